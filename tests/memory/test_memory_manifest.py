"""A memory-tier step's manifest is written from its slab's template (each chunk's file and
digest filled in, ckpt/_memory/tier.py): the document is the one the root's commit writes
for the same step, byte for byte; a new layout, dtype or set of tensors gets a template of
its own; the step restores bit-exact and every recorded digest is that of its file's bytes."""

from __future__ import annotations

import os

import torch

import ckpt
from ckpt._format.manifest import Manifest, TensorsTemplate
from ckpt._format.names import MANIFEST_NAME
from ckpt._save import commit

from tests.memory.test_slab_digests import exact, file_digests, manager


def awkward_state(step: int, rows: int = 300, dtype: torch.dtype = torch.float32
                  ) -> dict[str, object]:
    """Keys JSON must escape (quotes, backslashes, ``%``, non-ASCII), a tensor of several
    chunks, an empty one, a tied pair (an alias) and plain values."""
    g = torch.Generator().manual_seed(step)
    tied = torch.randn(8, 8, generator=g)
    return {'w "q" \\ %s %%': torch.randn(rows, 257, generator=g).to(dtype),
            "émoji ✓": torch.randn(17, generator=g),
            "empty": torch.zeros(0, 3),
            "a": tied, "b": tied,
            "meta": {"step": step, "lr": 0.5 / (step + 1), "flag": step % 2 == 0,
                     "name": "100% \"done\""}}


def segment_manifest(mgr: ckpt.CheckpointManager, step: int) -> bytes:
    path = os.path.join(mgr._publisher.tier.path, f"step-{step:08d}", MANIFEST_NAME)
    with open(path, "rb") as f:
        return f.read()


def test_a_memory_step_manifest_is_the_document_the_root_commit_writes(tmp_path):
    """Parsed and written again the regular way (``Manifest.to_json``, chunk objects and
    all), each step's document comes out byte-identical, through three layouts."""
    with manager(tmp_path) as mgr:
        saves = {1: awkward_state(1), 2: awkward_state(2),  # the template reused
                 3: awkward_state(3, rows=31),  # another layout
                 4: awkward_state(4, rows=31, dtype=torch.float64),  # another dtype
                 5: {k: v for k, v in awkward_state(5).items() if k != "empty"}}
        for step, state in saves.items():
            mgr.save(step, state).wait()
            raw = segment_manifest(mgr, step)
            parsed = Manifest.from_json(raw, where=f"step {step}")
            assert parsed.to_json() == raw, step
            assert sorted(parsed.tensors) == sorted(k for k, v in state.items()
                                                    if isinstance(v, torch.Tensor) and k != "b")
            assert parsed.aliases == {"b": "a"}
            for key, entry in parsed.tensors.items():
                assert (entry.torch_dtype, entry.shape) == (state[key].dtype,
                                                            tuple(state[key].shape)), key
            for (key, box), (recorded, actual) in file_digests(
                    mgr._publisher.tier.path, step).items():
                assert recorded == actual, (step, key, box)
        restored = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None
                    for k, v in saves[5].items()}
        restored["b"] = restored["a"]
        assert mgr.restore(restored) == 5
        assert exact({k: v for k, v in restored.items() if isinstance(v, torch.Tensor)},
                     {k: v for k, v in saves[5].items() if isinstance(v, torch.Tensor)})
        assert restored["meta"] == saves[5]["meta"]
        assert mgr.last_restore.tier == "memory"


def test_the_same_slab_for_tensors_in_another_order_gets_its_own_template(tmp_path):
    """An unaligned tensor before an aligned one is laid out as the reverse order is (the
    aligned box first): the slab is reused, and the manifest lists the tensors in the
    state's order, as the root's commit does."""
    g = torch.Generator().manual_seed(0)
    odd, even = torch.randn(3, generator=g), torch.randn(16, generator=g)
    with manager(tmp_path, keep=1) as mgr:  # two slabs, taking turns
        for step in range(1, 6):
            state = {"odd": odd, "even": even} if step in (1, 2) else {"even": even, "odd": odd}
            mgr.save(step, state).wait()
            raw = segment_manifest(mgr, step)
            parsed = Manifest.from_json(raw, where=f"step {step}")
            assert list(parsed.tensors) == list(state), step
            assert parsed.to_json() == raw, step


def test_the_template_holes_follow_the_manifests_chunk_order():
    """A tensor's chunks listed out of order in the table: the template's holes take them
    by their offsets, as ``build_manifest`` orders them."""
    from ckpt._format.entries import Chunk
    from ckpt._save.payload import RankTable

    table = RankTable()
    table.chunks += [("x", Chunk((4, 0), (4, 2), "f", 32, 32, "d1")),
                     ("y", Chunk((0,), (3,), "f", 64, 12, "d2")),
                     ("x", Chunk((0, 0), (4, 2), "f", 0, 32, "d0"))]
    tensors = {"x": ("float32", (8, 2)), "y": ("int32", (3,))}
    template, order = commit.tensors_template(tensors, table)
    assert order == [2, 0, 1]
    digests = [table.chunks[i][1].digest for i in order]
    text = template.render("f", digests)
    manifest = commit.build_manifest(
        _payload(tensors), [table])
    regular = manifest.to_json()
    assert text.encode() in regular
    assert isinstance(template, TensorsTemplate)


def _payload(tensors):
    from ckpt._save.payload import StepPayload

    return StepPayload(step=1, name="step-00000001", pieces={}, held={}, tensors=tensors,
                       items={}, aliases={}, ready=None, metadata=None, previous=None, rank=0,
                       world_size=1, token="t", digests={})
