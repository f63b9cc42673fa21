"""One-launch EXL3 linear (``exl3::exl3_linear`` / ``exl3_linear_group``, csrc/exl3/exl3_fused.cuh).

References are pure torch in fp64 on fresh random problems (any int16 bit pattern is a valid trellis;
Ŵ from ``decode_inner``, the bit-exact oracle). Besides the numbers, the tests pin the workspace
protocol: the op must leave its fp32 accumulator and arrival counters zeroed, so repeated,
interleaved and CUDA-graph-replayed calls stay right with no memset in between.

Launch options (pre-decoding, its chunk cap, the x-once row threshold) are the ops' per-call ``launch``
argument (``LaunchConfig.ints()``): each test passes the setting it exercises and the defaults otherwise.

Tolerances. The op rounds to fp16 four times (x*suh, xh, Had(z), *svh); each rounding is a relative
error below 2^-11 = 4.9e-4 per element (about 2e-4 RMS), and the Hadamards (orthogonal) and the
random Ŵ carry relative L2 error through unchanged, so against the unrounded fp64 algebra the
expected relative L2 error is about sqrt(4) * 2e-4 = 4e-4 (a torch emulation of the roundings
measures 4.1e-4..4.5e-4 on these shapes): REL_FP32 = 2e-3 leaves ~5x margin. Against a reference
that rounds at the same four places only the fp32 accumulation order differs, flipping an fp16
rounding in ~0.5% of the elements; the emulation measures <= 1.2e-5, while dropping one of the
roundings shows up as 3.4e-4: REL_ROUNDED = 1e-4 sits between the two.
"""
from __future__ import annotations

import math

import pytest
import torch

from exl3_core.kernels.launch import LaunchConfig
from exl3_core.quant.exl3 import CB_3INST, CB_MCG, CB_MUL1, cuda_ops
from exl3_core.quant.exl3.hadamard import get_hadamard
from exl3_core.quant.exl3.trellis import decode_inner

pytestmark = pytest.mark.cuda
CBS = (CB_3INST, CB_MCG, CB_MUL1)
DEV = "cuda"
REL_FP32 = 2e-3
REL_ROUNDED = 1e-4
SHAPES = [(128, 128), (384, 640), (4096, 1152), (1280, 4096)]  # (k, n): tiny, one chunk, deep k, wide n
MS = (1, 3, 8, 16)


@pytest.fixture(scope="module")
def fused_ops(exl3_ops):
    if not hasattr(exl3_ops, "exl3_linear"):
        pytest.fail("exl3_core._C predates exl3::exl3_linear; rebuild it (python setup.py build_ext --inplace)")
    if not any(a.name == "launch" for a in exl3_ops.exl3_linear.default._schema.arguments):
        pytest.fail("exl3_core._C predates the fused ops' launch argument; rebuild it")
    return exl3_ops


def launch(**kw: int) -> list[int]:
    """The ops' ``launch`` argument: the defaults with ``kw`` changed."""
    return LaunchConfig(**kw).ints()


class Problem:
    """One linear: random trellis, fp16 scales (sign times [0.5, 2]) and its decoded Ŵ in fp64."""

    def __init__(self, k: int, n: int, K: int, cb: int) -> None:
        self.k, self.n, self.K, self.cb = k, n, K, cb
        self.trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, device=DEV)
        self.suh = rand_scales(k)
        self.svh = rand_scales(n)
        self.w = decode_inner(self.trellis, K, cb).double()


def rand_scales(size: int) -> torch.Tensor:
    sign = torch.randint(0, 2, (size,), device=DEV) * 2 - 1
    return (sign * (0.5 + 1.5 * torch.rand(size, device=DEV))).to(torch.float16)


def had64(t: torch.Tensor) -> torch.Tensor:
    """Blockwise H128/sqrt(128) along the last dim in fp64 (natural-order Sylvester, spec 4.1)."""
    h = get_hadamard(128).to(device=t.device, dtype=torch.float64) / math.sqrt(128)
    return (t.reshape(-1, 128) @ h).reshape(t.shape)


