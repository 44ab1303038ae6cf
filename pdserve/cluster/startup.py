"""What ``pdserve serve`` does around either launcher: claim the router's port before anything
loads, say it is ready only when a request will be served, and stop cleanly on a signal.

    sock = bind_port(host, port)          # ConfigError naming the port if it is taken (nothing started yet)
    on_stop_signals(callback)             # SIGTERM / SIGINT: callback once, later ones only logged
    wait_until_ready(url, timeout_s, stopped)   # polls GET /ready until 200 (a decode worker in rotation)
    announce(model, url, detail)          # then, and only then: the log line and PDSERVE_READY <url>
    RouterServer(config, on_signal)       # uvicorn, telling the launcher when a signal stops it

The ready line is the start-up contract with whoever runs ``pdserve serve`` (a user, a test, a
supervisor's probe): a request sent right after it is served, not answered 503 because the
decode worker is still joining the router's rotation.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import uvicorn

from pdserve.configs import ConfigError

log = logging.getLogger(__name__)
READY_LINE = "PDSERVE_READY"
PROGRESS_EVERY_S = 10.0
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # our own router: never through a proxy


def bind_port(host: str, port: int) -> socket.socket:
    """The router's listening socket, bound now (not yet listening), or a one-line ConfigError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a closed server's TIME_WAIT is fine
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"router.port: port {port} on {host or '0.0.0.0'} is already in use; stop what "
                              f"holds it or choose another (--port)") from None
        raise ConfigError(f"router.host/port: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def check_port(host: str, port: int) -> None:
    """Refuse a taken port before anything starts (where another process binds it later: Ray's proxy)."""
    bind_port(host, port).close()


def local_url(host: str, port: int) -> str:
    """Where this machine reaches the router (a wildcard host is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def on_stop_signals(callback: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call ``callback`` the first time; later ones are logged, so a second Ctrl-C
    does not cut the drain short (the workers' own grace period bounds it)."""
    state = {"stopping": False}

    def handler(signum, frame):
        if state["stopping"]:
            log.info("%s: already stopping (in-flight requests are finishing)", signal.Signals(signum).name)
            return
        state["stopping"] = True
        callback()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def wait_until_ready(url: str, timeout_s: float, stopped: Callable[[], bool], poll_s: float = 0.25) -> bool:
    """Poll ``url``/ready until it answers 200: True. False if ``stopped()`` first; TimeoutError after
    ``timeout_s`` naming what /ready last said. Logs progress every few seconds."""
    start = time.monotonic()
    next_progress = start + PROGRESS_EVERY_S
    last = "no answer yet"
    while not stopped():
        status, last = _get(url + "/ready")
        if status == 200:
            return True
        now = time.monotonic()
        if now - start > timeout_s:
            raise TimeoutError(f"not ready after {timeout_s:.0f} s: no decode worker joined the router's rotation "
                               f"(GET {url}/ready: {last})")
        if now >= next_progress:
            log.info("waiting for a decode worker to join the router's rotation (%.0f s; /ready: %s)", now - start,
                     last)
            next_progress = now + PROGRESS_EVERY_S
        time.sleep(poll_s)
    return False


def _get(url: str) -> tuple[int | None, str]:
    """(status, what it said), without a client library's per-request logging."""
    try:
        with _DIRECT.open(url, timeout=5) as r:
            return r.status, r.read(300).decode(errors="replace")
    except urllib.error.HTTPError as e:
        with e:
            return e.code, f"{e.code} {e.read(300).decode(errors='replace')}"
    except (OSError, ValueError) as e:  # refused, reset, timed out: not up yet
        return None, type(e).__name__


class RouterServer(uvicorn.Server):
    """uvicorn's server that also calls ``on_signal`` when a signal asks it to stop, so the workers
    drain alongside the router rather than after it (one grace period, not two)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None] | None = None):
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig, frame) -> None:
        if self.on_signal is not None and not self.should_exit:
            self.on_signal()
        super().handle_exit(sig, frame)


def announce(model: str, url: str, detail: str) -> None:
    log.info("serving %s on %s (%s)", model, url, detail)
    print(f"{READY_LINE} {url}", flush=True)
