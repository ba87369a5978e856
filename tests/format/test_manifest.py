"""A manifest is validated whole when it is parsed: every kind of damage is refused as
corruption (the error a restore falls back past), naming what is wrong."""

from __future__ import annotations

import json

import pytest
import torch

from ckpt import CheckpointManager, CorruptCheckpointError, SaveOptions, Schedule
from ckpt._format import bounds, tiling
from ckpt._format import manifest as fmt
from ckpt._format.bounds import MAX_DIMS
from ckpt._format.manifest import Manifest
from ckpt._format.sealed import seal, sealed_json


DIGEST = "0123456789abcdef"


CHUNK = {"offsets": [0], "shape": [4], "file": "data-0.bin", "start": 0, "length": 16,
         "digest": DIGEST}


def _v1(chunks: list | None = None, **top: object) -> dict:
    """A valid format-1 manifest of one float32 tensor ``t`` of shape [4]; ``top`` replaces
    top-level fields."""
    return {"format": "ckpt", "format_version": 1, "step": 1, "world_size": 1, "created": 0.0,
            "files": {"data-0.bin": 64},
            "tensors": {"t": {"dtype": "float32", "shape": [4],
                              "chunks": [CHUNK] if chunks is None else chunks}},
            "aliases": {}, "items": {"t": {"kind": "tensor", "tree": {"__tensor__": "t"}}},
            **top}


def _v2(layout: dict | None = None, **top: object) -> dict:
    """A valid format-2 manifest (rank tables, two ranks) of one tensor ``t`` [4, 2]."""
    return {"format": "ckpt", "format_version": 2, "step": 1, "world_size": 2, "created": 0.0,
            "files": {"data-0.bin": 64},
            "tensors": {"t": {"dtype": "float32", "shape": [4, 2],
                              "layout": layout or {"mesh": 0, "placements": ["S0"]}}},
            "meshes": [{"shape": [2], "ranks": [0, 1]}],
            "tables": [["table-0.json", 100, DIGEST], ["table-1.json", 100, DIGEST]],
            "refs": {}, "aliases": {},
            "items": {"t": {"kind": "tensor", "tree": {"__tensor__": "t"}}}, **top}


def _refused(doc: dict, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match="invalid manifest") as info:
        Manifest.from_json(sealed_json(doc), where="m")
    assert message in str(info.value)


def _deep(levels: int) -> dict:
    doc: dict = {}
    for _ in range(levels - 1):
        doc = {"x": doc}
    return doc


def test_the_valid_manifests_these_tests_damage_parse():
    """The well-formed manifests the tests below damage parse, metadata nested exactly to the bound
    included."""
    assert Manifest.from_json(json.dumps(_v1()).encode(), where="m").tensors["t"].shape == (4,)
    two = Manifest.from_json(json.dumps(_v2()).encode(), where="m")
    assert two.tables[1] == ("table-1.json", 100, DIGEST)
    Manifest.from_json(json.dumps(_v1(metadata=_deep(bounds.MAX_DEPTH))).encode(), where="m")


def _whole(**change: object) -> list:
    return [{**CHUNK, **change}]


