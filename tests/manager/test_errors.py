"""Bad input gets a clear error of the documented type, and changes nothing: not the live
state, not the checkpoint root. Corrupt checkpoints are refused before their data is used,
and a manager falls back past them to the previous good step."""

from __future__ import annotations

import json
import logging
import os
import signal
import shutil
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt._format.sealed import sealed_json
from tests.support.workers import ForkedWorker, assert_same

APIS = ["oneshot", "manager"]


class Net(torch.nn.Module):
    def __init__(self, seed: int, hidden: int = 8, out: int = 3, extra: bool = False,
                 second: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(4, hidden)
        if second:
            self.fc2 = torch.nn.Linear(hidden, out)
        if extra:
            self.fc3 = torch.nn.Linear(out, 2)


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def save_one(tmp_path: Path, api: str, state: dict, **kw) -> Path:
    """Save ``state`` once (as step 1 of a root for the manager); return what to load from."""
    if api == "oneshot":
        ckpt.save(state, tmp_path / "one", step=1, **kw)
        return tmp_path / "one"
    with ckpt.CheckpointManager(tmp_path / "root", options=ckpt.SaveOptions(**kw)) as mgr:
        mgr.save(1, state)
    return tmp_path / "root"


def load_one(api: str, where: Path, state: dict, **kw) -> int | None:
    if api == "oneshot":
        return ckpt.load(state, where, **kw)
    with ckpt.CheckpointManager(where, options=ckpt.SaveOptions(**kw)) as mgr:
        return mgr.restore(state)


def root_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name not in (".lock", ".lock.owner"))


# ----------------------------------------------------------------- nothing there (yet)


def test_restore_on_an_empty_root_returns_none_and_changes_nothing(tmp_path):
    model = Net(0)
    before = snapshot(model)
    state = {"model": model, "value": 5}
    with ckpt.CheckpointManager(tmp_path / "root") as mgr:
        assert mgr.steps() == []
        assert mgr.restore(state) is None
    assert_same(snapshot(model), before)
    assert state["value"] == 5
    assert root_entries(tmp_path / "root") == []


def test_read_only_manager_on_a_missing_root_raises_not_found(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ckpt.CheckpointNotFoundError) as e:
        ckpt.CheckpointManager(missing, read_only=True)
    assert str(missing) in str(e.value)
    assert isinstance(e.value, FileNotFoundError)
    assert not missing.exists()


@pytest.mark.parametrize("where", ["missing_dir", "missing_parent"])
def test_load_from_a_missing_path_raises_not_found(tmp_path, where):
    path = tmp_path / "ckpt" if where == "missing_dir" else tmp_path / "a" / "b" / "ckpt"
    model = Net(0)
    before = snapshot(model)
    with pytest.raises(ckpt.CheckpointNotFoundError) as e:
        ckpt.load({"model": model}, path)
    assert str(path) in str(e.value)
    assert_same(snapshot(model), before)
    assert sorted(os.listdir(tmp_path)) == []


# ------------------------------------------------------------------------ mismatched state


MISMATCHES = {
    # name: (live model factory, strings the message must contain)
    "extra_layer": (lambda: Net(1, extra=True), ["fc3.weight", "fc3.bias"]),
    "missing_layer": (lambda: Net(1, second=False), ["fc2.weight", "fc2.bias"]),
    "shape": (lambda: Net(1, out=5), ["fc2.weight", "[3, 8]", "[5, 8]"]),
    "dtype": (lambda: Net(1).double(), ["fc1.weight", "float32", "float64"]),
}


@pytest.mark.parametrize("kind", list(MISMATCHES))
@pytest.mark.parametrize("api", APIS)
def test_mismatched_model_raises_state_mismatch_and_changes_nothing(tmp_path, api, kind):
    where = save_one(tmp_path, api, {"model": Net(0)})
    factory, needles = MISMATCHES[kind]
    live = factory()
    before = snapshot(live)
    with pytest.raises(ckpt.StateMismatchError) as e:
        load_one(api, where, {"model": live})
    for needle in needles:
        assert needle in str(e.value)
    assert_same(snapshot(live), before)


@pytest.mark.parametrize("api", APIS)
def test_mismatch_found_by_load_state_dict_changes_nothing(tmp_path, api):
    model = Net(0)
    opt = torch.optim.AdamW([{"params": model.fc1.parameters()},
                             {"params": model.fc2.parameters(), "lr": 0.1}])
    model.fc2(model.fc1(torch.randn(2, 4))).sum().backward()
    opt.step()
    where = save_one(tmp_path, api, {"model": model, "opt": opt})

    live = Net(1)
    live_opt = torch.optim.AdamW(live.parameters())  # one param group, not two
    before = snapshot(live)
    with pytest.raises(ckpt.StateMismatchError, match="parameter groups"):
        load_one(api, where, {"model": live, "opt": live_opt})
    assert_same(snapshot(live), before)


