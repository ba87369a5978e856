"""A manager's settings: its keywords, option objects and deprecated keywords resolved into
one validated set of option objects."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ckpt._retention.policy import KeepBest, RetentionPolicy
from ckpt.options import MemoryTierOptions, MetricsOptions, SaveOptions, Schedule

#: Deprecated keyword -> (the option keyword, its field), e.g. ``keep_every=`` ->
#: ``retention=ckpt.RetentionPolicy(keep_every=...)``.
DEPRECATED: dict[str, tuple[str, str]] = {
    "every_seconds": ("schedule", "every_seconds"),
    "save_on_preemption": ("schedule", "save_on_preemption"),
    "handle_sigterm": ("schedule", "handle_sigterm"),
    "keep_every": ("retention", "keep_every"),
    "keep_best": ("retention", "keep_best"),
    "best_metric": ("retention", "best_metric"),
    "best_mode": ("retention", "best_mode"),
    "allow_pickle": ("options", "allow_pickle"),
    "compression": ("options", "compression"),
    "incremental": ("options", "incremental"),
    "full_every": ("options", "full_every"),
    "commit_timeout": ("options", "commit_timeout"),
    "probe": ("options", "probe"),
    "metrics_port": ("metrics", "port"),
    "metrics_textfile": ("metrics", "textfile"),
    "persist_every": ("memory_tier", "persist_every"),
    "memory_keep": ("memory_tier", "keep"),
    "memory_budget": ("memory_tier", "budget"),
    "memory_job": ("memory_tier", "job"),
    "replicas": ("memory_tier", "replicas"),
    "memory_dir": ("memory_tier", "shm_dir"),
    "memory_node": ("memory_tier", "node"),
}

_BEST = ("keep_best", "best_metric", "best_mode")
_CLASSES = {"schedule": Schedule, "retention": RetentionPolicy, "options": SaveOptions,
            "metrics": MetricsOptions, "memory_tier": MemoryTierOptions}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a manager was configured with, validated. ``memory`` and ``metrics_to``
    are None when that feature is off."""

    options: SaveOptions
    schedule: Schedule
    retention: RetentionPolicy
    memory: MemoryTierOptions | None
    metrics_to: MetricsOptions | None


def resolve(*, every_steps: int | None, keep_last: int | None, options: SaveOptions | None,
            schedule: Schedule | None, retention: RetentionPolicy | None,
            memory_tier: bool | MemoryTierOptions, metrics: bool | MetricsOptions,
            deprecated: dict[str, Any]) -> Settings:
    """The settings of ``CheckpointManager(...)``'s keywords.

    Raises:
        TypeError: an unknown keyword, or an option of the wrong type.
        ValueError: an invalid value, or one given twice (a shorthand and its option).
    """
    fields: dict[str, dict[str, Any]] = {name: {} for name in _CLASSES}
    for name, value in deprecated.items():
        if name not in DEPRECATED:
            raise TypeError(f"CheckpointManager() got an unexpected keyword argument {name!r}")
        owner, field = DEPRECATED[name]
        spelled = f"ckpt.{_CLASSES[owner].__name__}({field}=...)" if name not in _BEST \
            else "ckpt.RetentionPolicy(keep_best=ckpt.KeepBest(n, metric, mode))"
        warnings.warn(f"CheckpointManager({name}=...) is deprecated and will be removed in "
                      f"the next release; pass {owner}={spelled}", DeprecationWarning,
                      stacklevel=3)
        fields[owner][field] = value
    if every_steps is not None:
        _shorthand("every_steps", schedule, fields["schedule"])["every_steps"] = every_steps
    if keep_last is not None:
        _shorthand("keep_last", retention, fields["retention"])["keep_last"] = keep_last
    for flag, option in (("memory_tier", memory_tier), ("metrics", metrics)):
        if not isinstance(option, (bool, _CLASSES[flag])):
            raise TypeError(f"{flag} must be True, False or a ckpt.{_CLASSES[flag].__name__}, "
                            f"not {option!r}")
    _combine_best(fields["retention"])
    saving = _built("options", options, fields["options"])
    memory = _built("memory_tier", memory_tier if memory_tier is not True else None,
                    fields["memory_tier"])
    if memory_tier is not False and saving.incremental:
        raise ValueError("memory_tier=True cannot be combined with incremental=True")
    metrics_to = _built("metrics", metrics if metrics is not True else None, fields["metrics"])
    kept = _built("retention", retention, fields["retention"])
    if kept.keep_last is not None and kept.keep_last < 1:  # `ckpt gc --keep-last 0` only
        raise ValueError(f"keep_last must be a positive integer or None, not {kept.keep_last!r}")
    return Settings(options=saving,
                    schedule=_built("schedule", schedule, fields["schedule"]),
                    retention=kept,
                    memory=memory if memory_tier is not False else None,
                    metrics_to=metrics_to if metrics is not False or fields["metrics"] else None)


def _combine_best(fields: dict[str, Any]) -> None:
    """The deprecated keep_best=, best_metric=, best_mode= as one KeepBest."""
    n, metric = fields.pop("keep_best", None), fields.pop("best_metric", None)
    mode = fields.pop("best_mode", "min")
    if metric is not None and n is None:
        raise ValueError("best_metric= needs keep_best=N (how many best steps to keep)")
    if n is not None:
        fields["keep_best"] = KeepBest(n, metric or "", mode)
    elif mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', not {mode!r}")


def _shorthand(name: str, option: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """Refuse a shorthand keyword whose option object sets the same field."""
    if option is not None and getattr(option, name) is not None:
        raise ValueError(f"{name}= is given twice: as a keyword and in the "
                         f"{type(option).__name__} passed; pass it once")
    return fields


def _built(owner: str, option: Any, fields: dict[str, Any]) -> Any:
    """``option`` (default: the class's defaults) with ``fields`` replaced (validated)."""
    cls = _CLASSES[owner]
    if option is None or option is False:
        option = cls()
    if not isinstance(option, cls):
        raise TypeError(f"{owner} must be a ckpt.{cls.__name__}, not {type(option).__name__}")
    return dataclasses.replace(option, **fields) if fields else option
