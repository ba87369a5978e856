"""Format 2 at scale: the simulator (benchmarks/scale_sim.py) runs the real save path (at 4
ranks its step equals a real gloo save's, apart from tokens, digests and times), layouts give
DTensor's own boxes, read plans read only the rank tables they need and find exactly the
overlapping chunks, and damaged rank tables are refused."""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
import sys

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from tests.support.ranks import run_ranks
from tests.support import scale_workers as W
import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt._format.manifest import Manifest
from ckpt._format.digest import digest
from ckpt._format.layout import Mesh, MeshLayout, mesh_box
from ckpt.options import SaveOptions
from ckpt._format.ranktable import MAGIC
from ckpt._format.sealed import sealed_json
from ckpt._shared.sharding import intersect, overlapping
from ckpt._shared.state import item_tree
from ckpt._step.tables import bind_tables

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks"))
import scale_sim as sim  # noqa: E402

OPTIONS = {"chunk_bytes": 4096, "write_threads": 2}

SPECS = [
    sim.TensorSpec("rows", "float32", (300, 16), (Shard(0),)),        # 2 chunks per rank
    sim.TensorSpec("cols", "bfloat16", (12, 10), (Shard(1),)),        # uneven columns
    sim.TensorSpec("rep", "float32", (5,), (Replicate(),)),           # written once
    sim.TensorSpec("sparse", "float32", (3, 8), (Shard(0),)),         # an empty shard
    sim.TensorSpec("grid", "float32", (8, 6), (Shard(0), Shard(1)), mesh=(2, 2)),
    sim.TensorSpec("hsdp", "bfloat16", (90, 40), (Replicate(), Shard(0)), mesh=(2, 2)),
]

_TOKEN = re.compile(r"^((?:data|table)-[0-9a-f]{2})-[0-9a-z]+-")


def _name(n: str) -> str:
    return _TOKEN.sub(r"\1-T-", n)


def _bound(manifest: Manifest, files: dict[str, bytes], reads: list | None = None) -> Manifest:
    manifest = Manifest.from_json(manifest.to_json(), where="simulated")

    def read(name: str) -> bytes:
        if reads is not None:
            reads.append(name)
        return files[name]
    return bind_tables(manifest, read, "simulated")


def _normalized(doc: dict, chunks: dict) -> dict:
    """What the planning path decides: layouts, meshes, files, table sizes and every chunk
    (box, file, byte range); tokens in names, digests and times left out."""
    return {
        "tensors": doc["tensors"], "meshes": doc["meshes"], "world_size": doc["world_size"],
        "files": {_name(k): v for k, v in doc["files"].items()},
        "tables": [[_name(t[0]), t[1]] for t in doc["tables"]],
        "chunks": {k: [(c.offsets, c.shape, _name(c.file), c.start, c.length, c.codec)
                       for c in v] for k, v in chunks.items()},
    }


@pytest.mark.multiproc
@pytest.mark.slow
def test_simulated_step_equals_a_real_four_rank_save(tmp_path):
    root = str(tmp_path / "root")
    run_ranks(4, W.save_specs, root, SPECS, OPTIONS, timeout=600)
    real = ckpt.inspect.open(root).manifest(1)
    with open(os.path.join(root, "step-00000001", "manifest.json"), "rb") as f:
        real_doc = json.loads(f.read())
    assert real_doc["format_version"] == 2  # several ranks write rank tables
    manifest, files = sim.step_of((4,), SPECS, SaveOptions(**OPTIONS))
    simulated = _bound(manifest, files)
    assert _normalized(json.loads(simulated.to_json()),
                       {k: e.chunks for k, e in simulated.tensors.items()}) == _normalized(
        real_doc, {k: e.chunks for k, e in real.tensors.items()})
    # The layout is not trivial: several chunks per tensor, the replica written once, the
    # real chunks' digests are those of the data.
    assert len(real.tensors["rows"].chunks) == 8
    assert len(real.tensors["rep"].chunks) == 1
    assert ckpt.inspect.open(root).read_tensor(1, "rows").equal(
        torch.arange(300 * 16.0).reshape(300, 16))


