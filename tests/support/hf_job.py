"""A Hugging Face Trainer job for tests/e2e/test_integrations.py (run as a subprocess).

    python hf_job.py kill WORK      # CkptTrainer; SIGKILLs itself at step 7 once 6 committed
    python hf_job.py resume WORK    # resumes WORK/hf and WORK/hf_bad through ckpt; runs the
                                     # same job with HF's own checkpoints, stopped after steps
                                     # 6 and 4 and resumed; loads WORK/hf/checkpoint-12 with
                                     # from_pretrained. Results in WORK/out/.
    python hf_job.py jit WORK       # HF's Trainer, then CkptTrainer, with enable_jit_checkpoint:
                                     # SIGTERM after the first save; WORK/out/jit.json says
                                     # where each stopped (tests/e2e/test_hf_contract.py runs
                                     # it as jit_forked, in a process of the fork server)
    python hf_job.py kill+resume WORK  # both (one import): kill runs in a forked child,
                                     # resume once the test writes go (tests/support/fork_kill.py)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          Trainer, TrainerCallback, TrainingArguments)

from tests.support.fork_kill import kill_then_wait  # noqa: E402
from trainer.integrations.hf import CkptTrainer  # noqa: E402

MAX_STEPS = 12


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 97, (48, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Stop(Exception):
    pass


class At(TrainerCallback):
    """At the end of step ``at``: wait for ``committed`` to exist and ``rotated`` to be gone
    (if given) and SIGKILL this process, or raise Stop (HF's own checkpoints are written
    synchronously)."""

    def __init__(self, at: int, committed: Path | None = None,
                 rotated: Path | None = None) -> None:
        self.at, self.committed, self.rotated = at, committed, rotated

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            if self.committed is None:
                raise Stop
            # The background write commits, then rotates HF's folders: a kill between the
            # two would leave the oldest folder too (the next save's rotation removes it).
            while not self.committed.exists() or (self.rotated is not None
                                                  and self.rotated.exists()):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)


class StartStep(TrainerCallback):
    step = None

    def on_train_begin(self, args, state, control, **kw):
        StartStep.step = state.global_step


def run(out: Path, cls: type, callbacks: list, resume: bool = False) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97,
                                       n_positions=16))
    args = TrainingArguments(output_dir=str(out), max_steps=MAX_STEPS, save_steps=2,
                             save_total_limit=2, per_device_train_batch_size=8,
                             learning_rate=1e-3, warmup_steps=2, seed=0, report_to=[],
                             use_cpu=True, disable_tqdm=True, logging_steps=1000,
                             dataloader_num_workers=0)
    trainer = cls(model=model, args=args, train_dataset=Data(),
                  callbacks=[StartStep(), *callbacks])
    try:
        trainer.train(resume_from_checkpoint=True if resume else None)
    except Stop:
        pass
    return model


class SigtermAfterSave(TrainerCallback):
    """SIGTERM to this process after the first save; then no scheduled saves, and steps slow
    enough that HF's JIT handler (it waits kill_wait seconds before asking for the
    checkpoint) acts before training ends."""

    def on_save(self, args, state, control, **kw):
        if state.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_step_end(self, args, state, control, **kw):
        if state.global_step > 2:
            control.should_save = False  # only the JIT checkpoint from here on
            time.sleep(0.05)


def shorten_jit_wait(trainer: Trainer, seconds: float = 0.3) -> None:
    """HF's own JIT handler, with a shorter wait between the SIGTERM and its checkpoint
    request (``kill_wait``, 3 s, which TrainingArguments does not expose): the same
    handler and the same path to the checkpoint, without two fixed 3 s pauses."""
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    handlers = [cb.jit_manager for cb in trainer.callback_handler.callbacks
                if isinstance(cb, JITCheckpointCallback) and cb.jit_manager is not None]
    if len(handlers) != 1 or handlers[0].kill_wait != 3:  # another transformers: say so
        raise RuntimeError("no JIT handler with kill_wait=3 on the Trainer; update "
                           "tests/support/hf_job.py's shorten_jit_wait")
    handlers[0].kill_wait = seconds


def jit(work: Path) -> None:
    """Each trainer stops on SIGTERM; what it left is written to WORK/out/jit.json."""
    result = {}
    for name, cls in (("hf", Trainer), ("ckpt", CkptTrainer)):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=97,
                                           n_positions=16))
        args = TrainingArguments(output_dir=str(work / name), max_steps=400, save_steps=2,
                                 per_device_train_batch_size=8, learning_rate=1e-3, seed=0,
                                 report_to=[], use_cpu=True, disable_tqdm=True,
                                 logging_steps=1000, enable_jit_checkpoint=True)
        trainer = cls(model=model, args=args, train_dataset=Data(),
                      callbacks=[SigtermAfterSave()])
        shorten_jit_wait(trainer)
        trainer.train()
        result[name] = {"stopped_at": trainer.state.global_step,
                        "handler_restored": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}
    out = work / "out"
    out.mkdir(exist_ok=True)
    (out / "jit.json").write_text(json.dumps(result))


def jit_forked(work: str) -> None:
    """``jit`` in a process forked from the suite's fork server (tests/support/ranks.py, whose
    preload imports this module): torch and transformers are imported already. Its output
    goes to WORK/jit.log."""
    log = os.open(os.path.join(work, "jit.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    jit(Path(work))


def main() -> None:
    torch.set_num_threads(1)
    mode, work = sys.argv[1], Path(sys.argv[2])

    def killed_run() -> None:
        run(work / "hf", CkptTrainer, [At(7, work / ".hf.ckpt/step-00000006/manifest.json",
                                             work / "hf/checkpoint-2")])

    if mode == "jit":
        jit(work)
        return
    if mode == "kill":
        killed_run()
        raise SystemExit("not killed")
    if mode == "kill+resume":  # both in one process: the killed run in a forked child
        kill_then_wait(killed_run)
        mode = "resume"
    out = work / "out"
    out.mkdir(exist_ok=True)
    starts = {}
    for name, cls, folder, stop in (("ckpt", CkptTrainer, work / "hf", None),
                                    ("ckpt_bad", CkptTrainer, work / "hf_bad", None),
                                    ("hf6", Trainer, work / "ref6", 6),
                                    ("hf4", Trainer, work / "ref4", 4)):
        if stop is not None:  # HF's own checkpoints: stop after step stop+1, resume
            run(folder, cls, [At(stop + 1)])
        model = run(folder, cls, [], resume=True)
        starts[name] = StartStep.step
        torch.save(model.state_dict(), out / f"{name}.pt")
        if name == "ckpt":
            trained = model
    (out / "starts.json").write_text(json.dumps(starts))
    # HF's own checkpoint folder loads with from_pretrained and gives the same logits.
    loaded = AutoModelForCausalLM.from_pretrained(str(work / "hf/checkpoint-12"))
    ids = Data().ids[:4]
    trained.eval()
    with torch.no_grad():
        torch.save({"trained": trained(ids).logits, "loaded": loaded(ids).logits,
                    "tied": loaded.lm_head.weight.data_ptr()
                    == loaded.transformer.wte.weight.data_ptr()}, out / "logits.pt")


if __name__ == "__main__":
    main()
