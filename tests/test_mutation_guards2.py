"""Guards found by mutation testing (h-mutate2): each test here kills a one-line mutant of
code landed in this session (the one-pass restore, the memory tier's restore) that the
modules' own tests let survive. The mutant is named in each docstring; applying it makes
the test fail."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt import CheckpointManager, CorruptCheckpointError, PartialLoadError, SaveOptions
from ckpt._format.manifest import MAX_DIMS, Manifest
from storage_backends import PosixStorage
from test_load import flip_byte

# Small chunks, one writer thread: every tensor spans several chunks of one data file.
OPTIONS = SaveOptions(chunk_bytes=4096, write_threads=1)


def make_state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(32, 48)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return {"model": model, "extra": torch.randn(48, 32, generator=gen)}


def values(state: dict) -> dict[str, torch.Tensor]:
    """The state's tensors by their stored keys, copied."""
    out = {f"model/{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    out["extra"] = state["extra"].clone()
    return out


def save_step(root: Path, step: int, state: dict) -> None:
    with CheckpointManager(root, async_save=False, options=OPTIONS, handle_sigterm=False,
                           metrics=False) as mgr:
        mgr.save(step, state)


def chunks(step_dir: Path) -> list[dict]:
    """The step's chunk records in the order they are stored."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    return sorted((c for e in manifest["tensors"].values() for c in e["chunks"]),
                  key=lambda c: (c["file"], c["start"]))


def changed(state: dict, before: dict[str, torch.Tensor]) -> set[str]:
    now = values(state)
    return {k for k in before if not torch.equal(now[k], before[k])}


class _NoStreaming(PosixStorage):
    """A storage that does not stream (as an object store, where every read is a request):
    a one-pass load reads each chunk whole and must digest it all the same."""

    stream_block = None


class _OddBlocks(PosixStorage):
    """Streams through blocks that divide no chunk: a one-pass load reads each chunk in
    several blocks, the last one short."""

    stream_block = 1000


@pytest.mark.parametrize("storage_type", [_NoStreaming, _OddBlocks])
def test_a_one_pass_restore_reads_and_digests_every_byte_whatever_the_storage(
        tmp_path, storage_type):
    """Mutants: ckpt/_load/reader.py read_chunk checking only a digest taken block by block
    (``found is not None and found != chunk.digest``: a storage without ``stream_block``, as
    S3, loads a flipped bit silently) and reading every block of a chunk at the chunk's start
    (``read_into(chunk.start, part)``)."""
    save_step(tmp_path, 1, make_state(1))
    save_step(tmp_path, 2, make_state(2))
    records = chunks(tmp_path / "step-00000002")
    middle = max(records[1:-1], key=lambda c: c["length"])  # neither first nor last
    assert len(records) >= 4 and middle["length"] > 2000  # (several blocks of _OddBlocks)
    live = make_state(3)
    with CheckpointManager(storage_type(tmp_path), read_only=True, metrics=False) as mgr:
        assert mgr.restore(live) == 2
    assert changed(live, values(make_state(2))) == set()
    flip_byte(tmp_path / "step-00000002" / middle["file"], middle["start"] + middle["length"] - 1)
    live = make_state(3)
    with CheckpointManager(storage_type(tmp_path), read_only=True, metrics=False) as mgr:
        assert mgr.restore(live) == 1
        assert [s for s, _ in mgr.skipped] == [2] and "digest mismatch" in mgr.skipped[0][1]
    assert changed(live, values(make_state(1))) == set()


def test_the_forward_level_verifies_a_step_before_writing_any_live_tensor(tmp_path):
    """Mutant: ckpt/_manager/manager.py restore reading in one pass at the forward level too
    (``gate.level != "structure"``). That level puts back only the models when it raises;
    a plain tensor written before the corrupt chunk was found would stay overwritten under
    an error that says nothing of it."""
    save_step(tmp_path, 1, make_state(1))
    last = chunks(tmp_path / "step-00000001")[-1]  # in "extra", stored last
    flip_byte(tmp_path / "step-00000001" / last["file"], last["start"] + last["length"] - 1)
    live = make_state(2)
    before = values(live)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match="digest mismatch") as info:
            mgr.restore(live, verify="forward")
    assert not isinstance(info.value, PartialLoadError)
    assert changed(live, before) == set()


def test_a_one_pass_restore_names_what_every_failed_step_overwrote(tmp_path):
    """Mutant: ckpt/_manager/manager.py restore keeping only the last failed step's tensors
    (``dirty = ...`` for ``dirty |= ...``). Step 2 fails at its last chunk, after writing
    every tensor; step 1 at its first. The error must name every tensor either overwrote,
    not only the one step 1 touched."""
    save_step(tmp_path, 1, make_state(1))
    save_step(tmp_path, 2, make_state(2))
    for step, which in ((1, 0), (2, -1)):
        c = chunks(tmp_path / f"step-{step:08d}")[which]
        flip_byte(tmp_path / f"step-{step:08d}" / c["file"], c["start"] + c["length"] // 2)
    live = make_state(3)
    before = values(live)
    with CheckpointManager(tmp_path, read_only=True, metrics=False) as mgr:
        with pytest.raises(PartialLoadError, match="no committed step") as info:
            mgr.restore(live)
    overwritten = changed(live, before)
    assert overwritten == set(before)  # (the case needs step 2 to have written them all)
    assert info.value.changed == overwritten
    assert f"overwrote {len(overwritten)} live tensors" in str(info.value)


def test_tensors_whose_paths_collide_are_saved_and_loaded_apart(tmp_path):
    """Mutant: ckpt/_shared/state.py _Flattener.tensor without ``key = self._unique(key)`` (the
    second tensor of a path, such as a dict's int key 1 and str key "1", would overwrite
    the first: both load as one of them)."""
    saved = {"m": {1: torch.arange(4.0), "1": torch.arange(4.0) + 10,
                   "x/y": torch.full((2,), 7.0), "x": {"y": torch.full((2,), 8.0)}}}
    ckpt.save(saved, tmp_path / "c")
    live = {"m": None}
    ckpt.load(live, tmp_path / "c")
    got = live["m"]
    assert torch.equal(got[1], saved["m"][1]) and torch.equal(got["1"], saved["m"]["1"])
    assert torch.equal(got["x/y"], saved["m"]["x/y"])
    assert torch.equal(got["x"]["y"], saved["m"]["x"]["y"])


def test_a_plain_tensor_that_requires_grad_loads_through_a_bounce_buffer(tmp_path):
    """Mutant: ckpt/_shared/state.py _Flattener.tensor keeping a plain tensor that requires grad
    undetached (``type(t) is torch.Tensor`` without ``and not t.requires_grad``): a load
    whose destination is not contiguous (as every CUDA destination) copies into it, which
    autograd refuses for a leaf that requires grad."""
    saved = torch.randn(96, 80)
    ckpt.save({"t": saved}, tmp_path / "c", options=OPTIONS)
    live = torch.zeros(80, 96).t()  # a transposed view: the bounce path
    live.requires_grad_()
    ckpt.load({"t": live}, tmp_path / "c")
    assert torch.equal(live, saved) and live.requires_grad


def _manifest(tensor: dict, **top: object) -> bytes:
    doc = {"format": "ckpt", "format_version": 1, "step": 1, "world_size": 1, "created": 0.0,
           "files": {"data-0.bin": 1 << 20}, "tensors": {"t": tensor}, "aliases": {},
           "items": {"t": {"kind": "tensor", "tree": {"__tensor__": "t"}}}, **top}
    return json.dumps(doc).encode()


def _whole(shape: list[int]) -> dict:
    n = 1
    for s in shape:
        n *= s
    return {"dtype": "float32", "shape": shape, "chunks": [{
        "offsets": [0] * len(shape), "shape": shape, "file": "data-0.bin", "start": 0,
        "length": 4 * n, "digest": "0123456789abcdef"}]}


@pytest.mark.parametrize("raw, message", [
    (_manifest(_whole([1] * (MAX_DIMS + 1))), f"at most {MAX_DIMS} ints"),
    (_manifest(_whole([4]), aliases={"t": "t"}), "alias 't' -> 't' is dangling"),
    (_manifest({**_whole([4]), "dtype": "float99"}), "tensor 't' has unknown dtype 'float99'"),
])
def test_a_manifest_beyond_the_formats_bounds_is_refused_as_corrupt(raw, message):
    """Mutants: ckpt/_format/manifest.py _dims without ``len(value) <= MAX_DIMS`` (a hostile shape
    reaches torch, which raises its own error, not the corruption a restore falls back
    past), _parse's alias check without ``k not in tensors`` (an alias that shadows a
    stored tensor) and _parse_tensor's without ``dtype in DTYPES`` (a KeyError escapes)."""
    assert Manifest.from_json(_manifest(_whole([4])), where="m").tensors["t"].shape == (4,)
    with pytest.raises(CorruptCheckpointError, match="invalid manifest") as info:
        Manifest.from_json(raw, where="m")
    assert message in str(info.value)


