"""Architecture kit: configuration, the model base class and the standard decoder."""
from __future__ import annotations

from exl3_core.archkit.batch import BatchMeta
from exl3_core.archkit.config import Config, ConfigError, HFConfig, RopeSettings, normalise_rope
from exl3_core.archkit.decoder import DecoderBlock, Head, StandardDecoder, StandardDecoderConfig
from exl3_core.archkit.model import Model

__all__ = [
    "BatchMeta", "Config", "ConfigError", "DecoderBlock", "HFConfig", "Head", "Model", "RopeSettings",
    "StandardDecoder", "StandardDecoderConfig", "normalise_rope",
]
