"""Conformance suites shipped for plugin authors (architectures: :mod:`exl3_core.testing.arch`)."""
from __future__ import annotations
