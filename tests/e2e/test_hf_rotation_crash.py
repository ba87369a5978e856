"""CkptTrainer's checkpoints written in the background meet HF's folder rotation
(``save_total_limit``): a job SIGKILLed at any moment still resumes, because HF's rotation
never deletes the folder of the newest committed checkpoint before the next one is committed.
A ``ckpt_root`` that names a storage URL is refused, not written to a local folder named
after it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

import ckpt

transformers = pytest.importorskip("transformers")
from transformers import TrainerCallback  # noqa: E402

from tests.e2e.test_hf_contract import arguments, data, tiny_model  # noqa: E402
from tests.support.ranks import run_forked  # noqa: E402
from trainer.integrations.hf import CkptTrainer  # noqa: E402

pytestmark = [pytest.mark.slow]

_NEVER = threading.Event()


class _SlowModelWrite(CkptTrainer):
    """The writer thread writes the model of ``checkpoint-2`` slowly (until the training
    loop has made ``checkpoint-4``, or 3 s), and that of ``checkpoint-4`` for ever."""

    def _save(self, output_dir=None, state_dict=None):
        name = os.path.basename(output_dir or "")
        if name == "checkpoint-2":
            later = os.path.join(os.path.dirname(output_dir), "checkpoint-4")
            deadline = time.monotonic() + 3.0
            while not os.path.isdir(later) and time.monotonic() < deadline:
                time.sleep(0.05)
        elif name == "checkpoint-4":
            _NEVER.wait()
        return super()._save(output_dir, state_dict)


class _KillAfterSave(TrainerCallback):
    """SIGKILL this process as soon as the training loop returns from the save of step 4
    (HF's rotation has run; the write of step 4 is in flight)."""

    def on_save(self, args, state, control, **kw):
        if state.global_step == 4:
            os.kill(os.getpid(), signal.SIGKILL)


def _train_killed_while_step_4_is_written(out: str) -> None:
    job = _SlowModelWrite(model=tiny_model(), train_dataset=data(),
                          args=arguments(Path(out), max_steps=6, save_steps=2,
                                         save_total_limit=1),
                          callbacks=[_KillAfterSave()])
    job.train()


def test_sigkill_while_a_checkpoint_is_written_leaves_the_previous_one_to_resume(tmp_path):
    """save_total_limit=1, killed while checkpoint-4 is written in the background: the
    folder of step 2, the newest committed checkpoint, is still there (rotation counts
    only written checkpoints, also when step 2's write is slow) and the resume starts
    from it."""
    out = tmp_path / "out"
    exitcode = run_forked(_train_killed_while_step_4_is_written, str(out))
    assert exitcode == -signal.SIGKILL, f"the job exited {exitcode}, not SIGKILL"
    assert ckpt.inspect.open(tmp_path / ".out.ckpt").steps() == [2]  # step 4 never committed
    assert (out / "checkpoint-2").is_dir(), sorted(p.name for p in out.iterdir())

    starts = []

    class Start(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            starts.append(state.global_step)

    job = CkptTrainer(model=tiny_model(), train_dataset=data(), callbacks=[Start()],
                      args=arguments(out, max_steps=6, save_steps=2, save_total_limit=1))
    job.train(resume_from_checkpoint=True)
    assert starts == [2]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-6"]
    assert ckpt.inspect.open(tmp_path / ".out.ckpt").steps() == [6]


@pytest.mark.parametrize("url", ["s3://bucket/run", "memory://run"])
def test_a_storage_url_as_ckpt_root_is_refused(tmp_path, monkeypatch, url):
    """CkptTrainer's root is a local folder (its resume lists it): a URL is refused with a
    ValueError before anything is written, rather than taken as a relative path (a local
    folder ``s3:/bucket/run`` that the node's disk keeps)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="local folder"):
        CkptTrainer(model=tiny_model(), train_dataset=data(), ckpt_root=url,
                    args=arguments(tmp_path / "out", max_steps=2, save_steps=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