def test_layout_boxes_are_dtensors_own():
    """``ckpt._format.layout.mesh_box`` (no torch.distributed) gives DTensor's boxes, uneven and
    nested splits included (empty shards: same size, offsets irrelevant)."""
    for shape, mesh, placements in [((10, 7), (3,), (0,)), ((10, 7), (2, 3), (0, 1)),
                                    ((13, 5), (2, 4), (0, 0)), ((5, 3), (4, 2), (None, 0)),
                                    ((3, 9), (2, 2, 2), (1, None, 0)), ((2,), (4,), (0,))]:
        layout = MeshLayout(Mesh(mesh, tuple(range(len(list(itertools.product(
            *map(range, mesh))))))), placements)
        torch_placements = [Replicate() if d is None else Shard(d) for d in placements]
        for coord in itertools.product(*map(range, mesh)):
            size, offsets = _compute_local_shape_and_global_offset(shape, mesh, list(coord),
                                                                   torch_placements)
            ours = mesh_box(shape, layout, coord)
            assert ours[1] == tuple(size)
            if all(size):
                assert ours[0] == tuple(offsets), (shape, mesh, placements, coord)


def _scan(entry, box):
    """The reference: every chunk checked."""
    return [(c, o) for c in entry.chunks if c.numel
            for o in [intersect((c.offsets, c.shape), box)] if o is not None]


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "tp_fsdp"])
def test_read_plan_reads_only_the_tables_it_needs_and_finds_every_overlap(layout):
    mesh, tensors = sim.model_state(layout, 16, optimizer=False, layers=1)
    manifest, files = sim.step_of(mesh, tensors, SaveOptions(chunk_bytes=1 << 20,
                                                             write_threads=1))
    reads: list[str] = []
    plan = _bound(manifest, files, reads)
    reference = _bound(manifest, files)  # reads every table (what verify does)
    for world in (8, 24):  # fewer and more ranks, and a mesh cut differently
        new_mesh, new = sim.model_state(layout, world, optimizer=False, layers=1)
        for rank in (0, world // 2, world - 1):
            for t, box in zip(new, sim.rank_boxes(new_mesh, new, rank)):
                got = sorted((c.offsets, o) for c, o in overlapping(plan.tensors[t.key], box))
                want = sorted((c.offsets, o) for c, o in _scan(reference.tensors[t.key], box))
                assert got == want, t.key
    if layout == "fsdp":  # 16 -> 8, 24 ranks: rank r reads only its neighbours' tables
        assert len(set(reads)) < len(files)
    # Every box was written exactly once: the tables together tile every tensor.
    assert all(sum(c.numel for c in e.chunks) == e.nbytes // e.torch_dtype.itemsize
               for e in reference.tensors.values())


def test_replicas_spread_their_writes_over_the_replica_group():
    mesh, tensors = sim.model_state("hsdp", 64, optimizer=False, layers=2)
    manifest, files = sim.step_of(mesh, tensors, SaveOptions(write_threads=1))
    written = [sum(manifest.files.get(f, 0) for f in manifest.files
                   if f"-r{r:05d}-" in f) for r in range(64)]
    assert sum(1 for w in written if w) > 8  # not just the first replica's 8 ranks


def _damaged(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1:]


def test_a_damaged_rank_table_is_refused_by_its_digest():
    manifest, files = sim.step_of((4,), SPECS, SaveOptions(**OPTIONS))
    name = manifest.tables[1][0]
    files = {**files, name: _damaged(files[name], len(files[name]) - 3)}
    m = _bound(manifest, files)
    with pytest.raises(CorruptCheckpointError, match="rank 1's chunk table .* digest"):
        m.tensors["rows"].chunks


def _rewrite(manifest: Manifest, files: dict, rank: int, edit) -> Manifest:
    """Change rank ``rank``'s table records with ``edit`` and record the new digest, as a
    writer with a bug (or an attacker who also edits the manifest) would."""
    name = manifest.tables[rank][0]
    raw = files[name]
    (hlen,) = struct.unpack("<Q", raw[8:16])
    head = json.loads(raw[16:16 + hlen])
    import numpy as np
    from ckpt._format.ranktable import record_dtype
    rec = np.frombuffer(raw, dtype=record_dtype(head["dims"]), offset=16 + hlen).copy()
    edit(rec)
    new = raw[:16 + hlen] + rec.tobytes()
    files[name] = new
    manifest.tables[rank] = (name, len(new), digest(new))
    return manifest


@pytest.mark.parametrize("edit,why", [
    (lambda r: r["offsets"].__setitem__((0, 0), r["offsets"][0, 0] + 1), "tile|outside"),
    (lambda r: r["length"].__setitem__(0, r["length"][0] + 4), "length|past the end"),
    (lambda r: r["file"].__setitem__(0, 99), "out of range"),
    (lambda r: r["ref"].__setitem__(0, 5), "earlier"),
    (lambda r: r["tensor"].__setitem__(0, 77), "tensor index"),
])
def test_a_rank_table_that_passes_its_digest_is_still_validated(edit, why):
    manifest, files = sim.step_of((4,), SPECS, SaveOptions(**OPTIONS))
    files = dict(files)
    manifest = _rewrite(manifest, files, 0, edit)
    m = _bound(manifest, files)
    with pytest.raises(CorruptCheckpointError, match=why):
        [e.chunks for e in m.tensors.values()]


def test_a_manifest_with_a_hostile_layout_is_refused():
    manifest, files = sim.step_of((4,), SPECS, SaveOptions(**OPTIONS))
    doc = json.loads(manifest.to_json())
    for damage, why in [
        (lambda d: d["tensors"]["rows"]["layout"].update(placements=["S5"]), "placement"),
        (lambda d: d["meshes"][0].update(ranks=[0, 0, 1, 2]), "distinct"),
        (lambda d: d["tensors"]["rep"]["layout"].update(boxes=[[[0], [3], 0]]), "cover"),
        (lambda d: d["tables"].pop(), "one table per rank"),
        (lambda d: d["tables"][0].__setitem__(0, "../x"), "plain file name"),
    ]:
        bad = json.loads(json.dumps(doc))
        damage(bad)
        with pytest.raises(CorruptCheckpointError, match=why):
            Manifest.from_json(sealed_json(bad), where="hostile")


def test_a_single_process_save_with_rank_tables_round_trips_and_refuses_a_flipped_bit(tmp_path):
    state = {"w": torch.arange(5000.0).reshape(100, 50), "b": torch.ones(3)}
    opts = ckpt.SaveOptions(chunk_bytes=4096, rank_tables=True)
    with ckpt.CheckpointManager(str(tmp_path), async_save=False, options=opts) as mgr:
        mgr.save(1, state, force=True)
    step = tmp_path / "step-00000001"
    table = next(p for p in step.iterdir() if p.name.startswith("table-"))
    assert table.read_bytes()[:8] == MAGIC
    out = {"w": torch.zeros(100, 50), "b": torch.zeros(3)}
    with ckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.restore(out) == 1
    assert out["w"].equal(state["w"]) and out["b"].equal(state["b"])
    raw = bytearray(table.read_bytes())
    raw[-5] ^= 0x10
    table.write_bytes(bytes(raw))
    with ckpt.CheckpointManager(str(tmp_path)) as mgr, pytest.raises(CorruptCheckpointError,
                                                                     match="chunk table"):
        mgr.restore(out, step=1)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_verify_lists_a_damaged_rank_table_as_a_damaged_file(tmp_path, capsys, damage):
    from verify.cli import main as cli_main

    opts = ckpt.SaveOptions(chunk_bytes=4096, rank_tables=True)
    with ckpt.CheckpointManager(str(tmp_path), async_save=False, options=opts) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.arange(5000.0).reshape(100, 50) * step}, force=True)
    table = next((tmp_path / "step-00000002").glob("table-*"))
    raw = table.read_bytes()
    table.write_bytes(_damaged(raw, len(raw) - 5) if damage == "flip" else raw[:-8])
    code = cli_main(["verify", str(tmp_path), "--all"])
    out = capsys.readouterr().out
    assert code == 1  # docs/cli.md: a check failed, the checkpoint is damaged
    assert "step 1: OK" in out
    assert "step 2: FAILED" in out and f"- structure: {table}" in out


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_rank_restoring_its_shard_touches_only_the_files_it_reads(tmp_path):
    """No rank sizes (a HEAD on S3) or reads another rank's data files or table: the
    structure check of a restore covers the files of the rank's own plan. Each rank gets
    its own RNG state back."""
    specs = [SPECS[0], SPECS[1]]  # Shard(0), Shard(1): each rank reads only its own boxes
    root = str(tmp_path / "root")
    touched = run_ranks(2, W.save_then_restore_counting, root, specs, OPTIONS, timeout=600)
    names = os.listdir(os.path.join(root, "step-00000001"))
    with open(os.path.join(root, "step-00000001", "manifest.json"), "rb") as f:
        doc = json.loads(f.read())
    # Each rank's RNG state is a tensor of its own name: the DTensors keep their mesh
    # layouts (an RNGState does not make the save gather every rank's boxes).
    assert {doc["tensors"][s.key]["layout"].get("mesh") for s in specs} == {0}
    assert doc["tensors"]["rng@1/torch"]["layout"]["boxes"][0][2] == 1
    for rank, files in enumerate(touched):
        own = {n for n in names if f"-r{rank:05d}" in n}
        assert any(n.startswith("data-") for n in own)
        assert set(files) - {"manifest.json"} == own, (rank, files)


