"""Restoring a process group from the memory tier: from a candidate save (one that live
nodes hold completely, ``ckpt/_memory/discovery.py``) to the storage each rank loads it from.

The ranks agree on who serves each origin rank's files, merge the origin ranks' tables into
one manifest, and plan which chunks each rank's (possibly resharded) boxes need: read from
its own node's segments directly, or from the rank on another node that holds them
(``ckpt/_memory/peer_client.py`` and ``peer_server.py``); a chunk that several ranks of a
node need from elsewhere is fetched by one of them for all (``ckpt/_memory/sharing.py``).

Every function here is collective over ``pg`` (a gloo group) unless it says otherwise; errors
on one rank become an agreed failure on all, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Any, MutableMapping

import torch
import torch.distributed as dist

from ckpt.errors import CorruptCheckpointError
from ckpt._format.manifest import Manifest
from ckpt._format.names import FORMAT_NAME, FORMAT_VERSION, step_dir
from ckpt._step.incremental import CHAIN_KEY
from ckpt._memory.discovery import Candidate, Holding
from ckpt._memory.peer_client import PeerClient
from ckpt._memory.peer_server import PeerServer, Range, map_ranges
from ckpt._memory.sharing import Requests, agree_attempt, next_attempt, share
from ckpt._memory.source import MemorySource
from ckpt._memory.tier import node_prefix, plain_name
from ckpt._load import cooperative
from ckpt._load.probe import PROBE_ITEM
from ckpt._load.read_plan import needed_tensors
from ckpt._shared.sharding import dtensor_type, overlapping, read_box, source_rank
from ckpt._shared.state import flatten, is_stateful, item_tree


@dataclass
class ReadPlan:
    """One rank's plan for a save: the merged manifest and where each chunk it needs comes
    from (not collective to build, but agreed with the other ranks before it is used).

    ``local``: path -> file on this node; ``requests``: holder -> the ranges of chunks read
    from it; ``headers``: holder -> the ranges of the headers of its data files this rank
    reads; ``sizes``: path -> the size its rank step recorded; ``tier``: "memory" when every
    byte comes from this node's own segments, "peer" when any comes from a replica or a
    peer."""

    location: str
    manifest: Manifest
    raw: bytes
    sizes: dict[str, int]
    local: dict[str, str]
    requests: Requests
    headers: Requests
    tier: str


def open_candidate(c: Candidate, state: MutableMapping[str, Any], *, shm_dir: str, job: str,
                   node: str, rank: int, pg: Any, probe: bool = False) -> MemorySource:
    """Agree on who serves each origin rank's files, merge the manifest and start serving
    the peers (a rank reads the bytes it needs from them as its load asks). Collective; raises
    CorruptCheckpointError on every rank when any rank cannot read or serve its part (the
    caller falls through to the next tier). ``probe``: the load also reads the probe recorded
    at save time (the forward gate's), which ``state`` has no slot for."""
    world = dist.get_world_size(pg)
    prefix = node_prefix(job, node)
    # Each origin's rank step document comes from its first holder (any copy: the digests
    # inside are checked against the data as it is loaded). Gathered with it: each rank's
    # node and host, and its count of attempts (numbers the shared chunks' messages).
    docs, error = {}, None
    for origin, holders in sorted(c.holders.items()):
        holder_rank, h = holders[0]
        if holder_rank == rank:
            doc = c.docs.get(h.segment)  # as listed: authenticated (discovery.py)
            if doc is None:
                error = f"step {c.step}: no authenticated rank document of {h.segment}"
            else:
                docs[origin] = doc
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (docs, error, prefix, socket.gethostname(), next_attempt()),
                           group=pg)
    errors = [e for _, e, _, _, _ in everyone if e]
    if errors:
        raise CorruptCheckpointError(f"step {c.step} in memory: {errors[0]}")
    docs = {int(o): d for part, _, _, _, _ in everyone for o, d in part.items()}
    nodes = [p for _, _, p, _, _ in everyone]
    attempt = agree_attempt([n for _, _, _, _, n in everyone])
    # Node-mates read a save in the same order (the same copy of each replicated box), so
    # that the chunks they fetch from elsewhere are the same ones, fetched once for all;
    # by default only across hosts (on one host the "network" is a copy in memory, which
    # sharing cannot save: measured in docs/memory-tier.md).
    sharing = len(set(nodes)) < world and (cooperative.MODE == "always" or (
        cooperative.MODE == "auto" and len({h for _, _, _, h, _ in everyone}) > 1))
    anchor = nodes.index(prefix) if sharing else rank
    location = step_dir(c.step)
    plan, error = None, None
    try:  # per rank: every failure must reach the exchange's agreement, not skip it
        plan = _plan(c, docs, state, location, shm_dir, prefix, rank, anchor, probe)
    except Exception as e:
        error = f"rank {rank} cannot use step {c.step} in memory: {e!r}"
    gathered = _exchange(plan.requests if plan else {}, plan.headers if plan else {}, error,
                         c.step, location, pg)
    assert plan is not None  # else this rank's error made _exchange raise on every rank
    mine, asked = share([g[0] for g in gathered], [g[1] for g in gathered], nodes, location,
                        rank, pg, attempt, sharing)
    serving = _serve(asked, c.step, location, shm_dir, prefix, rank, pg)
    url = f"memory:{c.step}"
    peers = PeerClient(pg, mine.requests, location, url, rounds=mine.rounds)
    server = PeerServer(pg, serving, url).start() if serving else None
    return MemorySource(url, location, plan.manifest, plan.raw, local=plan.local,
                        sizes=plan.sizes, tier=plan.tier, peers=peers, server=server,
                        cooperation=mine.cooperation)


