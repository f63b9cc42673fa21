"""Reading and writing safetensors checkpoints.

* :class:`SafetensorsCollection`: lazy, validated, mmap-backed access to a model directory
  (single file, sharded with index, or loose ``*.safetensors``).
* :func:`load_tensors`: load a set of :class:`TensorRequest` onto a device, all or nothing.
* :func:`save_tensors` / :func:`save_sharded`: atomic writers in the EXL3 checkpoint layout.

Every failure is a :class:`LoaderError` naming the file, the tensor and the fix.
"""
from __future__ import annotations

from exl3_core.loader.format import LoaderError, TensorInfo, parse_header
from exl3_core.loader.load import TensorRequest, load_tensors
from exl3_core.loader.safetensors import INDEX_FILE, SINGLE_FILE, SafetensorsCollection
from exl3_core.loader.save import save_sharded, save_tensors, shard_name

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "LoaderError",
    "SafetensorsCollection",
    "TensorInfo",
    "TensorRequest",
    "load_tensors",
    "parse_header",
    "save_sharded",
    "save_tensors",
    "shard_name",
]
