"""A commit log entry's bytes (the JSON of :mod:`.._log.state`'s entries, compact), and the
fast path both ways for the commonest one, the entry of a plain send (an append of one journal
unit's messages): the writer fills a template (:func:`entry_bytes`), readers match a regular
expression (:func:`entry_of`). The two shapes are kept side by side here; both give exactly
what the JSON encoder and ``json.loads`` give (tests/test_group_commit.py ties them).
"""
from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["ENTRY_JSON", "entry_bytes", "entry_of"]

#: What writes an entry (``json.dumps`` with separators makes an encoder a call).
ENTRY_JSON = json.JSONEncoder(separators=(",", ":"))

#: The keys, in order, of the entry of a plain send as ``_stamped`` leaves it (an append of
#: one journal unit's messages), and of the one page it lists (``_log.journal.unit_page``).
_UNIT_APPEND_KEYS = ("op", "seq", "pages", "v", "ts", "id")
_UNIT_PAGE_KEYS = ("journal", "rows", "bytes", "stats")


def entry_bytes(entry: dict[str, Any]) -> bytes:
    """``entry`` as the bytes ``ENTRY_JSON`` writes. The entry of a plain send (ints, a hex
    id, one journal page without statistics) is filled into a template: the encoder's walk
    over the dicts was ~6% of a single send's CPU (docs/performance.md, "send-profile")."""
    pages = entry.get("pages")
    page = pages[0] if type(pages) is list and len(pages) == 1 else None
    if tuple(entry) != _UNIT_APPEND_KEYS or entry["op"] != "append" or type(page) is not dict \
            or tuple(page) != _UNIT_PAGE_KEYS or page["journal"] is not True \
            or type(page["stats"]) is not dict or page["stats"]:
        return ENTRY_JSON.encode(entry).encode()
    seq, v, ts, ident = entry["seq"], entry["v"], entry["ts"], entry["id"]
    rows, nbytes = page["rows"], page["bytes"]
    if not (type(seq) is int and type(v) is int and type(ts) is int and type(rows) is int
            and type(nbytes) is int and type(ident) is str and ident.isascii()
            and ident.isalnum()):
        return ENTRY_JSON.encode(entry).encode()
    return (f'{{"op":"append","seq":{seq},"pages":[{{"journal":true,"rows":{rows},'
            f'"bytes":{nbytes},"stats":{{}}}}],"v":{v},"ts":{ts},"id":"{ident}"}}').encode()


#: The entry of a plain send as :func:`entry_bytes` fills its template (and as the JSON
#: encoder writes it), perhaps with ``synced_to``: parsed without ``json`` (a replay of
#: other processes' single sends spent a third of its time in ``json.loads``).
_PLAIN_ENTRY = re.compile(
    rb'\{"op":"append","seq":(0|[1-9][0-9]{0,18}),"pages":\[\{"journal":true,'
    rb'"rows":(0|[1-9][0-9]{0,18}),"bytes":(0|[1-9][0-9]{0,18}),"stats":\{\}\}\],'
    rb'"v":(0|[1-9][0-9]{0,18}),"ts":(0|[1-9][0-9]{0,18}),"id":"([0-9a-zA-Z]{1,64})"'
    rb'(?:,"synced_to":(0|[1-9][0-9]{0,18}))?\}')


def entry_of(data: bytes) -> Any:
    """The entry JSON of a unit: what ``json.loads`` returns, the same dict for a plain send's
    entry without the decoder."""
    plain = _PLAIN_ENTRY.fullmatch(data)
    if plain is None:
        return json.loads(data)
    seq, rows, nbytes, v, ts, ident, synced_to = plain.groups()
    entry: dict[str, Any] = {
        "op": "append", "seq": int(seq),
        "pages": [{"journal": True, "rows": int(rows), "bytes": int(nbytes), "stats": {}}],
        "v": int(v), "ts": int(ts), "id": ident.decode()}
    if synced_to is not None:
        entry["synced_to"] = int(synced_to)
    return entry