FORMAT1 = {
    # a document of another format, or of a version this ckpt cannot read
    "other format": (_v1(format="zarr"), "format must be 'ckpt'"),
    "future version": (_v1(format_version=3), "format_version 3 is not supported"),
    # the step and world size are bounded integers
    "negative step": (_v1(step=-1), "step must be an integer"),
    "text step": (_v1(step="1"), "step must be an integer"),
    "no ranks": (_v1(world_size=0), "world_size must be an integer in [1,"),
    # every name in "files" is a plain file name
    "file outside": (_v1(files={"../data-0.bin": 64}), "file '../data-0.bin' is not a plain"),
    "file in a folder": (_v1(files={"a/b": 64}), "file 'a/b' is not a plain"),
    "dot file": (_v1(files={".": 64}), "file '.' is not a plain"),
    "hidden file": (_v1(files={".tmp-x": 64}), "file '.tmp-x' is not a plain"),
    "dotted name": (_v1(files={"a..b": 64}), "file 'a..b' is not a plain"),
    # an alias names a stored tensor
    "dangling alias": (_v1(aliases={"u": "nope"}), "alias 'u' -> 'nope' is dangling"),
    # metadata nesting is bounded (restore decodes it recursively)
    "deep metadata": (_v1(metadata=_deep(bounds.MAX_DEPTH + 1)), "metadata nests deeper"),
    # offsets are not negative
    "negative offset": (_v1(_whole(offsets=[-1])), "offsets must be a list of integers"),
    # a tensor's size is bounded before anything is allocated for it
    "huge tensor": (_v1(tensors={"t": {"dtype": "float32", "shape": [1 << 49], "chunks": []}}),
                    "tensor 't' is absurdly large"),
    # a format-1 tensor's chunks tile it (no overlap, no gap)
    "overlap": (_v1([{**CHUNK, "shape": [2], "length": 8},
                     {**CHUNK, "shape": [2], "length": 8, "start": 8}]), "overlap"),
    # a chunk's box has its tensor's rank
    "box of another rank": (_v1(_whole(offsets=[0, 0], shape=[4, 1])), "has the wrong rank"),
    # the codec is one this ckpt decodes
    "unknown codec": (_v1(_whole(codec="lz4")), "has unknown codec 'lz4'"),
    # a raw chunk holds exactly its box's bytes
    "short raw chunk": (_v1(_whole(length=8)), "has length 8 but its box holds 16 bytes"),
    # a compressed chunk is never much larger than its raw bytes (a reader allocates it)
    "fat zstd chunk": (_v1(_whole(codec="zstd", length=1041), files={"data-0.bin": 4096}),
                       "claims 16 bytes compressed into 1041"),
    # a chunk does not start before its file
    "negative start": (_v1(_whole(start=-1)), "start must be an integer"),
    # a reused chunk lies in an earlier step, not this one
    "self reference": (_v1(_whole(step=1)), "refers to step 1, which is not an earlier step"),
    # digests are 16 hex digits
    "bad digest": (_v1(_whole(digest="XYZ")), "has a malformed digest"),
    # an array item's dtype is one numpy has (a restore makes a numpy array of it)
    "bf16 array": (_v1(tensors={"t": {"dtype": "bfloat16", "shape": [4],
                                      "chunks": [{**CHUNK, "length": 8}]}},
                       items={"t": {"kind": "value", "tree": {"__ndarray__": "t"}}}),
                   "array 't' has dtype bfloat16, which numpy lacks"),
    # items are of a known kind, their trees of its shape
    "pickle text": (_v1(items={"p": {"kind": "value", "tree": {"__pickle__": "no base64!"}}}),
                    "a pickled value must be base64 text"),
    "odd kind": (_v1(items={"t": {"kind": "weird", "tree": {"__tensor__": "t"}}}),
                 "item 't' has kind 'weird'"),
    "tensor item of a dict": (_v1(items={"t": {"kind": "tensor",
                                               "tree": {"a": {"__tensor__": "t"}}}}),
                              "item 't' is a tensor item, but its tree is not a tensor"),
    "module of a list": (_v1(items={"m": {"kind": "module", "tree": [1]}}),
                         "item 'm': a module's state must be an object"),
    "format-1 tables": (_v1(items={"v": {"kind": "value", "per_rank": "tables"}}),
                        "item 'v': per_rank must map rank numbers to trees"),
    "dict as a key": (_v1(items={"v": {"kind": "value",
                                       "tree": {"__dict__": [[{"__dict__": []}, 1]]}}}),
                      "cannot be a key"),
    # nesting of lists counts too
    "deep list metadata": (_v1(metadata={"x": json.loads("[" * 200 + "]" * 200)}),
                           "metadata nests deeper"),
}


