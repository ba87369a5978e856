"""Storage backends: ckpt against DCP on an S3 endpoint, and tensorstore against POSIX on disk.

1. S3 (moto's server on loopback, started here): save and load of the same state by ckpt
   (CheckpointManager on ``s3://``, the fsspec backend) and by torch.distributed.checkpoint's
   FsspecWriter/FsspecReader, one process. DCP runs with ``sync_files=False`` (on fsspec
   streams its fsync falls back to a host-wide ``os.sync()``, which says nothing about S3; an
   S3 PUT is durable when it returns) and with as many writer threads as ckpt.
2. Local disk: ckpt's tensorstore backend (``tensorstore+file://``) against its POSIX backend.

Every ckpt load verifies each chunk's digest; DCP's does not. Methods run interleaved, one
repetition each in turn; the tables give medians. moto is a Python server: the S3 figures
compare two clients against one slow endpoint, not what either reaches on AWS.

Run from the repository root::

    python benchmarks/bench_storage.py [--sizes 128M] [--shapes many] [--reps 3]
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (puts the repository root on sys.path too)
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import (  # noqa: E402
    FsspecReader, FsspecWriter)

import ckpt  # noqa: E402
from ckpt.options import default_threads  # noqa: E402
from storage_backends import open_storage  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
logging.getLogger("werkzeug").setLevel(logging.ERROR)


def start_moto() -> tuple[object, str, str]:
    """moto's S3 server on a free loopback port, fake credentials, one bucket."""
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                        "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ[name] = value
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    return server, endpoint, "bench"


def ckpt_cases(open_root, state, dest, drop_cache: bool = False) -> list:
    """Save and load cases of ckpt through a CheckpointManager on roots from ``open_root``
    (``drop_cache``: drop the page cache before each load, when allowed, for cold reads)."""
    roots: dict[int, str] = {}

    def save(rep: int) -> dict[str, float]:
        roots[rep] = f"r{rep}-{uuid.uuid4().hex[:6]}"
        with ckpt.CheckpointManager(open_root(roots[rep]), async_save=False,
                                    schedule=ckpt.Schedule(handle_sigterm=False)) as mgr:
            with common.Stopwatch() as sw:
                mgr.save(1, state).wait()
        return {"save": sw.seconds}

    def load(rep: int) -> dict[str, float]:
        storage = open_root(roots[rep])
        if drop_cache:
            common.drop_page_cache()
        with ckpt.CheckpointManager(storage, read_only=True) as mgr:
            with common.Stopwatch() as sw:
                mgr.restore(dest, 1)
        assert common.same_values(state, dest)
        for entry in storage.list():
            storage.delete(entry.name)
        return {"load": sw.seconds}

    return [save, load]


def dcp_cases(endpoint: str, bucket: str, state, dest) -> list:
    options = {"client_kwargs": {"endpoint_url": endpoint}}
    paths: dict[int, str] = {}

    def save(rep: int) -> dict[str, float]:
        paths[rep] = f"s3://{bucket}/dcp-{rep}-{uuid.uuid4().hex[:6]}"
        writer = FsspecWriter(paths[rep], sync_files=False, thread_count=default_threads(),
                              **options)
        with common.Stopwatch() as sw:
            dcp.save(state, storage_writer=writer)
        return {"save": sw.seconds}

    def load(rep: int) -> dict[str, float]:
        with common.Stopwatch() as sw:
            dcp.load(dest, storage_reader=FsspecReader(paths[rep], **options))
        assert common.same_values(state, dest)
        open_storage(paths[rep], storage_options=options).delete("")
        return {"load": sw.seconds}

    return [save, load]


def paired(name: str, save, load) -> list:
    """A save and the load of what it saved, as one case (so load follows its own save)."""
    def both(rep: int) -> dict[str, float]:
        return {**save(rep), **load(rep)}
    return [(name, both)]


def report(title: str, timings: common.Timings, nbytes: int, anchor: str) -> None:
    for metric in ("save", "load"):
        rows = [common.Row(name, t[metric]) for name, t in timings.items()]
        print(f"\n### {title}: {metric}, {common.format_size(nbytes)}\n")
        print(common.throughput_table(rows, nbytes, [anchor]))


def main() -> None:
    # moto holds every object in memory: smaller defaults than the other benchmarks.
    args = common.parse_args("ckpt storage backends: S3 (moto) and tensorstore", 3,
                             lambda p: p.set_defaults(sizes="128M", shapes="many"))
    print(f"# bench_storage  ({common.machine_description()}; load {common.load_average()}; "
          f"code {common.code_version()})")
    server, endpoint, bucket = start_moto()
    s3_options = {"client_kwargs": {"endpoint_url": endpoint}}
    try:
        for size in args.sizes:
            for shape in args.shapes:
                state = common.make_state(size, shape)
                dest = common.empty_like_state(state)
                nbytes = common.state_bytes(state)
                label = f"{shape} ({common.SHAPES[shape]} tensors)"

                def s3_root(name: str):
                    return open_storage(f"s3://{bucket}/ckpt-{name}",
                                        storage_options=s3_options)

                timings = common.run_interleaved(
                    paired("ckpt s3 (fsspec)", *ckpt_cases(s3_root, state, dest))
                    + paired("DCP FsspecWriter", *dcp_cases(endpoint, bucket, state, dest)),
                    args.reps, progress=f"s3 {common.format_size(size)} {shape}")
                report(f"S3 via moto, {label}", timings, nbytes, "DCP FsspecWriter")

                os.makedirs(args.dir, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                    def posix_root(name: str):
                        return open_storage(os.path.join(tmp, "posix", name))

                    def ts_root(name: str):
                        return open_storage(f"tensorstore+file://{tmp}/ts/{name}")

                    cold = common.drop_page_cache()
                    timings = common.run_interleaved(
                        paired("ckpt posix", *ckpt_cases(posix_root, state, dest, cold))
                        + paired("ckpt tensorstore+file",
                                 *ckpt_cases(ts_root, state, dest, cold)),
                        args.reps, progress=f"disk {common.format_size(size)} {shape}")
                report(f"local disk ({common.describe_dir(args.dir)}, {'cold' if cold else 'warm'} loads), {label}",
                       timings, nbytes, "ckpt posix")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
