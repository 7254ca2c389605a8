"""Transaction keys of the commit log: the one place that says who writes which key.

An ``append`` (or ``drop``) entry may carry ``txn = {"id": key, "batch": version}``;
:class:`~.state.LogState` keeps the highest version seen per key (persisted
in checkpoints), and a commit whose version is not above it is a duplicate: nothing is appended
and ``CommitResult.duplicate`` is set. Versions of one key therefore only move forward, as Delta
Lake's ``txnAppId``/``txnVersion`` do.

Keys live in namespaces, so that a user's app id can never be taken for the streaming sink's own
keys (or the other way round):

``app:<app id>``
    User transactions: ``Address.send(data, txn=(app_id, version))`` and a Spark batch write
    with the options ``txnAppId`` and ``txnVersion``. The same pair is the same transaction
    whichever of the two wrote it.
``spark-query:<query id>``
    The streaming sink, per micro-batch (the query id is stable across restarts from one
    checkpoint).
``spark-checkpoint:<checkpoint url>``
    The streaming sink when no task reported a query id.
``scheduled:<schedule id>``
    The release of one scheduled file (``_ops/scheduled.py``), at version 0: a release repeated
    after a crash (its rows appended, the file not yet deleted) is a duplicate. The log keeps
    the last :data:`REMEMBER_SCHEDULED` of these keys (``LogState``), not all of them.

Imported by :mod:`.address` and the Spark sink; needs neither pyarrow nor pyspark.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidOptionError

__all__ = [
    "APP_PREFIX",
    "SPARK_CHECKPOINT_PREFIX",
    "REMEMBER_SCHEDULED",
    "SCHEDULED_PREFIX",
    "SPARK_QUERY_PREFIX",
    "app_id",
    "app_txn",
    "committed",
    "scheduled_txn",
    "streaming_txn",
]

APP_PREFIX = "app:"
SPARK_QUERY_PREFIX = "spark-query:"
SPARK_CHECKPOINT_PREFIX = "spark-checkpoint:"
SCHEDULED_PREFIX = "scheduled:"
#: How many release keys of scheduled files the log's state keeps (the newest): a crash
#: between a release's append and its file's deletion leaves at most one round of files
#: (``_ops/scheduled.py``, ``ROUND_FILES``), which the next release looks at first.
REMEMBER_SCHEDULED = 10_000


def app_txn(txn: Any) -> tuple[str, int]:
    """The commit-log key of a user transaction ``(app id, version)``, validated.

    Parameters
    ----------
    txn : (str, int)
        A non-empty application id and a version ``>= 0``.

    Returns
    -------
    (str, int)
        ``("app:" + app id, version)``.

    Raises
    ------
    TypeError
        ``txn`` is not a pair, or its parts have the wrong types.
    InvalidOptionError
        The app id is empty or the version is negative.
    """
    example = "e.g. txn=('orders-loader', 17)"
    if not isinstance(txn, (tuple, list)) or len(txn) != 2:
        raise TypeError(f"txn must be a pair (app id, version), {example}; got {txn!r}")
    app_id, version = txn
    if not isinstance(app_id, str):
        raise TypeError(f"the app id of txn must be a str, {example}; got "
                        f"{type(app_id).__name__} {app_id!r}")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"the version of txn must be an int, {example}; got "
                        f"{type(version).__name__} {version!r}")
    if not app_id:
        raise InvalidOptionError(f"the app id of txn is empty; name the writing application, "
                                 f"{example}")
    if version < 0:
        raise InvalidOptionError(f"the version of txn must be at least 0, got {version}")
    return APP_PREFIX + app_id, version


def committed(txns: Mapping[str, int], txn: tuple[str, int]) -> bool:
    """Whether the log (its ``txns`` map) already holds ``txn``'s version or a later one."""
    return txns.get(txn[0], -1) >= txn[1]


def streaming_txn(batch_id: int, *, query_id: str | None,
                  checkpoint: str | None) -> tuple[str, int] | None:
    """The commit-log key of a streaming sink's micro-batch ``batch_id``.

    Keyed by the query id (stable across restarts from one checkpoint), else by the checkpoint
    (absolute URL or path) when no task reported a query id; ``None`` without either (the
    batch is then not deduplicated).
    """
    if query_id:
        return SPARK_QUERY_PREFIX + query_id, batch_id
    if checkpoint:
        return SPARK_CHECKPOINT_PREFIX + checkpoint, batch_id
    return None


def scheduled_txn(schedule_id: str) -> tuple[str, int]:
    """The commit-log key of the release of scheduled file ``schedule_id`` (version 0)."""
    return SCHEDULED_PREFIX + schedule_id, 0


def app_id(key: str) -> str | None:
    """The user's app id of a key made by :func:`app_txn`; ``None`` for the sink's own keys."""
    return key[len(APP_PREFIX):] if key.startswith(APP_PREFIX) else None
