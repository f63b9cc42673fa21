"""Import a llama.cpp GGUF file into an HF-style model folder (config, tokenizer, safetensors).

The core knows the GGUF container and tensor layout; what an architecture's metadata means (which
HF class, which config keys, whether llama.cpp permuted Q/K rows when it converted the model) is
supplied by a :class:`GGUFAdapter` from the architecture plugin, found through
``ArchSpec.gguf_arch`` / ``ArchSpec.gguf_adapter``.

Output layout (what ``transformers`` and :class:`exl3_core.tokenizer.Tokenizer` read)::

    config.json  generation_config.json  tokenizer.json  tokenizer_config.json
    special_tokens_map.json  model.safetensors (or model-0000i-of-0000n.safetensors + index)
    exl3_import.json          # provenance; written last, marks a finished import
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from exl3_core.convert.gguf_tokenizer import write_tokenizer

log = logging.getLogger("exl3.convert")

ProgressFn = Callable[[int, int, str], None]

#: Marker written last into an imported folder; its presence means the import finished.
IMPORT_MARKER = "exl3_import.json"
IMPORTER_VERSION = 1

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

#: HF tensor names (without .weight/.bias) of the standard pre-norm decoder with gated MLP, the
#: layout most GGUF architectures share. Adapters of other layouts set ``hf_tensor_names``.
STANDARD_DECODER_TENSORS: tuple[str, ...] = (
    "model.embed_tokens",
    "model.norm",
    "lm_head",
    "model.layers.{bid}.input_layernorm",
    "model.layers.{bid}.self_attn.q_proj",
    "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj",
    "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.mlp.gate_proj",
    "model.layers.{bid}.mlp.up_proj",
    "model.layers.{bid}.mlp.down_proj",
)

#: GGUF tensors that carry nothing an HF checkpoint stores (derived from the config instead).
_DERIVED_TENSORS = ("rope_freqs.weight",)


class GGUFAdapter(Protocol):
    """What an architecture plugin tells the importer about one llama.cpp architecture.

    Required:

    - ``permuted_qk``: llama.cpp's HF->GGUF converter interleaved the rotary halves of the Q and K
      rows for this architecture; the importer undoes it (per head, ``head_count`` for Q and
      ``head_count_kv`` for K).
    - ``hf_config(metadata)``: the HF ``config.json`` dict, including ``"architectures"`` and
      ``"model_type"``. :func:`decoder_config` builds the common part. The importer fills
      ``vocab_size``, ``tie_word_embeddings``, token ids and ``torch_dtype`` when absent.

    Optional attributes (looked up with ``getattr``):

    - ``generation_config(metadata) -> dict``: the generation_config.json dict (default: token ids).
    - ``hf_tensor_names: Sequence[str]``: HF tensor name templates (``{bid}`` = layer index),
      mapped to GGUF names through ``gguf.TensorNameMap`` (default :data:`STANDARD_DECODER_TENSORS`).
    - ``pretokenizers: Mapping[str, str]``: llama.cpp ``tokenizer.ggml.pre`` names -> keys of
      :data:`exl3_core.convert.gguf_tokenizer.RECIPES`.
    """

    permuted_qk: bool

    def hf_config(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """Called once per import with the file's metadata (arrays as lists); returns config.json."""
        ...


class UnsupportedGGUFArchitecture(ValueError):
    """No adapter is registered for the file's ``general.architecture``."""


# -- metadata ----------------------------------------------------------------------------------

