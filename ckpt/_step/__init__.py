"""One committed step on storage: reading its manifest and rank tables, pointers, listing steps."""
