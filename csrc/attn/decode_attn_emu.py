"""CPU emulation of csrc/attn/decode_attn.cu's index logic (the tensor-core decode attention), for one
(sequence, kv head): the swizzled shared-memory rows, ldmatrix (.x4 and .x4.trans) from the lanes' row
addresses, mma.m16n8k16 on the fragment layouts that csrc/exl3/exl3_kernels.cuh relies on (A: rows g, g + 8
x cols 2t, 2t + 1 (+ 8); B: k 2t, 2t + 1 (+ 8) x n g; C: rows g, g + 8 x cols 2t, 2t + 1), the per-warp
online softmax and the warps' merge. It checks the kernel's fragment bookkeeping against a plain softmax
attention before a GPU runs it; it says nothing about timing or the hardware's own semantics.

    python csrc/attn/decode_attn_emu.py
"""
from __future__ import annotations

import numpy as np

WARPS = 8
LANES = np.arange(32)
G_, T_ = LANES >> 2, LANES & 3


def smem_at(r: np.ndarray | int, c: np.ndarray | int, d: int) -> np.ndarray:
    return np.asarray(r) * d + ((np.asarray(c) ^ (np.asarray(r) & 7)) << 3)


def ldsm4(mem: np.ndarray, addr: np.ndarray) -> np.ndarray:
    """[4, 32, 2]: matrix i's rows at addr[8i .. 8i + 7]; lane l gets row l // 4, elements 2 (l % 4) + {0, 1}."""
    out = np.empty((4, 32, 2), dtype=mem.dtype)
    for i in range(4):
        rows = addr[8 * i: 8 * i + 8]
        base = rows[G_] + 2 * T_
        out[i, :, 0], out[i, :, 1] = mem[base], mem[base + 1]
    return out


def ldsm4_t(mem: np.ndarray, addr: np.ndarray) -> np.ndarray:
    """.trans: lane l gets rows 2 (l % 4), 2 (l % 4) + 1 of matrix i, element l // 4 of each."""
    out = np.empty((4, 32, 2), dtype=mem.dtype)
    for i in range(4):
        rows = addr[8 * i: 8 * i + 8]
        out[i, :, 0] = mem[rows[2 * T_] + G_]
        out[i, :, 1] = mem[rows[2 * T_ + 1] + G_]
    return out


def mma(c: np.ndarray, a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> None:
    """c [32, 4] += A (a [4, 32, 2]) @ B (b0, b1 [32, 2]) on the m16n8k16 fragment layouts."""
    A = np.zeros((16, 16), np.float32)
    B = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, 2 * t: 2 * t + 2] = a[0, lane]
        A[g + 8, 2 * t: 2 * t + 2] = a[1, lane]
        A[g, 2 * t + 8: 2 * t + 10] = a[2, lane]
        A[g + 8, 2 * t + 8: 2 * t + 10] = a[3, lane]
        B[2 * t: 2 * t + 2, g] = b0[lane]
        B[2 * t + 8: 2 * t + 10, g] = b1[lane]
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]


