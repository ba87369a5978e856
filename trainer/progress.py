"""The elastic trainer's run directory: per-rank progress records and the summary.

Each rank of each attempt appends JSON lines (``attempt-NNNN/rank-NNNNN.jsonl``: start,
built, restored, step, save, rollback, skip, failure, preempted, done), flushed per line so
that they survive SIGKILL. :func:`build_summary` reads every attempt's records back and puts
the story together as an :class:`ElasticSummary` with one :class:`Recovery` per failure.
Rank 0 also keeps ``skips.jsonl`` (the global batches rollbacks marked bad) and writes
``summary.json`` at the end. See docs/elastic.md.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

# The file helpers directly, not through ckpt.tools: the live supervisor imports this module
# and starts without torch (setup.cfg's public-face contract names this one exception).
from storage_backends.files import SpecialFileError, atomic_write, open_regular

from trainer.stragglers import describe as describe_stragglers
from trainer.stragglers import summarize as summarize_stragglers

RUN_DIR_ENV = "CKPT_ELASTIC_RUN_DIR"


# ------------------------------------------------------------------------------- results


@dataclasses.dataclass
class Recovery:
    """One failure of the job and the way back (times are wall-clock seconds since the epoch).

    ``failed_at`` is an estimate: the last sign of life of the lost ranks (their last
    heartbeat change as seen by a survivor, or their last finished step).
    """

    attempt: int                 # the attempt that ended
    reason: str                  # "lost ranks", "preempted", "collective failed", ...
    lost_ranks: list[int]
    world_before: int
    world_after: int | None
    last_step: int               # the last step the ended attempt finished
    restored_step: int | None    # the step the next attempt resumed from
    steps_lost: int | None       # last_step - restored_step: steps trained twice
    failed_at: float | None
    detected_at: float | None
    restarted_at: float | None   # the first process of the next attempt started
    group_ready_at: float | None  # its process group formed (all ranks)
    built_at: float | None       # model, DDP/FSDP, optimizer, heartbeat built (all ranks)
    restored_at: float | None    # its checkpoint restored (all ranks)
    resumed_at: float | None     # its first step finished
    restored_from: str | None = None   # the tiers its ranks restored from ("memory", ...)
    bytes_from_storage: int | None = None  # read from the persistent root, all ranks

    @staticmethod
    def _delta(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    @property
    def detect_s(self) -> float | None:
        """Failure to detection."""
        return self._delta(self.failed_at, self.detected_at)

    @property
    def restart_s(self) -> float | None:
        """Detection to the next workers' start: exit, torchrun re-rendezvous, spawn."""
        return self._delta(self.detected_at, self.restarted_at)

    @property
    def init_s(self) -> float | None:
        """Worker start to process group formed (interpreter, imports, init_process_group)."""
        return self._delta(self.restarted_at, self.group_ready_at)

    @property
    def build_s(self) -> float | None:
        """Process group formed to model, DDP/FSDP and optimizer built."""
        return self._delta(self.group_ready_at, self.built_at)

    @property
    def restore_s(self) -> float | None:
        """Checkpoint manager opened (rank 0 takes the lock) and the checkpoint loaded."""
        return self._delta(self.built_at, self.restored_at)

    @property
    def first_step_s(self) -> float | None:
        return self._delta(self.restored_at, self.resumed_at)

    @property
    def resume_s(self) -> float | None:
        """Detection to the first step of the next attempt."""
        return self._delta(self.detected_at, self.resumed_at)

    @property
    def downtime_s(self) -> float | None:
        """Failure to the first step of the next attempt (no progress in between)."""
        return self._delta(self.failed_at if self.failed_at is not None else self.detected_at,
                           self.resumed_at)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name in ("detect_s", "restart_s", "init_s", "build_s", "restore_s", "first_step_s",
                     "resume_s", "downtime_s"):
            d[name] = getattr(self, name)
        return d


