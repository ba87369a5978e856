"""Options, gathered in one place as small frozen dataclasses validated on creation: how a
save is written (:class:`SaveOptions`) and a :class:`ckpt.CheckpointManager`'s schedule,
memory tier and metrics (its retention: :class:`ckpt.RetentionPolicy`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# 8 MiB chunks: large enough that per-chunk overhead (a manifest entry, one read, one digest)
# is negligible next to the bytes, small enough that an incremental save of a partly changed
# tensor rewrites little and a load has several chunks per file to read in parallel.
DEFAULT_CHUNK_BYTES = 8 << 20


def default_threads() -> int:
    """Writer/reader threads: one per core, at most 4 (a local disk gains nothing beyond)."""
    return max(1, min(4, os.cpu_count() or 1))


class _ChosenThreads(int):
    """``SaveOptions.write_threads`` when the caller did not set it: the number itself
    (what a restore's readers use, the most writer threads), marked so that a background
    save may use fewer (ckpt._save.concurrency). An int passed by the caller is not marked."""

    def __repr__(self) -> str:  # in SaveOptions' repr; str() and format() give the number
        return f"{int(self)} (chosen per save)"

    __str__ = int.__repr__


def chosen_threads(value: int) -> bool:
    """Whether ``write_threads`` is the default, which a save may adapt, not the caller's."""
    return isinstance(value, _ChosenThreads)


@dataclass(frozen=True)
class SaveOptions:
    """How a save lays out and writes its bytes.

    Args:
        chunk_bytes: target size of one chunk (the unit of digests, reuse and parallel reads).
        write_threads: data files written in parallel by one rank (one file per thread),
            and a restore's reader threads. Default: chosen per save (docs/guide.md, "Writer
            threads"): a save of CPU tensors gets one writer thread per core that training
            leaves free (the cores in this process's affinity mask minus
            ``torch.get_num_threads()``), at least 1; a save staged from a GPU or written
            to an object store gets one per core, at most 4. An explicit
            ``write_threads=N`` is used as given.
        writer_nice: how far below training's the writer threads' scheduling priority is
            (a nice increment, Linux; 0: the same priority). On a contended core training's
            threads run first, and the write takes the time they leave.
        allow_pickle: store values that are neither tensors nor JSON by pickling them.
        compression: None, or "zstd" (floating-point chunks byte-grouped first).
        compression_level: the zstd level; 1 is as small as 3 on weights and much faster.
        compression_threads: zstd worker threads per file being written (0: compress on
            the writer thread itself); benchmarks/bench_compression.py measures the choice.
        overlap_device_copy: copy the CUDA tensors that only ``optimizer.step()`` changes
            (parameters and state of the optimizers in the saved state) during the next
            forward and backward; their optimizer's step waits for the copy. False: training
            waits for every copy (for code that changes parameters in place
            other than through ``optimizer.step()``).
        rank_tables: write format 2 (a small manifest plus one chunk table per rank; see
            docs/format.md). None: whenever more than one rank saves; a single process
            writes format 1 (one manifest holding every chunk) unless this is True.
        incremental: (:class:`ckpt.CheckpointManager`) write only the chunks whose bytes
            changed since the base step (the step the manager last saved or restored);
            unchanged chunks are referenced.
        full_every: (:class:`ckpt.CheckpointManager`) with ``incremental``, every K-th save
            is a full one, so chains stay short.
        commit_timeout: (:class:`ckpt.CheckpointManager`) how long rank 0 waits for the other
            ranks' reports before it gives up on a step (a rank died or hangs): the step is
            not committed and every rank's save raises.
        probe: (:class:`ckpt.CheckpointManager`) a :class:`ckpt.Probe` recorded with every
            save, for ``ckpt verify --level forward`` and ``restore(state, verify="forward")``.
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    write_threads: int = _ChosenThreads(default_threads())
    allow_pickle: bool = False
    compression: str | None = None
    compression_level: int = 1
    compression_threads: int = 0
    overlap_device_copy: bool = True
    rank_tables: bool | None = None
    incremental: bool = False
    full_every: int = 10
    commit_timeout: float = 600.0
    probe: Any = None  # a ckpt.Probe; not imported here, the save wing sits below it
    writer_nice: int = 10
    # Whether write_threads is the default a save may adapt: options that save differently
    # are not equal, though an explicit count equals the default's number.
    _threads_chosen: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_threads_chosen", chosen_threads(self.write_threads))
        _positive_int("full_every", self.full_every)
        _positive_number("commit_timeout", self.commit_timeout)
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be at least 4096, not {self.chunk_bytes}")
        if isinstance(self.write_threads, bool) or not isinstance(self.write_threads, int) \
                or self.write_threads < 1:
            raise ValueError(f"write_threads must be an integer of at least 1, not "
                             f"{self.write_threads!r}")
        if isinstance(self.writer_nice, bool) or not isinstance(self.writer_nice, int) \
                or not 0 <= self.writer_nice <= 19:
            raise ValueError(f"writer_nice must be an integer in [0, 19], not "
                             f"{self.writer_nice!r}")
        if self.compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', not {self.compression!r}")
        if self.compression_threads < 0:
            raise ValueError(f"compression_threads must be >= 0, not {self.compression_threads}")
        if not -7 <= self.compression_level <= 22:
            raise ValueError(f"compression_level must be in [-7, 22], not {self.compression_level}")

    @property
    def max_file_bytes(self) -> int:
        """Compressed files are assembled in memory before writing: keep each one small."""
        return 64 << 20 if self.compression else 1 << 62


@dataclass(frozen=True)
class Schedule:
    """When a :class:`ckpt.CheckpointManager`'s ``save(step, ...)`` writes.

    Args:
        every_steps: when ``step % every_steps == 0`` (None: 1, or only by time when
            ``every_seconds`` is given alone).
        every_seconds: also when this many seconds (wall clock) passed since the last save.
            Rank 0 decides and tells the other ranks (one small broadcast per ``save``
            call), so every rank saves the same steps.
        save_on_preemption: on SIGTERM, the next ``save`` call saves the current step
            whatever the schedule, waits for it, and exits with status 143. With a process
            group, ranks receive SIGTERM at different steps: agree on it in the loop (an
            all-reduce) and call ``save(step, state, force=True)`` on every rank, as
            ``trainer.ElasticTrainer`` does.
        handle_sigterm: install a SIGTERM handler (it finishes the save in flight first).
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    save_on_preemption: bool = False
    handle_sigterm: bool = True

    def __post_init__(self) -> None:
        _positive_int("every_steps", self.every_steps, optional=True)
        _positive_number("every_seconds", self.every_seconds, optional=True)


@dataclass(frozen=True)
class MemoryTierOptions:
    """A :class:`ckpt.CheckpointManager`'s memory tier: every save is also published into
    node-local shared memory, so a restarted worker restores from RAM (docs/memory-tier.md).

    Args:
        persist_every: a save also goes to the root when its step is a multiple of
            ``persist_every * every_steps`` (``every_steps`` 1 without a step schedule):
            every K-th scheduled save, the same steps after any restart. A preempted save,
            and one called with ``persist=True``, always does.
        keep: generations (steps) kept in memory.
        budget: the most bytes the segment may hold (None: no limit but the free space).
        job: the job id in the segment's name (default: TORCHELASTIC_RUN_ID, else a hash
            of the root).
        replicas: under a process group, how many other nodes (a ring by node) receive a
            copy of each rank's newest step in their shared memory, in the background.
        shm_dir: where segments live (default ``/dev/shm``).
        node: this node's name in them (default: env CKPT_NODE, else the hostname followed
            by an identity kept in the node's /dev/shm, which torchrun's renumbering of the
            nodes after a loss does not change: docs/memory-tier.md, "Names").
    """

    persist_every: int = 1
    keep: int = 2
    budget: int | None = None
    job: str | None = None
    replicas: int = 1
    shm_dir: str | None = None
    node: str | None = None

    def __post_init__(self) -> None:
        _positive_int("persist_every", self.persist_every)
        _positive_int("keep", self.keep)
        _positive_int("budget", self.budget, optional=True)
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) \
                or self.replicas < 0:
            raise ValueError(f"replicas must be a non-negative integer, not {self.replicas!r}")


@dataclass(frozen=True)
class MetricsOptions:
    """Where a :class:`ckpt.CheckpointManager`'s metrics go besides ``mgr.metrics`` (in
    memory); both need prometheus_client (the ``ckpt[metrics]`` extra).

    Args:
        port: serve ``/metrics`` on this port, from the manager's opening to its
            ``close()``.
        textfile: write the metrics to this file after every commit, for node_exporter's
            textfile collector.
        addr: the address the port listens on: all interfaces by default, as Prometheus
            exporters do; bind it to the address your scraper reaches the job at
            (docs/observability.md).
    """

    port: int | None = None
    textfile: str | None = None
    addr: str = "0.0.0.0"

    def __post_init__(self) -> None:
        _positive_int("port", self.port, optional=True)
        if not isinstance(self.addr, str) or not self.addr:
            raise ValueError(f"addr must be a host address such as '127.0.0.1', not "
                             f"{self.addr!r}")
        if self.textfile is not None and not isinstance(self.textfile, (str, os.PathLike)):
            raise ValueError(f"textfile must be a path or None, not {self.textfile!r}")


def _positive_int(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if optional else ''}, "
                         f"not {value!r}")


def _positive_number(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number{' or None' if optional else ''}, "
                         f"not {value!r}")
