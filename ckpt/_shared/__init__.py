"""What the wings share: state flattening, RNG, boxes over ranks, process groups, buffers,
and the bounded HTTP server of the metrics and heal endpoints."""
