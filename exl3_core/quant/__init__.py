"""Quantization formats."""
