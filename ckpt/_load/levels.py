"""The verification levels: what ``restore`` and ``load`` check besides loading, by level:

* ``"structure"``: the manifest is valid and every file it names is present with its
  recorded size; chunk digests are not computed, so a flipped bit in the data is loaded as
  it is. Faster (no hashing); for storage that checksums by itself.
* ``"digest"`` (the default): also every chunk read is checked against its xxh3 digest.
* ``"forward"``: also the probe recorded at save time (:class:`ckpt.Probe`) is rerun through
  the restored model (:func:`ckpt._load.probe.check_model`): a step saved whole but bad (weights
  gone NaN before the save, a model whose code changed) fails like a digest mismatch. A
  step saved without a probe passes with a logged warning.

At the forward level a copy of every ``nn.Module``'s tensors in the state is kept (on the
CPU) while the restore runs, and put back when it raises: the model is never left holding a
step that failed its check.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from ckpt._shared.distributed import Group
from ckpt.errors import ForwardCheckError
from ckpt._format.manifest import Manifest
from ckpt._load.probe import PROBE_ITEM, ProbeFailure, check_model, model_of
from ckpt._shared.sharding import dtensor_type
from ckpt._shared.state import item_tree

log = logging.getLogger("ckpt")

LEVELS = ("structure", "digest", "forward")
ACCEPT_HINT = ('to accept the saved weights with the model as it is now, restore with '
               'verify="digest" (and save with a fresh probe)')


def verify_level(verify: Any) -> str:
    """The level named by ``verify``: one of :data:`LEVELS` (True/False mean digest/structure,
    as ``ckpt.load``'s flag did)."""
    if verify is True or verify is False:
        return "digest" if verify else "structure"
    if verify not in LEVELS:
        raise ValueError(f"verify must be one of {', '.join(map(repr, LEVELS))}, "
                         f"not {verify!r}")
    return verify


class Gate:
    """One restore's checks beyond loading; a context manager that puts the models back when
    the restore raises (forward level only)."""

    def __init__(self, level: str, state: MutableMapping[str, Any]) -> None:
        self.level = level
        self.digests = level != "structure"
        self.forward = level == "forward"
        self.failed: dict[int, ProbeFailure] = {}  # steps that failed here, oldest last
        self._state = state
        self._backup: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._target: _WithProbe | None = None

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        if error is not None:
            self.put_back()

    def target(self, manifest: Manifest) -> MutableMapping[str, Any]:
        """The mapping to load the step into: the state, plus a slot for the probe at the
        forward level (so one load reads it, digests checked, with everything else)."""
        if not self.forward:
            return self._state
        if self._backup is None:
            self._backup = _copy_modules(self._state)
        self._target = None
        if PROBE_ITEM in manifest.items and PROBE_ITEM not in self._state:
            self._target = _WithProbe(self._state)
            return self._target
        return self._state

    def agree(self, group: Group, loaded: bool) -> bool:
        """Whether every rank loaded the step: at the forward level, ranks run the probe all
        or none (a forward may hold collectives). Call once per step on every rank."""
        if not self.forward or not group.enabled:
            return loaded
        return all(group.all_gather(loaded))

    def check(self, step: int | None, manifest: Manifest, group: Group | None = None,
              where: str = "") -> ForwardCheckError | None:
        """Run the step's probe through the restored model (forward level; after a load that
        succeeded on this rank). Returns the failure, or None when it passed or could not
        run (no probe, no model in the state: logged)."""
        if not self.forward or (group is not None and not self.agree(group, True)):
            return None
        name = f"step {step}" if step is not None else where
        if PROBE_ITEM not in manifest.items:
            log.warning("ckpt.restore %s has no probe: the forward check was skipped "
                        "(digests were checked); save with CheckpointManager(probe="
                        "ckpt.Probe(...)) to record one", name)
            return None
        probe = self._target.probe if self._target is not None else self._state.get(PROBE_ITEM)
        damaged = damaged_probe(probe)
        if damaged is not None:
            failure = ProbeFailure(f"the probe item is damaged: {damaged}")
        else:
            model_key = probe.get("model_key") or item_tree(manifest.items[PROBE_ITEM]).get(
                "model_key")
            model = model_of(self._state.get(model_key))
            if model is None:
                log.warning("ckpt.restore %s: the probe's model %r is not an nn.Module of the "
                            "state being restored: the forward check was skipped", name,
                            model_key)
                return None
            failure = check_model(model, probe)
        if failure is None:
            log.info("ckpt.restore %s passed the forward check", name)
            return None
        if step is not None:
            self.failed[step] = failure
        hint = f"; if the model's code changed on purpose, {ACCEPT_HINT}" if (
            failure.mismatch) else ""
        return ForwardCheckError(f"{where or name}: the forward check failed: "
                                 f"{failure.reason}{hint}", path=where or None)

    def all_failed(self, root: str, failures: list[str]) -> None:
        """Every step failed: put the models back, and raise the forward level's summary
        when every step failed its forward check here (else the caller raises its own)."""
        self.put_back()
        if not self.forward or not failures or len(self.failed) != len(failures):
            return
        lines = "\n  ".join(f"step {s}: {f.reason}" for s, f in self.failed.items())
        if all(f.mismatch for f in self.failed.values()):
            diffs = {s: f.max_abs_diff for s, f in self.failed.items()
                     if f.max_abs_diff is not None}
            worst = (f", largest |diff| {max(diffs.values()):.3g} (step "
                     f"{max(diffs, key=diffs.get)})" if diffs else "")
            raise ForwardCheckError(
                f"the probe's output differs from the one recorded at save time at every "
                f"step under {root}{worst}: the model's code has changed since these steps "
                f"were saved (the weights load, but compute something else). Nothing was "
                f"restored into the model; {ACCEPT_HINT}.\n  {lines}", path=root)
        raise ForwardCheckError(
            f"no committed step under {root} passed the forward check (verify=\"forward\"); "
            f"nothing was restored into the model:\n  {lines}", path=root)

    def put_back(self) -> None:
        """The models' tensors as they were before the restore (forward level)."""
        if not self._backup:
            return
        with torch.no_grad():
            for live, saved in self._backup:
                live.copy_(saved)


def damaged_probe(probe: Any) -> str | None:
    """What is wrong with a loaded probe item's inputs or output (a hand-edited or damaged
    manifest), or None."""
    if not isinstance(probe, dict):
        return f"it is a {type(probe).__name__}, not the recorded fields"
    if "output" not in probe:
        return "it has no recorded output"
    if "inputs" not in probe:
        return "it has no recorded inputs"
    if not isinstance(probe.get("output"), torch.Tensor):
        return f"its recorded output is a {type(probe.get('output')).__name__}, not a tensor"
    if "output_index" in probe:
        return _damaged_sample(probe)
    return None


def _damaged_sample(probe: dict) -> str | None:
    """What is wrong with a sampled probe's positions, shape and sums (they index the rerun's
    output: a hand-edited manifest must not point outside it), or None."""
    index, shape, sums = probe["output_index"], probe.get("output_shape"), probe.get("output_sums")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                              and d >= 0 for d in shape):
        return f"its recorded output shape is {shape!r}, not a list of sizes"
    if not (isinstance(index, torch.Tensor) and index.dtype == torch.int64 and index.dim() == 1
            and index.shape == probe["output"].shape):
        return "its recorded output positions are not one int64 position per sampled value"
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= math.prod(shape)):
        return f"its recorded output positions fall outside an output of shape {shape}"
    if not (isinstance(sums, list) and len(sums) == 2 and all(
            isinstance(v, float) for v in sums)):
        return "its recorded output sums are not two numbers"
    return None


def _copy_modules(state: MutableMapping[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(live tensor, CPU copy) for each parameter and buffer of every module in the state
    (local shards of DTensors); a load copies into these same tensors."""
    dtensor = dtensor_type()
    seen: set[int] = set()
    copies = []
    for value in list(state.values()):
        module = model_of(value)
        if module is None:
            continue
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            local = t.to_local() if dtensor is not None and isinstance(t, dtensor) else t
            local = local.detach()
            copies.append((local, local.to("cpu", copy=True)))
    return copies


class _WithProbe(MutableMapping):
    """The caller's state plus a slot for the probe item, which the caller did not ask for."""

    def __init__(self, state: MutableMapping[str, Any]) -> None:
        self.state = state
        self.probe: Any = None

    def __getitem__(self, key: str) -> Any:
        return self.probe if key == PROBE_ITEM else self.state[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == PROBE_ITEM:
            self.probe = value
        else:
            self.state[key] = value

    def __delitem__(self, key: str) -> None:
        del self.state[key]

    def __iter__(self) -> Iterator[str]:
        yield from self.state
        yield PROBE_ITEM

    def __len__(self) -> int:
        return len(self.state) + 1
