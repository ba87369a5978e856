"""The storage a rank restores one agreed in-memory save from: the merged manifest, chunk
bytes from this node's segments or from the peers that hold them, and the serving of the
bytes its peers read from this rank, until both sides are done."""

from __future__ import annotations

from typing import Any, Iterator

from ckpt._format.manifest import Manifest
from ckpt._format.names import MANIFEST_NAME
from ckpt._memory.peer_client import PeerClient
from ckpt._memory.peer_server import PeerServer
from ckpt._memory.shm_reader import ShmReader


class MemorySource(ShmReader):
    """The storage of one agreed save (built by ``ckpt/_memory/plan.py``'s
    ``open_candidate``).

    Args:
        url: names the save (``memory:<step>``).
        location: the step's directory; ``<location>/manifest.json`` reads ``raw``.
        manifest: ``raw`` parsed and validated.
        raw: the merged manifest's bytes.
        local: path -> the file on this node that holds it.
        sizes: path -> the size its rank step recorded (every file of the save).
        tier: "memory" when every byte this rank needs lies in its node's own segments,
            "peer" when any comes from a replica or another node.
        peers: reads the paths that are not ``local`` from the peers that hold them.
        server: serves the peers reading from this rank (None: none does).
        cooperation: the loader's exchange of the chunks this rank's node-mates fetch for
            it and it for them (``ckpt/_memory/sharing.py``; None: nothing is shared).

    ``close`` ends both sides of the peer protocol (see ``ckpt/_memory/peer_server.py``),
    then releases the descriptors.
    """

    def __init__(self, url: str, location: str, manifest: Manifest, raw: bytes, *,
                 local: dict[str, str], sizes: dict[str, int], tier: str, peers: PeerClient,
                 server: PeerServer | None = None, cooperation: Any = None) -> None:
        super().__init__(url, lambda path: self.local.get(path))
        self.location = location
        self.parsed_manifest = manifest
        self.local = local
        self.sizes = sizes
        self.tier = tier
        self._manifest = raw
        self._peers = peers
        self._server = server
        self.cooperation = cooperation
        if peers.holders:  # the loader's block: a round's piece (fewer waits for a peer)
            self.stream_block = peers.piece
            # A peer's bytes come over one connection per holder, as the holder sends them:
            # not a copy out of this node's memory that more reading threads would speed.
            self.reads_from_memory = False

    @property
    def server(self) -> PeerServer | None:
        """What serves the peers reading from this rank (None: none does, or closed)."""
        return self._server

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        if path == f"{self.location}/{MANIFEST_NAME}":
            return self._manifest[start:None if length is None else start + length]
        if path in self.local:
            return super().read(path, start, length)
        if length is None:  # to the end of the planned range that starts there
            length = self._peers.planned_length(path, start)
        buf = bytearray(length)
        self.read_into(path, start, memoryview(buf))
        return bytes(buf)

    def read_into(self, path: str, start: int, out: memoryview) -> None:
        if path in self.local:
            return super().read_into(path, start, out)
        self._peers.read_into(path, start, out)

    def read_blocks(self, path: str, start: int, length: int,
                    buffer: memoryview) -> Iterator[memoryview]:
        if path in self.local:
            yield from super().read_blocks(path, start, length, buffer)
            return
        yield from self._peers.read_blocks(path, start, length)

    def size(self, path: str) -> int:
        if path in self.local:
            return super().size(path)
        return self.sizes[path]

    def exists(self, path: str) -> bool:
        return path in self.local or path in self.sizes

    def close(self) -> None:
        """Tell the holders this rank read from that it is done (after receiving what it did
        not read), wait until the peers it serves are done too, then release the
        descriptors; raises the first error either side met (a peer died)."""
        errors = self._peers.close()
        server, self._server = self._server, None
        if server is not None:
            errors += server.close()
        super().close()
        if errors:
            raise errors[0]

    def __del__(self) -> None:
        ShmReader.close(self)  # descriptors only: the peers' protocol is close()'s
