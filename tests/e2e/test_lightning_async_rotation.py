"""CkptCheckpointIO meets a SIGKILL in the middle of a write: with async_save=True the file
Lightning's top-k rotation drops is removed only once the checkpoint that replaces it is
committed, so the folder still holds a ``.ckpt`` to resume from; the hidden temporary file
the killed write left is removed by the next save into the folder.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

import ckpt

L = pytest.importorskip("lightning")

from tests.e2e.test_lightning_contract import Net, data, trainer  # noqa: E402
from tests.support.ranks import run_forked  # noqa: E402
from trainer.integrations import _pl_file as plf  # noqa: E402
from trainer.integrations.lightning import CkptCheckpointIO  # noqa: E402

pytestmark = [pytest.mark.slow]

_NEVER = threading.Event()


class _StuckAtStep4(CkptCheckpointIO):
    """Step 4's file is written (in the writer thread) for ever; the process is SIGKILLed
    as soon as Lightning's rotation has asked to remove the file it replaces."""

    @staticmethod
    def _write(store, checkpoint, saved):
        if saved.step == 4:
            _NEVER.wait()
        return CkptCheckpointIO._write(store, checkpoint, saved)

    def remove_checkpoint(self, path):
        super().remove_checkpoint(path)
        os.kill(os.getpid(), signal.SIGKILL)


def _fit_killed_while_step_4_is_written(folder: str) -> None:
    trainer(_StuckAtStep4(async_save=True), steps=6, dirpath=folder, every_n_train_steps=2,
            save_top_k=1, monitor="step", mode="max").fit(Net(), data())


def test_sigkill_while_the_replacing_checkpoint_is_written_keeps_the_dropped_file(tmp_path):
    """save_top_k=1, async: Lightning drops epoch=0-step=2.ckpt as soon as step 4's save is
    handed over; killed while step 4 is written, the folder still holds step 2's file,
    which loads (checked against its step) and resumes the fit."""
    folder = tmp_path / "ckpts"
    exitcode = run_forked(_fit_killed_while_step_4_is_written, str(folder))
    assert exitcode == -signal.SIGKILL, f"the fit exited {exitcode}, not SIGKILL"
    assert ckpt.inspect.open(tmp_path / ".ckpts.ckpt").steps() == [2]
    kept = folder / "epoch=0-step=2.ckpt"
    assert kept.is_file(), sorted(p.name for p in folder.iterdir())

    assert CkptCheckpointIO().load_checkpoint(kept)["global_step"] == 2
    resumed = trainer(True, steps=6, dirpath=folder, every_n_train_steps=2, save_top_k=1,
                      monitor="step", mode="max")
    resumed.fit(Net(), data(), ckpt_path=str(kept))
    assert resumed.global_step == 6
    assert (folder / "epoch=1-step=6.ckpt").is_file()


class _KilledBeforeRename(CkptCheckpointIO):
    """SIGKILLed once step 4 is committed, before its file is renamed into place (the
    hidden temporary file, as large as the checkpoint, is left in the folder)."""

    @staticmethod
    def _write(store, checkpoint, saved):
        if saved.step == 4:
            plf.publish = _kill_self
        return CkptCheckpointIO._write(store, checkpoint, saved)


def _kill_self(*args):
    os.kill(os.getpid(), signal.SIGKILL)


def _fit_killed_before_step_4_is_renamed(folder: str) -> None:
    trainer(_KilledBeforeRename(), steps=6, dirpath=folder, every_n_train_steps=2,
            save_top_k=1, monitor="step", mode="max").fit(Net(), data())


def test_the_temporary_file_of_a_killed_write_is_removed_by_the_next_save(tmp_path):
    folder = tmp_path / "ckpts"
    exitcode = run_forked(_fit_killed_before_step_4_is_renamed, str(folder))
    assert exitcode == -signal.SIGKILL, f"the fit exited {exitcode}, not SIGKILL"
    left = [p.name for p in folder.iterdir() if p.name.endswith(".part")]
    assert len(left) == 1, sorted(p.name for p in folder.iterdir())

    resumed = trainer(True, steps=6, dirpath=folder, every_n_train_steps=2, save_top_k=1,
                      monitor="step", mode="max")
    resumed.fit(Net(), data(), ckpt_path=str(folder / "epoch=0-step=2.ckpt"))
    assert resumed.global_step == 6
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


class _KilledOnceLastLinksToStep4(CkptCheckpointIO):
    """SIGKILLed while step 4's file is written in the background, as soon as Lightning has
    linked last.ckpt to it (``save_last="link"``: the link is made when the save returns)."""

    @staticmethod
    def _write(store, checkpoint, saved):
        if saved.step == 4:
            last = os.path.join(os.path.dirname(saved.path), "last.ckpt")
            while not (os.path.islink(last) and os.readlink(last) == "epoch=0-step=4.ckpt"):
                _NEVER.wait(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        return CkptCheckpointIO._write(store, checkpoint, saved)


def _fit_killed_once_last_links_to_step_4(folder: str) -> None:
    trainer(_KilledOnceLastLinksToStep4(async_save=True), steps=6, dirpath=folder,
            every_n_train_steps=2, save_top_k=1, monitor="step", mode="max",
            save_last="link").fit(Net(), data())


class _StartingStep(L.Callback):
    def on_train_start(self, trainer, module):
        self.step = trainer.global_step


def test_a_last_link_made_during_a_background_write_resumes_from_the_step_before(tmp_path):
    """save_last="link", async: Lightning links last.ckpt to step 4's file as soon as the
    save returns. Killed while that file is written, the link names the place held for it,
    so fit(ckpt_path="last") resumes from step 2 (not from step 0, as a link naming no file
    makes Lightning do); the next write of the folder leaves no such place behind."""
    folder = tmp_path / "ckpts"
    exitcode = run_forked(_fit_killed_once_last_links_to_step_4, str(folder))
    assert exitcode == -signal.SIGKILL, f"the fit exited {exitcode}, not SIGKILL"
    assert ckpt.inspect.open(tmp_path / ".ckpts.ckpt").steps() == [2]
    assert os.readlink(folder / "last.ckpt") == "epoch=0-step=4.ckpt"
    assert plf.is_reservation(str(folder / "epoch=0-step=4.ckpt"))

    started = _StartingStep()
    resumed = trainer(CkptCheckpointIO(async_save=True), steps=6, dirpath=folder,
                      extra=[started], every_n_train_steps=2, save_top_k=1, monitor="step",
                      mode="max", save_last="link")
    resumed.fit(Net(), data(), ckpt_path="last")
    assert started.step == 2
    assert resumed.global_step == 6
    assert not any(plf.is_reservation(str(p)) for p in folder.iterdir())
    assert CkptCheckpointIO().load_checkpoint(folder / "last.ckpt")["global_step"] == 6


def test_the_place_a_killed_write_held_is_removed_once_the_next_file_is_written(tmp_path):
    """A place held for a write that died, under a name the resumed run does not write
    again, goes once the next file of the folder is in place."""
    folder = tmp_path / "ckpts"
    folder.mkdir()
    stale = folder / "epoch=0-step=4.ckpt"
    plf.reserve(str(stale), 4)
    plf.reserve(str(stale), 9)  # a file is there: left as it is
    assert plf.claim(str(stale)) == 4 and plf.is_reservation(str(stale))
    trainer(CkptCheckpointIO(async_save=True), steps=2, dirpath=folder,
            every_n_train_steps=2).fit(Net(), data())
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt"]
