"""The memory tier combined with a probe and the forward gate (the trainer's defaults), under
a process group of two real gloo ranks, each playing one node with its own segments and a peer
replica on the other: a restore with ``verify="forward"`` is served from memory (the probe's
recorded output is part of what each rank reads), falls through to the replicas when a rank's
own copy is damaged, and says what it did (a log line and ``mgr.last_restore``)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import ckpt

from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

NODES = ["nodeA", "nodeB"]


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 8))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}


def _manager(root: str, shm: str, rank: int) -> ckpt.CheckpointManager:
    # A probe batch larger than the model: its recorded inputs and output get data files
    # of their own, which no tensor of the state being restored shares.
    probe = ckpt.Probe(model_key="model", inputs=torch.ones(2048, 16))
    tier = ckpt.MemoryTierOptions(shm_dir=shm, node=NODES[rank], job="probe",
                                  persist_every=1000)
    return ckpt.CheckpointManager(root, memory_tier=tier, async_save=False,
                                  options=ckpt.SaveOptions(probe=probe, write_threads=4))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _weights(state: dict) -> list:
    """The model's weights as lists (tensors do not cross the result queue)."""
    return [p.detach().tolist() for p in state["model"].parameters()]


def _restore(root: str, shm: str, rank: int) -> dict:
    """A fresh model restored with the forward gate; what it got and what it said."""
    state = _state(999)
    lines = _Lines()
    logging.getLogger("ckpt").addHandler(lines)
    logging.getLogger("ckpt").setLevel(logging.INFO)
    try:
        with _manager(root, shm, rank) as mgr:
            step = mgr.restore(state, verify="forward")
            info = mgr.last_restore
    finally:
        logging.getLogger("ckpt").removeHandler(lines)
    return {"step": step, "tier": str(info.tier), "skipped": list(getattr(info, "skipped", [])),
            "bytes": getattr(info, "bytes", 0), "bytes_from_storage": info.bytes_from_storage,
            "seconds": getattr(info, "seconds", 0), "weights": _weights(state),
            "said": [line for line in lines.lines if line.startswith("ckpt.restore step=")]}


def _segment(shm: str, name: str) -> str:
    """The segment directory ``name`` under ``shm`` (at any depth)."""
    [found] = [os.path.join(d, name) for d, dirs, _ in os.walk(shm) if name in dirs]
    return found


def _flip(step_path: str, prefix: str) -> None:
    """Flip one bit in the middle of every chunk of the tensors named ``prefix*``."""
    with open(os.path.join(step_path, "rank.json")) as f:
        doc = json.load(f)
    chunks = [chunk for key, chunk in doc["table"]["chunks"] if key.startswith(prefix)]
    assert chunks, f"no chunk of {prefix}* in {step_path}"
    for chunk in chunks:
        if True:
            with open(os.path.join(step_path, chunk["file"]), "r+b") as f:
                f.seek(chunk["start"] + chunk["length"] // 2)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ 0x01]))


def save_then_restore(rank: int, world: int, root: str, shm: str) -> dict:
    """Save steps 0 (root and memory), 2 and 4 (memory only), faster than they are
    replicated; restore with the gate three times: as saved; after rank 0's own copy of step 4 was damaged (its replica on node B is
    good); after node B lost its memory (rank 1 reads every byte, the probe's among them,
    from rank 0, whose only copy of step 4 is the damaged one)."""
    with _manager(root, shm, rank) as mgr:
        state, out = _state(0), {}
        # Saves outpace replication: the replicas arriving here are stored only once every
        # step is published (the first is still on its way when the later ones are queued).
        mgr._publisher.replicator.hold.clear()
        for step in (0, 2, 4):
            with torch.no_grad():
                for p in state["model"].parameters():
                    p.add_(0.01 * (step + 1))
            mgr.save(step, state, force=True)
            out[f"saved{step}"] = _weights(state)
        mgr.wait()
        dist.barrier()  # every rank has queued its steps
        mgr._publisher.replicator.hold.set()
        assert mgr.wait_replicated(60)
        dist.barrier()
        out["root"] = mgr.steps()
    out["own"] = _restore(root, shm, rank)
    if rank == 0:
        _flip(os.path.join(_segment(shm, f"ckpt-probe-{NODES[0]}-r0"), "step-00000004"),
              "model/")
    dist.barrier()
    out["damaged"] = _restore(root, shm, rank)
    if rank == 1:  # node B loses its memory (its rank lives on): its own and replica segments
        for name in (f"ckpt-probe-{NODES[1]}-r1", f"ckpt-probe-{NODES[1]}-replica-r0"):
            shutil.rmtree(_segment(shm, name))
    dist.barrier()
    out["node_lost"] = _restore(root, shm, rank)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    shm = tmp / "shm"
    shm.mkdir()
    return run_ranks(2, save_then_restore, str(tmp / "root"), str(shm), timeout=120)


def test_forward_gate_restores_from_memory(runs):
    for out in runs:
        assert out["root"] == [0]  # steps 2 and 4 exist in memory only
        own = out["own"]
        assert (own["step"], own["tier"], own["skipped"]) == (4, "memory", [])
        assert own["bytes_from_storage"] == 0
        assert own["weights"] == out["saved4"]


def test_damaged_own_copy_is_read_from_the_replica_and_reported(runs):
    for out in runs:
        damaged = out["damaged"]
        assert (damaged["step"], damaged["tier"]) == (4, "peer")
        assert damaged["weights"] == out["saved4"]
        [(step, tier, why)] = damaged["skipped"]
        assert (step, tier) == (4, "memory") and "digest" in why
        [line] = damaged["said"]
        assert line.startswith(f"ckpt.restore step=4 tier=peer bytes={damaged['bytes']} ")
        assert "skipped=step 4 (memory): " in line and "digest" in line


def test_forward_gate_reads_the_recorded_probe_from_a_peer(runs):
    # Node B lost its memory: rank 1 reads every byte, the probe's recorded inputs and
    # output among them (the gate runs on every rank), from rank 0. Rank 0's only copy of
    # step 4 is damaged: both ranks skip it and restore step 2.
    ours, theirs = runs[0]["node_lost"], runs[1]["node_lost"]
    assert (ours["step"], ours["tier"]) == (2, "memory")
    assert (theirs["step"], theirs["tier"]) == (2, "peer")
    assert ours["weights"] == theirs["weights"] == runs[0]["saved2"]
    for out in (ours, theirs):
        assert out["bytes_from_storage"] == 0
        assert [(s, tier) for s, tier, _ in out["skipped"]] == [(4, "memory")]
        [line] = out["said"]
        assert line.startswith(f"ckpt.restore step=2 tier={out['tier']} bytes={out['bytes']} ")
        assert "skipped=step 4 (memory): " in line


def test_restore_reports_step_tier_bytes_and_time(runs):
    for out in runs:
        own = out["own"]
        assert own["bytes"] > 0 and own["seconds"] > 0
        [line] = own["said"]
        assert line.startswith(f"ckpt.restore step=4 tier=memory bytes={own['bytes']} "
                               f"seconds=")
        assert "skipped=none" in line