def read_gguf(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """Open a GGUF file: ``(GGUFReader, metadata dict)``; arrays become lists, strings str."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    md = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return reader, md


def _key(md: Mapping[str, Any], arch: str, name: str, default: Any = None, *, required: bool = False) -> Any:
    k = f"{arch}.{name}"
    if k in md:
        return md[k]
    if required:
        raise ValueError(f"GGUF metadata lacks {k!r}, which the {arch!r} import needs")
    return default


def _f32(v: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(v)))


def decoder_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The HF config keys every standard decoder GGUF states (``{arch}.*`` metadata).

    Adapters start from this and add ``architectures``, ``model_type`` and their own keys.
    """
    arch = str(metadata["general.architecture"])

    def g(name: str, default: Any = None, required: bool = False) -> Any:
        return _key(metadata, arch, name, default, required=required)

    heads = int(g("attention.head_count", required=True))
    kv = g("attention.head_count_kv", heads)
    if isinstance(kv, list):
        raise ValueError(  # noqa: TRY004 - a metadata value, not an argument of the wrong type
            f"GGUF {arch}.attention.head_count_kv is per-layer ({kv[:4]}...); only a single value is supported")
    cfg: dict[str, Any] = {
        "hidden_size": int(g("embedding_length", required=True)),
        "intermediate_size": int(g("feed_forward_length", required=True)),
        "num_hidden_layers": int(g("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 2048)),
    }
    key_len = g("attention.key_length")
    if key_len is not None:
        cfg["head_dim"] = int(key_len)
    if g("vocab_size") is not None:
        cfg["vocab_size"] = int(g("vocab_size"))
    if (rs := rope_scaling(metadata)) is not None:
        cfg["rope_scaling"] = rs
    return cfg


def rope_scaling(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*`` (linear and YaRN), or None."""
    arch = str(metadata["general.architecture"])
    kind = _key(metadata, arch, "rope.scaling.type")
    factor = _key(metadata, arch, "rope.scaling.factor")
    if kind is None and (lin := _key(metadata, arch, "rope.scale_linear")) is not None:
        kind, factor = "linear", lin
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    out: dict[str, Any] = {"rope_type": str(kind), "factor": _f32(factor)}
    orig = _key(metadata, arch, "rope.scaling.original_context_length")
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    if kind == "yarn":
        for gk, hk in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow"),
                       ("rope.scaling.attn_factor", "attention_factor")):
            if (v := _key(metadata, arch, gk)) is not None:
                out[hk] = _f32(v)
    elif kind != "linear":
        log.warning("GGUF %s.rope.scaling.type=%r is passed through unchecked", arch, kind)
    return out


# -- adapters ----------------------------------------------------------------------------------

def _find_adapter(gguf_arch: str) -> GGUFAdapter:
    """The adapter the installed architecture plugins declare for ``gguf_arch``."""
    from exl3_core.plugins import get_plugins

    plugins = get_plugins()
    specs = [s for s in plugins.architectures().values() if gguf_arch in s.gguf_arch]
    if not specs:
        supported = sorted({g for s in plugins.architectures().values() for g in s.gguf_arch if s.gguf_adapter})
        raise UnsupportedGGUFArchitecture(
            f"GGUF architecture {gguf_arch!r} is not supported by the installed plugins; supported GGUF "
            f"architectures: {', '.join(supported) or '(none)'}. Install the exl3 architecture plugin for it.")
    spec = specs[0]
    if spec.gguf_adapter is None:
        raise UnsupportedGGUFArchitecture(
            f"architecture {spec.hf_arch!r} lists GGUF architecture {gguf_arch!r} but declares no gguf_adapter")
    adapter: GGUFAdapter = plugins.resolve(spec.gguf_adapter, what="GGUF adapter")
    return adapter


def _select_adapter(gguf_arch: str, adapters: Mapping[str, GGUFAdapter] | None) -> GGUFAdapter:
    if adapters is None:
        return _find_adapter(gguf_arch)
    if gguf_arch not in adapters:
        raise UnsupportedGGUFArchitecture(
            f"GGUF architecture {gguf_arch!r} is not supported; supported GGUF architectures: "
            f"{', '.join(sorted(adapters)) or '(none)'}")
    return adapters[gguf_arch]


# -- tensors -----------------------------------------------------------------------------------

def tensor_name_map(gguf_arch: str, n_blocks: int, hf_names: Sequence[str]) -> dict[str, str]:
    """GGUF base tensor name -> HF base name, by sending each HF template through gguf's map."""
    import gguf

    enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}.get(gguf_arch)
    if enum is None:
        raise UnsupportedGGUFArchitecture(f"the installed gguf package does not know architecture {gguf_arch!r}; "
                                          f"upgrade it (pip install -U gguf)")
    tmap = gguf.get_tensor_name_map(enum, n_blocks)
    out: dict[str, str] = {}
    for tmpl in hf_names:
        for bid in (range(n_blocks) if "{bid}" in tmpl else (0,)):
            hf = tmpl.format(bid=bid)
            g = tmap.get_name(hf)
            if g is not None:
                out[g] = hf
    return out


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of Q/K rows.

    llama.cpp stores, per head, rows ``[0, d/2, 1, d/2+1, ...]`` of the HF layout (rotate-half pairs
    made adjacent); rows are reshaped to ``(head, d/2, 2)`` and the last two axes swapped back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute a tensor with {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(t: Any) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        # A plain ndarray view: slicing np.memmap per block row costs more than the arithmetic.
        arr = dequantize(t.data.view(np.ndarray), t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which gguf cannot dequantize "
                         f"(pip install -U gguf)") from e
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    # F32 tensors come back as read-only views of the memory map; torch needs its own copy.
    return np.array(arr, dtype=np.float32, copy=True).reshape(shape)


class _ShardWriter:
    """Collects tensors and writes safetensors shards of at most ``max_bytes`` each."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + n > self.max_bytes:
            self.flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += n
        self.total += n

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        fname = f"shard-{len(self.files):05d}.tmp"
        save_file(self.pending, str(self.out_dir / fname), metadata={"format": "pt"})
        self.files.append((fname, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        n = len(self.files)
        if n == 1:
            os.replace(self.out_dir / self.files[0][0], self.out_dir / "model.safetensors")
            return
        weight_map: dict[str, str] = {}
        for i, (fname, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / fname, self.out_dir / final)
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(self.out_dir / "model.safetensors.index.json", index)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# -- the import --------------------------------------------------------------------------------

def import_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "bf16",
    adapters: Mapping[str, GGUFAdapter] | None = None,
    progress: ProgressFn | None = None,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Import ``gguf_path`` into the HF-style folder ``out_dir`` and return its path.

    :param dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``; every tensor is dequantized to fp32 first and
        then rounded (round-to-nearest-even) to this type.
    :param adapters: GGUF architecture -> adapter; None asks the installed plugins.
    :param progress: called as ``progress(done, total, tensor_name)`` after each tensor.
    :param overwrite: replace an existing ``out_dir``; otherwise a non-empty one is an error.
    :param max_shard_bytes: safetensors shard size limit.

    Everything is written into a hidden sibling directory that is renamed over ``out_dir`` at the
    end, so an interrupted import never leaves a half-written model behind.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"output directory {out_dir} exists and is not empty; pass overwrite=True "
                              f"(--overwrite) or choose another directory")
    reader, md = read_gguf(gguf_path)
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{gguf_path} has no general.architecture metadata")  # noqa: TRY004 - file content
    adapter = _select_adapter(arch, adapters)

    names = [t.name for t in reader.tensors]
    config = dict(adapter.hf_config(md))
    if "architectures" not in config:
        raise ValueError(f"GGUF adapter {adapter!r} for {arch!r} returned a config without 'architectures'")
    if "vocab_size" not in config:
        # The embedding's row count is the model's vocabulary (the tokenizer may list fewer tokens).
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        tokens = md.get("tokenizer.ggml.tokens")
        config["vocab_size"] = int(embd.shape[-1]) if embd is not None else (len(tokens) if tokens else None)
    # llama.cpp writes output.weight only when the head is not the embedding matrix.
    config["tie_word_embeddings"] = "output.weight" not in names
    for k, mk in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id")):
        if k not in config and (v := md.get(f"tokenizer.ggml.{mk}")) is not None:
            config[k] = int(v)
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    gen_fn = getattr(adapter, "generation_config", None)
    gen = dict(gen_fn(md)) if gen_fn is not None else default_generation_config(md)

    n_blocks = int(config.get("num_hidden_layers") or _key(md, arch, "block_count", required=True))
    name_map = tensor_name_map(arch, n_blocks, getattr(adapter, "hf_tensor_names", STANDARD_DECODER_TENSORS))
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads", n_head))

    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        writer = _ShardWriter(tmp, max_shard_bytes)
        for i, t in enumerate(reader.tensors):
            base, _, suffix = t.name.rpartition(".")
            if t.name in _DERIVED_TENSORS:
                log.warning("GGUF tensor %r is derived from the config and is not imported; check rope_scaling "
                            "in %s/config.json", t.name, out_dir)
                continue
            hf = name_map.get(base)
            if hf is None or suffix not in ("weight", "bias"):
                raise ValueError(f"GGUF tensor {t.name!r} of architecture {arch!r} has no HF name; add it to the "
                                 f"adapter's hf_tensor_names")
            w = torch.from_numpy(_dequantize(t))
            if adapter.permuted_qk and base.endswith((".attn_q", ".attn_k")):
                w = unpermute_qk(w, n_head if base.endswith(".attn_q") else n_kv)
            writer.add(f"{hf}.{suffix}", w.to(_DTYPES[dtype]))
            if progress is not None:
                progress(i + 1, len(names), t.name)
        writer.finish()
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", gen)
        if "tokenizer.ggml.tokens" in md:
            write_tokenizer(md, tmp, getattr(adapter, "pretokenizers", None), config.get("max_position_embeddings"))
        else:
            log.warning("%s has no tokenizer metadata; %s gets weights and config only", gguf_path, out_dir)
        st = gguf_path.stat()
        _write_json(tmp / IMPORT_MARKER, {"importer_version": IMPORTER_VERSION, "source": str(gguf_path.resolve()),
                                          "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns,
                                          "dtype": dtype, "gguf_architecture": arch})
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``, replacing whatever is there (callers checked overwrite)."""
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


def default_generation_config(md: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json from the GGUF's special ids; end-of-turn ids join the EOS list."""
    gen: dict[str, Any] = {}
    if (bos := md.get("tokenizer.ggml.bos_token_id")) is not None:
        gen["bos_token_id"] = int(bos)
    eos = [int(md[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                "tokenizer.ggml.eom_token_id") if md.get(k) is not None]
    eos = list(dict.fromkeys(eos))
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if (pad := md.get("tokenizer.ggml.padding_token_id")) is not None:
        gen["pad_token_id"] = int(pad)
    return gen


# -- CLI ---------------------------------------------------------------------------------------