@pytest.mark.parametrize("case", FORMAT1)
def test_a_damaged_format1_manifest_is_refused_naming_the_damage(case):
    """Each kind of damage to a format-1 manifest is refused as corrupt, naming it, rather than let
    through to fail later, elsewhere, or not at all: another format or a future version; a step or
    world size out of range; a file name that is not a plain name; a dangling alias; metadata or
    lists nested too deep; a negative offset or start; a tensor too large; chunks that overlap; a
    box of another rank; an unknown codec; a raw chunk of the wrong length; a compressed chunk much
    larger than its raw bytes; a reference to a step that is not earlier; a malformed digest; an
    array of a dtype numpy lacks; a pickled value that is not base64; an item of an unknown kind or
    whose tree has the wrong shape; per-rank tables in format 1; a dict as a dict's key."""
    doc, message = FORMAT1[case]
    _refused(doc, message)


def test_a_manifest_over_the_size_bound_is_refused_before_it_is_parsed(monkeypatch):
    """A manifest over the size bound is refused before it is parsed (the bound is lowered here: a
    real one is a GiB)."""
    raw = json.dumps(_v1()).encode()
    monkeypatch.setattr(fmt, "MAX_MANIFEST_BYTES", len(raw) - 1)
    with pytest.raises(CorruptCheckpointError, match=f"manifest is {len(raw)} bytes"):
        Manifest.from_json(raw, where="m")


def test_the_tiling_checks_work_is_bounded(monkeypatch):
    """The check that a tensor's boxes tile it does bounded work: past the bound (lowered here: 8
    boxes over 3 split dimensions weigh 64 corners) it refuses the manifest rather than compare
    every corner."""
    monkeypatch.setattr(tiling, "MAX_TILING_CORNERS", 63)
    boxes = [((i, j, k), (1, 1, 1)) for i in (0, 1) for j in (0, 1) for k in (0, 1)]
    with pytest.raises(bounds.Invalid, match="split 3 dimensions into 8 boxes"):
        tiling.check_tiling("t", (2, 2, 2), boxes)
    monkeypatch.setattr(tiling, "MAX_TILING_CORNERS", 64)
    tiling.check_tiling("t", (2, 2, 2), boxes)  # exactly at the bound: checked, and a tiling


def _tree(levels: int) -> dict:
    """An item tree of plain dicts nested ``levels`` deep (a module's state, say)."""
    tree: dict = {"__tensor__": "t"}
    for _ in range(levels - 1):
        tree = {"x": tree}
    return tree


FORMAT2 = {
    # a mesh fits the world and names its ranks
    "mesh too big": (_v2(meshes=[{"shape": [3], "ranks": [0, 1, 2]}]),
                     "mesh 0 has shape [3], which does not fit 2 ranks"),
    "rank past the world": (_v2(meshes=[{"shape": [2], "ranks": [0, 2]}]),
                            "mesh 0: ranks must list 2 distinct ranks below 2"),
    # each rank's table is bounded, has a digest, a name of its own
    "huge table": (_v2(tables=[["table-0.json", 1 << 31, DIGEST], ["table-1.json", 1, DIGEST]]),
                   "size of rank 0's table must be an integer"),
    "table digest": (_v2(tables=[["table-0.json", 1, "nope"], ["table-1.json", 1, DIGEST]]),
                     "table of rank 0 has a malformed digest"),
    "table is data": (_v2(tables=[["data-0.bin", 64, DIGEST], ["table-1.json", 1, DIGEST]]),
                      "table of rank 0 is also listed as a data file"),
    "shared table": (_v2(tables=[["table-0.json", 1, DIGEST], ["table-0.json", 1, DIGEST]]),
                     "two ranks name the same table"),
    # references name earlier steps' plain files (paths are built from them)
    "ref to itself": (_v2(refs={"1": {"data-0.bin": 8}}),
                      "refs names step '1', which is not an earlier step"),
    "ref outside": (_v2(refs={"0": {"../../x": 8}}), "file '../../x' is not a plain file name"),
    # a format-2 tensor's size is bounded too
    "huge tensor": (_v2(tensors={"t": {"dtype": "float32", "shape": [1 << 49],
                                       "layout": {"mesh": 0, "placements": ["R"]}}}),
                    "tensor 't' is absurdly large"),
}


