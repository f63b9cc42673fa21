"""Jobs that turn checkpoints into other checkpoints (GGUF import, EXL3 quantization)."""
