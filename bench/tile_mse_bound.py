"""How far the tail-biting tile encoder is from the trellis' unconstrained optimum (CPU).

The encoder (exl3_core/quant/exl3/viterbi.py) picks a path that starts and ends in the same state (tail-biting,
format spec 3.4). Without that constraint a plain Viterbi over the tile finds the cheapest path with a free
start and end (the encoder's first pass, unrotated); its MSE is a lower bound on any encoder's, and a loose one, because a free start also makes the
first ~16/K positions nearly free. Prints both on N(0, 1) tiles scaled to the codebook's RMS (the tiles of
``tests/core/test_viterbi.py::test_mse_mul1_k2`` at the defaults).

With ``--candidates N``: how much a better choice of the tail-biting overlap (the low 16-K bits shared by the
first and last state) could give. For every overlap O, the cheapest path through O at the tile's wrap with free
ends at its middle (the encoder's first pass, plus the same recursion run backwards) is a lower bound on the
tail-biting cost with overlap O; the N overlaps with the lowest bound each get the encoder's second pass
(start and end forced to O), and the cheapest is kept; N = 1 is the encoder's own choice. On the defaults' 320
tiles (the same search in plain fp32 arithmetic, which takes a third of the time) the MSE went 0.06836, 0.06818,
0.06808, 0.06806, 0.06805 for N = 1, 2, 4, 8, 16 and stayed at 0.06805 for N = 32: the overlap choice is worth
0.5% at most, and the tail-biting optimum of these tiles is about 0.0680. Slow: one pass takes ~20 s per 16
tiles on two cores.

    python bench/tile_mse_bound.py [--tiles 320] [--seed 0] [--K 2] [--codebook 2] [--candidates N]
"""
from __future__ import annotations

import argparse
import time

import torch

from exl3_core.quant.exl3 import codebook as cb
from exl3_core.quant.exl3 import viterbi as V


def unconstrained_mse(tiles: torch.Tensor, K: int, codebook: int, chunk: int = 16) -> torch.Tensor:
    """Per tile, the least MSE over every state path with a free start and end: the encoder's own first pass
    (its torch reference, exact fp32 FMA) on the tiles in natural order, in chunks that bound its survivor table."""
    lut = V._lut32(codebook)
    costs = [V._viterbi_torch(tiles[i:i + chunk], lut, K, None)[0].min(dim=1).values
             for i in range(0, tiles.shape[0], chunk)]
    return torch.cat(costs) / V.SEQ


def _backward(tiles: torch.Tensor, lut: torch.Tensor, K: int) -> torch.Tensor:
    """``[B, NN]``: per node n, the least cost of the tiles' positions with the state before the first one ending
    in node n and a free end (the mirror of the encoder's first pass, with the same exact fp32 FMA)."""
    B, NN = tiles.shape[0], V.STATES >> K
    L = 1 << K
    cost = torch.zeros(B, NN, dtype=torch.float32)
    lut3 = lut.view(1, L, NN)  # state s = a * NN + n2: its node n2 is the next position's predecessor node
    for i in range(tiles.shape[1] - 1, -1, -1):
        d = lut3 - tiles[:, i].view(B, 1, 1)
        c = V.fma32(d, d, cost.view(B, 1, NN).expand(B, L, NN))
        cost = c.reshape(B, NN, L).min(dim=2).values  # states grouped by their predecessor node s >> K
    return cost


def best_overlap_mse(tiles: torch.Tensor, K: int, codebook: int, candidates: int, chunk: int = 16) -> dict[int, float]:
    """Mean MSE per count N = 1, 2, 4, ... up to ``candidates`` when the best of the first N overlaps (by their lower
    bound) is kept."""
    lut = V._lut32(codebook)
    half = V.SEQ // 2
    sums = {n: 0.0 for n in (1, 2, 4, 8, 16, 32, 64) if n <= candidates}
    for c0 in range(0, tiles.shape[0], chunk):
        w = tiles[c0:c0 + chunk]
        rows = torch.arange(w.shape[0])
        # the encoder's first pass over positions 128..255 from a free start, and its mirror over 0..127
        order = (V._viterbi_torch(w[:, half:], lut, K, None)[0] + _backward(w[:, :half], lut, K)).argsort(dim=1)
        best = torch.full((w.shape[0],), float("inf"))
        for j in range(candidates):
            o = order[:, j]
            cost, _ = V._viterbi_torch(w, lut, K, o)
            best = torch.minimum(best, cost[rows, o])
            if j + 1 in sums:
                sums[j + 1] += float(best.sum())
    return {n: v / tiles.shape[0] / V.SEQ for n, v in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=320)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--codebook", type=int, default=cb.CB_MUL1)
    ap.add_argument("--candidates", type=int, default=0, help="also the best of this many overlaps per tile")
    a = ap.parse_args()
    rms = float(cb.lut(a.codebook).float().pow(2).mean().sqrt())
    x = torch.randn(a.tiles, V.SEQ, generator=torch.Generator().manual_seed(a.seed)) * rms
    t = time.perf_counter()
    free = unconstrained_mse(x, a.K, a.codebook).mean().item()
    t_free = time.perf_counter() - t
    states = V.encode_tiles(x, a.K, a.codebook)
    tb = V.tile_mse(x, states, a.codebook).mean().item()
    print(f"K={a.K} codebook {a.codebook}, {a.tiles} tiles: unconstrained {free:.5f} ({t_free:.0f} s), "
          f"tail-biting encoder {tb:.5f}")
    if a.candidates > 0:
        t = time.perf_counter()
        got = best_overlap_mse(x, a.K, a.codebook, a.candidates)
        print("best of N overlaps: " + ", ".join(f"N={n} {m:.5f}" for n, m in got.items())
              + f" ({time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()
