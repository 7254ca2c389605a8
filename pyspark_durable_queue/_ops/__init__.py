"""Writes and maintenance of an address: what changes its files.

- :mod:`.registry`: consumer state files and watermarks (``ConsumerRegistry``);
- :mod:`.context`: one address as the operations below see it (``AddressContext``: name,
  storage, layout, log, consumers, settings), built once per settings by ``Address``;
- :mod:`.commit`: publishing pages, the full policy, backlog counting (``Committer``);
- :mod:`.group_commit`: concurrent sends of a process sharing one commit (``SendQueue``; group
  commit as LevelDB does it, not a consumer group);
- :mod:`.cleanup`: cleanup, orphans, archive, log retention (``Cleaner``);
- :mod:`.compact`: runs of small pages re-framed into full pages (``Compactor``);
- :mod:`.seal`: statistics for runs of small journal units in rolled segments (``Sealer``);
- :mod:`.repair`: verify and repair;
- :mod:`.scheduled`: scheduled delivery, kept outside the log until due (``Scheduler``);
- :mod:`.lease`: one running query per consumer (``ConsumerLease``).

Above reading (``_read``) and the commit log (``_log``); below the client (``consumer``,
``producer``, ``address``). Nothing is re-exported here, so that importing one operation does
not load the others.
"""