def test_a_missing_file_a_restore_needs_is_refused_before_anything_changes(tmp_path):
    """A file holding only tensors the state does not ask for is not looked at; one it
    needs is reported (by name) before any live tensor is written."""
    saved = {"a": torch.arange(4096.0), "b": torch.arange(4096.0) + 1}
    opts = ckpt.SaveOptions(rank_tables=True, write_threads=2)
    with ckpt.CheckpointManager(str(tmp_path), async_save=False, options=opts) as mgr:
        mgr.save(1, saved, force=True)
    m = ckpt.inspect.open(str(tmp_path)).manifest(1)
    file_of = {k: {c.file for c in e.chunks} for k, e in m.tensors.items()}
    assert len(file_of["a"] | file_of["b"]) == 2 and not file_of["a"] & file_of["b"]
    os.remove(tmp_path / "step-00000001" / file_of["b"].pop())
    only_a = {"a": torch.zeros(4096)}
    with ckpt.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.restore(only_a, step=1) == 1
    assert only_a["a"].equal(saved["a"])
    both = {"a": torch.full((4096,), 7.0), "b": torch.full((4096,), 7.0)}
    with ckpt.CheckpointManager(str(tmp_path)) as mgr, pytest.raises(
            CorruptCheckpointError, match="is missing"):
        mgr.restore(both, step=1)
    assert all(t.eq(7.0).all() for t in both.values())


