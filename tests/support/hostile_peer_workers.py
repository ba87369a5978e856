"""Bodies for run_ranks: a peer of the memory tier's restore protocol that sends requests ckpt's
own reader never sends (``ckpt/_memory/peer_server.py``), then ordinary ones."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ckpt._memory import peer_server
from ckpt._memory.peer_server import APPLY, DONE, READ, REQUEST_TAG, ROUND, VERIFY

DATA = bytes(range(256)) * 64  # the planned range rank 0 serves rank 1: 16 KiB

HOSTILE_ROUNDS = [
    [ROUND, VERIFY, 1, 0, 0],            # pieces of 0 bytes
    [ROUND, VERIFY, 1, -1024, 0],        # negative pieces
    [ROUND, APPLY, 1, 1 << 40, 0],       # pieces past any message
    [ROUND, APPLY, -5, 1024, 0],         # negative tags
    [ROUND, APPLY, 1 << 40, 1024, 0],    # tags past gloo's
    [ROUND, 7, 1, 1024, 0],              # no such kind
    [ROUND, VERIFY, 1, 1024, 2],         # more ranges than were planned
    [ROUND, VERIFY, 1, 1024, -1],        # a negative count of ranges
    [ROUND, APPLY, (1 << 31) - 2, 1024, 0],  # tags that run past gloo's within the round
    [ROUND, APPLY, 1, 1024, 0],          # a round, served...
    [ROUND, APPLY, 100000, 1024, 0],     # ...but a repeated round of a kind is not sent
    [READ, 0, 0, 16, -3],                # negative tag
    [READ, 0, 0, 16, 1 << 40],           # tag past gloo's
    [READ, 0, 0, 16, 0],                 # the request tag
    [9, 0, 0, 0, 0],                     # no such op
]


def serve_hostile_requests(rank: int, world: int, tmp: str) -> dict:
    if rank == 0:
        path = os.path.join(tmp, "data-0")
        with open(path, "wb") as f:
            f.write(DATA)
        server = peer_server.PeerServer(dist.group.WORLD,
                                        {1: [(peer_server._map(path), 0, len(DATA))]},
                                        "hostile").start()
        errors = server.close()
        return {"errors": [repr(e) for e in errors]}
    for ask in HOSTILE_ROUNDS:
        dist.send(torch.tensor(ask, dtype=torch.int64), dst=0, tag=REQUEST_TAG)
    # The round that was served: its messages are received.
    ones = [torch.empty(1024, dtype=torch.uint8) for _ in range(16)]
    for w in [dist.irecv(t, src=0, tag=1 + k) for k, t in enumerate(ones)]:
        w.wait()
    # READs outside the plan with a tag to answer on: a short answer of zeros, never 1 TiB.
    huge = torch.full((4 << 20,), 7, dtype=torch.uint8)
    bad = torch.full((10,), 7, dtype=torch.uint8)
    got = [dist.irecv(huge, src=0, tag=200000), dist.irecv(bad, src=0, tag=200001)]
    for ask in ([READ, 0, 0, 1 << 40, 200000], [READ, 0, -1, 10, 200001]):
        dist.send(torch.tensor(ask, dtype=torch.int64), dst=0, tag=REQUEST_TAG)
    for w in got:
        w.wait()
    # The server still answers ckpt's own requests: a READ and a round of the other kind.
    part = torch.empty(16, dtype=torch.uint8)
    w = dist.irecv(part, src=0, tag=200002)
    dist.send(torch.tensor([READ, 0, 100, 16, 200002], dtype=torch.int64), dst=0,
              tag=REQUEST_TAG)
    w.wait()
    pieces = [torch.empty(4096, dtype=torch.uint8) for _ in range(4)]
    dist.send(torch.tensor([ROUND, VERIFY, 300000, 4096, 0], dtype=torch.int64), dst=0,
              tag=REQUEST_TAG)
    for w in [dist.irecv(p, src=0, tag=300000 + k) for k, p in enumerate(pieces)]:
        w.wait()
    dist.send(torch.tensor([DONE, 0, 0, 0, 0], dtype=torch.int64), dst=0, tag=REQUEST_TAG)
    return {"ones": bytes(torch.cat(ones).tolist()) == DATA,
            "huge_zeros": int((huge == 0).sum()), "bad_zeros": int((bad == 0).sum()),
            "read": bytes(part.tolist()) == DATA[100:116],
            "round": bytes(torch.cat(pieces).tolist()) == DATA}
