"""The bytes on disk: what each file of an address holds and how it is written and read.

- :mod:`.layout`: where an address keeps its files (``AddressLayout``: every path, one place);
- :mod:`.frame`: the frame codec, one checksummed run of messages, shared by page files and
  the journal's units;
- :mod:`.page`: page files (frames, footers, statistics; ``PageWriter``);
- :mod:`.checked`: JSON files that carry their own checksum (format 5);
- :mod:`.scheduled`: a scheduled send's file and its name;
- :mod:`.ipc`: a few plain rows as an Arrow IPC stream written without Arrow;
- :mod:`.watermark`: a consumer's watermark file, rewritten in place;
- :mod:`.window`: a consumer's window file (pending rows as int64 arrays, checksummed);
- :mod:`.schema`: the system columns, schema conformance, rows to Arrow, selectors compiled
  against an address schema;
- :mod:`.stats`: page and frame statistics.

Above storage (``_storage``) and selectors (``_selector``); below the commit log (``_log``).
Nothing is re-exported here: ``stats`` and ``schema`` import pyarrow.compute and selectors,
which the read path of a plain consumer does not load, so each module is imported by name.
"""
