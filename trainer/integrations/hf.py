"""Hugging Face Trainer: ``CkptTrainer``, a drop-in ``transformers.Trainer`` that saves and
resumes through ckpt while keeping HF's checkpoint folders.

``output_dir/checkpoint-N/`` holds what HF's ``Trainer`` writes there, so HF's tools read it
(``AutoModelForCausalLM.from_pretrained("out/checkpoint-N")``, ``get_last_checkpoint``,
``save_total_limit``): the model as HF saves it, written once, in the background from a host
copy; the optimizer's state goes through ckpt (async, digested) into step N of the hidden
sibling root ``.out.ckpt``, whose manifest also records the model files' digests.
``optimizer.pt`` is a small file naming that step (see :mod:`._hf_folder`).

``train(resume_from_checkpoint=True)`` picks the folder HF would (the highest
``checkpoint-N``); one whose step is unfinished, missing or fails a digest is skipped with a
warning for the one before it. Signals stay HF's (``enable_jit_checkpoint``): ckpt installs
no SIGTERM handler. Single process, or DDP where rank 0 saves (the RNG state saved is rank 0's).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import re
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

import ckpt
import ckpt.inspect
import ckpt.tools

from . import _hf_folder as hff
from ._steps import StepStore, check_own_root, load_newest_good, pickle_allowed

log = logging.getLogger("ckpt")

TRAINER_STATE_NAME = "trainer_state.json"
CONFIG_KEY = "hf_config"  # manifest metadata: the model's config.json, for `ckpt export --to hf`
JIT_SENTINEL = "checkpoint-is-incomplete.txt"  # HF's JIT checkpoint marks its folder with it
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # a storage URL, file:// included


class CkptTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints go through ckpt (see the module docstring).

    Args:
        ckpt_options: passed to :class:`ckpt.CheckpointManager` (``async_save``,
            ``options=ckpt.SaveOptions(...)``...); schedule and retention are HF's.
        ckpt_root: ckpt's root (default: ``.<output_dir name>.ckpt`` next to ``output_dir``).
        args, kwargs: as for ``transformers.Trainer``.
    """

    def __init__(self, *args: Any, ckpt_options: dict | None = None,
                 ckpt_root: str | None = None, **kwargs: Any) -> None:
        if ckpt_root is not None and _URL.match(os.fspath(ckpt_root)):
            # abspath would make it a local folder named after the URL (``./s3:/bucket``):
            # checkpoints the user believes off the node would stay on its disk.
            raise ValueError(
                f"CkptTrainer(ckpt_root={ckpt_root!r}): ckpt's root for HF checkpoints is a "
                "local folder (its resume lists the folders beside it), not a URL; give a "
                "local folder, or leave ckpt_root out for the hidden sibling of output_dir")
        super().__init__(*args, **kwargs)
        options = dict(ckpt_options or {})
        StepStore.check_options(options)
        # SIGTERM is HF's (its JIT checkpoint, or the default exit): ckpt installs no handler.
        options.setdefault("schedule", ckpt.Schedule(handle_sigterm=False))
        # The writer thread is the asynchrony (the host copies are taken before it runs), so
        # ckpt saves from it synchronously, without copying again; async_save=False makes
        # every checkpoint wait for its write.
        self._ckpt_sync = options.pop("async_save", True) is False
        options["async_save"] = False
        self.ckpt_options = options
        self.ckpt_root = ckpt_root
        self._ckpt_store: StepStore | None = None
        self._ckpt_writer: hff.FolderWriter | None = None
        self._ckpt_run_dir = ""
        self._ckpt_host = hff.HostCopies()
        self._ckpt_loaded: dict[str, Any] | None = None

    def ckpt_root_for(self, run_dir: str) -> str:
        """ckpt's root for ``run_dir``'s checkpoints (the default one checked: a link or a
        folder of another user's there raises ``CheckpointError``)."""
        if self.ckpt_root:
            return os.path.abspath(self.ckpt_root)
        root = hff.root_for(run_dir)
        check_own_root(root, run_dir, "give CkptTrainer(ckpt_root=...) a folder of yours")
        return root

    # -- saving ----------------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        if self._ckpt_writer is not None:
            # The write before (and its folder rotation) ends before this folder exists:
            # the rotation must not count a folder whose checkpoint is not yet written.
            self._ckpt_writer.wait()
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
        store = self._store(run_dir)
        self._ckpt_writer.wait()  # one checkpoint in flight: never two host copies at once
        # The training thread takes host copies (what ckpt's own async save blocks for); the
        # writer thread writes the model as HF does, digests it, then saves the ckpt step.
        model_sd = self._ckpt_host.copy(self.model.state_dict(), "model")
        items: dict[str, Any] = {"trainer_state": self.state_json()}
        if not self.args.save_only_model:
            optimizer = self._ckpt_host.copy(self.optimizer.state_dict(), "optimizer")
            items.update(optimizer=hff.Captured(optimizer),
                         scheduler=hff.Captured(copy.deepcopy(self.lr_scheduler.state_dict())),
                         rng=hff.Captured(ckpt.RNGState().state_dict(), per_rank=True))
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                items["scaler"] = hff.Captured(copy.deepcopy(scaler.state_dict()))
            # HF's small files, as HF writes them (bytes: kilobytes).
            self._save_rng_state(folder)
            self._save_scaler(folder)
            torch.save(self.lr_scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
        self.state.save_to_json(os.path.join(folder, TRAINER_STATE_NAME))
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        metadata = {CONFIG_KEY: json.loads(config.to_json_string())} if config is not None \
            and hasattr(config, "to_json_string") else {}
        with_optimizer = not self.args.save_only_model
        limit, best = self.args.save_total_limit, self.state.best_model_checkpoint

        def write() -> None:
            self._save(folder, state_dict=model_sd)
            metadata[hff.MODEL_FILES_KEY] = hff.weight_digests(folder)
            store.save(step, items, metadata=metadata, overwrite=True)  # HF rewrites it too
            store.mgr.wait()  # committed: now the folder may say so
            if with_optimizer:
                hff.write_marker(folder, step)
            # HF's rotation, once this checkpoint is committed: run before, it could delete
            # the folder (the model) of the newest committed checkpoint while this one is
            # still written, and a crash then would leave nothing to resume from.
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=best, use_mtime=True)
            store.retire(set(store.mgr.steps()) - set(hff.folders(run_dir)))

        self._ckpt_writer.submit(write)
        if self._ckpt_sync or os.path.exists(os.path.join(folder, JIT_SENTINEL)):
            # HF's JIT checkpoint removes its marker when this returns: the checkpoint must be
            # on disk by then (the job is about to be killed).
            self._ckpt_writer.wait()

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
        """The writable store of ``run_dir``'s root (and the writer thread), opened once."""
        run_dir = os.path.abspath(run_dir)
        if self._ckpt_store is not None and self._ckpt_run_dir != run_dir:
            self.wait_for_checkpoints()
        if self._ckpt_store is None:
            self._ckpt_store = StepStore(self.ckpt_root_for(run_dir), self.ckpt_options)
            self._ckpt_run_dir = run_dir
            self._ckpt_writer = hff.FolderWriter()
        return self._ckpt_store

    def wait_for_checkpoints(self) -> None:
        """Finish the write in flight (raising its error), delete the steps whose
        ``checkpoint-N`` folder HF deleted, unlock the root."""
        store, self._ckpt_store = self._ckpt_store, None
        writer, self._ckpt_writer = self._ckpt_writer, None
        if store is None:
            return
        try:
            writer.close()
            store.mgr.wait()
            steps = set(store.mgr.steps())
            named = steps & set(hff.folders(self._ckpt_run_dir))
            if named:  # HF's rotation decides; a folder that names a committed step remains
                store.mgr.retire(steps - named)
        finally:
            store.close()

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # HF loads the best model and deletes folders here: the last write must be done.
        if self._ckpt_writer is not None:
            self._ckpt_writer.wait()
        return super()._finalize_training(*args, **kwargs)

    # -- resuming ---------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """As ``Trainer.train``; a resume reads the folder HF would, through ckpt (module
        docstring). Waits for the last checkpoint's background write before returning."""
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            resume_from_checkpoint = self._resolve(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._ckpt_loaded = None
            self.wait_for_checkpoints()

    def _resolve(self, resume: str | bool) -> str | bool:
        """The folder to resume from, as HF picks it (the highest ``checkpoint-N``, or the one
        named); its ckpt step loaded and its model files checked against the step's digests.
        A folder that fails is skipped, with a warning, for the one before it."""
        if resume is True:
            run_dir, limit = os.path.abspath(self.args.output_dir), None
        else:
            folder = os.path.abspath(os.fspath(resume))
            limit = hff.step_of(folder)
            if limit is None or not os.path.isdir(folder):
                return resume  # HF says what is wrong with it
            run_dir = os.path.dirname(folder)
        if self._ckpt_store is not None:
            self.wait_for_checkpoints()
        candidates = sorted((n for n in hff.folders(run_dir) if limit is None or n <= limit),
                            reverse=True)
        if not candidates:
            return resume  # HF raises "No valid checkpoint found in output directory"
        root = self.ckpt_root_for(run_dir)
        committed = set(ckpt.inspect.open(root).steps()) if os.path.isdir(root) else set()
        failures = []
        for n in candidates:
            folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{n}")
            if ckpt.tools.read_pointer(os.path.join(folder, ckpt.tools.POINTER_NAME)) is not None:
                return self._resolve_pointer(run_dir, n)
            if n not in committed:
                own = hff.is_marker(folder) or (
                    committed and not os.path.exists(os.path.join(folder, hff.OPTIMIZER_NAME)))
                if not own:
                    return folder  # a checkpoint of HF's own format: HF loads it
                failures.append(f"{folder}: its ckpt step is not committed (its save never "
                                "finished, the job stopped while writing it; or the step was "
                                "removed since)")
            else:
                problem = self._load_step(root, n, folder)
                if problem is None:
                    return folder
                failures.append(f"{folder}: {problem}")
            log.warning("ckpt: skipping %s", failures[-1])
        raise ckpt.CorruptCheckpointError(
            f"no checkpoint under {run_dir} could be loaded; `ckpt verify --all {root}` gives "
            "details:\n  " + "\n  ".join(failures), path=run_dir)

    def _resolve_pointer(self, run_dir: str, n: int) -> str:
        """A folder an earlier CkptTrainer wrote: a pointer ``ckpt-step.json`` to a step in
        ``run_dir`` itself that holds the model too. Loads it (or the newest good step
        before it) so that such a run resumes; new checkpoints then go to the sibling root."""
        found = load_newest_good(run_dir, n, allow_pickle=pickle_allowed(self.ckpt_options))
        if found is None:
            raise ValueError(f"No valid checkpoint found in output directory ({run_dir})")
        step, self._ckpt_loaded = found
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        os.makedirs(folder, exist_ok=True)
        self._write_state(folder, self._ckpt_loaded["trainer_state"])
        log.info("ckpt: resuming from step %d under %s (written by an earlier CkptTrainer)",
                 step, run_dir)
        return folder

    @staticmethod
    def _write_state(folder: str, text: str) -> None:
        """HF reads the trainer state from the folder: write the verified copy there."""
        ckpt.tools.atomic_write(os.path.join(folder, TRAINER_STATE_NAME), text.encode(),
                                umask=True)

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: torch.nn.Module | None = None) -> None:
        if self._ckpt_loaded is None or "model" not in self._ckpt_loaded:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        target.load_state_dict(self._ckpt_loaded["model"])  # an earlier CkptTrainer's step

    def _load_step(self, root: str, n: int, folder: str) -> str | None:
        """Load step ``n`` and check ``folder``'s model files; the problem, or None."""
        path = os.path.join(root, ckpt.inspect.step_dir(n))
        try:
            saved = ckpt.load(path, allow_pickle=pickle_allowed(self.ckpt_options))
            recorded = ckpt.inspect.open(root).manifest(n).metadata.get(hff.MODEL_FILES_KEY, {})
        except (ckpt.CorruptCheckpointError, ckpt.CheckpointNotFoundError) as e:
            return str(e)
        problems = hff.weight_problems(folder, recorded)
        if problems and hff.replaced(folder, recorded):
            log.warning("ckpt: %s holds other model files than step %d recorded (%s): they "
                        "are loaded as HF loads them, unchecked", folder, n, ", ".join(recorded))
            problems = []
        if problems:
            return "; ".join(problems)
        self._ckpt_loaded = saved
        self._write_state(folder, saved["trainer_state"])
        log.info("ckpt: resuming from %s (step %d of %s)", folder, n, root)
        return None

    def _load_best_model(self) -> None:
        """HF's, after checking the best folder's model files against its step's digests:
        when they fail, a warning says so and the model stays as the last step left it (what
        HF's ``Trainer`` does when it cannot find the best model)."""
        if self._ckpt_writer is not None:
            self._ckpt_writer.wait()
        best = self.state.best_model_checkpoint
        n = hff.step_of(best) if best else None
        root = self.ckpt_root_for(os.path.dirname(os.path.abspath(best))) if best else ""
        if n is not None and os.path.isdir(root) and n in ckpt.inspect.open(root).steps():
            recorded = ckpt.inspect.open(root).manifest(n).metadata.get(hff.MODEL_FILES_KEY, {})
            problems = hff.weight_problems(best, recorded)
            if problems:
                log.warning("ckpt: the best checkpoint %s (step %d) cannot be loaded, so the "
                            "model stays as the last step left it (HF's Trainer does the same "
                            "when it cannot find the best model): %s", best, n,
                            "; ".join(problems))
                return
        super()._load_best_model()

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


__all__ = ["CkptTrainer"]
