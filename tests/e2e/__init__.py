"""End to end: real crashes, torchrun jobs, framework integrations, exact resume."""
