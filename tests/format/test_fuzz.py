"""Property-based fuzzing of what ckpt parses from disk: the manifest, the item trees in it,
and the safetensors headers of data files. Random and mutated documents are either accepted
or refused with CorruptCheckpointError (a header: reported as a problem), never anything
else; what is accepted allocates no more than the step's real bytes allow, names no path
outside its step, and decodes; the tiling check is linear in the number of chunks.

Deterministic (derandomized, no example database) and bounded to run in about 20 s.
"""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt
import ckpt.inspect
from ckpt.errors import CorruptCheckpointError, UnsupportedValueError
from ckpt._format.bounds import MAX_ZSTD_RATIO, Invalid
from ckpt._format.entries import Chunk
from ckpt._format.manifest import Manifest
from ckpt._format.names import STEP_DIR
from ckpt._format.sealed import DIGEST_MEMBER, seal
from ckpt._format.tiling import check_tiling
from ckpt._format.tree import check_tree
from ckpt._step.integrity import chunk_path
from ckpt._step.tables import bind_tables
from ckpt._shared.state import decode
from storage_backends import PosixStorage

FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False), st.text(max_size=12))
json_docs = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=30)


# ------------------------------------------------------------------------ manifests
@pytest.fixture(scope="module")
def real_step(tmp_path_factory):
    """A real committed step (compressed, a stateful item with tagged values) to mutate."""
    root = tmp_path_factory.mktemp("fuzz") / "root"
    state = {"w": torch.randn(256, 16), "b": torch.zeros(16),
             "opt": {"t": (1, 2.5), "f": float("inf"), "raw": b"\x01", "k": {3: "int key"},
                     "arr": np.arange(3.0)}}
    with ckpt.CheckpointManager(root, async_save=False, options=ckpt.SaveOptions(
            compression="zstd", chunk_bytes=4096)) as mgr:
        mgr.save(1, state)
        doc = json.loads((root / "step-00000001" / "manifest.json").read_text())
    return root, doc


def _paths(doc, prefix=()):
    """Every (path, value) inside a parsed JSON document."""
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _set(doc, path, value):
    if not path:
        return value
    target = doc
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return doc


def _delete(doc, path):
    if path:
        target = doc
        for p in path[:-1]:
            target = target[p]
        del target[path[-1]]
    return doc


INTERESTING = [0, -1, 1, 2**31, 2**42, 2**63, 1.5, float("inf"), "", "..", "../x", "/etc",
               "step-00000001/../../x", "zstd", "float32", None, True, [], {}, [["float32"]],
               {"__tensor__": "w"}, {"__tensor__": "nope"}, {"__float__": "x"},
               {"__ndarray__": "b"}, {"__dict__": [[[1], 2]]}, {"__bytes__": "!"},
               {"__tuple__": 3}, {"kind": "value"}, {"__pickle__": "AA=="}]


@st.composite
def mutated_manifest(draw, base):
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        path, _ = draw(st.sampled_from(paths))
        how = draw(st.sampled_from(["set", "interesting", "delete"]))
        if how == "delete" and path:
            doc = _delete(doc, path)
        else:
            value = draw(json_docs) if how == "set" else copy.deepcopy(
                draw(st.sampled_from(INTERESTING)))
            doc = _set(doc, path, value)
    return doc


def _body(doc) -> bytes:
    """``doc`` as compact JSON, without the digest member of the manifest it came from."""
    if isinstance(doc, dict):
        doc = {k: v for k, v in doc.items() if k != DIGEST_MEMBER}
    return json.dumps(doc, allow_nan=True, separators=(",", ":")).encode()


def _encode(doc) -> bytes:
    """``doc`` as a writer would write it (sealed with its digest, when it is an object): the
    mutations are validated, not refused by the digest alone."""
    body = _body(doc)
    return seal(body) if isinstance(doc, dict) and doc else body


