"""An Accelerate training loop for tests/e2e/test_integrations.py (run as a subprocess).

    python acc_job.py kill WORK     # CkptAccelerator; SIGKILLs itself at step 7, after
                                     # the save of step 6 (iteration 2) returned
    python acc_job.py resume WORK   # resumes WORK/acc and WORK/acc_bad through ckpt; runs the
                                     # same loop with Accelerate's own save_state, stopped after
                                     # steps 6 and 4 and resumed. Results in WORK/out/.
    python acc_job.py kill+resume WORK  # both (one import): kill runs in a forked child,
                                     # resume once the test writes go (tests/support/fork_kill.py)
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration, set_seed  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from tests.support.fork_kill import kill_then_wait  # noqa: E402
from trainer.integrations.accelerate import CkptAccelerator  # noqa: E402

MAX_STEPS = 12


class Progress:
    """A user counter registered with register_for_checkpointing."""

    def __init__(self) -> None:
        self.step = 0
        self.saves = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "saves": self.saves}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.saves = state["step"], state["saves"]


class Stop(Exception):
    pass


def run(project: Path, cls: type, *, resume: bool = False, kill_at: int | None = None,
        stop_at: int | None = None) -> tuple[GPT2LMHeadModel, int]:
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97,
                                       n_positions=16))
    ids = torch.randint(0, 97, (48, 16), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(ids, batch_size=8, shuffle=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    acc = cls(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=2))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    if resume:
        acc.load_state()
        acc.project_configuration.iteration = progress.saves
    start = progress.step
    try:
        while progress.step < MAX_STEPS:
            skip = progress.step % len(loader)
            for batch in acc.skip_first_batches(loader, skip) if skip else loader:
                loss = model(batch, labels=batch).loss
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                progress.step += 1
                if progress.step % 2 == 0:
                    progress.saves += 1
                    acc.save_state()
                if progress.step == kill_at:
                    i = progress.saves - 1  # save_state returned with the step committed
                    assert (project / f"checkpoints/checkpoint_{i}/step-{i:08d}/manifest.json"
                            ).exists()
                    os.kill(os.getpid(), signal.SIGKILL)
                if progress.step == stop_at:
                    raise Stop
                if progress.step == MAX_STEPS:
                    break
    except Stop:
        pass
    if isinstance(acc, CkptAccelerator):
        acc.wait_for_checkpoints()
    return acc.unwrap_model(model), start


def main() -> None:
    torch.set_num_threads(1)
    mode, work = sys.argv[1], Path(sys.argv[2])

    def killed_run() -> None:
        run(work / "acc", CkptAccelerator, kill_at=7)

    if mode == "kill":
        killed_run()
        raise SystemExit("not killed")
    if mode == "kill+resume":  # both in one process: the killed run in a forked child
        kill_then_wait(killed_run)
        mode = "resume"
    out = work / "out"
    out.mkdir(exist_ok=True)
    starts = {}
    for name, cls, project, stop in (("ckpt", CkptAccelerator, work / "acc", None),
                                     ("ckpt_bad", CkptAccelerator, work / "acc_bad", None),
                                     ("acc6", Accelerator, work / "ref6", 7),
                                     ("acc4", Accelerator, work / "ref4", 5)):
        if stop is not None:  # Accelerate's own save_state: stop after step `stop`, resume
            run(project, cls, stop_at=stop)
        model, starts[name] = run(project, cls, resume=True)
        torch.save(model.state_dict(), out / f"{name}.pt")
    (out / "starts.json").write_text(json.dumps(starts))


if __name__ == "__main__":
    main()
