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
    "CB_3INST", "CB_MCG", "CB_MUL1", "CODEBOOK_NAMES",
    "EXL3Linear", "exl3_matmul", "exl3_matmul_reference", "is_exl3_storage", "padded", "unpack_sign_bits",
    "codebook_from_markers", "codebook_from_tensors", "marker_int32", "reconstruct",
    "can_build", "get_hadamard", "had_blockwise",
    "check_states", "check_wrap", "decode_inner", "k_from_trellis", "pack_trellis", "place_tiles",
    "tensor_core_perm", "tensor_core_perm_inv", "tiles_from_matrix", "unpack_states",
]
