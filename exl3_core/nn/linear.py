"""Linear layers: the interface every linear implements, the dense layer and the factory.

Checkpoints hold each linear either as EXL3 (``trellis`` + ``suh``/``svh``, format spec 1.2) or
dense (``weight [out, in]``, HF orientation, possibly zero-padded to multiples of 128 when the
converter left it unquantized, spec 1.6). :func:`make_linear` decides from the tensor names alone,
as the format requires (config.json is not consulted).
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from exl3_core.nn.adapters import LinearAdapter, adapted
from exl3_core.nn.shard import LinearShard
from exl3_core.nn.source import TensorSource, WeightError, fetch

PAD = 128  # EXL3 converters zero-pad unquantized linears to this multiple


def _padded(n: int) -> int:
    return -(-n // PAD) * PAD


@runtime_checkable
class LinearBase(Protocol):
    """What a block expects of a linear: true feature counts, ``forward(x [..., in]) -> [..., out]``, the
    adapters whose deltas its output includes (:mod:`exl3_core.nn.adapters`) and the tensor-parallel
    shard it holds (:mod:`exl3_core.nn.shard`; None: the whole layer)."""

    key: str
    in_features: int
    out_features: int
    adapters: tuple[LinearAdapter, ...]
    shard: LinearShard | None

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DenseLinear(torch.nn.Module):
    """``y = x Wᵀ + b`` with ``W [out, in]`` in fp16/bf16/fp32.

    :param weight: the stored weight; a 128-padded ``[padded(out), padded(in)]`` tensor is trimmed
        to the true size (the padding is zeros by construction).
    :param bias: optional, stored ``[out]`` or ``[padded(out)]``.
    :param key: checkpoint key (for messages).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int,
                 key: str = "linear") -> None:
        super().__init__()
        self.key = key
        self.in_features = in_features
        self.out_features = out_features
        if weight.dim() != 2 or not _trimmable(weight.shape[0], out_features) or not _trimmable(weight.shape[1], in_features):
            raise WeightError(f"{key}.weight has shape {list(weight.shape)}, expected [{out_features}, {in_features}] "
                              f"(or 128-padded [{_padded(out_features)}, {_padded(in_features)}]); the checkpoint "
                              f"does not match the model config")
        if tuple(weight.shape) != (out_features, in_features):
            weight = weight[:out_features, :in_features].contiguous()
        if bias is not None:
            if bias.dim() != 1 or not _trimmable(bias.shape[0], out_features):
                raise WeightError(f"{key}.bias has shape {list(bias.shape)}, expected [{out_features}]")
            bias = bias[:out_features].contiguous()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.adapters: tuple[LinearAdapter, ...] = ()
        self.shard: LinearShard | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return adapted(F.linear(x, self.weight, self.bias), x, self.adapters, owned=True)

    def extra_repr(self) -> str:
        return f"{self.key}: in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, " \
               f"dtype={self.weight.dtype}"


def _trimmable(stored: int, true: int) -> bool:
    return stored == true or stored == _padded(true)


