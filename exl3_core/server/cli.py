"""``exl3 serve``: the OpenAI-compatible HTTP server for one model.

Model loading is the ``generate``/``chat`` commands' :class:`~exl3_core.generate_cli.Session`;
this module only adds the HTTP side. Heavy imports happen when the command runs, so building the
``exl3`` parser stays cheap.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Any


def add_cli(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, ...)")
    p.add_argument("-m", "--model", type=Path, default=None,
                   help="model folder (HF-style, unquantized or EXL3); default: the embedded default model")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; the API has no authentication)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--cache-tokens", type=int, default=8192,
                   help="KV-cache size in tokens, shared by all concurrent requests (default 8192)")
    p.add_argument("--device", default=None, help="torch device (default: cuda:0 if available, else cpu)")
    p.add_argument("--max-batch", type=int, default=16,
                   help="most requests generating at once; more wait in the queue (default 16)")
    p.add_argument("--model-name", default=None, help="model id reported by /v1/models (default: the folder name)")
    p.add_argument("--attention", default=None, help="comma-separated attention backends to try, in order")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest accepted request body in MiB (default 16)")
    p.set_defaults(func=_serve_cmd)


def build_app(args: argparse.Namespace) -> Any:
    """Load the model as ``exl3 generate`` does and wrap it in an :class:`OpenAIApp`."""
    from exl3_core.generate_cli import Session
    from exl3_core.generator import Generator
    from exl3_core.server.openai import OpenAIApp

    if args.max_batch < 1:
        raise ValueError(f"--max-batch {args.max_batch} must be at least 1")
    s = Session(args)
    gen = Generator(s.model, s.cache, s.tokenizer, max_batch_size=args.max_batch)
    gen.capture_graphs()  # every decode bucket now: no request waits for a capture later
    name = args.model_name or Path(s.config.directory).name
    ctx = s.config.raw.get("max_position_embeddings")
    return OpenAIApp(gen, s.tokenizer, model_id=name, max_context=ctx if isinstance(ctx, int) else None)


async def serve(app: Any, host: str, port: int, *, stop: asyncio.Event | None = None, **server_kwargs: Any) -> None:
    """Serve ``app`` until ``stop`` is set (or SIGINT/SIGTERM), then shut down cleanly."""
    from exl3_core.server.http import HTTPServer

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    server = HTTPServer(app, host, port, **server_kwargs)
    await server.start()
    print(f"exl3: serving '{app.model_id}' on http://{host}:{server.port}/v1 (Ctrl-C stops)", file=sys.stderr,
          flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
        await app.close()


def _serve_cmd(args: argparse.Namespace) -> int:
    logging.getLogger("exl3.server").setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    asyncio.run(serve(app, args.host, args.port, max_body_bytes=int(args.max_body_mb * 1024 * 1024)))
    return 0