def _check_accepted(storage: PosixStorage, manifest: Manifest) -> None:
    """What an accepted manifest lets a reader do stays inside the step and its real size."""
    location = "step-00000001"
    for entry in manifest.tensors.values():
        for chunk in entry.chunks:
            path = chunk_path(location, chunk)
            head, name = path.split("/")
            assert STEP_DIR.match(head) and "/" not in name and ".." not in name, path
            raw = chunk.numel * entry.torch_dtype.itemsize
            # The reader allocates the raw bytes of each chunk: bounded by what is stored.
            assert raw <= (chunk.length + 64) * MAX_ZSTD_RATIO
            if chunk.step is None:
                assert chunk.start + chunk.length <= manifest.files[chunk.file]
    for item in manifest.items.values():
        trees = item["per_rank"].values() if "per_rank" in item else [item["tree"]]
        for tree in trees:
            _decodes(tree, manifest)


def _decodes(tree, manifest: Manifest) -> None:
    """An accepted tree decodes (pickles are refused by type, not by crashing)."""
    tensors = {k: torch.zeros(0, dtype=e.torch_dtype) if e.dtype not in ("bfloat16",)
               else torch.zeros(0) for k, e in manifest.tensors.items()}
    tensors.update({a: tensors[t] for a, t in manifest.aliases.items()})
    try:
        decode(tree, tensors)
    except UnsupportedValueError:
        pass


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_mutated_manifests_are_accepted_safely_or_refused_as_corrupt(real_step, data):
    root, base = real_step
    doc = data.draw(mutated_manifest(base))
    try:
        manifest = Manifest.from_json(_encode(doc), where="fuzz")
    except CorruptCheckpointError:
        return
    _check_accepted(PosixStorage(str(root), create=False), manifest)


@settings(FUZZ, max_examples=60)
@given(doc=json_docs)
def test_random_documents_are_refused_as_corrupt(doc):
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(_encode(doc), where="fuzz")


@settings(FUZZ, max_examples=80)
@given(raw=st.binary(max_size=200), cut=st.integers(0, 4000))
def test_damaged_manifest_bytes_are_refused_as_corrupt(real_step, raw, cut):
    _, base = real_step
    text = _encode(base)
    damaged = text[:cut % len(text)] + raw + text[cut % len(text):]
    try:
        Manifest.from_json(damaged, where="fuzz")
    except CorruptCheckpointError:
        pass


@pytest.mark.parametrize("opener", ["[", "{\"a\":"])
def test_deep_nesting_is_refused_as_corrupt(real_step, opener):
    _, base = real_step
    closer = "]" if opener == "[" else "}"
    depth = sys.getrecursionlimit() * 100
    text = _body(base).decode().replace('"metadata":{', '"metadata":{"x":'
                                        + opener * depth + "1" + closer * depth + ",", 1)
    with pytest.raises(CorruptCheckpointError, match="nests deeper"):
        Manifest.from_json(seal(text.encode()), where="fuzz")


def _first_file(doc):
    return next(iter(doc["files"]))


def _rename_file(doc, new):
    old = _first_file(doc)
    doc["files"][new] = doc["files"].pop(old)
    for entry in doc["tensors"].values():
        for c in entry.get("chunks", []):
            if c["file"] == old:
                c["file"] = new
    return doc


# Strings that Python's str methods and `$` accept as digits or as a whole name, but that are
# another spelling: int("²") raises ValueError, int("١") is 1, "$" matches before a newline.
SPELLINGS = {
    "file name ending in a newline": lambda d: _rename_file(d, _first_file(d) + "\n"),
    "digest ending in a newline": lambda d: d["tensors"]["w"]["chunks"][0].update(
        digest=d["tensors"]["w"]["chunks"][0]["digest"] + "\n"),
    "per_rank keyed by a superscript": lambda d: d["items"].update(
        r={"kind": "stateful", "per_rank": {"\u00b2": {"x": 1}}}),
    "per_rank keyed by an Arabic-Indic digit": lambda d: d["items"].update(
        r={"kind": "stateful", "per_rank": {"\u0661": {"x": 1}}}),
    "refs to a superscript step": lambda d: d.update(refs={"\u00b2": {"data-x": 1}}),
    "table name ending in a newline": lambda d: d["tables"][0].__setitem__(
        0, d["tables"][0][0] + "\n"),
}