def make_linear(key: str, in_features: int, out_features: int, *, bias: bool | None, source: TensorSource,
                device: torch.device | str, dtype: torch.dtype,
                names: Collection[str] | None = None) -> LinearBase:
    """Build the linear stored under ``key`` in ``source``.

    :param key: tensor name prefix, e.g. ``"model.layers.0.self_attn.q_proj"``.
    :param bias: True = ``key.bias`` must exist, False = ignore any bias, None = use it if present.
    :param source: checkpoint tensors.
    :param device: target device.
    :param dtype: dtype of dense weights (EXL3 layers keep their storage dtypes).
    :param names: the source's tensor names, if the caller already has them as a set.
    :raises WeightError: naming the key and the checkpoint when neither storage form is present.
    """
    names = names if names is not None else frozenset(source.keys())
    device = torch.device(device)
    # Imported here: the EXL3 codec is optional machinery a dense-only model never touches.
    from exl3_core.quant.exl3.linear import EXL3Linear, is_exl3_storage

    if is_exl3_storage(key, names):
        if bias is True and f"{key}.bias" not in names:
            raise WeightError(f"tensor '{key}.bias' is missing from the checkpoint at {source.directory}: "
                              f"the architecture has a bias on {key}; the checkpoint does not match the config")

        def get(name: str) -> torch.Tensor | None:
            if name == f"{key}.bias" and bias is False:
                return None
            return fetch(source, name, device) if name in names else None

        try:
            return EXL3Linear.from_tensors(key, get, in_features, out_features)
        except (KeyError, ValueError) as e:
            raise WeightError(f"{e} (checkpoint at {source.directory})") from None

    wname = f"{key}.weight"
    if wname not in names:
        partial = sorted(n for n in names if n.startswith(key + "."))
        found = f"only {', '.join(partial)} found, which is neither EXL3 (trellis+suh+svh) nor dense (weight)" \
            if partial else "no tensor with that prefix exists"
        raise WeightError(f"linear layer {key!r}: tensor {wname!r} (or EXL3 {key}.trellis/suh/svh) is missing from "
                          f"the checkpoint at {source.directory}: {found}. The checkpoint does not match its "
                          f"config.json or is incomplete; re-download or re-convert it")
    padded_shape = (_padded(out_features), _padded(in_features))
    stored = tuple(source.shape(wname))
    if stored not in ((out_features, in_features), padded_shape):
        where = getattr(source, "file_of", None)
        file = where(wname) if where is not None else source.directory
        raise WeightError(f"tensor {wname!r} in {file} has shape {list(stored)}, expected "
                          f"[{out_features}, {in_features}]; the checkpoint does not match the model config")
    w = fetch(source, wname, device, dtype)
    b = None
    bname = f"{key}.bias"
    if bias is True and bname not in names:
        raise WeightError(f"tensor {bname!r} is missing from the checkpoint at {source.directory}: the architecture "
                          f"has a bias on {key}; the checkpoint does not match the config")
    if bias is not False and bname in names:
        b = fetch(source, bname, device, dtype)
    return DenseLinear(w, b, in_features, out_features, key=key)


def shard_granularity(*linears: torch.nn.Module) -> int:
    """The feature multiple at which ``linears`` can be cut: 128 where one is EXL3 (its blocks), else 1."""
    from exl3_core.quant.exl3.linear import EXL3Linear

    return PAD if any(isinstance(m, EXL3Linear) for m in linears) else 1


def shard_linear(linear: torch.nn.Module, shard: LinearShard) -> torch.nn.Module:
    """The part of ``linear`` that ``shard`` names, as a new linear of the same type (weights sliced, not
    copied where a view will do). A row shard keeps the bias on rank 0 only (it is added once, after the
    reduction's sum). The result carries ``shard`` and the adapters of the original.

    :raises TypeError: for a linear type that cannot be sharded; :raises ValueError: for ranges the
        storage cannot cut (EXL3 cuts at 128 features).
    """
    from exl3_core.quant.exl3.linear import EXL3Linear, shard_exl3

    if getattr(linear, "adapters", ()):
        raise ValueError(f"{getattr(linear, 'key', '?')}: shard the model before attaching adapters (an adapter's "
                         f"weights need the same cut)")
    if isinstance(linear, EXL3Linear):
        out: torch.nn.Module = shard_exl3(linear, shard.kind, shard.start, shard.stop, keep_bias=shard.rank == 0)
    elif isinstance(linear, DenseLinear):
        w, b = linear.weight, linear.bias
        if shard.kind == "column":
            if shard.stop > linear.out_features:
                raise ValueError(f"{linear.key}: column shard {shard.start}:{shard.stop} beyond {linear.out_features}")
            w, b = w[shard.start:shard.stop], (b[shard.start:shard.stop] if b is not None else None)
            n_in, n_out = linear.in_features, shard.stop - shard.start
        else:
            if shard.stop > linear.in_features:
                raise ValueError(f"{linear.key}: row shard {shard.start}:{shard.stop} beyond {linear.in_features}")
            w, b = w[:, shard.start:shard.stop], (b if shard.rank == 0 else None)
            n_in, n_out = shard.stop - shard.start, linear.out_features
        out = DenseLinear(w.contiguous(), b, n_in, n_out, key=linear.key)
    else:
        raise TypeError(f"cannot shard {type(linear).__name__} ({getattr(linear, 'key', '?')}): only EXL3 and "
                        f"dense linears have shards")
    out.shard = shard  # type: ignore[assignment]
    return out
