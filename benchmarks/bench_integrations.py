"""Lightning, the Hugging Face Trainer and Accelerate: how long training is blocked per
checkpoint with ckpt against the framework's own checkpointing, and the bytes on disk.

One model for all (a GPT-2 built from a config, AdamW: weights + two moments), one short
training run per (framework, method) with a checkpoint every 2 steps and the framework's own
retention (Lightning: save_top_k=2 + save_last=True; HF: save_total_limit=2; Accelerate:
total_limit=2). Methods run interleaved (default, ckpt, default, ckpt, ...); medians of the
time the training loop waited per checkpoint (Lightning: the ModelCheckpoint's saves of one
step together, top-k file and last; HF: ``_save_checkpoint``; Accelerate: ``save_state()``).
Bytes: the checkpoint folder at the end of a run (after ckpt's background writes finished),
with the hidden sibling root of CkptTrainer and CkptCheckpointIO (``.<folder>.ckpt``); a file
with two names (a hard link) counts once.

    python benchmarks/bench_integrations.py [--layers 4] [--width 384] [--reps 2]

It never asserts on timings.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

STEPS, EVERY = 8, 2


def model_config(args: argparse.Namespace):
    from transformers import GPT2Config

    return GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                      vocab_size=2048, n_positions=64)


def tokens() -> torch.Tensor:
    return torch.randint(0, 2048, (64, 32), generator=torch.Generator().manual_seed(1))


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path``, each file once (a hard link is a second name of
    the same bytes on disk; a symbolic link holds none)."""
    files = {(s.st_dev, s.st_ino): s.st_size for p in path.rglob("*")
             if p.is_file() and not p.is_symlink() for s in [p.stat()]}
    return sum(files.values())


# -- Lightning ---------------------------------------------------------------------------------

def run_lightning(args: argparse.Namespace, use_ckpt: bool, work: Path,
                  async_save: bool = False) -> tuple[list, int]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from transformers import GPT2LMHeadModel

    from trainer.integrations.lightning import CkptCheckpointIO

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = GPT2LMHeadModel(model_config(args))

        def training_step(self, batch, batch_idx):
            return self.lm(batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[CkptCheckpointIO(async_save=async_save)] if use_ckpt else None,
                        callbacks=[ModelCheckpoint(dirpath=work, every_n_train_steps=EVERY,
                                                   save_top_k=2, monitor="step", mode="max",
                                                   save_last=True)])
    blocked: dict[int, float] = {}
    original = trainer.save_checkpoint

    def timed(*a, **kw):
        t0 = time.perf_counter()
        original(*a, **kw)
        blocked[trainer.global_step] = blocked.get(trainer.global_step, 0.0) + (
            time.perf_counter() - t0)

    trainer.save_checkpoint = timed
    loader = torch.utils.data.DataLoader(tokens(), batch_size=4)
    trainer.fit(Net(), loader)  # teardown waits for ckpt's last write
    steps = work.parent / f".{work.name}.ckpt"  # CkptCheckpointIO's sibling root
    return list(blocked.values()), folder_bytes(work) + (
        folder_bytes(steps) if steps.exists() else 0)


# -- Hugging Face Trainer ----------------------------------------------------------------------

def run_hf(args: argparse.Namespace, use_ckpt: bool, work: Path) -> tuple[list, int]:
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from trainer.integrations.hf import CkptTrainer

    class Data(torch.utils.data.Dataset):
        ids = tokens()

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    targs = TrainingArguments(output_dir=str(work), max_steps=STEPS, save_steps=EVERY,
                              save_total_limit=2, per_device_train_batch_size=4,
                              report_to=[], use_cpu=True, disable_tqdm=True,
                              logging_steps=1000)
    cls = CkptTrainer if use_ckpt else Trainer
    trainer = cls(model=GPT2LMHeadModel(model_config(args)), args=targs, train_dataset=Data())
    trainer.remove_callback(PrinterCallback)  # it prints the run's metrics into the table
    blocked = []
    original = trainer._save_checkpoint

    def timed(*a, **kw):
        t0 = time.perf_counter()
        original(*a, **kw)
        blocked.append(time.perf_counter() - t0)

    trainer._save_checkpoint = timed
    trainer.train()  # CkptTrainer.train waits for the last write
    root = Path(trainer.ckpt_root_for(str(work))) if use_ckpt and hasattr(
        trainer, "ckpt_root_for") else work / "__none__"  # ckpt's hidden sibling root
    return blocked, folder_bytes(work) + (folder_bytes(root) if root.exists() else 0)


# -- Accelerate --------------------------------------------------------------------------------

