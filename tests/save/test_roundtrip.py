"""Round trips through ckpt.save/ckpt.load and CheckpointManager.save/restore: what goes in
comes back bit for bit, with the same types, into the same live objects."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import ckpt
from tests.support.workers import assert_same, tensor_bytes
from ckpt._format.names import DTYPES as FORMAT_DTYPES
from ckpt._format.manifest import Manifest

APIS = ["oneshot", "manager"]


def roundtrip(tmp_path: Path, api: str, state: dict, template: dict, *,
              options: ckpt.SaveOptions | None = None, allow_pickle: bool = False) -> Manifest:
    """Save ``state``, load it into ``template`` in place; return the manifest written."""
    if api == "oneshot":
        path = tmp_path / "one"
        result = ckpt.save(state, path, step=3, options=options, allow_pickle=allow_pickle)
        assert result.step == 3
        assert ckpt.load(template, path, allow_pickle=allow_pickle) == 3
        raw = (path / "manifest.json").read_bytes()
        return Manifest.from_json(raw, where=str(path))
    root = tmp_path / "root"
    saving = dataclasses.replace(options or ckpt.SaveOptions(), allow_pickle=allow_pickle)
    with ckpt.CheckpointManager(root, options=saving) as mgr:
        mgr.save(3, state)
        mgr.wait()
        assert mgr.steps() == [3]
    with ckpt.CheckpointManager(root, options=ckpt.SaveOptions(allow_pickle=allow_pickle)) as mgr:
        assert mgr.restore(template) == 3
        return mgr.manifest(3)


def data_dir(tmp_path: Path, api: str) -> Path:
    return tmp_path / "one" if api == "oneshot" else tmp_path / "root" / "step-00000003"


# ------------------------------------------------------------------------------ tied weights


class TiedLM(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(1000, 64)
        self.mid = torch.nn.Linear(64, 64)
        self.lm_head = torch.nn.Linear(64, 1000, bias=False)
        self.lm_head.weight = self.embed.weight


@pytest.mark.parametrize("api", APIS)
def test_tied_weights_stay_tied_and_are_stored_once(tmp_path, api):
    src = TiedLM(seed=0)
    expected = {k: v.clone() for k, v in src.state_dict().items()}
    dst = TiedLM(seed=1)
    param = dst.embed.weight
    assert not torch.equal(param, src.embed.weight)

    manifest = roundtrip(tmp_path, api, {"model": src}, {"model": dst})

    # Still one Parameter, the same object as before the restore, holding the saved values.
    assert dst.lm_head.weight is dst.embed.weight
    assert dst.embed.weight is param
    for k, v in dst.state_dict().items():
        assert_same(v, expected[k], k)
    # Stored once: one of the two names is an alias of the other, and the bytes on disk hold
    # the embedding once (all tensors' bytes plus small headers, less than one more copy).
    pair = {"model/embed.weight", "model/lm_head.weight"}
    assert len(pair & set(manifest.tensors)) == 1
    (alias, target), = manifest.aliases.items()
    assert {alias, target} == pair and target in manifest.tensors
    embed_bytes = 1000 * 64 * 4
    unique_bytes = embed_bytes + (64 * 64 + 64) * 4
    files = sorted(data_dir(tmp_path, api).glob("*.safetensors"))
    on_disk = sum(p.stat().st_size for p in files)
    assert on_disk == sum(manifest.files.values())
    assert unique_bytes <= on_disk < unique_bytes + 16 * 1024


# ----------------------------------------------------------------- views, empty and 0-d tensors


@pytest.mark.parametrize("api", APIS)
def test_non_contiguous_views_empty_and_scalar_tensors(tmp_path, api):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g)
    other = torch.randn(8, 12, generator=g)
    state = {
        "transposed": base.t(),
        "stepped": base[::2, 1::3],
        "offset": base[2:5],
        "empty": torch.empty(0),
        "empty2d": torch.empty(3, 0),
        "scalar": torch.tensor(2.5),
        "int_scalar": torch.tensor(-7, dtype=torch.int64),
        "values": {"t": other.t(), "s": [other[1::3, ::4]], "e": torch.empty(3, 0, dtype=torch.int32),
                   "z": torch.tensor(True)},
    }
    assert not state["transposed"].is_contiguous() and not state["stepped"].is_contiguous()
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else None) for k, v in state.items()}
    expected["values"] = {"t": other.t().clone(), "s": [other[1::3, ::4].clone()],
                          "e": torch.empty(3, 0, dtype=torch.int32), "z": torch.tensor(True)}
    # Live destinations that are themselves views (restored in place, through the view).
    dst_base1, dst_base2, dst_base3 = torch.zeros(6, 10), torch.zeros(6, 10), torch.zeros(6, 10)
    template = {
        "transposed": dst_base1.t(),
        "stepped": dst_base2[::2, 1::3],
        "offset": dst_base3[2:5],
        "empty": torch.ones(0),
        "empty2d": torch.ones(3, 0),
        "scalar": torch.tensor(0.0),
        "int_scalar": torch.tensor(0, dtype=torch.int64),
        "values": None,
    }
    live = {k: v for k, v in template.items() if isinstance(v, torch.Tensor)}

    roundtrip(tmp_path, api, state, template)

    for k, v in live.items():
        assert template[k] is v, f"{k} was replaced instead of restored in place"
    for k in expected:
        assert_same(template[k], expected[k], k)
    assert_same(dst_base1.t(), base.t())  # written through the transposed view
    assert_same(dst_base2[::2, 1::3], base[::2, 1::3])
    assert dst_base2[1::2].abs().sum() == 0  # and nowhere else
    assert_same(dst_base3[2:5], base[2:5])
    assert dst_base3[:2].abs().sum() == 0 and dst_base3[5:].abs().sum() == 0


# ------------------------------------------------------------------------------ every dtype

DTYPE_NAMES = ["float16", "float32", "float64", "bfloat16", "complex32", "complex64",
               "complex128", "int8", "int16", "int32", "int64", "uint8", "bool", "uint16",
               "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
               "float8_e5m2fnuz"]
# The dtypes asked for, and whatever else the format says it stores.
DTYPES = list(dict.fromkeys([getattr(torch, n) for n in DTYPE_NAMES if hasattr(torch, n)]
                            + list(FORMAT_DTYPES.values())))


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of arbitrary bit patterns (NaN payloads, -0.0, denormals included)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def zeros(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(math.prod(shape) * dtype.itemsize, dtype=torch.uint8).view(dtype).reshape(shape)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("api", APIS)
def test_every_dtype_is_bit_exact(tmp_path, api):
    assert {torch.float8_e4m3fn, torch.uint16, torch.uint64} <= set(DTYPES)  # torch >= 2.3
    state, template = {}, {}
    for i, dtype in enumerate(DTYPES):
        name = str(dtype).removeprefix("torch.")
        state[name] = random_bits(dtype, (37, 3), seed=i)
        state[f"{name}_0d"] = random_bits(dtype, (), seed=100 + i)
        template[name] = zeros(dtype, (37, 3))
        template[f"{name}_0d"] = zeros(dtype, ())
    state["inside"] = {str(d).removeprefix("torch."): random_bits(d, (5, 2), seed=200 + i)
                       for i, d in enumerate(DTYPES)}
    template["inside"] = None
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else
                    {n: t.clone() for n, t in v.items()}) for k, v in state.items()}

    manifest = roundtrip(tmp_path, api, state, template)

    for key, value in expected.items():
        assert_same(template[key], value, key)
    assert {e.dtype for e in manifest.tensors.values()} == {
        str(d).removeprefix("torch.") for d in DTYPES}


# ----------------------------------------------------------------- optimizer and scheduler


def make_training(seed: int, opt_cls):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = opt_cls([
        {"params": list(model[0].parameters()), "lr": 1e-2, "weight_decay": 0.1},
        {"params": list(model[2].parameters()), "lr": 3e-3, "betas": (0.8, 0.95), "amsgrad": True},
    ])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20, eta_min=1e-4)
    return model, opt, sched


def batches(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(10, 6, generator=g), torch.randn(10, 3, generator=g)) for _ in range(n)]


def train(model, opt, sched, data) -> None:
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("api", APIS)
def test_optimizer_and_scheduler_resume_bit_exact(tmp_path, api, opt_cls, one_thread):
    model, opt, sched = make_training(0, opt_cls)
    train(model, opt, sched, batches(1, 4))
    # Per-parameter `step`s differ: one more step on the first group's parameters only.
    for p in model[2].parameters():
        p.requires_grad_(False)
    train(model, opt, sched, batches(2, 1))
    for p in model[2].parameters():
        p.requires_grad_(True)
    steps = {int(s["step"]) for s in opt.state_dict()["state"].values()}
    assert steps == {4, 5}
    saved_opt = opt.state_dict()
    saved_opt = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in saved_opt["state"].items()},
                 "param_groups": [dict(g) for g in saved_opt["param_groups"]]}
    saved_sched = dict(sched.state_dict())

    model2, opt2, sched2 = make_training(1, opt_cls)
    roundtrip(tmp_path, api, {"model": model, "opt": opt, "sched": sched},
              {"model": model2, "opt": opt2, "sched": sched2})

    assert_same(opt2.state_dict(), saved_opt, "opt")
    assert_same(sched2.state_dict(), saved_sched, "sched")
    assert_same(model2.state_dict(), model.state_dict(), "model")
    assert sched2.get_last_lr() == sched.get_last_lr()
    # Continuing from both gives the same parameters, bit for bit.
    more = batches(3, 6)
    train(model, opt, sched, more)
    train(model2, opt2, sched2, more)
    assert_same(model2.state_dict(), model.state_dict(), "model after more steps")
    assert_same(opt2.state_dict(), opt.state_dict(), "opt after more steps")


# ------------------------------------------------------------------------------ RNG state


@pytest.mark.parametrize("api", APIS)
def test_rng_state_gives_the_same_next_numbers(tmp_path, api):
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    torch.rand(3), random.random(), np.random.rand()  # advance each generator a little
    root_state = {"rng": ckpt.RNGState()}
    if api == "oneshot":
        ckpt.save(root_state, tmp_path / "one")
    else:
        with ckpt.CheckpointManager(tmp_path / "root", async_save=False) as mgr:
            mgr.save(3, root_state)
    expected = (torch.rand(5), random.random(), np.random.rand(4))
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    assert random.random() != expected[1]

    if api == "oneshot":
        ckpt.load({"rng": ckpt.RNGState()}, tmp_path / "one")
    else:
        with ckpt.CheckpointManager(tmp_path / "root") as mgr:
            assert mgr.restore({"rng": ckpt.RNGState()}) == 3
    assert_same((torch.rand(5), random.random(), np.random.rand(4)), expected)


# ------------------------------------------------------------------------------ plain values


def plain_values() -> dict:
    return {
        "int_keys": {1: "one", 2: [1, 2], -3: {"x": None}},
        "mixed_keys": {1: "int", "1": "str", False: "bool", None: "none", 2.5: "float",
                       (1, "a"): "tuple"},
        "nested": {"a": {3: {"b": (1, 2.5, "s", (None, False))}}, "empty": {}, "list": []},
        "tuple": (1, (2, 3), [4, (5,)], ()),
        "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "negzero": -0.0,
        "floats": [0.1, 1e-310, 1.7976931348623157e308],
        "bytes": b"\x00\xff\x10 binary", "empty_bytes": b"",
        "none": None, "bool": True, "big": 2**70, "neg": -(2**63), "text": "ümlaut ☃",
        "tag_lookalike": {"__tensor__": "not a tensor", "__float__": "nan"},
        "single_tag_lookalike": {"__bytes__": "AAAA"},
    }


@pytest.mark.parametrize("api", APIS)
def test_plain_json_values_round_trip_with_their_types(tmp_path, api):
    state = {"cfg": plain_values(), "counter": 12, "name": "run", "nothing": None,
             "pi": math.pi, "seq": [1, "two", 3.0]}
    template = {k: None for k in state}

    roundtrip(tmp_path, api, state, template)

    expected = {"cfg": plain_values(), "counter": 12, "name": "run", "nothing": None,
                "pi": math.pi, "seq": [1, "two", 3.0]}
    assert_same(template, expected)
    assert math.isnan(template["cfg"]["nan"])
    assert struct.pack("<d", template["cfg"]["negzero"]) == struct.pack("<d", -0.0)
    keys = list(template["cfg"]["mixed_keys"])
    assert [type(k) for k in keys] == [int, str, bool, type(None), float, tuple]


# ------------------------------------------------------------------ safetensors and chunking


def safetensors_pieces(path: Path) -> list[tuple[str, int, int]]:
    """(name, absolute start, length) of every tensor in a safetensors file, from its header."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    return [(name, 8 + n + info["data_offsets"][0], info["data_offsets"][1] - info["data_offsets"][0])
            for name, info in header.items() if name != "__metadata__"]


