"""Guards found by mutation testing (h-mutate4) of the first-wave, safety-critical code: the
manifest's validation, the integrity checks, the storage backends, the collector. Each test
kills one-line mutants that the suite let survive; the mutants are named in its docstring
(``file: what the mutant does``), and applying any of them makes the test fail."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
import uuid
import zlib

import numpy as np
import pytest
import torch
import zstandard

from ckpt import CheckpointManager, SaveOptions
from ckpt._format import manifest as fmt
from ckpt._format.codec import decode_into, encode
from ckpt._format.datafile import Piece
from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt._format.manifest import MANIFEST_NAME, Manifest
from ckpt._step.incremental import collect, step_dirs
from ckpt._step.integrity import check_structure, read_manifest
from ckpt._format.layout import BoxLayout, Mesh, MeshLayout, cells_overlapping, writer, written_by
from ckpt._memory.tier import replica_name
from ckpt._memory.replication import Replicator, ring_targets
from ckpt._shared.sharding import (PieceSpec, assign_writers, balance_plain, boxes_layouts, overlapping,
                           source_rank, sub_slices)
from storage_backends import PosixStorage
from storage_backends import Entry, LockHeldError, fsspec_store, lease
from storage_backends.fsspec_store import READ_BLOCK, FsspecStorage
from storage_backends.locks import FlockWriterLock
from tests.s3_fixture import _moto, s3_restartable  # noqa: F401  (fixtures)

DIGEST = "0123456789abcdef"
CHUNK = {"offsets": [0], "shape": [4], "file": "data-0.bin", "start": 0, "length": 16,
         "digest": DIGEST}


def _v1(chunks: list | None = None, **top: object) -> dict:
    """A valid format-1 manifest of one float32 tensor ``t`` of shape [4]; ``top`` replaces
    top-level fields."""
    return {"format": "ckpt", "format_version": 1, "step": 1, "world_size": 1, "created": 0.0,
            "files": {"data-0.bin": 64},
            "tensors": {"t": {"dtype": "float32", "shape": [4],
                              "chunks": [CHUNK] if chunks is None else chunks}},
            "aliases": {}, "items": {"t": {"kind": "tensor", "tree": {"__tensor__": "t"}}},
            **top}


def _v2(layout: dict | None = None, **top: object) -> dict:
    """A valid format-2 manifest (rank tables, two ranks) of one tensor ``t`` [4, 2]."""
    return {"format": "ckpt", "format_version": 2, "step": 1, "world_size": 2, "created": 0.0,
            "files": {"data-0.bin": 64},
            "tensors": {"t": {"dtype": "float32", "shape": [4, 2],
                              "layout": layout or {"mesh": 0, "placements": ["S0"]}}},
            "meshes": [{"shape": [2], "ranks": [0, 1]}],
            "tables": [["table-0.json", 100, DIGEST], ["table-1.json", 100, DIGEST]],
            "refs": {}, "aliases": {},
            "items": {"t": {"kind": "tensor", "tree": {"__tensor__": "t"}}}, **top}


def _refused(doc: dict, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match="invalid manifest") as info:
        Manifest.from_json(json.dumps(doc).encode(), where="m")
    assert message in str(info.value)


def _deep(levels: int) -> dict:
    doc: dict = {}
    for _ in range(levels - 1):
        doc = {"x": doc}
    return doc


def test_the_valid_manifests_these_tests_damage_parse():
    assert Manifest.from_json(json.dumps(_v1()).encode(), where="m").tensors["t"].shape == (4,)
    two = Manifest.from_json(json.dumps(_v2()).encode(), where="m")
    assert two.tables[1] == ("table-1.json", 100, DIGEST)
    Manifest.from_json(json.dumps(_v1(metadata=_deep(fmt.MAX_DEPTH))).encode(), where="m")


def _whole(**change: object) -> list:
    return [{**CHUNK, **change}]


FORMAT1 = {
    # F02/F03: a document of another format, or of a version this ckpt cannot read
    "other format": (_v1(format="zarr"), "format must be 'ckpt'"),
    "future version": (_v1(format_version=3), "format_version 3 is not supported"),
    # F04/F05: the step and world size are bounded integers
    "negative step": (_v1(step=-1), "step must be an integer"),
    "text step": (_v1(step="1"), "step must be an integer"),
    "no ranks": (_v1(world_size=0), "world_size must be an integer in [1,"),
    # F07/F13/F14/F15: every name in "files" is a plain file name
    "file outside": (_v1(files={"../data-0.bin": 64}), "file '../data-0.bin' is not a plain"),
    "file in a folder": (_v1(files={"a/b": 64}), "file 'a/b' is not a plain"),
    "dot file": (_v1(files={".": 64}), "file '.' is not a plain"),
    "hidden file": (_v1(files={".tmp-x": 64}), "file '.tmp-x' is not a plain"),
    "dotted name": (_v1(files={"a..b": 64}), "file 'a..b' is not a plain"),
    # F08: an alias names a stored tensor
    "dangling alias": (_v1(aliases={"u": "nope"}), "alias 'u' -> 'nope' is dangling"),
    # F11: metadata nesting is bounded (restore decodes it recursively)
    "deep metadata": (_v1(metadata=_deep(fmt.MAX_DEPTH + 1)), "metadata nests deeper"),
    # F12: offsets are not negative
    "negative offset": (_v1(_whole(offsets=[-1])), "offsets must be a list of integers"),
    # F16: a tensor's size is bounded before anything is allocated for it
    "huge tensor": (_v1(tensors={"t": {"dtype": "float32", "shape": [1 << 49], "chunks": []}}),
                    "tensor 't' is absurdly large"),
    # F17: a format-1 tensor's chunks tile it (no overlap, no gap)
    "overlap": (_v1([{**CHUNK, "shape": [2], "length": 8},
                     {**CHUNK, "shape": [2], "length": 8, "start": 8}]), "overlap"),
    # F19: a chunk's box has its tensor's rank
    "box of another rank": (_v1(_whole(offsets=[0, 0], shape=[4, 1])), "has the wrong rank"),
    # F21: the codec is one this ckpt decodes
    "unknown codec": (_v1(_whole(codec="lz4")), "has unknown codec 'lz4'"),
    # F23: a raw chunk holds exactly its box's bytes
    "short raw chunk": (_v1(_whole(length=8)), "has length 8 but its box holds 16 bytes"),
    # F24: a compressed chunk is never much larger than its raw bytes (a reader allocates it)
    "fat zstd chunk": (_v1(_whole(codec="zstd", length=1041), files={"data-0.bin": 4096}),
                       "claims 16 bytes compressed into 1041"),
    # F26: a chunk does not start before its file
    "negative start": (_v1(_whole(start=-1)), "start must be an integer"),
    # F29: a reused chunk lies in an earlier step, not this one
    "self reference": (_v1(_whole(step=1)), "refers to step 1, which is not an earlier step"),
    # F30: digests are 16 hex digits
    "bad digest": (_v1(_whole(digest="XYZ")), "has a malformed digest"),
    # F56: an array item's dtype is one numpy has (a restore makes a numpy array of it)
    "bf16 array": (_v1(tensors={"t": {"dtype": "bfloat16", "shape": [4],
                                      "chunks": [{**CHUNK, "length": 8}]}},
                       items={"t": {"kind": "value", "tree": {"__ndarray__": "t"}}}),
                   "array 't' has dtype bfloat16, which numpy lacks"),
    # F62/F63/F66/F67/F68/F72: items are of a known kind, their trees of its shape
    "pickle text": (_v1(items={"p": {"kind": "value", "tree": {"__pickle__": "no base64!"}}}),
                    "a pickled value must be base64 text"),
    "odd kind": (_v1(items={"t": {"kind": "weird", "tree": {"__tensor__": "t"}}}),
                 "item 't' has kind 'weird'"),
    "tensor item of a dict": (_v1(items={"t": {"kind": "tensor",
                                               "tree": {"a": {"__tensor__": "t"}}}}),
                              "item 't' is a tensor item, but its tree is not a tensor"),
    "module of a list": (_v1(items={"m": {"kind": "module", "tree": [1]}}),
                         "item 'm': a module's state must be an object"),
    "format-1 tables": (_v1(items={"v": {"kind": "value", "per_rank": "tables"}}),
                        "item 'v': per_rank must map rank numbers to trees"),
    "dict as a key": (_v1(items={"v": {"kind": "value",
                                       "tree": {"__dict__": [[{"__dict__": []}, 1]]}}}),
                      "cannot be a key"),
    # F73: nesting of lists counts too
    "deep list metadata": (_v1(metadata={"x": json.loads("[" * 200 + "]" * 200)}),
                           "metadata nests deeper"),
}


@pytest.mark.parametrize("case", FORMAT1)
def test_a_damaged_format1_manifest_is_refused_naming_the_damage(case):
    """Mutants (ckpt/_format/manifest.py): _parse without the format-name check (F02), the version
    check (F03), the step's _int (F04), world_size's lo=1 (F05), file_name() on the keys of
    ``files`` (F07), _FILE_NAME's first character (F14) or its lack of "/" (F15), the ".."
    check (F13), the alias target check (F08), the metadata depth check (F11); _dims without
    ``0 <=`` (F12); _parse_tensor without its size bound (F16) or its call of _check_tiling
    (F17: two chunks over the same bytes parsed as one tensor); _parse_chunk comparing only
    offsets with box (F19), accepting any codec (F21), only refusing a raw chunk that is too
    long (F23), without ``length <= raw_len + 1024`` (F24), without ``0 <=`` on start (F26),
    with ``ref <= step`` (F29), without the digest pattern (F30); check_tree without the
    numpy dtype check of an ``__ndarray__`` (F56), the base64 check of a pickle (F62), the
    kind check (F63), a tensor item's or a module's tree shape (F66, F67), _check_item
    taking per_rank "tables" for format 1 too (F68), _is_hashable_tag taking any tag for
    a key (F72), _depth counting only dicts (F73). Each let a damaged
    manifest through (to fail later, elsewhere, or not at all) or named the wrong thing."""
    doc, message = FORMAT1[case]
    _refused(doc, message)


def test_a_manifest_over_the_size_bound_is_refused_before_it_is_parsed(monkeypatch):
    """Mutant: ckpt/_format/manifest.py Manifest.from_json without ``len(raw) > MAX_MANIFEST_BYTES``
    (F01; the bound is lowered here: a real one is a GiB)."""
    raw = json.dumps(_v1()).encode()
    monkeypatch.setattr(fmt, "MAX_MANIFEST_BYTES", len(raw) - 1)
    with pytest.raises(CorruptCheckpointError, match=f"manifest is {len(raw)} bytes"):
        Manifest.from_json(raw, where="m")


def test_the_tiling_checks_work_is_bounded(monkeypatch):
    """Mutant: ckpt/_format/manifest.py _check_tiling without ``len(boxes) << len(split) <=
    MAX_TILING_CORNERS`` (F32; lowered here: 8 boxes over 3 split dimensions weigh 64
    corners)."""
    monkeypatch.setattr(fmt, "MAX_TILING_CORNERS", 63)
    boxes = [((i, j, k), (1, 1, 1)) for i in (0, 1) for j in (0, 1) for k in (0, 1)]
    with pytest.raises(fmt.Invalid, match="split 3 dimensions into 8 boxes"):
        fmt._check_tiling("t", (2, 2, 2), boxes)
    monkeypatch.setattr(fmt, "MAX_TILING_CORNERS", 64)
    fmt._check_tiling("t", (2, 2, 2), boxes)  # exactly at the bound: checked, and a tiling


def _tree(levels: int) -> dict:
    """An item tree of plain dicts nested ``levels`` deep (a module's state, say)."""
    tree: dict = {"__tensor__": "t"}
    for _ in range(levels - 1):
        tree = {"x": tree}
    return tree


FORMAT2 = {
    # F36/F38: a mesh fits the world and names its ranks
    "mesh too big": (_v2(meshes=[{"shape": [3], "ranks": [0, 1, 2]}]),
                     "mesh 0 has shape [3], which does not fit 2 ranks"),
    "rank past the world": (_v2(meshes=[{"shape": [2], "ranks": [0, 2]}]),
                            "mesh 0: ranks must list 2 distinct ranks below 2"),
    # F47/F48/F49/F50: each rank's table is bounded, has a digest, a name of its own
    "huge table": (_v2(tables=[["table-0.json", 1 << 31, DIGEST], ["table-1.json", 1, DIGEST]]),
                   "size of rank 0's table must be an integer"),
    "table digest": (_v2(tables=[["table-0.json", 1, "nope"], ["table-1.json", 1, DIGEST]]),
                     "table of rank 0 has a malformed digest"),
    "table is data": (_v2(tables=[["data-0.bin", 64, DIGEST], ["table-1.json", 1, DIGEST]]),
                      "table of rank 0 is also listed as a data file"),
    "shared table": (_v2(tables=[["table-0.json", 1, DIGEST], ["table-0.json", 1, DIGEST]]),
                     "two ranks name the same table"),
    # F51/F52: references name earlier steps' plain files (paths are built from them)
    "ref to itself": (_v2(refs={"1": {"data-0.bin": 8}}),
                      "refs names step '1', which is not an earlier step"),
    "ref outside": (_v2(refs={"0": {"../../x": 8}}), "file '../../x' is not a plain file name"),
    # F74: a format-2 tensor's size is bounded too
    "huge tensor": (_v2(tensors={"t": {"dtype": "float32", "shape": [1 << 49],
                                       "layout": {"mesh": 0, "placements": ["R"]}}}),
                    "tensor 't' is absurdly large"),
}


@pytest.mark.parametrize("case", FORMAT2)
def test_a_damaged_format2_manifest_is_refused_naming_the_damage(case):
    """Mutants (ckpt/_format/manifest.py): _parse_meshes without ``math.prod(shape) <= world`` (F36)
    or with ``r <= world`` (F38); _parse_tables without ``hi=MAX_TABLE_BYTES`` (F47), the
    digest pattern (F48), ``name not in files`` (F49) or the distinct-names check (F50);
    _parse_refs with ``int(s) <= step`` (F51) or without file_name() (F52: a reference to
    "step-00000000/../../x" passed on to the storage); _parse_laid_out without its size
    bound (F74)."""
    doc, message = FORMAT2[case]
    _refused(doc, message)


def test_an_item_tree_of_dicts_nested_too_deep_is_refused():
    """Mutant: ckpt/_format/manifest.py check_tree without its depth check on dicts (F55; the one on
    lists is tests/test_hostile.py's): the decoder of a restore recurses through them."""
    ok = _v1(items={"m": {"kind": "module", "tree": _tree(fmt.MAX_DEPTH)}})
    assert "m" in Manifest.from_json(json.dumps(ok).encode(), where="m").items
    _refused(_v1(items={"m": {"kind": "module", "tree": _tree(fmt.MAX_DEPTH + 1)}}),
             "item 'm' nests deeper than 200 levels")


# ------------------------------------------------------------------ ckpt/_step/integrity.py
def _save(root, steps: dict, **kw) -> None:
    """Save ``steps`` (step -> state) in ``root`` (small chunks, one writer thread)."""
    kw.setdefault("options", SaveOptions(chunk_bytes=16 << 10, write_threads=1))
    with CheckpointManager(root, async_save=False, handle_sigterm=False, metrics=False,
                           **kw) as mgr:
        for step, state in steps.items():
            mgr.save(step, state, force=True)


def test_a_manifest_that_names_another_step_than_its_directory_is_corrupt(tmp_path):
    """Mutant: ckpt/_step/integrity.py read_manifest without ``manifest.step != step`` (I01): a
    manifest copied or edited into another step's directory was read as that step."""
    _save(tmp_path, {1: {"t": torch.ones(4)}, 2: {"t": torch.ones(4) * 2}})
    path = tmp_path / "step-00000002" / MANIFEST_NAME
    path.write_bytes(path.read_bytes().replace(b'"step":2', b'"step":5'))
    storage = PosixStorage(str(tmp_path))
    assert read_manifest(storage, "step-00000002").step == 5  # well formed on its own
    with pytest.raises(CorruptCheckpointError, match="manifest says step 5, but lies in "
                                                     "step-00000002"):
        read_manifest(storage, "step-00000002", 2)


def test_the_full_structure_check_compares_every_file_with_its_recorded_size(tmp_path):
    """Mutant: ckpt/_step/integrity.py check_structure passing no expected size for the step's
    own files (I03): a data file that grew (bytes appended after its chunks) passed
    ``ckpt verify``'s structure level, though it is not the file the step wrote."""
    _save(tmp_path, {1: {"t": torch.ones(64)}})
    storage = PosixStorage(str(tmp_path))
    manifest = read_manifest(storage, "step-00000001", 1)
    check_structure(storage, "step-00000001", manifest)
    name, size = next(iter(manifest.files.items()))
    with open(tmp_path / "step-00000001" / name, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(CorruptCheckpointError, match=f"is {size + 8} bytes, the manifest "
                                                     f"recorded {size}"):
        check_structure(storage, "step-00000001", manifest)


def _two_incremental_steps(tmp_path, rank_tables: bool):
    """Steps 1 and 2 of an incremental chain, step 2 reusing step 1's chunks of a frozen
    tensor; returns the storage and step 2's manifest."""
    frozen = torch.randn(64, 64)
    _save(tmp_path, {1: {"frozen": frozen, "t": torch.zeros(4)},
                     2: {"frozen": frozen, "t": torch.ones(4)}},
          incremental=True, full_every=100,
          options=SaveOptions(chunk_bytes=4 << 10, write_threads=1, rank_tables=rank_tables))
    storage = PosixStorage(str(tmp_path))
    return storage, read_manifest(storage, "step-00000002", 2)


def test_the_full_structure_check_of_a_format2_step_sizes_the_files_it_reuses(tmp_path):
    """Mutant: ckpt/_step/integrity.py check_structure without the ``< needed`` check of a
    format-2 step's ``refs`` (I04): an incremental step whose earlier step's file was
    truncated passed ``ckpt verify``'s structure level."""
    storage, manifest = _two_incremental_steps(tmp_path, rank_tables=True)
    assert manifest.format_version == 2 and manifest.refs
    check_structure(storage, "step-00000002", manifest)
    (step, name), needed = next(iter(manifest.refs.items()))
    os.truncate(tmp_path / f"step-{step:08d}" / name, needed - 1)
    with pytest.raises(CorruptCheckpointError, match=f"shorter than the {needed} bytes step 2 "
                                                     "uses; the file is truncated"):
        check_structure(storage, "step-00000002", manifest)


def test_the_full_structure_check_of_a_format1_step_finds_a_reused_chunk_cut_short(tmp_path):
    """Mutant: ckpt/_step/integrity.py check_structure comparing only a chunk's start with its
    file's size (I05): a format-1 incremental step whose earlier step's file was cut inside
    the last chunk it reuses passed ``ckpt verify``'s structure level (that file's size is
    recorded by the earlier step only)."""
    storage, manifest = _two_incremental_steps(tmp_path, rank_tables=False)
    reused = [c for c in manifest.tensors["frozen"].chunks if c.step == 1]
    assert manifest.format_version == 1 and reused
    check_structure(storage, "step-00000002", manifest)
    last = max(reused, key=lambda c: c.start)
    os.truncate(tmp_path / "step-00000001" / last.file, last.start + last.length - 1)
    with pytest.raises(CorruptCheckpointError, match="needs bytes .*; the file is truncated"):
        check_structure(storage, "step-00000002", manifest)


def test_the_full_structure_check_sizes_a_format2_steps_rank_tables(tmp_path):
    """Mutant: ckpt/_step/integrity.py check_structure sizing ``manifest.files`` instead of
    ``own_files()`` (I09): a rank table cut short passed ``ckpt verify``'s structure level."""
    _save(tmp_path, {1: {"t": torch.ones(64)}},
          options=SaveOptions(write_threads=1, rank_tables=True))
    storage = PosixStorage(str(tmp_path))
    manifest = read_manifest(storage, "step-00000001", 1)
    check_structure(storage, "step-00000001", manifest)
    name, size, _ = manifest.tables[0]
    os.truncate(tmp_path / "step-00000001" / name, size - 1)
    with pytest.raises(CorruptCheckpointError, match=f"{name} is {size - 1} bytes, the "
                                                     f"manifest recorded {size}"):
        check_structure(storage, "step-00000001", manifest)


def test_a_structure_level_restore_refuses_a_data_file_of_another_size(tmp_path):
    """Mutant: ckpt/_step/integrity.py _check_files passing no recorded size for the step's own
    files (I07): a data file replaced by a longer one (its chunks' ranges still inside) was
    restored at the structure level, which reads no digest: the size is all it checks."""
    _save(tmp_path, {1: {"t": torch.ones(64)}})
    data = next((tmp_path / "step-00000001").glob("data-*"))
    size = data.stat().st_size
    data.write_bytes(b"\xff" * (size + 8))  # another file: every chunk's bytes are wrong
    live = {"t": torch.zeros(64)}
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match=f"is {size + 8} bytes, the manifest "
                                                         f"recorded {size}"):
            mgr.restore(live, step=1, verify="structure")
    assert not live["t"].any(), "a refused restore wrote"


# ------------------------------------------------------- storage_backends/fsspec_store.py
def test_an_object_stores_reads_follow_its_own_writes_and_deletes():
    """Mutants: storage_backends/fsspec_store.py write() and delete() without
    ``self._cache.forget`` (S14, S15), and _BlockCache.forget dropping only the path itself,
    not what lies under it (S22): a read after a rewrite or a delete by this very instance
    returned the bytes cached before it."""
    storage = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/root")
    out = memoryview(bytearray(16))
    storage.write("step-1/f", [b"a" * 64])
    storage.read_into("step-1/f", 8, out)
    assert bytes(out) == b"a" * 16
    storage.write("step-1/f", [b"b" * 64])
    storage.read_into("step-1/f", 8, out)
    assert bytes(out) == b"b" * 16
    storage.delete("step-1")  # the directory: its files go with it
    with pytest.raises(FileNotFoundError):
        storage.read_into("step-1/f", 8, out)


@pytest.mark.s3
def test_a_large_read_from_a_server_that_is_down_is_an_io_error_not_a_short_object(
        s3_restartable):
    """Mutant: storage_backends/fsspec_store.py _cat_ranges taking any failed range for one
    past the end of the object (dropping ``http_status(...) == 416``; S09): a read of 8 MiB
    or more while the server was unreachable raised EOFError, the "object is truncated" of
    corruption (a restore skips the step as damaged), instead of the I/O error it is."""
    endpoint = s3_restartable
    storage = FsspecStorage(endpoint.root("run"), storage_options=endpoint.storage_options,
                            retries=1)
    size = READ_BLOCK + 4096
    storage.write("blob", [bytes(size)])
    out = memoryview(bytearray(size))
    storage.read_into("blob", 0, out)
    endpoint.stop()
    try:
        with pytest.raises(OSError, match="reading .*/blob failed"):
            storage.read_into("blob", 0, out)
    finally:
        endpoint.start()


def test_an_object_store_sizes_only_objects_and_lists_only_what_lies_under_a_path():
    """Mutants: storage_backends/fsspec_store.py size() without its directory check (S18: a
    prefix was sized 0 bytes, as an empty file) and list() without skipping the listed path
    itself (S17: a listing of an object named the object as its own child)."""
    storage = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/root")
    storage.write("step-1/f", [b"a" * 64])
    assert storage.size("step-1/f") == 64
    with pytest.raises(IsADirectoryError):
        storage.size("step-1")
    assert storage.list("step-1/f") == []
    assert [e.name for e in storage.list("step-1")] == ["f"]


# ------------------------------------------------------------- storage_backends/posix.py
@pytest.mark.parametrize("path", ["../victim.txt", "step-1/../../victim.txt", "./x", "step-1/./x"])
def test_the_posix_storage_refuses_a_path_that_leaves_or_bends_its_root(tmp_path, path):
    """Mutant: storage_backends/posix.py local_path refusing only empty components, not "."
    and ".." (P12): a path through ".." read, sized and deleted a file outside the root."""
    root = tmp_path / "root"
    (tmp_path / "victim.txt").write_bytes(b"precious")
    (root / "step-1").mkdir(parents=True)
    storage = PosixStorage(str(root))
    for call in (storage.read, storage.size, storage.delete, storage.exists):
        with pytest.raises(ValueError, match="is not a plain path inside the root"):
            call(path)
    assert (tmp_path / "victim.txt").read_bytes() == b"precious"


def test_a_file_where_a_save_stages_is_refused_not_written_through(tmp_path):
    """Mutant: storage_backends/posix.py begin() without ``if not S_ISDIR(...): raise``
    (P15): a regular file at the staging name was taken for the directory another rank had
    made, and the save went on to fail on its first data file with an error naming no
    cause. (Every rank of one save calls begin(): an existing directory is fine.)"""
    storage = PosixStorage(str(tmp_path))
    assert storage.begin("step-00000001", "tok") == storage.begin("step-00000001", "tok")
    (tmp_path / ".tmp-step-00000002-tok").write_bytes(b"not a directory")
    with pytest.raises(FileExistsError):
        storage.begin("step-00000002", "tok")


def test_only_directories_under_the_staging_prefixes_are_leftovers(tmp_path):
    """Mutant: storage_backends/posix.py uncommitted() without ``and e.is_dir`` (P18): a
    file whose name starts like a staging directory was listed as a save's leftovers."""
    storage = PosixStorage(str(tmp_path))
    staging = storage.begin("step-00000001", "tok")
    (tmp_path / ".tmp-notes.txt").write_bytes(b"someone's file")
    assert storage.uncommitted() == [staging]


@pytest.mark.s3
def test_a_huge_object_is_uploaded_in_no_more_parts_than_s3_allows(s3_restartable,
                                                                   monkeypatch):
    """Mutant: storage_backends/fsspec_store.py _put uploading in ``block_size`` parts
    whatever the object's size (S23): an object over 9,000 parts (288 GiB at 32 MiB) failed
    at S3's limit of 10,000 parts. The limit is lowered here to 2 parts: 12 MiB in 5 MiB
    blocks must go up in two parts of 6 MiB, not three (S3's ETag of a multipart object
    ends in its number of parts)."""
    monkeypatch.setattr(fsspec_store, "_PART_LIMIT", 2)
    endpoint = s3_restartable
    storage = FsspecStorage(endpoint.root("run"), storage_options=endpoint.storage_options,
                            block_size=5 << 20)
    data = os.urandom(12 << 20)
    storage.write("blob", [data])
    etag = endpoint.client().head_object(Bucket=endpoint.bucket, Key="run/blob")["ETag"]
    assert etag.strip('"').endswith("-2"), etag
    assert storage.read("blob") == data


# ------------------------------------------------------------------ ckpt/_step/incremental.py
def test_gc_deletes_nothing_when_a_kept_steps_references_cannot_be_read(tmp_path):
    """Mutant: ckpt/_step/incremental.py collect() skipping a kept step whose manifest it cannot
    read instead of stopping (N02): its references unknown, the files of the earlier step
    it reuses were deleted with that step."""
    frozen = torch.randn(64, 64)
    _save(tmp_path, {1: {"frozen": frozen, "t": torch.zeros(4)},
                     2: {"frozen": frozen, "t": torch.ones(4)}},
          incremental=True, full_every=100)
    before = sorted(p.name for p in (tmp_path / "step-00000001").iterdir())
    (tmp_path / "step-00000002" / MANIFEST_NAME).write_bytes(b"{not json")
    storage = PosixStorage(str(tmp_path))
    with pytest.raises(CheckpointError, match="gc stopped before deleting anything: cannot "
                                              "read the references of kept step 2"):
        collect(storage, keep={2})
    assert sorted(p.name for p in (tmp_path / "step-00000001").iterdir()) == before


def test_a_file_named_like_a_step_is_no_step_directory(tmp_path):
    """Mutant: ckpt/_step/incremental.py step_dirs without ``entry.is_dir`` (N01): a file named
    step-00000002 in the root was taken for an uncommitted step, and the collector deleted
    it as that step's leftovers."""
    _save(tmp_path, {1: {"t": torch.ones(4)}})
    (tmp_path / "step-00000002").write_bytes(b"a note, not a step")
    storage = PosixStorage(str(tmp_path))
    assert step_dirs(storage) == {1: True}
    collect(storage)
    assert (tmp_path / "step-00000002").read_bytes() == b"a note, not a step"


def test_a_dry_run_of_gc_deletes_nothing(tmp_path):
    """Mutant: ckpt/_step/incremental.py collect() deleting unreferenced files whatever
    ``dry_run`` says (N07): a dry run emptied the steps it only reported, their manifests
    left in place (committed steps without their data)."""
    _save(tmp_path, {1: {"t": torch.ones(4)}, 2: {"t": torch.ones(4) * 2}})
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    report = collect(PosixStorage(str(tmp_path)), keep={2}, dry_run=True)
    assert report.retired_steps == [1] and report.deleted_files
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_gc_leaves_a_directory_inside_a_kept_step_alone(tmp_path):
    """Mutant: ckpt/_step/incremental.py collect() without ``(is_kept and entry.is_dir)`` (N05): a
    directory inside a kept step (none of ckpt's files) was deleted with what it holds."""
    _save(tmp_path, {1: {"t": torch.ones(4)}})
    (tmp_path / "step-00000001" / "notes").mkdir()
    (tmp_path / "step-00000001" / "notes" / "a.txt").write_bytes(b"kept")
    collect(PosixStorage(str(tmp_path)))
    assert (tmp_path / "step-00000001" / "notes" / "a.txt").read_bytes() == b"kept"


def test_an_incremental_chain_ends_in_a_full_save_every_full_every_steps(tmp_path):
    """Mutant: ckpt/_step/incremental.py chain_length() always 0 (N10): the manager never saw a
    chain reach ``full_every``, and every save stayed incremental (each step depending on
    ever older ones) forever."""
    frozen = torch.randn(64, 64)
    _save(tmp_path, {s: {"frozen": frozen, "t": torch.full((4,), float(s))} for s in (1, 2, 3)},
          incremental=True, full_every=2)
    storage = PosixStorage(str(tmp_path))
    reused = {s: any(c.step is not None for e in read_manifest(storage, f"step-{s:08d}", s)
                     .tensors.values() for c in e.chunks) for s in (1, 2, 3)}
    assert reused == {1: False, 2: True, 3: False}


def test_a_step_is_never_committed_over_a_file_of_its_name(tmp_path):
    """Mutant: storage_backends/posix.py _commit_over without its ``S_ISDIR`` check (P19): a
    file at the step's name failed the commit with a NotADirectoryError from moving the first
    data file, not the FileExistsError that names the file to remove."""
    storage = PosixStorage(str(tmp_path))
    (tmp_path / "step-00000001").write_bytes(b"not a step")
    staging = storage.begin("step-00000001", "tok")
    storage.write(f"{staging}/data", [b"x"])
    with pytest.raises(FileExistsError, match="exists and is not a step directory"):
        storage.commit(staging, "step-00000001", b"{}", MANIFEST_NAME)
    assert (tmp_path / "step-00000001").read_bytes() == b"not a step"


def test_deleting_through_a_planted_link_is_ignored_not_an_error(tmp_path):
    """Mutant: storage_backends/posix.py delete() letting SymlinkRefusedError out (P22): a
    path through a link counts as absent, and deleting an absent path is no error."""
    root, victim = tmp_path / "root", tmp_path / "victim"
    (victim / "step-00000001").mkdir(parents=True)
    (victim / "step-00000001" / "f").write_bytes(b"precious")
    root.mkdir()
    os.symlink(victim / "step-00000001", root / "step-00000001")
    storage = PosixStorage(str(root))
    storage.delete("step-00000001/f")
    storage.delete("step-00000001")
    assert (victim / "step-00000001" / "f").read_bytes() == b"precious"
    assert os.path.islink(root / "step-00000001")


def test_abort_of_a_staging_name_that_is_a_planted_link_is_ignored(tmp_path):
    """Mutant: storage_backends/posix.py abort() letting SymlinkRefusedError out (P24): a
    failed save's clean-up raised over a link planted at its staging name (hiding the
    save's own error) instead of leaving it, as every path through a link is left."""
    root, victim = tmp_path / "root", tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_bytes(b"precious")
    root.mkdir()
    os.symlink(victim, root / ".tmp-step-00000001-tok")
    PosixStorage(str(root)).abort(".tmp-step-00000001-tok")
    assert (victim / "f").read_bytes() == b"precious"


def test_gc_stops_at_a_kept_step_whose_manifest_names_another_step(tmp_path):
    """Mutant: ckpt/_step/incremental.py collect() reading a kept step's manifest without the step
    it must name (N13): a manifest copied into another step's directory was trusted for the
    references that decide what gc deletes."""
    _save(tmp_path, {1: {"t": torch.ones(4)}, 2: {"t": torch.ones(4) * 2}})
    path = tmp_path / "step-00000002" / MANIFEST_NAME
    path.write_bytes(path.read_bytes().replace(b'"step":2', b'"step":7'))
    with pytest.raises(CheckpointError, match="cannot read the references of kept step 2"):
        collect(PosixStorage(str(tmp_path)), keep={2})
    assert (tmp_path / "step-00000001" / MANIFEST_NAME).exists()


# ------------------------------------------------------------- storage_backends/lease.py
def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("same_namespace", [True, False], ids=["here", "other-pidns"])
def test_a_live_lease_is_taken_over_early_only_from_a_dead_process_of_this_pid_namespace(
        same_namespace):
    """Mutant: storage_backends/lease.py _dead_here comparing host and boot but not the pid
    namespace (E06): a lease held by a process of another container on this node (its pid
    means nothing here) was taken over before it expired while its writer was alive."""
    here = lease._this_machine()
    if "boot" not in here:
        pytest.skip("no boot id on this machine")
    pidns = here["pidns"] if same_namespace else here["pidns"] + 1
    holder = {**here, "pidns": pidns, "pid": _dead_pid(), "since": time.time(),
              "expires": time.time() + 600}
    storage = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/root")
    storage.write(lease.LEASE_NAME, [json.dumps(holder).encode()])
    if same_namespace:
        storage.lock({"host": "me", "pid": os.getpid(), "since": 0.0}).release()
    else:
        with pytest.raises(LockHeldError):
            storage.lock({"host": "me", "pid": os.getpid(), "since": 0.0})


def test_a_lease_taken_over_while_held_is_lost_and_commits_nothing():
    """Mutant: storage_backends/lease.py _renew_loop ignoring a refused renewal (E07): the
    writer whose lease another writer had taken over went on renewing its expiry in memory
    (never ``lost``, always ``valid()``) and committed over the new holder's root."""
    storage = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/root", lease_ttl=0.3)
    lock = storage.lock({"host": "me", "pid": os.getpid(), "since": 0.0})
    staging = storage.begin("step-00000001", "tok")
    rival = {"host": "rival", "pid": 2, "since": time.time(), "expires": time.time() + 600}
    storage.write(lease.LEASE_NAME, [json.dumps(rival).encode()])  # the rival's takeover
    deadline = time.monotonic() + 30
    while not lock.lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lock.lost and not lock.valid()
    with pytest.raises(OSError, match="lease on the root was lost"):
        storage.commit(staging, "step-00000001", b"{}", MANIFEST_NAME)
    lock.release()  # must not delete the rival's lease
    assert json.loads(storage.read(lease.LEASE_NAME))["host"] == "rival"


# ------------------------------------------------------------------ ckpt/_memory/replication.py
def _send(address: tuple, header: dict, payload: bytes, *, close_early: bool = False) -> bytes:
    """Speak the replication protocol to a receiver at ``address``; its reply (b"OK", or
    b"" when it refused and hung up)."""
    head = json.dumps(header).encode()
    with socket.create_connection(("127.0.0.1", address[1]), timeout=30) as sock:
        try:
            sock.sendall(struct.pack("!Q", len(head)) + head + payload)
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


DOC = json.dumps({"step": 3, "rank": 1}).encode()
GOOD = {"secret": "s3cret", "job": "j", "origin": 1, "step": 3, "files": [["data-0", 4]],
        "doc": len(DOC)}
HOSTILE = {
    "wrong secret": ({**GOOD, "secret": "guess"}, b"abcd" + DOC),  # R02
    "no secret yet": ({**GOOD, "secret": ""}, b"abcd" + DOC),  # R01 (before connect())
    "path in a name": ({**GOOD, "files": [["../../evil", 4]]}, b"abcd" + DOC),  # R04, R14
    "another step": ({**GOOD}, b"abcd" + json.dumps({"step": 4, "rank": 1}).encode()),  # R05
    "negative rank": ({**GOOD, "origin": -1, "doc": len(DOC) + 1},
                      b"abcd" + json.dumps({"step": 3, "rank": -1}).encode()),  # R13
    "over budget": ({**GOOD, "files": [["data-0", 64]]}, bytes(64) + DOC),  # R06
    "dropped": ({**GOOD, "files": [["data-0", 100]]}, bytes(10)),  # R08: the sender dies
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_replica_receiver_stores_nothing_a_peer_may_not_send(tmp_path, case):
    """Mutants (ckpt/_memory/replication.py): _receive accepting any secret while the job's is still
    unset (R01) or any at all (R02), taking file names as sent (R04: "../../evil" was
    written outside the replica segment; R14: only the rank document's name checked),
    storing a rank.json of another step (R05), a negative origin rank (R13), a step over
    ``budget`` (R06), and _store leaving a dropped transfer's staging directory (R08)."""
    counted: list[str] = []
    shm = tmp_path / "shm"
    shm.mkdir()
    rep = Replicator(shm_dir=str(shm), job="j", node="n", keep=2, timeout=10,
                     budget=32 if case == "over budget" else None, count=counted.append)
    try:
        if case != "no secret yet":
            rep.connect([], "s3cret")
            assert _send(rep.address, GOOD, b"abcd" + DOC) == b"OK"  # the control
            assert counted == []
        header, payload = HOSTILE[case]
        reply = _send(rep.address, header, payload, close_early=case == "dropped")
        deadline = time.monotonic() + 30
        while "failed" not in counted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reply == b"" and counted == ["failed"]
        stored = sorted(str(p.relative_to(shm)) for p in shm.rglob("*")
                        if p.is_file() and p.name != "owner" and "owner" not in p.name)
        assert stored == ([] if case == "no secret yet" else
                          [f"{replica_name('j', 'n', 1)}/step-00000003/data-0",
                           f"{replica_name('j', 'n', 1)}/step-00000003/rank.json"])
        assert not list(shm.rglob(".tmp-*")) and not (shm / "evil").exists()
    finally:
        rep.close()


# ------------------------------------------------------------- storage_backends/locks.py
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_refused_lock_names_no_holder_from_an_odd_or_linked_owner_file_and_leaks_nothing(
        tmp_path):
    """Mutants: storage_backends/locks.py _read_owner returning a non-dict record as it is
    (K07), opening the owner file without O_NOFOLLOW (K12: a link planted there made a
    refused writer read, and report, a file outside the root), and __init__ not closing its
    descriptor when the lock is refused (K15: a writer retrying the lock ran out of them)."""
    root = tmp_path / "root"
    root.mkdir()
    held = FlockWriterLock(str(root), {"host": "h", "pid": 1, "since": 0.0})
    try:
        (tmp_path / "outside.json").write_text(json.dumps({"host": "outside"}))
        owner = root / ".lock.owner"
        for planted in ("link", "list"):
            owner.unlink()
            if planted == "link":
                os.symlink(tmp_path / "outside.json", owner)
            else:
                owner.write_text("[1, 2]")
            before = _open_fds()
            with pytest.raises(LockHeldError) as info:
                FlockWriterLock(str(root), {"host": "me", "pid": 2, "since": 0.0})
            assert info.value.holder == {}, planted
            assert _open_fds() == before
    finally:
        held.release()


def test_a_lock_whose_owner_record_cannot_be_written_is_released(tmp_path):
    """Mutants: storage_backends/locks.py __init__ keeping the flock when writing the owner
    record fails (K10: the root stayed locked by a writer that had raised), and
    _write_owner not removing a leftover temporary file first (K05: a leftover of an
    earlier process with this pid made every lock fail with FileExistsError)."""
    root = tmp_path / "root"
    (root / ".lock.owner").mkdir(parents=True)  # os.replace of the record onto it fails
    with pytest.raises(OSError):
        FlockWriterLock(str(root), {"host": "me", "pid": 1, "since": 0.0})
    (root / ".lock.owner").rmdir()
    (root / f".lock.owner.{os.getpid()}").write_text("left by a crash")
    lock = FlockWriterLock(str(root), {"host": "me", "pid": 1, "since": 0.0})
    assert json.loads((root / ".lock.owner").read_text())["host"] == "me"
    lock.release()


def test_lease_and_commit_arguments_are_checked():
    """Mutants: storage_backends/lease.py LeaseLock without the ``ttl <= 0`` check (E20: a
    lease that expires as it is taken), commit() without ``staging != name`` (E23), and
    children() keeping only the last kind seen of a name that is both an object and a
    prefix (E18)."""
    storage = FsspecStorage(f"memory://ckpt-{uuid.uuid4().hex}/root", lease_ttl=0)
    with pytest.raises(ValueError, match="ttl must be positive"):
        storage.lock({"host": "me", "pid": 1, "since": 0.0})
    storage.begin("step-00000001", "tok")
    with pytest.raises(ValueError, match="is not the staging location"):
        storage.commit("step-00000002", "step-00000001", b"{}", MANIFEST_NAME)
    assert lease.children("", ["a/x", "a", "b"]) == [Entry("a", True), Entry("b", False)]


def test_replicas_go_to_other_nodes_and_spread_over_a_smaller_nodes_ranks():
    """Mutants: ckpt/_memory/replication.py ring_targets looping over every node, this one
    included (R10: a rank sent its replica to itself), and sending every rank whose local
    rank a node lacks to that node's first rank (R17)."""
    assert ring_targets(0, ["a", "b"], [0, 0], replicas=3) == [1]
    nodes, local = ["a", "a", "a", "a", "b", "b"], [0, 1, 2, 3, 0, 1]
    assert [ring_targets(r, nodes, local, 1)[0] for r in range(4)] == [4, 5, 4, 5]


# ------------------------------------------------------------ ckpt/_format/codec.py, ckpt/_format/datafile.py
def _unsized_frame(data: bytes) -> bytes:
    """A zstd frame whose header does not record its content size (a streaming writer's)."""
    return zstandard.ZstdCompressor(write_content_size=False).compress(data)


def test_a_chunks_zstd_frame_is_checked_against_the_chunks_size_before_it_is_expanded():
    """Mutants: ckpt/_format/codec.py decode_into without the frame-size check (C02: a frame of
    another size, or of an unrecorded one, was expanded before anything was compared) and
    letting zstd's own error out (C05: damage must be a ValueError, which the reader
    reports as corruption)."""
    out = memoryview(bytearray(16))
    with pytest.raises(ValueError, match="zstd frame says 32 bytes, the chunk holds 16"):
        decode_into("zstd", zstandard.ZstdCompressor().compress(bytes(32)), out, torch.uint8)
    with pytest.raises(ValueError, match="zstd frame says -1 bytes"):  # (size unrecorded)
        decode_into("zstd", _unsized_frame(bytes(16)), out, torch.uint8)
    with pytest.raises(ValueError, match="zstd: "):
        decode_into("zstd", b"not a zstd frame", out, torch.uint8)
    decode_into("zstd", zstandard.ZstdCompressor().compress(b"x" * 16), out, torch.uint8)
    assert bytes(out) == b"x" * 16


def test_complex_chunks_group_the_bytes_of_each_real_and_imaginary_part():
    """Mutant: ckpt/_format/codec.py _grouping_width giving a complex dtype its whole item size
    (C06): it still round-trips, but the stored layout (the format) changes, so chunks
    written before were decoded wrong."""
    values = torch.arange(64, dtype=torch.float32).reshape(32, 2)
    data = memoryview(torch.view_as_complex(values).numpy().tobytes())
    codec, stored = encode(data, torch.complex64)
    assert codec == "zstd-grouped"
    raw = zstandard.ZstdDecompressor().decompress(bytes(stored))
    assert raw == np.frombuffer(data, np.uint8).reshape(-1, 4).T.tobytes()


def test_a_compressed_piece_is_labelled_as_the_bytes_it_holds():
    """Mutant: ckpt/_format/datafile.py header_entry giving a compressed piece its tensor's dtype
    and shape (D03): the safetensors header then described 16 bytes of float32 where 3
    bytes of zstd lie, and safetensors readers misread or refuse the file."""
    piece = Piece("t", memoryview(b"abc"), torch.float32, (4,), stored_raw=False)
    assert piece.header_entry(64) == {"dtype": "U8", "shape": [3], "data_offsets": [64, 67]}
    raw = Piece("t", memoryview(bytes(16)), torch.float32, (4,))
    assert raw.header_entry(0) == {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


# ------------------------------------------------------------ ckpt/_format/layout.py, ckpt/_shared/sharding.py
def test_the_writer_of_a_replicated_box_is_the_replica_its_key_picks_row_major():
    """Mutant: ckpt/_format/layout.py writer() without ``pick //= ...`` (L04): over two Replicate
    mesh dimensions only the diagonal replicas ever wrote (ranks 0 and 3 of a 2 x 2 mesh),
    not the replica numbered crc32(key) % 4 that the format documents."""
    layout = MeshLayout(Mesh((2, 2), (10, 11, 12, 13)), (None, None))
    keys = [f"layer{i}.weight" for i in range(16)]
    assert [writer(k, layout, (0, 0)) for k in keys] == [
        10 + zlib.crc32(k.encode()) % 4 for k in keys]


def test_no_rank_writes_an_empty_box():
    """Mutants: ckpt/_format/layout.py written_by without ``math.prod(s)`` for explicit boxes (L05)
    and without ``not math.prod(box[1])`` for a mesh layout (L07): a rank whose shard is
    empty (3 rows over 4 ranks) was told to write it."""
    mesh = MeshLayout(Mesh((4,), (0, 1, 2, 3)), (0,))
    assert [written_by("t", (3, 2), mesh, r) for r in range(4)] == [
        [((0, 0), (1, 2))], [((1, 0), (1, 2))], [((2, 0), (1, 2))], []]
    boxes = BoxLayout((((0, 0), (3, 2), 0), ((3, 0), (0, 2), 1)))
    assert written_by("t", (3, 2), boxes, 1) == []


def test_boxes_that_only_touch_do_not_overlap():
    """Mutant: ckpt/_format/layout.py cells_overlapping comparing explicit boxes with ``<=`` (L08):
    the neighbour that only touches a wanted box was listed, and its writer's rank table
    read for nothing."""
    layout = BoxLayout((((0,), (2,), 0), ((2,), (2,), 1)))
    assert cells_overlapping("t", (4,), layout, ((2,), (2,))) == [(((2,), (2,)), 1)]
    assert cells_overlapping("t", (4,), layout, ((1,), (2,))) == [(((0,), (2,)), 0),
                                                                   (((2,), (2,)), 1)]


def test_a_replica_receiver_keeps_only_its_newest_generations(tmp_path):
    """Mutant: ckpt/_memory/replication.py _store without ``retire_rank_steps`` (R15): every step a
    peer sent stayed in memory (/dev/shm), however small ``keep``."""
    rep = Replicator(shm_dir=str(tmp_path), job="j", node="n", keep=2, timeout=10)
    try:
        rep.connect([], "s3cret")
        for step in (3, 4, 5):
            doc = json.dumps({"step": step, "rank": 1}).encode()
            assert _send(rep.address, {**GOOD, "step": step, "doc": len(doc)},
                         b"abcd" + doc) == b"OK"
        segment = tmp_path / replica_name("j", "n", 1)
        assert sorted(p.name for p in segment.glob("step-*")) == ["step-00000004",
                                                                  "step-00000005"]
    finally:
        rep.close()


def test_meshes_of_one_shape_with_other_ranks_are_stored_apart():
    """Mutant: ckpt/_format/layout.py Mesh.__eq__ comparing shapes only (L12): the manifest stores
    each distinct mesh once (a dict of meshes), and two meshes whose ranks differ only in
    the middle (the hash looks at the first and last eight) became one: the second
    tensor's boxes were attributed to the first mesh's ranks."""
    ranks = list(range(20))
    swapped = ranks[:9] + [ranks[10], ranks[9]] + ranks[11:]
    a, b = Mesh((20,), tuple(ranks)), Mesh((20,), tuple(swapped))
    assert hash(a) == hash(b) and a != b
    meshes: dict = {}
    docs = [fmt._layout_doc(MeshLayout(m, (0,)), meshes) for m in (a, b)]
    assert [d["mesh"] for d in docs] == [0, 1] and list(meshes) == [a, b]


def test_a_box_is_found_in_every_chunk_it_overlaps_and_new_ranks_wrap_around():
    """Mutants: ckpt/_shared/sharding.py overlapping() starting its search one chunk late
    (``- reach + 2``, H03: the chunk that starts before a wanted box and reaches into it
    was missed, so that part of the box was never read), measuring its reach by the
    shortest chunk instead of the longest (H05: the same, behind a long chunk), and
    source_rank() with
    ``rank <= saved_world`` (H02: the first new rank of a grown world got a saved rank
    that does not exist instead of rank 0's values)."""
    chunks = tuple(fmt.Chunk((o,), (2,), "f", 8 * o, 8, DIGEST) for o in (0, 2, 4))
    entry = fmt.TensorEntry("float32", (6,), chunks)
    assert overlapping(entry, ((1,), (2,))) == [(chunks[0], ((1,), (1,))),
                                                (chunks[1], ((2,), (1,)))]
    uneven = (fmt.Chunk((0,), (4,), "f", 0, 16, DIGEST), fmt.Chunk((4,), (1,), "f", 16, 4, DIGEST),
              fmt.Chunk((5,), (1,), "f", 20, 4, DIGEST))
    assert overlapping(fmt.TensorEntry("float32", (6,), uneven), ((3,), (2,))) == [
        (uneven[0], ((3,), (1,))), (uneven[1], ((4,), (1,)))]
    assert [source_rank(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]


def test_writers_are_spread_over_the_ranks_and_boxes_index_their_slice():
    """Mutants: ckpt/_shared/sharding.py assign_writers giving every box to its first holder (H06)
    and balance_plain never counting what it assigned (H10): all of a DDP model's tensors
    were written by rank 0; boxes_layouts keeping empty boxes (H09); sub_slices ending at
    the box's end in the tensor instead of in the outer box (H14)."""
    specs = [[PieceSpec(k, "float32", (4,), (0,), (4,), 16) for k in ("a", "b")]] * 2
    assert sorted(assign_writers(specs).values()) == [0, 1]
    plain = balance_plain({k: ((4,), 16) for k in ("a", "b", "c")}, world=3)
    assert sorted(layout.boxes[0][2] for layout in plain.values()) == [0, 1, 2]
    empty = [[PieceSpec("t", "float32", (4,), (0,), (4,), 16)],
             [PieceSpec("t", "float32", (4,), (4,), (0,), 0)]]
    assert boxes_layouts(empty)["t"].boxes == (((0,), (4,), 0),)
    assert sub_slices(((2,), (4,)), ((3,), (2,))) == (slice(1, 3),)