@pytest.mark.parametrize("case", FORMAT2)
def test_a_damaged_format2_manifest_is_refused_naming_the_damage(case):
    """Each kind of damage to a format-2 manifest is refused as corrupt, naming it: a mesh that does
    not fit the world or names ranks past it; a rank table too large, without a digest, that is also
    a data file, or shared by two ranks; a reference to a step that is not earlier or to a file that
    is not a plain name (paths are built from them); a tensor too large."""
    doc, message = FORMAT2[case]
    _refused(doc, message)


def test_an_item_tree_of_dicts_nested_too_deep_is_refused():
    """An item tree of dicts nested deeper than the bound is refused: the decoder of a restore
    recurses through them."""
    ok = _v1(items={"m": {"kind": "module", "tree": _tree(bounds.MAX_DEPTH)}})
    assert "m" in Manifest.from_json(json.dumps(ok).encode(), where="m").items
    _refused(_v1(items={"m": {"kind": "module", "tree": _tree(bounds.MAX_DEPTH + 1)}}),
             "item 'm' nests deeper than 200 levels")


def _one_tensor_manifest(tensor: dict, **top: object) -> bytes:
    doc = {"format": "ckpt", "format_version": 1, "step": 1, "world_size": 1, "created": 0.0,
           "files": {"data-0.bin": 1 << 20}, "tensors": {"t": tensor}, "aliases": {},
           "items": {"t": {"kind": "tensor", "tree": {"__tensor__": "t"}}}, **top}
    return json.dumps(doc).encode()


def _whole_tensor(shape: list[int]) -> dict:
    n = 1
    for s in shape:
        n *= s
    return {"dtype": "float32", "shape": shape, "chunks": [{
        "offsets": [0] * len(shape), "shape": shape, "file": "data-0.bin", "start": 0,
        "length": 4 * n, "digest": "0123456789abcdef"}]}


@pytest.mark.parametrize("raw, message", [
    (_one_tensor_manifest(_whole_tensor([1] * (MAX_DIMS + 1))), f"at most {MAX_DIMS} ints"),
    (_one_tensor_manifest(_whole_tensor([4]), aliases={"t": "t"}), "alias 't' -> 't' is dangling"),
    (_one_tensor_manifest({**_whole_tensor([4]), "dtype": "float99"}),
     "tensor 't' has unknown dtype 'float99'"),
])
def test_a_manifest_beyond_the_formats_bounds_is_refused_as_corrupt(raw, message):
    """A manifest beyond the format's bounds (more dimensions than MAX_DIMS, an alias that shadows a
    stored tensor, an unknown dtype) is refused as corrupt, the error a restore falls back past,
    never with torch's own error or a KeyError."""
    good = Manifest.from_json(_one_tensor_manifest(_whole_tensor([4])), where="m")
    assert good.tensors["t"].shape == (4,)
    with pytest.raises(CorruptCheckpointError, match="invalid manifest") as info:
        Manifest.from_json(raw, where="m")
    assert message in str(info.value)


@pytest.mark.parametrize("layout, message", [
    ({"boxes": [[[0, 0], [4, 2], 0.0]]}, "writer of box 0 of 't' must be an integer"),
    ({"mesh": 0.0, "placements": ["S0"]}, "tensor 't' names mesh 0.0"),
])
def test_a_format2_layout_with_a_float_index_is_refused_as_corrupt(tmp_path, layout, message):
    """A format-2 layout whose writer or mesh index is a float is refused as corrupt: 0.0 passes the
    range checks but cannot index a list."""
    root = tmp_path / "root"
    with CheckpointManager(root, async_save=False, metrics=False,
                           schedule=Schedule(handle_sigterm=False),
                           options=SaveOptions(rank_tables=True)) as mgr:
        mgr.save(1, {"t": torch.zeros(4, 2)}, force=True)
    doc = json.loads((root / "step-00000001" / "manifest.json").read_text())
    assert doc["tensors"]["t"]["layout"] == {"boxes": [[[0, 0], [4, 2], 0]]}
    doc = {**doc, "meshes": [{"shape": [1], "ranks": [0]}],
           "tensors": {"t": {**doc["tensors"]["t"], "layout": layout}}}
    with pytest.raises(CorruptCheckpointError, match="invalid manifest") as info:
        Manifest.from_json(sealed_json(doc), where="m")
    assert message in str(info.value)


