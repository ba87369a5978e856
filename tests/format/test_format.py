"""The short cuts of a load's fixed costs refuse and find exactly what the general paths do:
manifest validation of a chunk that spans its whole tensor, the chunk look-up of a one-chunk
tensor, and flatten's handling of tensors outside autograd."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from ckpt.errors import CorruptCheckpointError, UnsupportedValueError
from ckpt._format.entries import Chunk, TensorEntry
from ckpt._format.manifest import Manifest
from ckpt._format.sealed import sealed_json
from ckpt._shared.sharding import overlapping
from ckpt._shared.state import flatten

DIGEST = "0123456789abcdef"


def _manifest(chunk: dict, shape: list[int] = [4]) -> dict:  # noqa: B006 (never mutated)
    return {"format": "ckpt", "format_version": 1, "step": 1, "world_size": 1, "created": 0.0,
            "files": {"data-0.bin": 64},
            "tensors": {"t": {"dtype": "float32", "shape": shape, "chunks": [chunk]}},
            "aliases": {}, "items": {"t": {"kind": "tensor", "tree": {"__tensor__": "t"}}}}


WHOLE = {"offsets": [0], "shape": [4], "file": "data-0.bin", "start": 0, "length": 16,
         "digest": DIGEST}


def _parse(doc: dict) -> Manifest:
    return Manifest.from_json(sealed_json(doc), where="m")


def test_a_whole_tensor_chunk_parses():
    entry = _parse(_manifest(WHOLE)).tensors["t"]
    assert entry.chunks == (Chunk((0,), (4,), "data-0.bin", 0, 16, DIGEST),)


@pytest.mark.parametrize("change, message", [
    ({"offsets": [1]}, "chunk 0 of 't' lies outside the tensor's shape [4]"),
    ({"offsets": [0, 0]}, "chunk 0 of 't' has the wrong rank"),
    ({"offsets": []}, "chunk 0 of 't' has the wrong rank"),
    ({"file": "other.bin"}, "chunk 0 of 't' names 'other.bin', which is not among files"),
    ({"file": "../data-0.bin"}, "file '../data-0.bin' is not a plain file name"),
    ({"file": ["data-0.bin"]}, "file ['data-0.bin'] is not a plain file name"),
    ({"start": 60}, "chunk 0 of 't' ends at byte 76, past the end of 'data-0.bin'"),
    ({"length": -1}, "chunk 0 of 't' length must be an integer"),
    ({"start": True}, "chunk 0 of 't' start must be an integer"),
])
def test_a_chunk_the_size_of_its_tensor_is_still_checked(change, message):
    """A chunk whose box has its tensor's shape skips the general bounds loop; its offsets,
    file and byte range are checked all the same."""
    with pytest.raises(CorruptCheckpointError, match="invalid manifest") as err:
        _parse(_manifest({**WHOLE, **change}))
    assert message in str(err.value)


def test_a_shape_of_the_wrong_type_names_its_tensor():
    doc = _manifest(WHOLE, shape=[4.0])
    with pytest.raises(CorruptCheckpointError, match=r"shape of 't' must be a list of integers"):
        _parse(doc)


def test_a_chunk_of_an_earlier_step_needs_a_plain_file_name():
    doc = _manifest({**WHOLE, "step": 0, "file": "../x"})
    with pytest.raises(CorruptCheckpointError, match=r"file '\.\./x' is not a plain file name"):
        _parse(doc)
    ok = _parse(_manifest({**WHOLE, "step": 0, "file": "elsewhere.bin"}))
    assert ok.tensors["t"].chunks[0].step == 0


def _one_chunk(shape: tuple[int, ...]) -> TensorEntry:
    n = 1
    for s in shape:
        n *= s
    return TensorEntry("float32", shape, (Chunk((0,) * len(shape), shape, "f", 0, 4 * n, DIGEST),))


@pytest.mark.parametrize("shape, want, found", [
    ((8, 4), ((0, 0), (8, 4)), ((0, 0), (8, 4))),  # the whole tensor
    ((8, 4), ((2, 0), (3, 4)), ((2, 0), (3, 4))),  # some rows (another world's shard)
    ((8, 4), ((6, 1), (4, 9)), ((6, 1), (2, 3))),  # clipped by the tensor
    ((8, 4), ((8, 0), (2, 4)), None),  # past it
    ((0, 4), ((0, 0), (0, 4)), None),  # an empty tensor: its chunk is never read
])
def test_the_one_chunk_of_a_tensor_is_found_for_any_box(shape, want, found):
    entry = _one_chunk(shape)
    out = overlapping(entry, want)
    assert out == ([] if found is None else [(entry.chunks[0], found)])


def test_flatten_detaches_only_what_autograd_tracks():
    model = torch.nn.Linear(3, 2)
    plain = torch.zeros(4)
    flat = flatten({"m": model, "t": plain}, keep_vars=True)
    assert not any(t.requires_grad for t in flat.tensors.values())
    assert flat.tensors["m/weight"] is not model.weight  # a detached view of the Parameter
    assert flat.tensors["m/weight"].data_ptr() == model.weight.data_ptr()
    assert flat.tensors["t"] is plain  # nothing to detach: the tensor itself


def test_flatten_stores_tensors_that_share_their_first_byte_once_only_when_seen_alike():
    """Tensors starting at the same byte are one (an alias) only when they also have the
    same shape, strides, dtype and lazy conjugation: tied weights are; a row of a matrix, a
    reinterpretation of its bytes, its conjugate view, and empty tensors are not."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tied = base.view(3, 4)  # another tensor object over the same bytes, seen alike
    c = torch.randn(3, dtype=torch.complex64)
    state = {"base": base, "row": base[0], "flat": base.view(12), "ints": base.view(torch.int32),
             "tied": tied, "again": base.view(3, 4), "c": c, "cc": c.conj(),
             "e1": torch.empty(0), "e2": torch.empty(0), "e3": torch.empty(2, 0)}
    flat = flatten(state)
    assert flat.aliases == {"tied": "base", "again": "base"}
    assert set(flat.tensors) == {"base", "row", "flat", "ints", "c", "cc", "e1", "e2", "e3"}
    assert flat.tensors["row"].shape == (4,) and flat.tensors["cc"].is_conj()


