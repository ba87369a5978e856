"""Hugging Face Trainer: ``CkptTrainer``, a drop-in ``transformers.Trainer`` that saves and
resumes through ckpt.

``TrainingArguments(save_steps=..., save_total_limit=...)`` keep their meaning. Each save
becomes a ckpt step ``step-<global_step>`` under ``output_dir`` (model, optimizer, scheduler,
gradient scaler, RNG, the trainer state with its data position), written in the background
and digested; ``output_dir/checkpoint-N/`` stays as HF's view of it: ``trainer_state.json``
and a pointer to the step (no weights: ``ckpt export output_dir --to hf DIR`` writes a
``from_pretrained`` folder; the model's config is saved with every step for it).

``train(resume_from_checkpoint=True)`` resumes from the newest ckpt step that loads cleanly
(a corrupt or unfinished newest one is skipped with a warning); a ``checkpoint-N`` path
resumes from step N (or the newest good one before it). Single process, or DDP where rank 0
saves (the RNG state saved is rank 0's).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

import ckpt
from ckpt.tools import POINTER_NAME, read_pointer, write_pointer

from ._steps import StepStore, load_newest_good, pickle_allowed

log = logging.getLogger("ckpt")

TRAINER_STATE_NAME = "trainer_state.json"
CONFIG_KEY = "hf_config"  # manifest metadata: the model's config.json, for `ckpt export --to hf`


class CkptTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints are ckpt steps (see the module docstring).

    Args:
        ckpt_options: passed to :class:`ckpt.CheckpointManager` (``async_save``,
            ``options=ckpt.SaveOptions(...)``...); schedule and retention are HF's.
        args, kwargs: as for ``transformers.Trainer``.
    """

    def __init__(self, *args: Any, ckpt_options: dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        StepStore.check_options(ckpt_options or {})
        self.ckpt_options = dict(ckpt_options or {})
        self._ckpt_store: StepStore | None = None
        self._ckpt_loaded: dict[str, Any] | None = None

    # -- saving ----------------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        if self.args.should_save:  # first, as HF does: the step being saved may be the best
            os.makedirs(folder, exist_ok=True)
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best):
                self.state.best_model_checkpoint = best
        self._update_stateful_callbacks()
        if not self.args.should_save:
            return
        unwrapped = self.accelerator.unwrap_model(self.model)
        state: dict[str, Any] = {"model": unwrapped,
                                 "trainer_state": self.state_json()}
        if not self.args.save_only_model:
            state.update(optimizer=self.optimizer, scheduler=self.lr_scheduler,
                         rng=ckpt.RNGState())
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
        config = getattr(unwrapped, "config", None)
        metadata = {CONFIG_KEY: json.loads(config.to_json_string())} if config is not None \
            else None
        store = self._store(run_dir)
        store.save(step, state, metadata=metadata)
        with open(os.path.join(folder, TRAINER_STATE_NAME), "w") as f:
            f.write(state["trainer_state"])
        write_pointer(os.path.join(folder, POINTER_NAME), step)
        rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint,
                           use_mtime=False)
        named = {read_pointer(os.path.join(run_dir, d, POINTER_NAME))
                 for d in os.listdir(run_dir) if d.startswith(PREFIX_CHECKPOINT_DIR)}
        store.retire(set(store.mgr.steps()) - named)

    def state_json(self) -> str:
        """The trainer state as HF writes it to ``trainer_state.json``."""
        return json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"

    def _update_stateful_callbacks(self) -> None:
        from transformers.trainer_callback import ExportableState

        for cb in [c for c in self.callback_handler.callbacks + [self.control]
                   if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()

    def _store(self, run_dir: str) -> StepStore:
        root = os.path.abspath(run_dir)
        if self._ckpt_store is not None and self._ckpt_store.root != root:
            self._ckpt_store.close()
            self._ckpt_store = None
        if self._ckpt_store is None:
            self._ckpt_store = StepStore(root, self.ckpt_options)
        return self._ckpt_store

    def wait_for_checkpoints(self) -> None:
        """Finish the save in flight (raising its error), delete dropped steps, unlock."""
        if self._ckpt_store is not None:
            store, self._ckpt_store = self._ckpt_store, None
            store.close()

    # -- resuming ---------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """As ``Trainer.train``; a resume reads the newest good ckpt step (module docstring).
        Waits for the last checkpoint's background write before returning."""
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            resume_from_checkpoint = self._resolve(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._ckpt_loaded = None
            self.wait_for_checkpoints()

    def _resolve(self, resume: str | bool) -> str | None:
        """Load the ckpt step to resume from; return its ``checkpoint-N`` folder for HF."""
        if resume is True:
            run_dir, step = os.path.abspath(self.args.output_dir), None
        else:
            folder = os.path.abspath(os.fspath(resume))
            step = read_pointer(os.path.join(folder, POINTER_NAME))
            if step is None:
                return resume  # a checkpoint of HF's own format: HF loads it
            run_dir = os.path.dirname(folder)
        if self._ckpt_store is not None:
            self._ckpt_store.mgr.wait()
        found = load_newest_good(run_dir, step, allow_pickle=pickle_allowed(self.ckpt_options))
        if found is None:
            raise ValueError(f"No valid checkpoint found in output directory ({run_dir})")
        loaded_step, self._ckpt_loaded = found
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{loaded_step}")
        os.makedirs(folder, exist_ok=True)
        # HF reads the trainer state from the folder: the verified copy from the step.
        tmp = os.path.join(folder, f".{TRAINER_STATE_NAME}.part")
        with open(tmp, "w") as f:
            f.write(self._ckpt_loaded["trainer_state"])
        os.replace(tmp, os.path.join(folder, TRAINER_STATE_NAME))
        write_pointer(os.path.join(folder, POINTER_NAME), loaded_step)
        log.info("ckpt: resuming from step %d under %s", loaded_step, run_dir)
        return folder

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: torch.nn.Module | None = None) -> None:
        if self._ckpt_loaded is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        target.load_state_dict(self._ckpt_loaded["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._ckpt_loaded is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if "optimizer" in self._ckpt_loaded:
            self.optimizer.load_state_dict(self._ckpt_loaded["optimizer"])
            self.lr_scheduler.load_state_dict(self._ckpt_loaded["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._ckpt_loaded is None or checkpoint is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and "scaler" in self._ckpt_loaded:
            scaler.load_state_dict(self._ckpt_loaded["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._ckpt_loaded is None or checkpoint is None:
            return super()._load_rng_state(checkpoint)
        if "rng" in self._ckpt_loaded:
            ckpt.RNGState().load_state_dict(self._ckpt_loaded["rng"])

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        step = read_pointer(os.path.join(best, POINTER_NAME)) if best else None
        if step is None:
            return super()._load_best_model()
        if self._ckpt_store is not None:
            self._ckpt_store.mgr.wait()
        path = os.path.join(os.path.dirname(best), ckpt.inspect.step_dir(step))
        try:  # that step only: an older one is not the best model
            saved = ckpt.load(path, allow_pickle=pickle_allowed(self.ckpt_options))
        except (ckpt.CorruptCheckpointError, ckpt.CheckpointNotFoundError) as e:
            log.warning("ckpt: the best checkpoint %s (step %d) cannot be loaded, so the model "
                        "stays as the last step left it (HF's Trainer does the same when it "
                        "cannot find the best model): %s", best, step, e)
            return
        self.accelerator.unwrap_model(self.model).load_state_dict(saved["model"])


__all__ = ["CkptTrainer"]
