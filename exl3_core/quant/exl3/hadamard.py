"""Hadamard matrices and the blockwise rotation EXL3 applies to both sides of every weight.

EXL3 itself only uses the natural-order Sylvester H128 (format spec 4.1). Other orders are built
for experiments and for callers that want non-power-of-two rotations: Sylvester (2^m), Paley I
(q+1, q ≡ 3 mod 4), Paley II (2(q+1), q ≡ 1 mod 4), q any odd prime power, and Kronecker
products of those. Orders none of these reach (92, 172, ...) raise ``ValueError``.
"""

from __future__ import annotations

import functools
import math

import torch

EXL3_BLOCK = 128


# ---- finite fields GF(p^m): elements are ints 0..q-1 whose base-p digits are poly coefficients


def _prime_power(q: int) -> tuple[int, int] | None:
    """(p, m) with q == p**m, p prime, or None."""
    if q < 2:
        return None
    p = next(d for d in range(2, q + 1) if q % d == 0)  # smallest divisor is prime
    m = 0
    while q % p == 0:
        q //= p
        m += 1
    return (p, m) if q == 1 else None


def _poly_mulmod(a: list[int], b: list[int], mod: list[int], p: int) -> list[int]:
    """a*b mod (monic ``mod``) over GF(p); polys are little-endian coefficient lists of length m."""
    m = len(mod) - 1
    prod = [0] * (2 * m - 1)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b):
                prod[i + j] = (prod[i + j] + x * y) % p
    for d in range(len(prod) - 1, m - 1, -1):  # reduce the top coefficients away
        c = prod[d]
        if c:
            for i in range(m + 1):
                prod[d - m + i] = (prod[d - m + i] - c * mod[i]) % p
    return prod[:m]