@pytest.fixture(scope="module")
def table_step(table_bytes):
    """A committed format-2 step's manifest (rank tables) to mutate."""
    return table_bytes[0]


@pytest.mark.parametrize("what", SPELLINGS)
def test_other_spellings_of_names_and_numbers_are_refused_as_corrupt(real_step, table_step,
                                                                     what):
    if "table" in what or "refs" in what:
        doc = copy.deepcopy(table_step)
    else:
        doc = copy.deepcopy(real_step[1])
    Manifest.from_json(_encode(doc), where="fuzz")  # the unchanged step is valid
    SPELLINGS[what](doc)
    with pytest.raises(CorruptCheckpointError):
        Manifest.from_json(_encode(doc), where="fuzz")


def test_optimizer_state_keyed_by_other_digits_is_not_a_parameter_index():
    from ckpt.inspect import _int_keyed

    assert _int_keyed({"0": "a", "12": "b", "\u00b2": "c", "\u0661": "d", "x": "e"}) == {
        0: "a", 12: "b"}


@pytest.fixture(scope="module")
def table_bytes(tmp_path_factory):
    """A format-2 step's manifest (parsed) and its one rank table: header (parsed), records."""
    import struct

    root = tmp_path_factory.mktemp("fuzz3") / "root"
    with ckpt.CheckpointManager(root, async_save=False,
                                options=ckpt.SaveOptions(rank_tables=True)) as mgr:
        mgr.save(1, {"w": torch.randn(8), "rng": ckpt.RNGState()})
    step = root / "step-00000001"
    doc = json.loads((step / "manifest.json").read_text())
    raw = (step / doc["tables"][0][0]).read_bytes()
    (hlen,) = struct.unpack("<Q", raw[8:16])
    return doc, json.loads(raw[16:16 + hlen]), raw[16 + hlen:]


@settings(FUZZ, max_examples=80)
@given(field=st.sampled_from(["step", "rank", "keys", "files", "dims", "rows", "values"]),
       value=st.one_of(json_docs, st.sampled_from([[[1]], [{}], ["a", "a"], ["../x"], -1])))
def test_rank_table_headers_are_refused_as_corrupt_or_accepted(table_bytes, field, value):
    """Each field of a table header (whose bytes match the manifest's size and digest, as a
    hand-edited or hostile step's would) is either accepted or the table is reported damaged;
    a list of lists as its files once raised TypeError out of restore."""
    import struct

    from ckpt._format.digest import digest

    doc, head, records = copy.deepcopy(table_bytes)
    head[field] = value
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    raw = b"CKPTRT02" + struct.pack("<Q", len(text)) + text + records
    doc["tables"][0][1:] = [len(raw), digest(raw)]
    manifest = bind_tables(Manifest.from_json(_encode(doc), where="fuzz"), lambda name: raw,
                           "fuzz")
    for problem in manifest.table_problems():
        assert isinstance(problem, CorruptCheckpointError)


# ------------------------------------------------------------------------ item trees
TAGS = ["__tensor__", "__ndarray__", "__tuple__", "__dict__", "__float__", "__bytes__",
        "__pickle__"]
tagged = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.text(max_size=4), inner, max_size=3),
        st.builds(lambda t, b: {t: b}, st.sampled_from(TAGS),
                  st.one_of(inner, st.sampled_from(["w", "b", "alias", "nope", "inf", "AA=="]),
                            st.lists(st.lists(inner, max_size=3), max_size=3)))),
    max_leaves=25)


@settings(FUZZ, max_examples=200)
@given(tree=tagged)
def test_item_trees_are_refused_or_decode(tree):
    tensors = {"w": torch.zeros(2), "b": torch.zeros(1, dtype=torch.int64)}
    entries = {k: _entry(t) for k, t in tensors.items()}
    try:
        check_tree(tree, entries, {"alias": "w"})
    except Invalid:
        return
    try:
        decode(tree, {**tensors, "alias": tensors["w"]})
    except UnsupportedValueError:  # a pickle without allow_pickle: refused by type
        pass