def test_format1s_manifest_is_the_json_of_its_documents(tmp_path):
    """Format 1's chunks are written as text, not as a dict each: the bytes are exactly
    json.dumps of the documents (chunk_doc), for chunks of earlier steps, compressed ones,
    0-d tensors, aliases and names outside ASCII."""
    from dataclasses import fields

    tied = torch.randn(3, 4)
    state = {"w\u00e9ight": torch.randn(64, 32), "frozen": torch.ones(64, 32), "t": tied,
             "alias": tied, "scalar": torch.tensor(2.5), "epoch": 3, "lr": 0.25}
    with CheckpointManager(tmp_path, async_save=False, options=SaveOptions(
            compression="zstd", chunk_bytes=4096, incremental=True)) as mgr:
        mgr.save(1, state, force=True)
        state["w\u00e9ight"] = torch.randn(64, 32)
        mgr.save(2, state, force=True)
        manifest = mgr.manifest(2)
    assert any(c.step == 1 for c in manifest.tensors["frozen"].chunks)
    assert manifest.aliases and manifest.tensors["scalar"].shape == ()
    doc = {f.name: getattr(manifest, f.name) for f in fields(manifest)
           if f.name not in ("tables", "refs", "rank_tables")}
    doc["tensors"] = {k: {"dtype": e.dtype, "shape": list(e.shape),
                          "chunks": [fmt.chunk_doc(c) for c in e.chunks]}
                      for k, e in manifest.tensors.items()}
    want = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    assert manifest.to_json() == sealed_json(json.loads(want)) == seal(want)


def _tensors_json(tensors: dict) -> str:
    return json.dumps({k: {"dtype": e.dtype, "shape": list(e.shape),
                           "chunks": [fmt.chunk_doc(c) for c in e.chunks]}
                       for k, e in tensors.items()}, separators=(",", ":"), allow_nan=False)


def test_format1s_tensors_text_follows_each_documents_files_digests_and_geometry():
    """A save of the same geometry as the last writes its files and digests into the last
    text's template; any change of geometry (a box, a byte range, a codec, a step, a key,
    a dtype) writes a new one; keys with % and JSON escapes stay exact."""
    import random
    from dataclasses import replace

    from ckpt._format import manifest as manifest_module
    from ckpt._format.entries import Chunk, TensorEntry

    rnd = random.Random(7)
    pieces = ['"', "\\", "%", "%s", "%%", "%(a)s", "\u00e9", "\n", "a", "\U0001f600"]

    def text() -> str:
        return "".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 5)))

    def renamed(tensors: dict) -> dict:
        """The same geometry with new files and digests (the next save of a job)."""
        return {k: TensorEntry(e.dtype, e.shape, tuple(replace(c, file=text(), digest=text())
                                                       for c in e.chunks))
                for k, e in tensors.items()}

    def changed(tensors: dict) -> dict:
        key = rnd.choice(list(tensors))
        e = tensors[key]
        c = e.chunks[0]
        c = rnd.choice([replace(c, start=c.start + 64), replace(c, length=c.length + 1),
                        replace(c, codec="zstd"), replace(c, step=(c.step or 0) + 1),
                        replace(c, offsets=(c.offsets[0] + 1,))])
        return {**tensors, key: TensorEntry(e.dtype, e.shape, (c, *e.chunks[1:]))}

    tensors = {f"{text()}{k}": TensorEntry("float32", (8,), tuple(
        Chunk((4 * i,), (4,), text(), 16 * i, 16, text(), "raw") for i in range(2)))
        for k in range(3)}
    manifest_module._last_template = None
    for _ in range(300):
        tensors = rnd.choice([renamed, renamed, changed])(tensors)
        assert manifest_module._tensors_text(tensors) == _tensors_json(tensors)
    assert manifest_module._last_template is not None  # the template was kept and reused
    other = {"k%s": TensorEntry("bfloat16", (8,), tensors[next(iter(tensors))].chunks)}
    assert manifest_module._tensors_text(other) == _tensors_json(other)
