"""Test aids for tensor parallelism: EXL3 checkpoints of tiny architectures, and a source that makes one rank
fail to allocate.

* :func:`exl3_checkpoint` stores a dense checkpoint's projections as EXL3 (random trellis words, which are
  valid EXL3 streams, with random sign scales, like ``exl3 bench``'s models): an EXL3 model of the same
  architecture whose linears take the EXL3 paths, including their 128-feature cuts.
* :class:`RankFailingSource` reads a checkpoint directory, except that on one rank of a tensor-parallel load
  reading a chosen tensor fails as an allocation that does not fit would; it is picklable, so it travels
  to the worker processes.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from exl3_core.parallel.worker import worker_rank

#: the ``mcg`` codebook's marker value (format spec 1.3)
MCG_MARKER = 0xCBAC1FED - (1 << 32)


def _padded(n: int) -> int:
    return -(-n // 128) * 128


def exl3_tensors(key: str, in_features: int, out_features: int, bits: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """EXL3 storage for one linear (``mcg`` codebook): random trellis words, ±scale vectors whose product keeps
    activations of order one."""
    k, n = _padded(in_features), _padded(out_features)
    scale = in_features ** -0.25

    def sign(size: int) -> torch.Tensor:
        return ((torch.randint(0, 2, (size,), generator=g) * 2 - 1) * scale).to(torch.float16)

    return {f"{key}.trellis": torch.randint(-32768, 32768, (k // 16, n // 16, 16 * bits), generator=g,
                                            dtype=torch.int32).to(torch.int16),
            f"{key}.suh": sign(k), f"{key}.svh": sign(n), f"{key}.mcg": torch.tensor(MCG_MARKER, dtype=torch.int32)}


def exl3_checkpoint(src: Path, dst: Path, *, keep_dense: Callable[[str], bool], bits: int = 4, seed: int = 0) -> Path:
    """Copy the checkpoint at ``src`` to ``dst`` with every 2-D ``*.weight`` stored as EXL3 (biases kept), except
    those ``keep_dense(name)`` keeps (embeddings, routers ...). Returns ``dst``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    for f in src.glob("*.json"):
        if f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        t = tensors[name]
        if t.dim() == 2 and name.endswith(".weight") and not keep_dense(name):
            out.update(exl3_tensors(name[: -len(".weight")], t.shape[1], t.shape[0], bits, g))
        else:
            out[name] = t.contiguous()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


class RankFailingSource:
    """The safetensors of ``directory``; on tensor-parallel rank ``rank``, reading ``tensor`` raises
    :class:`torch.OutOfMemoryError`, as a device whose share does not fit does."""

    def __init__(self, directory: Path, rank: int, tensor: str) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.tensor = tensor
        self._inner: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "rank": self.rank, "tensor": self.tensor, "_inner": None}

    @property
    def inner(self) -> Any:
        if self._inner is None:
            from exl3_core.loader import SafetensorsCollection

            self._inner = SafetensorsCollection(self.directory)
        return self._inner

    def __contains__(self, name: object) -> bool:
        return name in self.inner

    def keys(self) -> list[str]:
        return list(self.inner.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.inner.shape(name))

    def dtype(self, name: str) -> torch.dtype:
        return self.inner.dtype(name)  # type: ignore[no-any-return]

    def get_tensor(self, name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   expect_shape: Collection[int | None] | None = None) -> torch.Tensor:
        if name == self.tensor and worker_rank() == self.rank and torch.device(device).type != "meta":
            raise torch.OutOfMemoryError(f"could not allocate {name} ({list(self.shape(name))}) on {device}: out of "
                                         f"memory")
        return self.inner.get_tensor(name, device=device, dtype=dtype, expect_shape=expect_shape)  # type: ignore[no-any-return]
