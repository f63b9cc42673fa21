"""Static instruction counts of a CUDA kernel's loops, on a machine with nvcc and no GPU.

Compiles one ``csrc`` file to an sm_90 cubin with the extension's flags (``csrc/compile_env.sh``), disassembles it
(``cuobjdump``: the toolkit's, else the one Triton ships), and for every function matching ``--kernel`` prints each
loop (a backward branch's span) with its instruction count and most frequent opcodes. A loop's count is static:
both sides of a branch inside it are counted, so compare like with like (the same loop before and after a change),
and judge speed on the GPU. Predicated instructions count once.

    python bench/sass_loops.py csrc/attn/decode_attn_qsplit.cu --kernel 'qsplit_kernelILi128ELi4ELi4E'
    python bench/sass_loops.py csrc/attn/decode_attn_qsplit.cu --kernel ILi128ELi4ELi4E --min 200 --top 16
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_INS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_FUNC = re.compile(r"Function\s*:\s*(\S+)")
_PRED = re.compile(r"^@!?U?P\w+\s+")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        raise SystemExit("no cuobjdump on PATH and no Triton to take one from") from None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not bundled.exists():
        raise SystemExit(f"no cuobjdump on PATH or at {bundled}")
    return str(bundled)


def compile_sass(src: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "out.cubin"
        script = (f'source csrc/compile_env.sh > /dev/null && "$NVCC" "${{FLAGS[@]}}" $INC -DTORCH_EXTENSION_NAME=_C '
                  f'-cubin "{src}" -o "{cubin}"')
        done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"nvcc failed on {src}:\n{done.stderr[-4000:]}")
        return subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Each function's instructions as (address, text without the predicate guard)."""
    out: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] | None = None
    for line in sass.splitlines():
        f = _FUNC.search(line)
        if f:
            current = out.setdefault(f.group(1), [])
            continue
        m = _INS.match(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), _PRED.sub("", m.group(2))))
    return out


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(start, end) addresses of every backward branch's span, outermost first."""
    spans = set()
    for addr, text in ins:
        if text.startswith("BRA"):
            target = re.search(r"0x([0-9a-f]+)", text)
            if target and int(target.group(1), 16) <= addr:
                spans.add((int(target.group(1), 16), addr))
    return sorted(spans, key=lambda s: s[0] - s[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="a .cu file under csrc/")
    ap.add_argument("--kernel", default="", help="regex a function's mangled name must match")
    ap.add_argument("--min", type=int, default=50, help="loops of fewer instructions are left out")
    ap.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    a = ap.parse_args()
    pattern = re.compile(a.kernel)
    shown = 0
    for name, ins in functions(compile_sass(a.source.resolve())).items():
        if not pattern.search(name):
            continue
        shown += 1
        print(f"{name}: {len(ins)} instructions")
        for lo, hi in loops(ins):
            ops = collections.Counter(t.split()[0].split(".")[0] for addr, t in ins if lo <= addr <= hi)
            n = sum(ops.values())
            if n >= a.min:
                top = ", ".join(f"{op} {c}" for op, c in ops.most_common(a.top))
                print(f"  loop {lo:#06x}-{hi:#06x}: {n} instructions ({top})")
    if not shown:
        sys.exit(f"no function in {a.source} matches {a.kernel!r}")


if __name__ == "__main__":
    main()
