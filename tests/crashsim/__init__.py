"""A crash-state explorer for ckpt's commit protocol (the approach of ALICE, OSDI'14).

* :mod:`.record` records the file-system operations ``storage_backends.posix`` makes (create,
  write, fsync, rename, unlink, mkdir, rmdir) by standing in for its ``os`` and ``shutil``;
* :mod:`.model` replays a trace on an inode model and enumerates every crash state POSIX
  allows (a prefix of the operations; of those, what no fsync made durable dropped, cut short
  or kept), and materializes each into a directory;
* :mod:`.oracle` checks one state: a restore sees the previous step or the new one whole,
  verify agrees, and opening a writer (which cleans up) changes none of that;
* :mod:`.objstore` does the same for object storage over the request sequence of a save.
"""
