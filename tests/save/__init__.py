"""Saves: synchronous and background, compressed, sharded over ranks, round trips."""
