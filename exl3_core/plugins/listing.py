"""``exl3 plugins``: the installed plugins, what each registers, whether each attention backend can run
on this machine (and why not), and the state of the compiled extension ``exl3_core._C``.

``--json`` prints a list of rows, one per plugin, then one for the compiled extension; every row has
the same keys (``kind`` tells them apart: ``"plugin"`` or ``"extension"``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from exl3_core.plugins.registry import missing_requires

if TYPE_CHECKING:  # torch loads lazily: the listing starts before it is needed
    import torch

    from exl3_core.attention.spec import AttnSpec


@dataclass(frozen=True)
class BackendStatus:
    """Whether an attention backend can run here: the phases it accepts for a typical model on this
    machine's device, or why it cannot."""

    name: str
    usable: bool
    phases: tuple[str, ...]
    reason: str | None


class Row(TypedDict):
    kind: str
    name: str
    module: str
    distribution: str | None
    version: str | None
    builtin: bool
    blocked: bool
    error: str | None
    hooks: list[str]
    provides: dict[str, list[str]]
    attention_backends: list[dict[str, Any]]
    status: str | None


def probe_device() -> tuple[str, tuple[int, int]]:
    """The device type a model would load on here, and its compute capability ((0, 0) on a CPU)."""
    import torch

    if torch.cuda.is_available():
        return "cuda", tuple(torch.cuda.get_device_capability(0))  # type: ignore[return-value]
    return "cpu", (0, 0)


def _probes(dtype: torch.dtype, dev: str, cc: tuple[int, int]) -> dict[str, list[AttnSpec]]:
    """The calls a backend is asked about, per phase: a fresh prompt attending to its own rows (one alone, or a
    batch), a prefill over the paged fp16 cache and a decode step, with a typical model's attention."""
    import torch

    from exl3_core.attention.spec import AttnSpec, sm_count

    sm = sm_count(torch.device("cuda")) if dev == "cuda" else 0

    def spec(**kw: Any) -> AttnSpec:
        return AttnSpec(head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=dtype, device_type=dev, device_cc=cc,
                        **kw)

    return {"fresh prefill": [spec(phase="prefill", num_seqs=n, max_keys=2048) for n in (1, 4)],
            "prefill": [spec(cache="kv/fp16", phase="prefill", page_size=256, num_seqs=n, max_keys=4096) for n in (1, 4)],
            "decode": [spec(cache="kv/fp16", phase="decode", page_size=256, num_seqs=n, max_keys=4096, q_per_seq=1,
                            sm_count=sm) for n in (1, 32)]}


def backend_status(plugins: Any) -> dict[str, BackendStatus]:
    """Every registered attention backend's :class:`BackendStatus`, probed with a typical model's
    attention (128-dim heads, 32 query / 8 key-value heads, exl3's default dtype on this device) in each
    phase of :func:`_probes` (a phase counts when any of its calls is taken); a backend's own
    ``unsupported_reasons`` say why it declines."""
    import torch

    dev, cc = probe_device()
    dtype = torch.float16 if dev == "cuda" else torch.float32
    out: dict[str, BackendStatus] = {}
    for name, spec in plugins.attention_backend_specs().items():
        miss = missing_requires(spec.requires)
        if miss:
            out[name] = BackendStatus(name, False, (), f"needs {', '.join(miss)} (not installed)")
            continue
        try:
            backend = plugins.resolve(spec.impl, what="attention backend")()
        except Exception as e:  # noqa: BLE001 - reported, not raised: the listing must still print
            out[name] = BackendStatus(name, False, (), f"failed to load: {type(e).__name__}: {e}")
            continue
        why: dict[str, list[str]] = {}
        for phase, probes in _probes(dtype, dev, cc).items():
            reasons: list[list[str]] = []
            for probe in probes:
                try:
                    reasons.append(list(backend.unsupported_reasons(probe)))
                except Exception as e:  # noqa: BLE001
                    reasons.append([f"unsupported_reasons failed: {type(e).__name__}: {e}"])
            why[phase] = [] if any(not r for r in reasons) else reasons[0]
        phases = tuple(p for p, r in why.items() if not r)
        # what stops it in every phase is the reason; a phase it leaves to others by design is not
        common = [r for r in why["decode"] if all(r in w for w in why.values())] or why["decode"] + why["prefill"]
        out[name] = BackendStatus(name, bool(phases), phases, None if phases else "; ".join(common))
    return out


