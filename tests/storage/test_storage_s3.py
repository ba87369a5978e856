"""ckpt end to end on a live S3 endpoint (moto's server on loopback): save, restore and verify
through the public API, a server that dies in the middle of an upload, two writers racing
for one root, an expired lease, and the collection of a manifest-less step prefix.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import ckpt
import verify.cli
from tests.support.s3_fixture import _moto, s3, s3_restartable  # noqa: F401  (fixtures)
from tests.support.s3_fixture import store_responses

pytestmark = pytest.mark.s3


def make_state(seed: int, width: int = 64) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return {"model": model, "opt": opt, "epoch": seed, "bf16": torch.randn(33, 7).bfloat16()}


def assert_same_state(a: dict, b: dict) -> None:
    for (ka, va), (kb, vb) in zip(a["model"].state_dict().items(),
                                  b["model"].state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    sa, sb = a["opt"].state_dict(), b["opt"].state_dict()
    for p in sa["state"]:
        for k, v in sa["state"][p].items():
            assert torch.equal(v, sb["state"][p][k]), (p, k)
    assert a["epoch"] == b["epoch"]
    assert torch.equal(a["bf16"].view(torch.int16), b["bf16"].view(torch.int16))


def manager(endpoint, name: str = "run", *, storage_options: dict | None = None,
            **kwargs) -> ckpt.CheckpointManager:
    options = {**endpoint.storage_options, **(storage_options or {})}
    return ckpt.CheckpointManager(endpoint.root(name), storage_options=options, **kwargs)


def test_save_restore_verify_bit_exact(s3, monkeypatch):
    state = make_state(1)
    with manager(s3, async_save=False) as mgr:
        result = mgr.save(1, state).wait()
        assert result.location == f"{s3.root('run')}/step-00000001"
    keys = s3.keys("run/")
    assert "run/step-00000001/manifest.json" in keys and "run/.lock" not in keys
    data = [k for k in keys if k.startswith("run/step-00000001/data-")]
    assert data and all(k.endswith(".safetensors") for k in data)
    assert not [k for k in keys if ".tmp" in k]  # no staging, no rename on object stores

    fresh = make_state(2)
    with manager(s3, read_only=True) as mgr:
        assert mgr.steps() == [1]
        assert mgr.restore(fresh) == 1
    assert_same_state(state, fresh)
    # The command line reads S3 too (the endpoint as for any AWS tool: AWS_ENDPOINT_URL).
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    assert verify.cli.main(["verify", s3.root("run")]) == 0


def test_async_incremental_zstd(s3):
    state = make_state(3, width=256)
    layer = state["model"][0].weight
    results = []
    with manager(s3, async_save=True, keep_last=2,
                 options=ckpt.SaveOptions(incremental=True, compression="zstd")) as mgr:
        for step in range(1, 4):
            with torch.no_grad():
                layer[step] += 1.0  # a small part changes; the rest is referenced
            results.append(mgr.save(step, state))
            mgr.wait()
        assert mgr.steps() == [2, 3]
    written = [r.result() for r in results]
    assert written[1].bytes_reused > 0 and written[2].bytes_reused > 0
    assert written[2].bytes_written < written[0].bytes_written
    fresh = make_state(4, width=256)
    with manager(s3, read_only=True) as mgr:
        assert mgr.restore(fresh) == 3
        m = mgr.manifest(3)
    assert {c.codec for e in m.tensors.values() for c in e.chunks} & {"zstd", "zstd-grouped"}
    assert_same_state(state, fresh)


def _wait_for_upload(endpoint, prefix: str, timeout: float = 30.0) -> None:
    """Return once a multipart upload under ``prefix`` is in progress on the server."""
    client = endpoint.client()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        uploads = client.list_multipart_uploads(Bucket=endpoint.bucket, Prefix=prefix)
        if uploads.get("Uploads"):
            return
        time.sleep(0.002)
    raise AssertionError(f"no upload under {prefix} within {timeout}s")


def test_server_dies_mid_upload(s3_restartable):
    endpoint = s3_restartable
    fast_failure = {"retries": 2, "retry_delay": 0.05, "block_size": 5 << 20}
    small = make_state(5)
    big = {"w": torch.randn(16 << 20 >> 2), "v": torch.randn(16 << 20 >> 2)}  # 2 x 16 MiB
    options = ckpt.SaveOptions(write_threads=1)
    with manager(endpoint, storage_options=fast_failure, options=options) as mgr:
        mgr.save(1, small).wait()
        handle = mgr.save(2, {**small, **big})
        _wait_for_upload(endpoint, "run/step-00000002/")
        endpoint.stop()
        with pytest.raises(ckpt.CheckpointError) as info:
            handle.wait(timeout=60)
        error = info.value
        assert isinstance(error, ckpt.StorageError) and "nothing was committed" in str(error)
        assert isinstance(error.__cause__, OSError)  # ours, with the client's error below it
        assert type(error.__cause__).__module__ == "builtins"
        endpoint.start()
        assert not [k for k in endpoint.keys("run/step-00000002/") if "manifest" in k]
        assert mgr.steps() == [1]
        fresh = make_state(6)
        assert mgr.restore(fresh) == 1
        assert_same_state(small, fresh)
        mgr.save(3, small).wait()
        assert mgr.steps() == [1, 3]
    # What the failed save left (its abort could not reach the server) is collected by the
    # next writer that opens the root.
    with manager(endpoint):
        pass
    assert endpoint.keys("run/step-00000002/") == []


def test_two_writers_race_for_one_root(s3):
    barrier = threading.Barrier(2)
    opened, refused = [], []

    def writer() -> None:
        barrier.wait()
        try:
            opened.append(manager(s3, schedule=ckpt.Schedule(handle_sigterm=False)))
        except ckpt.CheckpointLockedError as e:
            refused.append(e)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(opened) == 1 and len(refused) == 1
    assert "locked by another writer" in str(refused[0])
    holder = json.loads(s3.client().get_object(Bucket=s3.bucket, Key="run/.lock")["Body"].read())
    assert holder["expires"] > time.time()
    opened[0].save(1, make_state(7)).wait()
    opened[0].close()
    assert "run/.lock" not in s3.keys("run/")  # released
    with manager(s3) as again:  # and free for the next writer
        assert again.steps() == [1]


def test_expired_lease_is_taken_over_and_live_one_refused(s3):
    def put_lease(expires: float) -> None:
        body = {"host": "node-17", "pid": 4242, "since": time.time() - 300, "expires": expires}
        s3.client().put_object(Bucket=s3.bucket, Key="run/.lock",
                               Body=json.dumps(body).encode())

    put_lease(time.time() + 600)  # a live writer elsewhere
    with pytest.raises(ckpt.CheckpointLockedError, match="node-17"):
        manager(s3)
    put_lease(time.time() - 5)  # that writer died; its lease ran out
    with manager(s3) as mgr:
        holder = json.loads(
            s3.client().get_object(Bucket=s3.bucket, Key="run/.lock")["Body"].read())
        assert holder["host"] != "node-17"
        mgr.save(1, make_state(8)).wait()
    assert mgr.steps() == [1]


def test_manifest_less_prefix_is_ignored_then_collected(s3, monkeypatch):
    state = make_state(9)
    with manager(s3) as mgr:
        mgr.save(1, state).wait()
    # A save that died before its commit: data objects under step-2/, no manifest.
    client = s3.client()
    for name in ("data-deadbeef0000-r00000-000.safetensors", "data-deadbeef0000-r00001-000"
                 ".safetensors"):
        client.put_object(Bucket=s3.bucket, Key=f"run/step-00000002/{name}", Body=b"x" * 1000)
    fresh = make_state(10)
    with manager(s3, read_only=True) as mgr:
        assert mgr.steps() == [1]
        assert mgr.restore(fresh) == 1
        assert mgr.skipped == []
    assert_same_state(state, fresh)

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    assert verify.cli.main(["gc", s3.root("run")]) == 0  # a dry run deletes nothing
    assert len(s3.keys("run/step-00000002/")) == 2
    assert verify.cli.main(["gc", "--yes", s3.root("run")]) == 0
    assert s3.keys("run/step-00000002/") == []
    assert "run/step-00000001/manifest.json" in s3.keys("run/")
    assert "run/.lock" not in s3.keys("run/")


def test_a_bad_step_is_saved_again_after_the_fallback(s3):
    with manager(s3) as mgr:
        mgr.save(1, make_state(11))
        mgr.save(2, make_state(12))
        mgr.wait()
    client = s3.client()
    data = [k for k in s3.keys("run/step-00000002/") if "/data-" in k]
    client.put_object(Bucket=s3.bucket, Key=data[0], Body=b"garbage")  # step 2 is now bad
    state = make_state(13)
    with manager(s3) as mgr:
        assert mgr.restore(state) == 1 and [s for s, _ in mgr.skipped] == [2]
        # Training goes on from step 1 and reaches step 2 again: an object store cannot
        # replace the bad step 2 in one move, so the manager retires it first.
        mgr.save(2, state).wait()
        assert mgr.steps() == [1, 2]
    assert data[0] not in s3.keys("run/")  # the bad step's objects went with it
    fresh = make_state(14)
    with manager(s3, read_only=True) as mgr:
        assert mgr.restore(fresh) == 2 and mgr.skipped == []
    assert_same_state(state, fresh)


def test_restore_with_the_server_down_raises_a_storage_error(s3_restartable):
    endpoint = s3_restartable
    with manager(endpoint) as mgr:
        mgr.save(1, make_state(15)).wait()
    reader = manager(endpoint, read_only=True,
                     storage_options={"retries": 2, "retry_delay": 0.05})
    endpoint.stop()
    with pytest.raises(ckpt.StorageError) as info:
        reader.restore(make_state(16))
    assert isinstance(info.value.__cause__, OSError)
    endpoint.start()
    fresh = make_state(17)
    assert reader.restore(fresh) == 1  # the same manager works once the server is back
    reader.close()


def test_gc_deletes_only_under_its_own_prefix_whatever_keys_hold(s3, monkeypatch):
    """Keys are literal on S3: `..`, `.`, empty parts, other spellings of a step, and
    neighbouring prefixes (run-other/, run0/, run/step-00000010 next to step-00000001) are
    nobody's business but their own. gc --yes removes only the retired step and the
    manifest-less step prefixes of this root."""
    with manager(s3) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, make_state(step)).wait()
    foreign = ["run/../escape", "outside/precious", "run-other/step-00000001/manifest.json",
               "run0/step-00000001/manifest.json", "run/step-000000002/manifest.json",
               "run/step-0000000\u0662/x", "run/notes.txt"]
    inside_retired = ["run/step-00000001/..", "run/step-00000001/../sneaky",
                      "run/step-00000002//double", "run/step-00000010/x"]
    client = s3.client()
    for key in foreign + inside_retired:
        client.put_object(Bucket=s3.bucket, Key=key, Body=b"x")
    before = set(s3.keys())
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    assert verify.cli.main(["gc", s3.root("run"), "--keep-last", "1", "--yes"]) == 0
    gone = before - set(s3.keys())
    assert all(key.startswith(("run/step-00000001/", "run/step-00000002/",
                               "run/step-00000010/")) for key in gone), sorted(gone)
    assert set(foreign) <= set(s3.keys())
    with manager(s3, read_only=True) as mgr:
        assert mgr.steps() == [3]
        fresh = make_state(0)
        assert mgr.restore(fresh) == 3
    assert_same_state(make_state(3), fresh)


def test_a_restore_reports_the_bytes_the_store_sent_not_those_it_asked_for(s3):
    """Restoring one item of two reads part of a data file; the store's read cache fetches
    whole blocks around it. ``last_restore.bytes_from_storage`` is what the responses
    carried (counted here at the requests too), more than the item's chunks."""
    root = s3.root("counted")
    torch.manual_seed(0)
    saved = {"a": {f"t{i}": torch.randn(64, 64) for i in range(8)},
             "b": {f"t{i}": torch.randn(64, 64) for i in range(8)}}
    with ckpt.CheckpointManager(root, async_save=False, storage_options=s3.storage_options,
                                options=ckpt.SaveOptions(write_threads=1)) as mgr:
        mgr.save(1, saved)
    state = {"a": {k: torch.zeros_like(v) for k, v in saved["a"].items()}}
    with ckpt.CheckpointManager(root, read_only=True,
                                storage_options=s3.storage_options) as mgr:
        with store_responses() as sent:
            assert mgr.restore(state) == 1
        info = mgr.last_restore
        asked = sum(c.length for key, e in mgr.manifest(1).tensors.items()
                    if key.startswith("a/") for c in e.chunks)
    assert all(torch.equal(state["a"][k], v) for k, v in saved["a"].items())
    # the other item's chunks came too (the restore's own manifest reads come before it counts)
    assert 1.5 * asked < info.bytes_from_storage <= sent["bytes"], (info, sent, asked)
