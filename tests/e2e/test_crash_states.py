"""The crash-state explorer (tests/crashsim) over ckpt's commit protocol.

Each scenario records the file-system operations of one save, retention or gc, builds every
crash state POSIX allows from them, and checks in each that a restore sees the previous step
or the new one whole and that verify agrees (tests/crashsim/oracle.py). Then two broken
variants of the protocol, injected here, show that the explorer does find what it looks for.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

import ckpt
from verify.cli import main as cli
from tests.crashsim import explore, oracle
from tests.crashsim.record import Trace
from tests.crashsim.scenarios import OPTIONS, template, values
from storage_backends import posix


def manager(root, **kw) -> ckpt.CheckpointManager:
    kw.setdefault("async_save", False)
    kw.setdefault("options", OPTIONS)
    return ckpt.CheckpointManager(root, metrics=False,
                                  schedule=ckpt.Schedule(handle_sigterm=False), **kw)


def saved(root, steps, **kw) -> dict:
    """Save ``steps`` (step -> values) and return them."""
    with manager(root, **kw) as mgr:
        for step, state in steps.items():
            mgr.save(step, state, force=True)
    return steps


def report(name: str, result: explore.Result) -> None:
    print(f"\ncrash states [{name}]: {result.summary()}")


def assert_clean(name: str, result: explore.Result) -> None:
    report(name, result)
    assert result.checked >= 3, result.describe()
    assert not result.violations, result.describe()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_every_crash_state_is_the_old_or_new_step(tmp_path, async_save):
    old = saved(tmp_path, {1: values(1)})
    expect = oracle.Expect(old, {**old, 2: values(2)}, template)
    with manager(tmp_path, async_save=async_save) as mgr:
        result = explore.run(str(tmp_path), lambda: mgr.save(2, values(2), force=True).wait(),
                             expect)
    assert_clean("async save" if async_save else "sync save", result)


def test_first_save_into_an_empty_root(tmp_path):
    expect = oracle.Expect({}, {1: values(1)}, template)
    with manager(tmp_path) as mgr:
        result = explore.run(str(tmp_path), lambda: mgr.save(1, values(1), force=True), expect)
    assert_clean("first save", result)


def test_resaving_an_existing_step(tmp_path):
    # After falling back past step 2, a job saves step 2 again: POSIX moves the old one aside
    # and renames the new one in. Between the two renames step 2 is absent (no atomic replace
    # of a directory exists in POSIX), so a crash there restores step 1: documented in
    # PosixStorage.commit, allowed here, and nothing worse. The re-save is the point:
    # overwrite=True (a step already saved is refused otherwise).
    old = saved(tmp_path, {1: values(1), 2: values(2)})
    again = values(22)
    expect = oracle.Expect(old, {1: old[1], 2: again}, template, also_allowed=frozenset({1}))
    with manager(tmp_path) as mgr:
        result = explore.run(str(tmp_path),
                             lambda: mgr.save(2, again, force=True, overwrite=True), expect)
    assert_clean("re-save of step 2", result)


def test_incremental_save_never_loses_the_chunks_it_reuses(tmp_path):
    incremental = dataclasses.replace(OPTIONS, incremental=True)
    old = saved(tmp_path, {1: values(1)}, options=incremental)
    new = values(2, changed=("b",))
    expect = oracle.Expect(old, {**old, 2: new}, template)
    with manager(tmp_path, options=incremental) as mgr:
        mgr.restore(template())  # the base of the incremental save
        result = explore.run(str(tmp_path), lambda: mgr.save(2, new, force=True), expect)
        assert mgr.manifest(2).files and any(
            c.step == 1 for e in mgr.manifest(2).tensors.values() for c in e.chunks)
    assert_clean("incremental save", result)


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_retention_retiring_a_step(tmp_path, incremental):
    changed = ("b",) if incremental else ("a", "b", "c")
    options = dataclasses.replace(OPTIONS, incremental=incremental)
    old = saved(tmp_path, {1: values(1), 2: values(2, changed=changed)},
                options=options, keep_last=2)
    new = {2: old[2], 3: values(3, changed=changed)}
    with manager(tmp_path, options=options, keep_last=2) as mgr:
        mgr.restore(template())
        result = explore.run(str(tmp_path), lambda: mgr.save(3, new[3], force=True),
                             oracle.Expect(old, new, template))
        assert mgr.steps() == [2, 3]
    assert_clean(f"retention, {'incremental' if incremental else 'full'} steps", result)


def test_gc_of_retired_steps_and_leftovers(tmp_path):
    old = saved(tmp_path, {1: values(1), 2: values(2), 3: values(3)})
    # What crashed writers leave: a staging directory and a step directory without manifest.
    for leftover in (".tmp-step-00000004-0123456789ab", "step-00000005"):
        os.mkdir(tmp_path / leftover)
        (tmp_path / leftover / "data-0123456789ab-r00000-000.safetensors").write_bytes(b"x" * 99)
    expect = oracle.Expect(old, {3: old[3]}, template)
    result = explore.run(str(tmp_path), lambda: cli(
        ["gc", str(tmp_path), "--keep-last", "1", "--yes"]), expect)
    assert sorted(os.listdir(tmp_path)) == [".lock", "step-00000003"]
    assert_clean("gc --keep-last 1", result)


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_rank_sharded_save(tmp_path):
    from tests.support.ranks import run_ranks

    ranks = run_ranks(2, _sharded_worker(), str(tmp_path))
    traces: list[Trace] = [r["trace"] for r in ranks]
    assert all(any(op[0] == "creat" for op in t.ops) for t in traces), "both ranks write files"
    expect = oracle.Expect({1: values(1)}, {1: values(1), 2: values(2)}, template)
    result = explore.explore(str(tmp_path), ranks[0]["base"], traces, expect)
    assert_clean("2-rank sharded save", result)


def _sharded_worker():
    from tests.crashsim.workers import sharded_save

    return sharded_save


# -- the explorer finds what it looks for: its persistence rules, then broken protocols ------
def test_model_keeps_only_what_an_fsync_made_durable():
    from tests.crashsim import model

    fid = (0, 1)
    trace = [("mkdir", "d"), ("creat", "d/f", fid), ("write", fid, 0, b"abcd"),
             ("fsync_file", fid), ("fsync_dir", "d"), ("rename", "d/f", "d/g"),
             ("unlink", "old")]
    a = model.analyse({"old": b"x"}, trace)
    states = {k: list(model.states_at(a, k)) for k in (3, 4, 7)}
    # Before the file's fsync its data may be lost, cut short or zeros; d may not exist.
    assert {t.get("d/f") for t in states[3]} >= {None, b"", b"ab", bytes(4), b"abcd"}
    # After it, whatever survives of d/f holds all of its data.
    assert {t.get("d/f") for t in states[4]} == {None, b"abcd"}
    # d itself was never made durable (no fsync of the root): it may be gone at the end,
    # and the rename and unlink too; d/f is durable inside d (d was fsynced).
    last = states[7]
    assert {"old" in t for t in last} == {True, False}
    assert {(t.get("d/f"), t.get("d/g")) for t in last if "d" in t} == {
        (b"abcd", None), (None, b"abcd")}
    assert any("d" not in t for t in last)


def _explore_broken_save(tmp_path) -> explore.Result:
    old = saved(tmp_path, {1: values(1)})
    expect = oracle.Expect(old, {**old, 2: values(2)}, template)
    with manager(tmp_path) as mgr:
        return explore.run(str(tmp_path), lambda: mgr.save(2, values(2), force=True), expect,
                           recover=False)


def test_explorer_finds_a_save_without_fsync(tmp_path, monkeypatch):
    from tests.crashsim.record import RecordingOS

    # posix.py as if it called no fsync at all (files and directories).
    monkeypatch.setattr(RecordingOS, "fsync", lambda self, fd: None)
    result = _explore_broken_save(tmp_path)
    report("broken: no fsync", result)
    found = "\n".join(p for _, problems in result.violations for p in problems)
    assert "restore returned step 1; allowed: [2]" in found  # lost after save returned
    assert "visible but torn" in found                        # a step with a missing file


def test_explorer_finds_the_manifest_written_after_the_rename(tmp_path, monkeypatch):
    def commit_then_manifest(self, staging, name, manifest, manifest_name):
        posix.fsync_dir(self.local_path(staging))
        posix.os.rename(self.local_path(staging), self.local_path(name))
        posix.fsync_dir(self.root)
        self.write(f"{name}/{manifest_name}", [manifest])  # the manifest last, in place

    monkeypatch.setattr(posix.PosixStorage, "commit", commit_then_manifest)
    result = _explore_broken_save(tmp_path)
    report("broken: manifest after the rename", result)
    found = "\n".join(p for _, problems in result.violations for p in problems)
    assert "step 2 is visible but torn" in found      # an empty or half-written manifest
    assert "restore returned step 1; allowed: [2]" in found  # its entry never made durable


# -- object storage: every prefix of a save's requests, each request failed or repeated ------
@pytest.mark.parametrize("retire", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["save", "save-with-retention"])
def test_object_store_save_requests_prefixes_and_faults(retire):
    from tests.crashsim import objstore

    url = f"memory://crash-{os.urandom(6).hex()}/root"
    opts = {"retry_delay": 0.001}
    kw = {"keep_last": 2} if retire else {}
    with manager(url, storage_options=opts, **kw) as mgr:
        for s in (1, 2):
            mgr.save(s, values(s), force=True)
    old = {1: values(1), 2: values(2)}
    new = {**({2: old[2]} if retire else old), 3: values(3)}
    expect = oracle.Expect(old, new, template)
    base = objstore.contents(url.removeprefix("memory://"))

    # Crash states: the store before each request of the save, and after the last.
    prefixes = []
    root = objstore.materialize(base)
    with manager(root, storage_options=opts, **kw) as mgr:
        def snap(i, what, path):
            prefixes.append(objstore.contents(root.removeprefix("memory://")))
        with objstore.requests(snap) as log:
            mgr.save(3, values(3), force=True)
    prefixes.append(objstore.contents(root.removeprefix("memory://")))
    n = len(log)
    assert any(what == "writing" for what, _ in log) and n >= 4
    violations, checked, seen = [], 0, set()
    for i, objects in enumerate(prefixes):
        key = (tuple(sorted(objects.items())), i == n)
        if key in seen:
            continue
        seen.add(key)
        checked += 1
        problems = oracle.check(objstore.materialize(objects), expect, after_return=i == n)
        violations += [(f"crash before request {i} ({log[i] if i < n else 'end'})", p)
                       for p in problems]

    # Each request failed once (retried), performed with its answer lost (repeated), or
    # failed for good (the save fails): the old step or the new one, whole, and the new one
    # whenever the save reported success.
    runs = {m: 0 for m in objstore.MODES}
    for mode in objstore.MODES:
        for at in range(n):
            root = objstore.materialize(base)
            ok = True
            with manager(root, storage_options=opts, **kw) as mgr:
                with objstore.requests(objstore.fault(mode, at)):
                    try:
                        mgr.save(3, values(3), force=True)
                    except (ckpt.CheckpointError, OSError):  # a failed request raises OSError
                        ok = False
            if mode != "fails":
                assert ok, f"a {mode} request {at} ({log[at]}) made the save fail"
            runs[mode] += 1
            violations += [(f"{mode} at request {at} ({log[at]})", p)
                           for p in oracle.check(root, expect, after_return=ok)]
    name = "object store " + ("save with retention" if retire else "save")
    print(f"\ncrash states [{name}]: {n} requests, {len(prefixes)} prefixes, {checked} distinct "
          f"checked; faults injected: {runs}; {len(violations)} violations")
    assert not violations, violations[:5]
