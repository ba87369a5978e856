"""The ``forward`` level of ``ckpt verify``: load the step into a fresh model and rerun the
probe recorded at save time (:class:`ckpt.Probe`).

1. Build a fresh model with the factory: ``--model module.path:callable``, or the factory the
   probe recorded when the caller opts in (``--trust-recorded``): importing and calling a
   module a checkpoint names runs code, so, as with pickle, nothing named by a checkpoint is
   imported unless asked. The module is imported with the current directory on ``sys.path``
   (as ``python -m`` does).
2. Load the probe's model item into it (``ckpt.inspect.Checkpoints.load``: atomic, digests
   checked, no pickle); the probe's recorded inputs, output and loss come back with it.
3. Every floating-point weight must be finite; a NaN or Inf is reported naming the tensor
   and the data file of the chunk that holds it.
4. Rerun the forward (``ckpt.inspect.run_forward``) and compare with the recorded output:
   ``|new - recorded| <= atol + rtol * |recorded|`` element-wise (``torch.allclose``), with
   the tolerance of the output's dtype (:data:`ckpt.inspect.TOLERANCES`, shared with
   ``restore(..., verify="forward")``); NaN or Inf in the new output is
   a failure. The loss is compared the same way when the probe recorded one and a loss
   function is known (``--loss module:callable``).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import re
import sys
import time
from typing import Any, Callable, Iterator

import torch

import ckpt
# TOLERANCES is re-exported by verify/__init__.py (its table lives in ckpt._load.probe, for restore)
from ckpt.inspect import (PROBE_ITEM, TOLERANCES, Checkpoints, Manifest,  # noqa: F401
                          compared_outputs, damaged_probe, item_tree, run_forward,
                          sums_outside, tensor_leaves, tolerance_for)

from .report import Problem, UsageError, count, number

_SPEC = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")
NO_PROBE_HINT = (
    "record one by saving with a probe: ckpt.CheckpointManager(root, options=ckpt.SaveOptions("
    "probe=ckpt.Probe(model_key='model', inputs=<a small batch>, factory='mypkg.models:build'))); "
    "the structure and digest levels need no probe")


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    """The current directory first on ``sys.path`` while the factory is imported and run."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def resolve(spec: str, what: str = "--model") -> Callable[..., Any]:
    """``"pkg.module:name"`` (``name`` may be dotted) -> the callable it names.

    Raises:
        UsageError: a malformed spec, a module that cannot be imported, a missing name.
    """
    m = _SPEC.match(spec) if isinstance(spec, str) else None
    if m is None:
        raise UsageError(f"{what} {spec!r} is not of the form module.path:callable")
    with _cwd_on_path():
        try:
            obj: Any = importlib.import_module(m.group(1))
        except Exception as e:
            raise UsageError(
                f"cannot import {m.group(1)!r} for {what} {spec!r}: {type(e).__name__}: {e}; "
                "run from the directory that holds it or add it to PYTHONPATH") from e
    for attr in m.group(2).split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise UsageError(f"{what} {spec!r}: {m.group(1)} has no {m.group(2)!r}") from None
    if not callable(obj):
        raise UsageError(f"{what} {spec!r} is not callable")
    return obj


def build_model(model: Any, recorded: str | None,
                trust_recorded: bool = False) -> tuple[torch.nn.Module, str]:
    """A fresh model from ``model`` (spec, callable or module), else the recorded factory
    when ``trust_recorded``."""
    if model is None:
        if recorded is None:
            raise UsageError("the probe recorded no factory: pass --model module.path:callable "
                             "(a function returning a fresh model of the saved architecture)")
        if not trust_recorded:
            raise UsageError(f"the probe records the factory {recorded!r}; a factory a "
                             "checkpoint names is imported and run only when asked (it runs "
                             f"code, as pickle does): pass --model {recorded} to use it, or "
                             "--trust-recorded for checkpoints you trust")
        model = recorded
    if isinstance(model, torch.nn.Module):
        return model, type(model).__qualname__
    name = model if isinstance(model, str) else getattr(model, "__qualname__", repr(model))
    try:
        factory = (resolve(model, "--model" if model is not recorded else "factory")
                   if isinstance(model, str) else model)
    except UsageError as e:
        if model is not recorded:
            raise
        raise UsageError(f"the probe's recorded factory: {_unimportable(e, recorded)}; pass "
                         "--model module.path:callable") from e
    with _cwd_on_path():
        try:
            built = factory()
        except Exception as e:
            raise UsageError(f"the model factory {name} raised {type(e).__name__}: {e}") from e
    if not isinstance(built, torch.nn.Module):
        raise UsageError(f"the model factory {name} returned a {type(built).__name__}, "
                         "not a torch.nn.Module")
    return built, name


