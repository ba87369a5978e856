"""One committed step on storage: its pointer and its integrity checks."""
