"""On CUDA: the fused ops vs their torch references at model sizes, the execution plan's fused forward and
the model's own forward with the Triton kernels vs its unfused forward, and split-KV decode attention (also
replayed from a CUDA graph at other lengths)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exl3_core import ops
from exl3_core.reference import fused as ref
from exl3_core.testing.kernels import captured

pytestmark = pytest.mark.cuda
DEV = "cuda"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def close(out: torch.Tensor, expect: torch.Tensor) -> None:
    assert out.dtype == expect.dtype and out.shape == expect.shape
    tol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), expect.float(), atol=tol * max(1.0, expect.abs().max().item()), rtol=tol)


def test_auto_takes_triton_on_cuda() -> None:
    assert ops.fused_enabled(torch.zeros(1, device=DEV)), "Triton missing? the CUDA model path would stay unfused"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (1, 4096), (7, 576), (2048, 4096), (3, 320)])
def test_rms_norm_residual(rows: int, hidden: int, dtype: torch.dtype) -> None:
    x = (torch.randn(rows, hidden, device=DEV) * 3).to(dtype)
    res = torch.randn(rows, hidden, device=DEV).to(dtype)
    w = 1 + 0.3 * torch.randn(hidden, device=DEV)
    normed, new_res = ops.rms_norm_residual(x, res, w, 1e-6, 0.0, impl="triton")
    r_normed, r_res = ref.rms_norm_residual(x, res, w, 1e-6, 0.0)
    torch.testing.assert_close(new_res, r_res, atol=0, rtol=0)
    close(normed, r_normed)
    close(ops.rms_norm(x, w, 1e-6, 1.0, impl="triton"), ref.rms_norm(x, w, 1e-6, 1.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 8192), (1, 14336), (33, 1536), (5, 320)])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul(rows: int, inter: int, dtype: torch.dtype, act: str) -> None:
    g = (torch.randn(rows, inter, device=DEV) * 2).to(dtype)
    u = torch.randn(rows, inter, device=DEV).to(dtype)
    fn = ops.silu_mul if act == "silu" else ops.gelu_tanh_mul
    ref_fn = ref.silu_mul if act == "silu" else ref.gelu_tanh_mul
    close(fn((g, u), impl="triton"), ref_fn((g, u)))
    close(fn(torch.cat([g, u], -1), impl="triton"), ref_fn((g, u)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("T,hq,hk,d,rot", [(1, 32, 8, 128, 128), (1, 32, 8, 64, 64), (300, 6, 2, 64, 32)])
def test_rope_apply(T: int, hq: int, hk: int, d: int, rot: int, interleaved: bool, dtype: torch.dtype) -> None:
    q = torch.randn(T, hq, d, device=DEV).to(dtype)
    k = torch.randn(T, hk, d, device=DEV).to(dtype)
    pos = torch.randint(0, 8000, (T,), device=DEV).float()
    f = pos[:, None] * (1.0 / 10000 ** (torch.arange(rot // 2, device=DEV).float() / (rot // 2)))[None, :]
    cos, sin = f.cos(), f.sin()
    qr, kr = q.clone(), k.clone()
    ref.rope_apply(qr, kr, cos, sin, rot, interleaved)
    ops.rope_apply(q, k, cos, sin, rot, interleaved, impl="triton")
    close(q, qr)
    close(k, kr)


@pytest.mark.parametrize("hf_arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_model_fused_equals_unfused(hf_arch: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from exl3_core.archkit import Config, Model
    from exl3_core.archkit.batch import BatchMeta
    from exl3_core.plan import ExecutionPlan
    from exl3_core.testing.arch import build_checkpoint, rel_err, tiny_variants

    cfg = next(iter(tiny_variants(hf_arch).values()))
    build_checkpoint(hf_arch, cfg, tmp_path / "ckpt", seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3)).to(DEV)
    model = Model.from_config(Config.from_directory(tmp_path / "ckpt")).load(device=DEV, dtype=torch.float32)
    plan = ExecutionPlan(model)
    assert plan.fused and plan.executor is not None and not plan.executor.chain_why, plan.report()
    with torch.no_grad():
        engine = plan.forward(BatchMeta.full(ids)).view(*ids.shape, -1)  # residual adds inside the norms
        fused = model(ids)  # the modules' own forward, its norms, RoPE and activations in Triton
        old = ops.set_enabled(False)
        try:
            unfused = model(ids)
        finally:
            ops.set_enabled(old)
    assert rel_err(fused, unfused) < 1e-4
    assert rel_err(engine, unfused) < 1e-4


# -- split-KV decode ------------------------------------------------------------------------------

def _decode_case(hd: int, hq: int, hkv: int, past: tuple[int, ...], dtype: torch.dtype, **kw):
    from exl3_core.attention.spec import AttnSpec, device_cc
    from exl3_core.testing.attention import Case

    spec = AttnSpec(head_dim=hd, num_q_heads=hq, num_kv_heads=hkv, dtype=dtype, cache=kw.pop("cache", "kv/fp16"),
                    phase="decode", page_size=16, device_type="cuda", device_cc=device_cc(torch.device(DEV)), **kw)
    return Case(spec, (1,) * len(past), past)


@pytest.mark.parametrize("shape", [  # built inside the test: device_cc needs CUDA at collection otherwise
    (128, 32, 8, (4095,), torch.float16, {}),
    (128, 32, 8, (255, 4000, 0, 1000), torch.float16, {}),
    (64, 32, 8, (3000,), torch.bfloat16, {"window": 512}),
    (128, 8, 2, (2000, 17), torch.float32, {}),
    (576, 16, 1, (1500, 3), torch.float16, {"head_dim_v": 512, "cache": "mla/fp16"}),
], ids=lambda s: f"d{s[0]}-h{s[1]}x{s[2]}-p{'.'.join(map(str, s[3]))}-{str(s[4])[6:]}-{'-'.join(s[5])}")
def test_split_kv_decode(shape: tuple) -> None:
    pytest.importorskip("triton")
    import exl3_attn_backends.triton_paged as tp

    from exl3_core.testing.attention import check_backend, make_args

    hd, hq, hkv, past, dtype, kw = shape
    case = _decode_case(hd, hq, hkv, past, dtype, **kw)
    b = tp.TritonPagedAttention()
    assert tp.choose_num_splits(make_args(case, DEV)) > 1
    check_backend(b, case, DEV, seed=5)


def test_split_kv_graph_replay_at_other_lengths() -> None:
    """Capture one decode call at the cache-capacity bound, replay it with new lengths and queries."""
    pytest.importorskip("triton")
    import exl3_attn_backends.triton_paged as tp

    from exl3_core.reference.attention import attention as reference_attention
    from exl3_core.testing.attention import make_args

    case = _decode_case(128, 32, 8, (4000, 100), torch.float16)
    args = make_args(case, DEV, seed=1)
    width = args.page_table.shape[1]
    table = args.page_table.clone()
    table[1] = table[0]  # every row may grow to 4001 tokens: give both the fully written pages
    static = args._replace(max_seqlen_k=width * 16, seq_lens_k=args.seq_lens_k.clone(), q=args.q.clone(),
                           page_table=table)
    b = tp.TritonPagedAttention()
    g, out = captured(lambda: b.forward(static))  # compiled off the capture
    for lens in ((4001, 101), (17, 1), (2500, 4001)):
        static.seq_lens_k.copy_(torch.tensor(lens, dtype=torch.int32))
        static.q.copy_(torch.randn_like(static.q))
        g.replay()
        torch.cuda.synchronize()
        ref_out = reference_attention(static._replace(max_seqlen_k=max(lens)))
        err = (out.float() - ref_out.float()).abs().max().item()
        assert err <= 2e-3 * max(1.0, ref_out.float().abs().max().item()), (lens, err)


def test_split_kv_graph_after_counter_growth() -> None:
    """A split-KV decode captured with the cached arrival counters still replays correctly after an
    eager call for more head blocks outgrew them (the cache moved to a larger buffer) and freed memory
    of the old buffer's size was handed out and scribbled on: the old buffer is retired, not freed."""
    pytest.importorskip("triton")
    import exl3_attn_backends.triton_paged as tp

    import exl3_core.kernels.counters as kc
    from exl3_core.reference.attention import attention as reference_attention
    from exl3_core.testing.attention import make_args

    small = make_args(_decode_case(128, 32, 8, (300,), torch.float16), DEV, seed=2)
    key = ("decode_split", "cuda", small.q.device.index)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tp.decode_split_kv(small, 8)  # compile, and the cached counters exist before the capture
    torch.cuda.current_stream().wait_stream(s)
    old = kc._cache[key]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tp.decode_split_kv(small, 8)
    seqs = old.numel() // 8 + 1  # 8 kv heads x 1 head block per sequence: more programs than it holds
    big = make_args(_decode_case(128, 32, 8, (40,) * seqs, torch.float16), DEV, seed=3)
    tp.decode_split_kv(big, 2)
    assert kc._cache[key] is not old and kc._cache[key].numel() > old.numel()
    junk = [torch.full((n,), 5, dtype=torch.int32, device=DEV) for n in (old.numel(), old.numel() // 2) for _ in range(16)]
    expect = reference_attention(small)
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), expect.float(), atol=2e-3, rtol=2e-3)
    assert all(int(j.min()) == 5 for j in junk), "the replay wrote into memory the old counters gave back"


def test_greedy_pack_counter_grown_during_capture() -> None:
    """A greedy pick captured for more rows than the cached arrival counters hold: the graph gets its
    own zeroed counters, replays equal the reference, and the cache is not handed the graph's buffer."""
    import exl3_core.kernels.counters as kc

    key = ("greedy_pack", "cuda", torch.cuda.current_device())
    x = torch.randn(2, 5000, device=DEV)
    ops.greedy_pack(x, impl="triton")  # compiled and cached off the capture
    cached = kc._cache[key]
    rows = cached.numel() + 3
    big = torch.randn(rows, 9000, device=DEV, dtype=torch.float16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.greedy_pack(big, impl="triton")
    assert kc._cache[key] is cached, "the cache took a buffer from the graph's pool"
    for _ in range(3):  # each replay's last programs leave the graph's counters clean
        big.copy_(torch.randn_like(big))
        g.replay()
        torch.cuda.synchronize()
        exp = ref.greedy_pack(big)
        torch.testing.assert_close(out, exp, atol=0, rtol=0)
    got = ops.greedy_pack(x, impl="triton")  # eager calls still work with the cached counters
    torch.testing.assert_close(got, ref.greedy_pack(x), atol=0, rtol=0)
