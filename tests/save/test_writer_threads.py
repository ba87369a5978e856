"""Writer threads: how many write a background save (the cores training leaves free, unless
``write_threads`` is given), that they run below training's priority, and that the bytes
saved are the same whatever their number."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import ckpt
import ckpt._save.concurrency as concurrency
from ckpt._save.concurrency import cores_available, writer_threads
from storage_backends import PosixStorage

CHUNK = 16 << 10  # several chunks per tensor, so more files than one can be written


def state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(256, 64, generator=gen), "b": torch.randn(4096, generator=gen),
            "h": torch.randn(64, 64, generator=gen).half()}


def save_once(root, options: ckpt.SaveOptions, tensors: dict) -> ckpt.SaveResult:
    with ckpt.CheckpointManager(root, async_save=True, options=options) as mgr:
        return mgr.save(1, tensors).wait()


@pytest.fixture
def torch_threads():
    """Set torch's intra-op threads for one test; the test's count is restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def one_cpu():
    """This thread pinned to one CPU (a real affinity mask), the old mask restored after."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    yield
    os.sched_setaffinity(0, before)


# -------------------------------------------------------------- how many threads


def test_cores_come_from_the_affinity_mask_not_the_machine(one_cpu):
    assert cores_available() == 1 <= os.cpu_count()


def test_a_cpu_save_gets_the_cores_training_leaves_free(monkeypatch, torch_threads):
    monkeypatch.setattr(concurrency, "cores_available", lambda: 8)
    options = ckpt.SaveOptions()  # the default: chosen per save, at most default_threads()
    most = options.write_threads
    torch_threads(6)
    assert writer_threads(options, from_gpu=False) == min(most, 2)
    torch_threads(8)  # training takes every core: one writer thread still writes
    assert writer_threads(options, from_gpu=False) == 1
    torch_threads(1)  # seven free cores: no more than the default's count
    assert writer_threads(options, from_gpu=False) == most


def test_a_save_staged_from_a_gpu_or_to_an_object_store_gets_every_writer_thread(
        monkeypatch, torch_threads):
    monkeypatch.setattr(concurrency, "cores_available", lambda: 2)
    torch_threads(2)
    options = ckpt.SaveOptions()
    assert writer_threads(options, from_gpu=True) == options.write_threads
    assert writer_threads(options, from_gpu=False, requests=True) == options.write_threads
    assert writer_threads(options, from_gpu=False) == 1


def test_an_explicit_write_threads_is_used_as_given(monkeypatch, torch_threads):
    monkeypatch.setattr(concurrency, "cores_available", lambda: 2)
    torch_threads(2)
    for n in (1, 3, 7):
        assert writer_threads(ckpt.SaveOptions(write_threads=n), from_gpu=False) == n


def test_the_default_survives_replacing_another_field_and_pickling():
    """Options rebuilt with another field changed (as the manager's keywords do) or sent to
    another process keep the default chosen per save, which reads as a plain number; an int
    the caller passed is not the default."""
    import dataclasses
    import pickle

    from ckpt.options import chosen_threads

    default = ckpt.SaveOptions()
    assert chosen_threads(default.write_threads)
    assert chosen_threads(dataclasses.replace(default, incremental=True).write_threads)
    assert chosen_threads(pickle.loads(pickle.dumps(default)).write_threads)
    number = str(int(default.write_threads))
    assert str(default.write_threads) == f"{default.write_threads}" == number
    default = int(ckpt.SaveOptions().write_threads)
    assert not chosen_threads(ckpt.SaveOptions(write_threads=default).write_threads)


def test_a_busy_machine_writes_one_file_and_an_explicit_count_its_own(
        tmp_path, monkeypatch, torch_threads):
    """What a save writes follows the policy: one data file per writer thread."""
    monkeypatch.setattr(concurrency, "cores_available", lambda: 2)
    torch_threads(2)  # training uses both cores
    chosen = save_once(tmp_path / "chosen", ckpt.SaveOptions(chunk_bytes=CHUNK), state())
    explicit = save_once(tmp_path / "explicit",
                         ckpt.SaveOptions(chunk_bytes=CHUNK, write_threads=3), state())
    monkeypatch.setattr(concurrency, "cores_available", lambda: 6)  # four cores free
    free = save_once(tmp_path / "free", ckpt.SaveOptions(chunk_bytes=CHUNK), state())
    assert (chosen.files, explicit.files) == (1, 3)
    assert free.files == ckpt.SaveOptions().write_threads


def test_ckpt_save_with_the_defaults_number_given_explicitly_writes_that_many_files(
        tmp_path, monkeypatch, torch_threads):
    """ckpt.save reuses its module-level writer while the options are the same: an explicit
    write_threads equal to the default's number is not the default, and is used as given."""
    monkeypatch.setattr(concurrency, "cores_available", lambda: 2)
    torch_threads(2)  # training uses both cores: the default writes one file
    default = int(ckpt.SaveOptions().write_threads)
    if default < 2:
        pytest.skip("one CPU: the default is one thread either way")
    ckpt.save(state(), tmp_path / "chosen", options=ckpt.SaveOptions(chunk_bytes=CHUNK))
    ckpt.save(state(), tmp_path / "explicit",
              options=ckpt.SaveOptions(chunk_bytes=CHUNK, write_threads=default))
    files = {name: len(list((tmp_path / name).glob("*.safetensors")))
             for name in ("chosen", "explicit")}
    assert files == {"chosen": 1, "explicit": default}, files


class RequestStorage(PosixStorage):
    """A file system that reads like an object store: no streamed blocks, each read a
    request (what S3 and tensorstore backends declare)."""

    stream_block = None


def test_a_save_to_an_object_store_writes_with_every_thread(tmp_path, monkeypatch,
                                                             torch_threads):
    monkeypatch.setattr(concurrency, "cores_available", lambda: 2)
    torch_threads(2)  # no core free: a file system root would get one writer thread
    (tmp_path / "r").mkdir()
    result = save_once(RequestStorage(str(tmp_path / "r")), ckpt.SaveOptions(chunk_bytes=CHUNK),
                       state())
    assert result.files == ckpt.SaveOptions().write_threads


def chunk_digests(root) -> dict:
    """Per tensor: (offsets, shape, digest) of each chunk, whatever file it landed in."""
    manifest = ckpt.inspect.open(root).manifest(1)
    return {key: sorted((c.offsets, c.shape, c.digest) for c in entry.chunks)
            for key, entry in manifest.tensors.items()}


def test_the_bytes_saved_are_the_same_whatever_the_thread_count(tmp_path):
    tensors = state()
    saved = {}
    for n in (1, 2, 3):
        root = tmp_path / f"threads{n}"
        result = save_once(root, ckpt.SaveOptions(chunk_bytes=CHUNK, write_threads=n), tensors)
        assert result.files == n
        out = {k: torch.zeros_like(v) for k, v in tensors.items()}
        with ckpt.CheckpointManager(root, read_only=True) as mgr:
            assert mgr.restore(out) == 1
        assert all(torch.equal(out[k], tensors[k]) for k in tensors), n
        saved[n] = chunk_digests(root)
    assert saved[1] == saved[2] == saved[3]


# -------------------------------------------------------------- priority


def nice_of_writes(monkeypatch) -> list[tuple[int, int]]:
    """(thread id, nice) of each storage write, as it happens."""
    seen: list[tuple[int, int]] = []
    original = PosixStorage.write

    def write(self, path, buffers):
        tid = threading.get_native_id()
        seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))
        return original(self, path, buffers)

    monkeypatch.setattr(PosixStorage, "write", write)
    return seen


