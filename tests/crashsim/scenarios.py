"""The state the scenarios save: a few tensors in several chunks and files, and a value."""

from __future__ import annotations

from typing import Any

import torch

import ckpt

# 4 KiB chunks and two writer threads: each step has several data files and chunks.
OPTIONS = ckpt.SaveOptions(chunk_bytes=4096, write_threads=2)


def values(step: int, *, changed: tuple[str, ...] = ("a", "b", "c")) -> dict[str, Any]:
    """The state saved as ``step``; tensors not in ``changed`` keep their step-1 values."""
    out: dict[str, Any] = {}
    for key, n in (("a", 2000), ("b", 1200)):
        g = torch.Generator().manual_seed(1000 * (step if key in changed else 1) + n)
        out[key] = torch.randn(n, generator=g)
    out["c"] = torch.arange(50, dtype=torch.int64) * (step if "c" in changed else 1)
    out["epoch"] = step
    return out


def template() -> dict[str, Any]:
    """A state to restore into (values nobody saves)."""
    return {"a": torch.full((2000,), -1.0), "b": torch.full((1200,), -1.0),
            "c": torch.full((50,), -1, dtype=torch.int64), "epoch": -1}
