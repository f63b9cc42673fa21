"""Time ``exl3 convert`` of a named bench shape (random bf16 weights) on the GPU.

Writes a random-weight HF Llama-family checkpoint of the shape (optionally only the first
``--layers`` blocks, to fit a time-limited run; the per-block time is reported so the full depth
can be extrapolated), then runs the converter with its default calibration (250 x 2048 tokens;
random rows, as the folder has no tokenizer) and prints per-module wall times.

    python bench/convert_gpu.py --shape 8b --layers 8 --bpw 4.0 --work /tmp/conv
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from exl3_core.convert.pipeline import convert

SHAPES = Path(__file__).resolve().parents[1] / "exl3_core" / "data" / "bench_shapes.json"


def write_random_model(d: Path, shape: dict, layers: int, tf: dict, device: str) -> float:
    """HF-layout safetensors with N(0, 0.02) linears/embeddings and 1 + 0.1 N(0,1) norms; returns seconds."""
    t = time.monotonic()
    d.mkdir(parents=True, exist_ok=True)
    h, i, v, hd = shape["hidden"], shape["intermediate"], shape["vocab"], shape["head_dim"]
    nq, nkv = shape["heads"], shape["kv_heads"]
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*s: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*s, generator=g, device=device) * std).to(torch.bfloat16).cpu()

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=g, device=device)).to(torch.bfloat16).cpu()

    save_file({"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": norm(h), "lm_head.weight": rnd(v, h)},
              str(d / "model-00000.safetensors"), metadata={"format": "pt"})
    for li in range(layers):
        p = f"model.layers.{li}."
        save_file({p + "self_attn.q_proj.weight": rnd(nq * hd, h), p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
                   p + "self_attn.v_proj.weight": rnd(nkv * hd, h), p + "self_attn.o_proj.weight": rnd(h, nq * hd),
                   p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
                   p + "mlp.down_proj.weight": rnd(h, i), p + "input_layernorm.weight": norm(h),
                   p + "post_attention_layernorm.weight": norm(h)},
                  str(d / f"model-{li + 1:05d}.safetensors"), metadata={"format": "pt"})
    cfg = {**tf, "hidden_size": h, "intermediate_size": i, "num_hidden_layers": layers, "num_attention_heads": nq,
           "num_key_value_heads": nkv, "head_dim": hd, "vocab_size": v, "max_position_embeddings": 8192,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return time.monotonic() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--layers", type=int, default=0, help="blocks to build (0: the shape's full depth)")
    ap.add_argument("--bpw", type=float, default=4.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cal-rows", type=int, default=250)
    ap.add_argument("--cal-cols", type=int, default=2048)
    ap.add_argument("--work", default="/tmp/exl3_convert_bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--verbose", action="store_true", help="print every report line (per-tensor times)")
    ap.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                    help="TF32 calibration matmuls (the converter's default on CUDA); --no-tf32 for exact fp32")
    ap.add_argument("--refit-final", type=float, default=None,
                    help="the converter's --refit-final β (post-pass scale refit; default: the converter's)")
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler over the embedding stage and the first block only (kernels and host ops)")
    a = ap.parse_args()
    data = json.loads(SHAPES.read_text())
    shape = data["shapes"][a.shape]
    layers = a.layers or shape["layers"]
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    src, out = work / "hf", work / "exl3"
    gen_s = write_random_model(src, shape, layers, data["transformers"], a.device)
    print(f"random {a.shape} checkpoint, {layers} of {shape['layers']} blocks: written in {gen_s:.1f} s", flush=True)
    t0 = time.monotonic()
    stamps: list[tuple[str, float]] = []

    def report(line: str) -> None:
        stamps.append((line, time.monotonic() - t0))
        if a.verbose or re.match(r"\[\d+/\d+\]", line) or line.startswith("wrote"):
            print(f"{time.monotonic() - t0:8.1f} s  {line.strip()}", flush=True)

    if a.profile:  # where a block's time goes: stop after the first block (stage index 1)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            convert(src, out, a.bpw, device=a.device, cal_rows=a.cal_rows, cal_cols=a.cal_cols, progress=False,
                    report=report, cal_random=1.0, tf32=a.tf32, _stop_after_module=1)
        avg = prof.key_averages()
        print(avg.table(sort_by="device_time_total", row_limit=25, max_name_column_width=70))
        print(avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
        return
    extra = {} if a.refit_final is None else {"refit_final": a.refit_final}
    convert(src, out, a.bpw, device=a.device, cal_rows=a.cal_rows, cal_cols=a.cal_cols, progress=False,
            report=report, cal_random=1.0, tf32=a.tf32, **extra)
    total = time.monotonic() - t0
    mod = [(ln, t) for ln, t in stamps if re.match(r"\[\d+/\d+\]", ln)]
    blocks = [t1 - t0_ for (l0, t0_), (l1, t1) in zip(mod, mod[1:]) if "layers." in l1]
    per_block = sorted(blocks)[len(blocks) // 2] if blocks else float("nan")
    rest = total - sum(blocks)
    est = rest + per_block * shape["layers"]
    print(f"convert: {total:.1f} s for {layers} blocks; median block {per_block:.1f} s; "
          f"everything else {rest:.1f} s; estimated full depth ({shape['layers']} blocks): {est / 60:.1f} min",
          flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(shape=a.shape, layers=layers, bpw=a.bpw, total_s=total,
                                                median_block_s=per_block, other_s=rest, est_full_s=est,
                                                gen_s=gen_s, lines=stamps), indent=1))


if __name__ == "__main__":
    sys.exit(main())
