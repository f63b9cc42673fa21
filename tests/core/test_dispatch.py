"""Attention dispatcher: ranking, tie-breaking, explicit order, caching and the failure table."""
from __future__ import annotations

import types

import pytest
import torch

from exl3_core import hookimpl
from exl3_core.attention import AttnArgs, AttnSpec, NoAttentionBackend, get_dispatcher
from exl3_core.plugins import AttentionBackendSpec, load_plugins

CALLS: dict[str, int] = {}


class _Fake:
    name = "fake"
    prio = 0
    reasons: list[str] = []

    def priority(self, spec: AttnSpec) -> int:
        CALLS[self.name] = CALLS.get(self.name, 0) + 1
        return self.prio

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        return list(self.reasons) if spec.head_dim != 64 else []

    def forward(self, args: AttnArgs) -> torch.Tensor:
        return args.q


class Fast(_Fake):
    name = "fast"
    prio = 50
    reasons = ["head_dim must be 64"]


class Alpha(_Fake):
    name = "alpha"
    prio = 50
    reasons = ["alpha only does 64"]


class Never(_Fake):
    name = "never"
    prio = 1000

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        return ["needs a GPU of compute capability 9.0", "fp8 only"]


def _plugins(*extra_specs: AttentionBackendSpec):
    @hookimpl
    def exl3_attention_backends() -> list[AttentionBackendSpec]:
        return list(extra_specs)

    mod = types.ModuleType("fake_backends")
    mod.exl3_attention_backends = exl3_attention_backends
    return load_plugins(autoload=False, extra=[mod])


S64 = AttnSpec(head_dim=64, num_q_heads=4, num_kv_heads=2, dtype=torch.float16)
S80 = S64._replace(head_dim=80)
MOD = __name__


def test_priority_and_tie_break_by_name() -> None:
    p = _plugins(AttentionBackendSpec(name="fast", impl=f"{MOD}:Fast"),
                 AttentionBackendSpec(name="alpha", impl=f"{MOD}:Alpha"))
    d = get_dispatcher(p)
    assert d.select(S64).name == "alpha"  # same priority 50: "alpha" < "fast"
    assert d.select(S80).name == "torch"  # both decline head_dim 80 -> reference


def test_choice_is_cached_per_spec() -> None:
    p = _plugins(AttentionBackendSpec(name="fast", impl=f"{MOD}:Fast"))
    d = get_dispatcher(p)
    CALLS.clear()
    b1 = d.select(S64)
    n = CALLS.get("fast", 0)
    for _ in range(5):
        assert d.select(S64) is b1
    assert CALLS.get("fast", 0) == n


def test_explicit_order_overrides_priority() -> None:
    p = _plugins(AttentionBackendSpec(name="fast", impl=f"{MOD}:Fast"))
    d = get_dispatcher(p)
    assert d.select(S64, ("torch", "fast")).name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        d.select(S64, ("nonexistent",))


def test_failure_lists_every_reason_and_unavailable() -> None:
    p = _plugins(AttentionBackendSpec(name="never", impl=f"{MOD}:Never"),
                 AttentionBackendSpec(name="fast", impl=f"{MOD}:Fast"),
                 AttentionBackendSpec(name="needs_mod", impl=f"{MOD}:Fast", requires=("no_such_attn_lib",)),
                 AttentionBackendSpec(name="bad_ref", impl=f"{MOD}:DoesNotExist"))
    d = get_dispatcher(p)
    with pytest.raises(NoAttentionBackend) as ei:
        d.select(S80, ("never", "fast"))
    msg = str(ei.value)
    assert "head_dim = 80" in msg
    assert "never: needs a GPU of compute capability 9.0; fp8 only" in msg
    assert "fast: head_dim must be 64" in msg
    assert "needs_mod: module(s) no_such_attn_lib not installed" in msg
    assert "bad_ref: failed to load" in msg
    assert msg.index("never:") < msg.index("fast:")  # order tried
    assert "torch: not in the requested backend list" in msg


def test_default_selection_uses_env(clean_settings) -> None:
    from exl3_core import settings
    from exl3_core.attention import select

    p = _plugins(AttentionBackendSpec(name="fast", impl=f"{MOD}:Fast"))
    assert select(S64, plugins=p).name == "fast"
    clean_settings.setenv("EXL3_ATTN_BACKENDS", "torch")
    settings.reload()
    assert select(S64, plugins=p).name == "torch"
