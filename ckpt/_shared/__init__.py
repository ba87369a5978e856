"""What save and load share: state flattening, RNG, boxes over ranks, process groups, buffers."""