def ref_fp32(x: torch.Tensor, p: Problem) -> torch.Tensor:
    """Spec 4.3 algebra with no intermediate rounding."""
    return had64(had64(x.double() * p.suh.double()) @ p.w) * p.svh.double()


def ref_rounded(x: torch.Tensor, p: Problem) -> torch.Tensor:
    """Spec 4.3 with its fp16 roundings: fp16(x*suh), fp16(xh), fp16(Had(z)), then * svh in fp16."""
    xh = had64((x * p.suh).double()).to(torch.float16)  # fp16 * fp16 on CUDA: exact product, one rounding
    z = xh.double() @ p.w
    return (had64(z).to(torch.float16) * p.svh).double()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    return ((a64 - b64).norm() / b64.norm()).item()


def poison(shape: tuple[int, ...]) -> None:
    """Fill and free a block of the output's size: the caching allocator hands it to the op next."""
    t = torch.full(shape, float("nan"), dtype=torch.float16, device=DEV)
    del t


def check(y: torch.Tensor, x: torch.Tensor, p: Problem, what: str) -> None:
    assert y.dtype == torch.float16 and tuple(y.shape) == (x.shape[0], p.n), what
    assert not y.isnan().any(), f"{what}: output elements left unwritten (or a stale workspace)"
    e32, er = rel_err(y, ref_fp32(x, p)), rel_err(y, ref_rounded(x, p))
    assert e32 < REL_FP32 and er < REL_ROUNDED, f"{what}: rel L2 {e32:.2e} vs fp64, {er:.2e} vs the rounded reference"


def assert_workspace_clean(fused_ops) -> None:
    z, counters = fused_ops.exl3_linear_workspace(torch.empty(1, device=DEV))
    assert z.numel() > 0 and counters.numel() > 0, "the fused op allocated no workspace"
    assert z.count_nonzero().item() == 0, f"{z.count_nonzero().item()} accumulator entries left nonzero"
    assert counters.count_nonzero().item() == 0, f"{counters.count_nonzero().item()} arrival counters left nonzero"


def xin(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, device=DEV).to(torch.float16)


@pytest.mark.parametrize("cb", CBS)
@pytest.mark.parametrize("K", range(1, 9))
def test_matches_reference(fused_ops, K: int, cb: int) -> None:
    for k, n in SHAPES:
        p = Problem(k, n, K, cb)
        for m in MS:
            x = xin(m, k)
            poison((m, n))
            check(fused_ops.exl3_linear(x, p.trellis, p.suh, p.svh, cb), x, p, f"K={K} cb={cb} k={k} n={n} m={m}")
    assert_workspace_clean(fused_ops)


@pytest.mark.parametrize("cb", CBS)
@pytest.mark.parametrize("K", [1, 4, 7])
@pytest.mark.parametrize("k", [128, 384, 512])
def test_bit_exact_vs_unfused_chain(fused_ops, k: int, K: int, cb: int) -> None:
    """With one k chunk (k <= 512, 32 k tiles per block) the fused op does the unfused chain's exact
    arithmetic: had128 prologue, the same mma sequence, had128 epilogue; so the bits must agree."""
    p = Problem(k, 256, K, cb)
    for m in (1, 16):
        x = xin(m, k)
        xh = fused_ops.had128(x, p.suh, None, True)
        z = fused_ops.exl3_gemm_xh(xh, p.trellis, K, cb, 32)
        chain = fused_ops.had128(z, None, p.svh, True)
        y = fused_ops.exl3_linear(x, p.trellis, p.suh, p.svh, cb, 32)
        diff = (y.view(torch.int16) != chain.view(torch.int16)).sum().item()
        assert diff == 0, f"K={K} cb={cb} k={k} m={m}: {diff} of {y.numel()} fp16 values differ from the 4-kernel chain"


