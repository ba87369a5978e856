"""CkptTrainer keeps the Hugging Face Trainer's contract: its ``checkpoint-N/`` folders (what
``from_pretrained`` and HF's own tests read), its listings, its SIGTERM (JIT checkpoint)
handling, its ``save_total_limit`` rotation and the folder ``resume_from_checkpoint=True``
picks. Each is compared with HF's own ``Trainer`` on the same tiny GPT-2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch

import ckpt
import ckpt.tools

transformers = pytest.importorskip("transformers")
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          Trainer, TrainerCallback, TrainingArguments)

from tests.support import hf_job  # noqa: E402
from tests.support.other_user import planted_sibling_roots  # noqa: E402
from tests.support.ranks import run_forked  # noqa: E402
from trainer.integrations.hf import CkptTrainer  # noqa: E402

# The files HF's own checkpoint tests look for in a checkpoint folder
# (tests/trainer/trainer_test_utils.py, check_saved_checkpoints), and rng_state.pth.
HF_FILES = {"model.safetensors", "config.json", "training_args.bin", "optimizer.pt",
            "scheduler.pt", "trainer_state.json", "rng_state.pth"}


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                      n_positions=16))


def data(n: int = 32) -> list[dict]:
    ids = torch.randint(0, 50, (n, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def arguments(out: Path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(out), max_steps=4, save_steps=2, per_device_train_batch_size=8,
                learning_rate=1e-3, seed=0, use_cpu=True, report_to=[], disable_tqdm=True,
                logging_steps=1000)
    return TrainingArguments(**{**base, **kw})


def listing(folder: Path) -> dict[str, list[str]]:
    """Every name under ``folder``, dotfiles included, by subfolder."""
    return {str(Path(d).relative_to(folder)): sorted(files + dirs)
            for d, dirs, files in os.walk(folder)}


def test_checkpoint_folder_is_hfs_and_loads_with_from_pretrained(tmp_path):
    """checkpoint-N/ holds HF's files and nothing of ckpt's; from_pretrained on it gives the
    trained model's logits; the model's bytes are written once (not in ckpt's step, whose
    manifest records their digest)."""
    theirs = Trainer(model=tiny_model(), args=arguments(tmp_path / "hf"), train_dataset=data())
    theirs.train()
    job = CkptTrainer(model=tiny_model(), args=arguments(tmp_path / "out"),
                      train_dataset=data())
    job.train()

    assert listing(tmp_path / "out") == listing(tmp_path / "hf")  # dotfiles included
    folder = tmp_path / "out" / "checkpoint-4"
    assert HF_FILES <= {p.name for p in folder.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(str(folder))
    ids = torch.stack([d["input_ids"] for d in data(4)])
    job.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, job.model(ids).logits)

    root = tmp_path / ".out.ckpt"  # ckpt's root: the hidden sibling of output_dir
    manifest = ckpt.inspect.open(root).manifest(4)
    assert "model" not in manifest.items and "optimizer" in manifest.items
    recorded = manifest.metadata["hf_model_files"]["model.safetensors"]
    assert recorded["bytes"] == (folder / "model.safetensors").stat().st_size
    tensor_bytes = sum(math.prod(e.shape) * getattr(torch, e.dtype).itemsize
                       for key, e in manifest.tensors.items() if not key.startswith("rng"))
    params = sum(p.numel() * p.element_size() for p in job.model.parameters())
    assert tensor_bytes < 2 * params + 1024  # Adam's two moments and step counts: no weights
    assert torch.load(folder / "optimizer.pt", weights_only=True)["step"] == 4


def test_sigterm_after_a_save_writes_hfs_jit_checkpoint_and_returns(tmp_path):
    """With enable_jit_checkpoint, SIGTERM after a save makes HF's handler write a
    checkpoint and stop training normally, as with HF's own Trainer: ckpt installs no
    handler of its own (which would exit 143 with no checkpoint)."""
    # A process of its own (it SIGTERMs itself), forked from the suite's fork server, which
    # has imported torch and transformers already.
    exitcode = run_forked(hf_job.jit_forked, str(tmp_path), timeout=600)
    log = (tmp_path / "jit.log").read_text(errors="replace")[-3000:]
    assert exitcode == 0, f"exited {exitcode}\n{log}"
    result = json.loads((tmp_path / "out/jit.json").read_text())
    for name in ("hf", "ckpt"):
        assert result[name]["stopped_at"] > 2 and result[name]["handler_restored"]
        saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / name).iterdir())
        assert saved[0] == 2 and len(saved) == 2  # the scheduled save and the JIT one
        jit_folder = tmp_path / name / f"checkpoint-{saved[1]}"
        assert HF_FILES <= {p.name for p in jit_folder.iterdir()}
        assert not (jit_folder / "checkpoint-is-incomplete.txt").exists()
    jit_step = max(int(p.name.split("-")[1]) for p in (tmp_path / "ckpt").iterdir())
    assert jit_step in ckpt.inspect.open(tmp_path / ".ckpt.ckpt").steps()  # committed


def test_save_total_limit_one_keeps_the_best_and_resume_true_picks_hfs_folder(tmp_path):
    """save_total_limit=1 with the best checkpoint at step 1: HF keeps checkpoint-1 alone
    at the end, and resume_from_checkpoint=True resumes from it. ckpt keeps no step without
    its folder, and resumes from the same step as HF."""
    starts = {}

    class Start(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            starts[self.name] = state.global_step

    def run(cls: type, out: Path, max_steps: int, resume: bool) -> None:
        evals = iter(range(100))
        args = arguments(out, max_steps=max_steps, save_steps=1, eval_strategy="steps",
                         eval_steps=1, save_total_limit=1, metric_for_best_model="rank",
                         greater_is_better=False, load_best_model_at_end=True)
        start = Start()
        start.name = f"{out.name}{max_steps}"
        job = cls(model=tiny_model(), args=args, train_dataset=data(), eval_dataset=data(8),
                  compute_metrics=lambda _: {"rank": next(evals)}, callbacks=[start])
        job.train(resume_from_checkpoint=True if resume else None)

    # Saves at steps 1, 2, 3: HF rotates checkpoint-2 away at step 3, and checkpoint-3 at
    # the end (save_total_limit=1 keeps the best alone).
    for cls, name in ((Trainer, "hf"), (CkptTrainer, "out")):
        run(cls, tmp_path / name, 3, False)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["checkpoint-1"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-1"]
    assert ckpt.inspect.open(tmp_path / ".out.ckpt").steps() == [1]

    for cls, name in ((Trainer, "hf"), (CkptTrainer, "out")):
        run(cls, tmp_path / name, 4, True)
    assert starts["hf4"] == starts["out4"] == 1


def test_a_root_planted_by_another_user_is_refused():
    """Threat: output_dir in a folder others may write (like /tmp); another local user makes
    ckpt's sibling root there first, a folder of hers or a link, to read the optimizer states
    written into it or to plant steps for a resume. CkptTrainer refuses it (naming it and
    what to do) and writes nothing there."""
    with planted_sibling_roots("out") as shared:
        for name, what in (("out", "owned by uid"), ("link", "a link")):
            job = CkptTrainer(model=tiny_model(), args=arguments(shared / name, max_steps=2),
                              train_dataset=data())
            with pytest.raises(ckpt.CheckpointError, match=f"is {what}.*ckpt_root="):
                job.train()
        assert os.listdir(shared / ".out.ckpt") == [] and not (shared / "hers").exists()


def test_a_run_written_by_the_earlier_layout_resumes(tmp_path):
    """An earlier CkptTrainer kept its steps in output_dir (model included) and a pointer
    ckpt-step.json in each checkpoint-N folder: such a run resumes from its step, and its
    next checkpoints are HF's folders with the steps in the sibling root."""
    out = tmp_path / "out"
    done = Trainer(model=tiny_model(), args=arguments(tmp_path / "ref", max_steps=2),
                   train_dataset=data())
    done.train()
    state = json.dumps(dataclasses.asdict(done.state), indent=2, sort_keys=True) + "\n"
    with ckpt.CheckpointManager(out, schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
        mgr.save(2, {"model": done.model, "optimizer": done.optimizer,
                     "scheduler": done.lr_scheduler, "rng": ckpt.RNGState(),
                     "trainer_state": state}, force=True)
    (out / "checkpoint-2").mkdir()
    ckpt.tools.write_pointer(str(out / "checkpoint-2" / ckpt.tools.POINTER_NAME), 2)

    starts = []

    class Start(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            starts.append((state.global_step, model.transformer.wte.weight.detach().clone()))

    model = tiny_model()
    job = CkptTrainer(model=model, args=arguments(out, max_steps=4), train_dataset=data(),
                      callbacks=[Start()])
    job.train(resume_from_checkpoint=True)
    assert starts[0][0] == 2 and torch.equal(starts[0][1], done.model.transformer.wte.weight)
    assert (out / "checkpoint-4" / "model.safetensors").exists()
    assert ckpt.inspect.open(tmp_path / ".out.ckpt").steps() == [4]