@pytest.mark.skipif(not os.sys.platform.startswith("linux"), reason="per-thread nice: Linux")
@pytest.mark.parametrize("threads", [1, 3])
def test_writer_threads_run_below_training_and_training_keeps_its_priority(
        tmp_path, monkeypatch, threads):
    seen = nice_of_writes(monkeypatch)
    me = threading.get_native_id()
    mine = os.getpriority(os.PRIO_PROCESS, me)
    save_once(tmp_path / "r", ckpt.SaveOptions(chunk_bytes=CHUNK, write_threads=threads,
                                               writer_nice=7), state())
    assert seen and all(tid != me for tid, _ in seen)
    assert {nice for _, nice in seen} == {min(19, mine + 7)}
    assert os.getpriority(os.PRIO_PROCESS, me) == mine


def test_writer_nice_zero_leaves_the_priority_alone(tmp_path, monkeypatch):
    seen = nice_of_writes(monkeypatch)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    save_once(tmp_path / "r", ckpt.SaveOptions(chunk_bytes=CHUNK, write_threads=2,
                                               writer_nice=0), state())
    assert seen and {nice for _, nice in seen} == {mine}


@pytest.mark.parametrize("bad", [{"writer_nice": -1}, {"writer_nice": 20},
                                 {"writer_nice": True}, {"write_threads": 0},
                                 {"write_threads": True}, {"write_threads": 2.5}])
def test_bad_thread_options_are_refused_with_the_field_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ckpt.SaveOptions(**bad)