@pytest.mark.parametrize("K,cb", [(4, CB_MUL1), (2, CB_3INST), (6, CB_MCG)])
def test_x_transformed_once_is_bit_exact(fused_ops, K: int, cb: int) -> None:
    """From ``xh_min_rows`` rows (the ``launch`` argument) the launch transforms x once (fused_xh_kernel) and
    the blocks copy it: the same arithmetic as every block transforming its own chunk, so with one k chunk (no
    atomics order) the bits agree; the gated op (its own chunking) agrees within rounding. 0 turns it off."""
    from exl3_core.ops import ACT_CODES

    p = Problem(512, 384, K, cb)
    off, on = launch(xh_min_rows=0), launch(xh_min_rows=2)
    for m in (2, 3, 8):
        x, gate = xin(m, 512), xin(m, 512) * 2
        y0 = fused_ops.exl3_linear(x, p.trellis, p.suh, p.svh, cb, 32, off)
        a0 = fused_ops.exl3_linear_act(gate, x, p.trellis, p.suh, p.svh, cb, ACT_CODES["silu"], off)
        y1 = fused_ops.exl3_linear(x, p.trellis, p.suh, p.svh, cb, 32, on)
        a1 = fused_ops.exl3_linear_act(gate, x, p.trellis, p.suh, p.svh, cb, ACT_CODES["silu"], on)
        assert torch.equal(y0.view(torch.int16), y1.view(torch.int16)), f"m={m}: plain"
        # the gated op picks its own k chunks (several: fp32 atomics in varying order), so within rounding
        assert rel_err(a1, a0) < REL_ROUNDED, f"m={m}: gated"
        check(y1, x, p, f"x once, K={K} cb={cb} m={m}")
    assert_workspace_clean(fused_ops)


def test_wide_output_paths(fused_ops) -> None:
    """Wide outputs (>= 512 column blocks of 128, a head's vocabulary) transform x once per launch at any row
    count, and a grid of two or more waves takes the cost model's k chunk, which need not end on a Hadamard
    block (exl3_fused.cuh: xh_wanted, pick_kt_per_chunk). With one k chunk the result is bit-exact with the
    path that has both off (xh_min_rows=0: each block transforms its own chunk); with several chunks both
    match the references."""
    one = Problem(128, 512 * 128, 4, CB_MUL1)  # 8 k tiles: one chunk
    deep = Problem(2048, 1024 * 128, 2, CB_MUL1)  # 128 k tiles x 1024 column blocks: >= 2 waves at 32 tiles
    on, off = launch(xh_min_rows=8), launch(xh_min_rows=0)
    for m in (1, 3, 8):  # 8: the 2-warp blocks (4 n tiles per warp) loop over 4 rows each in the epilogue
        x = xin(m, one.k)
        y_wide = fused_ops.exl3_linear(x, one.trellis, one.suh, one.svh, CB_MUL1, 0, on)
        y_off = fused_ops.exl3_linear(x, one.trellis, one.suh, one.svh, CB_MUL1, 0, off)
        assert torch.equal(y_wide.view(torch.int16), y_off.view(torch.int16)), f"m={m}: one chunk"
        check(y_wide, x, one, f"wide, one chunk, m={m}")
        x = xin(m, deep.k)
        poison((m, deep.n))
        check(fused_ops.exl3_linear(x, deep.trellis, deep.suh, deep.svh, CB_MUL1, 0, on), x, deep,
              f"wide, deep, m={m}")
        poison((m, deep.n))
        check(fused_ops.exl3_linear(x, deep.trellis, deep.suh, deep.svh, CB_MUL1, 0, off), x, deep,
              f"wide, off, m={m}")
    assert_workspace_clean(fused_ops)