def extension_status() -> tuple[str, str | None, list[str]]:
    """``(status, detail, ops)`` of the compiled extension: status is ``loaded``, ``not built``,
    ``disabled`` (EXL3_DISABLE_EXT) or ``failed`` (detail: the reason); ops are the registered
    ``exl3::`` ops, each marked ``(cuda)`` when it has a CUDA kernel."""
    from exl3_core import settings

    if settings.get().disable_ext:
        return "disabled", "EXL3_DISABLE_EXT=1", []
    if importlib.util.find_spec("exl3_core._C") is None:
        return "not built", "build it with `python setup.py build_ext --inplace` (pure torch is used meanwhile)", []
    from exl3_core import ext

    if not ext.load():
        return "failed", "; ".join(ext.load_error) or "unknown error", []
    import torch

    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("exl3::"))
    marked = [n.split("::", 1)[1] + (" (cuda)" if torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA") else "")
              for n in ops]
    return "loaded", None, marked


def describe_plugins(plugins: Any) -> list[Row]:
    """One row per known plugin (distribution, hooks, what it registers, load error, its attention
    backends' status), then one for the compiled extension."""
    provides: dict[str, dict[str, list[str]]] = {}
    labels = {
        "exl3_architectures": ("architectures", lambda s: s.hf_arch + (f" (+{', '.join(s.aliases)})" if s.aliases else "")),
        "exl3_attention_backends": ("attention backends", lambda s: s.name),
        "exl3_cache_layer_types": ("cache layers", lambda s: f"{s.kind}/{s.variant}"),
        "exl3_samplers": ("samplers", lambda s: s.name if s.kind == "step" else f"{s.name} (preset)"),
        "exl3_filters": ("filters", lambda s: s.name),
    }
    owner: dict[str, str] = {}
    for hook, (label, fmt) in labels.items():
        for plugin, spec in plugins._collect(hook):
            provides.setdefault(plugin, {}).setdefault(label, []).append(fmt(spec))
            if hook == "exl3_attention_backends":
                owner[spec.name] = plugin
    status = backend_status(plugins)
    rows: list[Row] = []
    for name, info in plugins.infos.items():
        rows.append(Row(
            kind="plugin", name=name, module=info.module, distribution=info.distribution, version=info.version,
            builtin=info.builtin, blocked=info.blocked,
            error=None if info.error is None else f"{type(info.error).__name__}: {info.error}",
            hooks=list(info.hooks), provides=provides.get(name, {}),
            attention_backends=[asdict(s) for n, s in status.items() if owner.get(n) == name], status=None))
    for key, err in plugins.load_errors.items():
        if key not in plugins.infos:
            rows.append(Row(kind="plugin", name=key, module="", distribution=None, version=None, builtin=False,
                            blocked=False, error=f"{type(err).__name__}: {err}", hooks=[], provides={},
                            attention_backends=[], status=None))
    from exl3_core import __version__

    ext_state, detail, ops = extension_status()
    rows.append(Row(kind="extension", name="exl3_core._C", module="exl3_core._C", distribution="exl3-core",
                    version=__version__, builtin=True, blocked=ext_state == "disabled",
                    error=detail if ext_state == "failed" else None, hooks=[],
                    provides={"compiled ops": ops} if ops else {}, attention_backends=[],
                    status=ext_state if detail is None or ext_state == "failed" else f"{ext_state}: {detail}"))
    return rows


def _print_rows(rows: list[Row]) -> None:
    dev, cc = probe_device()
    for r in rows:
        if r["kind"] == "extension":
            print(f"compiled extension {r['name']}: {r['status']}")
            for kind, items in r["provides"].items():
                print(f"    {kind}: {', '.join(items)}")
            continue
        head = r["name"]
        if r["distribution"]:
            head += f"  ({r['distribution']} {r['version'] or ''})".rstrip()
        if r["builtin"]:
            head += "  [built-in]"
        if r["blocked"]:
            head += "  [blocked]"
        print(head)
        if r["error"]:
            print(f"    LOAD ERROR: {r['error']}")
        if r["hooks"]:
            print(f"    hooks: {', '.join(r['hooks'])}")
        for kind, items in r["provides"].items():
            if kind != "attention backends":
                print(f"    {kind}: {', '.join(items)}")
        for b in r["attention_backends"]:
            where = f"{dev}" + (f" sm_{cc[0]}{cc[1]}" if dev == "cuda" else "")
            state = (f"usable here ({where}: {', '.join(b['phases'])})" if b["usable"]
                     else f"not usable here ({where}): {b['reason']}")
            print(f"    attention backend {b['name']}: {state}")


def _plugins_cmd(args: argparse.Namespace) -> int:
    from exl3_core.plugins import load_plugins

    rows = describe_plugins(load_plugins())
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_rows(rows)
    return 0


def add_cli(sub: Any) -> None:
    sp = sub.add_parser(
        "plugins", help="list installed plugins, what each registers, and load errors",
        description="List the installed exl3 plugins (distribution, hooks, what each registers, load errors), "
                    "whether each attention backend can run on this machine and why not, and the state of the "
                    "compiled extension.")
    sp.add_argument("--json", action="store_true", help="machine-readable output: a list of rows")
    sp.set_defaults(func=_plugins_cmd)
