"""The scale simulator (benchmarks/scale_sim.py) runs the real planning path: at 4 ranks the
manifest it builds equals the one a real gloo save writes, apart from digests and times."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from torch.distributed.tensor import Replicate, Shard

from _dist import run_ranks
import _scale_workers as W
from ckpt.format import Manifest
from ckpt.options import SaveOptions
from ckpt.sharding import overlapping

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
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


def _normalized(doc: dict) -> dict:
    """The parts of a manifest the planning path decides: every tensor's chunks (box, file,
    byte range) and the file sizes; tokens in file names, digests and times removed."""
    token = re.compile(r"^(data-[0-9a-f]{2})-[0-9a-z]+-")
    return {
        "tensors": {k: {"dtype": e["dtype"], "shape": e["shape"], "chunks": [
            {**{f: c[f] for f in ("offsets", "shape", "start", "length")},
             "file": token.sub(r"\1-T-", c["file"])} for c in e["chunks"]]}
            for k, e in doc["tensors"].items()},
        "files": {token.sub(r"\1-T-", k): v for k, v in doc["files"].items()},
        "world_size": doc["world_size"],
    }


@pytest.mark.multiproc
@pytest.mark.slow
def test_simulated_manifest_equals_a_real_four_rank_save(tmp_path):
    root = str(tmp_path / "root")
    run_ranks(4, W.save_specs, root, SPECS, OPTIONS, timeout=600)
    with open(os.path.join(root, "step-00000001", "manifest.json"), "rb") as f:
        real = json.loads(f.read())
    simulated = sim.manifest_of(SPECS, sim.rank_specs((4,), SPECS), SaveOptions(**OPTIONS))
    assert _normalized(json.loads(simulated.to_json())) == _normalized(real)
    # The layout is not trivial: several chunks per tensor, the replica written once.
    assert len(real["tensors"]["rows"]["chunks"]) == 8
    assert len(real["tensors"]["rep"]["chunks"]) == 1


def _scan(entry, box):
    """The reference: every chunk checked (what a read plan did before the index)."""
    from ckpt.sharding import intersect
    return [(c, o) for c in entry.chunks if c.numel
            for o in [intersect((c.offsets, c.shape), box)] if o is not None]


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "tp_fsdp"])
def test_indexed_read_plan_finds_exactly_the_overlapping_chunks(layout):
    mesh, tensors = sim.model_state(layout, 16, optimizer=False, layers=1)
    manifest = sim.manifest_of(tensors, sim.rank_specs(mesh, tensors),
                               SaveOptions(chunk_bytes=1 << 20, write_threads=1))
    manifest = Manifest.from_json(manifest.to_json(), where="simulated")
    for world in (8, 24):  # fewer and more ranks, and a mesh cut differently
        new_mesh, new = sim.model_state("fsdp" if layout == "fsdp" else layout, world,
                                        optimizer=False, layers=1)
        for rank in (0, world // 2, world - 1):
            for t, box in zip(new, sim.rank_boxes(new_mesh, new, rank)):
                entry = manifest.tensors[t.key]
                got = sorted((c.offsets, o) for c, o in overlapping(entry, box))
                assert got == sorted((c.offsets, o) for c, o in _scan(entry, box)), t.key
