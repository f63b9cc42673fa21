"""CPU: what the bf16 prefill's precision costs a real model. Perplexity of the embedded default model
(SmolLM2-135M-Instruct, imported with dense linears) on the built-in evaluation text: in fp32 (the
reference), in fp16 (the GPU's dtype), and in fp16 with every forward forced through the bf16 prefill
path, the dense linears' weights rounded to bf16 as the GPU path rounds its rebuilt W
(``StandardDecoder._prefill_dtype``; on CUDA the real predicate takes only EXL3 linears).

    python bench/ppl_bf16_cpu.py [--rows 40] [--ctx 512]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from exl3_core.archkit import Model
from exl3_core.archkit.decoder import StandardDecoder
from exl3_core.convert.default_model import default_model_dir
from exl3_core.eval.cli import eval_ids
from exl3_core.eval.ppl import make_windows, perplexity
from exl3_core.nn.linear import DenseLinear


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--ctx", type=int, default=512)
    args = ap.parse_args()
    d = default_model_dir(progress=False)
    own_pd, own_fwd = StandardDecoder._prefill_dtype, DenseLinear.forward

    def bf16(self, x: torch.Tensor, meta) -> torch.dtype | None:
        return torch.bfloat16 if x.dtype == torch.float16 else None

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    for name, dtype, patched in (("fp32", torch.float32, False), ("fp16", torch.float16, False),
                                 ("bf16 prefill", torch.float16, True)):
        model = Model.from_pretrained(str(d), device="cpu", dtype=dtype)
        windows = make_windows(eval_ids(str(d), None, None, model.config.hf.vocab_size), args.ctx, args.rows)
        StandardDecoder._prefill_dtype = bf16 if patched else own_pd  # type: ignore[method-assign]
        DenseLinear.forward = dense if patched else own_fwd  # type: ignore[method-assign]
        t = time.time()
        r = perplexity(model, windows.reshape(-1), ctx=args.ctx)
        print(f"{name}: perplexity {r.ppl:.4f} (mean NLL {r.nll:.5f} over {r.tokens} tokens; {time.time() - t:.0f} s)")
    StandardDecoder._prefill_dtype, DenseLinear.forward = own_pd, own_fwd  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