def _fields_of(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """The items of ``d`` that are fields of the dataclass ``cls`` (derived ones dropped)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclasses.dataclass
class ElasticSummary:
    """What :meth:`ElasticTrainer.fit` did, across every restart of the job."""

    final_step: int
    total_steps: int
    world_sizes: list[int]           # one entry per attempt (a run of the worker group)
    attempts: int
    restarts: int                    # TORCHELASTIC_RESTART_COUNT now (max over agents)
    restores: list[int]              # the steps the attempts resumed from (0: fresh start)
    steps_lost: int                  # steps trained again after failures
    recoveries: list[Recovery]
    wall_s: float                    # the invocations' own wall times, summed (not the
                                     # idle time between two launches of the job)
    lost_s: float                    # downtime plus the time of the steps trained again
    step_s: float | None             # median time of one step (this attempt)
    final_loss: float | None
    run_dir: str | None = None
    rollbacks: int = 0               # health-guard rollbacks, all attempts
    skipped_batches: int = 0         # distinct global batches skipped by them
    stragglers: dict[str, Any] | None = None  # straggler scores, flags and drops
                                              # (trainer.stragglers.summarize)

    @property
    def lost_fraction(self) -> float:
        return self.lost_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def detect_s(self) -> list[float | None]:
        return [r.detect_s for r in self.recoveries]

    @property
    def resume_s(self) -> list[float | None]:
        return [r.resume_s for r in self.recoveries]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["recoveries"] = [r.to_dict() for r in self.recoveries]
        d["lost_fraction"] = self.lost_fraction
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ElasticSummary":
        rec = [Recovery(**_fields_of(Recovery, r)) for r in d["recoveries"]]
        return cls(**{**_fields_of(cls, d), "recoveries": rec})

    def format(self) -> str:
        """A human-readable account: world sizes, restarts and each recovery's timeline."""
        def s(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}s"

        lines = [f"elastic run: step {self.final_step}/{self.total_steps}, world sizes "
                 f"{self.world_sizes}, {self.attempts} attempt(s), torchrun restarts "
                 f"{self.restarts}, resumed from {self.restores}, steps lost "
                 f"{self.steps_lost}, wall {self.wall_s:.1f}s, lost {self.lost_s:.1f}s "
                 f"({100 * self.lost_fraction:.1f}%)"
                 + (f", step {self.step_s * 1e3:.0f} ms" if self.step_s else "")
                 + (f", final loss {self.final_loss:.4f}" if self.final_loss is not None
                    else "")
                 + (f", {self.rollbacks} rollback(s), {self.skipped_batches} batch(es) "
                    "skipped" if self.rollbacks or self.skipped_batches else "")]
        stragglers = describe_stragglers(self.stragglers)
        if stragglers:
            lines.append(stragglers)
        for r in self.recoveries:
            lines.append(
                f"  attempt {r.attempt} ended ({r.reason}; lost ranks {r.lost_ranks}) at "
                f"step {r.last_step}, world {r.world_before} -> {r.world_after}, resumed "
                f"from step {r.restored_step}: {r.steps_lost} steps lost; detect "
                f"{s(r.detect_s)}, exit+rendezvous+spawn {s(r.restart_s)}, init "
                f"{s(r.init_s)}, build {s(r.build_s)}, restore {s(r.restore_s)}"
                + (f" (from {r.restored_from})" if r.restored_from else "") + ", first step "
                f"{s(r.first_step_s)}; detect->resume {s(r.resume_s)}, downtime {s(r.downtime_s)}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------- JSON lines


def _json_line(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


def _open_append(path: Path):
    """``path`` opened for appending text, only if it is a regular file: a run or audit
    directory another user can write to (``CKPT_ELASTIC_RUN_DIR`` pointed at a shared
    folder) could hold a link planted at the name, which would have the records appended
    to whatever file it names, or a FIFO, which would block the open for ever. Created 0644
    (records are not secret)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except SpecialFileError as e:
        raise OSError(e.errno, f"{path} is {e.kind}: records are appended only to a regular "
                               "file, never through a link (remove it, and keep the run and "
                               "audit directories where only this job's user can write)") \
            from None
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8")


class JsonLines:
    """An append-only JSON-lines file, flushed per line (survives SIGKILL), thread safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = _open_append(path)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = _json_line(record)
        with self._lock:
            if not self._f.closed:
                self._f.write(line)
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record to a JSON-lines file (opened and closed for it: rare events)."""
    with _open_append(path) as f:
        f.write(_json_line(record))


def json_float(value: float | None) -> float | str | None:
    """A float for JSON: NaN and infinities as the strings "nan", "inf", "-inf"."""
    if value is None or math.isfinite(value):
        return value
    return str(float(value))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a torn last line (the writer was killed) is skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


# ------------------------------------------------------------------------------- the run directory


def default_run_dir(run_dir: str | os.PathLike | None,
                    checkpoint_root: str | os.PathLike) -> Path | None:
    """``run_dir``, else env ``CKPT_ELASTIC_RUN_DIR``, else ``<root>/.elastic`` for a local
    checkpoint root (None for an object-store root)."""
    if run_dir is not None:
        return Path(run_dir)
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    root = os.fspath(checkpoint_root)
    if "://" in root and not root.startswith("file://"):
        return None  # an object-store root: no local bookkeeping unless run_dir is given
    return Path(root.removeprefix("file://")) / ".elastic"


def next_attempt(run_dir: Path | None) -> int:
    """The number of the attempt starting now: one past the newest recorded."""
    if run_dir is None or not run_dir.is_dir():
        return 0
    numbers = [int(p.name.split("-")[1]) for p in run_dir.glob("attempt-*")
               if p.name.split("-")[1].isdigit()]
    return max(numbers, default=-1) + 1


def open_progress(run_dir: Path, attempt: int, rank: int) -> JsonLines:
    """This rank's progress records of ``attempt``."""
    return JsonLines(run_dir / f"attempt-{attempt:04d}" / f"rank-{rank:05d}.jsonl")


def record_skip(run_dir: Path, record: dict[str, Any]) -> None:
    """Note a global batch a rollback marked bad (rank 0), for the attempts to come."""
    append_jsonl(run_dir / "skips.jsonl", record)


def recorded_skips(run_dir: Path | None, global_batch_size: int) -> list[int]:
    """Data offsets of the batches earlier rollbacks of this job skipped (run_dir)."""
    path = None if run_dir is None else run_dir / "skips.jsonl"
    if path is None or not path.is_file():
        return []
    return sorted({int(r["offset"]) for r in read_jsonl(path)
                   if r.get("global_batch") == global_batch_size})


def write_summary(run_dir: Path, summary: ElasticSummary) -> None:
    """``summary.json`` in the run directory, replaced at once and never written through a
    link or a file planted in the directory (``ckpt.tools.atomic_write``)."""
    atomic_write(run_dir / "summary.json", json.dumps(summary.to_dict(), indent=1))


# ------------------------------------------------------------------------------- the summary


def build_summary(run_dir: str | os.PathLike | None, *, total_steps: int, final_step: int,
                  restarts: int = 0, final_loss: float | None = None,
                  step_s: float | None = None, fallback_world: int = 1) -> ElasticSummary:
    """Read the run directory's records of every attempt and put the story together."""
    attempts: list[dict[str, Any]] = []
    if run_dir is not None and Path(run_dir).is_dir():
        for adir in sorted(Path(run_dir).glob("attempt-*")):
            records = [r for p in sorted(adir.glob("rank-*.jsonl")) for r in read_jsonl(p)]
            if records:
                attempts.append(_attempt_facts(int(adir.name.split("-")[1]), records))
    if not attempts:
        attempts = [{"attempt": 0, "world": fallback_world, "restored": 0, "last_step":
                     final_step, "start": time.time(), "end": time.time(), "failures": [],
                     "done": True}]
    recoveries = []
    idle = 0.0  # between invocations: in no recovery's downtime
    for a, b in zip(attempts, attempts[1:]):
        recoveries.append(_recovery(a, b))
        if _new_invocation(a, b) and recoveries[-1].downtime_s is not None:
            idle += _gap(a, b)
    steps_lost = sum(r.steps_lost or 0 for r in recoveries)
    rollbacks = sum(a.get("rollbacks", 0) for a in attempts)
    skipped = len(set().union(*(a.get("skipped_offsets", set()) for a in attempts)))
    wall = _wall(attempts, now=time.time())
    step_time = step_s or 0.0
    lost = max(0.0, sum((r.downtime_s or 0.0) for r in recoveries) - idle) \
        + steps_lost * step_time
    return ElasticSummary(
        final_step=final_step, total_steps=total_steps,
        world_sizes=[a["world"] for a in attempts], attempts=len(attempts), restarts=restarts,
        restores=[a["restored"] for a in attempts if a["restored"] is not None],
        steps_lost=steps_lost, recoveries=recoveries, wall_s=round(wall, 3),
        lost_s=round(lost, 3), step_s=step_s, final_loss=final_loss,
        run_dir=None if run_dir is None else os.fspath(run_dir), rollbacks=rollbacks,
        skipped_batches=skipped, stragglers=summarize_stragglers(
            [(a["attempt"], w) for a in attempts for w in a.get("stragglers", [])]))


def _new_invocation(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether attempt ``b`` began a new invocation of the job (a new torchrun launch or
    process, maybe hours later) rather than a restart of ``a``'s: torchrun's restart count
    went back, in other processes. (Within one launch every restart counts up; a second
    ``fit`` in the same process is the same invocation.)"""
    ra, rb = a.get("restart_count"), b.get("restart_count")
    if ra is None or rb is None:
        return False
    return rb <= ra and not (a.get("pids", set()) & b.get("pids", set()))


def _gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The idle time between attempt ``a``'s last record and ``b``'s first process."""
    if a.get("end") is None or b.get("start") is None:
        return 0.0
    return max(0.0, b["start"] - a["end"])


def _wall(attempts: list[dict[str, Any]], now: float) -> float:
    """The sum of each invocation's own wall time (its first process start to its last
    record; the running one to ``now``)."""
    total, first = 0.0, None
    for i, a in enumerate(attempts):
        if first is None:
            first = a["start"]
        last = i == len(attempts) - 1
        if last or _new_invocation(a, attempts[i + 1]):
            end = now if last else (a.get("end") or now)
            if first is not None:
                total += max(0.0, end - first)
            first = None
    return total


def _attempt_facts(number: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    by = {}
    for r in records:
        by.setdefault(r["event"], []).append(r)
    starts = by.get("start", [])
    restored = by.get("restored", [])
    steps = by.get("step", [])
    restored_step = restored[0]["step"] if restored else None
    first = [r["time"] for r in steps if restored_step is not None
             and r["step"] == restored_step + 1]

    # The step each rank finished last (its records are in the order written; the highest
    # may belong to a timeline a rollback undid). Not by time: ranks' clocks differ.
    last_of_each_rank = {r["rank"]: r["step"] for r in steps}

    def most_of_one_rank(event: str) -> int:  # every rank records rollbacks and skips
        return max(collections.Counter(r["rank"] for r in by.get(event, [])).values(),
                   default=0)

    return {
        "attempt": number,
        "world": starts[0]["world"] if starts else None,
        "start": min((r["process_start"] for r in starts), default=None),
        "restart_count": max((r["restart_count"] for r in starts
                              if isinstance(r.get("restart_count"), int)), default=None),
        "pids": {r["pid"] for r in starts if "pid" in r},
        "group_ready": max((r["group_ready"] for r in starts), default=None),
        "restored": restored_step,
        "restored_at": max((r["time"] for r in restored), default=None),
        "restored_from": ",".join(sorted({r["tier"] for r in restored if r.get("tier")}))
                         or None,
        "bytes_from_storage": sum(r["bytes_from_storage"] for r in restored)
                              if restored and all("bytes_from_storage" in r for r in restored)
                              else None,
        "resumed_at": max(first) if first else None,
        "last_step": max(last_of_each_rank.values(), default=restored_step or 0),
        "last_step_times": {r["rank"]: r["time"] for r in steps},
        "failures": by.get("failure", []),
        "silent": sorted({r["rank"] for r in starts} - {r["rank"] for r in records if r["event"]
                                                        in ("failure", "preempted", "done")}),
        "built_at": max((r["time"] for r in by.get("built", [])), default=None),
        "preempted": by.get("preempted", []),
        "done": bool(by.get("done")),
        "end": max((r["time"] for r in records), default=None),
        "rollbacks": most_of_one_rank("rollback"),
        "skipped_offsets": {r["offset"] for r in by.get("skip", [])},
        "stragglers": sorted(by.get("stragglers", []), key=lambda r: r.get("window", 0)),
    }


def _recovery(a: dict[str, Any], b: dict[str, Any]) -> Recovery:
    """How attempt ``a`` ended and how ``b``, the next one, came back."""
    reason, lost, detected, failed = _ending(a)
    restored = b["restored"]
    lost_steps = None if restored is None else max(0, a["last_step"] - restored)
    if a["done"] and not a["failures"]:
        b = {**b, "start": None}  # not a recovery: no downtime to count
    return Recovery(attempt=a["attempt"], reason=reason, lost_ranks=lost,
                    world_before=a["world"], world_after=b["world"], last_step=a["last_step"],
                    restored_step=restored, steps_lost=lost_steps, failed_at=failed,
                    detected_at=detected, restarted_at=b["start"],
                    group_ready_at=b["group_ready"], built_at=b["built_at"],
                    restored_at=b["restored_at"],
                    resumed_at=b["resumed_at"], restored_from=b["restored_from"],
                    bytes_from_storage=b["bytes_from_storage"])


def _ending(a: dict[str, Any]) -> tuple[str, list[int], float | None, float | None]:
    """Why attempt ``a`` ended: the reason, the lost ranks, when that was detected and
    when the failure itself happened (estimated)."""
    failures, preempted = a["failures"], a["preempted"]
    # Lost: named by a survivor's heartbeat, or silent (started, then left no final record:
    # killed, or stopped and killed by its agent).
    # (A rank named by a peer that then recorded its own exit was alive: not lost, unless
    # it named itself: a hung rank that found its own training thread stuck.)
    spoke = ({f["rank"] for f in failures if f["rank"] not in f.get("lost", [])}
             | {p["rank"] for p in preempted})
    lost = sorted(({r for f in failures for r in f.get("lost", [])} - spoke)
                  | set(a["silent"]))
    if failures:
        reasons = sorted({f["reason"] for f in failures})
        reason = ", ".join(reasons)
        detected = min(f["time"] for f in failures)
        # The failure came after the lost ranks' last sign of life: their last step record
        # or the last change of their heartbeat that a survivor saw (the latest is tightest).
        signs = [v for f in failures for k, v in f.get("last_seen", {}).items()
                 if int(k) in lost and v is not None]
        signs += [a["last_step_times"][r] for r in lost if r in a["last_step_times"]]
        failed = min(max(signs), detected) if signs else None
    elif preempted:
        reason = "SIGTERM (preemption, or torchrun restarting the group for a new node)"
        detected = failed = min(p["time"] for p in preempted)
    elif a["done"]:
        reason, detected, failed = "finished (the job was started again for more steps)", None, None
    else:
        reason, detected, failed = "unknown (no survivor recorded it)", None, None
    return reason, lost, detected, failed


__all__ = ["RUN_DIR_ENV", "ElasticSummary", "JsonLines", "Recovery", "append_jsonl",
           "build_summary", "default_run_dir", "json_float", "next_attempt", "open_progress",
           "read_jsonl", "record_skip", "recorded_skips", "write_summary"]
