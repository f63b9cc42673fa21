"""`exl3 generate` with no model argument: the embedded default model answers coherently on CPU,
in under a minute once the model has been imported."""
from __future__ import annotations

import os
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
                      "--max-new-tokens", "24"], cache_dir)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout, out.stdout
    assert "importing" not in out.stderr  # reused the cached import
    assert secs < 60, f"exl3 generate took {secs:.1f} s"


def test_chat_reads_turns_from_stdin() -> None:
    cache_dir = imported_model().parent.parent
    out, _ = _run(["chat", "--max-new-tokens", "16"], cache_dir,
                  stdin="What is the capital of France?\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout, out.stdout


def test_generate_bad_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    out, _ = _run(["generate", "hi", "--model", str(tmp_path / "missing")], tmp_path)
    assert out.returncode == 1
    assert "missing" in out.stderr and "does not exist" in out.stderr


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
