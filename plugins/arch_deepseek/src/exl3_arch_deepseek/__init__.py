"""DeepSeek-V2 and DeepSeek-V3 (MLA + MoE) architectures for exl3."""
from __future__ import annotations

__version__ = "0.1.0"
