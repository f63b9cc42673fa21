"""Compile Triton kernels for an sm_90 GPU on a machine without one (run as a script, see
test_triton_sm90_compile.py): a stand-in driver reports an H100/H200 target and every launch becomes a
warm-up, which runs the whole compiler (Python front end, TTIR, TTGIR, LLVM, PTX, ptxas) but no kernel.

The CPU interpreter, which the other kernel tests use, never compiles: a kernel it runs correctly can still
be refused by the compiler (a type that differs between two returns of one function, say). Prints one
line per attention case, ``ok <id>`` or ``FAIL <id>: <error>``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel is decorated
# this checkout's packages, not an installed exl3 elsewhere: a script starts with its own folder first on sys.path
_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(_ROOT), str(_ROOT / "plugins" / "attn_backends" / "src")]

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import (
    driver,
    jit,
)


class _Sm90Driver:
    """The driver calls a launch makes before compiling, answered for device 0, an sm_90 GPU."""

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def _install() -> None:
    driver.set_active(_Sm90Driver())
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    jit.JITFunction.run = compile_only


_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _lora(dtypes: list[torch.dtype]) -> int:
    """The LoRA shrink/expand pair, one input slice and several, each weight dtype; the expand into a residual
    stream that moves its rows' sums of squares too."""
    from exl3_core.lora.kernels import ShrinkInput, lora_add_group, lora_expand, lora_shrink
    from exl3_core.lora.selection import Selection
    from exl3_core.lora.stack import LoraStack, StackEntry

    failed = 0
    dev = torch.device("cpu")
    for dtype in dtypes:
        for rows in (1, 32, 300):
            stacks = [LoraStack.build([StackEntry(0, torch.randn(r, 4096), torch.randn(r, n), 1.0)], 8, dev, dtype)
                      for r, n in ((16, 4096), (64, 1024))]  # ranks 16 and 64: both block shapes
            sel = Selection(dev, 8, rows=rows)
            sel.fill([({0: 1.0}, rows)])
            x = torch.randn(rows, 4096).to(dtype)
            ys = [torch.randn(rows, 4096).to(dtype), torch.randn(rows, 1024).to(dtype)]
            name = f"lora {dtype} rows={rows}"
            try:
                lora_add_group(x, ys, ys, stacks, sel, None)
                ss = torch.zeros(rows)
                lora_expand(lora_shrink(ShrinkInput(x), stacks[:1], sel, None), ys[:1], ys[:1], ss=ss)
                print(f"ok {name}", flush=True)
            except Exception as e:  # noqa: BLE001 - every case is reported
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {str(e)[-2000:]}", flush=True)
    return 1 if failed else 0


def main(pattern: str, dtype_names: str) -> int:
    """``pattern``: ``lora`` or a part of the attention cases' ids; ``dtype_names``: comma-separated, of fp16, bf16
    and fp32 (the attention cases take the first two)."""
    _install()
    dtypes = [_DTYPES[d] for d in dtype_names.split(",")]
    if pattern == "lora":
        return _lora(dtypes)
    import exl3_attn_backends.triton_paged as tp

    from exl3_core.testing import attention as A

    A.device_cc = lambda dev: (9, 0)  # the cases the sm_90 GPU tests run
    cases = [c for dt in dtypes if dt != torch.float32 for c in A.default_cases("cpu", dt)
             if c.spec.cache is not None and pattern in c.id]
    backend = tp.TritonPagedAttention()
    failed = 0
    for case in cases:
        try:
            backend.forward(A.make_args(case, "cpu", seed=0))
            print(f"ok {case.id}", flush=True)
        except Exception as e:  # noqa: BLE001 - every case is reported
            failed += 1
            print(f"FAIL {case.id}: {type(e).__name__}: {str(e)[-2000:]}", flush=True)
    return 1 if failed or not cases else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "", sys.argv[2] if len(sys.argv) > 2 else "fp16,bf16,fp32"))
