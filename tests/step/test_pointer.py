"""Pointer files (ckpt._step.pointer): what the CLI follows must be a small regular file, read
without following a link or blocking on a FIFO (the round trip, links and malformed
pointers: tests/trainer/test_integration_steps.py)."""

from __future__ import annotations

import os
import threading

import pytest

from ckpt._step.pointer import MAX_POINTER_BYTES, POINTER_FORMAT, read_pointer, write_pointer


def test_a_fifo_is_not_a_pointer_and_does_not_block(tmp_path):
    fifo = tmp_path / "last.ckpt"
    os.mkfifo(fifo)
    result = []
    reader = threading.Thread(target=lambda: result.append(read_pointer(str(fifo))),
                              daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the thread (a writer end opens the FIFO) before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not reader.is_alive(), "read_pointer blocked on a FIFO"
    assert result == [None]
    # A FIFO holding a pointer's bytes is still no pointer (only regular files are read).
    keep = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(writer, f'{{"format": "{POINTER_FORMAT}", "step": 5}}'.encode())
        assert read_pointer(str(fifo)) is None
    finally:
        os.close(writer)
        os.close(keep)


def test_a_directory_or_an_oversized_file_is_not_a_pointer(tmp_path):
    assert read_pointer(str(tmp_path)) is None
    big = tmp_path / "big.ckpt"
    doc = f'{{"format": "{POINTER_FORMAT}", "step": 1}}'
    big.write_text(doc + " " * (MAX_POINTER_BYTES + 1 - len(doc)))
    assert read_pointer(str(big)) is None
    big.write_text(doc)
    assert read_pointer(str(big)) == 1


def test_a_pointer_names_a_whole_non_negative_step(tmp_path):
    path = tmp_path / "last.ckpt"
    for step in ("-1", "1.5", "true", '"7"'):
        path.write_text(f'{{"format": "{POINTER_FORMAT}", "step": {step}}}')
        assert read_pointer(str(path)) is None, step
    path.write_text('{"format": "other", "step": 1}')
    assert read_pointer(str(path)) is None


def test_a_written_pointer_is_durable_after_its_rename(tmp_path, monkeypatch):
    """The rename that publishes a pointer is made durable by an fsync of its folder,
    after the rename (else a power loss can bring back the previous step's pointer): the
    pointer is written by the shared ``atomic_write(durable=True)``."""
    from storage_backends import files

    events = []
    real_replace, real_fsync_dir = os.replace, files.fsync_dir
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"),
                                                     real_replace(a, b))[1])
    monkeypatch.setattr(files, "fsync_dir", lambda d: (events.append(("fsync_dir", d)),
                                                       real_fsync_dir(d))[1])
    write_pointer(str(tmp_path / "last.ckpt"), 7)
    assert events == ["replace", ("fsync_dir", str(tmp_path))]
    assert read_pointer(str(tmp_path / "last.ckpt")) == 7


def test_a_pointer_is_created_under_the_umask(tmp_path):
    """A pointer is readable as the process's umask allows, as ``open`` creates files: under
    ``umask 077`` it stays private."""
    old = os.umask(0o077)
    try:
        write_pointer(str(tmp_path / "private.ckpt"), 1)
    finally:
        os.umask(old)
    write_pointer(str(tmp_path / "shared.ckpt"), 1)
    assert (tmp_path / "private.ckpt").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "shared.ckpt").stat().st_mode & 0o777 == 0o644 & ~old


def test_a_link_planted_at_a_temp_name_redirects_no_write(tmp_path):
    """Another user who can write into the folder plants a link where a predictable temp
    name would be: the pointer is still written to its own path, and the file the link points
    at is left as it was (the temp file is created exclusively, under an unguessable name,
    never through a link)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "out"
    folder.mkdir()
    os.symlink(victim, folder / f".last.ckpt.{os.getpid()}.part")
    write_pointer(str(folder / "last.ckpt"), 7)
    assert victim.read_text() == "precious"
    assert read_pointer(str(folder / "last.ckpt")) == 7
    assert not [p for p in os.listdir(folder) if p.endswith(".part") and
                not os.path.islink(folder / p)]


def test_a_pointer_write_that_fails_leaves_no_temp_file(tmp_path, monkeypatch):
    """A pointer whose rename fails raises, and its temp file is removed, not left behind."""
    def refuse(a, b):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        write_pointer(str(tmp_path / "last.ckpt"), 3)
    assert os.listdir(tmp_path) == []
