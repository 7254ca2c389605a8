"""The commit log of an address and what it is built from.

- :mod:`.commit_log`: publish, load, checkpoints, retention (``CommitLog``);
- :mod:`.state`: the fold of the log's entries into an address's state (``LogState``);
- :mod:`.index`: live pages as columns and ``PageRef``, the one reference to published messages;
- :mod:`.journal`: the local journal (format 4), commits as checksummed units in segments;
- :mod:`.durability`: ``fsync=periodic``, the background sync of written commits;
- :mod:`.txn`: transaction keys (exactly-once Spark batches, idempotent sends).

Above the on-disk formats (``_format``) and storage; below reading (``_read``) and the writes
and maintenance (``_ops``). Nothing is re-exported here, so that importing one module (the Spark
sink's ``txn``) does not load the others.
"""
