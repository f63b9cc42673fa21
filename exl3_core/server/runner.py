"""Running an :class:`~exl3_core.server.openai.OpenAIApp` under uvicorn: in the foreground
(:func:`run_server`, what ``exl3 serve`` does) or on a thread of its own (:class:`BackgroundServer`,
for tests and for embedding in synchronous programs)."""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import signal
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from exl3_core.server.asgi import OpenAIH11Protocol
from exl3_core.server.openai import OpenAIApp

#: seconds in-flight requests get to finish once shutdown begins; then they are cancelled
GRACEFUL_SHUTDOWN_S = 5
#: seconds an idle keep-alive connection stays open
KEEP_ALIVE_S = 15


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning to print when listening on ``host`` exposes an unauthenticated API, else None."""
    if api_key is not None or is_loopback(host):
        return None
    return (f"listening on {host} without an API key: anyone who can reach this port can use the model; "
            f"set --api-key (or EXL3_API_KEY), or bind 127.0.0.1")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one, see ``getsockname()``)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    if not infos:
        raise OSError(f"cannot resolve --host {host!r}")
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e}; pick another --port or --host") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # signals are the caller's: exl3 serve maps SIGINT/SIGTERM to should_exit and exits 0
        yield


def make_server(app: OpenAIApp, *, access_log: bool = False, graceful_s: float = GRACEFUL_SHUTDOWN_S) -> uvicorn.Server:
    """A uvicorn server for ``app`` that leaves logging set-up and signal handling to the caller."""
    config = uvicorn.Config(app.asgi(), http=OpenAIH11Protocol, lifespan="on", log_config=None,
                            access_log=access_log, timeout_keep_alive=KEEP_ALIVE_S,
                            timeout_graceful_shutdown=int(graceful_s), server_header=False)
    return _Server(config)


async def run_server(app: OpenAIApp, sock: socket.socket, *, stop: asyncio.Event | None = None,
                     access_log: bool = True) -> None:
    """Serve ``app`` on the listening ``sock`` until ``stop`` is set or SIGINT/SIGTERM arrives,
    then finish in-flight requests (cancelled after :data:`GRACEFUL_SHUTDOWN_S`) and stop the
    generator."""
    server = make_server(app, access_log=access_log)
    loop = asyncio.get_running_loop()

    def request_exit() -> None:
        if server.should_exit:
            server.force_exit = True  # a second Ctrl-C: stop waiting for in-flight requests
        server.should_exit = True

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, request_exit)
            installed.append(sig)
    watcher = None
    if stop is not None:
        async def watch() -> None:
            await stop.wait()
            server.should_exit = True

        watcher = asyncio.ensure_future(watch())
    try:
        await server.serve(sockets=[sock])
    finally:
        if watcher is not None:
            watcher.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)


class BackgroundServer:
    """Runs ``app`` under uvicorn on its own thread and event loop; ``port`` is known as soon as
    the object exists (the socket is bound in the constructor)."""

    def __init__(self, app: OpenAIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.sock = bind(host, port)
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        self.server = make_server(app, graceful_s=2)
        self._thread = threading.Thread(target=self._main, name="exl3-server", daemon=True)
        self._error: BaseException | None = None

    def _main(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # noqa: BLE001 - reported to start()/stop()
            self._error = e

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"server thread exited during start-up: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()
        if self._thread.is_alive():
            raise TimeoutError(f"server did not stop within {timeout} s")

    def __enter__(self) -> BackgroundServer:  # noqa: PYI034 - typing.Self needs 3.11+ typing_extensions here
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
