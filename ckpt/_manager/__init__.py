"""The manager: CheckpointManager, a facade over the save schedule, the saver, the restorer and
its tiers, the root's owner and the memory publisher."""