@pytest.mark.parametrize("layout, message", [
    ({"boxes": [[[0, 0], [4, 2], 0.0]]}, "writer of box 0 of 't' must be an integer"),
    ({"mesh": 0.0, "placements": ["S0"]}, "tensor 't' names mesh 0.0"),
])
def test_a_format2_layout_with_a_float_index_is_refused_as_corrupt(tmp_path, layout, message):
    """Mutants: ckpt/_format/manifest.py _parse_laid_out without ``type(writer) is not int`` and
    without ``type(mesh) is int`` (0.0 passes the range checks; the mesh then indexes a
    list: a TypeError escapes the parse instead of the corruption a restore falls back
    past)."""
    root = tmp_path / "root"
    with CheckpointManager(root, async_save=False, metrics=False, handle_sigterm=False,
                           options=SaveOptions(rank_tables=True)) as mgr:
        mgr.save(1, {"t": torch.zeros(4, 2)}, force=True)
    doc = json.loads((root / "step-00000001" / "manifest.json").read_text())
    assert doc["tensors"]["t"]["layout"] == {"boxes": [[[0, 0], [4, 2], 0]]}
    doc = {**doc, "meshes": [{"shape": [1], "ranks": [0]}],
           "tensors": {"t": {**doc["tensors"]["t"], "layout": layout}}}
    with pytest.raises(CorruptCheckpointError, match="invalid manifest") as info:
        Manifest.from_json(json.dumps(doc).encode(), where="m")
    assert message in str(info.value)