@pytest.mark.parametrize("kt", [0, 1, 5, 8, 13, 16, 24, 26, 32])
def test_split_k_chunks(fused_ops, kt: int) -> None:
    """Chunks of any k-tile count: 1, 5, 13 and 26 start and end inside 128-column Hadamard blocks of x. At
    m = 1 chunks of <= 12 tiles run the short trellis ring (exl3_fused.cuh, SHORT_RING), longer ones the deep one."""
    p = Problem(4096, 1024, 4, CB_MUL1)
    for m in (1, 16):
        x = xin(m, 4096)
        poison((m, 1024))
        check(fused_ops.exl3_linear(x, p.trellis, p.suh, p.svh, CB_MUL1, kt), x, p, f"kt_per_chunk={kt} m={m}")
    assert_workspace_clean(fused_ops)


@pytest.mark.parametrize("K,cb", [(4, CB_MUL1), (2, CB_3INST), (6, CB_MCG), (8, CB_MUL1)])
def test_predecode_matches_plain_path(fused_ops, K: int, cb: int) -> None:
    """Pre-decoding (exl3_fused.cuh, PD_TILES: in a one-wave grid each warp decodes the first 8 k tiles of
    its chunk before griddepcontrol.wait) does the plain path's arithmetic in the same order, in both of its
    modes: bit-equal outputs with one k chunk (no atomics order), the reference's tolerance with 16 chunks
    (the 1B-shape o_proj) and with the launcher's chunks grown to fit one wave (the 1B-shape down_proj). The
    mode is each call's ``launch`` argument, so calls with different modes interleave freely."""
    one = Problem(128, 1024, K, cb)  # 8 k tiles: one chunk per column block, 8 blocks
    many = Problem(2048, 2048, K, cb)  # 16 chunks of 8 tiles x 16 column blocks: 256 blocks
    # the 1B down shape: the launcher's 8-tile chunks make 1,024 blocks; pre-decoding grows them to 16 (512)
    grow = Problem(8192, 2048, K, cb)
    for m in (1, 3):
        x = xin(m, 128)
        y = {}
        for mode in (2, 1, 0):
            poison((m, 1024))
            y[mode] = fused_ops.exl3_linear(x, one.trellis, one.suh, one.svh, cb, 0, launch(predecode=mode))
            check(y[mode], x, one, f"one chunk, predecode={mode}, K={K} cb={cb} m={m}")
        for mode in (2, 1):
            diff = (y[mode].view(torch.int16) != y[0].view(torch.int16)).sum().item()
            assert diff == 0, f"K={K} cb={cb} m={m} mode {mode}: {diff} fp16 values differ from the plain path"
        x = xin(m, 2048)
        for mode in (2, 0):
            poison((m, 2048))
            check(fused_ops.exl3_linear(x, many.trellis, many.suh, many.svh, cb, 8, launch(predecode=mode)), x, many,
                  f"16 chunks, predecode={mode}, K={K} cb={cb} m={m}")
        x = xin(m, 8192)
        for mode in (2, 0):
            poison((m, 2048))
            check(fused_ops.exl3_linear(x, grow.trellis, grow.suh, grow.svh, cb, 0, launch(predecode=mode)), x, grow,
                  f"launcher's chunks, predecode={mode}, K={K} cb={cb} m={m}")
    assert_workspace_clean(fused_ops)


def test_predecode_chunk_cap(fused_ops) -> None:
    """``predecode_max_kt`` (the ``launch`` argument) caps a pre-decoding launch's chunk: the 1B-shape gate/up
    (2048 x 16384) needs 32-tile chunks to fit one wave, so a cap of 16 sends it down the plain path; both must
    match the reference."""
    p = Problem(2048, 16384, 4, CB_MUL1)
    for cap in (16, 0):
        for m in (1, 3):
            x = xin(m, 2048)
            poison((m, 16384))
            check(fused_ops.exl3_linear(x, p.trellis, p.suh, p.svh, CB_MUL1, 0, launch(predecode_max_kt=cap)), x, p,
                  f"cap={cap} m={m}")
    assert_workspace_clean(fused_ops)


