"""A tiny byte-level transformer LM and a deterministic synthetic corpus, for CPU demos."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from trainer.data import ResumableSampler

VOCAB = 256
D_MODEL = 64
N_LAYERS = 2
N_HEADS = 4
CONTEXT = 64
DROPOUT = 0.1

_ADJECTIVES = ["quick", "lazy", "red", "old", "small", "bright", "quiet", "brave", "green", "tall"]
_NOUNS = ["fox", "dog", "cat", "bird", "tree", "river", "king", "robot", "child", "ship"]
_VERBS = ["sees", "likes", "chases", "finds", "builds", "follows", "paints", "hears"]
_ADVERBS = ["slowly", "today", "again", "quietly", "at night", "with care"]


def make_corpus(seed: int, num_sentences: int = 1500) -> bytes:
    """Deterministic English-like text from a tiny grammar; learnable but not trivial."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        words = ["the", rng.choice(_ADJECTIVES), rng.choice(_NOUNS), rng.choice(_VERBS),
                 "the", rng.choice(_NOUNS)]
        if rng.random() < 0.5:
            words.append(rng.choice(_ADVERBS))
        sentence = " ".join(words)
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
    return " ".join(sentences).encode("ascii")


class WindowDataset(Dataset):
    """Map-style dataset of (input, target) byte windows; target is input shifted by one."""

    def __init__(self, corpus: bytes, context: int = CONTEXT, stride: int = 16) -> None:
        if len(corpus) < context + 1:
            raise ValueError("corpus shorter than one window")
        self.tokens = torch.tensor(list(corpus), dtype=torch.long)
        self.context = context
        self.stride = stride
        self._len = (len(corpus) - context - 1) // stride + 1

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self._len:
            raise IndexError(i)
        start = i * self.stride
        chunk = self.tokens[start:start + self.context + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """Pre-LN transformer block with causal self-attention."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        # No dropout on attention probabilities: it dominated step time on CPU; embedding and
        # residual dropout still make the run depend on the global RNG.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, d)
        x = x + self.resid_drop(self.proj(y))
        return x + self.resid_drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """Byte-level GPT-style LM whose output head shares its weight with the input embedding."""

    def __init__(self, vocab: int = VOCAB, d_model: int = D_MODEL, n_layers: int = N_LAYERS,
                 n_heads: int = N_HEADS, context: int = CONTEXT, dropout: float = DROPOUT) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: one Parameter, two names
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} exceeds context {self.context}")
        x = self.drop(self.embed(idx) + self.pos[:t])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    """LR multiplier: linear warmup to 1, then cosine decay to `floor` at `total` steps."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


@dataclass
class Training:
    """Everything one training run needs; the stateful parts go into a checkpoint."""

    model: TinyLM
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    dataset: WindowDataset
    sampler: ResumableSampler
    batch_size: int


def make_training(seed: int, total_steps: int = 300, batch_size: int = 16, lr: float = 3e-3,
                  warmup: int = 20, audit: bool = False) -> Training:
    """Build model, AdamW, warmup+cosine LambdaLR, dataset and sampler, all from `seed`.

    Seeds the global torch RNG (it drives dropout, so it is part of the run's state), and
    Python's and NumPy's global RNGs so that a whole-process RNG snapshot is reproducible too.
    """
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    model = TinyLM()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "pos"]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or n == "pos"]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, total_steps))
    dataset = WindowDataset(make_corpus(seed))
    sampler = ResumableSampler(len(dataset), seed=seed, audit=audit)
    return Training(model, optimizer, scheduler, dataset, sampler, batch_size)


def collate(dataset: WindowDataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the (input, target) windows for `indices` into a batch."""
    xs, ys = zip(*(dataset[i] for i in indices))
    return torch.stack(xs), torch.stack(ys)


def train_step(tr: Training) -> float:
    """One optimizer step on the sampler's next batch; returns the loss."""
    x, y = collate(tr.dataset, tr.sampler.next_indices(tr.batch_size))
    tr.model.train()
    logits = tr.model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    tr.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(tr.model.parameters(), 1.0)
    tr.optimizer.step()
    tr.scheduler.step()
    return loss.item()
