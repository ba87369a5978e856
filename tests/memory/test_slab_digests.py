"""A save into the memory tier digests each chunk as it copies it into the shared pages
(ckpt/_memory/slabs.py): the digests are those of the bytes the file holds; a save that also
goes to the root reuses them (nothing is digested twice) and the root's files check out
against them; the next save reuses the spare's mapping and layout, never a kept step's file;
what a step saved again over its number left behind is collected."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import ckpt
import ckpt.inspect
from ckpt._format.digest import digest
from ckpt._memory import slabs
from ckpt._save import rank_write
from ckpt._shared.buffers import plain_address


def state_of(step: int) -> dict[str, torch.Tensor]:
    """Every byte depends on ``step``: a tensor of several chunks, a parameter (requires
    grad), odd sizes and dtypes, a non-contiguous view, a lazy conjugate, views that start
    inside their storage, an empty tensor."""
    g = torch.Generator().manual_seed(step)
    wide = torch.randn(48, 33, generator=g)
    return {"w": torch.randn(300, 257, generator=g),
            "p": torch.nn.Parameter(torch.randn(64, 33, generator=g)),
            "h": torch.randn(13, 7, generator=g).to(torch.bfloat16),
            "i": torch.randint(0, 1 << 30, (999,), generator=g),
            "t": wide.t(),
            "c": torch.randn(40, generator=g, dtype=torch.complex64).conj(),
            # contiguous, but starting inside their storage (the copy reads from the
            # tensor's own address, not its storage's)
            "tail": torch.randn(1000, generator=g)[7:],
            "row": torch.randn(100, 100, generator=g)[42],
            "empty": torch.zeros(0, 5),
            "scalar": torch.tensor(float(step))}


def manager(tmp_path, keep: int = 2, persist_every: int = 1_000_000
            ) -> ckpt.CheckpointManager:
    """Chunks of 16 KiB: "w" is several of them."""
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    tier = ckpt.MemoryTierOptions(shm_dir=str(shm), job="slabs", keep=keep,
                                  persist_every=persist_every)
    options = ckpt.SaveOptions(chunk_bytes=16 << 10)
    return ckpt.CheckpointManager(tmp_path / "root", memory_tier=tier, async_save=True,
                                  options=options, schedule=ckpt.Schedule(handle_sigterm=False))


def file_digests(root: str, step: int) -> dict[tuple[str, tuple[int, ...]], tuple[str, str]]:
    """(key, chunk box) -> (the digest the step records, xxh3 of the bytes its file holds)."""
    reader = ckpt.inspect.open(root)
    manifest = reader.manifest(step)
    out = {}
    for path, chunks in reader.files(step, manifest).items():
        data = reader.read_bytes(path)
        for key, c in chunks:
            out[(key, c.offsets)] = (c.digest, digest(data[c.start:c.start + c.length]))
    return out


def exact(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].resolve_conj(), b[k].detach().resolve_conj()) for k in a)


def test_fill_digests_each_chunk_as_the_file_holds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(slabs, "BLOCK", 1024)  # chunks of several blocks
    tensors = state_of(1)
    pool = slabs.SlabPool(str(tmp_path), 3)
    try:
        slab = pool.acquire([(k, (0,) * t.dim(), t) for k, t in tensors.items()], 8192,
                            lambda nbytes: None)
        slab.fill(tensors, threads=3)
        assert exact({k: slab.views[k] for k in tensors}, tensors)
        with open(slab.path, "rb") as f:
            data = f.read()
        chunks = [(key, i, p.start + c.byte_start, c.byte_length)
                  for key, p in slab.placements.items() for i, c in enumerate(p.chunks)]
        assert len(slab.placements["w"].chunks) > 1
        assert {(k, i): digest(data[s:s + n]) for k, i, s, n in chunks} == slab.digests
        # publishing takes them as they are: no second pass over the pages
        monkeypatch.setattr(slabs, "digest", lambda data: pytest.fail("digested again"))
        table = slab.table("file")
        assert [c.digest for _, c in table.chunks] == [slab.digests[(k, i)]
                                                       for k, i, _, _ in chunks]
    finally:
        pool.close()


def test_helper_threads_take_only_chunks_of_parallel_size(tmp_path, monkeypatch):
    """The fill's helper threads copy and digest the chunks of at least ``PARALLEL`` bytes
    (the copy and the digest release the GIL); smaller chunks, mostly Python, stay on the
    calling thread, and a fill of small chunks only starts no helper. (Chunks under
    ``SMALL`` bytes never become jobs: the calling thread copies them, then digests them.)"""
    monkeypatch.setattr(slabs, "PARALLEL", 4096)
    monkeypatch.setattr(slabs, "SMALL", 256)
    tensors = state_of(1)
    pool = slabs.SlabPool(str(tmp_path), 3)
    try:
        slab = pool.acquire([(k, (0,) * t.dim(), t) for k, t in tensors.items()], 8192,
                            lambda nbytes: None)
        helpers_done = threading.Event()
        workers = slab.workers

        class Pool:  # the helpers' pool, telling when its drains have ended
            def __init__(self, n: int) -> None:
                self.pool = workers(n)

            def submit(self, fn):
                def run():
                    try:
                        fn()
                    finally:
                        helpers_done.set()
                return self.pool.submit(run)

        asked: list[int] = []
        slab.workers = lambda n: asked.append(n) or Pool(n)
        ran: dict[tuple[str, int], tuple[bool, int]] = {}
        real = slab._fill_chunk
        caller, first = threading.get_ident(), [True]

        def fill_chunk(job: tuple) -> None:
            here = threading.get_ident() == caller
            if here and first:  # the caller's first chunk waits: the helper takes the rest
                first.clear()
                assert helpers_done.wait(60)
            ran[(job[0], job[1])] = (here, job[3])
            real(job)

        slab._fill_chunk = fill_chunk
        slab.fill(tensors, threads=2)
        assert exact({k: slab.views[k] for k in tensors}, tensors)
        # (a tensor torch copies, not contiguous or a lazy conjugate, is digested from the
        # pages: no jobs either)
        jobs = [(k, i) for k, p in slab.placements.items() for i, c in enumerate(p.chunks)
                if c.byte_length >= 256 and plain_address(tensors[k], p.nbytes) is not None]
        assert asked == [1] and sorted(ran) == sorted(jobs)
        assert len(slab.digests) == sum(len(p.chunks) for p in slab.placements.values())
        helper = [n for here, n in ran.values() if not here]
        mine = [n for here, n in ran.values() if here]
        assert len(helper) > 1 and min(helper) >= 4096  # every other chunk of PARALLEL or more
        assert [n for n in mine if n < 4096]  # every small one, on the calling thread
        # At most the one it held (the helper may have taken every large chunk before the
        # calling thread asked for one; then the caller's first chunk is a small one).
        assert sum(n >= 4096 for n in mine) <= 1

        asked.clear()
        small = {k: t for k, t in tensors.items()  # its chunks all under PARALLEL
                 if all(c.byte_length < 4096 for c in slab.placements[k].chunks)}
        assert len(small) > 2
        slab.fill(small, threads=2)
        assert asked == [] and exact({k: slab.views[k] for k in small}, small)
    finally:
        pool.close()


def test_a_save_to_both_tiers_digests_each_chunk_once(tmp_path, monkeypatch):
    """The root's writer takes the memory tier's digests; the root's files check out against
    them, as the memory tier's file does."""
    digested: list[int] = []
    real = rank_write.digest
    monkeypatch.setattr(rank_write, "digest",
                        lambda data: digested.append(len(data)) or real(data))
    with manager(tmp_path, persist_every=1) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step)).wait()
        segment = mgr._publisher.tier.path
        assert digested == []
        root = file_digests(str(tmp_path / "root"), 2)
        memory = file_digests(segment, 2)
    assert len(root) > 8 and all(recorded == held for recorded, held in root.values())
    assert all(recorded == held for recorded, held in memory.values())
    assert {box: d for box, (d, _) in root.items()} == {box: d for box, (d, _) in memory.items()}


