"""A Hugging Face Trainer job for tests/e2e/test_integrations.py (run as a subprocess).

    python hf_job.py kill WORK      # CkptTrainer; SIGKILLs itself at step 7 once 6 committed
    python hf_job.py resume WORK    # resumes WORK/hf and WORK/hf_bad through ckpt; runs the
                                     # same job with HF's own checkpoints, stopped after steps
                                     # 6 and 4 and resumed; exports WORK/hf with the CLI and
                                     # loads it with from_pretrained. Results in WORK/out/.
    python hf_job.py kill+resume WORK  # both (one import): kill runs in a forked child,
                                     # resume once the test writes go (tests/support/fork_kill.py)
"""

from __future__ import annotations

import contextlib
import io
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
from verify import cli  # noqa: E402
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
    """At the end of step ``at``: wait for ``committed`` (if any) and SIGKILL this process,
    or raise Stop (HF's own checkpoints are written synchronously)."""

    def __init__(self, at: int, committed: Path | None = None) -> None:
        self.at, self.committed = at, committed

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            if self.committed is None:
                raise Stop
            while not self.committed.exists():  # the background commit (an event)
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


def main() -> None:
    torch.set_num_threads(1)
    mode, work = sys.argv[1], Path(sys.argv[2])

    def killed_run() -> None:
        run(work / "hf", CkptTrainer, [At(7, work / "hf/step-00000006/manifest.json")])

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
    # The exported folder loads with from_pretrained and gives the same logits. The CLI runs
    # in this process (`python -m ckpt` itself is tested in tests/verify/test_cli.py).
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main(["export", str(work / "hf"), "--to", "hf", str(work / "export"),
                           "--max-shard-size", "40KB", "--json"])
    assert status == 0, status
    (out / "export.json").write_text(printed.getvalue())
    loaded = AutoModelForCausalLM.from_pretrained(str(work / "export"))
    ids = Data().ids[:4]
    trained.eval()
    with torch.no_grad():
        torch.save({"trained": trained(ids).logits, "loaded": loaded(ids).logits,
                    "tied": loaded.lm_head.weight.data_ptr()
                    == loaded.transformer.wte.weight.data_ptr()}, out / "logits.pt")


if __name__ == "__main__":
    main()
