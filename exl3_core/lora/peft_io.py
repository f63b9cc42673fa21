"""Reading a PEFT LoRA folder into checked per-module ``(A, B, scale)`` triples.

PEFT saves ``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]`` per adapted linear, under the
linear's module path prefixed by ``base_model.model.`` (transformers' own adapter saving leaves the
prefix out). exl3 linears carry their checkpoint key, which is that module path, so an adapter maps
onto a model by name; every tensor is checked (module exists and may carry an adapter, both halves
present, shapes against the linear and the config's rank, float dtype, finite values) before anything
is returned, and every error names the file and the tensor.
"""
from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from exl3_core.lora.config import LEGACY_WEIGHTS_FILE, WEIGHTS_FILE, AdapterConfig, LoraError, read_config

log = logging.getLogger(__name__)

PREFIXES = ("base_model.model.",)


@dataclass(frozen=True)
class LinearShape:
    """What the reader checks an adapted module against: the linear's true feature counts."""

    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModuleDelta:
    """One adapted linear: ``delta(x) = scale * (x Aᵀ) Bᵀ`` with ``A [r, in]``, ``B [out, r]`` (fp32, CPU)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def weight(self) -> torch.Tensor:
        """The dense ``[out, in]`` delta ``scale * B A`` (fp32), as PEFT merges it."""
        return (self.b @ self.a) * self.scale


@dataclass(frozen=True)
class AdapterWeights:
    """A read, checked adapter: its config, its weights file and its modules by linear key."""

    config: AdapterConfig
    file: Path
    modules: Mapping[str, ModuleDelta]

    @property
    def folder(self) -> Path:
        return self.file.parent


@dataclass(frozen=True)
class FusedParam:
    """A 3-D expert parameter that PEFT targets through ``target_parameters`` (transformers' fused expert
    tensors: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), which exl3 holds as per-expert linears.

    :param key: the parameter's path, e.g. ``model.layers.1.mlp.experts.gate_up_proj``.
    :param experts: per expert, the keys of the linears that hold the parameter's output rows, in order.
    :param in_features: the parameter's input width.
    :param out_splits: the output width of each linear of an expert's group.
    """

    key: str
    experts: tuple[tuple[str, ...], ...]
    in_features: int
    out_splits: tuple[int, ...]

    @property
    def module(self) -> str:
        return self.key.rpartition(".")[0]

    @property
    def param(self) -> str:
        return self.key.rpartition(".")[2]


def _split(name: str) -> tuple[str, str] | None:
    """``(module path, "A" | "B")`` of a PEFT tensor name (wrappers' ``.base_layer`` kept), or None when it is
    not a LoRA weight."""
    for p in PREFIXES:
        if name.startswith(p):
            name = name[len(p):]
            break
    parts = name.split(".")
    # "<module>.lora_A.weight", or with the adapter's name kept: "<module>.lora_A.<adapter>.weight"
    for n in (2, 3):
        if len(parts) > n and parts[-1] == "weight" and parts[-n] in ("lora_A", "lora_B"):
            return ".".join(parts[:-n]), parts[-n][-1]
    return None


def _unwrap(path: str) -> tuple[str, int]:
    """``(module, depth)``: PEFT nests one wrapper per targeted parameter of a module, each inner one
    reached through ``.base_layer``."""
    depth = 0
    while path.endswith(".base_layer"):
        path, depth = path[: -len(".base_layer")], depth + 1
    return path, depth


def _describe_unknown(key: str, linears: Mapping[str, LinearShape]) -> str:
    close = difflib.get_close_matches(key, list(linears), n=3, cutoff=0.75)
    return f" (closest linears: {', '.join(close)})" if close else ""


def read_adapter(folder: str | os.PathLike[str], linears: Mapping[str, LinearShape],
                 refusals: Mapping[str, str] | None = None, fused: Sequence[FusedParam] = (), *,
                 what: str = "this model") -> AdapterWeights:
    """Read and check the PEFT LoRA folder ``folder`` against ``linears`` (key -> shape).

    :param refusals: linear keys that cannot carry an adapter, with the reason.
    :param fused: fused expert parameters PEFT may target (their LoRA becomes per-expert linear deltas).
    :param what: how messages name the model (e.g. its directory).
    :raises LoraError: naming the file and tensor (missing files, a damaged safetensors file, a module the
        model does not have, shapes of another base model, ranks that contradict the config, non-float or
        non-finite values).
    """
    from exl3_core.loader import LoaderError, SafetensorsCollection

    root = Path(folder).expanduser()
    if not root.is_dir():
        raise LoraError(f"{root}: no such adapter folder (expected a PEFT LoRA folder with "
                        f"adapter_config.json and {WEIGHTS_FILE})")
    cfg = read_config(root)
    file = root / WEIGHTS_FILE
    if not file.is_file():
        if (root / LEGACY_WEIGHTS_FILE).is_file():
            raise LoraError(f"{root / LEGACY_WEIGHTS_FILE}: pickled adapter weights are not read (unsafe to "
                            f"unpickle); re-save the adapter with safe_serialization=True to get {WEIGHTS_FILE}")
        raise LoraError(f"{file}: not found; the adapter folder has adapter_config.json but no weights")
    refusals = refusals or {}
    base = f" (the adapter was made for {cfg.base_model})" if cfg.base_model else ""
    by_module: dict[str, list[FusedParam]] = {}
    for f in fused:
        by_module.setdefault(f.module, []).append(f)
    try:
        with SafetensorsCollection(file) as st:
            pairs: dict[str, dict[str, str]] = {}
            for name in st:
                split = _split(name)
                if split is None:
                    raise LoraError(f"{file}: tensor {name!r} is not a LoRA weight (expected "
                                    f"<module>.lora_A.weight / lora_B.weight); embedding LoRA, DoRA magnitudes and "
                                    f"saved modules are not supported")
                path, half = split
                if half in pairs.setdefault(path, {}):
                    raise LoraError(f"{file}: tensor {name!r} repeats lora_{half} of {path} (also "
                                    f"{pairs[path][half]!r})")
                pairs[path][half] = name
            if not pairs:
                raise LoraError(f"{file}: holds no LoRA tensors")
            modules: dict[str, ModuleDelta] = {}
            for path in sorted(pairs):
                names = pairs[path]
                first = next(iter(names.values()))
                for half in "AB":
                    if half not in names:
                        raise LoraError(f"{file}: {path} has lora_{'AB'.replace(half, '')} but no lora_{half} "
                                        f"tensor; the file is incomplete")
                module, depth = _unwrap(path)
                if module in by_module:
                    param = _fused_param(file, first, module, depth, by_module[module], cfg)
                    modules.update(_fused(st, file, names["A"], names["B"], param, linears, refusals, cfg, base))
                    continue
                key = path
                if key not in linears:
                    raise LoraError(f"{file}: tensor {first!r} targets module {key!r}, which is not a linear of "
                                    f"{what}{_describe_unknown(key, linears)}; the adapter belongs to another "
                                    f"base model{base}")
                if key in refusals:
                    raise LoraError(f"{file}: tensor {first!r} targets {key}, which cannot carry an adapter: "
                                    f"{refusals[key]}")
                if not cfg.targets(key):
                    raise LoraError(f"{file}: tensor {first!r} targets {key}, which target_modules "
                                    f"{cfg.target_modules!r} in {cfg.path} does not name; the config and the "
                                    f"weights do not belong together")
                a, b = _pair(st, file, names["A"], names["B"], cfg.rank_of(key), linears[key].in_features,
                             linears[key].out_features, key, cfg, base)
                modules[key] = ModuleDelta(a=a, b=b, scale=cfg.scale_of(key))
    except LoaderError as e:
        raise LoraError(f"{e} (LoRA adapter at {root})") from None
    unused = _unmatched_targets(cfg, linears)
    if unused:
        log.warning("%s: target_modules %s match no linear of %s", cfg.path, unused, what)
    return AdapterWeights(config=cfg, file=file, modules=modules)


def _fused_param(file: Path, first: str, module: str, depth: int, params: list[FusedParam],
                 cfg: AdapterConfig) -> FusedParam:
    """The parameter of ``module`` that the wrapper ``depth`` levels deep adapts: PEFT wraps the targeted
    parameters in their order on the module, the first innermost."""
    targeted = [p for p in params if cfg.targets_parameter(p.key)]
    if not targeted:
        raise LoraError(f"{file}: tensor {first!r} adapts a parameter of {module}, but target_parameters "
                        f"{cfg.target_parameters!r} in {cfg.path} names none of {[p.param for p in params]}")
    if depth >= len(targeted):
        raise LoraError(f"{file}: tensor {first!r} is {depth} wrappers deep in {module}, which has only "
                        f"{len(targeted)} targeted parameter(s) ({', '.join(p.param for p in targeted)})")
    return targeted[len(targeted) - 1 - depth]


def _fused(st: object, file: Path, name_a: str, name_b: str, p: FusedParam, linears: Mapping[str, LinearShape],
           refusals: Mapping[str, str], cfg: AdapterConfig, base: str) -> dict[str, ModuleDelta]:
    """Per-expert linear deltas of a LoRA on the fused parameter ``p``: PEFT stores ``A [r E, in]`` with expert
    ``e``'s rows at ``e r .. e r + r`` and ``B [out, r E]`` with expert ``e``'s column ``j`` at ``j E + e``."""
    E = len(p.experts)
    r = cfg.rank_of(p.key)
    a, b = _pair(st, file, name_a, name_b, r * E, p.in_features, sum(p.out_splits), p.key, cfg, base,
                 rank_note=f"rank {r} x {E} experts")
    scale = cfg.scale_of(p.key)
    b3 = b.view(b.shape[0], r, E)
    out: dict[str, ModuleDelta] = {}
    for e, keys in enumerate(p.experts):
        a_e = a[e * r:(e + 1) * r].contiguous()
        b_e = b3[:, :, e]
        row = 0
        for key, width in zip(keys, p.out_splits):
            if key in refusals:
                raise LoraError(f"{file}: tensor {name_a!r} adapts {key}, which cannot carry an adapter: {refusals[key]}")
            out[key] = ModuleDelta(a=a_e, b=b_e[row:row + width].contiguous(), scale=scale)
            row += width
    return out


def _pair(st: object, file: Path, name_a: str, name_b: str, r: int, n_in: int, n_out: int, key: str,
          cfg: AdapterConfig, base: str, rank_note: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [r, in], B [out, r])`` of ``key`` in fp32, checked."""
    from exl3_core.loader import SafetensorsCollection

    assert isinstance(st, SafetensorsCollection)
    expect = {name_a: (r, n_in), name_b: (n_out, r)}
    got: dict[str, torch.Tensor] = {}
    for name, want in expect.items():
        found = tuple(st.shape(name))
        if not st.dtype(name).is_floating_point:
            raise LoraError(f"{file}: tensor {name!r} is {st.dtype(name)}, not a float tensor; the file is damaged")
        if found != want:
            is_a = name == name_a
            rank_dim, size_dim = (0, 1) if is_a else (1, 0)
            if len(found) == 2 and found[size_dim] == (n_in if is_a else n_out) and found[rank_dim] != r:
                why = (f"its rank {found[rank_dim]} contradicts the config's ({rank_note or f'r = {r}'} for {key} "
                       f"in {cfg.path}); the config and the weights do not belong together")
            else:
                why = f"the adapter belongs to another base model{base}"
            raise LoraError(f"{file}: tensor {name!r} has shape {list(found)}, expected {list(want)} for {key} "
                            f"(in {n_in}, out {n_out}, {rank_note or f'rank {r}'}); {why}")
        t = st.get_tensor(name, dtype=torch.float32)
        if not bool(torch.isfinite(t).all()):
            raise LoraError(f"{file}: tensor {name!r} holds NaN or infinite values; the file is damaged")
        got[name] = t
    return got[name_a], got[name_b]


def _unmatched_targets(cfg: AdapterConfig, linears: Mapping[str, LinearShape]) -> list[str]:
    t = cfg.target_modules
    if t is None or isinstance(t, str):
        return []
    return [name for name in t if not any(k == name or k.endswith("." + name) for k in linears)]
