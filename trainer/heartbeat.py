"""Dropped-rank and hung-rank detection through the c10d store.

Every rank runs two daemon threads:

- the **beat** thread writes ``{"step", "seq", "time", "state"}`` under the rank's key every
  ``interval`` seconds, with the training thread's progress when it has progress markers
  (the keys listed in :mod:`trainer.sections`; the Python stack of the training thread
  once its section is over the hang limit), and reads the watched peers' keys (one
  ``multi_get`` once they exist);
- the **watchdog** thread never touches the store. It looks at what the beat thread last saw
  and reports a peer whose beat has not changed for ``timeout`` seconds, or a store that has
  not answered for ``timeout`` seconds (its host hangs) or keeps refusing (its host died);
  with progress markers, also a rank whose training thread has not left its section for
  longer than the section's limit while the others wait for it (:mod:`trainer.hangs`: a
  live process whose beat thread runs on). When that rank is this one, its beat says
  ``"state": "hung"`` with its stack before the watchdog reports it.

Two threads because a store call can block: if the process that hosts the store is stopped,
every ``set``/``get`` waits for the client's timeout, and a watchdog doing its own I/O would
be stuck with it. Silence is measured on this rank's monotonic clock (the time the beat was
*seen* to change), so peers' clocks never matter.

Give the heartbeat a store connection of its own (``store.clone()``): a c10d ``TCPStore``
client serializes its calls, so a ``wait`` elsewhere (ckpt's commit vote waits on the default
store for up to ``commit_timeout``) would otherwise hold up the beats for as long.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import time
from typing import Any, Callable

from trainer.hangs import Hang, HangRule, RankProgress, judge, thread_stack
from trainer.sections import Sections

log = logging.getLogger("trainer.heartbeat")

#: Above this many ranks each rank watches only its next ``RING_WATCH`` peers (a ring): every
#: rank is still watched, and the store sees O(world) reads per interval instead of O(world^2).
FULL_WATCH_LIMIT = 64
RING_WATCH = 8


@dataclasses.dataclass
class PeerLoss:
    """What a heartbeat found wrong: which ranks are lost and what was last heard of them."""

    reason: str                       # "heartbeat" (peers silent), "store" (store unusable)
                                      # or "hang" (a rank stopped making progress)
    lost: list[int]                   # ranks judged lost
    last_steps: dict[int, int | None]  # the step each lost rank last reported
    silent_s: dict[int, float]        # how long each lost rank has been silent
    last_seen: dict[int, float]       # wall time at which its beat last changed (our clock)
    detected_at: float                # wall time of the verdict
    detail: str = ""
    hang: Hang | None = None          # reason "hang": where each rank was, the culprits' stacks

    def describe(self) -> str:
        if self.hang is not None:
            return f"hung: {self.hang.describe()}"
        ranks = ", ".join(f"rank {r} (last reported step {self.last_steps.get(r)}, silent "
                          f"{self.silent_s.get(r, 0.0):.1f}s)" for r in self.lost)
        what = "store unusable" if self.reason == "store" else "heartbeat lost"
        return f"{what}: {ranks or 'no rank identified'}" + (
            f"; {self.detail}" if self.detail else "")


class Heartbeat:
    """Heartbeats of one rank in the c10d store, and a watchdog over its peers.

    Args:
        store: a c10d store used by this object only (``default_store.clone()``); wrap it in
            a ``PrefixStore`` unique to the job attempt so stale keys are never read.
        rank, world_size: this rank and the group size.
        timeout: a watched peer silent this long is lost; a store that has not answered
            this long is unusable (its host hangs).
        interval: seconds between beats.
        on_lost: called once, from the watchdog thread, with a :class:`PeerLoss`; it may
            exit the process. Default: log only.
        store_host_rank: the rank whose process (or node) hosts the store; named as lost
            when the store itself fails.
        store_error_grace: consecutive store errors (refused/reset connections: the host
            is gone) are reported after this many seconds (default ``2 * interval``),
            without waiting for ``timeout``.
        watch: the ranks to watch (default: all peers up to 64 ranks, else a ring).
        sections: the training thread's progress markers, published with each beat.
        hang_rule: how long a section may stand still (None: progress is published, never
            judged). A verdict needs every watched live peer's progress; when only a ring
            is watched, ranks stuck together (none behind) are left to the collective
            timeout, since the one behind may be outside the ring.
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, timeout: float = 30.0,
                 interval: float = 1.0, on_lost: Callable[[PeerLoss], None] | None = None,
                 store_host_rank: int = 0, store_error_grace: float | None = None,
                 watch: list[int] | None = None, sections: Sections | None = None,
                 hang_rule: HangRule | None = None) -> None:
        if timeout <= 0 or interval <= 0:
            raise ValueError("timeout and interval must be positive")
        if timeout < 2 * interval:
            raise ValueError(f"heartbeat timeout {timeout}s must be at least two intervals "
                             f"({2 * interval}s)")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.interval = float(interval)
        self.on_lost = on_lost
        self.store_host_rank = store_host_rank
        self.store_error_grace = (2 * interval if store_error_grace is None
                                  else float(store_error_grace))
        if watch is None:
            peers = [r for r in range(world_size) if r != rank]
            if world_size > FULL_WATCH_LIMIT:
                peers = [(rank + i) % world_size for i in range(1, RING_WATCH + 1)]
            watch = peers
        self.watch = sorted(set(watch) - {rank})
        self.sections, self.hang_rule = sections, hang_rule
        self._whole_world = len(self.watch) == world_size - 1
        self._hung: Hang | None = None           # this rank's own hang, once judged
        self._wake = threading.Event()           # beat now (this rank was found hung)
        self._hung_published = threading.Event()
        self._crossing: float | None = None       # when this rank's section passes its limit
        self._keys = [str(r) for r in self.watch]
        self._lock = threading.Lock()
        self._step: int | None = None
        self._seq = 0
        self._stopping = threading.Event()
        self._started_mono = time.monotonic()
        self._last_ok = self._started_mono      # last store round trip that succeeded
        self._error_since: float | None = None  # first of a run of failed round trips
        self._last_error: str | None = None
        self._peer_value: dict[int, bytes | None] = {r: None for r in self.watch}
        self._peer_change: dict[int, float] = {r: self._started_mono for r in self.watch}
        self._peer_info: dict[int, dict] = {}
        self._all_present = False
        self._reported: PeerLoss | None = None
        self._threads: list[threading.Thread] = []
        self._set_store_timeout()

    def _set_store_timeout(self) -> None:
        # A call to a hung store must come back, so that the next beat can try again.
        try:
            self.store.set_timeout(datetime.timedelta(seconds=max(self.interval,
                                                                  self.timeout / 2)))
        except Exception:  # not every store type has set_timeout; the watchdog copes anyway
            pass

    # -- lifetime ------------------------------------------------------------------------------
    def start(self) -> "Heartbeat":
        now = time.monotonic()
        self._started_mono = self._last_ok = now
        self._peer_change = {r: now for r in self.watch}
        for target, name in ((self._beat_loop, "ckpt-heartbeat"),
                             (self._watch_loop, "ckpt-watchdog")):
            t = threading.Thread(target=target, name=f"{name}-{self.rank}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def update(self, step: int) -> None:
        """Tell the peers this rank finished ``step`` (read by the next beat)."""
        self._step = step

    def peer_payloads(self) -> dict[int, dict]:
        """The last beat read from each watched peer (its JSON object: see
        :mod:`trainer.sections` for the progress keys), whatever its state."""
        with self._lock:
            return {r: dict(v) for r, v in self._peer_info.items()}

    def peer_ages(self) -> dict[int, float]:
        """Seconds since each watched, live peer's beat last changed (this rank's clock)."""
        now = time.monotonic()
        with self._lock:
            return {r: now - t for r, t in self._peer_change.items()
                    if self._peer_info.get(r, {}).get("state", "alive") == "alive"}

    def stop(self, *, final_state: str = "stopped") -> None:
        """Stop both threads; peers then see ``final_state`` and stop watching this rank."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=self.interval + self.timeout / 2 + 1)
        try:
            self.store.set(str(self.rank), self._payload(final_state))
        except Exception:  # the store may be gone already (its host finished)
            pass

    @property
    def reported(self) -> PeerLoss | None:
        return self._reported

    # -- progress ------------------------------------------------------------------------------
    def own_progress(self, *, with_stack: bool = False) -> tuple[RankProgress, dict] | None:
        """This rank's progress now and its payload keys (None without markers, or in a
        section the peers would not accept); the training thread's stack is added when it
        is over its limit (or ``with_stack``)."""
        if self.sections is None:
            return None
        payload = self.sections.payload()
        rule = self.hang_rule
        limit = None if rule is None else rule.limit(payload["section"], payload["stats"])
        payload["limit"] = None if limit is None else round(limit, 4)
        if with_stack or (limit is not None and payload["age"] > limit):
            payload["stack"] = thread_stack(self.sections.thread_id)
        payload["step"] = self._step
        progress = RankProgress.from_payload(self.rank, payload)
        if progress is None:
            # A section name the peers would refuse (``Sections.enter`` takes any): beat
            # without progress rather than fail the beat, which would read as a dead store.
            return None
        return progress, payload

    # -- the beat thread: all store I/O --------------------------------------------------------
    def _payload(self, state: str = "alive") -> str:
        with self._lock:
            self._seq += 1
            seq = self._seq
        beat: dict[str, Any] = {"step": self._step, "seq": seq, "time": time.time(),
                                "state": state}
        own = self.own_progress(with_stack=self._hung is not None)
        self._crossing = None
        if own is not None:
            beat.update({k: v for k, v in own[1].items() if k != "step"})
            progress = own[0]
            if progress.limit is not None and progress.age <= progress.limit:
                # beat again the moment the section passes its limit (with the stack), not
                # up to an interval later
                self._crossing = time.monotonic() + progress.limit - progress.age
        if self._hung is not None and state == "alive":
            beat["state"] = "hung"
        return json.dumps(beat)

    def _beat_loop(self) -> None:
        while not self._stopping.is_set():
            t0 = time.monotonic()
            hung = self._hung is not None
            try:
                self._beat_once()
                if hung:
                    self._hung_published.set()
            except Exception as e:  # refused, reset or timed out: the watchdog judges
                now = time.monotonic()
                with self._lock:
                    if self._error_since is None:
                        self._error_since = t0
                    self._last_error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                log.debug("heartbeat rank=%d store error after %.2fs: %s", self.rank,
                          now - t0, self._last_error)
            until = t0 + self.interval
            if self._crossing is not None:
                until = min(until, self._crossing + 0.005)
            self._wake.wait(max(0.0, until - time.monotonic()))
            self._wake.clear()

    def _beat_once(self) -> None:
        self.store.set(str(self.rank), self._payload())
        values: dict[int, bytes | None] = {}
        if self._keys:
            if not self._all_present:
                self._all_present = bool(self.store.check(self._keys))
            if self._all_present:
                values = dict(zip(self.watch, self.store.multi_get(self._keys)))
            else:
                values = {r: (self.store.get(k) if self.store.check([k]) else None)
                          for r, k in zip(self.watch, self._keys)}
        now = time.monotonic()
        with self._lock:
            self._last_ok = now
            self._error_since = None
            for r, v in values.items():
                if v is not None and v != self._peer_value[r]:
                    self._peer_value[r] = v
                    self._peer_change[r] = now
                    try:
                        beat = json.loads(v)
                    except ValueError:
                        beat = {}
                    # Anyone who reaches the store can write a key: only an object is a beat.
                    self._peer_info[r] = beat if isinstance(beat, dict) else {}

    # -- the watchdog thread: judges, never blocks on the store --------------------------------
    def _watch_loop(self) -> None:
        period = max(0.05, min(self.interval / 4, self.timeout / 8))
        while not self._stopping.wait(period):
            verdict = self.check()
            if verdict is not None:
                if verdict.hang is not None and self.rank in verdict.lost:
                    self._publish_own_hang(verdict.hang)
                elif verdict.hang is not None and self.rank == self.store_host_rank:
                    # The store goes with this process: give the peers two beats to read
                    # the culprit's own beat, so they name it rather than a lost store.
                    self._stopping.wait(2 * self.interval)
                self._reported = verdict
                log.error("heartbeat rank=%d: %s", self.rank, verdict.describe())
                if self.on_lost is not None:
                    self.on_lost(verdict)
                return

    def _publish_own_hang(self, hang: Hang) -> None:
        """This rank is the one holding the job up: beat ``"hung"`` with the stack now, and
        give the peers a beat's time to read it before the verdict (which may end the
        process)."""
        self._hung = hang
        self._wake.set()
        if self._hung_published.wait(2 * self.interval + 1.0):
            self._stopping.wait(self.interval)

    def check(self, *, min_silence: float | None = None) -> PeerLoss | None:
        """The current verdict: None while every watched peer and the store are fine.

        ``min_silence`` (default ``timeout``) lowers the bar: after a collective failed, a
        peer silent for a few intervals is the likely culprit.
        """
        limit = self.timeout if min_silence is None else min_silence
        now, wall = time.monotonic(), time.time()
        with self._lock:
            last_ok, error_since, error = self._last_ok, self._error_since, self._last_error
            change = dict(self._peer_change)
            info = {r: dict(v) for r, v in self._peer_info.items()}

        def seen(r: int) -> float:
            return wall - (now - change[r])

        store_silent = now - last_ok
        erroring = error_since is not None and now - error_since >= min(
            self.store_error_grace, limit)
        if store_silent > limit or erroring:
            host = self.store_host_rank
            lost = [host] if host != self.rank else []
            detail = (f"the store has not answered for {store_silent:.1f}s"
                      + (f" (last error: {error})" if error else "")
                      + f"; it is hosted by rank {host}'s process or node")
            return PeerLoss("store", lost,
                            {r: info.get(r, {}).get("step") for r in lost},
                            {r: now - change[r] for r in lost if r in change},
                            {r: seen(r) for r in lost if r in change}, wall, detail)
        if store_silent > 2.5 * self.interval:
            # The store itself is late: the peers' beats read through it are stale, so their
            # silence says nothing yet; the store's own verdict above decides.
            return None
        lost = [r for r in self.watch
                if info.get(r, {}).get("state", "alive") == "alive" and now - change[r] > limit]
        if not lost:
            return self._check_progress(info, {r: seen(r) for r in change}, wall)
        never = [r for r in lost if r not in info]
        return PeerLoss("heartbeat", lost, {r: info.get(r, {}).get("step") for r in lost},
                        {r: now - change[r] for r in lost}, {r: seen(r) for r in lost}, wall,
                        f"never heard from {never}" if never else "")

    def _check_progress(self, info: dict[int, dict], seen: dict[int, float],
                        wall: float) -> PeerLoss | None:
        """The hang verdict from this rank's progress (now) and the peers' (as they last
        published it), or None (:mod:`trainer.hangs`)."""
        if self.hang_rule is None:
            return None
        own = self.own_progress()
        if own is None:
            return None
        progress = {self.rank: own[0]}
        for r in self.watch:
            beat = info.get(r)
            if beat is None:
                return None  # not heard from yet: it may be the one behind
            if beat.get("state", "alive") not in ("alive", "hung"):
                continue  # done, stopped, preempted: not waited for
            p = RankProgress.from_payload(r, beat)
            if p is None:
                return None
            progress[r] = p
        hang = judge(progress, me=self.rank)
        if hang is None or (hang.together and not self._whole_world):
            return None
        if self.rank in hang.culprits and own[0].stack is None:  # the report carries it
            with_stack = self.own_progress(with_stack=True)
            if with_stack is not None:  # (None: the thread moved on meanwhile)
                progress[self.rank] = with_stack[0]
                hang = dataclasses.replace(hang, progress=progress)
        lost = hang.culprits
        # When each culprit entered its section: the failure's time in the run summary.
        entered = {r: (wall if r == self.rank else seen.get(r, wall)) - progress[r].age
                   for r in lost}
        return PeerLoss("hang", lost, {r: progress[r].step for r in lost},
                        {r: progress[r].age for r in lost}, entered, wall, hang.describe(),
                        hang)

    def diagnose(self, grace: float) -> PeerLoss | None:
        """After a collective failed: wait up to ``grace`` seconds for a culprit to show.

        A peer counts as lost once it has been silent for ``2.5 * interval`` (it missed two
        beats), the store as unusable once it failed for the error grace.
        """
        deadline = time.monotonic() + grace
        while True:
            verdict = self._reported or self.check(min_silence=2.5 * self.interval)
            if verdict is not None or time.monotonic() >= deadline:
                return verdict
            time.sleep(min(0.1, self.interval / 4))