def run_accelerate(args: argparse.Namespace, use_ckpt: bool, work: Path,
                   async_save: bool = False) -> tuple[list, int]:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from transformers import GPT2LMHeadModel

    from trainer.integrations.accelerate import CkptAccelerator

    torch.manual_seed(0)
    model = GPT2LMHeadModel(model_config(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(tokens(), batch_size=4)
    cls = CkptAccelerator if use_ckpt else Accelerator
    acc = cls(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(work), automatic_checkpoint_naming=True, total_limit=2),
        **({"ckpt_options": {"async_save": async_save}} if use_ckpt else {}))
    model, opt, loader = acc.prepare(model, opt, loader)
    blocked = []
    for step, batch in enumerate(loader, 1):
        acc.backward(model(batch, labels=batch).loss)
        opt.step()
        opt.zero_grad()
        if step % EVERY == 0:
            t0 = time.perf_counter()
            acc.save_state()
            blocked.append(time.perf_counter() - t0)
        if step == STEPS:
            break
    if use_ckpt:
        acc.wait_for_checkpoints()
    return blocked, folder_bytes(work)


FRAMEWORKS = {"Lightning": run_lightning, "HF Trainer": run_hf, "Accelerate": run_accelerate,
              # ckpt's background writes, asked for (the integrations' default is synchronous)
              "Lightning async": lambda *a: run_lightning(*a, async_save=True),
              "Accelerate async": lambda *a: run_accelerate(*a, async_save=True)}
DEFAULTS = {"Lightning": "TorchCheckpointIO", "HF Trainer": "Trainer._save_checkpoint",
            "Accelerate": "Accelerator.save_state",
            "Lightning async": "TorchCheckpointIO (ckpt: async_save=True)",
            "Accelerate async": "Accelerator.save_state (ckpt: async_save=True)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--reps", type=int, default=2, help="runs per method (interleaved)")
    parser.add_argument("--only", default="", help="comma-separated frameworks")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both methods (default 1: on a shared "
                             "machine, parallel copies of many small tensors stall)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bars
    n = sum(p.numel() for p in GPT2LMHeadModel(model_config(args)).parameters())
    print(f"GPT-2 from a config: {args.layers} layers, width {args.width}, {n / 1e6:.1f} M "
          f"parameters ({n * 4 / 2**20:.0f} MiB fp32; with AdamW's two moments "
          f"{n * 12 / 2**20:.0f} MiB per checkpoint). {STEPS} steps, a checkpoint every "
          f"{EVERY}, {args.reps} interleaved runs per method; CPU, {torch.get_num_threads()} "
          "threads.\n")
    print("| framework | default checkpointing | blocked per checkpoint, default (median) "
          "| blocked, ckpt (median) | ckpt / default | bytes on disk, default | bytes, ckpt |")
    print("|---|---|---|---|---|---|---|")
    only = [f for f in args.only.split(",") if f] or list(FRAMEWORKS)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-integrations-"))
    for name in only:
        times: dict[bool, list[float]] = {False: [], True: []}
        sizes: dict[bool, list[int]] = {False: [], True: []}
        for rep in range(args.reps):
            for use_ckpt in (False, True) if rep % 2 == 0 else (True, False):
                work = base / f"{name.replace(' ', '_')}-{int(use_ckpt)}-{rep}"
                blocked, nbytes = FRAMEWORKS[name](args, use_ckpt, work)
                times[use_ckpt] += blocked
                sizes[use_ckpt].append(nbytes)
        d, c = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {name} | {DEFAULTS[name]} | {d * 1e3:.0f} ms | {c * 1e3:.0f} ms | "
              f"{c / d:.2f}x | {max(sizes[False]) / 2**20:.0f} MiB | "
              f"{max(sizes[True]) / 2**20:.0f} MiB |", flush=True)
    print("\nckpt's figure is the time the loop waited in the save call. CkptCheckpointIO "
          "and CkptAccelerator save synchronously by default (as the frameworks' own IO: "
          "the step is committed when the call returns), so their rows include the write; "
          "their async rows (async_save=True) and CkptTrainer wait for the copy of the "
          "state to host memory, the pointer file's fsync, the framework's "
          "rotation, and any wait for the previous background write to finish "
          "(backpressure); digests, the write and the commit ran in the background. "
          "Lightning's default writes last.ckpt and the top-k file as two full copies; "
          "CkptCheckpointIO writes Lightning's .ckpt file once (torch.save, fsync, xxh3 "
          "digests recorded in a ckpt step) and makes last.ckpt a hard link to it when "
          "Lightning saves the same state again. CkptTrainer writes HF's checkpoint-N folder "
          "(the model as HF's safetensors, once, from the writer thread) and the "
          "optimizer as a ckpt step.")


if __name__ == "__main__":
    main()
