"""Helpers for tests of the metrics exporters: a free port, the text format, what listens
where, and the clients an attacker of a bounded server would be (idle, trickling)."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """``ckpt_*`` samples of the Prometheus text format: series (with labels) -> value."""
    out = {}
    for line in text.splitlines():
        if line.startswith("ckpt_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def listening(port: int) -> set[str]:
    """The local IPv4 addresses a socket listens on at ``port``, read from /proc/net/tcp
    (what the kernel bound, whatever the process says)."""
    found = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            local, state = line.split()[1], line.split()[3]
            host, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(socket.inet_ntoa(bytes.fromhex(host)[::-1]))
    return found


def scrape(port: int, address: str = "127.0.0.1") -> dict[str, float]:
    """The ``ckpt_*`` samples served at ``http://address:port/metrics``."""
    with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=10) as answer:
        return parse_metrics(answer.read().decode())


def threads_for_idle_connections(port: int, count: int = 20) -> tuple[int, bool]:
    """Open ``count`` connections to 127.0.0.1:``port`` that send nothing (anyone who
    reaches the port can): the threads this process started while they were open, and
    whether the server closed every one (unread, or at its request deadline)."""
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]
    try:
        time.sleep(0.5)  # the server accepts them all
        started = threading.active_count() - before
        return started, all(s.recv(64) == b"" for s in idle)
    finally:
        for s in idle:
            s.close()


def trickle_until_cut(port: int, message: bytes, every: float = 0.2) -> int:
    """Send ``message`` to 127.0.0.1:``port`` a byte every ``every`` seconds until the
    server hangs up: the bytes sent by then (``len(message)`` if it never did)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            for i in range(len(message)):
                s.sendall(message[i:i + 1])
                sent += 1
                time.sleep(every)
                s.setblocking(False)  # has the server hung up?
                try:
                    if s.recv(1024) == b"":
                        return sent
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
        except OSError:  # hung up while a byte was on its way
            return sent
    return sent


def ask_at_the_deadline(port: int, request: bytes) -> tuple[bytes, bytes, int]:
    """Send ``request`` (a whole HTTP/1.0 request) to 127.0.0.1:``port`` the way a slow key
    holder would: all but its last byte after 2.7 s, the last 0.1 s later (the server's
    last read then waits with about 0.2 s left of a 3 s deadline), and read the answer only
    a second after that. Returns (head, body, the head's content-length)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        time.sleep(2.7)
        s.sendall(request[:-1])
        time.sleep(0.1)  # the server's last read waits with ~0.2 s left
        s.sendall(request[-1:])
        time.sleep(1.0)  # the answer fills the sockets meanwhile
        received = bytearray()
        while piece := s.recv(1 << 20):
            received += piece
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), b"-1"))
    return head, body, length


def dripping_server(bytes_at_most: int) -> tuple[socket.socket, threading.Event]:
    """A listener on 127.0.0.1 whose one connection gets a status line, then a header a
    byte every 0.2 s (``bytes_at_most`` of them), until the returned event is set or the
    client hangs up: a peer that answers too slowly to ever finish. Close the listener."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def drip() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(b"HTTP/1.0 200 OK\r\nX-Pad: ")
                for _ in range(bytes_at_most):
                    if done.is_set():
                        return
                    conn.sendall(b"a")
                    time.sleep(0.2)
            except OSError:
                return

    threading.Thread(target=drip, daemon=True).start()
    return listener, done


def plant_link(path: str, victim: str) -> str:
    """A link to ``victim`` planted where prometheus_client would put the temporary file
    of ``path`` from this thread (``<path>.<pid>.<thread id>``): its path."""
    planted = f"{path}.{os.getpid()}.{threading.current_thread().ident}"
    os.symlink(victim, planted)
    return planted
