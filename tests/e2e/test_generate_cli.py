"""`exl3 generate` and `exl3 chat` with no model argument: the embedded default model answers coherently
on CPU, in under a minute once the model has been imported; it samples by default (llama.cpp's settings,
as the model's generation_config.json has none) and decodes greedily with --greedy; Ctrl-C in chat stops
the reply, not the chat."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from smol_gguf import imported_model  # noqa: E402  (shared once-per-session import)


def _run(args: list[str], cache_dir: Path, stdin: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "EXL3_CACHE_DIR": str(cache_dir), "EXL3_DISABLE_PLUGINS": "broken"}
    env.pop("EXL3_DEFAULT_MODEL", None)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "exl3_core", *args], capture_output=True, text=True, env=env,
                         input=stdin, timeout=300)
    return out, time.perf_counter() - t0


def test_generate_default_model_is_coherent_and_fast() -> None:
    cache_dir = imported_model().parent.parent  # <cache>/models/<name>
    out, secs = _run(["generate", "What is the capital of France? Answer in one sentence.",
                      "--max-new-tokens", "24", "--greedy"], cache_dir)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout, out.stdout
    assert "importing" not in out.stderr  # reused the cached import
    assert secs < 60, f"exl3 generate took {secs:.1f} s"


def test_chat_reads_turns_from_stdin() -> None:
    cache_dir = imported_model().parent.parent
    out, _ = _run(["chat", "--max-new-tokens", "16", "--greedy"], cache_dir,
                  stdin="What is the capital of France?\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout, out.stdout


def test_generate_bad_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    out, _ = _run(["generate", "hi", "--model", str(tmp_path / "missing")], tmp_path)
    assert out.returncode == 1
    assert "missing" in out.stderr and "does not exist" in out.stderr


def test_generate_samples_by_default_and_seed_repeats() -> None:
    cache_dir = imported_model().parent.parent
    args = ["generate", "Name a color.", "--max-new-tokens", "12", "--stats"]
    a, _ = _run([*args, "--seed", "5"], cache_dir)
    assert a.returncode == 0, a.stderr
    assert "sampling: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05 (llama.cpp defaults)" in a.stderr
    b, _ = _run([*args, "--seed", "5"], cache_dir)
    assert b.stdout == a.stdout  # the same seed draws the same reply
    g, _ = _run([*args, "--temperature", "0"], cache_dir)
    assert g.returncode == 0 and "sampling: greedy" in g.stderr


def test_chat_ctrl_c_stops_the_reply_then_exits() -> None:
    cache_dir = imported_model().parent.parent
    env = {**os.environ, "EXL3_CACHE_DIR": str(cache_dir), "EXL3_DISABLE_PLUGINS": "broken", "PYTHONUNBUFFERED": "1"}
    env.pop("EXL3_DEFAULT_MODEL", None)
    p = subprocess.Popen([sys.executable, "-m", "exl3_core", "chat", "--max-new-tokens", "400", "--seed", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdin is not None and p.stdout is not None
    try:
        p.stdin.write(b"Write a very long story about a dragon.\n")
        p.stdin.flush()
        os.set_blocking(p.stdout.fileno(), False)
        got, deadline = b"", time.monotonic() + 120
        while len(got) < 20 and time.monotonic() < deadline:  # the reply is streaming
            got += p.stdout.read() or b""
            time.sleep(0.05)
        assert len(got) >= 20, got
        p.send_signal(signal.SIGINT)  # stops this reply only
        time.sleep(1.0)
        assert p.poll() is None, p.stderr.read() if p.stderr else ""
        p.stdin.write(b"/reset\nSay hi.\n")
        p.stdin.flush()
        time.sleep(2.0)
        assert p.poll() is None
        p.send_signal(signal.SIGINT)  # the second reply, or the prompt after it: either stops
        time.sleep(1.0)
        if p.poll() is None:
            p.send_signal(signal.SIGINT)  # at the prompt: ends the chat
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert b"reply stopped" in err and b"Traceback" not in err


def test_missing_tokenizer_is_reported_before_the_model_loads(tmp_path: Path, monkeypatch, capsys) -> None:
    import exl3_core
    from exl3_core.cli import main

    src = imported_model()
    model_dir = tmp_path / "no-tokenizer"
    model_dir.mkdir()
    for f in src.iterdir():
        if f.name != "tokenizer.json":
            (model_dir / f.name).symlink_to(f)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built before the tokenizer was checked")

    monkeypatch.setattr(exl3_core.Model, "from_config", refuse)
    assert main(["generate", "hi", "--model", str(model_dir), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "no tokenizer.json" in err and str(model_dir) in err and "save_pretrained" in err, err