def _entry(t: torch.Tensor):
    from ckpt._format.entries import TensorEntry
    from ckpt._format.names import dtype_name

    return TensorEntry(dtype_name(t.dtype), tuple(t.shape), ())


@pytest.fixture(scope="module")
def optimizer_step(tmp_path_factory):
    """A manifest holding a module and an Adam optimizer over it, as parsed JSON."""
    root = tmp_path_factory.mktemp("optim") / "root"
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ckpt.save({"model": model, "optim": opt}, root)
    return json.loads((root / "manifest.json").read_text())


def _in_optimizer(tree):
    return {"state": {"0": tree}, "param_groups": [{"params": [0, tree], "lr": tree}]}


@settings(FUZZ, max_examples=60)
@given(tree=tagged, where=st.sampled_from(["state", "params", "group", "whole"]))
def test_what_tools_read_from_an_optimizer_tree_never_raises(optimizer_step, tree, where):
    """inspect and diff name optimizer state by parameter and list its plain values; a
    parameter list holding a dict once made `ckpt diff` die with TypeError (unhashable)."""
    import verify
    from verify._commands import saved_values

    doc = copy.deepcopy(optimizer_step)
    optim = doc["items"]["optim"]["tree"]
    if where == "state":
        optim["state"]["0"] = tree
    elif where == "params":
        optim["param_groups"][0]["params"].append(tree)
    elif where == "group":
        optim["param_groups"].append(tree)
    else:
        doc["items"]["optim"]["tree"] = _in_optimizer(tree)
    try:
        manifest = Manifest.from_json(_encode(doc), where="fuzz")
    except CorruptCheckpointError:
        return
    ckpt.inspect.parameter_names(manifest)
    ckpt.inspect.named_tensors(manifest)
    saved_values(manifest)
    verify.user_metadata(manifest)


def test_an_optimizer_whose_parameter_list_holds_no_numbers_keeps_its_numbers(
        optimizer_step):
    doc = copy.deepcopy(optimizer_step)
    assert ckpt.inspect.parameter_names(Manifest.from_json(_encode(doc), where="x")) == {
        "optim": {0: "weight", 1: "bias"}}
    doc["items"]["optim"]["tree"]["param_groups"][0]["params"][1] = {"x": 1}
    assert ckpt.inspect.parameter_names(Manifest.from_json(_encode(doc), where="x")) == {}


