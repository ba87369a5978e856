"""Retention: the policy, incremental chains and the collector."""
