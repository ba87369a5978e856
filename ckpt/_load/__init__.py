"""Load: planning and running a step's reads; the verification levels (structure to forward)."""
