"""The heal transport of live recovery (trainer/live/transport.py) as an attacker on the
job's network sees it: someone who reaches a group's heal server, or who registers a fake
replica group with the lighthouse and so becomes a healing group's source.

The server gives no byte of state without a proof of the job's key made for its own URL
(a proof sent to a fake source cannot be relayed), and drops the state once the step is
voted on; the healing client asks only http:// sources, loads nothing unsigned, and bounds
what a source can cost it: the body's size and the transfer's time.
"""
from __future__ import annotations

import http.server
import pickle
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest

from tests.support.prom import ask_at_the_deadline, dripping_server, trickle_until_cut

pytest.importorskip("torchft")

KEY = b"k" * 32
T = timedelta(seconds=5)


def _fake_source(respond: Callable[[http.server.BaseHTTPRequestHandler], None]
                 ) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            respond(self)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _url(server: http.server.ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/checkpoint/"


@pytest.fixture
def source():
    import torch

    from trainer.live.transport import KeyedHTTPTransport

    t = KeyedHTTPTransport("127.0.0.1", KEY, T)
    secret = torch.arange(1000, dtype=torch.float32) * 3.25
    t.send_checkpoint([1], 7, {"model": {"w": secret}}, T)
    yield t, secret
    t.shutdown()


def _get(url: str, headers: dict[str, str]) -> urllib.error.HTTPError:
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5)
    return e.value


def test_heal_server_gives_nothing_without_the_key(source) -> None:
    """Without the job's key: 403 and no byte of state, with no header, a made-up one,
    one for another step or made with another key; the key holder gets the state."""
    import torch

    from trainer.live.transport import AUTH_HEADER, request_mac

    t, secret = source
    assert t._server.server_address[0] == "127.0.0.1"
    url = t.metadata() + "7"
    for headers in ({}, {AUTH_HEADER: "0" * 64},
                    {AUTH_HEADER: request_mac(KEY, t.metadata() + "8")},
                    {AUTH_HEADER: request_mac(b"x" * 32, url)}):
        error = _get(url, headers)
        assert error.code == 403
        assert secret.numpy().tobytes()[:64] not in error.read()
    got = t.recv_checkpoint(0, t.metadata(), 7, T)
    assert torch.equal(got["model"]["w"], secret)


def test_proof_sent_to_a_fake_source_cannot_be_relayed(source) -> None:
    """A fake replica group named as the heal source receives the healing group's proof
    for step 7; relayed to a real group's server it gets 403 (the proof names the URL it
    was made for)."""
    from trainer.live.transport import AUTH_HEADER, HealAuthError, KeyedHTTPTransport

    t, secret = source
    captured: dict[str, str] = {}

    def capture(handler: http.server.BaseHTTPRequestHandler) -> None:
        captured["proof"] = handler.headers[AUTH_HEADER]
        handler.send_response(200)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    fake = _fake_source(capture)
    healer = KeyedHTTPTransport("127.0.0.1", KEY, T)
    try:
        with pytest.raises(HealAuthError):
            healer.recv_checkpoint(0, _url(fake), 7, T)
        error = _get(t.metadata() + "7", {AUTH_HEADER: captured["proof"]})
        assert error.code == 403 and secret.numpy().tobytes()[:64] not in error.read()
    finally:
        healer.shutdown()
        fake.shutdown()


def test_served_state_dropped_once_the_step_is_voted_on(source) -> None:
    """After the vote (``disallow_checkpoint``) the server holds no copy of the state and
    answers a valid proof for that step with 409, no state."""
    from trainer.live.transport import AUTH_HEADER, request_mac

    t, secret = source
    t.disallow_checkpoint()
    assert t._body == b""
    url = t.metadata() + "7"
    t._timeout = timedelta(seconds=0.2)  # the server waits this long for a staged step
    error = _get(url, {AUTH_HEADER: request_mac(KEY, url)})
    assert error.code == 409 and secret.numpy().tobytes()[:64] not in error.read()


def test_malformed_step_refused(source) -> None:
    """A request whose step is not plain ASCII digits ('²' passes str.isdigit) gets 403."""
    import socket

    t, _ = source
    with socket.create_connection(("127.0.0.1", t.port), timeout=5) as s:
        s.sendall(b"GET /checkpoint/\xb2 HTTP/1.0\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.0 403")


def test_heal_request_never_goes_through_a_proxy(source, monkeypatch) -> None:
    """An ``http_proxy`` in the environment (common on clusters) never sees a heal
    request: the proof and the state go straight to the peer."""
    import socket

    import torch

    t, secret = source
    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy.listen(4)
    proxy.settimeout(0.5)
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.getsockname()[1]}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    try:
        got = t.recv_checkpoint(0, t.metadata(), 7, T)
        assert torch.equal(got["model"]["w"], secret)
        with pytest.raises(socket.timeout):
            proxy.accept()
    finally:
        proxy.close()


