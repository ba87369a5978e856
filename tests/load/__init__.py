"""Loads: failures that change nothing, structure, verification levels, user errors."""
