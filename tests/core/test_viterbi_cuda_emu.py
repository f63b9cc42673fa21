"""The CUDA Viterbi kernel's block algorithm (csrc/quant/viterbi_kernel.cuh), run on the CPU.

csrc/quant/viterbi_emu.cc compiles the very encode_block() the GPU kernel runs, with each of the
block's 512 threads as a fiber (barriers and warp shuffles emulated), so its indexing, reductions,
tie handling and traceback are checked here against the CPU op without a GPU. The device-specific
pieces (PTX sub/fma, fp16 loads, vector stores, shuffles) are covered by tests/gpu/test_viterbi_cuda.py.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exl3_core.quant.exl3 import codebook as cb
from exl3_core.quant.exl3 import viterbi as V

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "csrc" / "quant" / "viterbi_emu.cc"
T_PER_BLOCK = {1: 1, 2: 1, 3: 1, 4: 2, 5: 4, 6: 4, 7: 4, 8: 4}  # Cfg<K>::T in viterbi_kernel.cuh

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulator uses ucontext fibers (Linux)"),
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build csrc/quant/viterbi_emu.cc"),
    pytest.mark.skipif(not V.has_cpp(), reason="needs the CPU op exl3::viterbi_encode as reference "
                       "(python setup.py build_ext --inplace)"),
]


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    so = tmp_path_factory.mktemp("vemu") / "libvemu.so"
    cmd = ["g++", "-O2", "-march=native", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC",
           f"-I{SRC.parent}", str(SRC), "-o", str(so)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert r.returncode == 0, f"building the emulator failed:\n{r.stderr[-3000:]}"
    lib = ctypes.CDLL(str(so))
    lib.exl3_viterbi_emu.restype = ctypes.c_int
    lib.exl3_viterbi_emu.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int]
    return lib


def run_emu(lib: ctypes.CDLL, tiles: torch.Tensor, K: int, lut16: torch.Tensor, nblocks: int) -> torch.Tensor:
    t = tiles.to(torch.float32).contiguous()
    lut = lut16.to(torch.float16).contiguous().view(torch.int16)
    out = torch.full((t.shape[0], 256), -1, dtype=torch.int32)
    rc = lib.exl3_viterbi_emu(K, t.data_ptr(), t.shape[0], lut.data_ptr(), out.data_ptr(), nblocks)
    assert rc == 0
    return out


def adversarial_tiles(K: int, codebook: int, n: int, seed: int) -> torch.Tensor:
    """Gaussian tiles, decoded valid streams (a zero-cost path exists), constants and zeros (ties)."""
    g = torch.Generator().manual_seed(seed)
    rms = float(cb.lut(codebook).float().pow(2).mean().sqrt())
    sym = torch.randint(0, 1 << K, (1, 256), generator=g)
    s = torch.zeros(1, 256, dtype=torch.int64)
    for j in range(-(-16 // K)):
        s |= torch.roll(sym, j, dims=-1) << (j * K)
    valid = V.decode_states(s & 0xFFFF, codebook).float()
    kinds = [torch.randn(1, 256, generator=g) * rms, valid, torch.full((1, 256), 0.3), torch.zeros(1, 256),
             valid + 1e-3 * torch.randn(1, 256, generator=g), torch.full((1, 256), 1e-41)]  # last: subnormal
    return torch.cat([kinds[i % len(kinds)] for i in range(n)])


@pytest.mark.parametrize("K", range(1, 9))
def test_emulated_kernel_equals_cpu_op(emu: ctypes.CDLL, K: int) -> None:
    codebook = (cb.CB_3INST, cb.CB_MCG, cb.CB_MUL1)[K % 3]
    T = T_PER_BLOCK[K]
    # two tile groups, the last one padded: one block striding over both (odd K) or two blocks
    n = T + 1
    tiles = adversarial_tiles(K, codebook, n, seed=K)
    got = run_emu(emu, tiles, K, cb.lut(codebook), nblocks=2 if K % 2 == 0 else 1)
    ref = V.encode_tiles(tiles, K, codebook, impl="cpp")
    assert (got >= 0).all(), "emulated kernel left states unwritten"
    mism = (got != ref).any(dim=1).nonzero().flatten().tolist()
    assert not mism, f"K={K} cb={codebook}: tiles {mism} differ from the CPU op"
    assert V.states_consistent(got, K).all()


def coarse_case(K: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A LUT rounded to multiples of 1/2 and tiles on the same grid: every cost is exact, so equal
    path costs are everywhere (about half of all nodes tie at K=4, all at K=8) and only the
    lowest-a rule decides the states."""
    g = torch.Generator().manual_seed(seed)
    lut = (cb.lut(cb.CB_3INST).float() * 2).round() / 2
    tiles = torch.randint(-4, 5, (n, 256), generator=g).float() / 2
    return lut, tiles


@pytest.mark.parametrize("K", range(1, 9))
def test_emulated_kernel_tie_rule(emu: ctypes.CDLL, K: int) -> None:
    from exl3_core import ext

    lut, tiles = coarse_case(K, T_PER_BLOCK[K], seed=100 + K)
    got = run_emu(emu, tiles, K, lut, nblocks=1)
    ref = ext.op("viterbi_encode")(tiles, lut, K)
    mism = (got != ref).any(dim=1).nonzero().flatten().tolist()
    assert not mism, f"K={K} coarse LUT: tiles {mism} differ from the CPU op (tie rule)"