@pytest.mark.parametrize("api", APIS)
def test_data_files_open_with_safetensors(tmp_path, api):
    g = torch.Generator().manual_seed(3)
    state = {
        "f32": torch.randn(7, 5, generator=g),
        "big": torch.randn(100, 300, generator=g),  # 120 KB: many 4 KiB chunks
        "f16": torch.randn(9, generator=g).half(),
        "bf16": torch.randn(4, 4, generator=g).bfloat16(),
        "i64": torch.randint(-10**12, 10**12, (6,), generator=g),
        "u8": torch.randint(0, 256, (11,), dtype=torch.uint8, generator=g),
        "flags": torch.rand(8, generator=g) > 0.5,
        "scalar": torch.tensor(1.25, dtype=torch.float64),
        "empty": torch.empty(3, 0),
        "c64": torch.randn(5, generator=g, dtype=torch.complex64),
    }
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    manifest = roundtrip(tmp_path, api, state, template,
                         options=ckpt.SaveOptions(chunk_bytes=4096, write_threads=2))
    for k, v in state.items():
        assert_same(template[k], v, k)

    directory = data_dir(tmp_path, api)
    found: set[tuple[str, int]] = set()
    for fname in manifest.files:
        pieces = {(start, length): name for name, start, length in safetensors_pieces(directory / fname)}
        with safe_open(str(directory / fname), "pt") as f:
            for key, entry in manifest.tensors.items():
                for i, chunk in enumerate(entry.chunks):
                    if chunk.file != fname or chunk.numel == 0:
                        continue
                    assert chunk.codec == "raw"
                    name = pieces[(chunk.start, chunk.length)]
                    box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.shape))
                    expected = state[key][box] if chunk.shape else state[key]
                    got = f.get_tensor(name)
                    if state[key].is_complex():  # safetensors has no complex: stored as bytes
                        assert got.dtype == torch.uint8
                        assert got.numpy().tobytes() == tensor_bytes(expected)
                    else:
                        assert_same(got, expected.contiguous(), f"{fname}:{name}")
                    found.add((key, i))
    assert found == {(k, i) for k, e in manifest.tensors.items()
                     for i, c in enumerate(e.chunks) if c.numel}
    assert len(manifest.tensors["big"].chunks) > 1


