"""Speculative decoding options of `exl3 generate` / `exl3 serve`: the same greedy text with a draft model
(the default model drafting for itself) and its stats, and option errors before any model loads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from smol_gguf import imported_model


def _run(args: list[str], cache_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "EXL3_CACHE_DIR": str(cache_dir), "EXL3_DISABLE_PLUGINS": "broken"}
    env.pop("EXL3_DEFAULT_MODEL", None)
    return subprocess.run([sys.executable, "-m", "exl3_core", *args], capture_output=True, text=True, env=env,
                          timeout=300, check=False)


def test_generate_with_a_draft_model_gives_the_same_text() -> None:
    model = imported_model()
    cache_dir = model.parent.parent
    # long enough for the draft-length policy to probe once: on the CPU a draft as costly as the model never pays
    prompt = ["generate", "Write a short story about a dragon.", "--max-new-tokens", "24", "--stats", "--greedy"]
    plain = _run(prompt, cache_dir)
    spec = _run(prompt + ["--draft-model", str(model), "--draft-tokens", "3"], cache_dir)
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert spec.stdout == plain.stdout
    stats = dict(part.strip().rsplit(" ", 1) for part in spec.stderr.strip().splitlines()[-1].split(";")[-1].split(","))
    assert int(stats["draft_tokens"]) > 0 and float(stats["acceptance_rate"]) == 1.0


@pytest.mark.parametrize(("args", "message"), [
    (["--draft-tokens", "0"], "--draft-tokens 0 must be at least 1"),
    (["--ngram-draft", "-2"], "--ngram-draft -2 must be >= 0"),
    (["--ngram-draft", "2", "--draft-model", "."], "not both"),
    (["--draft-model", "/nonexistent/draft"], "--draft-model /nonexistent/draft: no such folder"),
])
def test_bad_speculation_options_are_named(args: list[str], message: str) -> None:
    from exl3_core.cli import build_parser
    from exl3_core.generate_cli import DraftArgs

    for cmd in (["generate", "hi"], ["chat"], ["serve"]):
        with pytest.raises(ValueError, match=message):
            DraftArgs.parse(build_parser().parse_args(cmd + args))


@pytest.mark.parametrize("cmd", [["generate", "hi"], ["serve"]])
def test_bad_speculation_options_fail_before_loading(tmp_path: Path, cmd: list[str]) -> None:
    out = _run([*cmd, "--draft-tokens", "0"], tmp_path)
    assert out.returncode in (1, 2) and "--draft-tokens 0 must be at least 1" in out.stderr, out.stderr
    assert not (tmp_path / "models").exists()  # nothing was imported or loaded
