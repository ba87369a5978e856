"""The ``checkpoint-N/`` folder of :class:`~trainer.integrations.hf.CkptTrainer`: where ckpt's
root lives, the host copy taken in the training thread, the digests of the model files, the
optimizer's marker file, and which folder a resume reads.

A ``checkpoint-N/`` folder holds what HF's ``Trainer`` writes there: the model as HF writes it
(``model.safetensors``, ``config.json``, ``training_args.bin``, the tokenizer), the trainer
state, scheduler, scaler and RNG files. The optimizer's state (the largest part) lives in
ckpt's step ``N`` under a hidden sibling root (``.out.ckpt`` next to ``out``), whose manifest
also records the model files' sizes and xxh3-64 digests; ``optimizer.pt`` is a small torch
file naming that step, written once the step is committed. So the model's bytes are written
once (as the standard file ``from_pretrained`` reads) and the folder listings are HF's.
"""

from __future__ import annotations

import io
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable

import torch
import xxhash
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckpt.tools import atomic_write
# The manifest metadata key of the folder's weight files: {name: {"bytes": n, "xxh3": hex}}.
from verify.integration_keys import HF_MODEL_FILES_KEY as MODEL_FILES_KEY


OPTIMIZER_NAME = "optimizer.pt"
MARKER_FORMAT = "ckpt-hf-optimizer/1"
MAX_MARKER_BYTES = 64 << 10
# The files HF's save_pretrained / _save write for the weights (single file or shards + index).
_WEIGHTS = re.compile(r"^(model|pytorch_model|adapter_model)([-.].*)?\.(safetensors|bin|json)$")
_FOLDER = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def root_for(run_dir: str) -> str:
    """ckpt's root for the checkpoints of ``run_dir``: the hidden sibling ``.<name>.ckpt``,
    so that ckpt's own files (lock, steps, staging) never appear in HF's listings."""
    run_dir = os.path.abspath(run_dir)
    parent, name = os.path.split(run_dir.rstrip(os.sep)) if run_dir != os.sep else ("/", "")
    return os.path.join(parent, f".{name or 'root'}.ckpt")


def folders(run_dir: str) -> dict[int, str]:
    """``checkpoint-N`` folders of ``run_dir`` by step."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        m = _FOLDER.match(name)
        if m and os.path.isdir(os.path.join(run_dir, name)):
            found[int(m.group(1))] = os.path.join(run_dir, name)
    return found


def step_of(folder: str) -> int | None:
    m = _FOLDER.match(os.path.basename(os.path.normpath(folder)))
    return int(m.group(1)) if m else None


class HostCopies:
    """Copies of state dicts whose tensors are on the CPU and no longer change with training.

    The buffers of one checkpoint are reused by the next (one checkpoint is in flight at a
    time, and the next copy is taken once it is written): the copy writes into memory that
    is already mapped, where fresh buffers would page-fault on every save. Tensors sharing
    storage (tied weights) stay shared, so HF's save still writes them once.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, obj: Any, path: str = "") -> Any:
        return self._copy(obj, path, {})

    def _copy(self, obj: Any, path: str, memo: dict) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                   tuple(t.stride()), t.dtype, t.device)
            if key not in memo:
                buf = self._buffers.get(path)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = self._buffers[path] = torch.empty(t.shape, dtype=t.dtype)
                memo[key] = buf.copy_(t)
            return memo[key]
        if isinstance(obj, dict):
            copied = {k: self._copy(v, f"{path}/{k}", memo) for k, v in obj.items()}
            return copied if type(obj) is dict else type(obj)(copied)  # OrderedDict stays one
        if isinstance(obj, list):
            return [self._copy(v, f"{path}/{i}", memo) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._copy(v, f"{path}/{i}", memo) for i, v in enumerate(obj))
        return obj


