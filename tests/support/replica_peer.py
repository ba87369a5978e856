"""A hand-made peer of the replica receiver (``ckpt/_memory/replica_wire.py``): it proves a key
it is given (the job's or a wrong one), then sends whatever header and bytes a test chooses."""

from __future__ import annotations

import hashlib
import json
import socket
import time

from ckpt._memory import replica_wire as wire


def send_replica(address: tuple, key: str, job: str, header: dict, payload: bytes, *,
                 close_early: bool = False) -> bytes:
    """Speak the replication protocol to the receiver at ``address`` with ``key``; returns its
    reply (b"OK", or b"" when it refused and hung up). A header without ``doc_sha256`` gets
    the SHA-256 of the last ``header["doc"]`` bytes of ``payload``."""
    if "doc_sha256" not in header:
        doc = payload[len(payload) - header["doc"]:] if header["doc"] else b""
        header = {**header, "doc_sha256": hashlib.sha256(doc).hexdigest()}
    with socket.create_connection(address, timeout=30) as sock:
        try:
            nonces = wire.sender_handshake(sock, wire.key_of(key), job, time.monotonic() + 30)
        except (OSError, PermissionError):  # it hung up on the proof: a refusal
            return b""
        try:
            sock.sendall(wire.header_frame(wire.key_of(key), nonces,
                                           json.dumps(header).encode()) + payload)
            if close_early:
                return b""
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # it hung up before reading everything: a refusal
            pass
        reply = b""
        try:
            while chunk := sock.recv(16):
                reply += chunk
        except OSError:
            pass
        return reply
