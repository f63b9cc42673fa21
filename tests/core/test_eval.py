"""Evaluation: perplexity and KL divergence against direct transformers computations on the same windows,
the bpw of a checkpoint against the reference engine's own figure, and the matplotlib plot."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from exl3_core.archkit import Model
from exl3_core.eval.kld import kl_divergence
from exl3_core.eval.plot import Point, model_bpw, render
from exl3_core.eval.ppl import make_windows, perplexity

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "exl3-golden"
CTX = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    tf = pytest.importorskip("transformers")
    from exl3_core.testing.arch import build_checkpoint

    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    d = tmp_path_factory.mktemp("eval") / "llama"
    hf = build_checkpoint("LlamaForCausalLM", cfg, d, seed=5)
    return d, hf


def _ids(n: int, vocab: int = 128, seed: int = 11) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_ppl_equals_transformers_nll(tiny: tuple[Path, torch.nn.Module]) -> None:
    d, hf = tiny
    ids = _ids(3 * CTX + 5)  # the 5-token tail does not fill a window and is dropped
    res = perplexity(Model.from_pretrained(d), ids, ctx=CTX)
    windows = ids[: 3 * CTX].view(3, CTX)
    with torch.no_grad():
        logits = hf(windows).logits.double()
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    assert res.windows == 3 and res.tokens == 3 * (CTX - 1)
    assert res.ppl == pytest.approx(math.exp(float(nll)), rel=1e-5)
    assert perplexity(Model.from_pretrained(d), ids, ctx=CTX, rows=1).windows == 1


def test_kld_against_transformers_and_self(tiny: tuple[Path, torch.nn.Module]) -> None:
    d, hf = tiny
    ids = _ids(2 * CTX, seed=12)
    model_bf16 = Model.from_pretrained(d, dtype=torch.bfloat16)
    model = Model.from_pretrained(d)
    self_kld = kl_divergence(model, model, ids, ctx=CTX)
    assert self_kld.kld == 0.0 and self_kld.top1 == 1.0 and self_kld.tokens == 2 * CTX

    res = kl_divergence(model_bf16, model, ids, ctx=CTX)
    w = ids.view(2, CTX)
    with torch.no_grad():
        ref = hf(w).logits.double()
        out = hf.to(torch.bfloat16)(w).logits.double()
    hf.float()
    want = F.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    assert res.kld > 0
    # exl3-bf16 vs exl3-fp32 and transformers-bf16 vs transformers-fp32 measure the same rounding error
    assert res.kld == pytest.approx(float(want), rel=0.5)


def test_eval_cli_ppl_matches_api(tiny: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    d, _ = tiny
    ids = _ids(2 * CTX, seed=13)
    save_file({"input_ids": ids}, str(tmp_path / "ids.safetensors"))
    out = subprocess.run([sys.executable, "-m", "exl3_core", "eval", "ppl", "-m", str(d), "--ids",
                          str(tmp_path / "ids.safetensors"), "--ctx", str(CTX), "--json"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ppl"] == pytest.approx(perplexity(Model.from_pretrained(d), ids, ctx=CTX).ppl, rel=1e-9)


def test_eval_cli_windows_of_text_begin_with_bos_where_the_tokenizer_adds_it(tmp_path: Path) -> None:
    """Text is cut into windows that begin as inputs do: the golden tokenizer adds BOS, so each window's first
    token is BOS (the prediction count is unchanged: a window's first token is never predicted)."""
    from exl3_core import Tokenizer
    from exl3_core.convert.calibration import builtin_text

    d = GOLDEN / "hf" / "model_c"
    text = builtin_text("eval")[:3000]
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "exl3_core", "eval", "ppl", "-m", str(d), "--text",
                          str(tmp_path / "t.txt"), "--ctx", str(CTX), "--rows", "3", "--json"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    ids = Tokenizer.from_directory(d).encode(text, add_bos=False)[0]
    w = make_windows(ids, CTX, 3).clone()
    w[:, 0] = 1  # the golden tokenizer's BOS
    model = Model.from_pretrained(d)
    assert got["ppl"] == pytest.approx(perplexity(model, w.reshape(-1), ctx=CTX).ppl, rel=1e-9)
    assert got["ppl"] != pytest.approx(perplexity(model, ids, ctx=CTX, rows=3).ppl, rel=1e-6)


def test_model_bpw_matches_reference_engine_figures() -> None:
    stats = json.loads((GOLDEN / "stats.json").read_text())["exl3_vs_hf_fp32"]
    for name in ("model_a_exl3_2.0bpw", "model_c_exl3_2.5bpw", "model_c_exl3_8.0bpw"):
        assert model_bpw(GOLDEN / "exl3" / name) == pytest.approx(stats[name]["bpw_layer"], abs=1e-9)
    assert model_bpw(GOLDEN / "hf" / "model_c") == 16.0  # bf16 weights


def test_plot_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    pts = [Point("a", 2.1, 30.0, 0.3), Point("b", 3.1, 21.0, 0.1), Point("c", 4.1, 20.0, 0.02)]
    path = render(pts, tmp_path / "p.png", reference_ppl=19.5)
    img = imread(path)
    assert path.read_bytes()[:4] == b"\x89PNG" and img.ndim == 3
    assert img.shape[1] > 1.8 * img.shape[0]  # two panels side by side (KLD values given)
    one = imread(render([Point(p.label, p.bpw, p.ppl) for p in pts], tmp_path / "q.png"))
    assert one.shape[1] < 1.5 * one.shape[0]  # perplexity only
    assert (img[..., :3] < 0.9).any()  # something was drawn on the white canvas


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"exl3-core\[plot\]"):
        render([Point("a", 2.0, 10.0)], tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


def test_make_windows() -> None:
    assert make_windows(torch.arange(10), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
