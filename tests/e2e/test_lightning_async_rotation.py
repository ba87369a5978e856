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
