"""Run the Triton kernels in Triton's CPU interpreter when there is no GPU (also when this
directory is collected on its own, without the repo's tests/conftest.py)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Triton's own switch (not an exl3 setting), read when a kernel is decorated: set it first
    os.environ.setdefault("TRITON_INTERPRET", "1")
