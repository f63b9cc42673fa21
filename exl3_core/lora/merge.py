"""Merging a LoRA adapter into an unquantized Hugging Face checkpoint, for ``exl3 convert --lora``.

EXL3 weights are a trellis code: an adapter cannot be folded into them, only quantized together with
the base. :func:`merge_checkpoint` writes a copy of the base folder whose adapted linears hold
``W + weight * scale * B A`` (fp32 math, stored in each tensor's own dtype); every other file is copied
as it is. The adapter is checked against the checkpoint's own tensors (names and shapes) with the
same reader the model uses, so the same errors name the same files and tensors.

Expert weights are found in both layouts transformers uses: per expert (``experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj``, or ``w1``/``w3``/``w2``) and fused 3-D (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``); PEFT's LoRA on the fused parameters (``target_parameters``) merges into
either.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from exl3_core.lora.config import LoraError
from exl3_core.lora.peft_io import AdapterWeights, FusedParam, LinearShape, ModuleDelta, read_adapter

MARKER = "lora_merge.json"
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.weight$")
#: per-expert projection names: (gate, up, down)
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_SLICE = re.compile(r"^(?P<tensor>.+)\[(?P<e>\d+)\](?:\.(?P<part>gate|up))?$")


def _targets(shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, LinearShape], list[FusedParam]]:
    """The checkpoint's linears (2-D ``<key>.weight``) and fused expert parameters, from tensor shapes alone."""
    linears = {n[: -len(".weight")]: LinearShape(s[1], s[0]) for n, s in shapes.items()
               if n.endswith(".weight") and len(s) == 2}
    fused: list[FusedParam] = []
    experts: dict[str, dict[int, set[str]]] = {}
    for n in shapes:
        m = _EXPERT.match(n)
        if m:
            experts.setdefault(m["prefix"], {}).setdefault(int(m["e"]), set()).add(m["proj"])
    for prefix, per in experts.items():
        count = max(per) + 1
        for gate, up, down in _EXPERT_NAMES:
            if all({gate, up, down} <= per.get(e, set()) for e in range(count)):
                g0 = linears[f"{prefix}.0.{gate}"]
                d0 = linears[f"{prefix}.0.{down}"]
                fused.append(FusedParam(f"{prefix}.gate_up_proj",
                                        tuple((f"{prefix}.{e}.{gate}", f"{prefix}.{e}.{up}") for e in range(count)),
                                        g0.in_features, (g0.out_features, g0.out_features)))
                fused.append(FusedParam(f"{prefix}.down_proj", tuple((f"{prefix}.{e}.{down}",) for e in range(count)),
                                        d0.in_features, (d0.out_features,)))
                break
    # fused 3-D experts, in the order transformers defines them (PEFT nests its wrappers in that order)
    for n, s in sorted(shapes.items(), key=lambda t: not t[0].endswith(".gate_up_proj")):
        if n.endswith(".experts.gate_up_proj") and len(s) == 3:
            E, two_i, h = s
            fused.append(FusedParam(n, tuple((f"{n}[{e}].gate", f"{n}[{e}].up") for e in range(E)), h,
                                    (two_i // 2, two_i // 2)))
            for e in range(E):
                linears[f"{n}[{e}].gate"] = linears[f"{n}[{e}].up"] = LinearShape(h, two_i // 2)
        elif n.endswith(".experts.down_proj") and len(s) == 3:
            E, h, i = s
            fused.append(FusedParam(n, tuple((f"{n}[{e}]",) for e in range(E)), i, (h,)))
            for e in range(E):
                linears[f"{n}[{e}]"] = LinearShape(i, h)
    return linears, fused


def read_for_checkpoint(base: str | os.PathLike[str], adapter: str | os.PathLike[str]) -> AdapterWeights:
    """Read ``adapter`` checked against the unquantized checkpoint in ``base``.

    :raises LoraError: naming the file and tensor (see :func:`~exl3_core.lora.peft_io.read_adapter`)."""
    from exl3_core.loader import LoaderError, SafetensorsCollection

    try:
        with SafetensorsCollection(base) as st:
            shapes = {n: tuple(st.shape(n)) for n in st}
    except LoaderError as e:
        raise LoraError(f"{e} (the base model for the LoRA merge)") from None
    linears, fused = _targets(shapes)
    return read_adapter(adapter, linears, {}, fused, what=f"the checkpoint at {base}")


def _apply(t: torch.Tensor, d: ModuleDelta, weight: float) -> torch.Tensor:
    return (t.float() + d.weight() * weight).to(t.dtype)


def merged_tensors(tensors: dict[str, torch.Tensor], deltas: Mapping[str, ModuleDelta], weight: float) -> int:
    """Add the deltas whose tensors are in ``tensors`` (one file's), in place; returns how many were applied."""
    done = 0
    for key, d in deltas.items():
        name = f"{key}.weight"
        if name in tensors:
            tensors[name] = _apply(tensors[name], d, weight)
            done += 1
            continue
        m = _SLICE.match(key)
        if m and m["tensor"] in tensors:
            t, e = tensors[m["tensor"]], int(m["e"])
            if m["part"] is None:
                t[e] = _apply(t[e], d, weight)
            else:
                half = t.shape[1] // 2
                rows = slice(0, half) if m["part"] == "gate" else slice(half, None)
                t[e, rows] = _apply(t[e, rows], d, weight)
            done += 1
    return done


def _fingerprint(folder: Path) -> list[tuple[str, int, int]]:
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())


def merge_checkpoint(base: str | os.PathLike[str], adapters: Sequence[tuple[str | os.PathLike[str], float]],
                     out: str | os.PathLike[str], *, report: Callable[[str], None] | None = None) -> Path:
    """Write ``base`` with every ``(adapter folder, weight)`` of ``adapters`` merged into ``out`` and return ``out``.
    A folder already there that was merged from the same base and adapter files is reused (a resumed conversion
    reads the same files); anything else there is refused rather than overwritten.

    :raises LoraError: for an adapter that does not fit the base (nothing is written then), or an ``out`` that
        holds something else.
    """
    from exl3_core.loader import SafetensorsCollection
    from exl3_core.loader.save import save_tensors

    src, dst = Path(base).expanduser(), Path(out).expanduser()
    folders = [(Path(a).expanduser(), float(w)) for a, w in adapters]
    if not folders:
        raise LoraError("merge_checkpoint: no adapter to merge")
    stamp = {"base": str(src.resolve()),
             "adapters": [[str(a.resolve()), w, _fingerprint(a) if a.is_dir() else []] for a, w in folders]}
    marker = dst / MARKER
    if dst.exists():
        if marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(stamp)):
            return dst
        if any(dst.iterdir()):
            raise LoraError(f"{dst}: exists and is not this merge of {src} (its {MARKER} differs or is missing); "
                            f"remove it or choose another output")
    read = [(read_for_checkpoint(src, a), w) for a, w in folders]  # all checked before anything is written
    say = report or (lambda s: None)
    tmp = dst.with_name(dst.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    applied = [0] * len(read)
    with SafetensorsCollection(src) as st:
        for f in st.files:
            tensors = {n: st.get_tensor(n) for n in st if st.file_of(n) == f}
            for i, (weights, w) in enumerate(read):
                applied[i] += merged_tensors(tensors, weights.modules, w)
            save_tensors(tensors, tmp / f.name, metadata=st.metadata(f))
            say(f"merged {f.name}")
    for (weights, _), n in zip(read, applied):
        if n != len(weights.modules):
            shutil.rmtree(tmp)
            raise LoraError(f"{weights.file}: {len(weights.modules) - n} adapted tensor(s) were not found in the files "
                            f"of {src}")
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors":
            shutil.copy2(p, tmp / p.name)
    (tmp / MARKER).write_text(json.dumps(stamp, indent=1))
    if dst.exists():
        dst.rmdir()
    tmp.rename(dst)
    say(f"LoRA {', '.join(str(a) for a, _ in folders)} merged into {src} -> {dst}")
    return dst


def merged_source(base: str, specs: Sequence[str], output: str) -> str:
    """``exl3 convert --lora``: the folder to quantize, ``<OUTPUT>.lora-base`` holding ``base`` with the adapters
    ``specs`` (``DIR`` or ``DIR:WEIGHT``) merged (reused when a resumed conversion finds it made from the same files)."""
    import argparse
    import sys

    from exl3_core.lora.cli import parse_spec

    try:
        adapters = [parse_spec(s) for s in specs]
    except argparse.ArgumentTypeError as e:
        raise LoraError(str(e)) from None
    out = Path(output).expanduser()
    dst = out.with_name(out.name + ".lora-base")
    return str(merge_checkpoint(base, adapters, dst, report=lambda s: print(s, file=sys.stderr, flush=True)))