def check_forward(cps: Checkpoints, step: int, manifest: Manifest, *,
                  model: Any = None, loss: Any = None, rtol: float | None = None,
                  atol: float | None = None,
                  trust_recorded: bool = False) -> tuple[list[Problem], dict[str, Any]]:
    """Run the forward level on ``step``; returns (problems, figures). ``trust_recorded``:
    import and run the factory and loss function the probe recorded when ``model`` and
    ``loss`` are not given (code a checkpoint names: only for checkpoints you trust).

    Raises:
        UsageError: no probe in the step, no usable factory, or a model that does not fit.
    """
    t0 = time.perf_counter()
    where = cps.step_url(step)
    item = manifest.items.get(PROBE_ITEM)
    tree = item_tree(item) if item is not None else None
    if not isinstance(tree, dict) or not isinstance(tree.get("model_key"), str):
        raise UsageError(f"step {step} has no probe, so the forward level cannot run: "
                         + NO_PROBE_HINT)
    model_key = tree["model_key"]
    net, factory = build_model(model, tree.get("factory"), trust_recorded)
    state: dict[str, Any] = {model_key: net, PROBE_ITEM: None}
    try:
        cps.load(state, step)
    except ckpt.StateMismatchError as e:
        raise UsageError(f"the model built by {factory} does not fit step {step}: {e}") from e
    except ckpt.CorruptCheckpointError as e:
        return [Problem("weights", str(e), e.path)], {"factory": factory}
    probe = state[PROBE_ITEM]
    damaged = _damaged_probe(probe)
    if damaged is not None:
        return [Problem("output", f"{where}: the probe item is damaged: {damaged}", where)], \
            {"factory": factory}
    problems = nonfinite_weights(cps, step, net, manifest, model_key)
    loss_fn, loss_note = _loss_function(loss, probe.get("loss_fn"), trust_recorded)
    try:
        output, loss_now = run_forward(net, probe["inputs"],
                                       None if loss_fn is None else _LossCall(loss_fn))
    except _LossFailed as e:
        raise UsageError(f"the loss function {e.name} raised {type(e.error).__name__}: "
                         f"{e.error} on the probe's output; fix it or pass another with "
                         "--loss module.path:callable") from e.error
    except Exception as e:  # the user's model code, not the checkpoint's bytes
        raise UsageError(f"the forward pass of the model built by {factory} on the probe's "
                         f"inputs raised {type(e).__name__}: {e}") from e
    recorded = probe["output"]
    r, a = tolerance_for(recorded.dtype)
    r, a = (r if rtol is None else rtol), (a if atol is None else atol)
    figures: dict[str, Any] = {
        "factory": factory, "model_key": model_key, "output_shape": list(output.shape),
        "output_dtype": str(output.dtype).removeprefix("torch."), "rtol": r, "atol": a,
        "max_abs_diff": None, "max_rel_diff": None, "mismatched": None,
        "loss_recorded": probe.get("loss"), "loss_now": loss_now, "loss_note": loss_note}
    compared = compared_outputs(probe, output)
    if isinstance(compared, str):
        problems.append(Problem("output", f"{where}: {compared}: the model does not match the "
                                "one that was saved", where))
    else:
        problems += compare_output(*compared, r, a, where, figures, whole=output)
        sums = sums_outside(probe, output, r, a)
        if sums is not None and not problems:
            problems.append(Problem("output", f"{where}: {sums}", where))
    if "output_index" in probe:
        figures["sampled"] = int(probe["output_index"].numel())
    if loss_fn is not None:
        problems += _compare_loss(probe.get("loss"), loss_now, r, a, where)
    figures["seconds"] = time.perf_counter() - t0
    return problems, figures


