"""EXL3 codec: codebooks, trellis bitstreams, Hadamard rotations, dequantization, linear layer."""

from __future__ import annotations

from exl3_core.quant.exl3.codebook import CB_3INST, CB_MCG, CB_MUL1, CODEBOOK_NAMES
from exl3_core.quant.exl3.dequant import (
    codebook_from_markers,
    codebook_from_tensors,
    marker_int32,
    reconstruct,
)
from exl3_core.quant.exl3.hadamard import can_build, get_hadamard, had_blockwise
from exl3_core.quant.exl3.linear import (
    EXL3Linear,
    exl3_matmul,
    exl3_matmul_reference,
    is_exl3_storage,
    padded,
    unpack_sign_bits,
)
from exl3_core.quant.exl3.trellis import (
    check_states,
    check_wrap,
    decode_inner,
    k_from_trellis,
    pack_trellis,
    place_tiles,
    tensor_core_perm,
    tensor_core_perm_inv,
    tiles_from_matrix,
    unpack_states,
)

__all__ = [
    "CB_3INST",
    "CB_MCG",
    "CB_MUL1",
    "CODEBOOK_NAMES",
    "EXL3Linear",
    "can_build",
    "check_states",
    "check_wrap",
    "codebook_from_markers",
    "codebook_from_tensors",
    "decode_inner",
    "exl3_matmul",
    "exl3_matmul_reference",
    "get_hadamard",
    "had_blockwise",
    "is_exl3_storage",
    "k_from_trellis",
    "marker_int32",
    "pack_trellis",
    "padded",
    "place_tiles",
    "reconstruct",
    "tensor_core_perm",
    "tensor_core_perm_inv",
    "tiles_from_matrix",
    "unpack_sign_bits",
    "unpack_states",
]