def _plan(c: Candidate, docs: dict[int, dict], state: MutableMapping[str, Any], location: str,
          shm_dir: str, prefix: str, rank: int, anchor: int, probe: bool) -> ReadPlan:
    """This rank's merged manifest and where each chunk it needs comes from: a file on this
    node, or a request to a holder elsewhere (holder -> [(segment, file, start, length)]).
    ``anchor``: the rank whose order of other nodes' copies this rank follows (itself, or
    the first rank of its node when node-mates share what they fetch)."""

    world = len(docs)

    def preference(rh: tuple[int, Holding]) -> tuple:
        """Own node's segments, then replicas on it, then other nodes' (spread over them:
        from this rank on, or from ``anchor`` on, the same for its node-mates); the second
        attempt reverses the order."""
        r, h = rh
        here = h.segment.startswith(prefix)
        key = (not here, h.replica, (r - (rank if here else anchor)) % world)
        return tuple(-k for k in key) if c.second else key

    chosen = {o: min(hs, key=preference) for o, hs in c.holders.items()}
    order = sorted(docs, key=lambda o: (preference(chosen[o]), o))
    manifest, raw, sizes, files_of = _merge(c, docs, location, order)
    origin_of = {name: origin for origin, names in files_of.items() for name in names}
    local: dict[str, str] = {}
    requests: Requests = {}
    headers: Requests = {}
    remote_files: dict[str, tuple[int, str]] = {}  # file -> (holder, segment)
    tier = "memory"
    for key, chunk in _needed_chunks(manifest, state, rank, probe):
        origin = origin_of[chunk.file]
        path = f"{location}/{chunk.file}"
        holder, h = chosen[origin]
        if h.replica or not h.segment.startswith(prefix):
            tier = "peer"
        if h.segment.startswith(prefix):  # on this node: read it here
            local[path] = os.path.join(shm_dir, h.segment, location, chunk.file)
        else:
            requests.setdefault(holder, []).append((h.segment, chunk.file, chunk.start,
                                                    chunk.length))
            remote_files[chunk.file] = (holder, h.segment)
    # The loader also reads the safetensors header of each data file it reads (checked
    # against the manifest): from a peer, its length prefix and its body, planned as the
    # two ranges it reads (a read of part of a planned range costs a request of its own).
    for name, (holder, segment) in sorted(remote_files.items()):
        end = _data_start(docs[origin_of[name]], name)
        headers.setdefault(holder, []).extend([(segment, name, 0, 8),
                                               (segment, name, 8, end - 8)])
    return ReadPlan(location, manifest, raw, sizes, local, requests, headers, tier)


def _data_start(doc: dict, name: str) -> int:
    """Where the data of the file ``name`` starts, after its header (``ckpt/_format/
    datafile.py``: the first chunk's bytes follow the header's padding)."""
    end = min(chunk["start"] for _, chunk in doc["table"]["chunks"] if chunk["file"] == name)
    if end <= 8:
        raise ValueError(f"{name}: its first chunk starts at {end}, inside the header")
    return end


