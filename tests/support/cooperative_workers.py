"""Rank bodies for tests/load/test_cooperative_restore.py (run on gloo ranks by name)."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

import ckpt
import ckpt.inspect
from ckpt._format.names import step_dir
from ckpt._step.integrity import chunk_path, read_manifest
from storage_backends import PosixStorage


def cooperate_on_one_host() -> None:
    """These ranks share one host (and its page cache), where restores read plainly by
    default: make them read together, as ranks on several hosts do."""
    from ckpt._load import cooperative

    cooperative.MODE = "always"


def replicated(step: int) -> dict[str, torch.Tensor]:
    """A DDP state (the same on every rank): two tensors of 2 MiB (sent in messages of their
    own) and 40 small ones (packed), its values set by ``step``."""
    g = torch.Generator().manual_seed(step)
    tensors = {f"big{i}": torch.rand(512, 1024, generator=g) for i in range(2)}
    tensors.update({f"small{i:02d}": torch.rand(64 + i, 33, generator=g) for i in range(40)})
    return tensors


def sharded(mesh, step: int):
    """An HSDP-like tensor: replicated over the mesh's first dimension, sharded over its
    second (ranks 0 and 2 hold one half, ranks 1 and 3 the other)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(100 + step)
    return distribute_tensor(torch.rand(256, 1024, generator=g), mesh, [Replicate(), Shard(0)])


def zeroed(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def data_bytes(root: str, step: int) -> int:
    """The bytes of the step's chunks (what a restore must read, once)."""
    manifest = read_manifest(PosixStorage(root, create=False), step_dir(step), step)
    return sum(c.length for e in manifest.tensors.values() for c in e.chunks)


def save_two_steps(root: str, with_sharded: bool = False):
    """Steps 1 and 2 of the replicated state (and the sharded tensor) on every rank."""
    mesh = None
    if with_sharded:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2))
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2):
            state = {"model": replicated(step)}
            if mesh is not None:
                state["sharded"] = sharded(mesh, step)
            mgr.save(step, state)
    return mesh


def restore_replicated(rank: int, world: int, root: str) -> dict:
    """Save, then restore the newest step into zeroed tensors on every rank."""
    cooperate_on_one_host()
    mesh = save_two_steps(root, with_sharded=True)
    shard = sharded(mesh, 2)
    expected = shard.to_local().clone()
    shard.to_local().zero_()
    state = {"model": zeroed(replicated(2)), "sharded": shard}
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        restored = mgr.restore(state)
        info = mgr.last_restore
    return {"step": restored, "exact": same(state["model"], replicated(2)) and torch.equal(
                shard.to_local(), expected),
            "ranks": [b for _, b in info.ranks], "mine": info.bytes_from_storage,
            "checkpoint": data_bytes(root, 2)}


def damaged_then_corrupt(rank: int, world: int, root: str, bad: int, owner: int) -> dict:
    """One job, two faults in turn (one set of processes and saves): rank ``bad`` damages
    the bytes it sends (``hostile_sender``), then a chunk rank ``owner`` reads for everyone
    is corrupt in the root (``corrupt_owned_chunk``)."""
    cooperate_on_one_host()
    save_two_steps(root)
    out = {"hostile": hostile_sender(rank, world, root, bad, saved=True)}
    dist.barrier()
    out["corrupt"] = corrupt_owned_chunk(rank, world, root, owner, saved=True)
    return out


