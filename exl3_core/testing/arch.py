"""Architecture conformance suite: exl3 against HF transformers on tiny random checkpoints.

For an ``ArchSpec`` with a ``test_config`` (``"module:fn"`` returning ``{variant: PretrainedConfig}``),
every variant is built with transformers under a fixed seed, given weights that make a sloppy
loader fail (norm weights ``1 + 0.25 N(0,1)``, random biases, unit-scale projections so attention
is far from uniform and RoPE errors show), saved with ``save_pretrained`` and then:

* loaded by exl3 in fp32 on CPU: full-sequence logits within ``FP32_RTOL`` of transformers
  (``max|Δ| / max|ref|``);
* run through ``forward_batch`` as a ragged two-sequence batch over a paged cache (chunked
  prefill, then decode steps), matching the same reference rows;
* loaded in bf16 and compared with transformers run in bf16, within ``BF16_RTOL`` (or, where the two
  bf16 runs disagree more, e.g. MoE routing flipped by rounding, no less accurate than transformers'
  bf16 run when both are measured against the fp32 reference);
* unloaded and reloaded; loading a copy with one tensor removed, and one with a tensor of the
  wrong shape, must fail naming that tensor and leave nothing loaded.

Usage in a plugin's tests::

    from exl3_core.testing.arch import arch_suite
    test_foo = arch_suite("FooForCausalLM")
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FP32_RTOL = 1e-4
BF16_RTOL = 2e-2
BF16_FALLBACK_SLACK = 1.5  # see _check_variant: only used when bf16 runs disagree beyond BF16_RTOL
SEQ_LEN = 48
SHORT_LEN = 37  # the second sequence of the ragged batch
PAGE_SIZE = 16
LINEAR_GAIN = 0.6  # projections: attention clearly non-uniform, yet bf16 rounding not amplified


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` in fp32."""
    out, ref = out.float(), ref.float()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def tiny_variants(hf_arch: str, plugins: Any = None) -> dict[str, Any]:
    """The ``{variant: PretrainedConfig}`` of an architecture's ``test_config`` (empty if none)."""
    from exl3_core.plugins import get_plugins

    plugins = plugins if plugins is not None else get_plugins()
    spec = plugins.arch(hf_arch)
    if spec.test_config is None:
        return {}
    fn = plugins.resolve(spec.test_config, what=f"test config of {hf_arch}")
    out = fn()
    if not isinstance(out, dict):  # a single config is allowed too
        out = {"default": out}
    return out


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give ``model`` weights that expose loader mistakes (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                if "norm" in name or name.endswith("layernorm.weight"):
                    p.copy_(1 + 0.25 * torch.randn(p.shape, generator=g))
                else:  # biases, router/correction vectors
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                std = 1.0 if "embed" in name else LINEAR_GAIN * p.shape[-1] ** -0.5
                p.copy_(std * torch.randn(p.shape, generator=g))


def build_checkpoint(hf_arch: str, cfg: Any, directory: Path, seed: int = 0) -> torch.nn.Module:
    """Create the tiny HF model for ``cfg`` (fp32, eval), save it to ``directory`` and return it."""
    from transformers import AutoModelForCausalLM

    cfg.architectures = [hf_arch]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    randomize_(model, seed)
    model.save_pretrained(directory)
    return model


def _tensor_names(directory: Path) -> list[str]:
    from exl3_core.loader import SafetensorsCollection

    with SafetensorsCollection(directory) as c:
        return sorted(c.keys())


def _rewrite_checkpoint(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Copy a checkpoint's json files and a single edited ``model.safetensors`` into ``dst``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    for f in src.glob("*.json"):
        if f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors", metadata={"format": "pt"})


def _assert_nothing_loaded(model: Any) -> None:
    assert not model.loaded, "a failed load left the model marked as loaded"
    for m in model.exl3_modules():
        for name, b in m.named_buffers(recurse=False):
            if name not in getattr(m, "static_buffers", ()):
                assert b is None, f"{type(m).__name__}.{name} is still allocated after a failed load or unload"
        for child in getattr(m, "_loaded_children", []):
            assert m._modules.get(child) is None, f"{type(m).__name__}.{child} is still allocated after a failed load or unload"


def check_load_errors(model_cls_factory: Callable[[Path], Any], directory: Path, workdir: Path) -> dict[str, str]:
    """A checkpoint missing one tensor, and one with a misshapen tensor, must fail naming it."""
    import pytest

    names = _tensor_names(directory)
    layered = [n for n in names if ".layers." in n and n.endswith(".weight")]
    # the last-loaded layer's tensor: everything before it is already on the device when it fails
    missing = max(layered or names, key=lambda n: (int(n.split(".layers.")[1].split(".")[0]) if ".layers." in n else -1, n))
    two_d = [n for n in layered if n != missing]
    misshapen = two_d[len(two_d) // 2] if two_d else names[0]
    messages = {}

    def drop(t: dict[str, torch.Tensor]) -> None:
        del t[missing]

    def grow(t: dict[str, torch.Tensor]) -> None:
        w = t[misshapen]
        t[misshapen] = torch.cat([w, w[:1]], dim=0)

    for label, edit, name in (("missing", drop, missing), ("misshapen", grow, misshapen)):
        d = workdir / f"broken_{label}"
        _rewrite_checkpoint(directory, d, edit)
        model = model_cls_factory(d)
        with pytest.raises(Exception) as info:
            model.load()
        msg = str(info.value)
        assert name in msg, f"loading a checkpoint with a {label} tensor {name!r} raised an error not naming it: {msg}"
        _assert_nothing_loaded(model)
        messages[label] = msg
    return messages


def _hf_stepped_logits(hf_model: Any, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits for ``ids`` fed one token at a time through its cache: the reference for dynamic NTK
    RoPE, whose tables transformers computes from each call's length (exl3 from each token's)."""
    import inspect

    from transformers import DynamicCache

    cache = DynamicCache()  # filled in place by each call
    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    out = [hf_model(ids[:, t:t + 1], use_cache=True, **{name: cache}).logits for t in range(ids.shape[1])]
    return torch.cat(out, 1).float()


def _cache_roundtrip(model: Any, ids: torch.Tensor, ref: torch.Tensor) -> float:
    """Ragged 2-sequence batch through a paged cache, as the engine runs it (the model's execution plan):
    chunked prefill, then decode. Max rel error."""
    from exl3_core.archkit.batch import BatchMeta
    from exl3_core.cache.cache import Cache
    from exl3_core.plan import ExecutionPlan

    plan = ExecutionPlan(model)

    lens = [SEQ_LEN, SHORT_LEN]
    cache = Cache(model, max_num_tokens=PAGE_SIZE * 12, page_size=PAGE_SIZE)
    # non-contiguous, interleaved pages so page-table indexing is exercised
    pages_per_seq = -(-SEQ_LEN // PAGE_SIZE)
    order = torch.randperm(cache.num_pages, generator=torch.Generator().manual_seed(1))[: 2 * pages_per_seq]
    page_table = order.view(2, pages_per_seq).to(torch.int32)
    toks = [ids[b, : lens[b]].tolist() for b in range(2)]
    done = [0, 0]
    worst = 0.0
    # two prefill chunks of different sizes per sequence, then one token per step
    schedule = [[20, 13], [SEQ_LEN - 24, SHORT_LEN - 16]] + [[1, 1]] * 4
    for step in schedule:
        new = [toks[b][done[b]: done[b] + step[b]] for b in range(2)]
        last = torch.tensor([len(new[0]) - 1, len(new[0]) + len(new[1]) - 1])
        rows_all = step == [1, 1]
        meta = BatchMeta.from_lists(new, done, page_table=page_table, page_size=PAGE_SIZE, device=ids.device,
                                    logits_indices=None if rows_all else last.to(ids.device))
        logits = plan.forward(meta, cache)
        expect = []
        for b in range(2):
            positions = range(done[b], done[b] + len(new[b])) if rows_all else [done[b] + len(new[b]) - 1]
            expect += [ref[b, p] for p in positions]
        worst = max(worst, rel_err(logits, torch.stack(expect)))
        done = [done[b] + len(new[b]) for b in range(2)]
    return worst


def check_variant(hf_arch: str, cfg: Any, workdir: Path, *, plugins: Any = None, seed: int = 0) -> dict[str, float]:
    """Run every check for one tiny config; returns the measured relative errors."""
    # Tiny matrices: one thread is faster, and far faster when other processes share the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _check_variant(hf_arch, cfg, workdir, plugins=plugins, seed=seed)
    finally:
        torch.set_num_threads(threads)


def _check_variant(hf_arch: str, cfg: Any, workdir: Path, *, plugins: Any, seed: int) -> dict[str, float]:
    from exl3_core.archkit import Config, Model

    directory = workdir / "ckpt"
    hf_model = build_checkpoint(hf_arch, cfg, directory, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ_LEN), generator=gen)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    with torch.no_grad():
        ref = _hf_stepped_logits(hf_model, ids) if rope.get("rope_type") == "dynamic" else hf_model(ids).logits.float()

    def make(d: Path) -> Any:
        return Model.from_config(Config.from_directory(d, plugins=plugins))

    model = make(directory)
    assert type(model).__name__ != "Model"
    results: dict[str, float] = {}
    with torch.no_grad():
        model.load(device="cpu", dtype=torch.float32)
        out = model(ids)
        assert out.dtype == torch.float32 and out.shape == ref.shape, f"logits {out.dtype} {list(out.shape)}"
        results["fp32"] = rel_err(out, ref)
        assert results["fp32"] <= FP32_RTOL, f"{hf_arch}: fp32 logits differ from transformers by {results['fp32']:.3g}"
        from exl3_core.archkit.batch import BatchMeta
        from exl3_core.plan import ExecutionPlan

        planned = ExecutionPlan(model).forward(BatchMeta.full(ids)).view(ref.shape)
        results["plan"] = rel_err(planned, ref)
        assert results["plan"] <= FP32_RTOL, f"{hf_arch}: the execution plan's logits differ by {results['plan']:.3g}"

        results["cache"] = _cache_roundtrip(model, ids, ref)
        assert results["cache"] <= FP32_RTOL, f"{hf_arch}: paged-cache logits differ by {results['cache']:.3g}"

        model.unload()
        assert not model.loaded
        _assert_nothing_loaded(model)

        model.load(device="cpu", dtype=torch.bfloat16)
        out_bf16 = model(ids)
        ref_bf16 = hf_model.to(torch.bfloat16)(ids).logits.float()
        results["bf16"] = rel_err(out_bf16, ref_bf16)
        if results["bf16"] > BF16_RTOL:
            # Discrete choices (MoE top-k routing) can flip under bf16 rounding, so two correct bf16
            # implementations may disagree. Then exl3 must be no less accurate than transformers in
            # bf16, both measured against the fp32 reference.
            results["bf16_vs_fp32"] = rel_err(out_bf16, ref)
            results["hf_bf16_vs_fp32"] = rel_err(ref_bf16, ref)
            bound = BF16_FALLBACK_SLACK * max(BF16_RTOL, results["hf_bf16_vs_fp32"])
            assert results["bf16_vs_fp32"] <= bound, (
                f"{hf_arch}: bf16 logits differ from transformers-bf16 by {results['bf16']:.3g} and from the fp32 "
                f"reference by {results['bf16_vs_fp32']:.3g} (transformers-bf16: {results['hf_bf16_vs_fp32']:.3g})")
        model.unload()

    check_load_errors(make, directory, workdir)
    return results


def arch_suite(hf_arch: str, *, plugins: Any = None) -> Callable[..., None]:
    """A pytest test function, parametrized over the architecture's tiny variants.

    :param hf_arch: HF ``architectures[0]`` string registered by a plugin.
    :param plugins: plugin set (default: the process-wide one).
    """
    import pytest

    variants = tiny_variants(hf_arch, plugins)
    if not variants:
        raise ValueError(f"{hf_arch}: its ArchSpec has no test_config; add one (module:fn returning tiny configs)")

    @pytest.mark.parametrize("variant", sorted(variants))
    def test_arch_conformance(variant: str, tmp_path: Path) -> None:
        pytest.importorskip("transformers")
        cfg = tiny_variants(hf_arch, plugins)[variant]  # fresh config: build_checkpoint mutates it
        results = check_variant(hf_arch, cfg, tmp_path, plugins=plugins)
        print(f"{hf_arch}[{variant}]: " + ", ".join(f"{k} rel err {v:.2e}" for k, v in results.items()))

    test_arch_conformance.__name__ = f"test_{hf_arch}"
    return test_arch_conformance


#: a top-2 logit gap below this is a near-tie: rounding that differs between kernel paths (batch sizes, graph
#: buckets, verification rows) may break it either way on fp16/bf16 models
NEAR_TIE = 0.1


def parted_only_at_near_tie(want: list[int], got: list[int], want_logits: torch.Tensor, *,
                            got_logits: torch.Tensor | None = None, near_tie: float = NEAR_TIE) -> str | None:
    """None when ``got`` equals ``want`` or first parts from it where parting is allowed; else why not.

    Greedy decoding is discontinuous at near-ties: once two runs of one job part there, each goes on from
    different text. ``want_logits [steps, vocab]`` are the reference run's logits per generated token. A greedy
    parting (``got_logits`` None) is allowed where the reference's two best logits are within ``near_tie``; a
    sampled one (``got_logits`` given) where both runs' distributions at that step agree (relative error under
    2e-2), so only the draw fell on the other side of a boundary."""
    n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if n is None:
        return None if len(want) == len(got) else f"lengths differ: {len(want)} against {len(got)}"
    if n >= want_logits.shape[0]:
        return f"parted at token {n}, past the {want_logits.shape[0]} reference logits"
    if got_logits is not None:
        err = rel_err(got_logits[n].float(), want_logits[n].float())
        return None if err < 2e-2 else f"parted at token {n} with distributions {err:.3g} apart (relative)"
    top = want_logits[n].float().topk(2).values
    gap = float(top[0] - top[1])
    return None if gap < near_tie else f"parted at token {n} where the reference's top-2 gap is {gap:.3f}"