@pytest.mark.parametrize("api", APIS)
def test_tensor_larger_than_chunk_bytes_is_split_and_round_trips(tmp_path, api):
    g = torch.Generator().manual_seed(4)
    big = torch.randn(257, 33, generator=g, dtype=torch.float64)  # 67,848 bytes
    state = {"big": big, "wrapped": {"also": big[::2].t()}}
    template = {"big": torch.zeros_like(big), "wrapped": None}

    manifest = roundtrip(tmp_path, api, state, template,
                         options=ckpt.SaveOptions(chunk_bytes=8192, write_threads=4))

    chunks = manifest.tensors["big"].chunks
    assert len(chunks) >= 67848 // 8192
    assert all(c.length <= 8192 for c in chunks)
    assert sum(c.length for c in chunks) == big.numel() * 8
    assert len({c.file for c in chunks}) > 1  # spread over several data files
    assert_same(template["big"], big)
    assert_same(template["wrapped"], {"also": big[::2].t().contiguous()})


# ------------------------------------------------------------------------ conjugate views

@pytest.mark.parametrize("mode", ["save", "async_save", "manager_sync", "manager_async"])
def test_conjugate_views_save_their_values(tmp_path, mode):
    g = torch.Generator().manual_seed(6)
    c = torch.randn(4, 3, dtype=torch.complex64, generator=g)
    state = {"conj": c.conj(), "inside": {"conj": c[1].conj()}}
    assert state["conj"].is_conj() and state["conj"].is_contiguous()
    template = {"conj": torch.zeros(4, 3, dtype=torch.complex64), "inside": None}
    if mode == "save":
        ckpt.save(state, tmp_path / "one")
    elif mode == "async_save":
        ckpt.async_save(state, tmp_path / "one").wait()
    else:
        with ckpt.CheckpointManager(tmp_path / "one", async_save=mode == "manager_async") as mgr:
            mgr.save(3, state)
    if mode.startswith("manager"):
        with ckpt.CheckpointManager(tmp_path / "one") as mgr:
            assert mgr.restore(template) == 3
    else:
        ckpt.load(template, tmp_path / "one")
    assert_same(template["conj"], c.conj().resolve_conj())
    assert_same(template["inside"]["conj"], c[1].conj().resolve_conj())


