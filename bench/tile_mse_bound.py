"""How far the tail-biting tile encoder is from the trellis' unconstrained optimum (CPU).

The encoder (exl3_core/quant/exl3/viterbi.py) picks a path that starts and ends in the same state (tail-biting,
format spec 3.4). Without that constraint a plain Viterbi over the tile finds the cheapest path with a free
start and end (the encoder's first pass, unrotated); its MSE is a lower bound on any encoder's, and a loose one, because a free start also makes the
first ~16/K positions nearly free. Prints both on N(0, 1) tiles scaled to the codebook's RMS (the tiles of
``tests/core/test_viterbi.py::test_mse_mul1_k2`` at the defaults).

    python bench/tile_mse_bound.py [--tiles 320] [--seed 0] [--K 2] [--codebook 2]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=320)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--codebook", type=int, default=cb.CB_MUL1)
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


if __name__ == "__main__":
    main()
