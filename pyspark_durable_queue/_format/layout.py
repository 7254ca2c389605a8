"""Where an address keeps its files: the one place that names them.

Under ``<root>/<address>/``::

    address.json            settings (JSON), written at creation, updated when settings change
    log/                    the commit log (entry and checkpoint names: see ``_log.commit_log``)
    pages/<uuid>.page       page files (see ``_format.page``)
    consumers/<name>.json   one state file per durable consumer (see ``_ops.registry``)
    consumers/<name>.wm     its watermark, rewritten in place (format 3, see ``_format.watermark``)
    consumers/<name>.window its rows settled out of order or waiting for redelivery, once a
                            nack made any (see ``_ops.window``)
    consumers/_leases/<name>/   the Spark source's claims on a consumer (see ``_ops.lease``)
    consumers/_shared/<name>/   a shared consumer's state, one file per epoch (see
                            ``_ops.shared``)
    archive/                consumed pages, when ``archive_data_logs`` is on (the folder is
                            the ``directory_archive`` setting)
    damaged/                what ``repair`` set aside (see ``_ops.repair``)
    scheduled/<due>-<stamp>-<rows>.arrow   messages scheduled for later, outside the log
                            until due (see ``_format.scheduled``, ``_ops.scheduled``)
    expiry/<N>.json         the expiry cursor and moves to ``expiry_address``, write-once
                            numbered records (see ``_ops.expiry``)
    cleanup.json            when cleanup last ran (``cleanup_interval_ms`` spans processes)

Temporary files of the local backend live in ``<root>/.tmp`` and belong to the storage.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AddressLayout", "is_numbered", "numbered"]

#: Digits of a numbered file's name (commit-log entries and checkpoints, journal segments,
#: lease epochs, the due time of a scheduled send's file): zero-padded so that names sort as
#: numbers.
NUMBER_WIDTH = 20


def numbered(number: int) -> str:
    """``number`` as the stem of a numbered file: ``00000000000000000042``."""
    return f"{number:0{NUMBER_WIDTH}d}"


def is_numbered(stem: str) -> bool:
    """Whether ``stem`` is a numbered file's stem (what :func:`numbered` makes)."""
    return len(stem) == NUMBER_WIDTH and stem.isdigit()

#: Folder names inside ``consumers/`` that are not consumers (names never start with ``_``).
LEASES = "_leases"
SHARED = "_shared"
DAMAGED = "damaged"


@dataclass(frozen=True)
class AddressLayout:
    """The paths of one address (small and picklable: a string)."""

    folder: str

    @property
    def meta(self) -> str:
        return f"{self.folder}/address.json"

    @property
    def log(self) -> str:
        return f"{self.folder}/log"

    @property
    def pages(self) -> str:
        return f"{self.folder}/pages"

    @property
    def consumers(self) -> str:
        return f"{self.folder}/consumers"

    @property
    def cleanup_marker(self) -> str:
        return f"{self.folder}/cleanup.json"

    @property
    def damaged(self) -> str:
        return f"{self.folder}/{DAMAGED}"

    @property
    def expiry(self) -> str:
        return f"{self.folder}/expiry"

    @property
    def scheduled(self) -> str:
        return f"{self.folder}/scheduled"

    def scheduled_file(self, name: str) -> str:
        return f"{self.scheduled}/{name}"

    @property
    def folders(self) -> tuple[str, ...]:
        """The folders made when an address is created."""
        return (self.folder, self.log, self.pages, self.consumers)

    def page(self, name: str) -> str:
        return f"{self.pages}/{name}"

    def consumer_state(self, name: str) -> str:
        return f"{self.consumers}/{name}.json"

    def consumer_watermark(self, name: str) -> str:
        return f"{self.consumers}/{name}.wm"

    def consumer_window(self, name: str) -> str:
        return f"{self.consumers}/{name}.window"

    def leases(self, consumer: str) -> str:
        return f"{self.consumers}/{LEASES}/{consumer}"

    def shared(self, consumer: str) -> str:
        return f"{self.consumers}/{SHARED}/{consumer}"

    def archived_page(self, directory: str, name: str) -> str:
        return f"{self.folder}/{directory}/{name}"

    def quarantined(self, name: str, now: float) -> str:
        """Where repair moves a damaged file (never deleted): ``damaged/<time>-<name>``."""
        return f"{self.damaged}/{int(now)}-{name}"