def test_repeat_calls_leave_workspace_clean(fused_ops) -> None:
    one = Problem(384, 512, 3, CB_MCG)  # one k chunk: no split-k atomics order, so deterministic
    deep = Problem(4096, 1152, 5, CB_3INST)  # several chunks: fp32 atomics in any order
    for p in (one, deep):
        x = xin(8, p.k)
        ys = []
        for i in range(3):
            poison((8, p.n))
            # k=384 is 24 k tiles: kt_per_chunk=24 forces the single chunk (auto might split it)
            ys.append(fused_ops.exl3_linear(x, p.trellis, p.suh, p.svh, p.cb, 24 if p is one else 0))
            check(ys[-1], x, p, f"k={p.k} call {i}")
        if p is one:
            assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2]), "repeated one-chunk calls differ"
        else:  # a stale accumulator would double z; atomics order moves only the last bits
            assert rel_err(ys[1], ys[0]) < 1e-4 and rel_err(ys[2], ys[0]) < 1e-4
        assert_workspace_clean(fused_ops)


def test_interleaved_shapes(fused_ops) -> None:
    """Growing and shrinking n between calls (the workspace grows on the way) and varying m."""
    small, mid, wide = Problem(128, 128, 8, CB_MCG), Problem(4096, 1152, 4, CB_MUL1), Problem(1280, 4096, 3, CB_3INST)
    for i, (p, m) in enumerate([(small, 3), (mid, 1), (wide, 16), (mid, 8), (small, 16), (wide, 1), (mid, 16)]):
        x = xin(m, p.k)
        poison((m, p.n))
        check(fused_ops.exl3_linear(x, p.trellis, p.suh, p.svh, p.cb), x, p, f"call {i}: k={p.k} n={p.n} m={m}")
    assert_workspace_clean(fused_ops)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_group(fused_ops, count: int, m: int) -> None:
    k = 2048
    probs = [Problem(k, n, 6, CB_MUL1) for n in (1024, 256, 640)[:count]]
    x = xin(m, k)
    ys = fused_ops.exl3_linear_group(x, [p.trellis for p in probs], [p.suh for p in probs], [p.svh for p in probs], CB_MUL1)
    assert len(ys) == count
    for i, (y, p) in enumerate(zip(ys, probs)):
        check(y, x, p, f"group of {count}, problem {i}, m={m}")
    assert_workspace_clean(fused_ops)


def test_cuda_graph_replay(fused_ops) -> None:
    a, b = Problem(4096, 1152, 4, CB_MUL1), Problem(1280, 4096, 2, CB_MCG)
    g1, g2 = Problem(1024, 512, 3, CB_3INST), Problem(1024, 384, 3, CB_3INST)
    xa, xb, xg = xin(1, a.k), xin(4, b.k), xin(2, g1.k)

    def step() -> list[torch.Tensor]:
        ya = fused_ops.exl3_linear(xa, a.trellis, a.suh, a.svh, a.cb)
        yb = fused_ops.exl3_linear(xb, b.trellis, b.suh, b.svh, b.cb)
        yg = fused_ops.exl3_linear_group(xg, [g1.trellis, g2.trellis], [g1.suh, g2.suh], [g1.svh, g2.svh], g1.cb)
        return [ya, yb, *yg]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up: grows the workspace before capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    pairs = [(xa, a), (xb, b), (xg, g1), (xg, g2)]
    for rep in range(2):
        for x in (xa, xb, xg):
            x.copy_(torch.randn(x.shape, device=DEV).to(torch.float16))
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in static]
        eager = step()
        for i, (y, e, (x, p)) in enumerate(zip(replayed, eager, pairs)):
            check(y, x, p, f"replay {rep}, output {i}")
            assert rel_err(y, e) < 1e-4, f"replay {rep}, output {i}: graph and eager results differ"
        assert_workspace_clean(fused_ops)


