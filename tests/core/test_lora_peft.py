"""LoRA against transformers + PEFT (fp32, CPU): tiny random Llama, Qwen3 and Qwen3-MoE checkpoints from the
architecture plugins' test configs, random adapters on q/k/v/o and the MLP projections (PEFT puts the
Qwen3-MoE experts' on the fused expert tensors), ranks 1/8/64, rsLoRA on and off; weighted mixes; every row
of a batch with its own choice, through the full forward and through the engine's paged-cache steps."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.config import Config
from exl3_core.archkit.model import Model
from exl3_core.cache import Cache
from exl3_core.lora import lora_set
from exl3_core.plan import ExecutionPlan
from exl3_core.testing.arch import FP32_RTOL, build_checkpoint, rel_err, tiny_variants
from exl3_core.testing.lora import peft_adapter

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
SEQ = 20


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Model]]:
    """arch -> (checkpoint folder, HF config, loaded exl3 model)."""
    out = {}
    for arch in ARCHS:
        cfg = next(iter(tiny_variants(arch).values()))
        d = tmp_path_factory.mktemp(arch)
        build_checkpoint(arch, cfg, d, seed=3)
        out[arch] = (d, cfg, Model.from_config(Config.from_directory(d)).load())
    return out


def _hf(d: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()


def _ids(cfg: Any, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rslora", [False, True], ids=["alpha_over_r", "rslora"])
@pytest.mark.parametrize("rank", [1, 8, 64])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_peft(bases: dict, tmp_path: Path, arch: str, rank: int, rslora: bool) -> None:
    d, cfg, model = bases[arch]
    ids = _ids(cfg, seed=rank)
    pm = peft_adapter(_hf(d), tmp_path / "a", r=rank, alpha=2.0 * rank if rank > 1 else 16.0, rslora=rslora, seed=rank)
    with torch.no_grad():
        ref = pm(ids).logits
        with pm.disable_adapter():
            ref_base = pm(ids).logits
    assert rel_err(ref, ref_base) > 0.05, "the random adapter barely changes the logits: the test would be vacuous"
    model.load_lora(tmp_path / "a", name="a")
    try:
        assert rel_err(model.forward(ids, loras={"a": 1.0}), ref) < FP32_RTOL
        assert rel_err(model.forward(ids), ref_base) < FP32_RTOL  # no choice: the base model
    finally:
        model.unload_lora("a")
    assert not any(getattr(m, "adapters", ()) for m in model.modules()), "unload left an adapter on a linear"


@pytest.mark.parametrize("arch", ARCHS)
def test_weighted_mix_and_per_row_choice(bases: dict, tmp_path: Path, arch: str) -> None:
    """Two adapters with weights equal PEFT running both with its scalings multiplied by the weights; a batch
    whose rows choose differently gives each row what it gets alone."""
    d, cfg, model = bases[arch]
    ids = _ids(cfg, batch=3, seed=5)
    # PEFT's own adapter names: "ad1"/"ad2" (PEFT warns about names inside its "lora_" prefix)
    pm = peft_adapter(_hf(d), tmp_path / "a", r=8, seed=1, name="ad1")
    peft_adapter(None, tmp_path / "b", r=4, rslora=True, seed=2, name="ad2", base=pm)
    wa, wb = 0.5, -1.25
    with torch.no_grad():
        for m in pm.modules():
            # each adapter where PEFT put it (PEFT 0.22 leaves the second adapter off Qwen3-MoE's dense MLP)
            for name, w in (("ad1", wa), ("ad2", wb)):
                if isinstance(getattr(m, "scaling", None), dict) and name in m.scaling:
                    m.scaling[name] *= w
        pm.base_model.set_adapter(["ad1", "ad2"])
        ref = pm(ids).logits
    model.load_lora(tmp_path / "a", name="a")
    model.load_lora(tmp_path / "b", name="b")
    try:
        assert sorted(model.lora_names()) == ["a", "b"]
        mix = {"a": wa, "b": wb}
        assert rel_err(model.forward(ids, loras=mix), ref) < FP32_RTOL
        choices = [{"a": 1.0}, None, mix]
        batch = model.forward(ids, loras=choices)
        for i, c in enumerate(choices):
            alone = model.forward(ids[i:i + 1], loras=c)
            assert rel_err(batch[i:i + 1], alone) < 1e-5, f"row {i} ({c}) differs from its run alone"
        assert rel_err(batch[1:2], model.forward(ids[1:2])) < 1e-5
        assert rel_err(batch[0:1], model.forward(ids[0:1])) > 0.05, "row 0's adapter has no visible effect"
    finally:
        model.unload_lora("a")
        model.unload_lora("b")


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_steps_mix_adapters_per_sequence(bases: dict, tmp_path: Path, arch: str) -> None:
    """The execution plan over a paged cache (chunked prefill with logits for the last rows only, then decode
    steps): sequence 0 with adapter a, sequence 1 with b, each row equal to PEFT's full forward with its adapter."""
    d, cfg, model = bases[arch]
    ids = _ids(cfg, seed=9)
    refs = []
    for name, seed, r in (("a", 11, 8), ("b", 12, 16)):
        pm = peft_adapter(_hf(d), tmp_path / name, r=r, seed=seed)
        with torch.no_grad():
            refs.append(pm(ids).logits)
        model.load_lora(tmp_path / name, name=name)
    s = lora_set(model)
    slots = [s.slots_of({"a": 1.0}), s.slots_of({"b": 1.0})]
    plan = ExecutionPlan(model)
    page = 8
    cache = Cache(model, max_num_tokens=page * 8, page_size=page)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    done = [0, 0]
    worst = 0.0
    try:
        for step in ([7, 5], [9, 12], [1, 1], [1, 1], [1, 1]):
            new = [ids[b, done[b]:done[b] + step[b]].tolist() for b in range(2)]
            decode = step == [1, 1]
            last = None if decode else torch.tensor([step[0] - 1, step[0] + step[1] - 1])
            meta = BatchMeta.from_lists(new, done, page_table=table, page_size=page, logits_indices=last)
            s.select([(slots[0], step[0]), (slots[1], step[1])])
            logits = plan.forward(meta, cache)
            for b in range(2):  # one logits row per sequence: its last new token's
                worst = max(worst, rel_err(logits[b], refs[b][b, done[b] + step[b] - 1]))
            done = [done[b] + step[b] for b in range(2)]
    finally:
        s.selection.clear()
        model.unload_lora("a")
        model.unload_lora("b")
    assert worst < FP32_RTOL
