"""The memory tier: node-local copies of recent steps in shared memory and their peer replicas.

One module per kind: ``tier`` (segments, and publishing steps into them), ``replication``
(copies sent to peer nodes; ``replica_receiver`` stores peers' copies, ``replica_wire`` is
how both sides authenticate), ``discovery`` (what the live nodes hold), ``plan`` (an agreed
save -> each rank's reads), ``shm_reader`` and ``source`` (the storage a restore reads),
``peer_client`` and ``peer_server`` (the two sides of the peer protocol).
"""

from ckpt._memory.discovery import Candidate, Holding, candidates, local_holdings
from ckpt._memory.plan import open_candidate
from ckpt._memory.replication import Replicator
from ckpt._memory.shm_reader import ShmReader
from ckpt._memory.source import MemorySource
from ckpt._memory.tier import MemoryTier, gc_segments

__all__ = [
    "Candidate",
    "Holding",
    "MemorySource",
    "MemoryTier",
    "Replicator",
    "ShmReader",
    "candidates",
    "gc_segments",
    "local_holdings",
    "open_candidate",
]
