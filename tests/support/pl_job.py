"""A Lightning training job for tests/e2e/test_integrations.py (run as a subprocess).

    python pl_job.py kill WORK      # ckpt IO; SIGKILLs itself at step 7 (step 6 committed)
    python pl_job.py resume WORK    # resumes WORK/pl and WORK/pl_bad through ckpt, runs the
                                     # same job through Lightning's own IO resumed from steps
                                     # 6 and 4; final weights go to WORK/out/*.pt
    python pl_job.py kill+resume WORK  # both (one import): kill runs in a forked child,
                                     # resume once the test writes go (tests/support/fork_kill.py)
    python pl_job.py ddp WORK       # DDP on 2 CPU processes: train to 6 and resume to 12,
                                     # through ckpt and through Lightning's own IO
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from tests.support.fork_kill import kill_then_wait  # noqa: E402
from trainer.integrations.lightning import CkptCheckpointIO  # noqa: E402

MAX_STEPS = 12


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)


class KillAt(Callback):
    """SIGKILL this process after step ``at`` (step ``committed`` is on disk)."""

    def __init__(self, at: int, committed: Path) -> None:
        self.at, self.committed = at, committed

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at:
            assert self.committed.exists()  # the save returned with its step committed
            os.kill(os.getpid(), signal.SIGKILL)


class StartStep(Callback):
    def __init__(self) -> None:
        self.step = None

    def on_train_start(self, trainer, *args) -> None:
        self.step = trainer.global_step


def fit(dirpath: Path, *, ckpt_io: bool, max_steps: int = MAX_STEPS, resume: bool = False,
        extra: list | None = None, devices: int = 1) -> tuple[Net, int | None]:
    L.seed_everything(0, verbose=False)
    model = Net()
    start = StartStep()
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=devices, logger=False,
        strategy="ddp" if devices > 1 else "auto",
        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        plugins=[CkptCheckpointIO()] if ckpt_io else None,
        callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=2,
                                   monitor="step", mode="max", save_last=True),
                   start, *(extra or [])])
    trainer.fit(model, loader(), ckpt_path="last" if resume else None)
    return model, start.step


def main() -> None:
    torch.set_num_threads(1)
    mode, work = sys.argv[1], Path(sys.argv[2])

    def killed_run() -> None:
        fit(work / "pl", ckpt_io=True,
            extra=[KillAt(7, work / ".pl.ckpt/step-00000006/manifest.json")])

    if mode == "kill":
        killed_run()
        raise SystemExit("not killed")
    if mode == "kill+resume":  # both in one process: the killed run in a forked child
        kill_then_wait(killed_run)
        mode = "resume"
    out = work / "out"
    out.mkdir(exist_ok=True)
    if mode == "ddp":
        starts = {}
        for name, ckpt_io in (("ckpt", True), ("torch", False)):
            fit(work / f"ddp_{name}", ckpt_io=ckpt_io, max_steps=6, devices=2)
            model, starts[name] = fit(work / f"ddp_{name}", ckpt_io=ckpt_io, resume=True,
                                      devices=2)
            if model.global_rank == 0:
                torch.save(model.state_dict(), out / f"ddp_{name}.pt")
        if model.global_rank == 0:
            (out / "ddp_starts.json").write_text(json.dumps(starts))
        return
    starts = {}
    for name, ckpt_io, dirpath, stop in (("ckpt", True, work / "pl", None),
                                         ("ckpt_bad", True, work / "pl_bad", None),
                                         ("torch6", False, work / "ref6", 6),
                                         ("torch4", False, work / "ref4", 4)):
        if stop is not None:  # Lightning's own IO: train to the step, resume from it
            fit(dirpath, ckpt_io=False, max_steps=stop)
        model, starts[name] = fit(dirpath, ckpt_io=ckpt_io, resume=True)
        torch.save(model.state_dict(), out / f"{name}.pt")
    (out / "starts.json").write_text(json.dumps(starts))


if __name__ == "__main__":
    main()
