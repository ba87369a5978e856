"""The manifest metadata keys that mark a step of a framework integration
(``trainer/integrations``), defined once: the integrations write them, ``ckpt gc`` and
``ckpt verify`` read them. They live here because trainer imports verify and never the
other way (setup.cfg's layers), so this is the lowest layer both can import."""

from __future__ import annotations

from .lightning_file import FILES_KEY as LIGHTNING_FILES_KEY

HF_MODEL_FILES_KEY = "hf_model_files"  # {name: {"bytes": n, "xxh3": hex}} of checkpoint-N/

# key -> (the framework, the setting that decides the retention of its steps)
FRAMEWORK_STEPS = {LIGHTNING_FILES_KEY: ("Lightning", "ModelCheckpoint's save_top_k"),
                   HF_MODEL_FILES_KEY: ("the Hugging Face Trainer", "save_total_limit")}

__all__ = ["FRAMEWORK_STEPS", "HF_MODEL_FILES_KEY", "LIGHTNING_FILES_KEY"]
