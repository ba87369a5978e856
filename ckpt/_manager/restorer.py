"""The restorer: loads the newest good step into a training state, trying each tier that holds
it and falling back past bad steps, every rank agreeing on the step."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import time
from typing import Any, Callable, MutableMapping

from storage_backends import Storage

from ckpt._format.manifest import Manifest
from ckpt._format.names import step_dir
from ckpt._load.cooperative import Cooperation
from ckpt._load.levels import Gate, verify_level
from ckpt._load.probe import PROBE_ITEM
from ckpt._load.reader import few_keys, load_step
from ckpt._load.as_saved import MapLocation, read_structure
from ckpt._manager.metrics import CheckpointMetrics
from ckpt._manager.publisher import MemoryPublisher
from ckpt._manager.tiers import CountedReads, RestoreTier, Tier, restore_order
from ckpt._manager.verdict import Fallback, Verdict
from ckpt._shared.distributed import Group
from ckpt._step.integrity import read_manifest
from ckpt._step.verified import verified_steps
from ckpt.errors import CheckpointError, CorruptCheckpointError, PartialLoadError, \
    StorageError

log = logging.getLogger("ckpt")

#: What ``restore(prefer=...)`` tries first: the newest good step, or the newest verified one.
NEWEST, VERIFIED = "newest", "verified"
PREFERENCES = (NEWEST, VERIFIED)


@dataclasses.dataclass(frozen=True)
class RestoreInfo:
    """Where the last ``restore`` came from. ``tier`` (this rank): :class:`Tier` "memory"
    (every byte from this node's own segments), "peer" (any byte from a replica or another
    node's memory) or "storage" (the persistent root). ``bytes_from_storage`` (this rank): the
    bytes this restore read from the root, every attempt and pass counted (0 from memory; a
    two-pass load of a step reads its data twice; under a process group a chunk several
    ranks need is read by one of them, ``ckpt._load.cooperative``; from an object store,
    what its responses carried: whole blocks of its read cache around small reads).
    ``ranks``: (tier, bytes_from_storage) of every rank, by rank, the same on all ranks
    (every rank restores the same step, but each from its own tier). ``bytes`` (this rank): the bytes read for the step restored, from
    its tier. ``seconds``: the restore's time on this rank, the steps it skipped and the
    discovery of what memory holds included. ``skipped``: (step, tier, why) of each attempt
    that failed before the one that loaded, newest first, the same on every rank (a step
    whose copy in memory failed is tried from the replicas, then the root)."""
    step: int
    tier: Tier
    bytes_from_storage: int
    ranks: tuple[tuple[Tier, int], ...] = ()
    bytes: int = 0
    seconds: float = 0.0
    skipped: tuple[tuple[int, Tier, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Restored:
    """A step a restore or load loaded: its manifest (the next incremental save's base) and,
    for a restore, where it came from."""
    step: int
    manifest: Manifest
    info: RestoreInfo | None = None
    value: Any = None


@dataclasses.dataclass(frozen=True)
class Attempts:
    """What the attempt that loaded read, and what came before it (``RestoreInfo``)."""
    bytes: int
    seconds: float
    skipped: tuple[tuple[int, Tier, str], ...]


def _newer(candidates: list[int], step: int) -> frozenset[int]:
    """The committed steps after ``step``, which a restore that preferred a verified step
    passed over (the bad ones among them it skipped anyway)."""
    return frozenset(s for s in candidates if s > step)


def _one_line(why: str) -> str:
    """A reason on one line (it goes into a log line)."""
    return " ".join(why.split())


class Restorer:
    """Loads committed steps of one root for a manager.

    Args:
        storage: the root.
        group: the ranks that restore together (all call every method).
        steps: the root's committed steps, oldest first.
        memory: the memory tier, or None.
        allow_pickle: load pickled values.
        threads: reader threads.
        metrics: counts restores, or None.
    """

    def __init__(self, storage: Storage, group: Group, steps: Callable[[], list[int]], *,
                 memory: MemoryPublisher | None, allow_pickle: bool, threads: int,
                 metrics: CheckpointMetrics | None) -> None:
        self.storage, self.group, self.steps, self.memory = storage, group, steps, memory
        self.allow_pickle, self.threads, self.metrics = allow_pickle, threads, metrics
        self.root: str = storage.url
        self.skipped: list[tuple[int, str]] = []
        # Committed steps newer than the verified step a restore preferred: passed over.
        self.passed_over: frozenset[int] = frozenset()
        self.restored_verified = False  # the last restore took a verified step it preferred

    def _candidates(self, step: int | None, prefer: str) -> tuple[list[int], frozenset[int]]:
        """The steps to try (``step`` alone, else every committed step, newest first) and
        those of them that are verified (only when ``prefer`` asks for them)."""
        try:
            candidates = [step] if step is not None else list(reversed(self.steps()))
        except OSError as e:  # the storage failed (after its retries): not a missing root
            raise StorageError(f"listing the steps of {self.root} failed: {e}",
                               path=self.root) from e
        verified = self._verified(candidates) if step is None and prefer == VERIFIED \
            else frozenset()
        return candidates, verified

    def restore(self, state: MutableMapping[str, Any], step: int | None, *, strict: bool,
                verify: str, prefer: str = NEWEST) -> Restored | None:
        """See :meth:`ckpt.CheckpointManager.restore`."""
        started = time.perf_counter()
        gate = Gate(verify_level(verify), state)
        one_pass = step is None and not strict and gate.level == "digest"
        dirty: frozenset[str] = frozenset()  # live tensors that failed steps left changed
        candidates, verified = self._candidates(step, prefer)
        self.passed_over, self.restored_verified = frozenset(), False
        partial: dict[int, str] = {}  # steps the live nodes hold in memory only in part
        root, order = restore_order(self.storage, self.memory, self.group, candidates, step,
                                    preferred=verified, partial=partial)
        retired: dict[int, str] = {}  # memory steps passed over as retired
        if self.memory is not None:
            order = self._without_retired(order, retired)
        tried = Fallback(self.group, self.root, self.skipped, "restore")
        in_memory_only: list[str] = []  # memory tiers' failures (the root may hold the step)
        failed: list[tuple[int, Tier, str]] = []  # every failed attempt, for last_restore
        with cf.ThreadPoolExecutor(self.threads) as pool, gate:
            for s, tier in order:
                # In one pass, a step that fails leaves `dirty` tensors behind. A step that
                # loads writes every live tensor (load_step), so it repairs them; when none
                # does, the error names them (never silently mixed).
                error, wrote, manifest, storage, nbytes = self._attempt(
                    s, tier, state, pool, gate, in_place=one_pass)
                # Every rank must restore the same step: agree on this one's outcome first.
                agreed = tried.agree(error)
                if agreed.fatal:
                    self._raise_fatal(s, error, agreed.fatal[0], dirty)
                if not gate.forward:  # (that level puts the models back itself)
                    # A step another rank failed on: what this rank wrote needs repair too.
                    dirty |= error.changed if isinstance(error, PartialLoadError) else wrote
                if not agreed.bad:
                    self.passed_over = _newer(candidates, s) if verified else frozenset()
                    self.restored_verified = s in verified
                    # Newer saves the memory tier could not offer whole were passed over
                    # too, and memory copies retired (of this step too): say so beside the
                    # failed attempts, newest first.
                    lost = [(p, Tier.MEMORY, _one_line(why)) for p, why in partial.items()
                            if p > s] + [(p, Tier.MEMORY, why) for p, why in retired.items()
                                         if p >= s]
                    skipped = sorted(lost + failed, key=lambda f: -f[0])
                    return self._restored(s, manifest, storage, tier.tier, root.reads, tried,
                                          Attempts(nbytes, time.perf_counter() - started,
                                                   tuple(skipped)))
                failed.append((s, tier.tier, _one_line(agreed.bad[0])))
                if tier.tier is not Tier.STORAGE:  # other copies, or the root, may hold it
                    log.warning("ckpt.restore memory tier step=%d unusable, falling through: "
                                "%s", s, agreed.bad[0])
                    in_memory_only.append(f"step {s} ({tier.tier} tier): {agreed.bad[0]}")
                    continue
                if strict or step is not None:
                    if isinstance(error, CheckpointError):
                        raise error
                    raise CorruptCheckpointError(agreed.bad[0], path=self.root)
                tried.skip(s, agreed.bad[0])
        # A step whose every copy was bad: never "no checkpoint yet" (a fresh start).
        tried.failures += in_memory_only
        if tried.failures:
            gate.all_failed(self.root, tried.failures)
            message = tried.none_loaded()
            if dirty:
                raise PartialLoadError(
                    f"{message}\nReading them in one pass overwrote {len(dirty)} live "
                    f"tensors ({few_keys(sorted(dirty))}) that no step could repair: the live "
                    "state is mixed; rebuild it before training on", path=self.root,
                    changed=dirty)
            raise CorruptCheckpointError(message, path=self.root)
        return None

    def _without_retired(self, order: list[tuple[int, RestoreTier]],
                         passed: dict[int, str]) -> list[tuple[int, RestoreTier]]:
        """``order`` without the memory steps whose save was retired (``mgr.retire`` on
        any rank; ``ckpt/_memory/retired.py``), each put in ``passed`` with the reason. The
        same on every rank (collective under a process group's memory tier)."""
        assert self.memory is not None
        retired = self.memory.retired_saves()
        kept, found = [], set()
        for s, tier in order:
            plan = getattr(tier, "plans", {}).get(s)  # a process group's agreed save
            if plan is not None:
                found.add((s, plan.token))
            why = None if plan is None else retired.why(s, plan.token)
            if why is None:
                kept.append((s, tier))
            elif s not in passed:  # (its peer copies: the same save)
                passed[s] = _one_line(why)
                log.info("ckpt.restore passing over step %d in memory: %s", s, why)
        # What a later retire records when this node's own copies were lost (a replaced node).
        self.memory.found = frozenset(found)
        return kept

    def _verified(self, candidates: list[int]) -> frozenset[int]:
        """The verified steps among ``candidates``, read by rank 0 and the same on every rank
        (a storage failure reading the markers: none, so the restore takes the newest)."""
        found: list[int] | None = None
        if self.group.is_coordinator:
            try:
                found = sorted(verified_steps(self.storage, candidates))
            except OSError as e:
                log.warning("ckpt.restore cannot read the verified markers of %s (%s): "
                            "restoring the newest good step instead", self.root, e)
                found = []
        return frozenset(self.group.broadcast(found))

    def _attempt(self, step: int, tier: RestoreTier, state: MutableMapping[str, Any],
                 pool: cf.ThreadPoolExecutor, gate: Gate, *, in_place: bool
                 ) -> tuple[BaseException | None, frozenset[str], Manifest | None, Any, int]:
        """Load ``step`` from ``tier``: (the error, or None; the live tensors written; the
        manifest when it loaded; the storage read; the bytes read from it)."""
        try:
            # The forward gate reads the probe recorded at save time too: a memory tier
            # plans each rank's reads, and must plan those.
            storage = tier.open(step, state, probe=gate.forward)
        except CorruptCheckpointError as e:  # every rank raised it: agreed
            return e, frozenset(), None, None, 0
        counted = storage if isinstance(storage, CountedReads) else CountedReads(storage)
        before = counted.bytes_read
        try:
            # The root's replicated chunks are read once for the group; a memory tier reads
            # this node's memory, and what node-mates fetch from elsewhere once per node.
            coop = (Cooperation.of(self.group) if tier.tier is Tier.STORAGE
                    else getattr(storage, "cooperation", None))
            loaded = self._try_load(step, state, pool, counted, gate, in_place=in_place,
                                    coop=coop)
            return (*loaded, storage, counted.bytes_read - before)
        finally:
            if tier.owns_storage:
                storage.close()  # a memory tier's open files

    def _raise_fatal(self, step: int, error: BaseException | None, why: str,
                     dirty: frozenset[str]) -> None:
        """Raise for a step some rank failed on for good (no other step can help)."""
        if dirty:  # (also over this step's own PartialLoadError)
            raise PartialLoadError(
                f"{error or why}; and a failed one-pass read of a newer step had already "
                f"overwritten {len(dirty)} live tensors ({few_keys(sorted(dirty))}): the live "
                "state is mixed; restore a good step before training on",
                path=self.root, changed=dirty | getattr(error, "changed", dirty)) from error
        if isinstance(error, OSError) and not isinstance(error, CheckpointError):
            raise StorageError(f"restoring step {step} from {self.root} failed: {error}",
                               path=self.root) from error
        if error is not None and not isinstance(error, CorruptCheckpointError):
            raise error
        raise CheckpointError(f"another rank failed to restore step {step}: {why}",
                              path=self.root)

    def _restored(self, step: int, manifest: Manifest | None, storage: Any, tier: Tier,
                  root_reads: Any, tried: Fallback, done: Attempts) -> Restored:
        here = (Tier(getattr(storage, "tier", tier)), root_reads.bytes_read)
        ranks = tuple(self.group.all_gather(here))
        # One line says what the restore did: which step, from where, how much, how long,
        # and every attempt it gave up on first (the same on every rank), with the reason.
        log.info("ckpt.restore step=%d tier=%s bytes=%d seconds=%.3f skipped=%s root=%s",
                 step, here[0], done.bytes, done.seconds, "; ".join(
                     f"step {s} ({t}): {why}" for s, t, why in done.skipped) or "none",
                 self.root)
        if self.metrics:
            self.metrics.restored(len(tried.failures))
        assert manifest is not None  # every rank succeeded, this one too
        return Restored(step, manifest, RestoreInfo(step, here[0], here[1], ranks,
                                                    bytes=done.bytes, seconds=done.seconds,
                                                    skipped=done.skipped))

    def _try_load(self, step: int, state: MutableMapping[str, Any], pool: cf.ThreadPoolExecutor,
                  storage: Any, gate: Gate, *, in_place: bool, coop: Cooperation | None = None
                  ) -> tuple[BaseException | None, frozenset[str], Manifest | None]:
        """Load ``step`` into ``state``: (the error, or None; the live tensors written; the
        manifest when it loaded)."""
        location = step_dir(step)
        try:
            # A memory tier's agreed save comes with its manifest validated already.
            manifest = getattr(storage, "parsed_manifest", None) or read_manifest(
                storage, location, step)
            wrote = load_step(storage, location, manifest, gate.target(manifest),
                              rank=self.group.rank, allow_pickle=self.allow_pickle, pool=pool,
                              in_place=in_place, verify=gate.digests, coop=coop)
        except Exception as e:  # classified by Verdict.of; re-raised by restore
            if coop is not None:
                coop.abandon(e)  # (if it failed before load_step: the others wait for it)
            gate.agree(self.group, False)  # ranks run the forward check all or none
            return e, frozenset(), None
        forward_error = gate.check(step, manifest, self.group, f"{self.root}/{location}")
        if forward_error is not None:
            return forward_error, wrote, None
        return None, wrote, manifest

    def load(self, step: int | None, *, map_location: MapLocation,
             prefer: str = NEWEST) -> Restored | None:
        """See :meth:`ckpt.CheckpointManager.load`."""
        tried = Fallback(self.group, self.root, self.skipped, "load")
        candidates, verified = self._candidates(step, prefer)
        # As restore: the verified steps newest first, then the others newest first.
        self.passed_over = frozenset()
        candidates.sort(key=lambda s: (s in verified, s), reverse=True)
        with cf.ThreadPoolExecutor(self.threads) as pool:
            for s in candidates:
                location, error, value = step_dir(s), None, None
                try:
                    manifest = read_manifest(self.storage, location, s)
                    value = read_structure(self.storage, location, manifest,
                                           rank=self.group.rank, allow_pickle=self.allow_pickle,
                                           pool=pool, map_location=map_location,
                                           skip=frozenset({PROBE_ITEM}))
                except Exception as e:  # classified as restore does; every rank agrees
                    error = e
                agreed = tried.agree(error)
                verdict = Verdict.of(error)
                if verdict is not None and (step is not None or verdict.fatal):
                    raise error
                if agreed.fatal:
                    raise CheckpointError(f"another rank failed to load step {s}: "
                                          f"{agreed.fatal[0]}", path=self.root)
                if not agreed.bad:
                    self.passed_over = _newer(candidates, s) if verified else frozenset()
                    log.info("ckpt.load step=%d root=%s skipped=%d", s, self.root,
                             len(tried.failures))
                    return Restored(s, manifest, value=value)
                tried.skip(s, agreed.bad[0])
        if tried.failures:
            raise CorruptCheckpointError(tried.none_loaded(), path=self.root)
        return None