# ------------------------------------------------------------------------ corrupt manifests


def corrupt_target(tmp_path: Path) -> dict:
    """A state with a many-chunk tensor; chunk_bytes=4096 cuts "w" into 4 slabs."""
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(5, generator=g),
            "meta": {"tag": "x"}}


OPTIONS = ckpt.SaveOptions(chunk_bytes=4096, write_threads=2)


def _parent_file(doc: dict, step_dir: Path) -> None:
    # A valid copy of a real data file placed at <step>/../x: if the name were followed,
    # the load would succeed and read outside the checkpoint.
    chunk = doc["tensors"]["w"]["chunks"][0]
    shutil.copyfile(step_dir / chunk["file"], step_dir.parent / "x")
    doc["files"]["../x"] = doc["files"][chunk["file"]]
    chunk["file"] = "../x"


def _absolute_file(doc: dict, step_dir: Path) -> None:
    chunk = doc["tensors"]["w"]["chunks"][0]
    doc["files"][str(step_dir / chunk["file"])] = doc["files"][chunk["file"]]
    chunk["file"] = str(step_dir / chunk["file"])


def _overlap(doc: dict, step_dir: Path) -> None:
    chunks = doc["tensors"]["w"]["chunks"]
    assert len(chunks) >= 3
    chunks[1]["offsets"][0] -= 1  # rows overlap chunk 0 and leave a gap; volume unchanged


def _absurd_shape(doc: dict, step_dir: Path) -> None:
    entry = doc["tensors"]["w"]
    entry["shape"] = [2**40, 2**40]
    entry["chunks"] = [dict(entry["chunks"][0], shape=[2**40, 2**40], offsets=[0, 0],
                            length=2**80 * 4)]


def _set(path: list, value):
    def mutate(doc: dict, step_dir: Path) -> None:
        target = doc
        for p in path[:-1]:
            target = target[p]
        target[path[-1]] = value(doc) if callable(value) else value
    return mutate


MANIFEST_DAMAGE = {
    "garbage": lambda raw, step_dir: b"\x00{not json at all",
    "truncated": lambda raw, step_dir: raw[: len(raw) // 2],
    "format_version": _set(["format_version"], 999),
    "parent_file": _parent_file,
    "absolute_file": _absolute_file,
    "absurd_file_size": lambda doc, d: doc["files"].update({k: 2**62 for k in doc["files"]}),
    "absurd_chunk_length": _set(["tensors", "w", "chunks", 0, "length"], 2**62),
    "absurd_start": _set(["tensors", "w", "chunks", 0, "start"], 2**62),
    "negative_start": _set(["tensors", "w", "chunks", 0, "start"], -8),
    "absurd_shape": _absurd_shape,
    "overlapping_chunks": _overlap,
}
RAW_DAMAGE = {"garbage", "truncated"}


def damage_manifest(step_dir: Path, kind: str) -> None:
    path = step_dir / "manifest.json"
    raw = path.read_bytes()
    if kind in RAW_DAMAGE:
        path.write_bytes(MANIFEST_DAMAGE[kind](raw, step_dir))
        return
    doc = json.loads(raw)
    MANIFEST_DAMAGE[kind](doc, step_dir)
    path.write_bytes(sealed_json(doc))  # sealed again: refused for the edit, not the digest




@pytest.mark.parametrize("kind", list(MANIFEST_DAMAGE))
def test_load_refuses_a_corrupt_manifest_before_touching_data(tmp_path, kind, storage_reads):
    state = corrupt_target(tmp_path)
    ckpt.save(state, tmp_path / "c", options=OPTIONS)
    damage_manifest(tmp_path / "c", kind)
    template = {"w": torch.zeros(64, 64), "b": torch.zeros(5), "meta": None}
    storage_reads.clear()

    with pytest.raises(ckpt.CorruptCheckpointError) as e:
        ckpt.load(template, tmp_path / "c")

    assert "manifest.json" in str(e.value)
    assert storage_reads and all(p.endswith("manifest.json") for p in storage_reads), storage_reads
    assert_same(template, {"w": torch.zeros(64, 64), "b": torch.zeros(5), "meta": None})


@pytest.mark.parametrize("kind", list(MANIFEST_DAMAGE))
def test_restore_falls_back_past_a_corrupt_manifest(tmp_path, kind, caplog):
    root = tmp_path / "root"
    first = corrupt_target(tmp_path)
    second = {k: (v + 1 if isinstance(v, torch.Tensor) else v) for k, v in first.items()}
    with ckpt.CheckpointManager(root, options=OPTIONS) as mgr:
        mgr.save(1, first)
        mgr.save(2, second)
    damage_manifest(root / "step-00000002", kind)
    template = {"w": torch.zeros(64, 64), "b": torch.zeros(5), "meta": None}

    with caplog.at_level(logging.WARNING, logger="ckpt"):
        with ckpt.CheckpointManager(root) as mgr:
            assert mgr.restore(template) == 1
            assert [s for s, _ in mgr.skipped] == [2]
            with pytest.raises(ckpt.CorruptCheckpointError):
                mgr.restore(template, step=2)  # an explicit step is not skipped silently
    assert_same(template, first)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "ckpt"]
    assert any("step=2" in r.getMessage() for r in warnings), [r.getMessage() for r in warnings]


