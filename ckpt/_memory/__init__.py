"""The memory tier: node-local copies of recent steps in shared memory and their peer replicas."""