def test_exl3_gemm_routes_through_fused(fused_ops) -> None:
    """``exl3_gemm`` takes the fused op for m <= 4 and the 4-kernel path above; both stay right."""
    p = Problem(1024, 768, 4, CB_MUL1)
    for m in (1, 4, 5, 16, 17, 40):
        x = xin(m, p.k)
        poison((m, p.n))
        y = fused_ops.exl3_gemm(x, p.trellis, p.suh, p.svh, p.cb)
        check(y, x, p, f"exl3_gemm m={m}")
        if m <= 4:
            single = fused_ops.exl3_linear(x, p.trellis, p.suh, p.svh, p.cb)
            assert rel_err(y, single) < 1e-4


def test_python_wrappers(fused_ops) -> None:
    p, q = Problem(512, 384, 5, CB_MCG), Problem(512, 256, 5, CB_MCG)
    x = torch.randn(2, 3, 512, device=DEV).to(torch.float16)
    y = cuda_ops.exl3_linear_cuda(x, p.trellis, p.suh, p.svh, p.cb)
    assert tuple(y.shape) == (2, 3, 384)
    check(y.reshape(6, 384), x.reshape(6, 512), p, "exl3_linear_cuda")
    yp, yq = cuda_ops.exl3_linear_group_cuda(x, [p.trellis, q.trellis], [p.suh, q.suh], [p.svh, q.svh], p.cb)
    check(yp.reshape(6, 384), x.reshape(6, 512), p, "group wrapper, problem 0")
    check(yq.reshape(6, 256), x.reshape(6, 512), q, "group wrapper, problem 1")
    big = torch.randn(20, 512, device=DEV).to(torch.float16)  # more than 16 rows: exl3_gemm
    check(cuda_ops.exl3_linear_cuda(big, p.trellis, p.suh, p.svh, p.cb), big, p, "exl3_linear_cuda m=20")
    with pytest.raises(ValueError, match="share K"):
        other = Problem(512, 128, 4, CB_MCG)
        cuda_ops.exl3_linear_group_cuda(x, [p.trellis, other.trellis], [p.suh, other.suh], [p.svh, other.svh], p.cb)
    with pytest.raises(ValueError, match="suh/svh"):
        cuda_ops.exl3_linear_cuda(x, p.trellis, p.suh[:128], p.svh, p.cb)


def _plan_device() -> torch.device:
    # the plan's runners compare devices with their index, as tensors report them
    return torch.device("cuda", torch.cuda.current_device())


