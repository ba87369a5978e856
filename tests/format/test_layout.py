"""Which rank writes which box of a tensor, and which stored chunks a wanted box reads."""

from __future__ import annotations

import zlib

from ckpt._format import entries
from ckpt._format import manifest as fmt
from ckpt._format.layout import (BoxLayout, Mesh, MeshLayout, cells_overlapping, writer,
                                 written_by)
from ckpt._shared.sharding import (PieceSpec, assign_writers, balance_plain, boxes_layouts,
                                   overlapping, source_rank, sub_slices)


DIGEST = "0123456789abcdef"


def test_the_writer_of_a_replicated_box_is_the_replica_its_key_picks_row_major():
    """The writer of a box replicated over two mesh dimensions is the replica numbered crc32(key) %
    4, row-major, as the format documents: every replica writes some boxes, not only those on the
    diagonal."""
    layout = MeshLayout(Mesh((2, 2), (10, 11, 12, 13)), (None, None))
    keys = [f"layer{i}.weight" for i in range(16)]
    assert [writer(k, layout, (0, 0)) for k in keys] == [
        10 + zlib.crc32(k.encode()) % 4 for k in keys]


def test_no_rank_writes_an_empty_box():
    """No rank is told to write an empty box (3 rows over 4 ranks leaves one shard empty), in a mesh
    layout or in explicit boxes."""
    mesh = MeshLayout(Mesh((4,), (0, 1, 2, 3)), (0,))
    assert [written_by("t", (3, 2), mesh, r) for r in range(4)] == [
        [((0, 0), (1, 2))], [((1, 0), (1, 2))], [((2, 0), (1, 2))], []]
    boxes = BoxLayout((((0, 0), (3, 2), 0), ((3, 0), (0, 2), 1)))
    assert written_by("t", (3, 2), boxes, 1) == []


def test_boxes_that_only_touch_do_not_overlap():
    """Boxes that only touch a wanted box do not overlap it: their writer's rank table is not read
    for nothing."""
    layout = BoxLayout((((0,), (2,), 0), ((2,), (2,), 1)))
    assert cells_overlapping("t", (4,), layout, ((2,), (2,))) == [(((2,), (2,)), 1)]
    assert cells_overlapping("t", (4,), layout, ((1,), (2,))) == [(((0,), (2,)), 0),
                                                                   (((2,), (2,)), 1)]


def test_meshes_of_one_shape_with_other_ranks_are_stored_apart():
    """Meshes of one shape whose ranks differ (here only in the middle, where their hash does not
    look) are distinct and stored apart in the manifest: a tensor's boxes are never attributed to
    another mesh's ranks."""
    ranks = list(range(20))
    swapped = ranks[:9] + [ranks[10], ranks[9]] + ranks[11:]
    a, b = Mesh((20,), tuple(ranks)), Mesh((20,), tuple(swapped))
    assert hash(a) == hash(b) and a != b
    meshes: dict = {}
    docs = [fmt.layout_doc(MeshLayout(m, (0,)), meshes) for m in (a, b)]
    assert [d["mesh"] for d in docs] == [0, 1] and list(meshes) == [a, b]


def test_a_box_is_found_in_every_chunk_it_overlaps_and_new_ranks_wrap_around():
    """A wanted box is found in every stored chunk it overlaps, including one that starts before it,
    behind chunks of other lengths; the new ranks of a grown world take the saved ranks' values in
    turn (the first new rank gets rank 0's)."""
    chunks = tuple(entries.Chunk((o,), (2,), "f", 8 * o, 8, DIGEST) for o in (0, 2, 4))
    entry = entries.TensorEntry("float32", (6,), chunks)
    assert overlapping(entry, ((1,), (2,))) == [(chunks[0], ((1,), (1,))),
                                                (chunks[1], ((2,), (1,)))]
    uneven = (entries.Chunk((0,), (4,), "f", 0, 16, DIGEST),
              entries.Chunk((4,), (1,), "f", 16, 4, DIGEST),
              entries.Chunk((5,), (1,), "f", 20, 4, DIGEST))
    assert overlapping(entries.TensorEntry("float32", (6,), uneven), ((3,), (2,))) == [
        (uneven[0], ((3,), (1,))), (uneven[1], ((4,), (1,)))]
    assert [source_rank(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]


def test_writers_are_spread_over_the_ranks_and_boxes_index_their_slice():
    """Writers are spread over the ranks (a DDP model's tensors are not all written by rank 0),
    empty boxes are dropped, and a box's slice is indexed within its outer box."""
    specs = [[PieceSpec(k, "float32", (4,), (0,), (4,), 16) for k in ("a", "b")]] * 2
    assert sorted(assign_writers(specs).values()) == [0, 1]
    plain = balance_plain({k: ((4,), 16) for k in ("a", "b", "c")}, world=3)
    assert sorted(layout.boxes[0][2] for layout in plain.values()) == [0, 1, 2]
    empty = [[PieceSpec("t", "float32", (4,), (0,), (4,), 16)],
             [PieceSpec("t", "float32", (4,), (4,), (0,), 0)]]
    assert boxes_layouts(empty)["t"].boxes == (((0,), (4,), 0),)
    assert sub_slices(((2,), (4,)), ((3,), (2,))) == (slice(1, 3),)
