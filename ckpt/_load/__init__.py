"""Load: planning and running the reads of a step, and the verification levels (structure, digest, forward)."""
