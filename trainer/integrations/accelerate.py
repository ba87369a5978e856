"""Accelerate: ``CkptAccelerator``, an ``accelerate.Accelerator`` whose ``save_state()`` and
``load_state()`` go through ckpt.

``save_state`` saves every prepared model (unwrapped: names as in the plain module), optimizer,
scheduler, the gradient scaler, stateful data loaders (``use_stateful_dataloader=True``), the
objects given to ``register_for_checkpointing``, ``accelerator.step`` and each rank's RNG state
as one ckpt step, every rank writing its share.

Every folder Accelerate would write (``save_state("ckpts/epoch3")``, or ``checkpoint_<i>``
under ``project_dir/checkpoints`` with automatic naming) is a ckpt root of its own, holding
that folder's step: two folders never share a step, whatever the save iteration says, and a
folder's listing is the only thing the checkpoint adds to its parent. Saving into a folder
again replaces its step once the new one is committed (as Accelerate overwrites the folder).

``save_state`` returns with the step committed and the folder's lock released, as
Accelerate's returns with its files written. ``ckpt_options={"async_save": True}`` returns once
the state is copied to host memory; the write goes on, holding that folder's lock, until
``wait_for_checkpoints()``, ``end_training()``, the next save, a load of that folder or another
Accelerator of this process using it, or this Accelerator's garbage collection.

``load_state()`` (automatic naming) loads the newest ``checkpoint_<i>`` that loads cleanly,
skipping a corrupt or unfinished one with a warning, and sets the save iteration after it;
``load_state(folder)`` loads that folder's step. A folder of Accelerate's own format is loaded
by Accelerate. Models saved under FSDP or DeepSpeed plugins are not supported here (use
ckpt.ModelOptimizer in your own loop). ``register_save_state_pre_hook`` hooks are not called.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
import weakref
from typing import Any

import torch

from accelerate import Accelerator

import ckpt
from ckpt.tools import POINTER_NAME, read_pointer

from ._steps import StepStore, load_newest_good, pickle_allowed

CONFIG_KEY = "hf_config"
EPOCH = ".epoch"  # suffix of the item holding a prepared loader's epoch (its iteration)
_FOLDER = re.compile(r"^checkpoint_(\d+)$")
_STEP = re.compile(r"^step-(\d+)$")
log = logging.getLogger("ckpt")

# Asynchronous writes still in flight in this process, by folder: whoever uses that folder next
# (any Accelerator) finishes the write first, so Accelerators of one process never lock each
# other out.
_IN_FLIGHT: dict[str, StepStore] = {}


def _finish(folder: str) -> None:
    """Finish the asynchronous write into ``folder`` (raising its error), release its lock."""
    store = _IN_FLIGHT.pop(folder, None)
    if store is not None:
        store.close()


def _finish_quietly(folders: set[str]) -> None:
    """At an Accelerator's garbage collection: finish its writes, logging a failure."""
    for folder in list(folders):
        try:
            _finish(folder)
        except Exception:  # noqa: BLE001 (a finalizer cannot raise)
            log.exception("ckpt: the checkpoint write into %s failed", folder)


def _name(kind: str, i: int) -> str:
    return kind if i == 0 else f"{kind}_{i}"


