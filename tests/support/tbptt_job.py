"""A training loop written like pytorch/examples' word_language_model, checkpointed by ckpt
(tests/e2e/test_tbptt_loop.py).

An LSTM language model trained with truncated backpropagation through time: the corpus
batchified into columns, index-based batches (``for batch, i in enumerate(range(0, n - 1,
bptt))``, no DataLoader), the hidden state carried from batch to batch (detached), a
hand-written SGD step (``p.data.add_(p.grad, alpha=-lr)``) with gradient clipping, the
learning rate divided by 4 when the validation loss does not improve, the best validation
loss kept. What ckpt needs from such a loop: the data position, ``lr`` and the best loss as
plain values, the carried hidden state in a :class:`ckpt.PerRank`, the RNG (dropout) as a
:class:`ckpt.RNGState`.

:func:`run` trains to the end, or SIGKILLs its own process after the batch whose global step
is ``kill_at`` (``after_commit``: that step must be a saved one; killed once it is committed).
"""

from __future__ import annotations

import json
import os
import signal

import torch

import ckpt

VOCAB, EMB, HIDDEN, BSZ, BPTT = 30, 16, 32, 4, 8
TRAIN_ROWS, VAL_ROWS = 49, 17  # 6 batches of BPTT rows per epoch; 2 for validation
EPOCHS, EVERY, CLIP = 3, 3, 0.25  # saves at steps 3, 9, 15: mid-epoch, the hidden state live


class RNNModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.2)
        self.encoder = torch.nn.Embedding(VOCAB, EMB)
        self.rnn = torch.nn.LSTM(EMB, HIDDEN)
        self.decoder = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, x, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return self.decoder(self.drop(output)).view(-1, VOCAB), hidden

    def init_hidden(self, bsz: int):
        return (torch.zeros(1, bsz, HIDDEN), torch.zeros(1, bsz, HIDDEN))


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data[:nbatch * bsz].view(bsz, -1).t().contiguous()


def get_batch(source: torch.Tensor, i: int):
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].view(-1)


def repackage_hidden(h):
    return tuple(v.detach() for v in h)


def evaluate(model: RNNModel, source: torch.Tensor) -> float:
    model.eval()
    total, hidden = 0.0, model.init_hidden(BSZ)
    with torch.no_grad():
        for i in range(0, source.size(0) - 1, BPTT):
            data, targets = get_batch(source, i)
            output, hidden = model(data, hidden)
            total += len(data) * torch.nn.functional.cross_entropy(output, targets).item()
    return total / (len(source) - 1)


def run(root: str | None, out: str, kill_at: int | None = None,
        after_commit: bool = False) -> None:
    """Train (resuming from ``root`` if it holds a step); write the final state to ``out``."""
    torch.set_num_threads(1)
    torch.manual_seed(1111)
    corpus = torch.randint(VOCAB, (BSZ * (TRAIN_ROWS + VAL_ROWS),),
                           generator=torch.Generator().manual_seed(5))
    train_data = batchify(corpus[:BSZ * TRAIN_ROWS], BSZ)
    val_data = batchify(corpus[BSZ * TRAIN_ROWS:], BSZ)
    model = RNNModel()
    hidden = model.init_hidden(BSZ)

    # The loop's own variables, as plain values; the hidden state and the RNG as ckpt items.
    loop = {"epoch": 1, "batch": 0, "lr": 20.0, "best_val_loss": None}
    state = {"model": model, "loop": loop, "hidden": ckpt.PerRank(hidden),
             "rng": ckpt.RNGState()}
    # synchronous saves: a kill two steps after a save resumes from that save, always
    mgr = ckpt.CheckpointManager(root, every_steps=EVERY, async_save=False) if root else None
    step = 0
    if mgr is not None:
        step = mgr.restore(state) or 0
        loop, hidden = state["loop"], state["hidden"].value
        print(f"start {step}", flush=True)

    while loop["epoch"] <= EPOCHS:
        model.train()
        if loop["batch"] == 0:
            hidden = model.init_hidden(BSZ)
        for batch, i in enumerate(range(0, train_data.size(0) - 1, BPTT)):
            if batch < loop["batch"]:
                continue  # trained before the restore
            data, targets = get_batch(train_data, i)
            hidden = repackage_hidden(hidden)
            model.zero_grad()
            output, hidden = model(data, hidden)
            loss = torch.nn.functional.cross_entropy(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-loop["lr"])
            step += 1
            loop["batch"] = batch + 1
            if mgr is not None:
                state["hidden"].value = hidden
                handle = mgr.save(step, state)
                if step == kill_at and (handle is not None or not after_commit):
                    os.kill(os.getpid(), signal.SIGKILL)
        val_loss = evaluate(model, val_data)
        if loop["best_val_loss"] is None or val_loss < loop["best_val_loss"]:
            loop["best_val_loss"] = val_loss
        else:
            loop["lr"] /= 4.0
        loop["epoch"], loop["batch"] = loop["epoch"] + 1, 0
    if mgr is not None:
        mgr.close()
    torch.save({"model": model.state_dict(), "hidden": hidden, "torch": torch.rand(4),
                "steps": step}, os.path.join(out, "final.pt"))
    with open(os.path.join(out, "final.json"), "w") as f:
        json.dump(loop, f)