def test_restore_raises_when_every_step_is_corrupt(tmp_path):
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, options=OPTIONS) as mgr:
        mgr.save(1, corrupt_target(tmp_path))
        mgr.save(2, corrupt_target(tmp_path))
    for step in ("step-00000001", "step-00000002"):
        damage_manifest(root / step, "garbage")
    with ckpt.CheckpointManager(root) as mgr:
        with pytest.raises(ckpt.CorruptCheckpointError) as e:
            mgr.restore({"w": torch.zeros(64, 64), "b": torch.zeros(5), "meta": None})
    assert "step 1" in str(e.value) and "step 2" in str(e.value)


# ------------------------------------------------------------------------ damaged data files


def damage_data(step_dir: Path, kind: str) -> str:
    """Damage the file holding chunk 1 of "w"; return its name."""
    doc = json.loads((step_dir / "manifest.json").read_bytes())
    chunk = doc["tensors"]["w"]["chunks"][1]
    path = step_dir / chunk["file"]
    if kind == "flipped_bit":
        raw = bytearray(path.read_bytes())
        raw[chunk["start"] + 5] ^= 0x04
        path.write_bytes(bytes(raw))
    elif kind == "truncated":
        os.truncate(path, path.stat().st_size - 7)
    else:
        path.unlink()
    return chunk["file"]


DATA_DAMAGE = ["flipped_bit", "truncated", "missing"]


@pytest.mark.parametrize("kind", DATA_DAMAGE)
def test_load_of_a_damaged_data_file_raises_corrupt_naming_the_file(tmp_path, kind):
    ckpt.save(corrupt_target(tmp_path), tmp_path / "c", options=OPTIONS)
    name = damage_data(tmp_path / "c", kind)
    with pytest.raises(ckpt.CorruptCheckpointError) as e:
        ckpt.load({"w": torch.zeros(64, 64), "b": torch.zeros(5), "meta": None}, tmp_path / "c")
    assert name in str(e.value)


@pytest.mark.parametrize("kind", DATA_DAMAGE)
def test_restore_falls_back_past_a_damaged_data_file(tmp_path, kind, caplog):
    root = tmp_path / "root"
    first = corrupt_target(tmp_path)
    second = {k: (v * 2 if isinstance(v, torch.Tensor) else v) for k, v in first.items()}
    with ckpt.CheckpointManager(root, options=OPTIONS) as mgr:
        mgr.save(1, first)
        mgr.save(2, second)
    name = damage_data(root / "step-00000002", kind)
    template = {"w": torch.zeros(64, 64), "b": torch.zeros(5), "meta": None}
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        with ckpt.CheckpointManager(root) as mgr:
            assert mgr.restore(template) == 1
            ((step, reason),) = mgr.skipped
            assert step == 2 and name in reason
    assert_same(template, first)
    assert any(r.levelno == logging.WARNING and "step=2" in r.getMessage() and name in r.getMessage()
               for r in caplog.records)


def test_load_of_a_corrupt_data_file_changes_nothing(tmp_path):
    ckpt.save(corrupt_target(tmp_path), tmp_path / "c", options=OPTIONS)
    damage_data(tmp_path / "c", "flipped_bit")
    live = {"w": torch.zeros(64, 64), "b": torch.zeros(5), "meta": None}
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.load(live, tmp_path / "c")
    assert_same(live, {"w": torch.zeros(64, 64), "b": torch.zeros(5), "meta": None})


# ------------------------------------------------------------------------ writer lock


def test_second_writer_in_the_same_process_is_refused_naming_the_pid(tmp_path):
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root) as first:
        with pytest.raises(ckpt.CheckpointLockedError) as e:
            ckpt.CheckpointManager(root)
        assert f"pid {os.getpid()}" in str(e.value)
        first.save(1, {"x": torch.ones(3)})  # the holder is unaffected
        first.wait()
    with ckpt.CheckpointManager(root) as again:  # released on close
        assert again.steps() == [1]


