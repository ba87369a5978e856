"""The structure and digest levels of ``ckpt verify``, and the driver that runs the levels.

Levels include the ones before them:

* ``structure``: the manifest parses and validates (ckpt's on-disk format: plain file names,
  bounded sizes, chunks tiling each tensor); every file it names exists with its recorded size and
  holds its byte ranges; and each data file's safetensors header agrees with the manifest
  (entry names, dtypes, shapes, byte ranges), by the rule a restore applies to the files it
  reads (:func:`ckpt.inspect.header_disagreement`). Checking them means a flipped bit
  anywhere in a data file is found: in the header here, in the data by the digest level.
* ``digest``: every chunk is read (in parallel) and its xxh3 digest compared.
* ``forward``: see :mod:`verify.forward`.

Unlike ``Checkpoints.check_structure`` (what a restore checks, stopping at the first
problem), these checks collect every problem they find, so one run reports them all. All
reads go through :mod:`ckpt.inspect`.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Any, Callable

import torch

import ckpt
from ckpt.inspect import Checkpoints, Chunk, Manifest, header_disagreement

from .report import Problem, StepReport, UsageError, count

LEVELS = ("structure", "digest", "forward")


def check_structure(cps: Checkpoints, step: int, manifest: Manifest) -> list[Problem]:
    """Files present with their recorded sizes, chunks inside them, headers agreeing."""
    problems: list[Problem] = []
    location = cps.location(step)
    own = {f"{location}/{n}": size for n, size in manifest.files.items()}
    dtypes = {k: e.torch_dtype for k, e in manifest.tensors.items()}
    for path, chunks in cps.files(step, manifest).items():
        url = cps.url_of(path)
        try:
            actual = cps.file_size(path)
        except FileNotFoundError:
            problems.append(Problem("structure", f"{url} is missing", url))
            continue
        expected = own.get(path)
        if expected is not None and actual != expected:
            problems.append(Problem("structure", f"{url} is {count(actual, 'byte')}, the manifest "
                                    f"recorded {expected}: the file was truncated or changed",
                                    url))
            continue
        end = max((c.start + c.length for _, c in chunks), default=0)
        if end > actual:
            key = next(k for k, c in chunks if c.start + c.length == end)
            problems.append(Problem("structure", f"{url} is {count(actual, 'byte')}, but {key} "
                                    f"needs bytes up to {end}: the file is truncated", url))
            continue
        problems += check_header(cps, path, actual, chunks, dtypes, exact=path in own)
    return problems


def check_header(cps: Checkpoints, path: str, file_size: int,
                 chunks: list[tuple[str, Chunk]], dtypes: dict[str, torch.dtype],
                 exact: bool) -> list[Problem]:
    """The data file's safetensors header against the manifest's chunks in that file
    (``dtypes``: each tensor key's dtype), by the rule a restore applies too
    (:func:`ckpt.inspect.header_disagreement`).

    ``exact``: the file belongs to this step, so its header must list exactly these chunks
    (a file reused from an earlier step may also hold chunks this step no longer uses).
    """
    url = cps.url_of(path)
    why = header_disagreement(lambda start, n: cps.read_bytes(path, start, n), file_size,
                              chunks, dtypes, exact=exact)
    return [] if why is None else [Problem("header", f"{url}: safetensors header {why}", url)]


def check_digests(cps: Checkpoints, step: int, manifest: Manifest, *, threads: int = 4,
                  progress: Callable[[int], None] | None = None) -> list[Problem]:
    """Read every chunk (``threads`` at a time) and compare its digest.

    Each thread reuses one buffer, so the cost is the read and the hash, not page faults
    of fresh allocations. ``progress(nbytes)`` is called from this thread as chunks finish.
    """
    jobs = sorted(((cps.chunk_path(step, c), c.start, key, c)
                   for key, entry in manifest.tensors.items() for c in entry.chunks),
                  key=lambda j: (j[0], j[1]))
    local = threading.local()

    def one(key: str, chunk: Chunk) -> Problem | None:
        dtype = manifest.tensors[key].torch_dtype
        nbytes = chunk.numel * dtype.itemsize
        buf = getattr(local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = local.buf = torch.empty(max(nbytes, 8), dtype=torch.uint8)
        try:
            cps.check_chunk(step, key, chunk, dtype, buf)
        except ckpt.CorruptCheckpointError as e:
            return Problem("digest", str(e), e.path)
        except PermissionError as e:
            raise UsageError(f"cannot read {e.filename}: {e}") from e
        return None

    problems = []
    threads = max(1, min(threads, len(jobs)))  # a thread and its buffer per chunk at most
    with cf.ThreadPoolExecutor(threads) as pool:
        futures = {pool.submit(one, key, chunk): chunk.length
                   for _, _, key, chunk in _interleave(jobs, threads)}
        for future in cf.as_completed(futures):
            problem = future.result()
            if problem is not None:
                problems.append(problem)
            if progress is not None:
                progress(futures[future])
    return sorted(problems, key=lambda p: (p.file or "", p.message))


def _interleave(jobs: list, n: int) -> list:
    """Cut the jobs (sorted by file and offset) into ``n`` runs of about equal bytes and
    take one from each in turn: the pool's ``n`` threads then each read mostly one run, front
    to back, which keeps the kernel's read-ahead working (n threads reading neighbouring
    chunks of one file defeat it: 4 such threads were ~25% slower than 1 on a cold cache)."""
    if n <= 1 or len(jobs) <= 1:
        return jobs
    total = sum(j[3].length for j in jobs) or 1
    runs: list[list] = [[] for _ in range(n)]
    done = 0
    for job in jobs:
        runs[min(n - 1, done * n // total)].append(job)
        done += job[3].length
    out = []
    for i in range(max(len(r) for r in runs)):
        out += [r[i] for r in runs if i < len(r)]
    return out


def verify_step(source: Checkpoints | ckpt.CheckpointManager, step: int,
                level: str = "structure", progress: Callable[[int], None] | None = None, *,
                model: Any = None, loss: Any = None, rtol: float | None = None,
                atol: float | None = None, threads: int = 4,
                trust_recorded: bool = False) -> StepReport:
    """Verify one committed step at ``level`` (and the levels before).

    ``source``: checkpoints opened with :func:`ckpt.inspect.open` (a root or one checkpoint
    directory) or an open :class:`ckpt.CheckpointManager`. ``model``/``loss``/``rtol``/
    ``atol``/``trust_recorded`` are for the forward level (see
    :func:`verify.forward.check_forward`). A later level runs only when the earlier ones
    passed.

    Raises:
        ValueError: an unknown level.
        CheckpointNotFoundError: the step does not exist, or a writer retired it while it
            was being checked.

    A step that cannot be read (permissions, I/O errors) gives a report with ``error`` set
    (exit status 2) rather than an exception, so ``--all`` still checks the other steps.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
    t0 = time.perf_counter()
    cps = source if isinstance(source, Checkpoints) else ckpt.inspect.open(source)
    report = StepReport(step, level, location=cps.step_url(step))
    try:
        _run_levels(cps, step, level, report, progress, model=model, loss=loss,
                    rtol=rtol, atol=atol, threads=threads, trust_recorded=trust_recorded)
    except UsageError as e:
        report.error = str(e)
    except ckpt.CheckpointNotFoundError:
        raise
    except OSError as e:  # unreadable storage: this step is not checked, others still are
        report.error = (f"step {step} could not be read: {type(e).__name__}: {e}; fix the "
                        "storage or its permissions and verify again")
    if (report.problems or report.error is not None) and cps.is_root and _retired(cps, step):
        # A live writer's retention deleted the step under us: no damage to report.
        raise ckpt.CheckpointNotFoundError(
            f"step {step} of {cps.url} was retired (deleted by its writer's retention) while "
            "it was being checked", path=cps.step_url(step))
    report.ok = not report.problems and report.error is None
    report.seconds = time.perf_counter() - t0
    return report


