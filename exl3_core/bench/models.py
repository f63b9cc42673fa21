"""Random-weight EXL3 models of a given shape, built straight on the target device.

Random trellis words are valid EXL3 streams (every 16-bit window decodes to some codebook
value), so a model whose every linear layer holds random words and random ±scale vectors runs
exactly the kernels and moves exactly the bytes a converted checkpoint would. The tensors come
from :class:`RandomSource`, an in-memory :class:`~exl3_core.nn.module.TensorSource` that creates
each tensor on the device when the loader asks for it: nothing is written to disk.
"""
from __future__ import annotations

import json
import re
import sys
import zlib
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from exl3_core.plugins import hookimpl
from exl3_core.plugins.specs import ArchSpec

EXL3_PLUGIN_API = (1, 0)
#: ``architectures[0]`` of the bench configs; served by the core's standard decoder
BENCH_ARCH = "Exl3BenchDecoder"
CODEBOOKS = {"3inst": 0, "mcg": 1, "mul1": 2}
#: the linears whose outputs are added to the residual stream
_RESIDUAL_WRITERS = ("o_proj", "down_proj")
#: their output scale in a self-predicting model: the embedding, not the layers, decides the next token
RESIDUAL_DAMPING = 1 / 256
_MARKERS = {1: ("mcg", 0xCBAC1FED), 2: ("mul1", 0x83DCD12D)}  # spec 1.3 locked multipliers


@hookimpl
def exl3_architectures() -> list[ArchSpec]:
    return [ArchSpec(hf_arch=BENCH_ARCH, model="exl3_core.archkit.decoder:StandardDecoder")]


@dataclass(frozen=True)
class BenchShape:
    """Decoder dimensions (head_dim defaults to hidden / heads)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int | None = None
    name: str = "custom"

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict for this shape (architecture-neutral keys)."""
        extra = _shape_table()["transformers"]
        return {
            "architectures": [BENCH_ARCH], "vocab_size": self.vocab, "hidden_size": self.hidden,
            "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.dim_head,
            "rms_norm_eps": extra.get("rms_norm_eps", 1e-5), "rope_theta": extra.get("rope_theta", 10000.0),
            "hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 131072,
        }

    def linears(self) -> list[tuple[str, int, int]]:
        """``(key, in, out)`` of every quantized linear of one layer (``{i}`` = layer index)."""
        h, i, d = self.hidden, self.intermediate, self.dim_head
        p = "model.layers.{i}"
        return [(f"{p}.self_attn.q_proj", h, self.heads * d), (f"{p}.self_attn.k_proj", h, self.kv_heads * d),
                (f"{p}.self_attn.v_proj", h, self.kv_heads * d), (f"{p}.self_attn.o_proj", self.heads * d, h),
                (f"{p}.mlp.gate_proj", h, i), (f"{p}.mlp.up_proj", h, i), (f"{p}.mlp.down_proj", i, h)]


def _shape_table() -> dict[str, Any]:
    text = resources.files("exl3_core").joinpath("data/bench_shapes.json").read_text(encoding="utf-8")
    return json.loads(text)  # type: ignore[no-any-return]


def named_shapes() -> dict[str, BenchShape]:
    """Every named shape and alias of ``exl3_core/data/bench_shapes.json``."""
    out: dict[str, BenchShape] = {}
    for name, d in _shape_table()["shapes"].items():
        d = dict(d)
        aliases = d.pop("aliases", [])
        shape = BenchShape(**d, name=name)
        for n in [name, *aliases]:
            out[n.lower()] = shape
    return out


def parse_shape(text: str) -> BenchShape:
    """A named shape, or ``custom(hidden,intermediate,layers,heads,kv_heads,vocab[,head_dim])``."""
    named = named_shapes()
    t = text.strip().lower()
    if t in named:
        return named[t]
    m = re.fullmatch(r"(?:custom)?\(?\s*([\d\s,]+?)\s*\)?", t)
    nums = [int(x) for x in m.group(1).split(",") if x.strip()] if m else []
    if len(nums) not in (6, 7):
        raise ValueError(f"--shape {text!r}: expected one of {sorted(named)} or "
                         f"custom(hidden,intermediate,layers,heads,kv_heads,vocab[,head_dim])")
    shape = BenchShape(*nums)  # type: ignore[arg-type]
    if shape.heads % shape.kv_heads or (shape.head_dim is None and shape.hidden % shape.heads):
        raise ValueError(f"--shape {text!r}: heads must be a multiple of kv_heads and divide hidden "
                         f"(or give head_dim)")
    return shape