@pytest.mark.multiproc
def test_second_writer_in_another_process_is_refused_and_a_dead_ones_lock_is_taken(tmp_path):
    root = tmp_path / "root"
    holder = ForkedWorker("hold_lock", root)
    try:
        holder.expect("locked")
        with pytest.raises(ckpt.CheckpointLockedError) as e:
            ckpt.CheckpointManager(root)
        assert f"pid {holder.pid}" in str(e.value)
        assert isinstance(e.value, BlockingIOError)
        with ckpt.CheckpointManager(root, read_only=True) as reader:  # readers need no lock
            assert reader.steps() == []
    finally:
        holder.kill()
    assert holder.proc.returncode == -signal.SIGKILL
    with ckpt.CheckpointManager(root) as mgr:  # the stale lock of the killed writer
        mgr.save(1, {"x": torch.ones(3)})
        with pytest.raises(ckpt.CheckpointLockedError) as e:
            ckpt.CheckpointManager(root)
        assert f"pid {os.getpid()}" in str(e.value)  # now it names this process
    assert ckpt.CheckpointManager(root, read_only=True).steps() == [1]


# ------------------------------------------------------------------------ unsupported values


@pytest.mark.parametrize("value", [{1, 2, 3}, object(), [1, {"deep": frozenset()}]],
                         ids=["set", "object", "nested"])
def test_non_json_value_is_refused_and_nothing_is_written(tmp_path, value):
    with pytest.raises(ckpt.UnsupportedValueError) as e:
        ckpt.save({"x": torch.ones(2), "bad": value}, tmp_path / "c")
    assert "bad" in str(e.value) and "allow_pickle" in str(e.value)
    assert not (tmp_path / "c").exists()

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root) as mgr:
        with pytest.raises(ckpt.UnsupportedValueError):
            mgr.save(1, {"x": torch.ones(2), "bad": value})
        assert root_entries(root) == []
        mgr.save(2, {"x": torch.ones(2)})  # the manager is still usable
        mgr.wait()
        assert mgr.steps() == [2]


@pytest.mark.parametrize("api", APIS)
def test_pickled_value_round_trips_only_with_allow_pickle(tmp_path, api):
    model = Net(0)
    where = save_one(tmp_path, api, {"model": model, "obj": {1, 2, 3}}, allow_pickle=True)
    live = {"model": Net(1), "obj": None}
    with pytest.raises(ckpt.UnsupportedValueError, match="allow_pickle"):
        load_one(api, where, live)
    assert live["obj"] is None

    assert load_one(api, where, live, allow_pickle=True) == 1
    assert live["obj"] == {1, 2, 3}
    assert_same(snapshot(live["model"]), snapshot(model))


@pytest.mark.parametrize("api", APIS)
def test_refused_pickled_value_changes_nothing(tmp_path, api):
    where = save_one(tmp_path, api, {"model": Net(0), "obj": {1, 2, 3}}, allow_pickle=True)
    live = Net(1)
    before = snapshot(live)
    with pytest.raises(ckpt.UnsupportedValueError):
        load_one(api, where, {"model": live, "obj": None})
    assert_same(snapshot(live), before)


@pytest.mark.skipif(not hasattr(torch, "bits8"), reason="this torch has no bits8")
def test_tensor_of_an_unstorable_dtype_is_refused_up_front(tmp_path):
    bad = torch.zeros(4, dtype=torch.uint8).view(torch.bits8)
    with pytest.raises(ckpt.UnsupportedValueError) as e:
        ckpt.save({"ok": torch.ones(2), "bad": bad}, tmp_path / "c")
    assert "bits8" in str(e.value)
    assert not (tmp_path / "c").exists()

    root = tmp_path / "root"
    with ckpt.CheckpointManager(root) as mgr:  # refused by save() itself, even when async
        with pytest.raises(ckpt.UnsupportedValueError):
            mgr.save(1, {"ok": torch.ones(2), "bad": bad})
        assert root_entries(root) == []
        mgr.save(2, {"ok": torch.ones(2)})
    assert ckpt.CheckpointManager(root, read_only=True).steps() == [2]


def test_a_forked_child_of_a_killed_writer_does_not_keep_the_root_locked(tmp_path):
    """DataLoader workers are forked children of the writer: one that outlives its SIGKILLed
    parent (workers notice a dead parent only after seconds) must not hold the writer lock,
    or the restarted job finds the root locked by a dead process."""
    import subprocess
    import sys

    root = tmp_path / "root"
    script = (
        "import os, sys, time, ckpt\n"
        f"mgr = ckpt.CheckpointManager({str(root)!r})\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(child, flush=True)\n"
        "time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=env)
    child = int(writer.stdout.readline())
    try:
        writer.kill()
        writer.wait()
        os.kill(child, 0)  # the child is still alive, holding the parent's descriptors
        with ckpt.CheckpointManager(root) as mgr:  # the restarted job takes the lock at once
            mgr.save(1, {"x": torch.ones(2)}, force=True)
        assert mgr.steps() == [1]
    finally:
        os.kill(child, signal.SIGKILL)
