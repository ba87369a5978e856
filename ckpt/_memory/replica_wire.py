"""The replication wire: how a replica's sender and receiver prove to each other that they hold
the job's key before anything else crosses, and reads that end at a deadline.

A connection, in order (fixed sizes until the header):

1. receiver -> sender: ``GREETING`` (8 bytes) and the receiver's nonce (32 random bytes);
2. sender -> receiver: the sender's nonce (32) and its proof (32),
   HMAC-SHA256(key, ``"ckpt-replica sender"`` | job | both nonces);
3. receiver -> sender: the receiver's proof (32), the same with ``"ckpt-replica receiver"``.
   Each side hangs up at once on a wrong proof: the receiver has then read 64 bytes and
   allocated nothing for the peer, and the sender has sent nothing of the step. Fresh nonces
   on both sides: a recorded proof is worth nothing on another connection, and the two labels
   keep one side's proof from being reflected as the other's.
4. sender -> receiver: the header's length (4 bytes, at most ``HEADER_MAX``), the header (JSON:
   origin, step, files and their sizes, the rank document's size and SHA-256) and its MAC,
   HMAC-SHA256(key, ``"ckpt-replica header"`` | both nonces | header) (32), which binds the
   header to this connection;
5. sender -> receiver: the files' bytes, then ``rank.json``; receiver -> sender: ``b"OK"``
   once the replica is published.

The data bytes themselves are not MACed here (that would hash every byte on both sides):
``rank.json`` holds every chunk's digest and is itself checked against the header's SHA-256,
so altered data fail their digests when the replica is loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time

GREETING = b"ckptrep2"
NONCE = 32
PROOF = 32
#: The largest header a receiver reads (a step of many files names each one).
HEADER_MAX = 1 << 20
_LENGTH = struct.Struct("!I")


def key_of(secret: str) -> bytes:
    """The HMAC key for the job's ``secret`` (its key in hex); empty: no key yet."""
    return secret.encode()


def proof(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join((label, *parts)), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes from ``sock`` by ``deadline`` (``time.monotonic()``), else TimeoutError:
    a peer that trickles its bytes is dropped at the deadline, not kept by each new byte."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        arm(sock, deadline)
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def arm(sock: socket.socket, deadline: float) -> None:
    """Set ``sock``'s timeout to what is left until ``deadline`` (TimeoutError when none)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the peer did not send in time")
    sock.settimeout(left)


def receiver_handshake(sock: socket.socket, key: bytes, job: str, deadline: float) -> bytes:
    """The receiver's side of steps 1-3; returns the connection's nonces (PermissionError: the
    peer does not hold the key)."""
    mine = secrets.token_bytes(NONCE)
    arm(sock, deadline)
    sock.sendall(GREETING + mine)
    answer = recv_exact(sock, NONCE + PROOF, deadline)
    nonces = mine + answer[:NONCE]
    if not key or not hmac.compare_digest(answer[NONCE:],
                                          proof(key, b"ckpt-replica sender", job.encode(),
                                                nonces)):
        raise PermissionError("a connection that did not prove it holds the job's key")
    sock.sendall(proof(key, b"ckpt-replica receiver", job.encode(), nonces))
    return nonces


def sender_handshake(sock: socket.socket, key: bytes, job: str, deadline: float) -> bytes:
    """The sender's side of steps 1-3; returns the connection's nonces (PermissionError: the
    receiver does not hold the key, and has been sent nothing of the step)."""
    greeting = recv_exact(sock, len(GREETING) + NONCE, deadline)
    if greeting[:len(GREETING)] != GREETING:
        raise PermissionError("the peer does not speak ckpt's replication protocol")
    mine = secrets.token_bytes(NONCE)
    nonces = greeting[len(GREETING):] + mine
    sock.sendall(mine + proof(key, b"ckpt-replica sender", job.encode(), nonces))
    if not hmac.compare_digest(recv_exact(sock, PROOF, deadline),
                               proof(key, b"ckpt-replica receiver", job.encode(), nonces)):
        raise PermissionError("the peer could not prove it holds the job's key; it was sent "
                              "nothing of the step")
    return nonces


def header_frame(key: bytes, nonces: bytes, header: bytes) -> bytes:
    """Step 4 as bytes: length, header, MAC."""
    if len(header) > HEADER_MAX:
        raise ValueError(f"a {len(header)}-byte header is over {HEADER_MAX} bytes (too many "
                         "files in one step)")
    return _LENGTH.pack(len(header)) + header + proof(key, b"ckpt-replica header", nonces,
                                                      header)


def recv_header(sock: socket.socket, key: bytes, nonces: bytes, deadline: float) -> bytes:
    """Step 4 read and checked (ValueError: too long; PermissionError: its MAC is wrong)."""
    (n,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size, deadline))
    if n > HEADER_MAX:
        raise ValueError(f"a {n}-byte header (at most {HEADER_MAX})")
    header = recv_exact(sock, n, deadline)
    if not hmac.compare_digest(recv_exact(sock, PROOF, deadline),
                               proof(key, b"ckpt-replica header", nonces, header)):
        raise PermissionError("a header not sent on this connection by a holder of the key")
    return header