@pytest.mark.parametrize("api", APIS)
def test_a_tensor_and_its_conjugate_view_are_not_merged(tmp_path, api):
    c = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    state = {"plain": c, "values": {"c": c, "cc": c.conj()}}
    template = {"plain": torch.zeros(3, dtype=torch.complex64), "values": None}
    roundtrip(tmp_path, api, state, template)
    assert_same(template["plain"], c)
    assert_same(template["values"]["c"], c)
    assert_same(template["values"]["cc"], c.conj().resolve_conj())


def test_tensor_keys_lists_every_leaf_of_a_deep_tree_in_order():
    from ckpt._shared.state import NDARRAY, PICKLE, TENSOR, holds_pickle, tensor_keys

    tree = {"a": [{TENSOR: "k0"}, {"b": {NDARRAY: "k1"}}], "c": {TENSOR: "k2", "x": 1}}
    deep: object = {TENSOR: "leaf"}
    for i in range(200):  # a deep tree: one list per subtree would have made this quadratic
        deep = [deep, {TENSOR: f"d{i}"}]
    assert tensor_keys(tree) == ["k0", "k1"]  # {TENSOR: ..., "x": 1} is a plain dict
    assert tensor_keys(deep) == ["leaf"] + [f"d{i}" for i in range(200)]
    assert not holds_pickle(deep)
    assert holds_pickle([1, {"v": [None, {PICKLE: "eA=="}]}])
    assert holds_pickle({PICKLE: "eA==", "other": 1})  # a tag among other keys still counts


