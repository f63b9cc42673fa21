"""Test fixture: a plugin whose import fails, as one with a missing dependency would."""
from __future__ import annotations

import exl3_nonexistent_dependency_for_tests  # noqa: F401  (the deliberate failure)
