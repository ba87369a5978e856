"""Run a test body on N real processes joined by a gloo process group.

``run_ranks(n, fn, *args)`` starts n processes, initializes ``torch.distributed`` (gloo, a
FileStore rendezvous in a fresh temp dir) in each, calls ``fn(rank, world_size, *args)`` and
returns the list of per-rank return values; an exception in any rank fails the caller with
that rank's traceback. ``fn`` must be a top-level function of an importable module (it is
pickled by name).

The ranks are forked from ``forkserver()``: multiprocessing's fork server, started once per
pytest process with torch, ckpt and the suite's other heavy imports loaded, so a rank starts
in milliseconds instead of paying torch's import (seconds on a 2-core machine). Each rank is
still a fresh process of its own (own pid, own gloo group, killable on its own); it runs
with the environment of the ``run_ranks`` call, as a spawned process would.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.context
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

_ROOT = str(Path(__file__).resolve().parents[2])

# What the suite's forked processes import (run_ranks' bodies, test_exact_resume's loops,
# the combination matrix's runs). multiprocessing has one fork server per process and takes
# the preload list of the first start, so every user of the fork server must go through
# forkserver() below. torch._dynamo: every torch.optim optimizer imports it when first built
# (about 2 s of CPU, paid again by every forked process otherwise); s3fs: the S3 roots.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor",
           "torch.distributed.device_mesh", "torch._dynamo", "ckpt", "storage_backends",
           "trainer", "torchdata.stateful_dataloader", "s3fs", "tests.support.exact_workers",
           "tests.support.combo_workers"]
# The integration job scripts (test_hf_contract, test_integrations run them from the fork
# server): preloaded only when this process imported their framework already (the run
# collected those tests), so that a run without them pays no framework import.
JOBS = {"transformers": "tests.support.hf_job", "accelerate": "tests.support.acc_job",
        "lightning": "tests.support.pl_job"}


def forkserver() -> multiprocessing.context.BaseContext:
    """The multiprocessing context whose processes fork from the suite's preloaded server."""
    for p in (_ROOT,):  # the server imports PRELOAD from sys.path
        if p not in sys.path:
            sys.path.insert(0, p)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD + [job for framework, job in JOBS.items()
                                          if framework in sys.modules])
    return ctx


def run_forked(target: Callable, *args: Any, timeout: float = 300) -> int | None:
    """Run ``target(*args)`` in a process forked from :func:`forkserver`; wait ``timeout``
    seconds for it (then kill it) and return its exit code (``-signal.SIGKILL`` for a
    process that killed itself, or that was killed here for running too long)."""
    proc = forkserver().Process(target=target, args=args, daemon=True)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return proc.exitcode


def _entry(rank: int, world: int, store_path: str, fn: Callable, args: tuple, queue,
           environ: dict[str, str]) -> None:
    # The fork server's environment is the one it started with: use the caller's.
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(n: int, fn: Callable, *args: Any, timeout: float = 120.0,
              allow_exit: set[int] | None = None) -> list[Any]:
    """Run ``fn(rank, n, *args)`` on n gloo ranks; return their results by rank.

    Ranks in ``allow_exit`` may die without reporting (a test that kills one on purpose);
    their result is None.
    """
    ctx = forkserver()
    queue = ctx.Queue()
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, n, store, fn, args, queue, environ),
                             daemon=True)
                 for r in range(n)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        expected = n - len(allow_exit or ())
        try:
            while len(results) + len(errors) < expected:
                rank, status, payload = queue.get(timeout=timeout)
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append(f"rank {rank} failed:\n{payload}")
        finally:
            for p in procs:
                p.join(timeout=10 if not errors else 1)
                if p.is_alive():
                    p.kill()
        if errors:
            raise AssertionError("\n".join(errors))
    return [results.get(r) for r in range(n)]