class Captured:
    """A state taken in the training thread and saved later from the writer thread (ckpt
    calls ``state_dict()`` when it saves)."""

    def __init__(self, state: Any, *, per_rank: bool = False) -> None:
        self._state = state
        self.ckpt_per_rank = per_rank

    def state_dict(self) -> Any:
        return self._state

    def load_state_dict(self, state: Any) -> None:  # a stateful object for ckpt; unused here
        self._state = state


def digest_file(path: str) -> dict[str, Any]:
    h, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
            size += len(block)
    return {"bytes": size, "xxh3": h.hexdigest()}


def weight_digests(folder: str) -> dict[str, dict[str, Any]]:
    """Size and xxh3-64 digest of each weights file HF wrote in ``folder``."""
    return {name: digest_file(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
            if _WEIGHTS.match(name) and os.path.isfile(os.path.join(folder, name))}


def weight_problems(folder: str, recorded: dict[str, Any]) -> list[str]:
    """What differs between ``folder``'s weights files and the digests a step recorded."""
    problems = []
    for name, want in sorted(recorded.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
            continue
        if os.path.getsize(path) != want.get("bytes"):
            problems.append(f"{name} has {os.path.getsize(path)} bytes, the step recorded "
                            f"{want.get('bytes')}")
        elif digest_file(path)["xxh3"] != want.get("xxh3"):
            problems.append(f"{name} fails its digest (xxh3-64)")
    return problems


def replaced(folder: str, recorded: dict[str, Any]) -> bool:
    """Whether the weights files a step recorded were all replaced by others (a checkpoint
    re-sharded by the user, as HF's own tests do): HF then loads what is there."""
    return bool(recorded) and not any(os.path.exists(os.path.join(folder, n)) for n in recorded) \
        and any(_WEIGHTS.match(n) for n in os.listdir(folder))


def write_marker(folder: str, step: int) -> None:
    """``optimizer.pt``: a small torch file (loads with ``weights_only=True``) saying that the
    optimizer's state is ckpt's step ``step``; written after that step is committed."""
    data = io.BytesIO()
    torch.save({"format": MARKER_FORMAT, "step": step,
                "note": "the optimizer state is in ckpt's step of this number, in the root "
                        "next to the output folder (.<output_dir>.ckpt); resume with "
                        "trainer.integrations.hf.CkptTrainer"}, data)
    # A fresh temporary beside it, never a fixed name a planted link could stand at.
    atomic_write(os.path.join(folder, OPTIMIZER_NAME), data.getvalue(), umask=True)


def is_marker(folder: str) -> bool:
    """Whether ``folder/optimizer.pt`` is ckpt's marker (not HF's own optimizer file)."""
    path = os.path.join(folder, OPTIMIZER_NAME)
    try:
        if os.path.islink(path) or os.path.getsize(path) > MAX_MARKER_BYTES:
            return False
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - any unreadable file is not our marker
        return False
    return isinstance(doc, dict) and doc.get("format") == MARKER_FORMAT


class FolderWriter:
    """One background thread writing checkpoints in order, one in flight: ``submit`` first
    waits for the one before (as ckpt's own saves do), so host copies never pile up."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hf")
        self._pending: Future | None = None
        self._latest: Future | None = None  # the last write queued, done or not

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()
        self._pending = self._latest = self._pool.submit(job)

    def then(self, job: Callable[[], None]) -> None:
        """Queue ``job`` after the write in flight without waiting for it (it fails with
        that write's error, if any)."""
        before = self._pending

        def chained() -> None:
            if before is not None:
                before.result()
            job()

        self._pending = self._latest = self._pool.submit(chained)

    def settle(self, timeout: float) -> tuple[bool, BaseException | None]:
        """Wait up to ``timeout`` seconds for the writes queued so far: (whether they are
        done, the error of a failed one or None); raises nothing."""
        pending = self._latest  # (wait() forgets _pending before it waits)
        if pending is None:
            return True, None
        done, _ = wait([pending], timeout)
        return bool(done), pending.exception() if done else None

    def wait(self) -> None:
        """Wait for the write in flight; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