def _retired(cps: Checkpoints, step: int) -> bool:
    try:
        return step not in cps.steps()
    except ckpt.CheckpointError:
        return False  # cannot tell: report what was found


def _run_levels(cps: Checkpoints, step: int, level: str, report: StepReport,
                progress: Callable[[int], None] | None, *, threads: int,
                **forward_args: Any) -> None:
    try:
        manifest = cps.manifest(step)
    except ckpt.CorruptCheckpointError as e:  # a missing step (NotFound) propagates
        report.checks.append("manifest")
        report.problems.append(Problem("manifest", str(e), e.path))
        return
    report.checks.append("manifest")
    report.tensors = len(manifest.tensors)
    damaged = manifest.table_problems()  # format 2: the rank tables, each listed when bad
    if damaged:
        report.checks.append("structure")
        report.problems += [Problem("structure", str(e), e.path) for e in damaged]
        return
    report.files = len(cps.files(step, manifest))
    report.bytes = sum(c.length for e in manifest.tensors.values() for c in e.chunks)
    report.checks += ["structure", "header"]
    report.problems += check_structure(cps, step, manifest)
    if report.problems or level == "structure":
        return
    report.checks.append("digest")
    report.problems += check_digests(cps, step, manifest, threads=threads, progress=progress)
    if report.problems or level == "digest":
        return
    from .forward import check_forward

    problems, report.forward = check_forward(cps, step, manifest, **forward_args)
    report.checks += ["weights", "output"] + (
        ["loss"] if report.forward.get("loss_now") is not None else [])
    report.problems += problems


def verify(path: str, step: int | None = None, level: str = "structure", model: Any = None,
           **options: Any) -> StepReport:
    """Verify ``step`` (the newest when None) of the checkpoints at ``path``: a root, a
    step directory or a ``ckpt.save`` directory.

    ``model`` (forward level): a ``"module:callable"`` factory, a callable returning a fresh
    ``nn.Module``, or a fresh module; None uses the factory recorded by the probe when
    ``trust_recorded=True`` (it imports and runs code the checkpoint names).
    ``options``: ``loss``, ``rtol``, ``atol``, ``threads``, ``progress``, ``trust_recorded``.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist, holds no committed step, or not
            ``step``.
    """
    cps = ckpt.inspect.open(path)
    if step is None:
        step = cps.latest_step()
        if step is None:
            raise ckpt.CheckpointNotFoundError(f"{path} holds no committed step", path=path)
    else:
        cps.require(step)
    progress = options.pop("progress", None)
    return verify_step(cps, step, level, progress, model=model, **options)
