"""EXL3 trellis bitstreams: in-tile order, state extraction, packing (format spec section 3).

Pure torch and vectorised over every tile at once. A tensor's trellis is int16 ``[k/16, n/16, 16K]``;
each ``[tk, tn]`` row is one tail-biting sequence of 256 K-bit symbols whose 16-bit sliding-window
states index the codebook. This module is the CPU oracle the compiled decoders are tested against.
"""

from __future__ import annotations

import functools

import torch

from exl3_core.quant.exl3 import codebook as _cb

TILE = 16
TILE_NUMEL = TILE * TILE  # 256 weights per tile = one trellis sequence
STATE_BITS = 16
MAX_K = 8


def check_k(K: int, what: str = "trellis") -> int:
    """Validate an integer bitrate K (1..8) and return it; ``what`` names the offender in errors."""
    if isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= MAX_K:
        raise ValueError(f"{what}: impossible EXL3 bitrate K={K!r}; K must be an integer in 1..{MAX_K}")
    return K


def k_from_trellis(trellis: torch.Tensor, what: str = "trellis") -> int:
    """K from the last dim (``16*K`` int16 words per tile), with errors naming ``what``."""
    if trellis.dim() < 1:
        raise ValueError(f"{what}: trellis must have a last dim of 16*K words, got a 0-dim tensor")
    words = trellis.shape[-1]
    if words % 16 != 0:
        raise ValueError(
            f"{what}: last dim {words} is not a multiple of 16, so it cannot hold 16*K words per tile "
            f"(impossible K); the tensor is truncated or not an EXL3 trellis"
        )
    return check_k(words // 16, f"{what} (last dim {words})")


def _resolve_k(trellis: torch.Tensor, K: int | None) -> int:
    found = k_from_trellis(trellis)
    if K is not None and check_k(K) != found:
        raise ValueError(f"trellis last dim {trellis.shape[-1]} means K={found}, but K={K} was passed")
    return found


@functools.cache
def _perm_cpu() -> torch.Tensor:
    # spec 3.2: p = 8t + j; t picks the (row pair, col) a tensor-core lane owns, j its 8 values
    p = torch.arange(TILE_NUMEL, dtype=torch.int64)
    t, j = p >> 3, p & 7
    r = 2 * (t & 3) + (j & 1) + 8 * ((j >> 1) & 1)
    c = (t >> 2) + 8 * (j >> 2)
    return r * TILE + c


@functools.cache
def _perm_inv_cpu() -> torch.Tensor:
    return torch.argsort(_perm_cpu())


def tensor_core_perm(device: torch.device | str | None = None) -> torch.Tensor:
    """LongTensor[256]: sequence position p -> flat tile index ``r*16 + c`` (r = input row)."""
    return _perm_cpu().to(device) if device is not None else _perm_cpu().clone()


def tensor_core_perm_inv(device: torch.device | str | None = None) -> torch.Tensor:
    """LongTensor[256]: flat tile index ``r*16 + c`` -> sequence position p (inverse of the above)."""
    return _perm_inv_cpu().to(device) if device is not None else _perm_inv_cpu().clone()


@functools.cache
def _window_tables(K: int, tile_order: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output slot: which 16-bit stream unit its state starts in, and the right shift.

    State p is bits [(p+1)K-16, (p+1)K) of the tile's N-bit stream, mod N (spec 3.4). It starts
    ``o`` bits into big-endian unit q and spills into unit q+1, so with the 32-bit pair
    V[q] = U[q] << 16 | U[q+1] the state is (V[q] >> (16 - o)) & 0xFFFF. With ``tile_order`` the
    slots are flat tile positions r*16+c instead of sequence positions, which folds the in-tile
    permutation into the gather.
    """
    n_bits = TILE_NUMEL * K
    p = torch.arange(TILE_NUMEL, dtype=torch.int64)
    if tile_order:
        p = _perm_inv_cpu()  # slot f holds sequence position perm_inv[f]
    b0 = ((p + 1) * K - STATE_BITS) % n_bits
    return b0 // 16, (16 - b0 % 16).to(torch.int32)


def _states(trellis: torch.Tensor, K: int | None, tile_order: bool) -> torch.Tensor:
    if trellis.dtype != torch.int16:
        raise TypeError(f"trellis must be int16 (safetensors I16), got {trellis.dtype}")
    K = _resolve_k(trellis, K)
    q, shift = (t.to(trellis.device) for t in _window_tables(K, tile_order))
    lead = trellis.shape[:-1]
    # little-endian uint32 storage swaps the 16-bit halves: stream unit U[q] = u[q ^ 1] (spec 3.3)
    u = trellis.to(torch.int32) & 0xFFFF
    units = u.view(*lead, 8 * K, 2).flip(-1).reshape(*lead, 16 * K)
    # int32 wrap of U << 16 only touches bit 31; the kept bits (shift..shift+15) stay below it
    pairs = (units << 16) | torch.roll(units, -1, dims=-1)
    g = torch.gather(pairs, -1, q.expand(*lead, TILE_NUMEL))
    return (g >> shift) & 0xFFFF


def unpack_states(trellis: torch.Tensor, K: int | None = None) -> torch.Tensor:
    """Trellis int16 ``[..., 16K]`` -> int32 states ``[..., 256]`` (0..65535), per spec 3.3-3.4.

    Sequence order (position p). Tail-biting: the first states take their high bits from the end
    of the tile's stream. ``K=None`` infers it from the last dim.
    """
    return _states(trellis, K, tile_order=False)


def symbols_from_states(states: torch.Tensor, K: int) -> torch.Tensor:
    """Low K bits of each state (the symbol it appends); any integer dtype -> int32."""
    return states.to(torch.int32) & ((1 << check_k(K)) - 1)


def pack_trellis(states_or_symbols: torch.Tensor, K: int) -> torch.Tensor:
    """States (or bare symbols) ``[..., 256]`` -> int16 trellis ``[..., 16K]`` (spec 3.5).

    Only the low K bits of each entry are kept, so full 16-bit encoder states and symbols both
    work. Whether the states were tail-biting consistent is the caller's business (``check_wrap``).
    """
    K = check_k(K)
    if states_or_symbols.shape[-1] != TILE_NUMEL:
        raise ValueError(
            f"pack_trellis: last dim must be {TILE_NUMEL} (one tile), got {tuple(states_or_symbols.shape)}"
        )
    if states_or_symbols.dtype.is_floating_point or states_or_symbols.dtype == torch.bool:
        raise TypeError(f"pack_trellis: needs an integer tensor, got {states_or_symbols.dtype}")
    lead = states_or_symbols.shape[:-1]
    dev = states_or_symbols.device
    sym = symbols_from_states(states_or_symbols, K)
    # expand every symbol MSB-first into bits, regroup the stream into 16-bit big-endian units
    shifts = torch.arange(K - 1, -1, -1, dtype=torch.int32, device=dev)
    bits = (sym.unsqueeze(-1) >> shifts) & 1  # [..., 256, K]
    bits = bits.reshape(*lead, 16 * K, 16)
    weights = torch.arange(15, -1, -1, dtype=torch.int32, device=dev)
    units = (bits << weights).sum(-1, dtype=torch.int32)  # U[q], 0..65535
    # little-endian uint32 storage swaps the two halves of every 32-bit word: u[q] = U[q ^ 1]
    swap = torch.arange(16 * K, device=dev) ^ 1
    u = units.index_select(-1, swap)
    return torch.where(u >= 32768, u - 65536, u).to(torch.int16)


def check_wrap(states: torch.Tensor, K: int) -> torch.Tensor:
    """Bool ``[...]``: the tail-biting condition ``state_0 >> K == state_255 & (2^(16-K)-1)``.

    This is the constraint an encoder must honour so that the states it assumed are the ones
    the packed stream yields (spec 3.4).
    """
    K = check_k(K)
    s = states.to(torch.int32) & 0xFFFF
    return (s[..., 0] >> K) == (s[..., -1] & ((1 << (STATE_BITS - K)) - 1))


def check_states(states: torch.Tensor, K: int) -> torch.Tensor:
    """Bool ``[...]``: every transition (wrap included) follows ``s_p >> K == s_{p-1} & mask``.

    Stricter than ``check_wrap``: a sequence passing it round-trips exactly through
    ``pack_trellis`` / ``unpack_states``.
    """
    K = check_k(K)
    s = states.to(torch.int32) & 0xFFFF
    prev = torch.roll(s, 1, dims=-1)
    return ((s >> K) == (prev & ((1 << (STATE_BITS - K)) - 1))).all(dim=-1)


def place_tiles(values: torch.Tensor) -> torch.Tensor:
    """Per-tile sequences ``[tk, tn, 256]`` -> matrix ``[16 tk, 16 tn]`` (spec 3.1 / 3.2)."""
    if values.dim() != 3 or values.shape[-1] != TILE_NUMEL:
        raise ValueError(f"place_tiles: expected [tk, tn, 256], got {tuple(values.shape)}")
    tk, tn, _ = values.shape
    flat = values.index_select(-1, _perm_inv_cpu().to(values.device))  # flat[r*16+c] = seq[p]
    return flat.view(tk, tn, TILE, TILE).permute(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)


def tiles_from_matrix(w: torch.Tensor) -> torch.Tensor:
    """Inverse of ``place_tiles``: ``[k, n]`` -> ``[k/16, n/16, 256]`` in sequence order."""
    if w.dim() != 2 or w.shape[0] % TILE or w.shape[1] % TILE:
        raise ValueError(
            f"tiles_from_matrix: expected [k, n] with k, n multiples of 16, got {tuple(w.shape)}"
        )
    k, n = w.shape
    flat = (
        w.reshape(k // TILE, TILE, n // TILE, TILE)
        .permute(0, 2, 1, 3)
        .reshape(k // TILE, n // TILE, TILE_NUMEL)
    )
    return flat.index_select(-1, _perm_cpu().to(w.device))


def decode_inner(trellis: torch.Tensor, K: int | None, codebook: int, exact: bool = False) -> torch.Tensor:
    """Decode a whole trellis ``[k/16, n/16, 16K]`` to the fp16 inner matrix Ŵ ``[k, n]``, bit-exactly.

    ``exact``: the values before their fp16 rounding, fp32 (:func:`codebook.decode_exact`; differs for
    MUL1 only)."""
    if trellis.dim() != 3:
        raise ValueError(
            f"decode_inner: trellis must be 3-D [k/16, n/16, 16K], got shape {tuple(trellis.shape)}"
        )
    tk, tn, _ = trellis.shape
    states = _states(trellis, K, tile_order=True)  # [tk, tn, r*16+c]
    lut = (_cb.lut_exact(codebook) if exact else _cb.lut(codebook)).to(trellis.device)
    return lut[states].view(tk, tn, TILE, TILE).permute(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)
