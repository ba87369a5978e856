"""The on-disk format, pure (no I/O, no threads): manifests, rank tables, data files, codec."""
