"""The two quality metrics of the golden comparison with ExLlamaV3 (docs/quality.md).

* ``golden``: mean KL(HF fp32 ‖ model) on the 128 positions of ``input_ids.safetensors`` (2 rows of
  64: BOS + a sentence, BOS + random ids), each row run alone: ``stats.json``'s metric.
* ``heldout``: the same quantity on 4096 held-out positions: 8 rows of BOS + 255 tokens of the built-in
  corpus's *evaluation* split (never calibrated on) and 8 rows of BOS + 255 random ids from a stream no
  calibration seed draws, each row run alone; ExLlamaV3's figure is its golden checkpoint read by
  exl3's loader (which reproduces ExLlamaV3's own logits to ~2e-3 relative).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from exl3_core.archkit import Model
from exl3_core.convert.calibration import builtin_text, load_tokenizer, text_windows, tokenize_text
from exl3_core.eval.kld import kl_per_token

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "exl3-golden"
STATS = json.loads((GOLDEN / "stats.json").read_text())["exl3_vs_hf_fp32"]
REFERENCE = {("model_a", 2.0): "model_a_exl3_2.0bpw", ("model_a", 3.0): "model_a_exl3_3.0bpw",
             ("model_a", 4.0): "model_a_exl3_4.0bpw", ("model_c", 2.5): "model_c_exl3_2.5bpw",
             ("model_c", 3.0): "model_c_exl3_3.0bpw_mul1", ("model_c", 5.0): "model_c_exl3_5.0bpw",
             ("model_c", 8.0): "model_c_exl3_8.0bpw"}
HELDOUT_ROWS, HELDOUT_COLS = 16, 256
HELDOUT_SEED = 0x5EED_E7A1  # random eval rows: a generator seed far from every calibration seed
BOS = 1


def _row_kl(model: Model, ids: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = torch.cat([model(ids[i: i + 1]) for i in range(ids.shape[0])])
    return kl_per_token(ref, logits)


def golden_kl(out: Path, model: str) -> tuple[float, float]:
    """Mean KL(HF fp32 ‖ out) and top-1 agreement, each golden row run alone (as stats.json was made)."""
    ids = load_file(GOLDEN / "input_ids.safetensors")["input_ids"]
    ref = load_file(GOLDEN / "logits" / f"{model}_hf_fp32_logits.safetensors")["logits"]
    m = Model.from_pretrained(out)
    with torch.no_grad():
        logits = torch.cat([m(ids[i: i + 1]) for i in range(ids.shape[0])])
    return float(kl_per_token(ref, logits).mean()), float((ref.argmax(-1) == logits.argmax(-1)).float().mean())


@functools.cache
def heldout_ids() -> torch.Tensor:
    """``[16, 256]`` int64: 8 rows of evaluation text, 8 of random ids, each after BOS."""
    tok = load_tokenizer(GOLDEN / "tokenizer")
    assert tok is not None
    n = HELDOUT_ROWS // 2
    text = text_windows(tokenize_text(tok, builtin_text("eval"), 1024), n, HELDOUT_COLS - 1)
    g = torch.Generator().manual_seed(HELDOUT_SEED)
    rand = torch.randint(0, 1024, (n, HELDOUT_COLS - 1), generator=g, dtype=torch.int64)
    body = torch.cat([text, rand])
    return torch.cat([torch.full((HELDOUT_ROWS, 1), BOS, dtype=torch.int64), body], dim=1)


@functools.cache
def heldout_reference(model: str) -> torch.Tensor:
    """The HF transformers fp32 logits of ``heldout_ids()`` (each row alone), the golden logits' recipe."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(GOLDEN / "hf" / model, dtype=torch.float32)
    hf.eval()
    ids = heldout_ids()
    with torch.no_grad():
        return torch.cat([hf(ids[i: i + 1]).logits.float() for i in range(ids.shape[0])])


def heldout_kl(out: Path, model: str) -> float:
    """Mean KL(HF fp32 ‖ out) over the 4096 held-out positions."""
    return float(_row_kl(Model.from_pretrained(out), heldout_ids(), heldout_reference(model)).mean())


@functools.cache
def reference_engine_kl(model: str, bpw: float) -> tuple[float | None, float | None]:
    """ExLlamaV3's (golden, held-out) KL at ``bpw``; None where it made no checkpoint."""
    name = REFERENCE.get((model, bpw))
    if name is None:
        return None, None
    return float(STATS[name]["mean_kl_hf_to_exl3"]), heldout_kl(GOLDEN / "exl3" / name, model)
