"""The memory tier: segments, peers, replication."""
