"""What `pdserve serve` does around its launchers, on small real objects: a taken port refused in one
line, readiness polled until /ready answers 200 (or given up, naming what it said), a second stop
signal not cutting the first one's drain short. (tests/integration/test_serve_cli.py runs serve.)"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import threading

import pytest

from pdserve.cluster.startup import bind_port, local_url, on_stop_signals, wait_until_ready
from pdserve.configs import ConfigError


def test_a_taken_port_is_one_line_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as e:
            bind_port("127.0.0.1", port)
    assert str(e.value) == (f"router.port: port {port} on 127.0.0.1 is already in use; stop what holds it or "
                            f"choose another (--port)")
    bind_port("127.0.0.1", port).close()  # free again: bound, and closed again


def test_a_wildcard_host_is_reached_on_loopback():
    assert local_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert local_url("::", 8000) == "http://[::1]:8000"
    assert local_url("10.0.0.5", 80) == "http://10.0.0.5:80"


class Ready:
    """A /ready endpoint answering 503, then 200 from its ``ready_from``-th request on (None: never)."""

    def __init__(self):
        self.ready_from: int | None = None
        self.asked = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.asked += 1
                code = 200 if outer.ready_from is not None and outer.asked >= outer.ready_from else 503
                body = b'{"ready": %s}' % (b"true" if code == 200 else b"false")
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    e = Ready()
    yield e
    e.close()


def test_ready_only_once_ready_answers_200(endpoint):
    endpoint.ready_from = 4  # three 503s first
    assert wait_until_ready(endpoint.url, 30, stopped=lambda: False, poll_s=0.01)
    assert endpoint.asked == 4


def test_giving_up_names_what_ready_said(endpoint):
    with pytest.raises(TimeoutError, match=r'not ready after 0 s.*/ready: 503 \{"ready": false\}'):
        wait_until_ready(endpoint.url, 0.05, stopped=lambda: False, poll_s=0.01)


def test_a_stop_while_waiting_is_not_ready(endpoint):
    assert wait_until_ready(endpoint.url, 30, stopped=lambda: endpoint.asked >= 2, poll_s=0.01) is False


def test_a_second_signal_does_not_repeat_the_stop():
    calls = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        on_stop_signals(lambda: calls.append(1))
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert calls == [1]
