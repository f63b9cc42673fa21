"""Launch options of the forward running in this context: set by the execution plan from its tuning.

A context variable rather than a global: two plans with different tunings (an A/B benchmark, two
models) each launch with their own, and nothing outlives the forward that set it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """:param pdl: programmatic dependent launch between kernels (Hopper and newer; ignored elsewhere).
    :param predecode: the decode-size EXL3 linear decodes its weights before waiting for its input:
        0 off, 1 on, 2 on and its dependent may start at once.
    :param predecode_max_kt: the longest k chunk (in 16-row tiles) a pre-decoding launch takes; 0: its
        ring's length.
    :param xh_min_rows: rows from which a decode-size launch transforms its input once for all its blocks
        (0: never; wide outputs such as a head always do)."""

    pdl: bool = True
    predecode: int = 2
    predecode_max_kt: int = 0
    xh_min_rows: int = 8

    def ints(self) -> list[int]:
        """The compiled fused ops' ``launch`` argument: ``[pdl, predecode, predecode_max_kt, xh_min_rows]``."""
        return [int(self.pdl), self.predecode, self.predecode_max_kt, self.xh_min_rows]


#: outside a plan's forward: PDL where the device has it, full pre-decoding
DEFAULT = LaunchConfig()
_CURRENT: ContextVar[LaunchConfig] = ContextVar("exl3_launch", default=DEFAULT)


@contextlib.contextmanager
def launch_config(config: LaunchConfig) -> Iterator[None]:
    """Kernels launched inside use ``config``."""
    token = _CURRENT.set(config)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> LaunchConfig:
    return _CURRENT.get()


def pdl_requested() -> bool:
    """Whether the forward running in this context asked for PDL."""
    return _CURRENT.get().pdl
