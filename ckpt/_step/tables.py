"""The rank tables of one format-2 step on storage: read on demand, in parallel, and cached.

``ckpt._format.ranktable`` parses and validates a table from its bytes; this module fetches
them (checking each against the size and digest the manifest recorded) and attaches them to
the manifest (:func:`bind_tables`), which then reads chunks and per-rank trees through them.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

from storage_backends import NotAFileError

from ckpt.errors import CorruptCheckpointError
from ckpt._format.bounds import Invalid
from ckpt._format.digest import digest as content_digest
from ckpt._format.entries import Chunk
from ckpt._format.layout import Box, cells_overlapping
from ckpt._format.manifest import Manifest
from ckpt._format.names import FORMAT_VERSION_TABLES
from ckpt._format.ranktable import BadTable, Table, TensorIndex, parse_tables
from ckpt._format.tree import check_item_tree


def bind_tables(manifest: Manifest, read: Callable[[str], bytes], where: str) -> Manifest:
    """Let a format-2 manifest read its rank tables: ``read(name)`` returns the bytes of a
    file of the step's directory; ``where`` names it in messages. Returns ``manifest``
    (format 1 unchanged)."""
    if manifest.format_version == FORMAT_VERSION_TABLES:
        manifest.attach(Tables(manifest, read, where))
    return manifest


class Tables:
    """The rank tables of one format-2 step, read on demand and cached (thread-safe).

    ``read(name)`` returns a table file's bytes (relative to the step's location). A reader
    asks for all the tables its plan needs at once (``prefetch``): they are read in
    parallel (object stores answer each request in tens of milliseconds) and validated in
    batches, a fixed number of numpy operations per batch plus work linear in the rows.
    """

    BATCH_BYTES = 4 << 20  # tables validated together: bounds a batch's temporary arrays
    READERS = 16  # concurrent table reads

    def __init__(self, manifest: Manifest, read: Callable[[str], bytes], where: str) -> None:
        self.manifest = manifest
        self.read = read
        self.where = where
        self._tables: dict[int, Table] = {}
        self._lock = threading.Lock()
        self._all: dict[str, tuple[Chunk, ...]] | None = None
        self._index: TensorIndex | None = None
        self._checked_values: set[tuple[int, str]] = set()

    def table(self, rank: int) -> Table:
        table = self._tables.get(rank)  # a dict read is atomic; filled under the lock
        if table is None:
            self.load([rank])
            table = self._tables[rank]
        return table

    def load(self, ranks: Iterable[int]) -> None:
        """Read, check against the manifest's sizes and digests, and validate the tables
        of ``ranks`` not read yet."""
        missing = sorted(set(ranks) - self._tables.keys())
        batch: list[int] = []
        size = 0
        for rank in missing:
            batch.append(rank)
            size += self.manifest.tables[rank][1]
            if size >= self.BATCH_BYTES:
                self._load_batch(batch)
                batch, size = [], 0
        if batch:
            self._load_batch(batch)

    def _load_batch(self, ranks: list[int]) -> None:
        if len(ranks) == 1:
            raws = {ranks[0]: self._fetch(ranks[0])}
        else:
            with cf.ThreadPoolExecutor(min(self.READERS, len(ranks))) as pool:
                raws = dict(zip(ranks, pool.map(self._fetch, ranks)))
        if self._index is None:
            self._index = TensorIndex(self.manifest)
        try:
            tables = parse_tables(raws, self.manifest, self._index)
        except BadTable as e:
            where = f"{self.where}/{self.manifest.tables[e.rank][0]}"
            raise CorruptCheckpointError(f"{where}: invalid chunk table (rank {e.rank}): {e}; "
                                         "the step cannot be loaded", path=where) from None
        with self._lock:
            self._tables.update(tables)

    def _fetch(self, rank: int) -> bytes:
        name, size, want = self.manifest.tables[rank]
        where = f"{self.where}/{name}"
        try:
            raw = self.read(name)
        except (FileNotFoundError, NotAFileError):
            raise CorruptCheckpointError(f"{where} (rank {rank}'s chunk table) is missing "
                                         "or not a file; "
                                         "the step cannot be loaded", path=where) from None
        if len(raw) != size or content_digest(raw) != want:
            raise CorruptCheckpointError(
                f"{where}: rank {rank}'s chunk table is {len(raw)} bytes with digest "
                f"{content_digest(raw)}, the manifest recorded {size} bytes and {want}: it was "
                "changed or damaged; the step cannot be loaded", path=where)
        return raw

    def value(self, rank: int, name: str) -> Any:
        """Saved rank ``rank``'s tree of per-rank item ``name``, checked on first use."""
        table = self.table(rank)
        tree = table.values[name]
        if (rank, name) not in self._checked_values:
            where = f"{self.where}/{self.manifest.tables[rank][0]}"
            try:
                check_item_tree(f"rank {rank}'s value of item {name!r}",
                                self.manifest.items[name]["kind"], tree,
                                self.manifest.tensors, self.manifest.aliases)
            except Invalid as e:
                raise CorruptCheckpointError(f"{where}: invalid chunk table (rank {rank}): "
                                             f"{e}; the step cannot be loaded",
                                             path=where) from None
            self._checked_values.add((rank, name))
        return tree

    def values_of(self, name: str) -> PerRankValues:
        """Per-rank item ``name``'s trees by saved rank, each read from its rank's table."""
        return PerRankValues(self, name)

    def prefetch(self, wanted: Iterable[tuple[str, Box]]) -> None:
        """Load at once the tables of every rank whose saved boxes overlap one of
        ``wanted`` ((key, box) pairs): what a reader's plan will look up."""
        ranks = set()
        for key, box in wanted:
            entry = self.manifest.tensors[key]
            ranks.update(w for _, w in cells_overlapping(key, entry.shape, entry.layout, box))
        self.load(ranks)

    def overlapping(self, key: str, box: Box) -> list[tuple[Chunk, Box]]:
        """The chunks of ``key`` overlapping ``box``, each with the overlap, from the tables
        of the ranks whose saved boxes overlap it (found from the layout)."""
        entry = self.manifest.tensors[key]
        out = []
        for cell, rank in cells_overlapping(key, entry.shape, entry.layout, box):
            table = self.table(rank)
            if key not in table.span:
                raise CorruptCheckpointError(
                    f"{self.where}: rank {rank}'s chunk table lacks {key!r}, which the "
                    "layout says it wrote; the step cannot be loaded", path=self.where)
            out += table.overlapping(key, box)
        return out

    def all_chunks(self, key: str) -> tuple[Chunk, ...]:
        """Every chunk of ``key`` (reads every table once, then cached): what tools that
        look at a whole step use (verify, inspect, diff, export)."""
        if self._all is None:
            self._collect()
        return self._all[key]

    def problems(self) -> list[CorruptCheckpointError]:
        """Every damaged table of the step, one error each (after a batch fails, the tables
        it did not validate are read one by one to find them all), else whether together
        they cover every tensor: what ``ckpt verify`` lists."""
        everyone = range(len(self.manifest.tables))
        try:
            self.load(everyone)
        except CorruptCheckpointError:
            out = []
            for rank in everyone:
                try:
                    self.load([rank])
                except CorruptCheckpointError as e:
                    out.append(e)
            return out
        out = []
        for rank in everyone:
            for name in self.manifest.in_tables():
                try:
                    self.value(rank, name)
                except CorruptCheckpointError as e:
                    out.append(e)
                    break
        if not out:
            try:
                self._collect()
            except CorruptCheckpointError as e:
                out.append(e)
        return out

    def _collect(self) -> None:
        if self._all is None:
            self.load(range(len(self.manifest.tables)))
            per: dict[str, list[Chunk]] = {k: [] for k in self.manifest.tensors}
            for rank in range(len(self.manifest.tables)):
                table = self.table(rank)
                for k in table.span:
                    per[k].extend(table.chunks(k))
            self._check_complete(per)
            self._all = {k: tuple(sorted(v, key=lambda c: c.offsets)) for k, v in per.items()}

    def _check_complete(self, per: dict[str, list[Chunk]]) -> None:
        for key, chunks in per.items():
            entry = self.manifest.tensors[key]
            covered = sum(c.numel for c in chunks)
            if covered != math.prod(entry.shape):
                raise CorruptCheckpointError(
                    f"{self.where}: the rank tables cover {covered} of the "
                    f"{math.prod(entry.shape)} elements of {key!r}; the step cannot be loaded",
                    path=self.where)


class PerRankValues(Mapping):
    """A format-2 per-rank item's trees, ``{"<rank>": tree}`` as format 1 stores them inline,
    but each read from that rank's table when asked for: a rank loading its values reads one
    table, not every rank's values."""

    in_tables = True  # what Manifest.in_tables looks for

    def __init__(self, tables: Tables, name: str) -> None:
        self.tables, self.name = tables, name

    def __getitem__(self, rank: str) -> Any:
        if not (isinstance(rank, str) and rank.isdigit()
                and int(rank) < len(self.tables.manifest.tables)):
            raise KeyError(rank)
        return self.tables.value(int(rank), self.name)

    def __iter__(self) -> Iterator[str]:
        return (str(r) for r in range(len(self.tables.manifest.tables)))

    def __len__(self) -> int:
        return len(self.tables.manifest.tables)
