"""Save: snapshot of the state, staging to host memory, the background writer and the commit."""
