"""Stateful adapters for state that needs more than ``state_dict()`` to save well."""

from __future__ import annotations

from typing import Any

import torch


class ModelOptimizer:
    """A model and its optimizer(s) through torch's distributed ``get_state_dict`` /
    ``set_state_dict``: parameter names instead of ids, DTensor shards for FSDP2 and tensor
    parallel models, and an optimizer whose state exists before its first step (so a fresh
    job can load into it on any world size).

    Example::

        state = {"train": ckpt.ModelOptimizer(model, optimizer), "rng": ckpt.RNGState()}
    """

    def __init__(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, list(self.optimizers))
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, list(self.optimizers), model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
