"""Every operator schema the compiled extension registers (``m.def("...")`` in csrc) parses as torch reads it.

CUDA sources are not compiled on a CPU-only machine, so a schema torch refuses (say a default on a tensor list)
would otherwise first show as an abort when the extension loads on a GPU."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = sorted(p for p in CSRC.rglob("*") if p.suffix in (".cu", ".cpp") and "m.def(" in p.read_text())


def _schemas(path: Path) -> list[str]:
    """The schema strings of ``m.def(...)`` calls: adjacent C++ string literals joined."""
    calls = re.findall(r"m\.def\(\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)", path.read_text())
    return ["".join(re.findall(r"\"((?:[^\"\\]|\\.)*)\"", c)) for c in calls]


def test_the_sources_register_operators() -> None:
    names = {p.name for p in SOURCES}
    assert {"exl3_ops.cu", "viterbi.cpp"} <= names, names
    for p in SOURCES:  # every call's schema is read, none skipped by the pattern
        assert len(_schemas(p)) == p.read_text().count("m.def("), p.name


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_schema_parses(path: Path) -> None:
    for schema in _schemas(path):
        torch._C.parse_schema(schema)  # raises on a schema the extension's registration would abort on


def test_a_refused_schema_is_caught() -> None:
    with pytest.raises(RuntimeError):
        torch._C.parse_schema("f(Tensor x, Tensor?[] caches=[]) -> Tensor")