def _damaged_probe(probe: Any) -> str | None:
    """What is wrong with a loaded probe item (a hand-edited or damaged manifest), or None:
    ckpt._load.levels's check, then the recorded loss, which only this level uses."""
    damaged = damaged_probe(probe)
    if damaged is not None:
        return damaged
    loss = probe.get("loss")
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
        return f"its recorded loss is a {type(loss).__name__}, not a number"
    return None


def nonfinite_weights(cps: Checkpoints, step: int, net: torch.nn.Module, manifest: Manifest,
                      model_key: str) -> list[Problem]:
    """One problem per stored tensor of the model holding NaN or Inf, naming the tensor and
    the data file of each chunk that holds a non-finite value."""
    where = cps.step_url(step)
    leaves = tensor_leaves(item_tree(manifest.items.get(model_key, {})))
    names_of: dict[str, list[str]] = {}
    values: dict[str, torch.Tensor] = {}
    for name, value in net.state_dict().items():
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point()
                                                       or value.is_complex()):
            continue
        key = leaves.get(name)
        key = manifest.resolve(key) if key else f"{model_key}/{name}"
        names_of.setdefault(key, []).append(name)
        values[key] = value
    problems = []
    for key, value in values.items():
        bad = ~torch.isfinite(value)
        if not bad.any():
            continue
        nan, total = int(torch.isnan(value).sum()), int(bad.sum())
        first = [int(i) for i in torch.nonzero(bad)[0]] if value.dim() else []
        files = _files_holding(cps, step, manifest, key, bad)
        names = " = ".join(names_of[key])
        problems.append(Problem(
            "weights", f"{files[0] if files else where}: weight {key} ({names}) has {nan} NaN "
            f"and {total - nan} Inf of {count(value.numel(), 'value')} (first at index {first})"
            + (f"; also in {', '.join(files[1:])}" if len(files) > 1 else ""),
            files[0] if files else where))
    return problems


def _files_holding(cps: Checkpoints, step: int, manifest: Manifest, key: str,
                   bad: torch.Tensor) -> list[str]:
    entry = manifest.tensors.get(key)
    if entry is None:
        return []
    files = []
    for c in entry.chunks:
        box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.shape))
        if c.numel and bool(bad[box].any()):
            path = cps.url_of(cps.chunk_path(step, c))
            if path not in files:
                files.append(path)
    return files


