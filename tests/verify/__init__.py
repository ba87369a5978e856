"""The tools: the ckpt command, verify, diff and export."""
