"""Every rank's verdict on one step a restore or load tried, and the record of the steps
skipped for the one before them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ckpt._shared.distributed import Group
from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, PartialLoadError

log = logging.getLogger("ckpt")


@dataclass(frozen=True)
class Verdict:
    """Why one rank's attempt at a step failed: ``fatal`` when no other step can help (the
    restore raises), otherwise the step is bad and an older one (or another tier) is tried.
    Picklable: the ranks exchange them."""

    fatal: bool
    why: str

    @classmethod
    def of(cls, error: BaseException | None) -> Verdict | None:
        """The verdict on an attempt that raised ``error`` (None: it succeeded)."""
        if error is None:
            return None
        if isinstance(error, PartialLoadError) and error.corrupt:  # another step repairs
            # Its cause, not its advice ("load a good step again"): the fallback does just
            # that, and if no step can, restore's own error names the overwritten tensors.
            return cls(False, f"{error.__cause__ or error} (read in one pass: the tensors it "
                              "overwrote are reloaded from the next step tried)")
        if isinstance(error, (CorruptCheckpointError, CheckpointNotFoundError)):
            return cls(False, str(error))
        return cls(True, f"{type(error).__name__}: {error}")


@dataclass(frozen=True)
class Agreed:
    """Every rank's verdicts on one step: the reasons of the fatal ones and of all."""

    fatal: list[str]
    bad: list[str]


class Fallback:
    """The steps a restore or load tried, newest first: every rank's verdict on each (all
    ranks must load the same step) and the reasons of those skipped.

    Args:
        group: the ranks that restore together.
        root: the root's URL, for messages.
        skipped: the manager's record of skipped steps, (step, reason), appended to.
        verb: "restore" or "load", for log lines.
    """

    def __init__(self, group: Group, root: str, skipped: list[tuple[int, str]],
                 verb: str) -> None:
        self.group, self.root, self.skipped, self.verb = group, root, skipped, verb
        self.failures: list[str] = []

    def agree(self, error: BaseException | None) -> Agreed:
        """Every rank's verdict on this step (collective under a process group)."""
        mine = Verdict.of(error)
        verdicts = self.group.all_gather(mine) if self.group.enabled else [mine]
        return Agreed([v.why for v in verdicts if v and v.fatal],
                      [v.why for v in verdicts if v])

    def skip(self, step: int, reason: str) -> None:
        log.warning("ckpt.%s skipping step=%d reason=%s", self.verb, step, reason)
        self.skipped.append((step, reason))
        self.failures.append(f"step {step}: {reason}")

    def none_loaded(self) -> str:
        return (f"no committed step under {self.root} could be loaded; `ckpt verify --all "
                f"{self.root}` gives details:\n  " + "\n  ".join(self.failures))