def corrupt_owned_chunk(rank: int, world: int, root: str, owner: int,
                        saved: bool = False) -> dict:
    """Flip a bit in a chunk of step 2 that rank ``owner`` reads for everyone; restore the
    newest step (one pass: every rank falls back to step 1), then step 2 by number (two
    passes: every rank raises, nothing changed)."""
    from ckpt._load.cooperative import owners_of

    cooperate_on_one_host()
    if not saved:
        save_two_steps(root)
    if rank == 0:
        manifest = read_manifest(PosixStorage(root, create=False), step_dir(2), 2)
        chunks = {(chunk_path(step_dir(2), c), c.start): c
                  for e in manifest.tensors.values() for c in e.chunks}
        owned = [cid for cid, r in owners_of(manifest, world).items() if r == owner]
        path, start = owned[0]
        with open(os.path.join(root, path), "r+b") as f:
            f.seek(start + chunks[(path, start)].length // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    dist.barrier()
    state = {"model": zeroed(replicated(2))}  # (a plain dict item: restore replaces it)
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        newest = mgr.restore(state)
        skipped = list(mgr.skipped)
        fell_back = same(state["model"], replicated(1))
        before = {k: v.clone() for k, v in state["model"].items()}
        try:
            mgr.restore(state, step=2)
            error = None
        except ckpt.CorruptCheckpointError as e:
            error = f"{type(e).__name__}: {e}"
        unchanged = same(state["model"], before)
    return {"newest": newest, "skipped": skipped, "fell_back": fell_back, "error": error,
            "unchanged": unchanged}


def hostile_sender(rank: int, world: int, root: str, bad: int, saved: bool = False) -> dict:
    """Rank ``bad`` reads its share correctly, then damages the bytes it sends (a bad
    memory, a hostile peer); the others must refuse them and fall back to step 1."""
    from ckpt._load import cooperative

    cooperate_on_one_host()
    if not saved:
        save_two_steps(root)
    real = cooperative.read_chunk_into
    if rank == bad:
        def read_then_damage(storage, location, key, chunk, view, *args, **kwargs):
            real(storage, location, key, chunk, view, *args, **kwargs)
            if location == step_dir(2) and len(view):
                view[0] ^= 0x01  # after its own digest check passed

        cooperative.read_chunk_into = read_then_damage
    model = zeroed(replicated(2))
    try:
        with ckpt.CheckpointManager(root, read_only=True) as mgr:
            newest = mgr.restore({"model": model})
            return {"newest": newest, "skipped": list(mgr.skipped)}
    finally:
        cooperative.read_chunk_into = real


def broken_exchange(rank: int, world: int, root: str) -> dict:
    """The group fails to carry the chunks (every send raises as a closed gloo connection
    does): every rank reads what it needs itself, and says so in the log."""
    cooperate_on_one_host()
    save_two_steps(root)

    def closed(*args, **kwargs):
        raise RuntimeError("[gloo] Connection closed by peer (injected)")

    dist.isend = closed
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ckpt").addHandler(handler)
    state = {"model": zeroed(replicated(2))}
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        restored = mgr.restore(state)
        info = mgr.last_restore
    return {"step": restored, "exact": same(state["model"], replicated(2)),
            "mine": info.bytes_from_storage, "checkpoint": data_bytes(root, 2),
            "logged": [line for line in lines if "reads what it needs" in line]}


def one_host_by_default(rank: int, world: int, root: str) -> dict:
    """The default: ranks on one host, a file system root: each rank reads what it needs."""
    save_two_steps(root)
    state = {"model": zeroed(replicated(2))}
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        restored = mgr.restore(state)
        info = mgr.last_restore
    return {"step": restored, "exact": same(state["model"], replicated(2)),
            "mine": info.bytes_from_storage, "checkpoint": data_bytes(root, 2)}


def save_alone_in_one_file(rank: int, root: str, options: dict | None,
                           steps: tuple[int, ...] = (1,)) -> None:
    """Rank 0 alone saves ``steps`` of the replicated state, each in one data file (the
    other ranks wait)."""
    alone = dist.new_group([0])
    if rank == 0:
        with ckpt.CheckpointManager(root, async_save=False, storage_options=options,
                                    process_group=alone,
                                    options=ckpt.SaveOptions(write_threads=1)) as mgr:
            for step in steps:
                mgr.save(step, {"model": replicated(step)})
    dist.barrier()


def object_store_corrupt_share(rank: int, world: int, root: str, options: dict) -> dict:
    """A bit flipped in the last chunk of step 2's one data file on S3 (in the last rank's
    share): restore the newest step on every rank."""
    import fsspec

    save_alone_in_one_file(rank, root, options, steps=(1, 2))
    if rank == 0:
        storage = ckpt.inspect.open(root, storage_options=options)
        manifest = storage.manifest(2)
        last = max((c for e in manifest.tensors.values() for c in e.chunks),
                   key=lambda c: c.start)
        fs = fsspec.filesystem("s3", **options)
        url = f"{root}/{chunk_path(step_dir(2), last)}"
        data = bytearray(fs.cat_file(url))
        data[last.start + last.length // 2] ^= 0x10
        fs.pipe_file(url, bytes(data))
    dist.barrier()
    state = {"model": zeroed(replicated(2))}
    with ckpt.CheckpointManager(root, read_only=True, storage_options=options) as mgr:
        restored = mgr.restore(state)
        skipped = [(s, why) for s, _, why in mgr.last_restore.skipped]
    return {"step": restored, "exact": same(state["model"], replicated(1)),
            "skipped": skipped}


def object_store_by_default(rank: int, world: int, root: str, options: dict) -> dict:
    """The default with an object-store root (no page cache): the ranks read together.
    Step 1 is saved by rank 0 alone, in one data file smaller than the store's read block,
    so that each rank's share of it is part of a block. ``fetched``: the bytes the
    restore's requests to the store returned on this rank (what crossed the network, whole
    blocks of its read cache included); ``ranges``: the ranged reads of data it asked for
    beyond its read cache."""
    from tests.support.s3_fixture import store_responses

    save_alone_in_one_file(rank, root, options)
    state = {"model": zeroed(replicated(1))}
    with ckpt.CheckpointManager(root, read_only=True, storage_options=options) as mgr:
        with store_responses() as sent:
            restored = mgr.restore(state)
        manifest = mgr.manifest(1)
        info = mgr.last_restore
    return {"step": restored, "exact": same(state["model"], replicated(1)),
            "ranks": [b for _, b in info.ranks], "fetched": sent["bytes"],
            "ranges": sent["ranges"], "files": len(manifest.files),
            "checkpoint": sum(c.length for e in manifest.tensors.values() for c in e.chunks)}


def files_one_rank_reads(manifest, world: int) -> dict[str, int]:
    """The data files of ``manifest`` that one rank alone reads when ``world`` ranks
    restore all of it together, each with that rank."""
    from ckpt._load import cooperative

    readers: dict[str, set[int]] = {}
    for (path, _), r in cooperative.owners_of(manifest, world).items():
        readers.setdefault(path, set()).add(r)
    return {path: min(ranks) for path, ranks in readers.items() if len(ranks) == 1}


def damage_header(rank: int, root: str, path: str) -> None:
    """Rank 0 gives the file at ``path`` a header length past its end; every rank waits."""
    if rank == 0:
        with open(os.path.join(root, path), "r+b") as f:
            f.write((1 << 40).to_bytes(8, "little"))
    dist.barrier()


def headers_checked_then_one_corrupt(rank: int, world: int, root: str) -> dict:
    """Restore the newest step, recording the data files whose headers this rank checks;
    then the header of a step-2 file that one rank other than 0 alone reads from is damaged
    (``damaged_reader``), and the newest step is restored again."""
    from ckpt._load import cooperative, reader

    cooperate_on_one_host()
    save_two_steps(root)
    checked: set[str] = set()
    real = reader.check_headers

    def recording(storage, location, manifest, reads):
        reads = list(reads)
        checked.update(chunk_path(location, c) for _, c in reads)
        return real(storage, location, manifest, reads)

    reader.check_headers = recording
    manifest = read_manifest(PosixStorage(root, create=False), step_dir(2), 2)
    owners = cooperative.owners_of(manifest, world)
    state = {"model": zeroed(replicated(2))}
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        first = mgr.restore(state)
    out = {"first": first, "checked": sorted(checked),
           "owned": sorted({path for (path, _), r in owners.items() if r == rank}),
           "files": len(manifest.files)}
    path, reader_rank = max((p, r) for p, r in files_one_rank_reads(manifest, world).items()
                            if r != 0)
    out["damaged_reader"] = reader_rank
    damage_header(rank, root, path)
    state = {"model": zeroed(replicated(2))}
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        out["second"] = mgr.restore(state)
        out["skipped"] = [(s, why) for s, _, why in mgr.last_restore.skipped]
    out["exact"] = same(state["model"], replicated(1))
    return out


def resharded_rows(step: int) -> dict[str, torch.Tensor]:
    """The full tensors of ``resharded_*``: ``rows`` changes at every step, ``rep`` only at
    step 1 (its later steps refer to step 1's chunks)."""
    g = torch.Generator().manual_seed(5)
    rows, rep = torch.rand(1500, 1024, generator=g), torch.rand(2048, 256, generator=g)
    return {"rows": rows + step, "rep": rep}


def resharded_save(rank: int, world: int, root: str) -> None:
    """Steps 1-3 saved incrementally and compressed, ``rows`` sharded by rows over this
    world, ``rep`` replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    options = ckpt.SaveOptions(incremental=True, compression="zstd")
    with ckpt.CheckpointManager(root, async_save=False, options=options) as mgr:
        for step in (1, 2, 3):
            full = resharded_rows(step)
            mgr.save(step, {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                            "rep": distribute_tensor(full["rep"], mesh, [Replicate()])})


def resharded_restore(rank: int, world: int, root: str) -> dict:
    """Restore the newest step into zeroed tensors sharded over this (another) world: a
    rank's rows span chunks that other ranks' rows share."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    cooperate_on_one_host()
    mesh = init_device_mesh("cpu", (world,))
    full = resharded_rows(3)
    state = {"rows": distribute_tensor(torch.zeros_like(full["rows"]), mesh, [Shard(0)]),
             "rep": distribute_tensor(torch.zeros_like(full["rep"]), mesh, [Replicate()])}
    with ckpt.CheckpointManager(root, read_only=True) as mgr:
        restored = mgr.restore(state)
        info = mgr.last_restore
    manifest = read_manifest(PosixStorage(root, create=False), step_dir(3), 3)
    return {"step": restored,
            "exact": all(torch.equal(state[k].full_tensor(), full[k]) for k in full),
            "ranks": [b for _, b in info.ranks],
            "steps": sorted({c.step or 3 for e in manifest.tensors.values() for c in e.chunks}),
            "checkpoint": sum(c.length for e in manifest.tensors.values() for c in e.chunks)}


def one_step_roots(rank: int, world: int, root: str) -> dict:
    """Two roots of one step each: plain values alone (``values_only``), and the replicated
    state with the header of a file one rank alone reads damaged (``only_step_bad_header``)."""
    return {"values": values_only(rank, world, os.path.join(root, "values")),
            "header": only_step_bad_header(rank, world, os.path.join(root, "header"))}


def values_only(rank: int, world: int, root: str) -> dict:
    """Save and restore a state of plain values: no chunk to read, nothing to share."""
    cooperate_on_one_host()
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"meta": {"epoch": 3, "seen": [7, 8]}})
    dist.barrier()
    state: dict = {"meta": {}}
    try:
        with ckpt.CheckpointManager(root, read_only=True) as mgr:
            restored = mgr.restore(state)
    except Exception as e:  # reported to the test, the other case still runs
        return {"error": f"{type(e).__name__}: {e}"}
    return {"step": restored, "meta": state["meta"]}


def only_step_bad_header(rank: int, world: int, root: str) -> dict:
    """The newest (and only) step's file that the last rank alone reads has a damaged
    header: restore the newest step (one pass, no step to fall back to). ``error``: the
    exception's type and text; ``changed``: the live tensors it changed."""
    cooperate_on_one_host()
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, replicated(1))  # each tensor an item: restored into the live tensors
    manifest = read_manifest(PosixStorage(root, create=False), step_dir(1), 1)
    damage_header(rank, root, max(p for p, r in files_one_rank_reads(manifest, world).items()
                                  if r == world - 1))
    state = zeroed(replicated(1))
    try:
        with ckpt.CheckpointManager(root, read_only=True) as mgr:
            mgr.restore(state)
        error = None
    except ckpt.CheckpointError as e:
        error = (type(e).__name__, str(e))
    return {"error": error, "reader": world - 1,
            "changed": [k for k, t in state.items() if bool(t.any())]}
