"""CheckpointManager: the schedule, retention and restore of a training run's checkpoints."""
