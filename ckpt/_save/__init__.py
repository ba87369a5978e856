"""Save: the state's snapshot, staging to host memory, each rank's files, the writer, the commit."""