def _merge(c: Candidate, docs: dict[int, dict], location: str,
           order: list[int]) -> tuple[Manifest, bytes, dict[str, int], dict[int, list[str]]]:
    """The manifest of the whole save, from every origin rank's table; a box that several
    ranks hold (a replicated tensor) is taken from the first of them in ``order``. Merged
    as JSON and parsed once: the same validation as any manifest read from a root.

    Returns the manifest, its bytes, path -> size of every file, origin -> its files."""
    first = docs[0]
    try:
        for o, d in docs.items():
            if d["token"] != c.token or d["rank"] != o:
                raise ValueError(f"rank {o}'s document names another save")
        tensors = {k: {"dtype": dtype, "shape": shape, "chunks": []}
                   for k, (dtype, shape) in first["tensors"].items()}
        files: dict[str, int] = {}
        seen: set = set()
        for o in order:
            table = docs[o]["table"]
            files.update(table["files"])
            for key, chunk in table["chunks"]:
                box = (key, tuple(chunk["offsets"]))
                if box not in seen:
                    seen.add(box)
                    tensors[key]["chunks"].append(chunk)
        for t in tensors.values():
            t["chunks"].sort(key=lambda chunk: chunk["offsets"])
        # Each rank's values of per-rank items (RNG states) from its own document: a rank
        # step needs to carry no other rank's.
        items = {name: {**item, "per_rank": {str(o): d["items"][name]["per_rank"][str(o)]
                                             for o, d in docs.items()}}
                 if isinstance(item.get("per_rank"), dict) else item
                 for name, item in first["items"].items()}
        doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": c.step,
               "world_size": c.world, "created": first["created"], "tensors": tensors,
               "aliases": first["aliases"], "items": items, "files": files,
               "metadata": {**first["metadata"], CHAIN_KEY: 0}}
        raw = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        manifest = Manifest.from_json(raw, where=f"step {c.step} in memory")
        files_of = {o: [plain_name(f) for f in d["table"]["files"]] for o, d in docs.items()}
        sizes = {f"{location}/{name}": size for d in docs.values()
                 for name, size in d["table"]["files"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"step {c.step} in memory: a rank step is malformed "
                                     f"({e!r})") from e
    return manifest, raw, sizes, files_of


def _needed_chunks(manifest: Manifest, state: MutableMapping[str, Any], rank: int,
                   probe: bool) -> list:
    """(key, chunk) this rank's load reads, planned as the loader plans it: the stored
    tensors its items refer to (``needed_tensors``, of the saved rank whose per-rank values
    it gets; with ``probe``, the probe item's too), in the box ``read_box`` gives for its
    live tensor, the chunks ``overlapping`` finds there."""
    src = source_rank(rank, manifest.world_size)
    live = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) or is_stateful(v)}
    tensors = flatten(live, allow_pickle=True, rank=src, keep_vars=True).tensors
    names = [*state, *([PROBE_ITEM] if probe and PROBE_ITEM not in state else [])]
    wanted = {name: item_tree(manifest.items[name], src) for name in names
              if name in manifest.items}
    dtensor, boxes = dtensor_type(), {}
    out = []
    for key in sorted(needed_tensors(None, "", manifest, wanted, allow_pickle=True)):
        entry, target = manifest.tensors[key], tensors.get(key)
        if dtensor is not None and isinstance(target, dtensor):
            # DTensors of one shape, mesh and placements share this rank's box: computed once
            spec = (tuple(target.shape), target.device_mesh, tuple(target.placements))
            box = boxes.get(spec) or boxes.setdefault(spec, read_box(entry, target))
        else:
            box = read_box(entry, target)
        out += [(key, chunk) for chunk, _ in overlapping(entry, box)]
    return out


def _exchange(requests: Requests, headers: Requests, error: str | None, step: int,
              location: str, pg: Any) -> list[tuple[Requests, Requests, None]]:
    """Every rank's planned reads from peers (``requests``: holder -> [(segment, file,
    start, length)] of chunks, ``headers``: of data files' headers); every rank raises when
    one could not plan them (``error``: this rank's reason)."""
    gathered: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, (requests, headers, error), group=pg)
    failed = [e for _, _, e in gathered if e]
    if failed:
        raise CorruptCheckpointError(failed[0])
    return gathered


def _serve(asked_by: list[Requests], step: int, location: str, shm_dir: str, prefix: str,
           rank: int, pg: Any) -> dict[int, list[Range]]:
    """Check that this rank can serve what the others ask of it (``asked_by``: rank ->
    holder -> ranges); every rank raises when one cannot. Returns what this rank serves:
    peer -> its ranges here, mapped."""
    world = dist.get_world_size(pg)
    # What each other rank asked of this one (its own node's ranges it reads locally).
    asked = {dst: r.get(rank, []) for dst, r in enumerate(asked_by) if dst != rank}
    serving: dict[int, list[Range]] = {}
    error = None
    try:
        serving = map_ranges(asked, shm_dir, prefix, location)
    except (OSError, ValueError, CorruptCheckpointError) as e:
        error = f"rank {rank} cannot serve step {step} from memory: {e}"
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error, group=pg)
    failed = [e for e in errors if e]
    if failed:
        raise CorruptCheckpointError(failed[0])
    return serving