def _is_irreducible(mod: list[int], p: int) -> bool:
    # brute force: no monic divisor of degree 1..m/2 (fields here are tiny, q < a few hundred)
    m = len(mod) - 1
    for deg in range(1, m // 2 + 1):
        for code in range(p**deg):
            div = [(code // p**i) % p for i in range(deg)] + [1]
            rem = list(mod)
            for d in range(m, deg - 1, -1):  # long division by a monic divisor
                c = rem[d]
                if c:
                    for i in range(deg + 1):
                        rem[d - deg + i] = (rem[d - deg + i] - c * div[i]) % p
            if not any(rem[:deg]):
                return False
    return True


@functools.cache
def _field(q: int) -> tuple[int, int, list[int]]:
    """(p, m, modulus) for GF(q); the modulus is the first monic irreducible poly found."""
    pm = _prime_power(q)
    if pm is None:
        raise ValueError(f"{q} is not a prime power")
    p, m = pm
    if m == 1:
        return p, 1, [0, 1]
    for code in range(p**m):
        mod = [(code // p**i) % p for i in range(m)] + [1]
        if mod[0] and _is_irreducible(mod, p):
            return p, m, mod
    raise AssertionError(f"no irreducible polynomial of degree {m} over GF({p})")  # cannot happen


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = chi(x_i - x_j) over GF(q) (quadratic character, chi(0) = 0), as int64."""
    p, m, mod = _field(q)
    digits = torch.tensor([[(x // p**i) % p for i in range(m)] for x in range(q)], dtype=torch.int64)
    squares: set[int] = set()
    for x in range(1, q):
        d = digits[x].tolist()
        sq = _poly_mulmod(d, d, mod, p) if m > 1 else [(d[0] * d[0]) % p]
        squares.add(sum(c * p**i for i, c in enumerate(sq)))
    chi = torch.full((q,), -1, dtype=torch.int64)
    chi[0] = 0
    chi[list(squares)] = 1
    diff = (digits[:, None, :] - digits[None, :, :]) % p  # subtraction is digit-wise in GF(p^m)
    idx = (diff * (p ** torch.arange(m, dtype=torch.int64))).sum(-1)
    return chi[idx]


def _paley1(q: int) -> torch.Tensor:
    # q ≡ 3 mod 4: Q is skew, S = [[0, 1ᵀ], [-1, Q]] is skew with SSᵀ = qI, H = I + S
    Q = _jacobsthal(q)
    n = q + 1
    S = torch.zeros(n, n, dtype=torch.int64)
    S[0, 1:] = 1
    S[1:, 0] = -1
    S[1:, 1:] = Q
    return torch.eye(n, dtype=torch.int64) + S


def _paley2(q: int) -> torch.Tensor:
    # q ≡ 1 mod 4: C = [[0, 1ᵀ], [1, Q]] is a symmetric conference matrix; substitute
    # 0 -> [[1, -1], [-1, -1]] and ±1 -> ±[[1, 1], [1, -1]]
    Q = _jacobsthal(q)
    C = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    C[0, 1:] = 1
    C[1:, 0] = 1
    C[1:, 1:] = Q
    one = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    zero = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int64)
    return torch.kron(C, one) + torch.kron(torch.eye(q + 1, dtype=torch.int64), zero)


def _sylvester(n: int) -> torch.Tensor:
    # natural order: H[i, j] = (-1)^popcount(i & j), what EXL3 uses for H128
    i = torch.arange(n, dtype=torch.int64)
    x = i[:, None] & i[None, :]
    parity = torch.zeros_like(x)
    while bool(x.any()):
        parity ^= x & 1
        x = x >> 1
    return 1 - 2 * parity


def _paley_q(n: int) -> tuple[str, int] | None:
    q = n - 1
    if q > 2 and q % 4 == 3 and _prime_power(q):
        return ("paley1", q)
    if n % 2 == 0:
        q = n // 2 - 1
        if q > 1 and q % 4 == 1 and _prime_power(q):
            return ("paley2", q)
    return None


@functools.cache
def _plan(n: int) -> tuple | None:
    """How to build order n: ("sylvester",), ("paley1"|"paley2", q), ("kron", a, b), or None."""
    if n < 1:
        return None
    if n & (n - 1) == 0:
        return ("sylvester",)
    direct = _paley_q(n)
    if direct:
        return direct
    if n % 4:
        return None  # Hadamard orders above 2 are multiples of 4
    for a in range(2, math.isqrt(n) + 1):
        if n % a == 0 and _plan(a) is not None and _plan(n // a) is not None:
            return ("kron", a, n // a)
    return None


def can_build(n: int) -> bool:
    """True when ``get_hadamard(n)`` will succeed."""
    return _plan(n) is not None


@functools.cache
def _hadamard_i64(n: int) -> torch.Tensor:
    plan = _plan(n)
    if plan is None:
        raise ValueError(
            f"no Hadamard matrix of order {n} can be built here (Sylvester 2^m, Paley I q+1, Paley II "
            f"2(q+1) for prime powers q, and Kronecker products of those); EXL3 weights only need 128"
        )
    if plan[0] == "sylvester":
        return _sylvester(n)
    if plan[0] == "paley1":
        return _paley1(plan[1])
    if plan[0] == "paley2":
        return _paley2(plan[1])
    return torch.kron(_hadamard_i64(plan[1]), _hadamard_i64(plan[2]))


@functools.cache
def _hadamard_f32(n: int) -> torch.Tensor:
    return _hadamard_i64(n).to(torch.float32)


def get_hadamard(n: int) -> torch.Tensor:
    """Unnormalised ±1 Hadamard matrix of order n as fp32 (H Hᵀ = n I); a fresh copy."""
    return _hadamard_f32(n).clone()


@functools.cache
def _normalized(n: int, device: torch.device) -> torch.Tensor:
    return (_hadamard_f32(n) / math.sqrt(n)).to(device)


def had_blockwise(x: torch.Tensor, dim: int = -1, block: int = EXL3_BLOCK) -> torch.Tensor:
    """Right-multiply every consecutive ``block`` slice of ``dim`` by H_block / sqrt(block), in fp32.

    Returns fp32. For H128 (symmetric, orthogonal once normalised) this is the EXL3 rotation:
    ``had_blockwise(W, 1)`` = W·BD_n and ``had_blockwise(W, 0)`` = BD_k·W (spec 4.1-4.2).
    """
    size = x.shape[dim]
    if size % block:
        raise ValueError(
            f"had_blockwise: dim {dim} has size {size}, not a multiple of the Hadamard block {block}; "
            f"zero-pad it to a multiple of {block} first"
        )
    H = _normalized(block, x.device)
    # one contiguous 2-D product: a strided batched matmul (dim=0 without the copy) is 100x slower on CPU
    xt = x.to(torch.float32).movedim(dim, -1).contiguous()
    shape = xt.shape
    y = (xt.reshape(-1, block) @ H).reshape(shape)
    return y.movedim(-1, dim)