# ------------------------------------------------------------------------ tiling
@st.composite
def layouts(draw):
    """A small tensor and chunk boxes: a true tiling, perturbed or not."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    cuts = [sorted({0, size, *draw(st.lists(st.integers(0, size), max_size=2))})
            for size in shape]
    boxes = [((),())]
    for c in cuts:
        boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in zip(c, c[1:])]
    if draw(st.booleans()):  # merge, move, resize or drop some boxes
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(boxes) - 1))
            o, s = boxes[i]
            d = draw(st.integers(0, len(shape) - 1))
            how = draw(st.sampled_from(["move", "grow", "shrink", "drop", "dup"]))
            o, s = list(o), list(s)
            if how == "move" and o[d] > 0:
                o[d] -= 1
            elif how == "grow" and o[d] + s[d] < shape[d]:
                s[d] += 1
            elif how == "shrink" and s[d] > 1:
                s[d] -= 1
            elif how == "drop" and len(boxes) > 1:
                boxes.pop(i)
                continue
            elif how == "dup":
                boxes.append(boxes[i])
                continue
            boxes[i] = (tuple(o), tuple(s))
    return shape, boxes


def _chunks(boxes) -> list[Chunk]:
    return [Chunk(o, s, "f", 0, 0, "0" * 16) for o, s in boxes]


@settings(FUZZ, max_examples=200)
@given(layout=layouts())
def test_tiling_check_agrees_with_counting_every_element(layout):
    shape, boxes = layout
    count = np.zeros(shape, dtype=np.int64)
    for o, s in boxes:
        count[tuple(slice(a, a + b) for a, b in zip(o, s))] += 1
    exact = bool((count == 1).all())
    try:
        check_tiling("t", shape, _chunks(boxes))
        accepted = True
    except Invalid:
        accepted = False
    assert accepted == exact, (shape, boxes, count)


def test_tiling_check_refuses_tricky_layouts():
    # Equal volume, one overlap and one gap (the classic pairwise miss).
    _refused((4, 4), [((0, 0), (2, 4)), ((1, 0), (2, 4)), ((3, 0), (1, 4))])
    # A pinwheel tiles a 3x3 square exactly: accepted.
    check_tiling("t", (3, 3), _chunks([((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)),
                                         ((2, 0), (1, 2)), ((1, 1), (1, 1))]))
    # The same pinwheel with the centre doubled and a corner dropped.
    _refused((3, 3), [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 1)),
                      ((1, 1), (1, 1)), ((1, 1), (1, 1))])
    # Boxes that overlap only in a later dimension, all at first offset 0.
    _refused((1, 6), [((0, 0), (1, 3)), ((0, 2), (1, 3)), ((0, 4), (1, 1)), ((0, 5), (1, 0))])
    # Empty chunks and an empty tensor are fine.
    check_tiling("t", (0, 3), _chunks([((0, 0), (0, 3))]))
    check_tiling("t", (2,), _chunks([((0,), (2,)), ((1,), (0,))]))


def _refused(shape, boxes) -> None:
    with pytest.raises(Invalid):
        check_tiling("t", shape, _chunks(boxes))


def _calls(fn) -> int:
    """Python-level calls (and generator resumptions) made by ``fn``: an operation count."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_tiling_check_is_linear_in_the_number_of_chunks():
    """One tensor in N chunks of shape [1, 1], all at first offset 0 (the layout that took
    the pairwise check 50 s at N=8,000): four times the chunks, about four times the work."""
    def ops(n: int) -> int:
        chunks = _chunks([((0, i), (1, 1)) for i in range(n)])
        return _calls(lambda: check_tiling("t", (1, n), chunks))

    small, large = ops(400), ops(1600)
    assert large < 6 * small, (small, large)


def test_a_manifest_of_many_chunks_validates(real_step):
    """The pairwise check took 50 s at 8,000 chunks of this layout; 100,000 take about 2 s
    on an idle machine (benchmark in the issue note)."""
    _, base = real_step
    doc = copy.deepcopy(base)
    n = 20_000
    first = doc["tensors"]["b"]["chunks"][0]
    name = first["file"]
    doc["files"][name] = max(doc["files"][name], n * 4)
    doc["tensors"]["b"] = {"dtype": "float32", "shape": [1, n], "chunks": [
        {**first, "offsets": [0, i], "shape": [1, 1], "start": 4 * i, "length": 4,
         "codec": "raw"} for i in range(n)]}
    manifest = Manifest.from_json(_encode(doc), where="fuzz")
    assert len(manifest.tensors["b"].chunks) == n


# ------------------------------------------------------------------------ safetensors headers
@settings(FUZZ, max_examples=100)
@given(header=st.one_of(json_docs.map(lambda d: json.dumps(d).encode()), st.binary(max_size=64),
                        st.integers(1, 3000).map(lambda n: b"[" * n)),
       declared=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_safetensors_headers_are_reported_never_crash(real_step, header, declared):
    from verify.integrity import check_header

    root, base = real_step
    manifest = Manifest.from_json(_encode(base), where="fuzz")
    (name, _), = [(n, s) for n, s in manifest.files.items()][:1]
    chunks = [(k, c) for k, e in manifest.tensors.items() for c in e.chunks if c.file == name]
    dtypes = {k: e.torch_dtype for k, e in manifest.tensors.items()}
    work = root.parent / "headers"
    length = len(header) if declared is None else declared
    data = length.to_bytes(8, "little") + header + b"\0" * 64
    (work / "step-00000001").mkdir(parents=True, exist_ok=True)
    (work / "step-00000001" / name).write_bytes(data)
    cps = ckpt.inspect.Checkpoints(PosixStorage(str(work), create=False))
    problems = check_header(cps, f"step-00000001/{name}", len(data), chunks, dtypes,
                            exact=True)
    assert all(p.check == "header" for p in problems)
