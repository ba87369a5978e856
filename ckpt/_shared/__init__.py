"""What save and load share: state flattening, RNG, sharding of boxes over ranks, process-group helpers."""
