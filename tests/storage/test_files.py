"""Small files written and opened in directories other users may write to
(storage_backends/files.py): a link, hard link, FIFO or directory planted at a name the job
writes is never written through, waited on or taken for the file."""

from __future__ import annotations

import os
import pickle
import stat
import threading

import pytest

from storage_backends import files
from storage_backends.files import SpecialFileError, atomic_write, open_regular


@pytest.fixture
def victim(tmp_path):
    """A file of the job's user outside the shared directory, which a planted link names."""
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


@pytest.fixture
def shared(tmp_path):
    path = tmp_path / "shared"
    path.mkdir()
    return path


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".part"))


# ------------------------------------------------------------------------------- atomic_write


def test_atomic_write_replaces_the_file_with_exactly_the_mode_asked(shared):
    """The new contents replace the old; the file has the mode asked whatever the umask
    (node_exporter reads a metrics textfile as another user); no temporary is left."""
    path = shared / "summary.json"
    path.write_text("old")
    old_umask = os.umask(0o077)
    try:
        atomic_write(path, "new", 0o644)
    finally:
        os.umask(old_umask)
    assert path.read_text() == "new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert leftovers(shared) == []


def test_atomic_write_replaces_a_link_planted_at_the_name_and_leaves_its_target(shared, victim):
    path = shared / "summary.json"
    path.symlink_to(victim)
    atomic_write(path, b"mine")
    assert victim.read_text() == "precious\n"
    assert not path.is_symlink() and path.read_bytes() == b"mine"


@pytest.mark.parametrize("planted", ["symbolic link", "hard link"])
def test_atomic_write_never_writes_through_an_entry_planted_at_its_temporary_name(
        shared, victim, monkeypatch, planted):
    """The temporary is created exclusively: even an attacker who guessed its random name
    and planted a link there (a hard link shares the victim's bytes) cannot have the write
    land in the victim; the write fails instead."""
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: "0" * (2 * n))
    guessed = shared / f".summary.json.{'0' * 16}.part"
    if planted == "symbolic link":
        guessed.symlink_to(victim)
    else:
        os.link(victim, guessed)
    with pytest.raises(FileExistsError):
        atomic_write(shared / "summary.json", "overwritten")
    assert victim.read_text() == "precious\n"
    assert not (shared / "summary.json").exists()


def test_a_failed_atomic_write_removes_its_temporary(shared):
    (shared / "summary.json").mkdir()  # the rename onto a directory fails
    with pytest.raises(OSError):
        atomic_write(shared / "summary.json", "x")
    assert leftovers(shared) == []


def test_a_durable_atomic_write_syncs_the_file_and_then_its_directory(shared, monkeypatch):
    """durable=True: the file's bytes reach the disk before the rename and the rename
    after it (a power loss leaves the old file or the new, not an empty one)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    atomic_write(shared / "pointer.json", "{}", durable=True)
    assert len(synced) == 2 and synced[0].endswith(".part") and synced[1] == str(shared)
    synced.clear()
    atomic_write(shared / "pointer.json", "{}")
    assert synced == []


# ------------------------------------------------------------------------------- open_regular


APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT


def open_in_a_thread(path) -> object:
    """open_regular's result or error; None when it has not returned (it blocked)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(open_regular(path, APPEND))
        except OSError as e:
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)  # a liveness bound, not a timing assert: a blocked open never returns
    return outcome[0] if outcome else None


def test_open_regular_refuses_a_link_and_leaves_its_target(shared, victim):
    (shared / "rank.jsonl").symlink_to(victim)
    with pytest.raises(SpecialFileError) as info:
        open_regular(shared / "rank.jsonl", APPEND)
    assert info.value.kind == "a symbolic link"
    assert info.value.filename == str(shared / "rank.jsonl")
    assert victim.read_text() == "precious\n"


def test_open_regular_refuses_a_fifo_without_a_reader_rather_than_waiting(shared):
    os.mkfifo(shared / "rank.jsonl")
    outcome = open_in_a_thread(shared / "rank.jsonl")
    assert isinstance(outcome, SpecialFileError), "the open of a FIFO never returned"
    assert outcome.kind == "a FIFO"


def test_open_regular_refuses_a_fifo_someone_reads(shared):
    """A FIFO its planter keeps open for reading opens without blocking: the descriptor's
    type refuses it (records written there would go to the planter)."""
    os.mkfifo(shared / "rank.jsonl")
    reader = os.open(shared / "rank.jsonl", os.O_RDONLY | os.O_NONBLOCK)
    try:
        outcome = open_in_a_thread(shared / "rank.jsonl")
    finally:
        os.close(reader)
    assert isinstance(outcome, SpecialFileError), outcome
    assert outcome.kind == "a FIFO"


def test_open_regular_refuses_a_directory(shared):
    (shared / "rank.jsonl").mkdir()
    with pytest.raises(SpecialFileError) as info:
        open_regular(shared / "rank.jsonl", APPEND)
    assert info.value.kind == "a directory"


def test_open_regular_gives_a_blocking_descriptor_of_a_regular_file(shared):
    """The descriptor is blocking once the check is done (writes of a full pipe or disk
    wait rather than fail half-written with EAGAIN), and appends to the file."""
    path = shared / "rank.jsonl"
    path.write_text("a\n")
    fd = open_regular(path, APPEND)
    try:
        assert os.get_blocking(fd)
        os.write(fd, b"b\n")
    finally:
        os.close(fd)
    assert path.read_text() == "a\nb\n"


def test_the_refusal_pickles_with_its_kind_and_path(shared):
    error = SpecialFileError(shared / "x", "a FIFO")
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), again.kind, again.filename, again.errno) == \
        (SpecialFileError, "a FIFO", str(shared / "x"), error.errno)


def test_atomic_write_under_the_umask_keeps_a_file_private_as_open_would(shared):
    """``umask=True``: the mode less the process's umask (a framework's checkpoint files, which
    its own writes create under the umask, stay private under ``umask 077``)."""
    path = shared / "trainer_state.json"
    old_umask = os.umask(0o077)
    try:
        atomic_write(path, "{}", 0o644, umask=True)
    finally:
        os.umask(old_umask)
    assert path.read_text() == "{}" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert leftovers(shared) == []


def test_fsync_dir_is_one_function_shared_with_the_posix_storage():
    """The durability step of a directory is written once: the POSIX storage uses the file
    helpers' ``fsync_dir`` (the helpers import nothing of the package, so no cycle)."""
    from storage_backends import files, posix

    assert posix.fsync_dir is files.fsync_dir
    assert "fsync_dir" in files.__all__
