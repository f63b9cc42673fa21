"""exl3 plugin: attention backends (CUDA short-bound decode, CUDA quantized-cache split decode, Triton paged attention;
flash-attn/xformers adapters)."""
from __future__ import annotations

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import AttentionBackendSpec

EXL3_PLUGIN_API = (1, 0)


@hookimpl
def exl3_attention_backends() -> list[AttentionBackendSpec]:
    return [
        # its kernel is exl3-core's (csrc/attn/decode_attn.cu); it declines bounds and batches past its
        # shared-memory pass, which the dispatcher then gives to triton_paged
        AttentionBackendSpec(name="cuda_decode", impl="exl3_attn_backends.cuda_decode:CudaDecodeAttention",
                             requires=("triton",)),
        # also exl3-core's kernel (csrc/attn/decode_attn_qsplit.cu): 4/8-bit quantized caches past cuda_decode's bound
        AttentionBackendSpec(name="cuda_qsplit", impl="exl3_attn_backends.cuda_qsplit:CudaQuantSplitAttention"),
        AttentionBackendSpec(name="torch_sdpa", impl="exl3_attn_backends.dense:DenseCausalAttention"),
        AttentionBackendSpec(name="torch_sdpa_rows", impl="exl3_attn_backends.dense:DenseRowsAttention"),
        AttentionBackendSpec(name="triton_paged", impl="exl3_attn_backends.triton_paged:TritonPagedAttention",
                             requires=("triton",)),
        AttentionBackendSpec(name="flash_attn", impl="exl3_attn_backends.flash:FlashAttnBackend",
                             requires=("flash_attn",)),
        AttentionBackendSpec(name="xformers", impl="exl3_attn_backends.xformers_adapter:XFormersBackend",
                             requires=("xformers",)),
    ]
