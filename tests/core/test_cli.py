"""The ``exl3`` command line's conventions, through real subprocesses where the exit status and stderr
matter: every option's default in --help, a description for every job, exit 2 for usage errors and 1 for
runtime errors (one line, no traceback), CUDA asked for without CUDA, bench refusing a CPU-only machine,
generate without a prompt; and the sampling defaults of generate/chat."""
from __future__ import annotations

import argparse
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exl3_core.cli import build_parser

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def exl3(*args: str, stdin: str | None = "", timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EXL3_DISABLE_PLUGINS": "broken"}
    env.pop("EXL3_LOG_LEVEL", None)  # DEBUG would re-raise with a traceback
    return subprocess.run([sys.executable, "-m", "exl3_core", *args], capture_output=True, text=True, env=env,
                          input=stdin, timeout=timeout, check=False)


def _parsers(p: argparse.ArgumentParser, path: str = "exl3") -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(path, p)]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out += _parsers(sub, f"{path} {name}")
    return out


def test_every_job_has_a_description_and_every_default_is_shown() -> None:
    parsers = _parsers(build_parser())
    names = {path for path, _ in parsers}
    assert {"exl3 generate", "exl3 chat", "exl3 convert", "exl3 eval ppl", "exl3 eval kld", "exl3 eval plot",
            "exl3 bench", "exl3 plugins", "exl3 import-gguf"} <= names
    missing: list[str] = []
    for path, p in parsers:
        if not (p.description or "").strip():
            missing.append(f"{path}: no description")
        fmt = p._get_formatter()
        for a in p._actions:
            if a.help == argparse.SUPPRESS or isinstance(a, (argparse._HelpAction, argparse._VersionAction,
                                                             argparse._SubParsersAction)):
                continue
            text = fmt._expand_help(a) if a.help else ""
            if a.default is not None and a.default is not False and "default" not in text.lower():
                missing.append(f"{path} {a.option_strings or a.dest}: default {a.default!r} not shown")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize(("args", "shown"), [
    (["generate"], ["(default: 256)", "(default: 8192)", "temperature 0.8, top-k 40, top-p 0.95, min-p 0.05"]),
    (["convert"], ["(default: mul1)", "(default: cpu)", "0.148, i.e. 20 of every 135 rows"]),
    (["bench"], ["(default: 1b)", "(default: 4.0)", "(default: mcg)"]),
])
def test_help_shows_the_defaults_users_asked_about(args: list[str], shown: list[str]) -> None:
    out = exl3(*args, "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    for s in shown:
        assert s in text, (s, out.stdout)
    assert "20/135" not in text


def test_serve_and_eval_jobs_have_descriptions() -> None:
    for args in (["serve"], ["eval", "ppl"], ["eval", "kld"], ["eval", "plot"]):
        out = exl3(*args, "--help")
        assert out.returncode == 0, out.stderr
        body = out.stdout.split("\n\n")
        assert len(body) > 2 and not body[1].lstrip().startswith(("options:", "positional")), out.stdout


def test_usage_errors_exit_2() -> None:
    for args, word in ((["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
                       (["generate", "hi", "--top-p", "1.5"], "--top-p"),
                       (["no-such-command"], "no-such-command"),
                       (["generate", "hi", "--greedy", "--top-k", "5"], "--greedy"),
                       (["convert", "-i", "a", "-o", "b", "-b", "9"], "--bits")):
        out = exl3(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert word in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)


_PARSE_ONLY = """
import contextlib, io, sys
from exl3_core.cli import build_parser
for job in sys.argv[1:]:
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        build_parser().parse_args([job, "--help"])
print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "numpy", "triton"}))
"""


def test_options_are_read_without_torch() -> None:
    """Every job's options parse before torch is imported: help and usage errors answer at once."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    jobs = sorted(sub.choices)
    assert {"generate", "convert", "import-gguf", "optimize", "bench", "serve", "eval"} <= set(jobs), jobs
    out = subprocess.run([sys.executable, "-c", _PARSE_ONLY, *jobs], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"parsing the options imported {out.stdout.strip()}"


def test_missing_model_folder_is_one_line_exit_1(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    for args in (["generate", "hi", "-m", str(missing)], ["eval", "ppl", "-m", str(missing)]):
        out = exl3(*args)
        assert out.returncode == 1, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("exl3: error:") and str(missing) in lines[0], out.stderr


@NO_CUDA
def test_device_cuda_without_cuda_says_what_to_do(tmp_path: Path) -> None:
    for args in (["generate", "hi", "--device", "cuda", "-m", str(tmp_path)],
                 ["eval", "ppl", "-m", str(tmp_path), "--device", "cuda:0"],
                 ["convert", "-i", str(tmp_path), "-o", str(tmp_path / "o"), "-b", "4", "--device", "cuda"]):
        out = exl3(*args)
        assert out.returncode == 1, (args, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "--device cuda" in lines[0] and "use --device cpu" in lines[0], out.stderr
        assert "Traceback" not in out.stderr and "AssertionError" not in out.stderr


@NO_CUDA
def test_bench_refuses_without_cuda() -> None:
    out = exl3("bench", "--shape", "custom(256,512,2,4,2,512)")
    assert out.returncode == 1
    assert "GPU" in out.stderr and "--device cpu" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_generate_with_empty_stdin_is_an_error() -> None:
    for stdin in ("", "  \n\n"):
        out = exl3("generate", stdin=stdin)
        assert out.returncode == 2 and "stdin was empty" in out.stderr, out.stderr
        assert out.stdout == ""  # no empty reply


def test_generate_on_a_terminal_says_it_reads_stdin() -> None:
    main, sub = pty.openpty()
    env = {**os.environ, "EXL3_DISABLE_PLUGINS": "broken"}
    p = subprocess.Popen([sys.executable, "-m", "exl3_core", "generate"], stdin=sub, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, text=True)
    os.close(sub)
    try:
        os.write(main, b"\x04")  # Ctrl-D on an empty line: end of input
        _, err = p.communicate(timeout=120)
    finally:
        os.close(main)
        if p.poll() is None:
            p.kill()
    assert "reading the prompt from stdin" in err and "Ctrl-D" in err
    assert p.returncode == 2 and "stdin was empty" in err


# -- sampling defaults --------------------------------------------------------------------------------

def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "x", *argv])


def _model(tmp_path: Path, gen: dict[str, object] | None) -> Path:
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return tmp_path


def test_sampling_defaults_follow_the_model_then_llama_cpp(tmp_path: Path) -> None:
    import random

    from exl3_core.generate_cli import DEFAULT_SAMPLING, choose_sampling

    s = choose_sampling(_args(), _model(tmp_path, {"bos_token_id": 1}))  # no sampling settings
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == tuple(DEFAULT_SAMPLING[k] for k in
                                                               ("temperature", "top_k", "top_p", "min_p"))
    t, p = round(random.uniform(0.2, 1.5), 3), round(random.uniform(0.5, 0.99), 3)
    s = choose_sampling(_args(), _model(tmp_path, {"temperature": t, "top_p": p, "do_sample": True}))
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (t, p, 0, 0.0) and "generation_config" in s.source
    s = choose_sampling(_args("--top-k", "7"), tmp_path)  # one option replaces one setting
    assert (s.temperature, s.top_p, s.top_k) == (t, p, 7)
    assert choose_sampling(_args("--greedy"), tmp_path).greedy
    assert choose_sampling(_args("--temperature", "0"), tmp_path).sampler().is_greedy
    assert not choose_sampling(_args(), tmp_path).sampler().is_greedy
    s = choose_sampling(_args(), _model(tmp_path, {"do_sample": False, "temperature": 0.6}))
    assert s.greedy and s.sampler().is_greedy
    assert not choose_sampling(_args("--top-p", "0.9"), tmp_path).greedy  # a sampling option asks to sample


def test_bad_generation_config_names_the_file(tmp_path: Path) -> None:
    from exl3_core.generate_cli import choose_sampling

    (tmp_path / "generation_config.json").write_text("{temperature: 0.7")
    with pytest.raises(ValueError, match="generation_config.json"):
        choose_sampling(_args(), tmp_path)
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        choose_sampling(_args(), tmp_path)
