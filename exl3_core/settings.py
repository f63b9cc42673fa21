"""Every ``EXL3_*`` environment variable, declared once, read on first use.

Nothing in exl3 reads ``os.environ`` for an ``EXL3_*`` name anywhere else (a test greps for it).
Values are read when :func:`get` is first called, never at import time; :func:`reload` re-reads
them (tests use it after changing the environment). These are the knobs a user sets; how the engine
itself is tuned (fusions, launch options, graph buckets) is typed in :mod:`exl3_core.tuning`.

| variable | meaning |
|---|---|
| ``EXL3_PLUGINS`` | comma-separated allow-list of entry-point plugin names; unset = all |
| ``EXL3_DISABLE_PLUGINS`` | comma-separated block-list of plugin names |
| ``EXL3_DISABLE_PLUGIN_AUTOLOAD`` | ``1``: load only the core built-ins, no entry points |
| ``EXL3_TRACE_PLUGINS`` | ``1``: log every hook call (debugging plugins) |
| ``EXL3_ATTN_BACKENDS`` | comma-separated attention backend names, in the order to try them |
| ``EXL3_CACHE_DIR`` | where exl3 keeps imported models (default ``~/.cache/exl3``, or ``$XDG_CACHE_HOME/exl3``) |
| ``EXL3_DEFAULT_MODEL`` | model directory used when ``--model`` is not given |
| ``EXL3_DISABLE_EXT`` | ``1``: never load the compiled extension (pure torch everywhere) |
| ``EXL3_NUM_THREADS`` | CPU threads of the ``exl3`` commands' torch pool and the compiled CPU ops (0: one per physical core, or ``OMP_NUM_THREADS`` when set; exl3_core/threads.py) |
| ``EXL3_PAGE_SIZE`` | KV-cache page size in tokens (default 256) |
| ``EXL3_CUDA_GRAPHS`` | ``0`` disables CUDA graphs (decode steps and prefill chunks), e.g. to debug a kernel or read a profile op by op |
| ``EXL3_API_KEY`` | the key ``exl3 serve`` requires from clients (``Authorization: Bearer KEY``) when ``--api-key`` is not given; unset: no key |
| ``EXL3_TP_TIMEOUT`` | seconds a tensor-parallel collective or a worker's reply may take before the group is declared broken (default 300) |
| ``EXL3_TP_LOAD_TIMEOUT`` | seconds tensor-parallel workers may take to load their shares of a model (default 3600) |
| ``EXL3_LOG_LEVEL`` | log level for the ``exl3`` logger (default ``WARNING``) |
| ``EXL3_NO_PROGRESS`` | ``1``: never draw progress bars |
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

PREFIX = "EXL3_"


def _list(v: str | None) -> tuple[str, ...] | None:
    if v is None or not v.strip():
        return None
    return tuple(x.strip() for x in v.split(",") if x.strip())


def _flag(v: str | None, default: bool = False) -> bool:
    if v is None or v == "":
        return default
    if v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if v.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment flag has value {v!r}; use 1/0, true/false, yes/no or on/off")


def _int(name: str, v: str | None, default: int) -> int:
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{PREFIX}{name}={v!r} is not an integer") from None


@dataclasses.dataclass(frozen=True)
class Settings:
    """Snapshot of the ``EXL3_*`` environment (see the module docstring for each field)."""

    plugins: tuple[str, ...] | None = None
    disable_plugins: tuple[str, ...] = ()
    disable_plugin_autoload: bool = False
    trace_plugins: bool = False
    attn_backends: tuple[str, ...] | None = None
    cache_dir: Path = Path("~/.cache/exl3").expanduser()
    default_model: Path | None = None
    disable_ext: bool = False
    num_threads: int = 0
    page_size: int = 256
    cuda_graphs: bool = True
    api_key: str | None = None
    tp_timeout: int = 300
    tp_load_timeout: int = 3600
    log_level: str = "WARNING"
    no_progress: bool = False

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        e = dict(os.environ if env is None else env)

        def g(name: str) -> str | None:
            return e.get(PREFIX + name)

        def flag(name: str, default: bool = False) -> bool:
            try:
                return _flag(g(name), default)
            except ValueError as err:
                raise ValueError(f"{PREFIX}{name}: {err}") from None

        xdg = e.get("XDG_CACHE_HOME")
        default_cache = Path(xdg) / "exl3" if xdg else Path("~/.cache/exl3").expanduser()
        page_size = _int("PAGE_SIZE", g("PAGE_SIZE"), 256)
        if page_size <= 0 or page_size % 16:
            raise ValueError(f"{PREFIX}PAGE_SIZE={page_size} must be a positive multiple of 16")
        tp_timeout = _int("TP_TIMEOUT", g("TP_TIMEOUT"), 300)
        tp_load_timeout = _int("TP_LOAD_TIMEOUT", g("TP_LOAD_TIMEOUT"), 3600)
        if tp_timeout <= 0 or tp_load_timeout <= 0:
            raise ValueError(f"{PREFIX}TP_TIMEOUT={tp_timeout} and {PREFIX}TP_LOAD_TIMEOUT={tp_load_timeout} must be "
                             f"positive numbers of seconds")
        dm = g("DEFAULT_MODEL")
        return cls(
            plugins=_list(g("PLUGINS")),
            disable_plugins=_list(g("DISABLE_PLUGINS")) or (),
            disable_plugin_autoload=flag("DISABLE_PLUGIN_AUTOLOAD"),
            trace_plugins=flag("TRACE_PLUGINS"),
            attn_backends=_list(g("ATTN_BACKENDS")),
            cache_dir=Path(g("CACHE_DIR")).expanduser() if g("CACHE_DIR") else default_cache,
            default_model=Path(dm).expanduser() if dm else None,
            disable_ext=flag("DISABLE_EXT"),
            num_threads=_int("NUM_THREADS", g("NUM_THREADS"), 0),
            page_size=page_size,
            cuda_graphs=flag("CUDA_GRAPHS", True),
            api_key=(g("API_KEY") or "").strip() or None,
            tp_timeout=tp_timeout,
            tp_load_timeout=tp_load_timeout,
            log_level=(g("LOG_LEVEL") or "WARNING").upper(),
            no_progress=flag("NO_PROGRESS"),
        )


_current: Settings | None = None


def get() -> Settings:
    """The settings, read from the environment on first call."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def reload() -> Settings:
    """Re-read the environment (after tests or a CLI change it)."""
    global _current
    _current = None
    return get()
