"""Writing the converted model directory (format spec 1.1, 1.6-1.8).

The per-stage tensor files in the work directory are streamed, in stage order, into sharded
safetensors (one stage = one module is never split across shards). ``config.json`` gets the
``quantization_config`` block, ``quantization_config.json`` adds the per-module
``tensor_storage`` map, and every other file of the source directory is copied, except its
weights, its index and its ``config.json``.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from exl3_core.loader import save_sharded
from exl3_core.loader.save import write_json_atomic as _write_json
from exl3_core.quant.exl3.quantize import tensor_storage_entry

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pth", ".pt")
SKIP_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
MIB = 1 << 20


def write_json_atomic(obj: Any, path: Path, indent: int = 4) -> None:
    """Config files as the reference engine writes them (indent 4, UTF-8 kept), atomically."""
    _write_json(obj, path, indent=indent, ensure_ascii=False)


def quantization_config(source_cfg: Mapping[str, Any], *, version: str, bits: float, head_bits: int,
                        cal_rows: int, cal_cols: int, out_scales: str, codebook: str) -> dict[str, Any]:
    """The ``quantization_config`` dict (spec 1.7)."""
    qc: dict[str, Any] = {
        "quant_method": "exl3",
        "version": version,
        "bits": round(bits, 2),
        "head_bits": head_bits,
        "calibration": {"rows": cal_rows, "cols": cal_cols},
        "out_scales": out_scales,
        "codebook": codebook,
    }
    orig = source_cfg.get("quantization_config")
    if isinstance(orig, Mapping) and orig.get("quant_method") != "exl3":
        qc["original_quantization_config"] = dict(orig)
    return qc


def output_config(source_cfg: Mapping[str, Any], qc: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json`` of the output: the source's, with ``quantization_config`` set (spec 1.1, 1.7)."""
    cfg = {k: v for k, v in source_cfg.items() if k != "quantization_config"}
    if "tied_word_embeddings" in cfg:
        cfg["tied_word_embeddings"] = True  # the reference writer's quirk (spec 1.1): kept for parity
    cfg["quantization_config"] = dict(qc)
    return cfg


def copy_other_files(src: Path, dst: Path) -> list[str]:
    """Copy every source file that is not a weight file, an index or ``config.json``; returns their names."""
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name in SKIP_FILES or p.name.endswith(WEIGHT_SUFFIXES):
            continue
        if p.name.endswith(".index.json") or p.name == "exl3_import.json":
            continue  # old weight indexes; the GGUF importer's marker belongs to the source folder only
        shutil.copyfile(p, dst / p.name)
        copied.append(p.name)
    return copied


def write_output(out_dir: Path, source_dir: Path, stage_files: Sequence[Path],
                 storage: Sequence[Sequence[tuple[str, list[str]]]], qc: Mapping[str, Any],
                 shard_mib: int) -> list[Path]:
    """Write the whole output directory.

    :param stage_files: one safetensors file per stage, in stage order.
    :param storage: per stage, ``[(leaf module key, [tensor names in order])]``.
    """
    from safetensors import safe_open

    out_dir.mkdir(parents=True, exist_ok=True)
    stage_of: dict[str, str] = {}
    for i, entries in enumerate(storage):
        for _, names in entries:
            for n in names:
                stage_of[n] = str(i)
    tensor_storage: dict[str, Any] = {}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for path, entries in zip(stage_files, storage, strict=True):
            with safe_open(str(path), "pt") as f:
                for leaf, names in entries:
                    ts = {n: f.get_tensor(n) for n in names}
                    tensor_storage[leaf] = tensor_storage_entry(ts)
                    yield from ts.items()

    files = save_sharded(tensors(), out_dir, shard_mib * MIB, group_key=stage_of.__getitem__)
    src_cfg = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
    write_json_atomic(output_config(src_cfg, qc), out_dir / "config.json")
    write_json_atomic({**qc, "tensor_storage": tensor_storage}, out_dir / "quantization_config.json")
    copy_other_files(source_dir, out_dir)
    return files
