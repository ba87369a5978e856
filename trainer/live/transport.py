"""How a healing replica group fetches the live state from a peer: an HTTP server on the
group's own address that serves the state only to holders of the job's key, and a client
that loads nothing it cannot authenticate.

torchft's default transport (``HTTPTransport``) listens on every interface, serves the
state to anyone who asks and unpickles what it receives (``weights_only=False``): whoever
can reach a group, or register a fake one with the lighthouse, could read the weights or
run code in a healing group. This one:

- binds the address given (the job's network), never a wildcard;
- answers a request only with the job's key: ``X-Ckpt-Live-Auth`` is an HMAC of the step
  under the key; anything else gets 403 and no byte of state;
- signs each answer (HMAC of the step and the body's SHA-256), and the client checks the
  signature before it deserializes, with ``torch.load(weights_only=True)``: tensors and
  plain containers only, never code.

It carries no encryption: the state crosses the job's network in the clear, like the
gradients do.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import socket
import threading
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torchft.checkpointing.transport import CheckpointTransport

log = logging.getLogger("trainer.live")

AUTH_HEADER = "X-Ckpt-Live-Auth"
SIGNATURE_HEADER = "X-Ckpt-Live-Signature"


def request_mac(key: bytes, step: int) -> str:
    """The request's proof of the key for ``step``."""
    return hmac.new(key, f"ckpt-live/get/{step}".encode(), hashlib.sha256).hexdigest()


def body_mac(key: bytes, step: int, body: bytes) -> str:
    """The answer's signature: the step and the body's digest under the key."""
    digest = hashlib.sha256(body).hexdigest()
    return hmac.new(key, f"ckpt-live/state/{step}/{digest}".encode(),
                    hashlib.sha256).hexdigest()


class HealAuthError(PermissionError):
    """A peer's answer to a heal request did not carry the job's signature."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, handler: type) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, 0), handler)


class KeyedHTTPTransport(CheckpointTransport[Any]):
    """torchft's checkpoint transport, bound to ``host`` and keyed (see the module).

    Args:
        host: the replica group's address on the job's network.
        key: the job's secret (the same bytes in every group).
        timeout: seconds for a request and for each socket read.
    """

    def __init__(self, host: str, key: bytes, timeout: timedelta) -> None:
        if not key:
            raise ValueError("the heal transport needs the job's key")
        self._host, self._key, self._timeout = host, key, timeout
        self._served = threading.Condition()
        self._step: int | None = None
        self._body = b""
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = transport._timeout.total_seconds()

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                transport._answer(self)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("heal server: " + fmt, *args)

        self._server = _Server(host, Handler)
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
        step = int(parts[1]) if len(parts) == 2 and parts[1].isdigit() else None
        given = request.headers.get(AUTH_HEADER, "")
        if step is None or not hmac.compare_digest(given, request_mac(self._key, step)):
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
        """The state a peer serves as ``step``; :class:`HealAuthError` if its answer is
        not signed with the job's key."""
        request = urllib.request.Request(f"{metadata}{step}",
                                         headers={AUTH_HEADER: request_mac(self._key, step)})
        with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as answer:
            body = answer.read()
            signature = answer.headers.get(SIGNATURE_HEADER, "")
        if not hmac.compare_digest(signature, body_mac(self._key, step, body)):
            raise HealAuthError(f"the heal source {metadata} answered without the job's "
                                f"signature: not loading its state")
        return torch.load(io.BytesIO(body), weights_only=True, map_location="cpu")

    def disallow_checkpoint(self) -> None:
        """Nothing to do: the served state is a copy, safe from the next step's update."""

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=self._timeout.total_seconds())


__all__ = ["AUTH_HEADER", "SIGNATURE_HEADER", "HealAuthError", "KeyedHTTPTransport",
           "body_mac", "request_mac"]