def test_a_single_chunk_that_is_not_the_whole_tensor_is_refused():
    from ckpt._format.bounds import Invalid
    from ckpt._format.entries import Chunk
    from ckpt._format.tiling import check_tiling

    def one(offsets, shape):
        return [Chunk(offsets, shape, "f", 0, 4 * math.prod(shape), "0" * 16, "raw", None)]

    check_tiling("t", (4, 3), one((0, 0), (4, 3)))  # the whole tensor: valid
    check_tiling("t", (0,), one((0,), (0,)))  # an empty tensor's one empty chunk: valid
    for offsets, shape in [((1, 0), (4, 3)), ((0, 0), (3, 3)), ((0, 0), (4, 4)), ((0, 1), (4, 2))]:
        with pytest.raises(Invalid):
            check_tiling("t", (4, 3), one(offsets, shape))


def test_tensors_whose_paths_collide_are_saved_and_loaded_apart(tmp_path):
    """Tensors whose paths collide (a dict's int key 1 and str key "1"; a key "x/y" and "y" nested
    under "x") are stored apart, and each loads its own values."""
    saved = {"m": {1: torch.arange(4.0), "1": torch.arange(4.0) + 10,
                   "x/y": torch.full((2,), 7.0), "x": {"y": torch.full((2,), 8.0)}}}
    ckpt.save(saved, tmp_path / "c")
    live = {"m": None}
    ckpt.load(live, tmp_path / "c")
    got = live["m"]
    assert torch.equal(got[1], saved["m"][1]) and torch.equal(got["1"], saved["m"]["1"])
    assert torch.equal(got["x/y"], saved["m"]["x/y"])
    assert torch.equal(got["x"]["y"], saved["m"]["x"]["y"])


