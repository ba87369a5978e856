"""An HTTP server that bounds what a client costs the process serving it: the metrics
server (ckpt/_manager/metrics.py, and the trainer's exporter through it) and the live heal
server (trainer/live/transport.py) are both this one.

- at most ``max_connections`` connections are handled at once, each on its own thread; a
  slot is taken when the connection is accepted, before any byte of it is read, and more
  connections are closed unread (a flood of idle connections costs no thread);
- a request must arrive whole within ``request_s`` of its accept, however it trickles
  (each read waits only for what is left of that deadline);
- the answer must be taken within ``request_s`` of its first byte, however little of the
  request's deadline the reads left (a reader that stops reading is cut then);
- a connection that fails or is cut is a debug line, not a traceback on the process's
  stderr (anyone who reaches the port could fill it).
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any


class DeadlineReader(io.RawIOBase):
    """A socket's reads, each limited to what is left until ``deadline`` (monotonic): a
    peer that trickles a byte at a time cannot stretch a request past it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class DeadlineWriter(io.BufferedIOBase):
    """A socket's writes, all within ``seconds`` of the first one (the answer's own
    deadline: the socket's timeout is set for each write, never left from a read)."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._sock, self._seconds = sock, seconds
        self._deadline: float | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self._deadline is None:
            self._deadline = time.monotonic() + self._seconds
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the answer was not taken in time")
        self._sock.settimeout(left)
        self._sock.sendall(data)
        with memoryview(data) as view:
            return view.nbytes


class DeadlineHandler(BaseHTTPRequestHandler):
    """A request handler whose reads and writes keep the server's ``request_s`` deadlines
    (put it first among the bases: ``class H(DeadlineHandler, WSGIRequestHandler)``)."""

    server: BoundedServer

    def setup(self) -> None:
        super().setup()
        seconds = self.server.request_s
        self.rfile = io.BufferedReader(DeadlineReader(self.connection,
                                                      time.monotonic() + seconds))
        self.wfile = DeadlineWriter(self.connection, seconds)


class BoundedServer(HTTPServer):
    """An HTTP server on ``address`` (a ``(host, port)`` of ``family``) with a thread per
    connection, at most ``max_connections`` at once, and ``request_s`` deadlines kept by
    ``handler`` (a :class:`DeadlineHandler`). ``name`` and ``log`` say whose the server
    is in its threads' names and its debug lines. Stop it with ``shutdown()`` and
    ``server_close()``."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[DeadlineHandler], *,
                 family: int, max_connections: int, request_s: float, name: str,
                 log: logging.Logger) -> None:
        if not issubclass(handler, DeadlineHandler):
            raise TypeError(f"{handler.__name__} must be a DeadlineHandler: the server's "
                            f"deadlines are kept by its reads and writes")
        self.address_family = family
        self.request_s, self.name, self._log = request_s, name, log
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: closed unread
            return
        try:
            threading.Thread(target=self._handle, args=(request, client_address),
                             name=f"{self.name} connection", daemon=True).start()
        except BaseException:
            self._slots.release()
            self.shutdown_request(request)
            raise

    def _handle(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client cut at its deadline or gone early
        self._log.debug("%s: a request from %s failed", self.name, client_address,
                        exc_info=True)


__all__ = ["BoundedServer", "DeadlineHandler", "DeadlineReader", "DeadlineWriter"]
