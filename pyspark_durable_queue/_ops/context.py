"""One address as the writes and maintenance of ``_ops`` see it: its context.

Who builds it: ``Address``, once per settings (a change of settings makes a new one, and the
operations built on it). The operations (``Committer``, ``Cleaner``, ``Compactor``,
``Sealer``) are built on one :class:`AddressContext` and read what they work on from it: the
address's name, its storage, the layout of its files, its commit log, its consumers and its
settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._format.layout import AddressLayout
from .._log.commit_log import CommitLog
from .._storage import Storage
from ..settings import AddressSettings
from .registry import ConsumerRegistry

__all__ = ["AddressContext", "OnAddress"]


@dataclass(frozen=True, eq=False)
class AddressContext:
    """What every operation of one address works on (the objects are the handle's own: its
    storage, its view of the log, its registry). Frozen: new settings make a new context."""

    name: str
    storage: Storage
    layout: AddressLayout
    log: CommitLog
    consumers: ConsumerRegistry
    settings: AddressSettings


class OnAddress:
    """An operation built on an :class:`AddressContext`; its parts are read from it."""

    def __init__(self, ctx: AddressContext) -> None:
        self.ctx = ctx

    @property
    def name(self) -> str:
        return self.ctx.name

    @property
    def storage(self) -> Storage:
        return self.ctx.storage

    @property
    def layout(self) -> AddressLayout:
        return self.ctx.layout

    @property
    def log(self) -> CommitLog:
        return self.ctx.log

    @property
    def consumers(self) -> ConsumerRegistry:
        return self.ctx.consumers

    @property
    def settings(self) -> AddressSettings:
        return self.ctx.settings
