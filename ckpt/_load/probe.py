"""Probe: a small fixed input run through the model at save time, so that a checkpoint can
later be checked by loading it into a model and running the same input again (``ckpt verify
--level forward`` in a fresh model; ``restore(..., verify="forward")`` in the live one)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ckpt._shared.adapters import ModelOptimizer

PROBE_ITEM = "__probe__"

# (rtol, atol) by the dtype of the probe's output. The rerun uses the same weights and
# inputs, but maybe another machine, thread count or kernel, so sums are reduced in another
# order: a few ulps per operation, compounding over layers. Any real loading fault (a wrong
# or missing tensor, transposed weights, a wrong dtype) moves outputs by O(1) relative.
# fp32: 1e-4 relative is ~800 ulps (eps 1.2e-7), far above reordering noise, far below faults.
# fp16 (eps 9.8e-4) and bf16 (eps 7.8e-3): one rounding flip moves a value by an ulp, so the
# bounds are a few ulps of those formats. docs/cli.md explains them.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.complex128: (1e-7, 1e-9),
    torch.complex64: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


#: The most output values a probe stores by default. A language model's output is batch x
#: sequence x vocabulary (12 MiB of logits for a small model, more than its weights): above
#: this many values the probe stores a fixed sample of positions (an even spread drawn from a
#: seeded generator) and the sum and absolute sum of the whole output, which the check
#: compares with the bounds that the element-wise tolerance implies. A faulty load moves
#: nearly every output value; a sample of 4,096 finds it, and the sums see the rest.
MAX_OUTPUT_VALUES = 4096
_SAMPLE_SEED = 0x5EED


def tolerance_for(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing outputs of ``dtype``; exact for integer outputs."""
    return TOLERANCES.get(dtype, (0.0, 0.0))


@dataclass(frozen=True)
class Probe:
    """What to record at save time for ``ckpt verify --level forward`` and
    ``restore(state, verify="forward")``.

    Args:
        model_key: the state entry holding the model (an ``nn.Module``, or a
            ``ckpt.ModelOptimizer`` whose model it runs).
        inputs: a small batch (a tensor, or a tuple of tensors passed positionally).
        loss_fn: optional ``(output, inputs) -> scalar tensor``; its value is recorded too.
        factory: ``"module:callable"`` that builds a fresh model for verification; recorded
            in the checkpoint so ``ckpt verify --level forward`` needs no ``--model``.
        max_outputs: the most output values stored (default :data:`MAX_OUTPUT_VALUES`);
            a larger output is stored as a sample of that many positions plus its sums.
            None stores the whole output.

    The forward runs under ``torch.no_grad()`` in eval mode, with the RNG state forked, so
    recording a probe changes neither the model's mode nor the random streams of training.
    """

    model_key: str = "model"
    inputs: Any = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    factory: str | None = None
    max_outputs: int | None = MAX_OUTPUT_VALUES

    def __post_init__(self) -> None:
        if self.max_outputs is not None and (isinstance(self.max_outputs, bool) or not
                                             isinstance(self.max_outputs, int)
                                             or self.max_outputs < 1):
            raise ValueError(f"Probe(max_outputs=...) must be a positive int or None, not "
                             f"{self.max_outputs!r}")

    def record(self, state: dict) -> dict:
        """Run the probe on the live model; returns the value saved as ``__probe__``."""
        model = model_of(state.get(self.model_key))
        if model is None:
            raise TypeError(f"Probe.model_key {self.model_key!r} does not name an nn.Module "
                            "(or a ckpt.ModelOptimizer) in the state")
        output, loss = run_forward(model, self.inputs, self.loss_fn)
        return {"model_key": self.model_key, "inputs": _cpu(self.inputs),
                **bounded_output(output, self.max_outputs), "loss": loss,
                "factory": self.factory, "loss_fn": _qualified_name(self.loss_fn),
                "finite": bool(torch.isfinite(output.float()).all())}