class _Recorder:
    def __init__(self) -> None:
        self.gc_enabled: list[bool] = []

    def state_dict(self) -> dict:
        self.gc_enabled.append(gc.isenabled())
        return {"x": torch.zeros(2)}

    def load_state_dict(self, sd: dict) -> None:
        pass


def test_flatten_pauses_the_collector_and_restores_it():
    assert gc.isenabled()
    rec = _Recorder()
    flatten({"r": rec})
    assert rec.gc_enabled == [False]  # paused while the state is taken apart
    assert gc.isenabled()
    with pytest.raises(UnsupportedValueError):
        flatten({"r": rec, "bad": object()})
    assert gc.isenabled()  # also after a failure
    gc.disable()
    try:
        flatten({"r": rec})
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()


# ------------------------------------------------------------ format 2: layouts
@pytest.fixture(scope="module")
def laid_out(tmp_path_factory) -> dict:
    """A real format-2 manifest (rank tables), as parsed JSON."""
    import ckpt

    root = tmp_path_factory.mktemp("f2") / "root"
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(rank_tables=True)) as mgr:
        mgr.save(1, {"t": torch.zeros(4, 2)}, force=True)
    doc = json.loads((root / "step-00000001" / "manifest.json").read_text())
    assert doc["format_version"] == 2 and doc["tensors"]["t"]["layout"] == {
        "boxes": [[[0, 0], [4, 2], 0]]}
    return doc


MESH = {"mesh": 0, "placements": ["S0"]}


@pytest.mark.parametrize("layout, message", [
    ({"boxes": [[[0, 0], [4, 2], 1]]}, "writer of box 0 of 't' must be an integer in [0, 0]"),
    ({"boxes": [[[0, 0], [4, 2], True]]}, "writer of box 0 of 't' must be an integer"),
    ({"boxes": [[[1, 0], [4, 2], 0]]}, "box 0 of 't' lies outside the tensor's shape [4, 2]"),
    ({"boxes": [[[0], [4], 0]]}, "box 0 of 't' has the wrong rank"),
    ({"boxes": [[[0, 0], [4, 2]]]}, "box 0 of 't' must be [offsets, shape, writer]"),
    ({"boxes": [[[0, 0.5], [4, 2], 0]]}, "box 0 of 't' must be a list of integers"),
    ({"boxes": {}}, "boxes of 't' must be a list"),
    ({"boxes": [[[0, 0], [2, 2], 0]]}, "the chunks of 't' cover 4 of 8 elements (a gap)"),
    ({**MESH, "mesh": 1}, "tensor 't' names mesh 1"),
    ({**MESH, "placements": []}, "tensor 't' needs one placement per dimension of mesh 0"),
    ({**MESH, "placements": ["S2"]}, "tensor 't' has placement 'S2'"),
    ({**MESH, "placements": ["S01"]}, "tensor 't' has placement 'S01'"),
    ("boxes", "tensor 't' has no layout"),
])
def test_format2_layouts_are_checked(laid_out, layout, message):
    doc = {**laid_out, "meshes": [{"shape": [1], "ranks": [0]}],
           "tensors": {"t": {**laid_out["tensors"]["t"], "layout": layout}}}
    with pytest.raises(CorruptCheckpointError, match="invalid manifest") as err:
        _parse(doc)
    assert message in str(err.value)


def test_format2_layouts_parse(laid_out):
    from ckpt._format.layout import BoxLayout, Mesh, MeshLayout

    assert _parse(laid_out).tensors["t"].layout == BoxLayout((((0, 0), (4, 2), 0),))
    for placements, dims in ((["S0"], (0,)), (["S1"], (1,)), (["R"], (None,))):
        doc = {**laid_out, "meshes": [{"shape": [1], "ranks": [0]}],
               "tensors": {"t": {**laid_out["tensors"]["t"],
                                 "layout": {**MESH, "placements": placements}}}}
        assert _parse(doc).tensors["t"].layout == MeshLayout(Mesh((1,), (0,)), dims)
