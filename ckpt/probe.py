"""Probe: a small fixed input run through the model at save time, so that a checkpoint can
later be checked by loading it into a fresh model and running the same input again."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

PROBE_ITEM = "__probe__"


@dataclass(frozen=True)
class Probe:
    """What to record at save time for ``ckpt verify --level forward``.

    Args:
        model_key: the state entry holding the model (an ``nn.Module``).
        inputs: a small batch (a tensor, or a tuple of tensors passed positionally).
        loss_fn: optional ``(output, inputs) -> scalar tensor``; its value is recorded too.
        factory: ``"module:callable"`` that builds a fresh model for verification; recorded
            in the checkpoint so ``ckpt verify --level forward`` needs no ``--model``.

    The forward runs under ``torch.no_grad()`` in eval mode, with the RNG state forked, so
    recording a probe changes neither the model's mode nor the random streams of training.
    """

    model_key: str = "model"
    inputs: Any = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    factory: str | None = None

    def record(self, state: dict) -> dict:
        """Run the probe on the live model; returns the value saved as ``__probe__``."""
        model = state.get(self.model_key)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Probe.model_key {self.model_key!r} does not name an nn.Module "
                            "in the state")
        output, loss = run_forward(model, self.inputs, self.loss_fn)
        return {"model_key": self.model_key, "inputs": _cpu(self.inputs),
                "output": output, "loss": loss, "factory": self.factory,
                "loss_fn": _qualified_name(self.loss_fn),
                "finite": bool(torch.isfinite(output.float()).all())}


def run_forward(model: torch.nn.Module, inputs: Any,
                loss_fn: Callable | None = None) -> tuple[torch.Tensor, float | None]:
    """Output (detached, on the CPU) and optional loss of ``model`` on ``inputs``."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    was_training = model.training
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.eval()
        try:
            out = model(*args)
            loss = float(loss_fn(out, inputs)) if loss_fn is not None else None
        finally:
            model.train(was_training)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if isinstance(out, dict):
        out = next(iter(out.values()))
    if loss is not None and not math.isfinite(loss):
        loss = None if math.isnan(loss) else loss
    return out.detach().to("cpu").clone(), loss


def _qualified_name(fn: Callable | None) -> str | None:
    """``module:qualname`` of a module-level function (so verify can re-import it)."""
    if fn is None or "<" in getattr(fn, "__qualname__", "<"):
        return None
    return f"{fn.__module__}:{fn.__qualname__}"


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone()
    if isinstance(value, tuple):
        return tuple(_cpu(v) for v in value)
    return value