def kernel(q: np.ndarray, k: np.ndarray, v: np.ndarray, qscale: float) -> np.ndarray:
    """q [G, D], k and v [seq, D] (fp16 values) -> [G, D] as the kernel computes it (fp32 accumulation)."""
    G, D = q.shape
    seq = k.shape[0]
    KW = 32 if D == 64 else 16
    CAP, NT, KS, DT = WARPS * KW, KW // 8, D // 16, D // 8
    P = D // 8
    nan = np.float32(np.nan)
    ks = np.full(CAP * D, nan, np.float32)  # stale shared memory: NaN bits, as the kernel must not read them
    vs = np.full(CAP * D, nan, np.float32)
    qs = np.full(16 * D, nan, np.float32)
    for r in range(G, 16):
        for c in range(P):
            qs[smem_at(r, c, D) + np.arange(8)] = 0
    for r in range(seq, min(CAP, -(-seq // KW) * KW)):
        for c in range(P):
            ks[smem_at(r, c, D) + np.arange(8)] = 0
            vs[smem_at(r, c, D) + np.arange(8)] = 0
    for h in range(G):
        for c in range(P):
            qs[smem_at(h, c, D) + np.arange(8)] = q[h, 8 * c: 8 * c + 8]
    state = [None] * WARPS
    m = np.full((WARPS, 32, 2), -np.inf, np.float32)
    l_ = np.zeros((WARPS, 32, 2), np.float32)
    o = np.zeros((WARPS, DT, 32, 4), np.float32)
    for p0 in range(0, seq, CAP):
        n = min(seq - p0, CAP)
        for r in range(n):  # the pass's rows (pass 0 before/after the wait, later ones after it)
            for c in range(P):
                ks[smem_at(r, c, D) + np.arange(8)] = k[p0 + r, 8 * c: 8 * c + 8]
                vs[smem_at(r, c, D) + np.arange(8)] = v[p0 + r, 8 * c: 8 * c + 8]
        for w in range(WARPS):
            key0 = w * KW
            if key0 >= n:
                continue
            q_r, q_c = (LANES & 7) + 8 * ((LANES >> 3) & 1), LANES >> 4
            sc = np.zeros((NT, 32, 4), np.float32)
            for s in range(0, KS, 2):
                qa = ldsm4(qs, smem_at(q_r, 2 * s + q_c, D))
                qb = ldsm4(qs, smem_at(q_r, 2 * s + 2 + q_c, D))
                for j in range(NT):
                    kf = ldsm4(ks, smem_at(key0 + 8 * j + (LANES & 7), 2 * s + (LANES >> 3), D))
                    mma(sc[j], qa, kf[0], kf[1])
                    mma(sc[j], qb, kf[2], kf[3])
            for j in range(NT):
                for e in range(2):
                    ok = key0 + 8 * j + 2 * T_ + e < n
                    sc[j][:, e] = np.where(ok, sc[j][:, e] * qscale, -np.inf)
                    sc[j][:, 2 + e] = np.where(ok, sc[j][:, 2 + e] * qscale, -np.inf)
            mx = np.stack([sc[:, :, 0:2].max(axis=(0, 2)), sc[:, :, 2:4].max(axis=(0, 2))], -1)  # [32, 2]
            mx = mx.reshape(8, 4, 2).max(axis=1).repeat(4, axis=0)  # the quad's shuffles
            mn = np.maximum(m[w], mx)
            al = np.exp2(m[w] - mn)
            m[w] = mn
            p = np.empty_like(sc)
            p[:, :, 0:2] = np.exp2(sc[:, :, 0:2] - mn[None, :, 0:1])
            p[:, :, 2:4] = np.exp2(sc[:, :, 2:4] - mn[None, :, 1:2])
            sums = np.stack([p[:, :, 0:2].sum(axis=(0, 2)), p[:, :, 2:4].sum(axis=(0, 2))], -1)
            sums = sums.reshape(8, 4, 2).sum(axis=1).repeat(4, axis=0)
            l_[w] = l_[w] * al + sums
            o[w, :, :, 0:2] *= al[None, :, 0:1]
            o[w, :, :, 2:4] *= al[None, :, 1:2]
            pf = p.astype(np.float16).astype(np.float32)  # pack2: rounded to the input type
            for kq in range(NT // 2):
                pa = np.stack([pf[2 * kq][:, 0:2], pf[2 * kq][:, 2:4], pf[2 * kq + 1][:, 0:2], pf[2 * kq + 1][:, 2:4]])
                row = key0 + 16 * kq + (LANES & 7) + 8 * ((LANES >> 3) & 1)
                for u in range(0, DT, 2):
                    vf = ldsm4_t(vs, smem_at(row, u + (LANES >> 4), D))
                    mma(o[w, u], pa, vf[0], vf[1])
                    mma(o[w, u + 1], pa, vf[2], vf[3])
    # each warp's state for rows g < G, then the merge
    for w in range(WARPS):
        sw = np.zeros((G, 2 + D), np.float32)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            if g >= G:
                continue
            if t == 0:
                sw[g, 0], sw[g, 1] = m[w, lane, 0], l_[w, lane, 0]
            for u in range(DT):
                sw[g, 2 + 8 * u + 2 * t], sw[g, 3 + 8 * u + 2 * t] = o[w, u, lane, 0], o[w, u, lane, 1]
        state[w] = sw
    nw = min(WARPS, -(-min(seq, CAP) // KW))
    out = np.zeros((G, D), np.float32)
    for h in range(G):
        M = max(state[w][h, 0] for w in range(nw))
        if M == -np.inf:
            continue
        wt = [np.exp2(state[w][h, 0] - M) for w in range(nw)]
        num = sum(wt[w] * state[w][h, 2:] for w in range(nw))
        den = sum(wt[w] * state[w][h, 1] for w in range(nw))
        out[h] = num / den if den > 0 else 0
    return out


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    s = (q.astype(np.float64) @ k.astype(np.float64).T) * scale
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(axis=1, keepdims=True)) @ v.astype(np.float64)


def main() -> None:
    rng = np.random.default_rng(0)
    worst = 0.0
    for d, g, seq in ((64, 4, 256), (64, 4, 1), (64, 8, 37), (64, 1, 300), (128, 4, 256), (128, 7, 100),
                      (128, 8, 17), (64, 3, 513)):
        q = rng.standard_normal((g, d)).astype(np.float16).astype(np.float32)
        k = rng.standard_normal((seq, d)).astype(np.float16).astype(np.float32)
        v = rng.standard_normal((seq, d)).astype(np.float16).astype(np.float32)
        scale = d ** -0.5
        got = kernel(q, k, v, scale * np.log2(np.e))
        err = float(np.abs(got - reference(q, k, v, scale)).max())
        worst = max(worst, err)
        print(f"d={d} group={g} keys={seq}: max err {err:.2e}{'  NaN!' if not np.isfinite(got).all() else ''}")
        assert np.isfinite(got).all() and err < 5e-3, (d, g, seq, err)
    print(f"all cases within 5e-3 (worst {worst:.2e}): the kernel's fragment bookkeeping holds")


if __name__ == "__main__":
    main()
