"""Accelerate: ``CkptAccelerator``, an ``accelerate.Accelerator`` whose ``save_state()`` and
``load_state()`` go through ckpt.

``save_state`` saves every prepared model (unwrapped: names as in the plain module), optimizer,
scheduler, the gradient scaler, stateful data loaders (``use_stateful_dataloader=True``), the
objects given to ``register_for_checkpointing``, ``accelerator.step`` and each rank's RNG state
as one ckpt step, in the background, every rank writing its share. The step is the save
iteration (``checkpoint_<iteration>``, as Accelerate names its folders); the folder Accelerate
would have written holds a pointer to the step. ``ProjectConfiguration(total_limit=...)``
keeps its meaning.

``load_state()`` (automatic checkpoint naming) loads the newest step that loads cleanly,
skipping a corrupt or unfinished newest one with a warning, and sets the save iteration after
it; ``load_state(folder)`` loads that folder's step (or the newest good one before it). A
folder of Accelerate's own format is loaded by Accelerate. Models saved under FSDP or
DeepSpeed plugins are not supported here (use ckpt.ModelOptimizer in your own loop).
``register_save_state_pre_hook`` hooks are not called (they edit Accelerate's own files).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Any

import torch

from accelerate import Accelerator

import ckpt
from ckpt.tools import POINTER_NAME, read_pointer, write_pointer

from ._steps import StepStore, load_newest_good, pickle_allowed

CONFIG_KEY = "hf_config"
EPOCH = ".epoch"  # suffix of the item holding a prepared loader's epoch (its iteration)
_FOLDER = re.compile(r"^checkpoint_(\d+)$")


def _name(kind: str, i: int) -> str:
    return kind if i == 0 else f"{kind}_{i}"


class CkptAccelerator(Accelerator):
    """An ``Accelerator`` that checkpoints through ckpt (see the module docstring).

    Args:
        ckpt_options: passed to :class:`ckpt.CheckpointManager` (``async_save``,
            ``options=ckpt.SaveOptions(...)``...); retention is ``total_limit``'s.
        args, kwargs: as for ``accelerate.Accelerator``.
    """

    def __init__(self, *args: Any, ckpt_options: dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        StepStore.check_options(ckpt_options or {})
        self.ckpt_options = dict(ckpt_options or {})
        self._ckpt_store: StepStore | None = None
        self.ckpt_loaded_step: int | None = None  # the step the last load_state() loaded

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
        """Save the state as ckpt step ``save_iteration``; returns the checkpoint folder.
        Returns once the state is copied to host memory; the write goes on in the background
        (``wait_for_checkpoints()`` or the next save raises its error)."""
        if self.project_configuration.automatic_checkpoint_naming:
            root = os.path.join(self.project_dir, "checkpoints")
            folder = os.path.join(root, f"checkpoint_{self.save_iteration}")
        elif output_dir is None:
            raise ValueError("save_state() needs output_dir unless the ProjectConfiguration "
                             "has automatic_checkpoint_naming=True")
        else:
            folder = os.path.abspath(os.path.expanduser(os.fspath(output_dir)))
            root = os.path.dirname(folder)
        root = os.path.abspath(root)
        step = self.save_iteration
        store = self._store(root)
        models = self._ckpt_state()
        self._warn_unseedable()
        config = getattr(models.get("model"), "config", None)
        metadata = ({CONFIG_KEY: json.loads(config.to_json_string())}
                    if hasattr(config, "to_json_string") else None)
        store.save(step, models, metadata=metadata)
        if self.is_main_process:
            os.makedirs(folder, exist_ok=True)
            write_pointer(os.path.join(folder, POINTER_NAME), step)
            if self.project_configuration.automatic_checkpoint_naming:
                store.retire(self._rotate(root))
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

    def _rotate(self, root: str) -> set[int]:
        """Keep the newest ``total_limit`` checkpoint folders; the steps no folder names."""
        limit = self.project_configuration.total_limit
        folders = sorted((int(m.group(1)), name) for name in os.listdir(root)
                         if (m := _FOLDER.match(name)))
        if limit is not None and len(folders) > limit:
            for _, name in folders[:len(folders) - limit]:
                path = os.path.join(root, name)
                if read_pointer(os.path.join(path, POINTER_NAME)) is not None:
                    shutil.rmtree(path)
        named = {read_pointer(os.path.join(root, name, POINTER_NAME))
                 for name in os.listdir(root) if _FOLDER.match(name)}
        return set(self._store(root).mgr.steps()) - named

    def _store(self, root: str) -> StepStore:
        if self._ckpt_store is not None and self._ckpt_store.root != root:
            self._ckpt_store.close()
            self._ckpt_store = None
        if self._ckpt_store is None:
            self._ckpt_store = StepStore(root, self.ckpt_options, collective=True)
        return self._ckpt_store

    def wait_for_checkpoints(self) -> None:
        """Finish the save in flight (raising its error), delete dropped steps, unlock."""
        if self._ckpt_store is not None:
            store, self._ckpt_store = self._ckpt_store, None
            store.close()

    def end_training(self) -> None:
        self.wait_for_checkpoints()
        super().end_training()

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """Load the newest good step (or ``input_dir``'s); see the module docstring."""
        if input_dir is not None:
            folder = os.path.abspath(os.path.expanduser(os.fspath(input_dir)))
            step = read_pointer(os.path.join(folder, POINTER_NAME))
            if step is None:
                return super().load_state(input_dir, **kwargs)
            root = os.path.dirname(folder)
        elif self.project_configuration.automatic_checkpoint_naming:
            root, step = os.path.abspath(os.path.join(self.project_dir, "checkpoints")), None
        else:
            raise ValueError("load_state() needs input_dir unless the ProjectConfiguration "
                             "has automatic_checkpoint_naming=True")
        if self._ckpt_store is not None:
            self._ckpt_store.mgr.wait()
        found = load_newest_good(root, step, allow_pickle=pickle_allowed(self.ckpt_options))
        if found is None:
            raise ValueError(f"no checkpoint was committed under {root}")
        loaded_step, saved = found
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
        if self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration = loaded_step + 1
        self.ckpt_loaded_step = loaded_step


__all__ = ["CkptAccelerator"]