def data_inodes(segment: str) -> dict[str, int]:
    """Each committed step's data file (by step directory) -> its inode."""
    out = {}
    for name in sorted(os.listdir(segment)):
        if name.startswith("step-"):
            (data,) = [f for f in os.listdir(os.path.join(segment, name))
                       if f.endswith(".safetensors")]
            out[name] = os.stat(os.path.join(segment, name, data)).st_ino
    return out


def test_the_next_save_reuses_the_spares_mapping_and_layout_never_a_kept_steps_file(
        tmp_path, monkeypatch):
    planned = []
    real_plan = slabs.plan
    monkeypatch.setattr(slabs, "plan", lambda *a: planned.append(1) or real_plan(*a))
    with manager(tmp_path, keep=2) as mgr:
        pool = mgr._publisher.tier.slabs
        segment = mgr._publisher.tier.path
        for step in (1, 2, 3):  # two kept steps and a spare
            mgr.save(step, state_of(step)).wait()
        plans = len(planned)
        for step in (4, 5, 6):
            spare = pool.spare
            assert spare.inode[1] not in data_inodes(segment).values()
            mgr.save(step, state_of(step)).wait()
            assert data_inodes(segment)[f"step-{step:08d}"] == spare.inode[1]
            assert pool.placed[spare.inode].mapping is spare.mapping  # not mapped again
        assert len(planned) == plans  # the same tensors: the layout is not planned again
        # a tensor of another shape: a new slab laid out for it, the spare's pages go
        changed = {**state_of(7), "w": torch.randn(301, 257)}
        spare = pool.spare
        mgr.save(7, changed).wait()
        assert len(planned) == plans + 1
        assert data_inodes(segment)["step-00000007"] != spare.inode[1]
        assert not os.path.exists(spare.path)
    with manager(tmp_path, keep=2) as mgr:
        dest = {k: torch.empty_like(v.detach()) for k, v in changed.items()}
        assert mgr.restore(dest) == 7 and mgr.last_restore.tier == "memory"
    assert exact(dest, changed)


