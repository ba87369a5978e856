"""One committed step on storage: reading and checking its manifest, pointers, listing steps."""
