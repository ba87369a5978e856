"""The on-disk format: manifests, their validation, layouts, data files, parsing."""
