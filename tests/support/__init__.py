"""Helpers of the ckpt test suite: rank runners, worker processes, job scripts, fixtures."""