def test_heal_server_bounds_its_connections() -> None:
    """Connections past ``max_requests`` are closed unread (idle ones hold a slot only
    until they go); once they go, the key holder is served again."""
    import socket

    import torch

    from trainer.live.transport import KeyedHTTPTransport

    t = KeyedHTTPTransport("127.0.0.1", KEY, T, max_requests=2)
    idle = [socket.create_connection(("127.0.0.1", t.port), timeout=5) for _ in range(2)]
    try:
        t.send_checkpoint([1], 7, {"w": torch.ones(3)}, T)
        time.sleep(0.2)  # the server accepts both idle connections
        with socket.create_connection(("127.0.0.1", t.port), timeout=5) as extra:
            extra.sendall(b"GET /checkpoint/7 HTTP/1.0\r\n\r\n")
            assert extra.recv(64) == b""  # closed, nothing read or answered
        for s in idle:
            s.close()
        wait_until = time.monotonic() + 10
        while True:
            try:
                assert torch.equal(t.recv_checkpoint(0, t.metadata(), 7, T)["w"],
                                   torch.ones(3))
                break
            except OSError:
                if time.monotonic() > wait_until:
                    raise
                time.sleep(0.1)
    finally:
        for s in idle:
            s.close()
        t.shutdown()


def test_healing_group_loads_nothing_from_a_fake_peer(tmp_path: Path) -> None:
    """A fake peer that serves a pickle which would run code: the healing group refuses
    it unread, so nothing runs."""
    from trainer.live.transport import HealAuthError, KeyedHTTPTransport

    marker = tmp_path / "owned"

    class Evil:
        def __reduce__(self):  # runs at unpickling
            return (open, (str(marker), "w"))

    payload = pickle.dumps(Evil())

    def serve(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("X-Ckpt-Live-Signature", "f" * 64)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    fake = _fake_source(serve)
    t = KeyedHTTPTransport("127.0.0.1", KEY, T)
    try:
        with pytest.raises(HealAuthError, match="signature"):
            t.recv_checkpoint(0, _url(fake), 3, T)
        assert not marker.exists()
    finally:
        t.shutdown()
        fake.shutdown()


def test_heal_source_must_be_http(tmp_path: Path) -> None:
    """A source named by a file:// (or any non-http) URL is not opened: the healing
    group's own files, or /dev/zero, are never read."""
    from trainer.live.transport import HealAuthError, KeyedHTTPTransport

    t = KeyedHTTPTransport("127.0.0.1", KEY, T)
    try:
        for source in ("file:///dev/zero#", f"file://{tmp_path}/#", "ftp://127.0.0.1/"):
            with pytest.raises(HealAuthError, match="http"):
                t.recv_checkpoint(0, source, 3, T)
    finally:
        t.shutdown()


def test_heal_body_size_bounded() -> None:
    """A source that announces more than the group accepts, or no size at all, is not
    read."""
    from trainer.live.transport import HealAuthError, KeyedHTTPTransport

    def huge(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(1 << 40))
        handler.end_headers()

    def unsized(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.end_headers()
        handler.wfile.write(b"x" * 1000)

    t = KeyedHTTPTransport("127.0.0.1", KEY, T, max_bytes=1 << 20)
    servers = [_fake_source(huge), _fake_source(unsized)]
    try:
        with pytest.raises(HealAuthError, match="accepts"):
            t.recv_checkpoint(0, _url(servers[0]), 3, T)
        with pytest.raises(HealAuthError, match="Content-Length"):
            t.recv_checkpoint(0, _url(servers[1]), 3, T)
    finally:
        t.shutdown()
        for s in servers:
            s.shutdown()


def test_heal_transfer_bounded_by_one_deadline() -> None:
    """A source that trickles its body (a byte every 0.4 s) fails the heal with a
    TimeoutError once the transfer's deadline passes, though no single read waits that
    long (the time taken is printed)."""
    from trainer.live.transport import KeyedHTTPTransport

    def drip(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "20")
        handler.end_headers()
        for _ in range(20):
            try:
                handler.wfile.write(b"x")
                handler.wfile.flush()
            except OSError:
                return
            time.sleep(0.4)

    fake = _fake_source(drip)
    t = KeyedHTTPTransport("127.0.0.1", KEY, timedelta(seconds=1))
    began = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="longer than"):
            t.recv_checkpoint(0, _url(fake), 3, timedelta(seconds=1))
    finally:
        print(f"\ntrickling source given up after {time.monotonic() - began:.1f}s")
        t.shutdown()
        fake.shutdown()


def test_wildcard_addresses_refused() -> None:
    """The job's listeners that we bind take its address, never a wildcard, however it is
    spelt ('0' and '0x0' are 0.0.0.0 to bind(), '::0' is '::')."""
    from trainer.live.config import LiveConfig
    from trainer.live.lighthouse import start_lighthouse

    spellings = ("0.0.0.0", "::", "", "0", "0.0", "0x0", "::0", "[::0]", "0:0::0", "[::]")
    for host in spellings:
        with pytest.raises(ValueError, match="address"):
            LiveConfig(lighthouse="127.0.0.1:1", host=host)
        with pytest.raises(ValueError, match="address"):
            start_lighthouse(f"{host}:0", 1)


@pytest.mark.parametrize("host", ["::ffff:0.0.0.0", "[::ffff:0.0.0.0]", "::ffff:0:0"])
def test_v4_mapped_wildcards_refused(host: str) -> None:
    """The IPv4-mapped 0.0.0.0, however spelt, is every IPv4 interface to bind() (a
    connection to 127.0.0.1 reaches it): refused like 0.0.0.0."""
    import socket

    from trainer.live.config import LiveConfig, is_wildcard
    from trainer.live.lighthouse import start_lighthouse

    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind((host.strip("[]"), 0))
    except OSError:
        probe = None  # no IPv6 here: only the refusal is checked
    if probe is not None:
        with probe:
            probe.listen()
            with socket.create_connection(("127.0.0.1", probe.getsockname()[1]), timeout=5):
                pass
    assert is_wildcard(host)
    with pytest.raises(ValueError, match="every interface"):
        LiveConfig(lighthouse="127.0.0.1:1", host=host)
    with pytest.raises(ValueError, match="address"):
        start_lighthouse(f"{host}:0", 1)


def test_source_lost_mid_transfer_is_a_connection_error() -> None:
    """A source that hangs up part way (the next group lost) fails the heal with a
    ConnectionError that says so, not as an unsigned answer."""
    from trainer.live.transport import KeyedHTTPTransport

    def cut(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        handler.wfile.write(b"x" * 10)
        handler.wfile.flush()
        handler.close_connection = True

    fake = _fake_source(cut)
    t = KeyedHTTPTransport("127.0.0.1", KEY, T)
    try:
        with pytest.raises(ConnectionError, match="closed after 10 of 1000"):
            t.recv_checkpoint(0, _url(fake), 3, T)
    finally:
        t.shutdown()
        fake.shutdown()


def test_trickled_status_and_headers_bounded_by_the_deadline() -> None:
    """A fake source that answers with a status line, then trickles an endless header (a
    byte every 0.2 s, for 30 s at most): the heal fails with a TimeoutError once the
    transfer's deadline passes, though every single byte arrives in time."""
    from trainer.live.transport import KeyedHTTPTransport

    listener, done = dripping_server(150)  # a header byte every 0.2 s, 30 s at most
    t = KeyedHTTPTransport("127.0.0.1", KEY, timedelta(seconds=1))
    began = time.monotonic()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/checkpoint/"
        with pytest.raises(TimeoutError, match="longer than"):
            t.recv_checkpoint(0, url, 3, timedelta(seconds=1))
    finally:
        print(f"\ntrickled headers given up after {time.monotonic() - began:.1f}s")
        done.set()
        t.shutdown()
        listener.close()


def test_a_deadline_passed_while_connecting_sends_no_request(monkeypatch) -> None:
    """A connect that outlasts the heal's deadline (the watchdog fired with no socket yet
    to cut) fails the heal with a TimeoutError and sends nothing: the exchange after it
    would run with no deadline."""
    import http.client
    import socket

    from trainer.live.transport import KeyedHTTPTransport

    listener = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def source() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            try:
                got.append(conn.recv(65536))
            except OSError:
                got.append(b"")

    threading.Thread(target=source, daemon=True).start()
    connect = http.client.HTTPConnection.connect

    def slow_connect(self: http.client.HTTPConnection) -> None:
        time.sleep(1.5)
        connect(self)

    monkeypatch.setattr(http.client.HTTPConnection, "connect", slow_connect)
    t = KeyedHTTPTransport("127.0.0.1", KEY, timedelta(seconds=1))
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/checkpoint/"
        with pytest.raises(TimeoutError, match="longer than"):
            t.recv_checkpoint(0, url, 3, timedelta(seconds=1))
        for _ in range(200):
            if got:
                break
            time.sleep(0.05)
        assert got == [b""]  # connected, then closed: no request sent
    finally:
        t.shutdown()
        listener.close()


def test_a_connection_closed_while_the_watchdog_cuts_it_is_no_error(monkeypatch) -> None:
    """The heal's watchdog may fire as the client closes its connection (conn.close() sets
    conn.sock to None between any two reads of it): the cut shuts down the socket it
    found, raises nothing in the watchdog's thread, and the heal fails with a
    TimeoutError at its deadline. The close is made to land just after the watchdog's
    first read of conn.sock."""
    import http.client
    import socket

    from trainer.live import transport

    class ClosedDuringCut(http.client.HTTPConnection):
        @property
        def sock(self) -> socket.socket | None:
            value = self.__dict__.get("_sock")
            if value is not None and isinstance(threading.current_thread(), threading.Timer):
                self.__dict__["_sock"] = None  # closed now, as by the client's finally
                found.append(value)
            return value

        @sock.setter
        def sock(self, value: socket.socket | None) -> None:
            self.__dict__["_sock"] = value

    found: list[socket.socket] = []
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    monkeypatch.setattr(transport.http.client, "HTTPConnection", ClosedDuringCut)
    listener, done = dripping_server(25)  # a header byte every 0.2 s, 5 s at most
    t = transport.KeyedHTTPTransport("127.0.0.1", KEY, timedelta(seconds=1))
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/checkpoint/"
        with pytest.raises(TimeoutError, match="longer than"):
            t.recv_checkpoint(0, url, 3, timedelta(seconds=1))
        assert errors == [] and len(found) == 1
    finally:
        done.set()
        for sock in found:
            sock.close()
        t.shutdown()
        listener.close()


def test_a_trickled_request_does_not_keep_its_slot() -> None:
    """Connections that trickle their request line (a byte every 0.2 s, no key needed)
    are cut once the request's deadline (``timeout`` from the accept) passes, before the
    request is whole; the slots they held then serve the key holder again."""
    import torch

    from trainer.live.transport import KeyedHTTPTransport

    t = KeyedHTTPTransport("127.0.0.1", KEY, timedelta(seconds=1), max_requests=2)
    t.send_checkpoint([1], 7, {"w": torch.ones(3)}, T)
    line = b"GET /checkpoint/" + b"7" * 100 + b" HTTP/1.0\r\n\r\n"
    cut: list[bool] = []

    def trickle() -> None:
        cut.append(trickle_until_cut(t.port, line) < len(line))

    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(2)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert cut == [True, True]  # both cut before their request was whole
        got = t.recv_checkpoint(0, t.metadata(), 7, T)
        assert torch.equal(got["w"], torch.ones(3))
    finally:
        t.shutdown()


def test_a_request_that_arrives_near_its_deadline_is_answered_whole() -> None:
    """A key holder's request whose last byte arrives just before the request's deadline
    (its last read left the socket a fraction of a second) is answered whole to a reader
    that starts a second later: the answer has ``timeout`` of its own."""
    import torch

    from trainer.live.transport import KeyedHTTPTransport, request_mac

    t = KeyedHTTPTransport("127.0.0.1", KEY, timedelta(seconds=3))
    t.send_checkpoint([1], 7, {"w": torch.zeros(4 << 20)}, T)  # 16 MiB
    proof = request_mac(KEY, f"{t.metadata()}7").encode()
    try:
        head, body, length = ask_at_the_deadline(
            t.port, b"GET /checkpoint/7 HTTP/1.0\r\nX-Ckpt-Live-Auth: " + proof + b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200")
        assert len(body) == length > 16 << 20
    finally:
        t.shutdown()


def test_non_ascii_proofs_and_signatures_are_refused_as_such(source) -> None:
    """A proof or a signature with bytes outside ASCII is a wrong one: the server answers
    403, the client refuses the answer with a HealAuthError (not a TypeError from the
    comparison)."""
    import socket

    from trainer.live.transport import HealAuthError, KeyedHTTPTransport

    t, _ = source
    with socket.create_connection(("127.0.0.1", t.port), timeout=5) as s:
        s.sendall(b"GET /checkpoint/7 HTTP/1.0\r\nX-Ckpt-Live-Auth: " + b"\xff" * 64
                  + b"\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.0 403")

    def serve(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("X-Ckpt-Live-Signature", "\xff" * 64)
        handler.send_header("Content-Length", "3")
        handler.end_headers()
        handler.wfile.write(b"abc")

    fake = _fake_source(serve)
    healer = KeyedHTTPTransport("127.0.0.1", KEY, T)
    try:
        with pytest.raises(HealAuthError, match="signature"):
            healer.recv_checkpoint(0, _url(fake), 3, T)
    finally:
        healer.shutdown()
        fake.shutdown()


def test_a_short_key_is_refused() -> None:
    """A key shorter than 16 bytes (one a neighbour could search for, then ask for the
    state with) is refused when the transport is made; the supervisor's is 32 bytes."""
    from trainer.live.transport import KeyedHTTPTransport

    for key in (b"", b"k", b"k" * 15):
        with pytest.raises(ValueError, match="key"):
            KeyedHTTPTransport("127.0.0.1", key, T)
