"""LoRA adapters (PEFT format) on exl3 models: loaded beside EXL3 or dense weights, several at once,
chosen per row of every step.

* :meth:`Model.load_lora` / :meth:`Model.unload_lora` / :meth:`Model.merge_lora` (:mod:`.registry`);
* per job ``Job(..., loras={"name": weight})``, per forward ``model.forward(ids, loras=...)``;
* the per-row delta (:mod:`.linear`, Triton kernels in :mod:`.kernels`), graph-capturable: the step's
  choice lives in device buffers (:mod:`.selection`);
* ``exl3 convert --lora DIR`` merges an adapter into the unquantized base before quantizing (:mod:`.merge`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from exl3_core.lazy import lazy_attributes, refs_of
from exl3_core.lora.config import AdapterConfig, LoraError, check_choice, read_config

if TYPE_CHECKING:
    from exl3_core.lora.peft_io import AdapterWeights, read_adapter
    from exl3_core.lora.registry import LoraSet, attached, lora_set

__getattr__ = lazy_attributes(__name__, {**refs_of("exl3_core.lora.peft_io", "AdapterWeights", "read_adapter"),
                                         **refs_of("exl3_core.lora.registry", "LoraSet", "attached", "lora_set")})

__all__ = ["AdapterConfig", "AdapterWeights", "LoraError", "LoraSet", "attached", "check_choice", "lora_set",
           "read_adapter", "read_config"]
