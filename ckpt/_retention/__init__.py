"""Retention: which committed steps a root keeps (one policy for the manager and ``ckpt gc``)
and the reference-aware collector that removes the others."""
