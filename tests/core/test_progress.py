"""Progress bars come from one library (tqdm) through exl3_core.progress: lines written while a bar is up
land above it, a heartbeat keeps a long step's bar moving, EXL3_NO_PROGRESS silences them, and no
hand-written bar drawing or PNG writing is left in exl3_core."""
from __future__ import annotations

import ast
import io
import logging
import re
import threading
import time
from pathlib import Path

import pytest
import tqdm

import exl3_core
from exl3_core import progress, settings
from exl3_core.progress import AboveBars, Progress

CORE = Path(exl3_core.__file__).resolve().parent


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _screen(raw: str) -> list[str]:
    """What a terminal shows: every carriage return overwrites the line, ANSI cursor codes dropped."""
    raw = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", raw)
    return [line.rsplit("\r", 1)[-1].rstrip() for line in raw.split("\n")]


def _leading_text(node: ast.expr) -> str | None:
    """The text an expression starts with, when it starts with a literal ("\r" + x, f"\r{x}", "\r")."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        return _leading_text(node.values[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _leading_text(node.left)
    return None


def test_no_hand_written_drawing_or_png_left() -> None:
    """No module redraws a line itself (text printed from a carriage return, ANSI cursor codes, the
    terminal's width) or writes PNG chunks itself: tqdm draws the bars, matplotlib the plots."""
    offenders: list[str] = []
    for path in sorted(CORE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            where = f"{path.relative_to(CORE)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
                v = node.value if isinstance(node.value, bytes) else node.value.encode("utf-8", "surrogatepass")
                if b"\x1b[" in v or b"\x89PNG" in v or b"IHDR" in v or b"IDAT" in v:
                    offenders.append(f"{where}: {node.value!r:.40}")
            if isinstance(node, ast.Call) and (
                    isinstance(node.func, ast.Attribute) and node.func.attr == "write"
                    or isinstance(node.func, ast.Name) and node.func.id == "print"):
                for arg in node.args:
                    text = _leading_text(arg)
                    if text is not None and text.startswith("\r") and not text.startswith("\r\n"):
                        offenders.append(f"{where}: prints from a carriage return")
            if isinstance(node, ast.Attribute) and node.attr == "get_terminal_size":
                offenders.append(f"{where}: measures the terminal")
    assert not offenders, "\n".join(offenders)
    assert progress.tqdm is tqdm.tqdm  # the bars are the library's


def test_lines_go_above_the_bar(clean_settings: pytest.MonkeyPatch) -> None:
    tty = _Tty()
    with Progress(4, "job", unit="tensor", stream=tty) as bar:
        bar.advance(1, "a")
        bar.write("report line one")
        bar.advance(2, "b")
        handler = AboveBars(tty)
        logging.getLogger("exl3.test").addHandler(handler)
        try:
            logging.getLogger("exl3.test").warning("a logged warning")
        finally:
            logging.getLogger("exl3.test").removeHandler(handler)
        bar.advance(1, "c")
    screen = _screen(tty.getvalue())
    assert "report line one" in screen and "a logged warning" in screen  # whole lines, nothing else on them
    bars = [s for s in screen if s.startswith("job:")]
    assert bars and "4/4" in bars[-1] and screen[-1] == "" and screen[-2] == bars[-1]
    assert screen.index("report line one") < screen.index("a logged warning") < screen.index(bars[-1])


def test_heartbeat_moves_a_long_step(clean_settings: pytest.MonkeyPatch) -> None:
    tty = _Tty()
    before = threading.active_count()
    with Progress(3, "convert", stream=tty, heartbeat_s=0.05) as bar:
        bar.step("layer 1: quantizing")
        n0 = tty.getvalue().count("\r")
        time.sleep(0.5)  # nothing reported meanwhile
        assert tty.getvalue().count("\r") >= n0 + 3  # redrawn on its own
        assert "layer 1: quantizing" in _screen(tty.getvalue())[-1]
    time.sleep(0.05)
    assert threading.active_count() == before  # the heartbeat thread ended with the bar


def test_silent_without_a_terminal_or_with_no_progress(clean_settings: pytest.MonkeyPatch) -> None:
    pipe = io.StringIO()
    with Progress(3, "x", stream=pipe, heartbeat_s=0.01) as bar:
        bar.advance(3, "done")
    assert pipe.getvalue() == ""
    clean_settings.setenv("EXL3_NO_PROGRESS", "1")
    settings.reload()
    tty = _Tty()
    with Progress(3, "x", stream=tty) as bar:
        bar.advance(3)
        bar.write("still printed")
    assert _screen(tty.getvalue()) == ["still printed", ""]


def test_callback_replaces_the_bar(clean_settings: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int, str]] = []
    with Progress(2, "x", callback=lambda *a: seen.append(a)) as bar:
        bar.advance(1, "first")
        bar.step("second: sub-step")
        bar(2, 5, "second")  # the callback form may change the total
    assert seen == [(1, 2, "first"), (1, 2, "second: sub-step"), (2, 5, "second")]


def test_convert_bar_shows_sub_steps_and_tensors(tmp_path: Path, clean_settings: pytest.MonkeyPatch) -> None:
    """A conversion draws one bar over its tensors whose label names each sub-step of a layer (the
    calibration pass, each tensor's quantization, the forward pass), with the report lines above it."""
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from convert_tiny import build_tiny

    from exl3_core.convert.pipeline import convert

    src = build_tiny("LlamaForCausalLM", tmp_path / "src")
    tty = _Tty()
    clean_settings.setattr(sys, "stderr", tty)
    convert(src, tmp_path / "out", 3.0, cal_rows=4, cal_cols=32, head_bits=16)
    raw = tty.getvalue()
    for sub in ("calibration pass", "q_proj: quantizing", "forward pass"):
        assert sub in raw, sub
    screen = _screen(raw)
    assert any(s.startswith("[2/") for s in screen)  # the module report line, on a line of its own
    final = [s for s in screen if s.startswith("quantizing src")][-1]
    n = re.search(r"(\d+)/(\d+)", final)
    assert n is not None and n.group(1) == n.group(2) and int(n.group(2)) > 0


def test_bench_reports_each_step() -> None:
    from exl3_core.bench.models import parse_shape
    from exl3_core.bench.run import run_bench

    seen: list[tuple[int, int, str]] = []
    run_bench(parse_shape("custom(256,512,2,4,2,512)"), device="cpu", contexts=(8, 12), batches=(2,),
              prefill_tokens=(8,), new_tokens=2, log=lambda s: None, progress=lambda *a: seen.append(a))
    assert [s[0] for s in seen] == list(range(len(seen))) and {s[1] for s in seen} == {len(seen) - 1}
    assert [s[2] for s in seen] == ["building the random-weight model", "decode b=1 ctx=8", "decode b=1 ctx=12",
                                    "decode b=2 ctx=8", "prefill 8 tokens", "done"]
