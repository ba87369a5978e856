"""Rank bodies for the DCP tests: an FSDP2 model and its optimizer saved with ``dcp.save``
and restored with ``ckpt.load`` (or the reverse), on any number of gloo ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import ckpt


def build(world: int | None, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small two-layer model (FSDP2-sharded over ``world`` ranks, plain when None) and
    its AdamW optimizer, parameters drawn from ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    if world is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for i in range(steps):
        torch.manual_seed(100 + i)
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Every tensor of the model and the optimizer, full, by name (as numpy arrays: they
    cross the process boundary as plain bytes); gathered on rank 0, None on the others."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    if not msd:
        return None
    flat = {f"model.{k}": v.numpy().copy() for k, v in msd.items()}
    for name, entry in osd["state"].items():
        for key, value in entry.items():
            flat[f"optim.{name}.{key}"] = torch.as_tensor(value).numpy().copy()
    flat["lr"] = osd["param_groups"][0]["lr"]
    return flat


def dcp_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """Train the sharded model two steps and ``dcp.save`` it: the reference state."""
    model, opt = build(world, seed=0)
    train(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return full_state(model, opt)


def ckpt_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """A fresh sharded model (other values, no optimizer state yet) loaded by ckpt: the
    full state (rank 0) and the ckpt log line saying how many bytes this rank read."""
    import logging

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore
    logging.getLogger("ckpt").addHandler(handler)
    logging.getLogger("ckpt").setLevel(logging.INFO)
    model, opt = build(world, seed=1)
    ckpt.load({"model": model, "optim": opt}, path)
    return {"state": full_state(model, opt),
            "read": next(line for line in lines if "data bytes" in line)}


def dcp_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """A fresh sharded model loaded by ``dcp.load`` (DCP's own documented recipe)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = build(world, seed=1)
    train(model, opt, steps=1)  # optimizer state exists to load into
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return full_state(model, opt)


def assert_equal(expected: dict, got: dict) -> None:
    """Same names, every tensor equal (as gathered by :func:`full_state`)."""
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(value)), key


def ckpt_export(rank: int, world: int, root: str, out: str) -> None:
    """``ckpt.interop.export_dcp`` called on every rank: each writes its share."""
    import ckpt.interop

    ckpt.interop.export_dcp(root, out, item="train")
