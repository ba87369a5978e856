"""A real SIGTERM to a real Lightning fit whose plugin writes in the background
(``CkptCheckpointIO(async_save=True, schedule=ckpt.Schedule(handle_sigterm=True))``): the
process waits for the ``.ckpt`` in flight to commit, logs it, and exits 143; past
``sigterm_timeout`` it exits without it, the previous checkpoint whole; a synchronous save
(``async_save=False``) finishes, then the process exits 143.

The write of step 4 is made slow in the job (tests/support/pl_sigterm_job.py); the signal
is sent once that write has started. Both fits run side by side, forked from one process
after Lightning's import.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from trainer.integrations.lightning import CkptCheckpointIO  # noqa: E402
from verify.cli import main as ckpt_cli  # noqa: E402
from verify.lightning_file import is_reservation  # noqa: E402

JOB = Path(__file__).resolve().parents[1] / "support" / "pl_sigterm_job.py"


def sigterm_once_writing(job: subprocess.Popen, work: Path) -> None:
    """SIGTERM the fit in ``work`` once its write of step 4 has started."""
    deadline = time.monotonic() + 300
    while not (work / "writing-4").exists():
        assert job.poll() is None, job.communicate()[0]
        assert time.monotonic() < deadline, "the job never reached the save of step 4"
        time.sleep(0.05)
    os.kill(int((work / "pid").read_text()), signal.SIGTERM)


def test_sigterm_waits_for_the_ckpt_in_flight_then_exits_143(tmp_path, capsys):
    """``waits``: a 3 s write, a 60 s bound; ``gives_up``: a 120 s write, a 1 s bound;
    ``sync``: a 3 s write in the training thread (``async_save=False``)."""
    job = subprocess.Popen([sys.executable, str(JOB), str(tmp_path), "waits:3:60",
                            "gives_up:120:1", "sync:3:60:sync"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        for name in ("waits", "gives_up", "sync"):
            sigterm_once_writing(job, tmp_path / name)
        out = job.communicate(timeout=300)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out
    waits, gives_up = tmp_path / "waits", tmp_path / "gives_up"
    # within the bound: the save in flight is committed, its file checks against its step
    assert (waits / "rc").read_text() == "143", out
    assert f"waiting up to 60 s for the checkpoint in flight (step 4, {waits}" in out
    assert f"step 4, {waits}/ckpts/epoch=0-step=4.ckpt committed after" in out
    files = sorted(os.listdir(waits / "ckpts"))
    assert "epoch=0-step=4.ckpt" in files, files
    assert ckpt_cli(["verify", str(waits / "ckpts" / "epoch=0-step=4.ckpt")]) == 0
    # past the bound: exits without it; the previous checkpoint stays whole
    assert (gives_up / "rc").read_text() == "143", out
    assert f"step 4, {gives_up}/ckpts/epoch=0-step=4.ckpt not committed after 1 s " \
        "(sigterm_timeout)" in out
    # (step 4's name holds the place of its file: loading it falls back to step 2)
    files = sorted(f for f in os.listdir(gives_up / "ckpts") if not f.startswith("."))
    assert files == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"], files
    assert ckpt_cli(["verify", str(gives_up / "ckpts" / files[0])]) == 0
    assert is_reservation(str(gives_up / "ckpts" / files[1]))
    held = CkptCheckpointIO().load_checkpoint(gives_up / "ckpts" / files[1])
    assert held["global_step"] == 2
    # a synchronous save in the training thread: it finishes, then the process exits
    sync = tmp_path / "sync"
    assert (sync / "rc").read_text() == "143", out
    assert f"SIGTERM during the save of step 4, {sync}" in out
    assert ckpt_cli(["verify", str(sync / "ckpts" / "epoch=0-step=4.ckpt")]) == 0
    capsys.readouterr()


def test_sigterm_as_the_background_write_starts_waits_for_it(tmp_path, monkeypatch):
    """A SIGTERM that lands the moment the plugin's writer thread has begun (before
    ``save_checkpoint`` returns) is ckpt's: the write is waited for and committed, the
    process exits 143; Lightning's handler, in place between writes, never sees it."""
    import ckpt
    from trainer.integrations import lightning as pl_io

    submit = pl_io.FolderWriter.submit

    def submit_then_sigterm(writer, job):
        submit(writer, job)
        signal.raise_signal(signal.SIGTERM)  # its handler runs in this thread, now

    monkeypatch.setattr(pl_io.FolderWriter, "submit", submit_then_sigterm)
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        io = pl_io.CkptCheckpointIO(schedule=ckpt.Schedule(handle_sigterm=True),
                                    async_save=True)
        path = tmp_path / "ckpts" / "epoch=0-step=2.ckpt"
        with pytest.raises(SystemExit) as exited:
            io.save_checkpoint({"global_step": 2, "w": torch.ones(3)}, path)
        assert exited.value.code == 143
        assert seen == []  # the handler in place between writes was not the one called
        assert ckpt_cli(["verify", str(path)]) == 0  # committed before the exit
        io.teardown()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_exit_a_finalizer_ignores_is_raised_again_where_it_propagates():
    """The handler runs wherever the main thread is, also inside a weakref callback (a
    collection the training loop set off), where Python prints an exception as ignored and
    goes on: the fit would train on. The guard sends the signal again, and the exit
    propagates."""
    from trainer.integrations._pl_sigterm import SigtermGuard

    previous = signal.getsignal(signal.SIGTERM)
    guard = SigtermGuard(5)
    guard.arm("step 4", None)
    guard.hand_off(lambda timeout: (True, None))  # the write in flight has committed

    class Held:
        pass

    def callback(_):
        signal.raise_signal(signal.SIGTERM)
        for _ in range(1000):  # the handler runs here, inside the callback
            pass

    held = Held()
    ref = weakref.ref(held, callback)
    try:
        with pytest.raises(SystemExit) as exited:
            del held
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.01)
        assert exited.value.code == 143
        assert ref() is None
    finally:
        signal.signal(signal.SIGTERM, previous)