def bounded_output(output: torch.Tensor, limit: int | None) -> dict[str, Any]:
    """The probe's fields for ``output``: ``{"output": output}`` when it holds at most
    ``limit`` values; else ``output`` a sample of ``limit`` of its values (flattened),
    ``output_index`` their positions, ``output_shape`` its shape and ``output_sums`` its
    sum and absolute sum (float64)."""
    n = output.numel()
    if limit is None or n <= limit:
        return {"output": output}
    g = torch.Generator().manual_seed(_SAMPLE_SEED)
    # Evenly spread with a random phase per stretch: no aliasing with the output's layout
    # (a stride equal to the vocabulary would sample one column), and sorted for reads.
    stretch = n / limit
    index = (torch.arange(limit, dtype=torch.float64) * stretch
             + torch.rand(limit, generator=g, dtype=torch.float64) * stretch).long()
    index = index.clamp_(max=n - 1)
    flat = output.reshape(-1)
    return {"output": flat[index].clone(), "output_index": index,
            "output_shape": list(output.shape), "output_sums": _sums(output)}


def _sums(output: torch.Tensor) -> list[float]:
    wide = output.to(torch.complex128 if output.is_complex() else torch.float64)
    return [float(wide.sum().abs() if wide.is_complex() else wide.sum()),
            float(wide.abs().sum())]


def compared_outputs(probe: dict, output: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor] | str:
    """(the rerun's values, the recorded ones) for the element-wise comparison: the whole
    outputs, or the recorded sample's positions; or why they cannot be compared (shapes)."""
    index = probe.get("output_index")
    shape = list(probe["output"].shape) if index is None else probe.get("output_shape")
    if list(output.shape) != shape:
        return (f"the probe's output has shape {list(output.shape)}, the one recorded at "
                f"save time {shape}")
    if index is None:
        return output, probe["output"]
    return output.reshape(-1)[index], probe["output"]


def sums_outside(probe: dict, output: torch.Tensor, rtol: float, atol: float) -> str | None:
    """For a sampled probe: whether the whole output's sums moved more than the element-wise
    tolerance allows (``|sum new - sum old| <= n * atol + rtol * sum|old|`` follows from
    ``|new - old| <= atol + rtol * |old|`` element by element), or None."""
    recorded = probe.get("output_sums")
    if recorded is None:
        return None
    now = _sums(output)
    # float64 sums of a few million values: rounding far below any tolerance; 1e-9 covers it
    bound = output.numel() * atol + rtol * recorded[1] + 1e-9 * recorded[1]
    for name, new, old in zip(("sum", "absolute sum"), now, recorded):
        if not abs(new - old) <= bound:  # NaN never passes
            return (f"the {name} of the probe's {output.numel()} output values is {new:.6g}, "
                    f"{old:.6g} at save time (allowed difference {bound:.3g})")
    return None


def model_of(value: Any) -> torch.nn.Module | None:
    """The module a probe runs through: ``value`` itself, or a ``ckpt.ModelOptimizer``'s
    model (FSDP2 states hold their model that way); None for anything else."""
    if isinstance(value, ModelOptimizer):
        value = value.model
    return value if isinstance(value, torch.nn.Module) else None


def run_forward(model: torch.nn.Module, inputs: Any,
                loss_fn: Callable | None = None) -> tuple[torch.Tensor, float | None]:
    """Output (detached, on the CPU) and optional loss of ``model`` on ``inputs``."""
    # A torch.compile'd model runs the module it wraps: same weights, and no compilation of
    # an eval-mode graph at save or restore time (seconds each, in a fresh process).
    model = getattr(model, "_orig_mod", model)
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    # Each submodule's own mode comes back (a frozen BatchNorm kept in eval stays in eval).
    modes = [(m, m.training) for m in model.modules()]
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        model.eval()
        try:
            out = model(*args)
            loss = float(loss_fn(out, inputs)) if loss_fn is not None else None
        finally:
            for m, training in modes:
                m.training = training
    if isinstance(out, (tuple, list)):
        out = out[0]
    if isinstance(out, dict):
        out = next(iter(out.values()))
    if loss is not None and not math.isfinite(loss):
        loss = None if math.isnan(loss) else loss
    return out.detach().to("cpu").clone(), loss