def test_per_rank_values_live_in_their_ranks_tables_and_old_manifests_still_load():
    """A format-2 manifest holds no per-rank trees (an RNGState is ~7.6 KB of JSON per
    rank); a rank reading its values reads its source rank's table only. A format-2
    manifest with the trees inline (as written before) still loads them."""
    rng = sim.rng_state(4)
    manifest, files = sim.step_of((4,), SPECS, SaveOptions(**OPTIONS), rng=rng)
    doc = json.loads(manifest.to_json())
    assert doc["items"]["rng"] == {"kind": "stateful", "per_rank": "tables"}
    reads: list[str] = []
    m = _bound(manifest, files, reads)
    assert item_tree(m.items["rng"], 2) == rng[0]["rng"]["per_rank"]["2"]
    assert reads == [manifest.tables[2][0]]
    assert dict(m.items["rng"]["per_rank"]) == rng[0]["rng"]["per_rank"]  # what tools list
    # A table whose values were removed (its digest re-recorded) is refused.
    name = manifest.tables[1][0]
    raw = files[name]
    (hlen,) = struct.unpack("<Q", raw[8:16])
    head = json.loads(raw[16:16 + hlen])
    del head["values"]
    header = json.dumps(head).encode()
    header += b" " * (-(len(header) + 16) % 8)
    bad = MAGIC + struct.pack("<Q", len(header)) + header + raw[16 + hlen:]
    manifest.tables[1] = (name, len(bad), digest(bad))
    with pytest.raises(CorruptCheckpointError, match="per-rank items"):
        item_tree(_bound(manifest, {**files, name: bad}).items["rng"], 1)
    # Before: the trees inline in a format-2 manifest (no values in the tables).
    old, old_files = sim.step_of((4,), SPECS, SaveOptions(**OPTIONS))
    old_doc = json.loads(old.to_json())
    old_doc["items"]["count"] = {"kind": "stateful",
                                 "per_rank": {str(r): {"n": r} for r in range(4)}}
    inline = bind_tables(Manifest.from_json(sealed_json(old_doc), where="old"),
                         old_files.__getitem__, "old")
    assert item_tree(inline.items["count"], 3) == {"n": 3}


