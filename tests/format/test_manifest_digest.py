"""A manifest carries the digest of its own bytes as its last member and is checked on every
read: one flipped bit anywhere in it (a value, a shape, a chunk's place, the digest member
itself) is a damaged step, refused as corrupt; a manifest with no digest member at all (one
written before manifests carried it) is read as it is, but only with the members such a
manifest has."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckpt
from ckpt import CorruptCheckpointError
from ckpt._format.digest import digest
from ckpt._format.manifest import Manifest
from ckpt._format.sealed import DIGEST_MEMBER, reseal, seal, sealed_json
from tests.support.s3_fixture import _moto, s3  # noqa: F401  (fixtures)
from verify.cli import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> bytes:
    """The manifest bytes of a real step: a module, an optimizer, a plain value."""
    root = tmp_path_factory.mktemp("digest") / "root"
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"model": model, "opt": opt, "epoch": 3}, force=True)
    return (root / "step-00000001" / "manifest.json").read_bytes()


def test_the_digest_is_the_last_member_and_covers_every_byte_before_it(saved):
    head, _, tail = saved.rpartition(b',"manifest_digest":"')
    assert tail == digest(head).encode() + b'"}'
    assert Manifest.from_json(saved, where="m").items["epoch"]["tree"] == 3
    assert DIGEST_MEMBER not in Manifest.from_json(saved, where="m").metadata


def _flipped(raw: bytes, at: int, bit: int) -> bytes:
    data = bytearray(raw)
    data[at] ^= 1 << bit
    return bytes(data)


def _refused(raw: bytes) -> str:
    with pytest.raises(CorruptCheckpointError) as info:
        Manifest.from_json(raw, where="m")
    return str(info.value)


# The first byte of each part's text (its last byte for a number: a digit stays a digit).
PARTS = {
    "a plain value": (b'"tree":3', -1),
    "an optimizer's lr": (b'"lr":0.25', -1),
    "a tensor's shape": (b'"shape":[2,3]', -3),
    "a chunk's file": (b'"file":"data-', -2),
    "a chunk's start": (b'"start":', len(b'"start":')),
}


@pytest.mark.parametrize("part", PARTS)
def test_one_flipped_bit_in_the_body_is_refused_as_damage(saved, part):
    text, offset = PARTS[part]
    at = saved.index(text) + (offset if offset >= 0 else len(text) + offset)
    for bit in range(8):
        assert "damaged after it was written" in _refused(_flipped(saved, at, bit))


def test_every_flipped_bit_in_the_digest_member_is_refused(saved):
    """The member's name, its value, its quotes, colon, comma and the closing brace: no flip
    turns the manifest into one read without its digest."""
    start = saved.rindex(b',"manifest_digest":')
    for at in range(start, len(saved)):
        for bit in range(8):
            _refused(_flipped(saved, at, bit))


def test_a_manifest_without_the_digest_member_reads_as_an_older_one_does(saved):
    """Written before manifests carried a digest: read as it is (documented in
    docs/format.md); the digest detects damage, not a deliberate edit."""
    body = saved[:saved.rindex(b',"manifest_digest":')] + b"}"
    assert Manifest.from_json(body, where="m").items["epoch"]["tree"] == 3
    # ... but not with members an older manifest never had (a damaged digest's name)
    assert "unknown members ['manifest_digesu']" in _refused(
        body[:-1] + b',"manifest_digesu":"0123456789abcdef"}')
    # ... nor with the digest member anywhere but last, or spaced
    doc = json.loads(saved)
    assert "is not the last member" in _refused(json.dumps(doc).encode())
    assert "is not the last member" in _refused(saved + b"\n")


def test_an_edit_resealed_reads_and_reaches_the_validation(saved):
    doc = json.loads(saved)
    doc["items"]["epoch"]["tree"] = 4
    assert Manifest.from_json(sealed_json(doc), where="m").items["epoch"]["tree"] == 4
    doc["step"] = -1
    assert "invalid manifest" in _refused(sealed_json(doc))
    edited = reseal(saved.replace(b'"tree":3', b'"tree":5'))
    assert edited.count(DIGEST_MEMBER.encode()) == 1
    assert Manifest.from_json(edited, where="m").items["epoch"]["tree"] == 5
    with pytest.raises(ValueError, match="non-empty JSON object"):
        seal(b"{}")


def test_a_step_with_a_damaged_manifest_is_listed_bad_and_fails_verify(tmp_path, capsys):
    root = tmp_path / "root"
    with ckpt.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.ones(4) * step, "epoch": step}, force=True)
    path = root / "step-00000002" / "manifest.json"
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"tree":2', b'"tree":6'))  # 0x32 -> 0x36: one bit
    capsys.readouterr()
    assert main(["ls", str(root)]) == 0
    listing = capsys.readouterr().out
    assert "step 2: bad:" in listing and "damaged after it was written" in listing
    assert main(["verify", str(root), "--step", "2"]) == 1
    report = capsys.readouterr().out
    assert "step-00000002/manifest.json" in report and "damaged after it was written" in report


SEGMENTS_DIR = "/dev/shm"


@pytest.mark.skipif(not os.path.isdir(SEGMENTS_DIR), reason="no /dev/shm")
def test_the_memory_tiers_restore_refuses_a_damaged_manifest(tmp_path):
    """A step in memory whose manifest was damaged and then tagged again under the job's key
    (the tag authenticates the writer, the digest the bytes) is not restored: the step
    before it is."""
    from ckpt._memory.auth import sign
    from ckpt._memory.tier import write_tag

    root = tmp_path / "root"
    tier = ckpt.MemoryTierOptions(persist_every=2, job=f"digest{os.getpid()}")
    model = torch.nn.Linear(2, 2)
    with ckpt.CheckpointManager(root, memory_tier=tier, async_save=False) as mgr:
        for epoch in (2, 3):  # step 2: the root and memory; step 3: memory only
            mgr.save(epoch, {"model": model, "epoch": epoch}, force=True)
        segment, key = mgr._publisher.tier.path, mgr._publisher.tier.key
    try:
        path = os.path.join(segment, "step-00000003", "manifest.json")
        with open(path, "rb") as f:
            raw = f.read().replace(b'"tree":3', b'"tree":7')
        os.chmod(path, 0o600)
        with open(path, "wb") as f:
            f.write(raw)
        write_tag(segment, "step-00000003", sign(key, raw))
        state = {"model": torch.nn.Linear(2, 2), "epoch": 0}
        with ckpt.CheckpointManager(root, memory_tier=tier) as mgr:
            assert (mgr.restore(state), state["epoch"]) == (2, 2)
            assert "damaged after it was written" in str(mgr.last_restore.skipped)
    finally:
        import shutil

        shutil.rmtree(segment, ignore_errors=True)


@pytest.mark.s3
def test_an_s3_restore_refuses_a_damaged_manifest(s3):  # noqa: F811  (fixture)
    options = s3.storage_options
    with ckpt.CheckpointManager(s3.root("run"), storage_options=options,
                                async_save=False) as mgr:
        for epoch in (2, 3):
            mgr.save(epoch, {"w": torch.ones(2), "epoch": epoch}, force=True)
    key = "run/step-00000003/manifest.json"
    raw = s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=raw.replace(b'"tree":3', b'"tree":7'))
    state = {"w": torch.zeros(2), "epoch": 0}
    with ckpt.CheckpointManager(s3.root("run"), storage_options=options,
                                read_only=True) as mgr:
        assert (mgr.restore(state), state["epoch"]) == (2, 2)
