"""``exl3 plugins``: each attention backend's usability on this machine with the reason when it is not
usable, the compiled extension's state, and --json rows that all share one set of keys."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from exl3_core.attention.spec import AttnSpec
from exl3_core.plugins import hookimpl, load_plugins
from exl3_core.plugins.listing import backend_status, describe_plugins, extension_status
from exl3_core.plugins.specs import AttentionBackendSpec


class PrefillOnly:
    """A backend that declines decode steps and non-CUDA devices when told to."""

    name = "prefill_only"
    needs_cuda = False

    def priority(self, spec: AttnSpec) -> int:
        return 0

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        r = []
        if self.needs_cuda and spec.device_type != "cuda":
            r.append(f"needs a CUDA device (got {spec.device_type})")
        if spec.phase != "prefill":
            r.append("prefill only")
        return r

    def forward(self, args: object) -> torch.Tensor:
        raise NotImplementedError


class FreshOnly(PrefillOnly):
    """Takes a fresh prompt's own rows only (no cache), as the SDPA routes do."""

    name = "fresh_only"

    def unsupported_reasons(self, spec: AttnSpec) -> list[str]:
        return super().unsupported_reasons(spec) + (["no cache only"] if spec.cache is not None else [])


class CudaOnly(PrefillOnly):
    name = "cuda_only"
    needs_cuda = True


def _plugin() -> types.ModuleType:
    m = types.ModuleType("listing_test_plugin")

    @hookimpl
    def exl3_attention_backends() -> list[AttentionBackendSpec]:
        return [AttentionBackendSpec(name="prefill_only", impl=f"{__name__}:PrefillOnly"),
                AttentionBackendSpec(name="cuda_only", impl=f"{__name__}:CudaOnly"),
                AttentionBackendSpec(name="fresh_only", impl=f"{__name__}:FreshOnly"),
                AttentionBackendSpec(name="needs_pkg", impl=f"{__name__}:PrefillOnly",
                                     requires=("exl3_no_such_module_for_tests",)),
                AttentionBackendSpec(name="broken_impl", impl=f"{__name__}:NoSuchClass")]

    m.exl3_attention_backends = exl3_attention_backends  # type: ignore[attr-defined]
    return m


def test_backend_usability_and_reasons() -> None:
    st = backend_status(load_plugins(autoload=False, extra=[_plugin()]))
    assert st["prefill_only"].usable and st["prefill_only"].phases == ("fresh prefill", "prefill")
    assert st["fresh_only"].usable and st["fresh_only"].phases == ("fresh prefill",)  # not "not usable here"
    assert not st["needs_pkg"].usable and "exl3_no_such_module_for_tests" in (st["needs_pkg"].reason or "")
    assert not st["broken_impl"].usable and "failed to load" in (st["broken_impl"].reason or "")
    assert st["torch"].usable and st["torch"].phases == ("fresh prefill", "prefill", "decode")  # the reference
    if torch.cuda.is_available():
        assert st["cuda_only"].usable
    else:  # the reason stopping it in every phase, not the phase it leaves to others
        assert not st["cuda_only"].usable and st["cuda_only"].reason == "needs a CUDA device (got cpu)"


def test_extension_state_follows_the_switch(clean_settings: pytest.MonkeyPatch) -> None:
    from exl3_core import ext, settings

    state, detail, ops = extension_status()
    if ext.load():
        assert state == "loaded" and detail is None and ops
        assert all(hasattr(torch.ops.exl3, o.split(" ")[0]) for o in ops)
    else:
        assert state in ("not built", "failed") and detail
    clean_settings.setenv("EXL3_DISABLE_EXT", "1")
    settings.reload()
    assert extension_status() == ("disabled", "EXL3_DISABLE_EXT=1", [])


def test_rows_share_keys_and_json_cli() -> None:
    rows = describe_plugins(load_plugins(autoload=False, extra=[_plugin()]))
    assert len({tuple(sorted(r)) for r in rows}) == 1
    assert [r["kind"] for r in rows].count("extension") == 1 and rows[-1]["name"] == "exl3_core._C"
    mine = next(r for r in rows if any(b["name"] == "cuda_only" for b in r["attention_backends"]))
    assert {b["name"] for b in mine["attention_backends"]} == {"prefill_only", "cuda_only", "fresh_only",
                                                               "needs_pkg", "broken_impl"}
    env = {**os.environ, "EXL3_DISABLE_PLUGINS": "broken"}
    env.pop("TRITON_INTERPRET", None)  # tests/conftest.py sets it; a user's shell does not
    out = subprocess.run([sys.executable, "-m", "exl3_core", "plugins", "--json"], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got[-1]["kind"] == "extension" and all(isinstance(r["attention_backends"], list) for r in got)
    text = subprocess.run([sys.executable, "-m", "exl3_core", "plugins"], capture_output=True, text=True,
                          env=env, timeout=120, check=True).stdout
    assert "attention backend torch: usable here" in text and "compiled extension exl3_core._C:" in text
    if not torch.cuda.is_available():
        assert "triton_paged: not usable here (cpu): needs a CUDA device" in text
        assert "torch_sdpa_rows: usable here (cpu: fresh prefill)" in text  # it serves batches of fresh prompts