def test_projection_matches_separate_layers(fused_ops, counting_kernels) -> None:
    """The plan's q/k/v and gate/up form (:class:`~exl3_core.plan.linears.Projection` with the compiled
    kernels): one grouped launch at decode sizes for EXL3 layers that can share it, separate calls otherwise
    (different K, or more rows than one launch takes); results equal the layers' own forwards, biases and
    true (unpadded) widths included."""
    from exl3_core.plan.linears import Projection
    from exl3_core.quant.exl3.linear import EXL3Linear
    from exl3_core.tuning import Tuning

    def layer(k_true: int, n_true: int, K: int, bias: bool) -> EXL3Linear:
        k, n = -(-k_true // 128) * 128, -(-n_true // 128) * 128
        p = Problem(k, n, K, CB_MUL1)
        b = torch.randn(n_true, device=DEV).half() if bias else None
        return EXL3Linear(p.trellis, p.suh, p.svh, CB_MUL1, k_true, n_true, bias=b)

    tuning = Tuning.h200()
    same = (layer(576, 576, 4, True), layer(576, 192, 4, True), layer(576, 192, 4, False))
    mixed = (layer(576, 1536, 4, False), layer(576, 1536, 3, False))  # K differs: separate calls
    for layers in (same, same[:2], mixed):
        kernels = counting_kernels()
        proj = Projection("test", layers, tuning, _plan_device(), kernels)
        assert (proj.group_why == []) == (layers is not mixed), proj.group_why
        launches = 0
        for m in (1, 3, 4, 9):
            x = torch.randn(m, 576, device=DEV).half()
            got = proj.run(x)
            launches += layers is not mixed and m <= tuning.kernels.fused_linear_max_rows
            assert kernels.calls.get("group", 0) == launches, f"{len(layers)} layers, m={m}: {kernels.calls}"
            for i, (g, lay) in enumerate(zip(got, layers)):
                want = lay(x)
                assert g.shape == want.shape == (m, lay.out_features)
                assert rel_err(g, want) < 1e-3, f"{len(layers)} layers, m={m}, output {i}"


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("K,cb", [(4, CB_MUL1), (2, CB_3INST), (6, CB_MCG)])
def test_linear_act(fused_ops, K: int, cb: int, act: str) -> None:
    """``exl3_linear_act(gate, up)`` = the linear of ``act(gate) * up`` formed by the reference kernel
    (fp32 math, one fp16 rounding), the product computed in the fused prologue."""
    from exl3_core.ops import ACT_CODES
    from exl3_core.reference import fused as ref

    p = Problem(1280, 512, K, cb)
    for m in (1, 3, 16):
        gate, up = xin(m, 1280) * 2, xin(m, 1280)
        x = (ref.silu_mul if act == "silu" else ref.gelu_tanh_mul)(gate, up)
        poison((m, 512))
        y = fused_ops.exl3_linear_act(gate, up, p.trellis, p.suh, p.svh, cb, ACT_CODES[act])
        check(y, x, p, f"act={act} K={K} cb={cb} m={m}")
    assert_workspace_clean(fused_ops)


def test_gated_mlp_forms_the_product_in_down(fused_ops, counting_kernels) -> None:
    """The plan's gated MLP (:class:`~exl3_core.plan.blocks.GatedMLPRunner`) with an EXL3 down projection forms
    act(gate) * up inside the down launch at decode sizes (no separate act*mul kernel), and matches the
    module's own two-launch forward; with the fusion off in the tuning the separate kernel runs."""
    import dataclasses

    from exl3_core.archkit.batch import BatchMeta
    from exl3_core.nn.mlp import GatedMLP
    from exl3_core.nn.module import ForwardState
    from exl3_core.plan.blocks import GatedMLPRunner
    from exl3_core.quant.exl3.linear import EXL3Linear
    from exl3_core.tuning import FusionTuning, Tuning

    def lin(k: int, n: int) -> EXL3Linear:
        t = torch.randint(-32768, 32768, (k // 16, n // 16, 64), dtype=torch.int16)
        return EXL3Linear(t, (rand_scales(k) * 0.05).cpu(), rand_scales(n).cpu(), CB_MUL1, k, n).to(DEV)

    mlp = GatedMLP(hidden_size=256, intermediate_size=512, act="silu", gate_key="g", up_key="u", down_key="d")
    mlp.gate, mlp.up, mlp.down = lin(256, 512), lin(256, 512), lin(512, 256)
    products: list[int] = []
    separate = mlp.act_mul
    mlp.act_mul = lambda g, u: products.append(1) or separate(g, u)  # type: ignore[method-assign]
    x = xin(2, 256)
    state = ForwardState(BatchMeta.full(torch.zeros(1, 2, dtype=torch.long, device=DEV)))
    want = mlp(x)
    assert products, "the module's own forward forms the product with its kernel"
    products.clear()
    on = counting_kernels()
    y = GatedMLPRunner(mlp, Tuning.h200(), _plan_device(), on).forward(x, state)
    assert not products and on.calls.get("act") == 1, \
        f"the separate act*mul kernel ran although the down projection can form the product: {on.calls}"
    assert y.shape == want.shape and rel_err(y, want) < 1e-3
    off = counting_kernels()
    tuning = dataclasses.replace(Tuning.h200(), fusion=FusionTuning(act_in_down=False))
    y2 = GatedMLPRunner(mlp, tuning, _plan_device(), off).forward(x, state)
    assert products and "act" not in off.calls, off.calls
    assert rel_err(y2, want) < 1e-3