def _padded(n: int) -> int:
    return -(-n // 128) * 128


def layer_bits(bpw: float, layers: int) -> list[int]:
    """Integer K per layer averaging ``bpw`` (K in 1..8): fractional rates alternate floor/ceil."""
    if not 1.0 <= bpw <= 8.0:
        raise ValueError(f"--bpw {bpw}: EXL3 stores 1 to 8 bits per weight")
    return [int(bpw * (i + 1) + 1e-9) - int(bpw * i + 1e-9) for i in range(layers)]


class RandomSource:
    """In-memory tensor source for a random EXL3 model of ``shape`` (tensors made on demand).

    :param shape: the model dimensions.
    :param bpw: bits per weight of the decoder layers (K per layer from :func:`layer_bits`).
    :param head_bits: K of the output head (None = dense head in the model dtype).
    :param codebook: ``"3inst"``, ``"mcg"`` or ``"mul1"``.
    :param seed: base seed; each tensor gets its own generator so results do not depend on load order.
    :param self_predicting: a model whose greedy next token is its current one by a wide margin: the embedding
        holds the head's rows and the layers' residual outputs are damped (:data:`RESIDUAL_DAMPING`). Same
        kernels and bytes as any other; its greedy continuation survives the rounding differences between
        kernel paths (one row against several), which flip a random model's near-ties.
    """

    def __init__(self, shape: BenchShape, bpw: float = 4.0, head_bits: int | None = 6, codebook: str = "mcg",
                 seed: int = 0, self_predicting: bool = False) -> None:
        if codebook not in CODEBOOKS:
            raise ValueError(f"codebook {codebook!r}: expected one of {sorted(CODEBOOKS)}")
        if self_predicting and head_bits is None:
            raise ValueError("a self-predicting bench model (the --draft target) copies its EXL3 head's rows into the "
                             "embedding; give the head bits (--head-bits 1..8, not 0)")
        self.dims, self.seed = shape, seed
        self.codebook = CODEBOOKS[codebook]
        self.directory = Path(f"<random {shape.name} {bpw} bpw>")
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype, str, float]] = {}
        h = shape.hidden
        self._add("model.embed_tokens.weight", (shape.vocab, h), torch.float16,
                  "head_rows" if self_predicting else "embed", 1.0)
        for i, k in enumerate(layer_bits(bpw, shape.layers)):
            for key, fin, fout in shape.linears():
                damp = RESIDUAL_DAMPING if self_predicting and key.endswith(_RESIDUAL_WRITERS) else 1.0
                self._add_exl3(key.format(i=i), fin, fout, k, damp)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                self._add(f"model.layers.{i}.{norm}.weight", (h,), torch.float16, "norm", 0.0)
        self._add("model.norm.weight", (h,), torch.float16, "norm", 0.0)
        if head_bits is None:
            self._add("lm_head.weight", (shape.vocab, h), torch.float16, "dense", h ** -0.5)
        else:
            self._add_exl3("lm_head", h, shape.vocab, head_bits)

    def _add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, kind: str, scale: float) -> None:
        self._meta[name] = (shape, dtype, kind, scale)

    def _add_exl3(self, key: str, fin: int, fout: int, k: int, damp: float = 1.0) -> None:
        if not 1 <= k <= 8:
            raise ValueError(f"{key}: K={k} bits per weight is outside 1..8")
        kp, n = _padded(fin), _padded(fout)
        self._add(f"{key}.trellis", (kp // 16, n // 16, 16 * k), torch.int16, "trellis", 0.0)
        # W = H diag(suh) Ŵ ... diag(svh): with unit-variance codebook values, |suh*svh| ~ fin^-1/2
        # keeps activations O(1) through the layers, as in a real checkpoint
        self._add(f"{key}.suh", (kp,), torch.float16, "sign", fin ** -0.25)
        self._add(f"{key}.svh", (n,), torch.float16, "sign", fin ** -0.25 * damp)
        if self.codebook in _MARKERS:
            self._add(f"{key}.{_MARKERS[self.codebook][0]}", (), torch.int32, "marker", 0.0)

    # -- TensorSource protocol ----------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._meta

    def keys(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][1]

    def nbytes(self, name: str) -> int:
        shape, dtype, _, _ = self._meta[name]
        n = 1
        for s in shape:
            n *= s
        return n * torch.empty((), dtype=dtype).element_size()

    def get_tensor(self, name: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   expect_shape: Any = None) -> torch.Tensor:
        shape, stored, kind, scale = self._meta[name]
        dev = torch.device(device)
        if dev.type == "meta":
            return torch.empty(shape, dtype=dtype or stored, device=dev)
        g = torch.Generator(device=dev).manual_seed(self.seed * 1_000_003 + (zlib.crc32(name.encode()) & 0xFFFFFFF))
        if kind == "trellis":
            t = torch.randint(-32768, 32768, shape, generator=g, device=dev, dtype=torch.int32).to(torch.int16)
        elif kind == "marker":
            v = _MARKERS[self.codebook][1]
            t = torch.tensor(v - (1 << 32) if v >= 1 << 31 else v, dtype=torch.int32, device=dev)
        elif kind == "sign":
            t = (torch.randint(0, 2, shape, generator=g, device=dev) * 2 - 1).to(stored) * scale
        elif kind == "norm":
            t = 1.0 + 0.05 * torch.randn(shape, generator=g, device=dev)
        elif kind == "head_rows":
            t = self._head_rows(dev)
        else:  # embed / dense
            t = torch.randn(shape, generator=g, device=dev) * scale
        # through the stored dtype, as a checkpoint's tensor: models of any dtype hold the same values
        return t.to(stored).to(dtype or stored)

    def _head_rows(self, dev: torch.device) -> torch.Tensor:
        """The head's rows at norm sqrt(hidden): as the embedding, each token's own logit stands far above the
        others' (random rows of this length are nearly orthogonal)."""
        from exl3_core.quant.exl3.linear import EXL3Linear

        h, v = self.dims.hidden, self.dims.vocab
        head = EXL3Linear.from_tensors("lm_head", lambda n: self.get_tensor(n, dev) if n in self else None, h, v)
        w = head.dequantize().t().contiguous()  # [vocab, hidden], row-major as a checkpoint's table
        return w * (h ** 0.5 / w.norm(dim=1, keepdim=True).clamp_min(1e-6))

    def weight_bytes(self) -> int:
        """Bytes of every stored tensor (what a checkpoint of this shape holds)."""
        return sum(self.nbytes(n) for n in self._meta)


def bench_plugins() -> Any:
    """Installed plugins (entry points: the attention backends among them) plus the bench architecture."""
    from exl3_core.plugins import load_plugins

    return load_plugins(extra=[sys.modules[__name__]])


def build_model(shape: BenchShape, *, bpw: float = 4.0, head_bits: int | None = 6, codebook: str = "mcg",
                device: str | torch.device = "cpu", dtype: torch.dtype | None = None, cache_tokens: int = 0,
                page_size: int | None = None, plugins: Any = None, seed: int = 0,
                attention: list[str] | None = None, parallel: dict[str, Any] | None = None,
                cache_kwargs: dict[str, Any] | None = None, self_predicting: bool = False) -> tuple[Any, Any]:
    """A loaded random-weight model of ``shape`` and, when ``cache_tokens`` > 0, its paged cache (``cache_kwargs``:
    its variant and options, e.g. from :meth:`~exl3_core.cache_bits.CacheBits.cache_kwargs`).

    The cache is created before loading, so the load's memory plan counts it. ``parallel``: tensor-parallel
    arguments of ``model.load`` (``tensor_parallel_size``, ``expert_parallel``).
    """
    from exl3_core.archkit import Config, Model
    from exl3_core.cache import Cache

    plugins = plugins if plugins is not None else bench_plugins()
    source = RandomSource(shape, bpw, head_bits, codebook, seed, self_predicting=self_predicting)
    config = Config(source.directory, shape.hf_config(), plugins=plugins)
    model = Model.from_config(config)
    cache = (Cache(model, cache_tokens, page_size=page_size, plugins=plugins, **(cache_kwargs or {}))
             if cache_tokens > 0 else None)
    model.load(device=device, dtype=dtype, source=source, attention=attention,  # type: ignore[arg-type]
               caches=[cache] if cache is not None else [], **(parallel or {}))
    model.bench_source = source  # type: ignore[attr-defined]
    return model, cache


def shape_dict(shape: BenchShape) -> dict[str, Any]:
    return asdict(shape) | {"head_dim": shape.dim_head}
