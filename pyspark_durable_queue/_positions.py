"""Where a read starts or ends: ``earliest``, ``latest``, a ``_seq``, a Spark offset, or a time.

One parser for every spelling users bring: the Python client's ``start=`` / ``Consumer.seek``
(``"earliest"``, ``"latest"``, an int, a ``datetime``), and the Spark options
``startingOffsets`` / ``endingOffsets`` (also the JSON offset Spark prints in query progress,
``{"seq": N}``) and ``startingTimestamp`` / ``endingTimestamp`` (epoch milliseconds or
ISO-8601). A position is resolved to a ``_seq`` against one view of the commit log.

Times: ``_timestamp`` is the commit time and never goes backwards within an address, so the
first message at or after a time is found by a binary search over the page index. A naive
``datetime`` or an ISO-8601 text without a zone is taken as UTC, like ``_timestamp`` itself.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import InvalidOptionError

__all__ = ["EARLIEST", "LATEST", "ReadPosition", "parse_position", "parse_time", "position_value",
           "time_value"]

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


class SeqView(Protocol):
    """What a position is resolved in: a view of the log (``_log.state.LogState``) or a snapshot
    of one (``_read.scan.Snapshot``). Defined here, so that this leaf module imports neither."""

    @property
    def first_seq(self) -> int: ...

    @property
    def next_seq(self) -> int: ...

    def seek_time(self, ts_us: int) -> int: ...


@dataclass(frozen=True)
class ReadPosition:
    """A place in an address, not yet resolved to a ``_seq``.

    Attributes
    ----------
    kind : {"earliest", "latest", "seq", "time"}
    value : int
        The ``_seq`` (kind ``seq``) or microseconds since the epoch, UTC (kind ``time``).
    """

    kind: str
    value: int = 0

    def resolve(self, state: SeqView) -> int:
        """The ``_seq`` this position names in ``state`` (a view of the log, or a snapshot
        of one): ``earliest`` is the first retained message, ``latest`` the next one to be
        written, a time the first message committed at or after it (the log's end when there
        is none yet)."""
        if self.kind == "earliest":
            return state.first_seq
        if self.kind == "latest":
            return state.next_seq
        if self.kind == "time":
            return state.seek_time(self.value)
        return self.value

    def __str__(self) -> str:
        if self.kind == "seq":
            return f"_seq {self.value}"
        if self.kind == "time":
            return (_EPOCH + dt.timedelta(microseconds=self.value)).isoformat()
        return self.kind


EARLIEST = ReadPosition("earliest")
LATEST = ReadPosition("latest")


def parse_position(value: Any, what: str = "start") -> ReadPosition:
    """Parse ``earliest``, ``latest``, a ``_seq`` (int or digits), a Spark offset
    (``{"seq": N}``, as a dict or JSON text), a ``datetime``, or a :class:`ReadPosition`.

    Raises
    ------
    InvalidOptionError
        Naming ``what`` (the option or argument), the value and the accepted forms.
    """
    try:
        return position_value(value)
    except ValueError as exc:
        raise InvalidOptionError(f"{what}={value!r} is invalid: {exc}") from None


def parse_time(value: Any, what: str = "timestamp") -> ReadPosition:
    """Parse a time: epoch milliseconds (int or digits), ISO-8601 text, or a ``datetime``."""
    try:
        return time_value(value)
    except ValueError as exc:
        raise InvalidOptionError(f"{what}={value!r} is invalid: {exc}") from None


_POSITION_FORMS = ('use earliest, latest, a _seq (an integer >= 0) or an offset as Spark prints '
                   'it in query progress ({"seq": N})')


def position_value(value: Any) -> ReadPosition:
    """:func:`parse_position` raising a plain ``ValueError`` that says what is accepted (the
    converter of the option table, which names the option)."""
    if isinstance(value, ReadPosition):
        return value
    if isinstance(value, dt.datetime):
        return time_value(value)
    if isinstance(value, dict):
        return _offset(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return _seq(value)
    text = str(value).strip()
    lower = text.lower()
    if lower in ("earliest", "latest"):
        return EARLIEST if lower == "earliest" else LATEST
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return _offset(parsed)
    elif text.lstrip("-").isdigit():
        return _seq(int(text))
    raise ValueError(_POSITION_FORMS)


def time_value(value: Any) -> ReadPosition:
    """:func:`parse_time` raising a plain ``ValueError``."""
    if isinstance(value, dt.datetime):
        when = value if value.tzinfo is not None else value.replace(tzinfo=dt.timezone.utc)
        return ReadPosition("time", (when - _EPOCH) // dt.timedelta(microseconds=1))
    if isinstance(value, int | float) and not isinstance(value, bool):
        return ReadPosition("time", round(value * 1000))
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return ReadPosition("time", int(text) * 1000)
    try:
        parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError("not a time: use epoch milliseconds (e.g. 1732233600000) or ISO-8601 "
                         "(e.g. 2026-11-23T10:00:00Z; without a zone it is UTC)") from None
    return time_value(parsed)


def _seq(seq: int) -> ReadPosition:
    if seq < 0:
        raise ValueError("a _seq is >= 0")
    return ReadPosition("seq", seq)


def _offset(offset: dict[str, Any]) -> ReadPosition:
    seq = offset.get("seq")
    if set(offset) != {"seq"} or not isinstance(seq, int) or isinstance(seq, bool):
        raise ValueError(_POSITION_FORMS)
    return _seq(seq)
