"""CPU: what the bf16 prefill's precision costs a real model. Perplexity of the embedded default model
(SmolLM2-135M-Instruct, imported with dense linears) on the built-in evaluation text: in fp32 (the
reference), in fp16 (the GPU's dtype), and in fp16 with every forward forced through the execution plan's
bf16 prefill form (``DecoderExecutor._bf16``), the dense linears' weights rounded to bf16 as the GPU path
rounds its rebuilt W. The plan declines that form here (on the CPU, for dense linears: on CUDA it takes
EXL3 linears only); this script waives exactly those reasons.

    python bench/ppl_bf16_cpu.py [--rows 40] [--ctx 512]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from exl3_core.archkit import Model
from exl3_core.archkit.batch import BatchMeta
from exl3_core.convert.default_model import default_model_dir
from exl3_core.eval.cli import eval_ids
from exl3_core.eval.ppl import make_windows, perplexity
from exl3_core.nn.linear import DenseLinear
from exl3_core.plan import ExecutionPlan


def plan_logits(plan: ExecutionPlan) -> Callable[[torch.Tensor], torch.Tensor]:
    """``input_ids [B, S]`` -> fp32 logits ``[B, S, vocab]`` through ``plan`` (each window a fresh sequence)."""
    def run(ids: torch.Tensor) -> torch.Tensor:
        return plan.forward(BatchMeta.full(ids)).view(*ids.shape, -1)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--ctx", type=int, default=512)
    args = ap.parse_args()
    d = default_model_dir(progress=False)
    own_fwd = DenseLinear.forward

    def dense(self: DenseLinear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    try:
        for name, dtype, forced in (("fp32", torch.float32, False), ("fp16", torch.float16, False),
                                    ("bf16 prefill", torch.float16, True)):
            model = Model.from_pretrained(str(d), device="cpu", dtype=dtype)
            windows = make_windows(eval_ids(str(d), None, None, model.config.hf.vocab_size), args.ctx, args.rows)
            plan = ExecutionPlan(model)
            assert plan.executor is not None, plan.reference_why
            if forced:
                print("bf16 prefill: waiving " + "; ".join(plan.executor.bf16_why))
                plan.executor.bf16_why = []
            DenseLinear.forward = dense if forced else own_fwd  # type: ignore[method-assign]
            t = time.time()
            r = perplexity(plan_logits(plan), windows.reshape(-1), ctx=args.ctx)
            print(f"{name}: perplexity {r.ppl:.4f} (mean NLL {r.nll:.5f} over {r.tokens} tokens; "
                  f"{time.time() - t:.0f} s)")
    finally:
        DenseLinear.forward = own_fwd  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