def test_a_plain_tensor_that_requires_grad_loads_through_a_bounce_buffer(tmp_path):
    """A plain tensor that requires grad loads into a destination that is not contiguous (as every
    CUDA destination) through a bounce buffer, which autograd allows, and still requires grad
    afterwards."""
    saved = torch.randn(96, 80)
    ckpt.save({"t": saved}, tmp_path / "c", options=ckpt.SaveOptions(chunk_bytes=4096, write_threads=1))
    live = torch.zeros(80, 96).t()  # a transposed view: the bounce path
    live.requires_grad_()
    ckpt.load({"t": live}, tmp_path / "c")
    assert torch.equal(live, saved) and live.requires_grad


def test_a_conjugate_view_restores_its_values_not_their_conjugates(tmp_path):
    """A live complex tensor that is a conjugate view (its bytes hold the conjugate) is filled
    through a copy and ends with the saved values, not their conjugates."""
    want = torch.complex(torch.arange(64.0), torch.arange(64.0) + 1)
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"z": want})
    live = torch.zeros(64, dtype=torch.complex64).conj()
    assert live.is_conj() and live.is_contiguous()
    with ckpt.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert mgr.restore({"z": live}) == 1
    assert torch.equal(live, want)


# ------------------------------- CUDA generators on another number of devices


def fake_cuda_rng(monkeypatch, count: int, current: int) -> dict[int, torch.Tensor]:
    """torch.cuda's RNG calls on ``count`` fake devices: returns each device's state as set
    (an index out of range raises, as torch.cuda.default_generators[index] does)."""
    states: dict[int, torch.Tensor] = {}

    def set_rng_state(new_state, device="cuda"):
        index = device if isinstance(device, int) else torch.device(device).index
        if index is None:
            index = current
        if not 0 <= index < count:
            raise IndexError("tuple index out of range")
        states[index] = new_state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    return states


def saved_rng(devices: int, current: int) -> dict:
    state = ckpt.RNGState().state_dict()
    state["cuda"] = [torch.full((16,), i, dtype=torch.uint8) for i in range(devices)]
    state["cuda_device"] = current
    return state


def test_cuda_rng_states_restore_on_as_many_devices_one_per_device(monkeypatch):
    """Saved CUDA generator states restore one per device on a machine with as many."""
    states = fake_cuda_rng(monkeypatch, count=2, current=1)
    ckpt.RNGState().load_state_dict(saved_rng(devices=2, current=1))
    assert {i: int(s[0]) for i, s in states.items()} == {0: 0, 1: 1}


def test_cuda_rng_of_a_rank_on_cuda3_of_8_goes_on_on_the_one_device_it_has_now(monkeypatch):
    """A rank that saved on cuda:3 of 8 devices goes on with that device's generator on the one
    device it has now."""
    states = fake_cuda_rng(monkeypatch, count=1, current=0)
    ckpt.RNGState().load_state_dict(saved_rng(devices=8, current=3))
    assert {i: int(s[0]) for i, s in states.items()} == {0: 3}


def test_cuda_rng_saved_by_an_old_version_without_its_device_restores_what_fits(monkeypatch):
    """CUDA generator states saved without the current device's index restore what fits the devices
    there are."""
    states = fake_cuda_rng(monkeypatch, count=2, current=0)
    old = saved_rng(devices=4, current=0)
    del old["cuda_device"]
    ckpt.RNGState().load_state_dict(old)
    assert {i: int(s[0]) for i, s in states.items()} == {0: 0, 1: 1}