def test_a_step_saved_again_and_a_stray_directory_are_collected(tmp_path):
    """A step number saved again (a job that went back) leaves the old save's data file in
    the step's directory, and a step directory without a manifest may be left by a crash:
    the publish that follows collects each."""
    with manager(tmp_path, keep=3) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_of(step)).wait()
        segment = mgr._publisher.tier.path
        mgr.save(2, state_of(20), overwrite=True).wait()
        entries = sorted(os.listdir(os.path.join(segment, "step-00000002")))
        assert len(entries) == 2 and entries[0].endswith(".safetensors")  # the new save's
        assert entries[1] == "manifest.json"
        assert not os.path.exists(os.path.join(segment, "step-00000003"))  # the line left
        os.mkdir(os.path.join(segment, "step-00000009"))
        mgr.save(4, state_of(4)).wait()
        assert not os.path.exists(os.path.join(segment, "step-00000009"))
    with manager(tmp_path, keep=3) as mgr:
        dest = {k: torch.empty_like(v.detach()) for k, v in state_of(0).items()}
        assert mgr.restore(dest, step=2) == 2 and mgr.last_restore.tier == "memory"
    assert exact(dest, state_of(20))


def test_cuda_tensors_are_digested_as_the_writer_copies_them_in(tmp_path, monkeypatch):
    """On fake CUDA streams (tests/support/fake_cuda.py): a CUDA tensor lands in a pinned
    buffer, the writer copies it into the slab once it has landed and digests it as it
    goes; the root's writer reuses those digests too."""
    from tests.support import fake_cuda

    sim = fake_cuda.install(monkeypatch)
    digested: list[int] = []
    real = rank_write.digest
    monkeypatch.setattr(rank_write, "digest",
                        lambda data: digested.append(len(data)) or real(data))
    state = {"w": sim.tensor(torch.randn(300, 257)), "b": sim.tensor(torch.randn(64)),
             "cpu": torch.randn(1000)}
    with manager(tmp_path, persist_every=1) as mgr:
        mgr.save(1, state).wait()
        segment = mgr._publisher.tier.path
        assert digested == []
        memory = file_digests(segment, 1)
        root = file_digests(str(tmp_path / "root"), 1)
    assert all(recorded == held for recorded, held in [*memory.values(), *root.values()])
    assert {box: d for box, (d, _) in root.items()} == {box: d for box, (d, _) in memory.items()}
    with manager(tmp_path) as mgr:  # (persisted: closing removed the segment)
        dest = {k: torch.empty(v.shape) for k, v in state.items()}
        assert mgr.restore(dest) == 1
    assert all(torch.equal(dest[k], v.as_subclass(torch.Tensor)) for k, v in state.items())