def compare_output(output: torch.Tensor, recorded: torch.Tensor, rtol: float, atol: float,
                   where: str, figures: dict[str, Any],
                   whole: torch.Tensor | None = None) -> list[Problem]:
    """The rerun's output against the recorded one (or the recorded sample's positions of
    it, ``whole`` being the rerun's whole output); fills the figures it measures. A NaN on
    either side is never "no difference": the figures then say nan, and NaN/Inf in the
    rerun's output is a problem of its own."""
    if output.shape != recorded.shape:
        return [Problem("output", f"{where}: the forward output has shape "
                        f"{list(output.shape)}, the recorded one {list(recorded.shape)}: "
                        "the model does not match the one that was saved", where)]
    problems = []
    whole = output if whole is None else whole
    bad = ~torch.isfinite(whole) if whole.is_floating_point() or whole.is_complex() else None
    if bad is not None and bool(bad.any()):
        problems.append(Problem("output", f"{where}: the forward output on the probe's inputs "
                                f"has {int(bad.sum())} NaN/Inf of "
                                f"{count(whole.numel(), 'value')}",
                                where))
    new = output.to(torch.complex128 if output.is_complex() else torch.float64)
    old = recorded.to(new.dtype)
    diff = (new - old).abs()
    nan = torch.isnan(diff)
    # NaN on both sides is reported above as NaN/Inf in the output, not as a difference
    both_nan = torch.isnan(new) & torch.isnan(old) if new.is_floating_point() else None
    limit = atol + rtol * old.abs()
    outside = torch.nan_to_num(diff, nan=math.inf) > torch.nan_to_num(limit, nan=0.0)
    if both_nan is not None:
        outside &= ~both_nan
    scale = old.abs()
    rel = torch.where(scale > atol, diff / scale.clamp_min(atol or 1e-300), 0.0)
    has_nan = bool(nan.any())
    figures["max_abs_diff"] = math.nan if has_nan else (
        float(diff.max()) if diff.numel() else 0.0)
    figures["max_rel_diff"] = math.nan if has_nan else (  # where |old| > atol
        float(rel.max()) if rel.numel() else 0.0)
    figures["mismatched"] = int(outside.sum())
    if bool(outside.any()):
        index = [int(i) for i in torch.nonzero(outside)[0]] if outside.dim() else []
        problems.append(Problem(
            "output", f"{where}: the forward output differs from the one recorded at save "
            f"time in {int(outside.sum())} of {count(output.numel(), 'value')}: max |diff| "
            f"{number(figures['max_abs_diff'])} (first outside at index {index}), tolerance "
            f"rtol={rtol:g} atol={atol:g} for {figures['output_dtype']}", where))
    return problems


def _loss_function(loss: Any, recorded: Any,
                   trust_recorded: bool) -> tuple[Callable | None, str | None]:
    """The loss function to recheck the recorded loss with, or (None, why not). A recorded
    one that is not trusted, or cannot be imported here (defined in the training script,
    ``__main__``), leaves the loss unchecked rather than failing the level; a bad ``--loss``
    is an error."""
    if loss is not None:
        return (resolve(loss, "--loss") if isinstance(loss, str) else loss), None
    if not isinstance(recorded, str):
        return recorded, None
    if not trust_recorded:
        return None, (f"the probe's recorded loss function {recorded!r} was not run (code a "
                      f"checkpoint names runs only when asked): pass --loss {recorded}, or "
                      "--trust-recorded")
    try:
        return resolve(recorded, "loss function"), None
    except UsageError as e:
        return None, (f"the probe's recorded loss function: {_unimportable(e, recorded)}; "
                      "pass --loss module.path:callable")


def _unimportable(error: UsageError, spec: str) -> str:
    """Why a recorded ``module:callable`` cannot be used here; a training script's own
    function (``__main__``) is the usual case."""
    if spec.startswith("__main__:"):
        return f"{spec} was defined in the training script, so it cannot be imported here"
    return str(error)


class _LossFailed(Exception):
    def __init__(self, name: str, error: Exception) -> None:
        super().__init__(name, error)
        self.name, self.error = name, error


class _LossCall:
    """The loss function, its failures (or a value that is no number) told apart from the
    model's."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.name = getattr(fn, "__module__", "?") + ":" + getattr(fn, "__qualname__", "?")

    def __call__(self, output: Any, inputs: Any) -> float:
        try:
            return float(self.fn(output, inputs))
        except Exception as e:
            raise _LossFailed(self.name, e) from e


def _compare_loss(recorded: Any, now: float | None, rtol: float, atol: float,
                  where: str) -> list[Problem]:
    if recorded is None:
        return []
    if now is None or not math.isfinite(now):  # run_forward reports a NaN loss as None
        return [Problem("loss", f"{where}: the probe's loss is {'nan' if now is None else now}"
                        f" now, {recorded:.6g} was recorded", where)]
    if not math.isclose(now, float(recorded), rel_tol=rtol, abs_tol=atol):
        return [Problem("loss", f"{where}: the probe's loss is {now:.6g}, {recorded:.6g} was "
                        f"recorded (rtol={rtol:g} atol={atol:g})", where)]
    return []
