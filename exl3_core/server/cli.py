"""``exl3 serve``: the OpenAI-compatible HTTP server for one model (FastAPI on uvicorn).

Model loading is the ``generate``/``chat`` commands' :class:`~exl3_core.generate_cli.Session`;
this module only adds the HTTP side. Heavy imports happen when the command runs, so building the
``exl3`` parser stays cheap.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

from exl3_core.cache_bits import add_cache_bits_arg
from exl3_core.parallel.cli import add_parallel_args, parallel_load_kwargs

log = logging.getLogger("exl3.server")


def add_cli(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, ...)")
    p.add_argument("-m", "--model", type=Path, default=None,
                   help="model folder (HF-style, unquantized or EXL3); default: the embedded default model")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only). Binding beyond loopback "
                        "without --api-key lets anyone who can reach the port use the model")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1 request (default: $EXL3_API_KEY; "
                        "unset: no authentication). /health and /metrics stay open. Prefer EXL3_API_KEY: other "
                        "users of this machine can read a command line")
    p.add_argument("--cache-tokens", type=int, default=8192,
                   help="KV-cache size in tokens, shared by all concurrent requests (default 8192)")
    add_cache_bits_arg(p)
    p.add_argument("--device", default=None, help="torch device (default: cuda:0 if available, else cpu)")
    p.add_argument("--max-batch", type=int, default=16,
                   help="most requests generating at once; more wait in the queue (default 16)")
    p.add_argument("--step-tokens", type=int, default=None, metavar="N",
                   help="tokens of one generator step while requests stream, shared by their next tokens and "
                        "chunks of new prompts (default: 512 on CUDA, 24 on CPU); smaller keeps streams smoother "
                        "while long prompts are read, larger reads prompts faster")
    p.add_argument("--model-name", default=None, help="model id reported by /v1/models (default: the folder name)")
    p.add_argument("--attention", default=None, help="comma-separated attention backends to try, in order")
    add_parallel_args(p)
    p.add_argument("--max-request-bytes", type=int, default=16 * 1024 * 1024, metavar="BYTES",
                   help="largest accepted request body in bytes (default 16 MiB; larger bodies get 413)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="seconds a request may take from arrival to its last token before it is cancelled "
                        "(default 600; 0: no limit)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="allow browser pages from ORIGIN (e.g. http://localhost:3000, or * for any) to call the "
                        "API; repeat for several. Default: no CORS headers")
    p.add_argument("--lora", action="append", default=[], type=_lora_spec, metavar="DIR[:WEIGHT]",
                   help="load a PEFT LoRA adapter (repeatable); a request uses it with \"model\": \"NAME:ADAPTER\" "
                        "(at WEIGHT, default 1) or the extension field \"loras\": {\"ADAPTER\": weight}; ADAPTER is "
                        "the folder's name, and /v1/models lists NAME:ADAPTER")
    from exl3_core.generate_cli import add_draft_args

    add_draft_args(p)
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also serve requests whose Host header is NAME (a name this server is reached under, e.g. "
                        "behind a proxy; .example.com for a domain and its subdomains, * for any). Default: the "
                        "address a request arrived on, and localhost on loopback; other names get 400 (this stops "
                        "DNS-rebinding web pages)")
    p.add_argument("--allow-special-tokens", action="store_true",
                   help="let chat message text that spells a special token (e.g. <|im_start|>) be encoded as that "
                        "token. Default: it stays text, so a client cannot forge turns; enable for trusted clients "
                        "only")
    p.set_defaults(func=_serve_cmd)


def _lora_spec(text: str) -> Any:
    from exl3_core.lora.cli import parse_spec

    return parse_spec(text)


def server_options(args: argparse.Namespace) -> Any:
    """The :class:`~exl3_core.server.openai.ServerOptions` of the parsed ``serve`` arguments."""
    from exl3_core import settings
    from exl3_core.server.openai import ServerOptions

    key = args.api_key if args.api_key is not None else settings.get().api_key
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes {args.max_request_bytes} must be positive")
    if args.request_timeout < 0:
        raise ValueError(f"--request-timeout {args.request_timeout} must be >= 0 (0: no limit)")
    if key is not None and not key.strip():
        raise ValueError("--api-key / EXL3_API_KEY is empty; give a non-empty key or leave it unset")
    parallel_load_kwargs(args)  # its errors too, before the model loads
    if args.step_tokens is not None and args.step_tokens < 1:
        raise ValueError(f"--step-tokens {args.step_tokens} must be at least 1")
    for h in args.allowed_host:
        if not h.strip() or any(c in h for c in "/ @"):
            raise ValueError(f"--allowed-host {h!r} is not a host name (give e.g. myhost.lan, .example.com or *)")
    return ServerOptions(api_key=key, max_request_bytes=args.max_request_bytes,
                         request_timeout=args.request_timeout or None, cors_origins=tuple(args.cors_origin),
                         allowed_hosts=tuple(args.allowed_host), allow_special_tokens=args.allow_special_tokens)


def build_app(args: argparse.Namespace) -> Any:
    """Load the model as ``exl3 generate`` does and wrap it in an :class:`OpenAIApp`."""
    from exl3_core.generate_cli import Session
    from exl3_core.generator import Generator
    from exl3_core.server.openai import OpenAIApp

    if args.max_batch < 1:
        raise ValueError(f"--max-batch {args.max_batch} must be at least 1")
    options = server_options(args)
    s = Session(args)
    gen = Generator(s.model, s.cache, s.tokenizer, max_batch_size=args.max_batch, step_tokens=args.step_tokens,
                    **s.speculation)
    gen.capture_graphs()  # every decode bucket now: no request waits for a capture later
    name = args.model_name or Path(s.config.directory).name
    ctx = s.config.raw.get("max_position_embeddings")
    return OpenAIApp(gen, s.tokenizer, model_id=name, max_context=ctx if isinstance(ctx, int) else None,
                     options=options, lora_weights=s.loras)


async def serve(app: Any, host: str, port: int, *, stop: asyncio.Event | None = None, access_log: bool = True) -> None:
    """Serve ``app`` (an :class:`OpenAIApp`) on ``host:port`` until ``stop`` is set or
    SIGINT/SIGTERM arrives, then shut down cleanly."""
    from exl3_core.server.runner import bind, exposure_warning, run_server

    warning = exposure_warning(host, app.options.api_key)
    if warning is not None:
        log.warning("%s", warning)
    sock = bind(host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"exl3: serving '{app.model_id}' on http://{shown}:{sock.getsockname()[1]}/v1 (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    try:
        await run_server(app, sock, stop=stop, access_log=access_log)
    finally:
        sock.close()


#: modules of the "server" extra
SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def _serve_cmd(args: argparse.Namespace) -> int:
    from exl3_core.generate_cli import DraftArgs

    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(f"exl3 serve: missing {', '.join(missing)}; install the server extra: pip install 'exl3-core[server]' "
              f"(or: pip install fastapi uvicorn prometheus-client)", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    for name in ("exl3.server", "uvicorn", "uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    try:
        server_options(args)  # option errors before the model loads
        DraftArgs.parse(args)
    except ValueError as e:
        print(f"exl3 serve: {e}", file=sys.stderr)
        return 2
    app = build_app(args)
    asyncio.run(serve(app, args.host, args.port))
    return 0
