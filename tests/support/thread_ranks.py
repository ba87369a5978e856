"""Ranks as threads of one process, each with its progress markers and its heartbeat on one
c10d store: the hang detector's path without torchrun (tests/trainer/test_hang.py,
benchmarks/bench_hang.py)."""

from __future__ import annotations

import datetime
import statistics
import threading
import time

import torch.distributed as dist

from trainer.hangs import HangRule
from trainer.heartbeat import Heartbeat
from trainer.sections import Sections


class ThreadRanks:
    """``world`` training threads, each a rank with its markers and heartbeat (one TCPStore):
    data, forward (``step_sleep``), then a barrier as collective N, optimizer. ``stuck``
    (rank, step, how) gets stuck in its data section: "sleep" or "spin"."""

    def __init__(self, world: int, stuck: tuple[int, int, str], rule: HangRule, *,
                 step_sleep: float = 0.1, interval: float = 0.05) -> None:
        self.master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.world, self.stuck, self.rule = world, stuck, rule
        self.step_sleep, self.interval = step_sleep, interval
        self.barrier = threading.Barrier(world)
        self.lost: dict[int, list] = {r: [] for r in range(world)}
        self.beats: dict[int, Heartbeat] = {}
        self.stuck_at: float | None = None
        self.release = threading.Event()
        self.threads = [threading.Thread(target=self.train, args=(r,), daemon=True)
                        for r in range(world)]
        self.step_times: list[float] = []
        self.named_at: dict[int, float] = {}

    def store(self):
        s = dist.TCPStore("127.0.0.1", self.master.port, is_master=False,
                          timeout=datetime.timedelta(seconds=5))
        return dist.PrefixStore("hb", s)

    def train(self, rank: int) -> None:
        sections = Sections()
        sections.begin_attempt()
        self.beats[rank] = Heartbeat(self.store(), rank, self.world, timeout=5.0,
                                     interval=self.interval, on_lost=lambda v, r=rank: self._named(r, v),
                                     sections=sections, hang_rule=self.rule).start()
        step = 0
        while not self.release.is_set():
            step += 1
            t0 = time.monotonic()
            sections.step(step)
            self.beats[rank].update(step - 1)
            sections.enter("data")
            if (rank, step) == self.stuck[:2]:
                self.stuck_at = time.monotonic()
                (sleep_in_loader if self.stuck[2] == "sleep" else spin_in_python)(self.release)
                return
            sections.enter("forward")
            time.sleep(self.step_sleep)
            sections.enter("collective")
            try:
                self.barrier.wait(timeout=10)
            except threading.BrokenBarrierError:
                return
            sections.enter("optimizer")
            if rank == 0:
                self.step_times.append(time.monotonic() - t0)

    def _named(self, rank: int, verdict) -> None:
        self.named_at.setdefault(rank, time.monotonic())
        self.lost[rank].append(verdict)

    def run(self) -> tuple[float, float, float]:
        """Start; wait for every rank's verdict; returns (typical step, seconds from the
        stop to the first rank's verdict, to the last rank's)."""
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(self.lost.values()):
            time.sleep(0.01)
        detected = time.monotonic()
        self.release.set()
        self.barrier.abort()
        for b in self.beats.values():
            b.stop()
        for t in self.threads:
            t.join(5)
        assert all(self.lost.values()), {r: len(v) for r, v in self.lost.items()}
        assert self.stuck_at is not None
        first = min(self.named_at.values())
        return (statistics.median(self.step_times), first - self.stuck_at,
                detected - self.stuck_at)


def sleep_in_loader(release: threading.Event) -> None:
    release.wait(60)  # a DataLoader that never hands over its batch


def spin_in_python(release: threading.Event) -> None:
    while not release.is_set():  # holds the interpreter but for its switch interval
        pass
