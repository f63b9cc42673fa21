"""Building blocks shared by architectures: linear, norm, embedding, RoPE, attention, MLP."""
from __future__ import annotations

from exl3_core.nn.attention import Attention
from exl3_core.nn.embedding import Embedding
from exl3_core.nn.linear import DenseLinear, LinearBase, make_linear
from exl3_core.nn.mlp import ACTIVATIONS, MLP, GatedMLP, activation
from exl3_core.nn.module import ForwardState, LoadContext, Module, TensorSource, WeightError
from exl3_core.nn.norm import RMSNorm, rms_norm
from exl3_core.nn.rope import RotaryEmbedding, apply_rotary, compute_inv_freq

__all__ = [
    "ACTIVATIONS", "MLP", "Attention", "DenseLinear", "Embedding", "ForwardState", "GatedMLP", "LinearBase",
    "LoadContext", "Module", "RMSNorm", "RotaryEmbedding", "TensorSource", "WeightError", "activation",
    "apply_rotary", "compute_inv_freq", "make_linear", "rms_norm",
]
