"""``--tensor-parallel-size`` / ``--expert-parallel`` on generate, chat, serve and bench: parsed, checked before
the model loads, and handed to ``model.load``."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from exl3_core.cli import build_parser
from exl3_core.parallel.cli import parallel_load_kwargs


@pytest.mark.parametrize("cmd", ["generate", "chat", "serve", "bench"])
def test_every_loading_command_takes_the_options(cmd: str) -> None:
    args = build_parser().parse_args([cmd, "--tensor-parallel-size", "4", "--expert-parallel"])
    assert parallel_load_kwargs(args) == {"tensor_parallel_size": 4, "expert_parallel": True}
    assert parallel_load_kwargs(build_parser().parse_args([cmd])) == {}


@pytest.mark.parametrize("argv,match", [(["--expert-parallel"], "needs --tensor-parallel-size"),
                                        (["--tensor-parallel-size", "0"], "at least 1")])
def test_option_errors(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parallel_load_kwargs(build_parser().parse_args(["generate", *argv]))
    from exl3_core.server.cli import server_options

    with pytest.raises(ValueError, match=match):  # exl3 serve reports it before loading the model
        server_options(build_parser().parse_args(["serve", *argv]))


def test_the_session_loads_with_them(checkpoints: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from exl3_core.archkit.model import Model
    from exl3_core.generate_cli import Session
    from exl3_core.tokenizer import Tokenizer

    seen: dict = {}

    class Loaded(Exception):
        pass

    def load(self: Model, **kwargs: object) -> Model:
        seen.update(kwargs)
        raise Loaded

    monkeypatch.setattr(Model, "load", load)
    # the session reads the tokenizer first; these test checkpoints have none
    monkeypatch.setattr(Tokenizer, "from_config", classmethod(lambda cls, config: object()))
    args = build_parser().parse_args(["generate", "-m", str(checkpoints[("llama", "dense")]), "--device", "cpu",
                                      "--tensor-parallel-size", "2"])
    with pytest.raises(Loaded):
        Session(args)
    assert seen["tensor_parallel_size"] == 2 and seen["expert_parallel"] is False and seen["device"] == "cpu"


def test_parsing_the_options_imports_no_torch() -> None:
    code = ("import sys; from exl3_core.parallel.cli import add_parallel_args, parallel_load_kwargs; "
            "import exl3_core.parallel; print(int('torch' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "0"


def test_kwargs_of_a_bare_namespace() -> None:
    assert parallel_load_kwargs(argparse.Namespace()) == {}
