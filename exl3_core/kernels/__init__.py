"""Triton kernels of the core (optional: nothing here is imported unless Triton is available).

Reach them through :mod:`exl3_core.ops`, which imports them lazily and falls back to the
pure-torch references in :mod:`exl3_core.reference` when Triton cannot run.
"""
