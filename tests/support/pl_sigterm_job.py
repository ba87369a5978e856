"""A Lightning fit whose checkpoint of one step is slow to write, for SIGTERM tests (run as a
subprocess by tests/e2e/test_lightning_sigterm.py).

    python pl_sigterm_job.py WORK NAME:SLOW_S:TIMEOUT_S[:sync] ...

One fit per NAME, each in a child forked after the imports (Lightning's import is most of a
job's CPU time): ``CkptCheckpointIO(async_save=True, schedule=ckpt.Schedule(
handle_sigterm=True), sigterm_timeout=TIMEOUT_S)``, a checkpoint every 2 steps into
WORK/NAME/ckpts. The write of step 4 (in the plugin's writer thread) first creates
WORK/NAME/writing-4, then sleeps SLOW_S seconds (a slow disk); the test sends SIGTERM to the
pid in WORK/NAME/pid once that file exists. Training goes on meanwhile (up to 10,000 steps),
so the signal finds the loop running or waiting for the write. ``:sync``: ``async_save=False``
(the write, and its sleep, in the training thread). Each child's exit status is written to
WORK/NAME/rc.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import ckpt  # noqa: E402
from trainer.integrations import _pl_file  # noqa: E402
from trainer.integrations.lightning import CkptCheckpointIO  # noqa: E402

SLOW_STEP = 4


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(work: Path, slow_s: float, timeout_s: float, asynchronous: bool = True) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
    write = _pl_file.write

    def slow_write(checkpoint, path, step):
        if step == SLOW_STEP:
            (work / f"writing-{step}").touch()
            time.sleep(slow_s)
        return write(checkpoint, path, step)

    _pl_file.write = slow_write
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)
    io = CkptCheckpointIO(async_save=asynchronous, schedule=ckpt.Schedule(handle_sigterm=True),
                          sigterm_timeout=timeout_s)
    L.Trainer(max_steps=10_000, accelerator="cpu", logger=False, enable_progress_bar=False,
              enable_model_summary=False, plugins=[io],
              callbacks=[ModelCheckpoint(dirpath=work / "ckpts", every_n_train_steps=2,
                                         save_top_k=-1)]).fit(Net(), data)


def child(work: Path, slow_s: float, timeout_s: float, asynchronous: bool) -> None:
    """Run one fit in this forked child and leave with its status, never returning into
    the parent's code."""
    code = 0
    try:
        main(work, slow_s, timeout_s, asynchronous)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported, then the status says it
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    root, pids = Path(sys.argv[1]), {}
    for spec in sys.argv[2:]:
        name, slow, timeout, *mode = spec.split(":")
        work = root / name
        work.mkdir(parents=True)
        pid = os.fork()
        if pid == 0:
            child(work, float(slow), float(timeout), mode != ["sync"])
        (work / "pid").write_text(str(pid))
        pids[pid] = work
    for pid, work in pids.items():
        _, status = os.waitpid(pid, 0)
        (work / "rc").write_text(str(os.waitstatus_to_exitcode(status)))
