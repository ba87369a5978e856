"""Which format a path holds, without importing the readers (cheap for every ``ckpt.load``)."""

from __future__ import annotations

import os

METADATA_NAME = ".metadata"  # DCP's metadata file
HF_INDEX_NAME = "model.safetensors.index.json"


def is_dcp(path: str | os.PathLike, storage_options: dict | None = None) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (it holds a ``.metadata`` file)."""
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        try:
            import fsspec

            fs, root = fsspec.core.url_to_fs(text, **(storage_options or {}))
            return fs.isfile(f"{root.rstrip('/')}/{METADATA_NAME}")
        except (ImportError, OSError, ValueError):
            return False
    local = text.removeprefix("file://")
    return os.path.isfile(os.path.join(local, METADATA_NAME)) and not _is_root(local)


HF_SINGLE_NAME = "model.safetensors"


def is_step_dir(path: str | os.PathLike, storage_options: dict | None = None) -> bool:
    """Whether ``path`` is one ckpt checkpoint directory (it holds a manifest), not a root."""
    from storage_backends import open_storage

    from ckpt._format.names import MANIFEST_NAME

    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return open_storage(text, create=False, storage_options=storage_options
                            ).exists(MANIFEST_NAME)
    return os.path.isfile(os.path.join(text.removeprefix("file://"), MANIFEST_NAME))


def is_hf(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a local Hugging Face folder (an index or ``model.safetensors``)."""
    text = os.fspath(path)
    if "://" in text:
        return False
    return (os.path.isfile(os.path.join(text, HF_INDEX_NAME))
            or os.path.isfile(os.path.join(text, HF_SINGLE_NAME))) and not _is_root(text)


def _is_root(path: str) -> bool:
    """A ckpt root (it holds step directories) stays one, whatever else lies in it (an
    exported ``model.safetensors`` next to the steps)."""
    try:
        with os.scandir(path) as entries:
            return any(e.name.startswith("step-") and e.is_dir() for e in entries)
    except OSError:
        return False
