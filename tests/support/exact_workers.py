"""A training loop as a user writes it, for the exact-resume tests.

Tied weights, dropout, AdamW, LambdaLR, GradScaler with bf16 autocast on the CPU, gradient
accumulation over 2 micro-batches, a shuffled loader with 2 workers; a CheckpointManager
saving every 3 optimizer steps in the background. Run as
``python tests/support/exact_workers.py MODE ROOT OUT`` (MODE: ``stateful`` for torchdata's
StatefulDataLoader, ``plain`` for a DataLoader with trainer.ResumableLoader, ``compiled``
for ``plain`` with the model under torch.compile). Prints ``start S`` after the restore,
``saved N`` right after a save was started and ``step N`` after each optimizer step; at the
end writes every tensor of model, optimizer, scheduler and scaler, and the next random
numbers, to OUT with torch.save. The tests start the runs through :func:`run_forked`.
"""

from __future__ import annotations

import sys

VOCAB, SEQ, BATCH, SAMPLES, ACCUM = 48, 9, 4, 40, 2
STEPS, EVERY = 15, 3  # 10 micro-batches per epoch: 5 optimizer steps; 3 epochs


def build_data(mode: str):
    import torch
    from torch.utils.data import DataLoader, Dataset

    import trainer

    class Tokens(Dataset):
        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, i: int):
            gen = torch.Generator().manual_seed(1000 + i)  # per sample, not the global RNG
            return torch.randint(VOCAB, (SEQ,), generator=gen)

    if mode == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(Tokens(), batch_size=BATCH, shuffle=True, num_workers=2,
                                  generator=torch.Generator().manual_seed(5))
    sampler = trainer.ResumableSampler(SAMPLES, seed=5)
    return trainer.ResumableLoader(DataLoader(Tokens(), sampler=sampler, batch_size=BATCH,
                                              num_workers=2))


def build_model():
    import torch

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, 32)
            self.drop = torch.nn.Dropout(0.2)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                           torch.nn.Dropout(0.1), torch.nn.Linear(64, 32))
            self.head = torch.nn.Linear(32, VOCAB, bias=False)
            self.head.weight = self.emb.weight  # tied

        def forward(self, x):
            h = self.drop(self.emb(x))
            return self.head(h + self.mlp(h))

    torch.manual_seed(1234)
    return TinyLM()


def main(mode: str, root: str, out: str) -> None:
    import torch

    import ckpt

    torch.set_num_threads(1)
    model = build_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + 0.1 * s))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=4)
    net = torch.compile(model) if mode == "compiled" else model
    loader = build_data(mode)
    state = {"model": net, "optim": optim, "sched": sched, "scaler": scaler,
             "rng": ckpt.RNGState(), "data": loader, "progress": {"step": 0}}
    mgr = ckpt.CheckpointManager(root, every_steps=EVERY, keep_last=2)
    step = mgr.restore(state) or 0
    assert state["progress"]["step"] == step, (state["progress"], step)
    print(f"start {step}", flush=True)
    micro = 0
    while step < STEPS:
        for batch in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = net(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB),
                                                     batch[:, 1:].reshape(-1))
            scaler.scale(loss / ACCUM).backward()
            micro += 1
            if micro % ACCUM:
                continue
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
            sched.step()
            step += 1
            state["progress"] = {"step": step}
            if mgr.save(step, state) is not None:
                print(f"saved {step}", flush=True)
            print(f"step {step}", flush=True)
            if step == STEPS:
                break
    mgr.close()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(),
                "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                "next": torch.rand(4)}, out)
    print("done", flush=True)


SCHEDULE_STEPS, SCHEDULE_SECONDS = 30, 4


def val_loss(step: int) -> float:
    """Rises with the step (overfitting): the newest step is never among the best."""
    return 0.5 + 0.01 * step


def schedule(root: str) -> None:
    """Save by time (a clock of one second per step) with best-2 retention by val_loss.

    Prints ``start S`` after the restore and ``committed N`` once save N returned (saves are
    synchronous: committed and retention applied).
    """
    import torch

    import ckpt

    state = {"w": torch.zeros(64), "progress": {"step": 0}}
    mgr = ckpt.CheckpointManager(
        root, schedule=ckpt.Schedule(every_seconds=SCHEDULE_SECONDS),
        retention=ckpt.RetentionPolicy(keep_best=ckpt.KeepBest(2, "val_loss")), async_save=False)
    step = mgr.restore(state) or 0
    print(f"start {step}", flush=True)
    # one "second" per step: no sleeps, same steps each run
    mgr._schedule.clock = lambda: float(step)
    mgr._schedule.last_save_time = float(step)
    while step < SCHEDULE_STEPS:
        step += 1
        state["w"] += 1
        state["progress"] = {"step": step}
        if mgr.save(step, state, metrics={"val_loss": val_loss(step)}) is not None:
            print(f"committed {step}", flush=True)
    mgr.close()
    print("done", flush=True)


def run_forked(command: str, args: list[str], out) -> None:
    """A run started by tests/e2e/test_exact_resume.py's fork server (``multiprocessing``'s
    forkserver, torch and ckpt imported once): stdout and stderr go to the pipe ``out``."""
    import multiprocessing
    import os

    # A forkserver child starts with forkserver as its default start method; the loop's
    # DataLoader workers fork as in a process started with `python` (Linux, Python < 3.14).
    multiprocessing.set_start_method("fork", force=True)
    for fd in (1, 2):
        os.dup2(out.fileno(), fd)
    out.close()
    os.environ.pop("CKPT_FAULT", None)
    if command == "schedule":
        schedule(*args)
    else:
        main(command, *args)


if __name__ == "__main__":
    if sys.argv[1] == "schedule":
        schedule(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