class _DiskErrorInStep1(PosixStorage):
    """Step 1's data files fail with an I/O error after ``reads`` reads (a disk error: not
    the step's corruption, so no older step is tried after it)."""

    reads = 1

    def open_reader(self, path):
        reader = super().open_reader(path)
        if "step-00000001" not in path:
            return reader

        allowed = self.reads

        class Failing:
            reads = 0

            def read_into(self, start, out):
                self.reads += 1
                if self.reads > allowed:
                    raise OSError(5, "Input/output error")
                reader.read_into(start, out)

            def close(self):
                reader.close()

        return Failing()


@pytest.mark.parametrize("corrupt, reads", [(-1, 1), (0, 3)])
def test_a_fallback_step_that_fails_on_a_disk_error_names_what_the_newer_step_overwrote(
        tmp_path, corrupt, reads):
    """Mutant (and the bug it showed, fixed): ckpt/_manager/manager.py restore re-raising the
    fallback step's own PartialLoadError when a disk error stops it part-way (``and not
    isinstance(error, PartialLoadError)``); and, with that fixed, naming only the newer
    step's tensors (``changed=dirty``). Step 2 is read in one pass and fails its digest at
    its last chunk (after overwriting every tensor) or its first; step 1 then fails on a
    disk error after ``reads`` chunks. The error must name every tensor either wrote (it
    named only step 1's and called the rest "unchanged")."""
    save_step(tmp_path, 1, make_state(1))
    save_step(tmp_path, 2, make_state(2))
    c = chunks(tmp_path / "step-00000002")[corrupt]
    flip_byte(tmp_path / "step-00000002" / c["file"], c["start"] + c["length"] - 1)
    live = make_state(3)
    before = values(live)
    storage = type("Disk", (_DiskErrorInStep1,), {"reads": reads})(tmp_path)
    with CheckpointManager(storage, read_only=True, metrics=False) as mgr:
        with pytest.raises(PartialLoadError, match="Input/output error") as info:
            mgr.restore(live)
        assert [s for s, _ in mgr.skipped] == [2]
    overwritten = changed(live, before)
    assert len(overwritten) >= 2  # (the case needs two tensors changed)
    # every tensor that changed is named (a read that failed may have begun to write one)
    assert overwritten <= info.value.changed <= set(before)
    assert "a failed one-pass read of a newer step had already overwritten" in str(info.value)

@pytest.mark.slow
@pytest.mark.multiproc
def test_a_peer_fetched_chunk_is_read_only_once_its_message_arrived(tmp_path):
    """Mutants: ckpt/_memory/restore.py MemorySource.read_into and _arrived without their
    ``r.wait()`` (the load digests a peer's chunk, in the live tensor or in the verify
    pass's buffer, before the message that brings it has arrived). The holder here sends
    only once the reader waits, so a read that does not wait finds no byte of the step: the
    restore must still come from the peer, exact, in one pass and with the verify pass."""
    from _dist import run_ranks
    from _mutation_workers import restore_with_late_peer_messages, save_in_memory_then_lose_node0

    root, shm, flags = tmp_path / "root", tmp_path / "shm", tmp_path / "flags"
    shm.mkdir()
    flags.mkdir()
    nodes = ["hostG_n0", "hostG_n1"]
    run_ranks(2, save_in_memory_then_lose_node0, str(root), str(shm), "late", nodes,
              timeout=100)
    out = run_ranks(2, restore_with_late_peer_messages, str(root), str(shm), "late", nodes,
                    str(flags), timeout=150)
    # rank 0's bytes come from rank 1's node; rank 1 reads its own
    assert out == [{case: {"step": step, "tier": tier, "exact": True}
                    for case, step in (("newest", 2), ("step 1", 1))}
                   for tier in ("peer", "memory")]
    assert sorted(os.listdir(flags)) == ["newest", "step 1"]  # rank 0 waited each time
