"""The on-disk format: manifests, validation, rank tables, data files, codec, boxes. Pure: no storage, no threads."""
