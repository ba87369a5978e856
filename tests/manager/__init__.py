"""The checkpoint manager: its options, errors and metrics."""
