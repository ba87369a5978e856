"""How a healing replica group fetches the live state from a peer: an HTTP server on the
group's own address that serves the state only to holders of the job's key, and a client
that loads nothing it cannot authenticate.

torchft's default transport (``HTTPTransport``) listens on every interface, serves the
state to anyone who asks and unpickles what it receives (``weights_only=False``): whoever
can reach a group, or register a fake one with the lighthouse, could read the weights or
run code in a healing group. This one:

- binds the address given (the job's network), never a wildcard;
- answers a request only with the job's key: ``X-Ckpt-Live-Auth`` is an HMAC, under the
  key, of the URL asked for (this server's address and the step), so a proof sent to a
  fake heal source cannot be relayed to a real group; anything else gets 403 and no byte
  of state;
- signs each answer (HMAC of the step and the body's SHA-256), and the client checks the
  signature before it deserializes, with ``torch.load(weights_only=True)``: tensors and
  plain containers only, never code;
- the client asks only ``http://`` sources, requires a ``Content-Length`` within
  ``max_bytes``, and the whole answer (status line, headers and body) must arrive within
  one deadline (``timeout``; at the deadline the connection is shut down): a source that
  lies about the size, trickles or never ends costs a failed heal, not the group's memory
  or time;
- the client never goes through an ``http_proxy`` from the environment;
- the served copy is dropped once the step is voted on (``disallow_checkpoint``); at most
  ``max_requests`` connections are handled at once (more are closed unread), and a
  request must arrive whole within ``timeout`` of its accept (a connection that trickles
  it is cut then) and its answer be taken within ``timeout`` of its first byte, so no one
  without the key holds a slot for longer (ckpt.tools.BoundedServer).

It carries no encryption: the state crosses the job's network in the clear, like the
gradients do; someone who can read that traffic could replay a request for the same
step and source while it is served.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import io
import logging
import re
import socket
import threading
import time
from urllib.parse import urlsplit
from datetime import timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torchft.checkpointing.transport import CheckpointTransport

from ckpt.tools import BoundedServer, DeadlineHandler

log = logging.getLogger("trainer.live")

AUTH_HEADER = "X-Ckpt-Live-Auth"
#: The shortest key the transport takes.
MIN_KEY_BYTES = 16
SIGNATURE_HEADER = "X-Ckpt-Live-Signature"


def _same(given: str, expected: str) -> bool:
    """``given`` (a header's value, any characters) equals ``expected``, in constant time
    (compare_digest refuses str with characters outside ASCII: compare bytes)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


def request_mac(key: bytes, url: str) -> str:
    """The request's proof of the key for ``url`` (the source's address and the step)."""
    return hmac.new(key, f"ckpt-live/get/{url}".encode(), hashlib.sha256).hexdigest()


def body_mac(key: bytes, step: int, body: bytes) -> str:
    """The answer's signature: the step and the body's digest under the key."""
    digest = hashlib.sha256(body).hexdigest()
    return hmac.new(key, f"ckpt-live/state/{step}/{digest}".encode(),
                    hashlib.sha256).hexdigest()


class HealAuthError(PermissionError):
    """A peer's answer to a heal request did not carry the job's signature."""


class KeyedHTTPTransport(CheckpointTransport[Any]):
    """torchft's checkpoint transport, bound to ``host`` and keyed (see the module).

    Args:
        host: the replica group's address on the job's network.
        key: the job's secret (the same bytes in every group; at least ``MIN_KEY_BYTES``).
        timeout: seconds for a whole heal transfer (and for a request's arrival).
        max_bytes: the largest state this group accepts from a peer (the trainer sets
            a bound from its own state's size).
        max_requests: connections handled at once; more are closed unread.
    """

    def __init__(self, host: str, key: bytes, timeout: timedelta, *,
                 max_bytes: int = 1 << 34, max_requests: int = 16) -> None:
        if len(key) < MIN_KEY_BYTES:  # a short key could be searched for, then used
            raise ValueError(f"the heal transport needs the job's key of at least "
                             f"{MIN_KEY_BYTES} random bytes (the supervisor makes 32: "
                             f"secrets.token_hex(32)), not {len(key)}")
        self._host, self._key, self._timeout = host, key, timeout
        self.max_bytes = max_bytes
        self._served = threading.Condition()
        self._step: int | None = None
        self._body = b""
        transport = self

        class Handler(DeadlineHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                transport._answer(self)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("heal server: " + fmt, *args)

        # the request within `timeout` of its accept, the answer within `timeout` of its
        # first byte, `max_requests` connections at once
        self._server = BoundedServer(
            (host, 0), Handler, family=socket.AF_INET6 if ":" in host else socket.AF_INET,
            max_connections=max_requests, request_s=timeout.total_seconds(),
            name="ckpt-live-heal-server", log=log)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="ckpt-live-heal-server", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def metadata(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}/checkpoint/"

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        parts = request.path.strip("/").split("/")
        digits = len(parts) == 2 and re.fullmatch(r"[0-9]{1,19}", parts[1])
        step = int(parts[1]) if digits else None
        given = request.headers.get(AUTH_HEADER, "")
        # the proof names this server's own URL: one made for another source is refused
        if step is None or not _same(given, request_mac(self._key,
                                                         f"{self.metadata()}{step}")):
            request.send_error(403, "the job's key is required")
            return
        # The peer may ask before this group's quorum thread has staged the step: wait.
        with self._served:
            self._served.wait_for(lambda: self._step is not None and self._step >= step,
                                  timeout=self._timeout.total_seconds())
            served, body = self._step, self._body
        if served != step:
            request.send_error(409, f"serving step {served}, not {step}")
            return
        request.send_response(200)
        request.send_header("Content-Type", "application/octet-stream")
        request.send_header("Content-Length", str(len(body)))
        request.send_header(SIGNATURE_HEADER, body_mac(self._key, step, body))
        request.end_headers()
        request.wfile.write(body)

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any,
                        timeout: timedelta) -> None:
        """Serve ``state_dict`` as ``step`` (a CPU copy, taken now) until the next one."""
        buf = io.BytesIO()
        cpu = tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v,
                       state_dict)
        torch.save(cpu, buf)
        with self._served:
            self._step, self._body = step, buf.getvalue()
            self._served.notify_all()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> Any:
        """The state a peer serves as ``step``; :class:`HealAuthError` if the source is
        not an ``http://`` URL or its answer is not signed with the job's key, too large
        or without a size; ConnectionError if it answers with an error; TimeoutError if
        the answer takes longer than ``timeout`` in all."""
        url = f"{metadata}{step}"
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise HealAuthError(f"the heal source {metadata!r} is not an http:// URL: not "
                                f"asking it")
        seconds = timeout.total_seconds()
        deadline = time.monotonic() + seconds
        # http.client, not urllib: never through an http_proxy from the environment (it
        # would see the proof and the state), and the socket is ours to cut at the deadline
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=seconds)
        expired = threading.Event()

        def cut() -> None:  # a source that trickles its status line or headers
            expired.set()
            # read once: conn.close() in the finally below may set it to None meanwhile
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(seconds, cut)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.connect()
            if expired.is_set():  # the watchdog fired before there was a socket to cut
                raise TimeoutError("connecting took the whole deadline")
            conn.request("GET", parts.path or "/",
                         headers={AUTH_HEADER: request_mac(self._key, url)})
            answer = conn.getresponse()
            if answer.status != 200:
                raise ConnectionError(f"the heal source {metadata} answered HTTP "
                                      f"{answer.status}: {answer.reason}")
            body = self._read(answer, metadata, deadline, timeout)
            signature = answer.getheader(SIGNATURE_HEADER, "")
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set() or isinstance(e, TimeoutError):
                raise TimeoutError(f"the heal from {metadata} took longer than "
                                   f"{seconds:g}s") from e
            if isinstance(e, OSError):
                raise
            raise ConnectionError(f"the heal source {metadata} sent no valid HTTP answer: "
                                  f"{e!r}") from e
        finally:
            watchdog.cancel()
            conn.close()
        if not _same(signature, body_mac(self._key, step, body)):
            raise HealAuthError(f"the heal source {metadata} answered without the job's "
                                f"signature: not loading its state")
        return torch.load(io.BytesIO(body), weights_only=True, map_location="cpu")

    def _read(self, answer: Any, source: str, deadline: float, timeout: timedelta) -> bytes:
        """The answer's body: its announced size within ``max_bytes``, read in chunks
        until ``deadline``; ConnectionError if the source hangs up before the end (it
        was likely lost: the next group to go)."""
        try:
            size = int(answer.getheader("Content-Length", ""))
        except ValueError:
            raise HealAuthError(f"the heal source {source} sent no Content-Length: not "
                                f"reading its answer") from None
        if not 0 <= size <= self.max_bytes:
            raise HealAuthError(f"the heal source {source} announced {size} bytes, more "
                                f"than this group accepts ({self.max_bytes})")
        out = bytearray()
        while len(out) < size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the heal from {source} took longer than "
                                   f"{timeout.total_seconds():g}s")
            piece = answer.read1(min(1 << 20, size - len(out)))
            if not piece:
                raise ConnectionError(f"the heal source {source} closed after {len(out)} of "
                                      f"{size} bytes")
            out += piece
        return bytes(out)

    def disallow_checkpoint(self) -> None:
        """The step was voted on (its healers have fetched it before the vote, which
        follows their all-reduce with this group): drop the served copy."""
        with self._served:
            self._step, self._body = None, b""

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=self._timeout.total_seconds())


__all__ = ["AUTH_HEADER", "MIN_KEY_BYTES", "SIGNATURE_HEADER", "HealAuthError",
           "KeyedHTTPTransport", "body_mac", "request_mac"]
