"""A tiny self-contained decoder and byte tokenizer implementing the interfaces the generator uses.

They exist so the generator, cache and samplers can be tested (by exl3 and by plugin authors)
without model files: :class:`ToyModel` is a :class:`~exl3_core.generator.types.BatchModel`
(``forward_batch``, ``cache_geometry``, ``device``, ``dtype``) with ``config.eos_token_ids()`` and
``vocab_size``; :class:`ByteTokenizer` has
``encode``, ``decode``, ``get_vocab_bytes`` and ``eos_token_ids``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.attention.spec import AttnArgs, AttnSpec
from exl3_core.cache.geometry import LayerGeometry
from exl3_core.cache.layer import CacheLayers
from exl3_core.reference.attention import attention


@dataclass
class _ToyConfig:
    eos: list[int] = field(default_factory=list)

    def eos_token_ids(self) -> list[int]:
        return list(self.eos)


class _ToyAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.head_dim_v = head_dim


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1] // 2
    inv = theta ** (-torch.arange(d, device=x.device, dtype=torch.float64) / d)
    ang = (pos.double()[:, None] * inv[None, :]).to(x.dtype)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class ToyModel:
    """Pre-norm decoder with rotary attention (GQA), a ReLU MLP and untied embeddings."""

    def __init__(self, vocab_size: int = 256, hidden: int = 32, num_layers: int = 2, num_heads: int = 4,
                 num_kv_heads: int = 2, head_dim: int = 8, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", eos_token_ids: list[int] | None = None, scale: float = 1.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.hidden = vocab_size, hidden
        self.device, self.dtype = torch.device(device), dtype
        self.config = _ToyConfig(list(eos_token_ids or []))
        self._attn = [_ToyAttention(num_heads, num_kv_heads, head_dim) for _ in range(num_layers)]

        def w(*shape: int, s: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * s / math.sqrt(shape[0])).to(device, dtype)

        self.emb = w(vocab_size, hidden, s=math.sqrt(vocab_size))
        self.layers = [{"wq": w(hidden, num_heads * head_dim), "wk": w(hidden, num_kv_heads * head_dim),
                            "wv": w(hidden, num_kv_heads * head_dim), "wo": w(num_heads * head_dim, hidden),
                            "w1": w(hidden, 4 * hidden), "w2": w(4 * hidden, hidden)} for _ in range(num_layers)]
        self.head = w(hidden, vocab_size, s=scale * 4.0)
        self.forward_calls = 0
        self.tokens_computed = 0
        self.loaded = True  # built with its weights: a Cache for it allocates at once

    def cache_geometry(self) -> tuple[LayerGeometry, ...]:
        return tuple(LayerGeometry("kv", a.num_kv_heads, a.head_dim, a.head_dim_v) for a in self._attn)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward_batch(self, meta: BatchMeta, cache: CacheLayers | None = None, *,
                      fp32_logits: bool = True) -> torch.Tensor:
        self.forward_calls += 1
        self.tokens_computed += int(meta.input_ids.shape[0])
        x = self.emb[meta.input_ids]
        T = x.shape[0]
        for i, (p, a) in enumerate(zip(self.layers, self._attn)):
            h = self._norm(x)
            q = _rope((h @ p["wq"]).view(T, a.num_heads, a.head_dim), meta.positions)
            k = _rope((h @ p["wk"]).view(T, a.num_kv_heads, a.head_dim), meta.positions)
            v = (h @ p["wv"]).view(T, a.num_kv_heads, a.head_dim)
            common = {"q": q, "cu_seqlens_q": meta.cu_seqlens_q, "seq_lens_k": meta.seq_lens_k,
                          "max_seqlen_q": meta.max_seqlen_q, "max_seqlen_k": meta.max_seqlen_k,
                          "scale": 1.0 / math.sqrt(a.head_dim)}
            if cache is None:
                spec = AttnSpec(a.head_dim, a.num_heads, a.num_kv_heads, self.dtype)
                o = attention(AttnArgs(spec=spec, k=k, v=v, **common))
            else:
                layer = cache.layers[i]
                layer.write(k, v, meta.slot_mapping)
                kc, vc = layer.attn_tensors()
                spec = AttnSpec(a.head_dim, a.num_heads, a.num_kv_heads, self.dtype, cache=layer.views()[0],
                                phase=meta.phase)
                o = attention(AttnArgs(spec=spec, k_cache=kc, v_cache=vc, page_table=meta.page_table, **common))
            x = x + o.reshape(T, -1) @ p["wo"]
            x = x + torch.relu(self._norm(x) @ p["w1"]) @ p["w2"]
        if meta.logits_indices is not None:
            x = x[meta.logits_indices]
        logits = self._norm(x) @ self.head
        return logits.float() if fp32_logits else logits


class ByteTokenizer:
    """Ids 0..255 are bytes; a few multi-byte ids follow (so tokens can split UTF-8 characters and
    stop strings can span tokens); the last id is EOS."""

    EXTRA: ClassVar[tuple[bytes, ...]] = (b"hello", b" world", b"\xc3", b"\xa9t\xc3\xa9", b"\xe2\x82\xac", b"ab", b"ba")

    def __init__(self, vocab_size: int = 256 + 8) -> None:
        self.pieces = [bytes([i]) for i in range(256)] + list(self.EXTRA)
        self.pieces = (self.pieces + [b""] * vocab_size)[:vocab_size]
        self.eos_token_id = vocab_size - 1
        self.pieces[self.eos_token_id] = b""
        self.eos_token_ids = [self.eos_token_id]

    def get_vocab_bytes(self) -> list[bytes]:
        return list(self.pieces)

    def encode(self, text: str, add_bos: bool | None = None, encode_special_tokens: bool = True) -> torch.Tensor:
        """UTF-8 bytes of ``text`` (there are no special tokens to encode); ``ValueError`` for text
        that is not valid Unicode."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text is not valid Unicode ({e.reason} at character {e.start}); send well-formed "
                             f"text") from None
        return torch.tensor([list(data)], dtype=torch.int64)

    def decode(self, ids: Any) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")
