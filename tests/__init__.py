"""The ckpt test suite."""
