"""ExLlamaV3's own checkpoints through the CUDA engine (the execution plan's forward): every GEMM path (the
transposed GEMV at m <= 8, the tensor-core GEMM at 9..64 rows, W rebuilt + cuBLAS above) and the graphed
generator land within 1e-2 relative L2 of the logits ExLlamaV3 computed, or of exl3's CPU reference path;
so does the model's own (reference) forward on CUDA.

The vendored set covers the three codebooks, K = 2..8, mixed K per tensor, tied embeddings, and
hidden/intermediate sizes that are not multiples of 128 (model_c: 320/480, padded in storage).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exl3_core import Cache, Config, Generator, Job, Model
from exl3_core.archkit.batch import BatchMeta
from exl3_core.plan import ExecutionPlan

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "exl3-golden"
MODELS = sorted(p.name for p in (GOLDEN / "exl3").iterdir())
TOL = 1e-2  # the CPU test's bound; quantization error against HF fp32 is 0.02..0.84 (stats.json)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float().cpu() - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return load_file(GOLDEN / "input_ids.safetensors")["input_ids"]


def _model(name: str, device: str) -> Model:
    model = Model.from_config(Config.from_directory(GOLDEN / "exl3" / name))
    model.load(device)
    return model


@pytest.mark.parametrize("name", MODELS)
def test_gemm_paths_match_reference_engine(name: str, input_ids: torch.Tensor) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ref = load_file(GOLDEN / "logits" / f"{name}_logits.safetensors")["logits"]
    model = _model(name, "cuda")
    try:
        ids = input_ids.cuda()
        plan = ExecutionPlan(model)

        def engine(x: torch.Tensor) -> torch.Tensor:
            return plan.forward(BatchMeta.full(x)).view(*x.shape, -1)

        cases = {
            "m=128 (both rows packed: W rebuilt, cuBLAS)": (engine(ids), ref),
            "m=64 (one row: tensor-core GEMM)": (torch.cat([engine(ids[i:i + 1]) for i in range(2)]), ref),
            "m=8 (transposed GEMV)": (engine(ids[:, :8].contiguous()), ref[:, :8]),
            "m=1 (decode-size launches)": (engine(ids[1:2, :1]), ref[1:2, :1]),
            "reference forward, m=128": (model.forward(ids), ref),
        }
        for what, (out, want) in cases.items():
            rel = _rel(out, want)
            print(f"golden {name} {what}: rel L2 {rel:.3e}")  # shown with pytest -s
            assert rel < TOL, f"{name}, {what}: rel L2 {rel:.4g} against ExLlamaV3's logits"
    finally:
        model.unload()


@pytest.mark.parametrize("name", [m for m in MODELS if m.startswith(("model_a_exl3_4.0", "model_c_exl3_2.5",
                                                                     "model_c_exl3_3.0bpw_3inst"))])
def test_graphed_generator_matches_cpu_reference(name: str, input_ids: torch.Tensor) -> None:
    """Greedy decode of 32 tokens after a 32-token prompt (prefill graph, then decode graphs): the
    step logits against the CPU reference path's full forward of the same tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _model(name, "cuda")
    try:
        cache = Cache(model, max_num_tokens=1024)
        gen = Generator(model, cache, None, max_batch_size=2, max_seq_len=128)
        assert gen.graphs is not None, "decode graphs declined"
        prompts = [input_ids[i, :32].tolist() for i in range(2)]
        jobs = [Job(p, max_new_tokens=32, stop_at_eos=False, identifier=i, return_logits=True)
                for i, p in enumerate(prompts)]
        gen.enqueue(jobs)
        toks: dict[int, list[int]] = {0: [], 1: []}
        logits: dict[int, list[torch.Tensor]] = {0: [], 1: []}
        while gen.num_remaining():
            for r in gen.iterate():
                toks[r["identifier"]] += r["token_ids"]
                if len(r.get("logits", [])):
                    logits[r["identifier"]].append(r["logits"].float().cpu())
        assert gen.graphs.replays > 0, "no decode step was replayed from a graph"
    finally:
        model.unload()
    cpu = _model(name, "cpu")
    try:
        for i in range(2):
            assert len(toks[i]) == 32
            seq = torch.tensor([prompts[i] + toks[i]])
            want = cpu.forward(seq)[0, 31:63]  # position t predicts token t + 1
            got = torch.cat(logits[i])
            assert got.shape == want.shape
            rel = _rel(got, want)
            print(f"golden {name} generator row {i}: rel L2 {rel:.3e}")
            assert rel < TOL, f"{name}, row {i}: generator logits rel L2 {rel:.4g} against the CPU reference"
            # each greedy pick is the CPU reference's argmax, up to a near-tie
            top2 = want.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * TOL * want.abs().amax(dim=-1)
            picked = torch.tensor(toks[i])
            assert torch.equal(picked[clear], want.argmax(dim=-1)[clear]), f"{name}, row {i}: a greedy pick differs"
    finally:
        cpu.unload()