def _steps_in(folder: str) -> list[int]:
    """The step folders (committed or not) a folder holds, in order."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _STEP.match(n)))


def _numbered(checkpoints: str) -> list[tuple[int, str]]:
    """The ``checkpoint_<i>`` folders under ``checkpoints``, oldest first."""
    try:
        names = os.listdir(checkpoints)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)), os.path.join(checkpoints, n))
                  for n in names if (m := _FOLDER.match(n)))


class CkptAccelerator(Accelerator):
    """An ``Accelerator`` that checkpoints through ckpt (see the module docstring).

    Args:
        ckpt_options: passed to :class:`ckpt.CheckpointManager` (``async_save=True``,
            ``options=ckpt.SaveOptions(...)``...); retention is ``total_limit``'s. Saves are
            synchronous unless ``async_save=True``; ckpt's SIGTERM handler is off unless
            ``schedule=ckpt.Schedule(handle_sigterm=True)``.
        args, kwargs: as for ``accelerate.Accelerator``.
    """

    def __init__(self, *args: Any, ckpt_options: dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        StepStore.check_options(ckpt_options or {})
        self.ckpt_options = {"async_save": False,
                             "schedule": ckpt.Schedule(handle_sigterm=False),
                             **(ckpt_options or {})}
        self.ckpt_loaded_step: int | None = None  # the step the last load_state() loaded
        self._ckpt_writing: set[str] = set()  # folders this Accelerator writes asynchronously
        self._ckpt_rotate: str | None = None  # a checkpoints folder to rotate once written
        self._ckpt_skipped: set[str] = set()  # folders load_state() skipped (corrupt, unfinished)
        weakref.finalize(self, _finish_quietly, self._ckpt_writing)

    def _ckpt_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for i, model in enumerate(self._models):
            state[_name("model", i)] = self.unwrap_model(model)
        for i, opt in enumerate(self._optimizers):
            state[_name("optimizer", i)] = opt
        for i, sched in enumerate(self._schedulers):
            state[_name("scheduler", i)] = sched
        for i, loader in enumerate(self._dataloaders):
            if getattr(loader, "use_stateful_dataloader", False):
                state[_name("dataloader", i)] = loader
                # the epoch seeds a seedable sampler's order; torchdata's state has no epoch
                state[_name("dataloader", i) + EPOCH] = getattr(loader, "iteration", 0)
        for i, obj in enumerate(self._custom_objects):
            state[f"custom_{i}"] = obj
        if self.scaler is not None:
            state["scaler"] = self.scaler
        state["rng"] = ckpt.RNGState()
        state["accelerator_step"] = self.step
        return state

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **kwargs: Any) -> str:
        """Save the state into its folder (a ckpt root); returns the folder. Returns once the
        step is committed, or with ``async_save=True`` once it is copied to host memory."""
        self.wait_for_checkpoints()  # one write in flight at a time; rotates what it finished
        if self.project_configuration.automatic_checkpoint_naming:
            checkpoints = os.path.abspath(os.path.join(self.project_dir, "checkpoints"))
            folder = os.path.join(checkpoints, f"checkpoint_{self.save_iteration}")
            if folder in self._ckpt_skipped:  # load_state found nothing loadable in it
                log.warning("ckpt: replacing %s, which load_state skipped", folder)
                _finish(folder)
                shutil.rmtree(folder)
            self._ckpt_skipped.discard(folder)
            if os.path.exists(folder):  # as Accelerate: never write over another checkpoint
                raise ValueError(
                    f"Checkpoint directory {folder} ({self.save_iteration}) already exists. "
                    "Please manually override `self.save_iteration` with what iteration to "
                    "start with.")
            step = self.save_iteration
        elif output_dir is None:
            raise ValueError("save_state() needs output_dir unless the ProjectConfiguration "
                             "has automatic_checkpoint_naming=True")
        else:
            checkpoints = None
            folder = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))
            _finish(folder)  # another Accelerator's write into this folder
            older = _steps_in(folder)
            step = older[-1] + 1 if older else 0
        models = self._ckpt_state()
        self._warn_unseedable()
        config = getattr(models.get("model"), "config", None)
        metadata = ({CONFIG_KEY: json.loads(config.to_json_string())}
                    if hasattr(config, "to_json_string") else None)
        store = StepStore(folder, self.ckpt_options, collective=True)
        try:
            store.save(step, models, metadata=metadata)
            store.retire(set(store.mgr.steps()) - {step})  # once the new step is committed
        except BaseException:
            store.close()
            raise
        self._ckpt_rotate = checkpoints
        if self.ckpt_options["async_save"]:
            _IN_FLIGHT[folder] = store
            self._ckpt_writing.add(folder)
        else:
            store.close()
            self._rotate()
        self.project_configuration.iteration += 1
        return folder

    def _warn_unseedable(self) -> None:
        """Warn (once) about a shuffled stateful loader whose order cannot be restored."""
        from accelerate.data_loader import SeedableRandomSampler

        if getattr(self, "_ckpt_warned", False):
            return
        for loader in self._dataloaders:
            sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
            if getattr(loader, "use_stateful_dataloader", False) and isinstance(
                    sampler, torch.utils.data.RandomSampler) and not isinstance(
                    sampler, SeedableRandomSampler):
                warnings.warn(
                    "a shuffled stateful DataLoader without use_seedable_sampler=True: "
                    "Accelerate saves its position but not its sampler's generator, so a "
                    "resumed epoch takes its batches from another order. Pass "
                    "DataLoaderConfiguration(use_stateful_dataloader=True, "
                    "use_seedable_sampler=True) and call accelerate.utils.set_seed(SEED) "
                    "before prepare()", RuntimeWarning, stacklevel=3)
                self._ckpt_warned = True
                return

    def _rotate(self) -> None:
        """Keep the newest ``total_limit`` checkpoint folders, once the newest is written
        (so a crash while saving still leaves the previous ones)."""
        checkpoints, self._ckpt_rotate = self._ckpt_rotate, None
        limit = self.project_configuration.total_limit
        if checkpoints is None or limit is None or not self.is_main_process:
            return
        folders = _numbered(checkpoints)
        for _, path in folders[:max(0, len(folders) - max(limit, 1))]:
            _finish(path)
            shutil.rmtree(path)

    def wait_for_checkpoints(self) -> None:
        """Finish this Accelerator's write in flight (raising its error), release its lock,
        then drop the checkpoint folders beyond ``total_limit``."""
        writing, failure = list(self._ckpt_writing), None
        self._ckpt_writing.clear()
        for folder in writing:
            try:
                _finish(folder)
            except BaseException as e:  # noqa: BLE001 (finish the others, raise the first)
                failure = failure or e
        if failure is not None:
            raise failure
        self._rotate()

    def end_training(self) -> None:
        self.wait_for_checkpoints()
        super().end_training()

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """Load ``input_dir``'s step, or the newest good checkpoint; see the module
        docstring."""
        if input_dir is not None:
            folder = os.path.abspath(os.path.expanduser(os.fspath(input_dir)))
            found = self._load_folder(folder)
            if found is None:
                return super().load_state(input_dir, **kwargs)
            if found is False:
                raise ValueError(f"no checkpoint was committed in {folder}")
            loaded_step, saved, root = found
        elif self.project_configuration.automatic_checkpoint_naming:
            checkpoints = os.path.abspath(os.path.join(self.project_dir, "checkpoints"))
            loaded = self._load_newest(checkpoints, **kwargs)
            if loaded is None:  # a folder of Accelerate's own format was loaded
                return None
            number, (loaded_step, saved, root) = loaded
            self.project_configuration.iteration = number + 1
        else:
            raise ValueError("load_state() needs input_dir unless the ProjectConfiguration "
                             "has automatic_checkpoint_naming=True")
        self._restore(loaded_step, saved, root)
        return None

    def _load_folder(self, folder: str) -> Any:
        """``(step, saved items, root)`` of a ckpt folder; False when it holds no committed
        step; None when it is not a ckpt folder (Accelerate's own format)."""
        _finish(folder)  # a write into it still in flight in this process
        allow = pickle_allowed(self.ckpt_options)
        step = read_pointer(os.path.join(folder, POINTER_NAME))
        if step is not None:  # a folder pointing at a step of its parent root
            root = os.path.dirname(folder)
            found = load_newest_good(root, step, allow_pickle=allow)
        elif _steps_in(folder):
            root, found = folder, load_newest_good(folder, None, allow_pickle=allow)
        else:
            return None
        return False if found is None else (*found, root)

    def _load_newest(self, checkpoints: str, **kwargs: Any) -> Any:
        """``(number, (step, saved, root))`` of the newest checkpoint folder that loads
        cleanly; None when the newest loadable one is of Accelerate's own format."""
        folders = _numbered(checkpoints)
        for number, folder in reversed(folders):
            try:
                found = self._load_folder(folder)
            except ckpt.CorruptCheckpointError as e:
                log.warning("ckpt: skipping %s: %s", folder, e)
                self._ckpt_skipped.add(folder)
                continue
            if found is None:
                super().load_state(folder, **kwargs)
                self.project_configuration.iteration = number + 1
                return None
            if found is False:
                log.warning("ckpt: skipping %s: no step in it was committed (the job stopped "
                            "while writing it)", folder)
                self._ckpt_skipped.add(folder)
                continue
            return number, found
        raise ValueError(f"no checkpoint under {checkpoints} could be loaded"
                         + ("" if folders else " (there is none)"))

    def _restore(self, loaded_step: int, saved: dict[str, Any], root: str) -> None:
        live = self._ckpt_state()
        # a step saved before ckpt recorded the loaders' epochs: their epoch stays
        missing = sorted(n for n in set(live) - set(saved) if not n.endswith(EPOCH))
        if missing:
            raise ckpt.StateMismatchError(
                f"step {loaded_step} under {root} has no {missing}: register the same objects "
                f"(models, optimizers, register_for_checkpointing) as the run that saved it")
        for name, obj in live.items():
            if name == "accelerator_step":
                self.step = saved[name]
            elif name.endswith(EPOCH):
                if name in saved:
                    live[name[:-len(EPOCH)]].iteration = saved[name]
            else:
                obj.load_state_dict(saved[name])
        self.ckpt_loaded_step = loaded_step


__all__ = ["CkptAccelerator"]
