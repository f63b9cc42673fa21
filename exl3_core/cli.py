"""The ``exl3`` command. Each job lives in its own module exposing ``add_cli(subparsers)``;
this file only wires them together, so a job whose module is absent simply isn't offered."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Any

from exl3_core import __version__, settings

#: modules providing sub-commands through ``add_cli(subparsers)``, in help order
SUBCOMMAND_MODULES = (
    "exl3_core.generate_cli",
    "exl3_core.convert.gguf_import",
    "exl3_core.convert.cli",
    "exl3_core.convert.optimize",
    "exl3_core.eval.cli",
    "exl3_core.bench.cli",
    "exl3_core.server.cli",
)


def _plugins_cmd(args: argparse.Namespace) -> int:
    from exl3_core.plugins import load_plugins

    plugins = load_plugins()
    rows = describe_plugins(plugins)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        head = f"{r['name']}"
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
            print(f"    {kind}: {', '.join(items)}")
    return 0


def describe_plugins(plugins: Any) -> list[dict[str, Any]]:
    """One row per known plugin: distribution, hooks, what it registers, load error."""
    provides: dict[str, dict[str, list[str]]] = {}
    labels = {
        "exl3_architectures": ("architectures", lambda s: s.hf_arch + (f" (+{', '.join(s.aliases)})" if s.aliases else "")),
        "exl3_attention_backends": ("attention backends", lambda s: s.name),
        "exl3_cache_layer_types": ("cache layers", lambda s: f"{s.kind}/{s.variant}"),
        "exl3_samplers": ("samplers", lambda s: s.name if s.kind == "step" else f"{s.name} (preset)"),
        "exl3_filters": ("filters", lambda s: s.name),
    }
    for hook, (label, fmt) in labels.items():
        for plugin, spec in plugins._collect(hook):
            provides.setdefault(plugin, {}).setdefault(label, []).append(fmt(spec))
    rows = []
    for name, info in plugins.infos.items():
        rows.append({
            "name": name, "module": info.module, "distribution": info.distribution, "version": info.version,
            "builtin": info.builtin, "blocked": info.blocked,
            "error": None if info.error is None else f"{type(info.error).__name__}: {info.error}",
            "hooks": info.hooks, "provides": provides.get(name, {}),
        })
    for key, err in plugins.load_errors.items():
        if key not in plugins.infos:
            rows.append({"name": key, "module": "", "distribution": None, "version": None, "builtin": False,
                         "blocked": False, "error": f"{type(err).__name__}: {err}", "hooks": [], "provides": {}})
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="exl3", description="Fast EXL3 LLM inference")
    p.add_argument("--version", action="version", version=f"exl3 {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sp = sub.add_parser("plugins", help="list installed plugins, what each registers, and load errors")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=_plugins_cmd)
    for mod_name in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and mod_name.startswith(e.name):
                continue  # that job is not part of this build
            raise
        add = getattr(mod, "add_cli", None)
        if add is not None:
            add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=getattr(logging, settings.get().log_level, logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, LookupError, RuntimeError, OSError) as e:
        if settings.get().log_level == "DEBUG":
            raise
        print(f"exl3: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