@pytest.mark.multiproc
def test_a_save_exchanges_no_per_rank_values_and_each_rank_restores_its_own(tmp_path):
    """Format 2 keeps each rank's per-rank trees in its own table, so a save's collectives
    carry none of them: what each rank receives stays small however large the values (at
    4,096 ranks an RNGState's tree alone was 31 MB to every rank). Each rank still restores
    its own RNG state and value from the root, bit-exact; ranks that disagree on their
    per-rank items are refused on every rank."""
    blob = 256 * 1024
    seen = run_ranks(2, W.save_recording_the_exchange, str(tmp_path), blob, timeout=300)
    with open(tmp_path / "step-00000002" / "manifest.json", "rb") as f:
        items = json.loads(f.read())["items"]
    assert items["blob"] == {"kind": "stateful", "per_rank": "tables"}
    assert not (tmp_path / "step-00000001").exists()
    for rank, s in enumerate(seen):
        assert s["mismatch"] and "different per-rank items" in s["mismatch"], rank
        assert s["received"], "the save ran no recorded collective"
        assert s["blobs_seen"] == [], (rank, s["blobs_seen"])
        assert sum(s["received"]) < blob // 16, (rank, s["received"])
        assert s["step"] == 2 and s["rng_exact"] and s["blob_exact"], (rank, s)


def test_verify_names_every_damaged_rank_table_not_only_the_first():
    """Every damaged rank table is named, not only the first, so that ``ckpt verify`` lists each
    damaged file and one repair pass fixes them all."""
    specs = [sim.TensorSpec("rows", "float32", (300, 16), (Shard(0),))]
    manifest, files = sim.step_of((4,), specs, SaveOptions(chunk_bytes=4096))

    def bound(files: dict[str, bytes]) -> Manifest:
        m = Manifest.from_json(manifest.to_json(), where="simulated")
        return bind_tables(m, lambda name: files[name], "simulated")

    assert bound(files).table_problems() == []
    damaged = dict(files)
    for rank in (1, 3):
        name = manifest.tables[rank][0]
        raw = damaged[name]
        damaged[name] = raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:]
    problems = bound(damaged).table_problems()
    assert [str(p) for p in problems] == [
        next(str(p) for p in problems if f"rank {rank}'s chunk table" in str(p))
        for rank in (1, 3)]