@dataclass(frozen=True)
class ProbeFailure:
    """Why a restored model failed its probe.

    ``mismatch`` is True when weights and output are finite but the output differs from the
    recorded one (or has another shape): the mark of a model whose code changed since the
    save. ``max_abs_diff`` is the largest element-wise difference then (None for shapes).
    """

    reason: str
    mismatch: bool = False
    max_abs_diff: float | None = None


def check_model(model: torch.nn.Module, probe: dict) -> ProbeFailure | None:
    """Rerun a recorded probe (the ``__probe__`` value) through ``model`` and judge it.

    Passes when every floating-point weight is finite, the output is finite, and it agrees
    with the recorded output element-wise, ``|new - recorded| <= atol + rtol * |recorded|``
    with the tolerance of its dtype (:data:`TOLERANCES`). The forward runs before anything is
    judged, so under a process group every rank runs it (a model's forward may hold
    collectives). The loss is not rechecked (the loss function is not in the checkpoint).
    """
    try:
        whole, _ = run_forward(model, probe["inputs"])
    except Exception as e:  # the model's code (or the device), not the checkpoint's bytes
        return ProbeFailure(f"running the probe's inputs through the model raised "
                            f"{type(e).__name__}: {e}")
    diverged = ("; the output recorded at save time was not finite either: training had "
                "diverged before this step was saved" if probe.get("finite") is False else "")
    bad = nonfinite_weights(model)
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        return ProbeFailure(f"weight {bad[0]}{more} of the model hold NaN/Inf{diverged}")
    if (whole.is_floating_point() or whole.is_complex()) and not bool(
            torch.isfinite(whole).all()):
        n = int((~torch.isfinite(whole)).sum())
        return ProbeFailure(f"the probe's output has {n} NaN/Inf of {whole.numel()} "
                            f"values{diverged}")
    compared = compared_outputs(probe, whole)
    if isinstance(compared, str):
        return ProbeFailure(compared, mismatch=True)
    output, recorded = compared
    rtol, atol = tolerance_for(recorded.dtype)
    wide = torch.complex128 if output.is_complex() else torch.float64
    new, old = output.to(wide), recorded.to(wide)
    diff = torch.nan_to_num((new - old).abs(), nan=math.inf)  # a NaN recorded never agrees
    outside = diff > atol + rtol * old.abs()
    if not bool(outside.any()):
        sums = sums_outside(probe, whole, rtol, atol)
        return None if sums is None else ProbeFailure(sums, mismatch=True)
    worst = float(diff.max())
    sampled = " sampled" if "output_index" in probe else ""
    return ProbeFailure(
        f"the probe's output differs from the one recorded at save time in "
        f"{int(outside.sum())} of {output.numel()}{sampled} values (max |diff| {worst:.3g}; "
        f"tolerance rtol={rtol:g} atol={atol:g} for "
        f"{str(recorded.dtype).removeprefix('torch.')})",
        mismatch=True, max_abs_diff=worst)


def nonfinite_weights(model: torch.nn.Module) -> list[str]:
    """Names of the model's floating-point parameters and buffers holding NaN or Inf (the
    local shard of a DTensor). One ``aminmax`` pass each (it propagates NaN and shows Inf),
    and one device-to-host transfer per device for all the verdicts."""
    names: dict[torch.device, list[str]] = {}
    flags: dict[torch.device, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            continue
        if id(t) in seen:  # a tied weight, under its second name
            continue
        seen.add(id(t))
        local = t.detach().to_local() if hasattr(t, "to_local") else t.detach()
        if local.numel() == 0:
            continue
        if local.is_complex():
            local = torch.view_as_real(local)
        low, high = torch.aminmax(local)
        names.setdefault(local.device, []).append(name)
        flags.setdefault(local.device, []).append(torch.isfinite(low) & torch.isfinite(high))
    return [name for device, fs in flags.items()
            for name, ok in zip(names[device], torch.stack(fs).tolist()) if not ok]


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
