"""Committing a step: the coordinator merges the ranks' reports into the manifest and publishes it.

The commit is one atomic publish of the staging location under the step's name, with the
manifest written last (``Storage.commit``: a rename on a file system, a conditional write on
an object store). Until then a reader sees no step; after it, a whole one.
"""

from __future__ import annotations

import logging
import time

from storage_backends import Storage
from storage_backends.faults import fault_point

from ckpt._format.entries import Chunk, TensorEntry
from ckpt._format.manifest import Manifest, TensorsTemplate
from ckpt._format.names import FORMAT_VERSION_TABLES, MANIFEST_NAME, PER_RANK_IN_TABLES
from ckpt._save.payload import RankTable, StepPayload
from ckpt._step.incremental import CHAIN_KEY, chain_length
from ckpt._step.tables import bind_tables

log = logging.getLogger("ckpt")


def build_manifest(payload: StepPayload, tables: list[RankTable]) -> Manifest:
    """The coordinator's merge of every rank's table into the step's manifest (format 1)."""
    files: dict[str, int] = {}
    for table in tables:
        files.update(table.files)
    return _manifest(payload, _entries(payload.tensors, tables), files)


def _entries(tensors: dict[str, tuple[str, tuple[int, ...]]],
             tables: list[RankTable]) -> dict[str, TensorEntry]:
    """Each tensor of ``tensors`` (``StepPayload.tensors``) with its chunks from ``tables``,
    in the manifest's order (the tensors', each tensor's chunks by offsets)."""
    chunks: dict[str, list[Chunk]] = {k: [] for k in tensors}
    for table in tables:
        for key, chunk in table.chunks:
            chunks[key].append(chunk)
    return {key: TensorEntry(dtype, shape, _in_order(chunks[key]))
            for key, (dtype, shape) in tensors.items()}


def _manifest(payload: StepPayload, tensors: dict[str, TensorEntry],
              files: dict[str, int]) -> Manifest:
    return Manifest(step=payload.step, world_size=payload.world_size, created=time.time(),
                    tensors=tensors, aliases=payload.aliases, items=payload.items, files=files,
                    metadata=_metadata(payload))


def tensors_template(tensors: dict[str, tuple[str, tuple[int, ...]]], table: RankTable
                     ) -> tuple[TensorsTemplate, list[int]]:
    """For a step whose chunks are all in ``table`` (a memory-tier slab's), with ``tensors``
    as ``StepPayload.tensors``: the template of its format-1 ``tensors`` member, ordered as
    :func:`build_manifest` orders it, and for each of its holes in order the index of the
    chunk in ``table.chunks`` (whose file and digest fill it)."""
    entries = _entries(tensors, [table])
    index = {id(chunk): i for i, (_, chunk) in enumerate(table.chunks)}
    order = [index[id(c)] for e in entries.values() for c in e.chunks]
    return TensorsTemplate(entries), order


def _in_order(chunks: list[Chunk]) -> tuple[Chunk, ...]:
    """A tensor's chunks by their offsets (most tensors are one chunk: nothing to sort)."""
    return tuple(chunks) if len(chunks) < 2 else tuple(sorted(chunks, key=lambda c: c.offsets))


def _metadata(payload: StepPayload) -> dict:
    metadata = dict(payload.metadata or {})
    metadata[CHAIN_KEY] = chain_length(payload.previous) + 1 if payload.previous else 0
    return metadata


def build_top_manifest(payload: StepPayload, reports: list[dict]) -> Manifest:
    """The coordinator's format-2 manifest: layouts, tables and files; O(tensors + ranks)."""
    files: dict[str, int] = {}
    refs: dict[tuple[int, str], int] = {}
    for report in reports:
        files.update(report["files"])
        for step, names in report["refs"].items():
            for name, size in names.items():
                refs[(int(step), name)] = max(refs.get((int(step), name), 0), size)
    tensors = {key: TensorEntry(dtype, shape, None, payload.layouts[key])
               for key, (dtype, shape) in payload.tensors.items()}
    # Per-rank values (RNG states) lie in their ranks' tables: the manifest stays small.
    items = {name: {"kind": item["kind"], "per_rank": PER_RANK_IN_TABLES} if "per_rank" in item
             else item for name, item in payload.items.items()}
    return Manifest(step=payload.step, world_size=payload.world_size, created=time.time(),
                    tensors=tensors, aliases=payload.aliases, items=items, files=files,
                    metadata=_metadata(payload), format_version=FORMAT_VERSION_TABLES,
                    tables=[tuple(r["table"]) for r in reports], refs=refs)


def commit_step(storage: Storage, staging: str, payload: StepPayload,
                tables: list[RankTable] | None = None,
                reports: list[dict] | None = None) -> Manifest:
    """Coordinator: write the manifest and publish the step (the commit point). Format 1
    merges the ranks' ``tables``; format 2 lists the ranks' ``reports``."""
    if reports is not None:
        manifest = build_top_manifest(payload, reports)
    else:
        manifest = build_manifest(payload, tables or [])
    _publish(storage, staging, payload, manifest.to_json())
    # The step's rank tables now lie in its directory: later incremental saves read them.
    return bind_tables(manifest, lambda name: storage.read(f"{payload.name}/{name}"),
                       f"{storage.url}/{payload.name}")


def commit_rendered(storage: Storage, staging: str, payload: StepPayload,
                    files: dict[str, int], tensors_text: str) -> None:
    """:func:`commit_step` for a single process's format-1 step whose ``tensors`` member is
    written already (:func:`tensors_template`, filled in by the memory tier)."""
    document = _manifest(payload, {}, files).to_json(tensors_text=tensors_text)
    _publish(storage, staging, payload, document)


def _publish(storage: Storage, staging: str, payload: StepPayload, document: bytes) -> None:
    fault_point("before_commit")
    # The commit point. Only now, once every rank's files are durable (each write returned,
    # every rank voted ok), does the step become visible: a crash on either side of this
    # call leaves the earlier steps and either no step or a whole one, never a torn one.
    storage.commit(staging, payload.name, document, MANIFEST_NAME)
    fault_point("after_commit")


def abort(storage: Storage, staging: str) -> None:
    """Remove a failed save's staging location, without masking the error that failed it."""
    try:
        storage.abort(staging)
    except Exception:  # the original error matters more; leftovers are cleaned later
        log.warning("could not remove staging location %s", staging, exc_info=True)
