"""One running query per consumer: a renewable lease stored next to the consumer's state.

A lease is a chain of write-once claim files, one per epoch::

    <address>/consumers/_leases/<consumer>/00000000000000000007.json
        {"owner": "9f0c...", "host": "...", "pid": 4242, "pid_start": "...",
         "renewed": 1732240000.1, "expires": 1732240060.1, "released": false}

The newest epoch is the current claim. Taking the lease, renewing it and releasing it all create
the next epoch with :meth:`Storage.create`, which is atomic and exclusive; so of two queries that
start at the same moment exactly one wins the epoch, and the loser sees the winner's claim and
fails with :class:`ConsumerInUseError`. Renewal is the same race: an owner that finds the next
epoch taken by someone else has lost its lease (it stalled past the expiry) and must stop.

The claim is free when it expired, was released, or names a process on this host that is no
longer running (a query whose driver was killed and restarted on the same machine does not wait
for the expiry). A claim that is still valid but has not been renewed for a third of the lease
(its owner renews three times per lease) probably belongs to a dead driver on another host; the
new query then waits for it to expire instead of failing. Expiry uses wall-clock time, so clocks
of the machines involved must agree to well within ``consumerLeaseMs``.

"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from .._format import checked
from .._format.layout import is_numbered, numbered
from .._storage import NotFound, Storage
from ..errors import ConsumerInUseError

__all__ = ["OWNERS", "ConsumerLease", "ProcessOwners", "live_claim"]

log = logging.getLogger(__name__)

_KEEP_EPOCHS = 3
_POLL_S = 0.2
#: How long a query waits for a live claim of a process on this host to go away (a query that
#: was stopped a moment ago) before it reports the consumer as in use.
_LOCAL_GRACE_S = 3.0


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` (Linux), to tell a live process from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start is None or _process_start(pid) in (None, start)


class ConsumerLease:
    """The claim of one query (one driver-side reader process) on a durable consumer.

    Concurrency guarantee: at most one holder at a time as long as holders renew within the
    lease time (a background thread does, see :meth:`start_heartbeat`); epochs are published
    with :meth:`Storage.create`, so concurrent acquirers never both win.

    Parameters
    ----------
    storage : Storage
        The store.
    folder : str
        The consumer's lease folder.
    consumer : str
        The consumer name (for messages).
    ttl_ms : int
        How long a claim lasts without renewal (``consumerLeaseMs``).
    checksums : bool
        Claims carry their checksum (on-disk format 5).
    """

    def __init__(self, storage: Storage, folder: str, consumer: str, ttl_ms: int, *,
                 checksums: bool = False) -> None:
        self.storage = storage
        self.checksums = checksums
        self.folder = folder
        self.consumer = consumer
        self.ttl = ttl_ms / 1000
        self.owner = uuid.uuid4().hex
        self.epoch = -1
        self._renewed = 0.0  # monotonic time of our last claim
        self._lock = threading.RLock()
        self._lost: ConsumerInUseError | None = None
        #: the consumer was deleted (:meth:`abandon`): nothing is written any more
        self._abandoned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the heartbeat's last renewal failed (the store is unreachable): releasing it at
        #: exit is skipped, so that an exit does not wait on a store that went away
        self.failing = False
        #: called by the heartbeat thread before each renewal (the owners give back the
        #: shares of collected handles there: a finalizer may not take locks or do I/O)
        self.before_beat: Callable[[], object] | None = None
        #: what the holder says of itself in each claim it writes (``status``: a consumer's
        #: messages in flight, which ``stats()`` reads, see ``_ops.metrics``); called in the
        #: renewing thread, so it reads without taking the holder's locks
        self.report: Callable[[], dict[str, Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a ConsumerLease belongs to one process and is never pickled")

    @property
    def held(self) -> bool:
        return self.epoch >= 0 and self._lost is None

    # -- files ----------------------------------------------------------------------------------
    def _path(self, epoch: int) -> str:
        return f"{self.folder}/{numbered(epoch)}.json"

    def _epochs(self) -> list[int]:
        out = []
        for name in self.storage.list(self.folder):
            stem = name[:-5] if name.endswith(".json") else ""
            if is_numbered(stem):
                out.append(int(stem))
        return sorted(out)

    def _newest(self) -> tuple[int, dict[str, Any] | None]:
        """The newest epoch and its claim (``-1, None`` when there is none)."""
        while True:
            epochs = self._epochs()
            if not epochs:
                return -1, None
            path = self._path(epochs[-1])
            try:
                claim = checked.loads(self.storage.read(path), required=self.checksums)
            except NotFound:
                continue  # pruned while we listed: look again
            except (ValueError, TypeError) as exc:
                # an unreadable claim cannot name an owner: it counts as free (the next epoch
                # is still created exclusively, so two queries never both take it)
                log.warning("lease claim %s is damaged (%s); taken as free", path, exc)
                claim = {}
            return epochs[-1], claim

    def _claim(self, *, released: bool = False) -> bytes:
        now = time.time()
        claim = {
            "consumer": self.consumer, "owner": self.owner, "host": socket.gethostname(),
            "pid": os.getpid(), "pid_start": _process_start(os.getpid()), "renewed": now,
            "expires": 0 if released else now + self.ttl, "released": released,
        }
        if self.report is not None and not released:
            claim["status"] = self.report()
        return checked.dumps(claim) if self.checksums else json.dumps(claim).encode()

    def _free(self, claim: dict[str, Any] | None, now: float) -> bool:
        if not claim or claim.get("released") or claim.get("owner") == self.owner:
            return True
        if float(claim.get("expires", 0)) <= now:
            return True
        if self._local(claim):
            return not _alive(claim["pid"], claim.get("pid_start"))
        return False

    @staticmethod
    def _local(claim: dict[str, Any]) -> bool:
        return claim.get("host") == socket.gethostname() and isinstance(claim.get("pid"), int)

    def _describe(self, claim: dict[str, Any], now: float) -> str:
        return (f"consumer {self.consumer!r} is in use by another running query or consumer "
                f"process (process {claim.get('pid')} on host {claim.get('host')!r}, claim "
                f"renewed {now - float(claim.get('renewed', now)):.0f} s ago, expires in "
                f"{float(claim.get('expires', now)) - now:.0f} s); stop it, close its consumer, "
                "or use another consumer name. A crashed holder's claim is free at once on its "
                "own host and expires after consumerLeaseMs elsewhere")

    def _prune(self, newest: int) -> None:
        for epoch in self._epochs():
            if epoch <= newest - _KEEP_EPOCHS:
                self.storage.delete(self._path(epoch))

    # -- protocol -------------------------------------------------------------------------------
    def acquire(self, wait_s: float | None = None) -> None:
        """Take the lease, or raise :class:`ConsumerInUseError` if a live holder has it.

        Called on the driver when the query starts reading (first ``initialOffset`` or
        ``latestOffset``), and by a client consumer's first ``receive``. ``wait_s=None`` (a
        query): waits a moment for a holder on this host that is exiting, and for a claim that
        looks abandoned (not renewed for a third of its lease) to expire. ``wait_s`` given (a
        client): waits at most that long for the claim to be free, whatever its holder.
        """
        with self._lock:
            self.storage.makedirs(self.folder)
            patience = time.monotonic() + (_LOCAL_GRACE_S if wait_s is None else wait_s)
            while True:
                epoch, claim = self._newest()
                now = time.time()
                if claim is not None and not self._free(claim, now) and self._local(claim) \
                        and claim["pid"] == os.getpid() and OWNERS.give_back_collected():
                    continue  # held by handles of this process that were dropped: gone now
                if claim is not None and not self._free(claim, now) and wait_s is not None:
                    if time.monotonic() >= patience:
                        raise ConsumerInUseError(self._describe(claim, now))
                    time.sleep(min(_POLL_S, max(0.0, patience - time.monotonic())))
                    continue
                if claim is not None and not self._free(claim, now):
                    stale = now - float(claim.get("renewed", 0)) > self.ttl / 3 + 1
                    if not stale:
                        if self._local(claim) and time.monotonic() < patience:
                            time.sleep(_POLL_S)  # a query stopped just now may still be exiting
                            continue
                        raise ConsumerInUseError(self._describe(claim, now))
                    time.sleep(min(_POLL_S * 5, max(0.0, float(claim["expires"]) - now)))
                    continue
                if self.storage.create(self._path(epoch + 1), self._claim()):
                    self.epoch = epoch + 1
                    self._renewed = time.monotonic()
                    self._lost = None
                    self._prune(self.epoch)
                    log.info("consumer %s: lease epoch %d taken", self.consumer, self.epoch)
                    return
                # another query won this epoch: look at its claim

    def renew(self, *, force: bool = False) -> None:
        """Extend the lease (at most every third of the lease unless ``force``).

        Raises
        ------
        ConsumerInUseError
            Another query took the lease over (ours had expired).
        """
        with self._lock:
            if self._lost is not None:
                raise self._lost
            if self._abandoned:
                return  # the consumer was deleted: nothing to renew
            if self.epoch < 0:
                self.acquire()
                return
            if not force and time.monotonic() - self._renewed < self.ttl / 3:
                return
            if not self.storage.exists(self._path(self.epoch)) and self._newest()[0] < 0:
                # the consumer (or its address) was deleted: a store that makes folders on
                # write (memory://, object stores) would get a claim in a folder that is gone
                raise NotFound(f"the lease folder {self.folder} of consumer {self.consumer!r} "
                               "is gone")
            if self.storage.create(self._path(self.epoch + 1), self._claim()):
                self.epoch += 1
                self._renewed = time.monotonic()
                self._prune(self.epoch)
                return
            _, claim = self._newest()
            if claim is not None and claim.get("owner") == self.owner:  # pragma: no cover
                return
            self._lost = ConsumerInUseError(
                f"the lease on consumer {self.consumer!r} was taken over by another query "
                f"while this one held it (it was not renewed for consumerLeaseMs="
                f"{int(self.ttl * 1000)}); this query stops so that messages are not consumed "
                "twice")
            raise self._lost

    def check(self) -> None:
        """Raise :class:`ConsumerInUseError` unless our claim is still the newest one."""
        with self._lock:
            if self._lost is not None:
                raise self._lost
            epoch, claim = self._newest()
            if claim is None or claim.get("owner") != self.owner:
                self._lost = ConsumerInUseError(
                    f"the lease on consumer {self.consumer!r} (epoch {self.epoch}) is now held "
                    f"by another query (epoch {epoch}); this query stops")
                raise self._lost

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No renewal runs inside the block (while the consumer's lease folder is deleted: a
        renewal would create a claim in it; after it, renewals find the folder gone and stop)."""
        with self._lock:
            yield

    def release(self) -> None:
        """Give the lease up (best effort: a released claim lets the next query start at once).
        Nothing to release when the consumer's folder is gone (it, or its address, was
        deleted)."""
        self._stop.set()
        with self._lock:
            if self.epoch < 0 or self._lost is not None or self._abandoned:
                self.epoch = -1
                return
            try:
                if self.storage.create(self._path(self.epoch + 1), self._claim(released=True)):
                    self._prune(self.epoch + 1)
            except NotFound:
                pass
            self.epoch = -1

    def abandon(self) -> None:
        """The consumer (or its address) was deleted: stop renewing and write nothing, not
        even at release (on an object store a claim would recreate files under the deleted
        folder). Handles that still hold it find the consumer gone when they next write."""
        self._stop.set()
        with self._lock:
            self._abandoned = True

    # -- heartbeat ------------------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """Renew from a daemon thread every third of the lease, so that a micro-batch longer
        than the lease does not lose it. Runs in the driver-side reader process only."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, name="dq-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if self.before_beat is not None:
                    self.before_beat()  # may release this very lease: then renewals stop
                    if self._stop.is_set():
                        return
                self.renew()
            except ConsumerInUseError:
                return  # recorded; the next latestOffset/commit raises it
            except NotFound:
                log.info("consumer %s: its lease folder is gone (the consumer or the address "
                         "was deleted); renewals stop", self.consumer)
                return
            except Exception as exc:
                # once per run of failures (a store that went away would log every beat)
                (log.debug if self.failing else log.warning)(
                    "consumer %s: lease renewal failed: %s", self.consumer, exc)
                self.failing = True
            else:
                self.failing = False


def live_claim(storage: Storage, folder: str, *, checksums: bool = False,
               now: float | None = None) -> dict[str, Any] | None:
    """The claim of a consumer's current holder (its newest epoch in ``folder``), ``None`` when
    nobody holds it: no claim, released, expired, or a process of this host that is gone.
    Two reads (the folder's listing, the claim); ``stats()`` reads a holder's ``status``."""
    probe = ConsumerLease(storage, folder, "", 0, checksums=checksums)
    try:
        _, claim = probe._newest()
    except NotFound:
        return None
    now = time.time() if now is None else now
    if not claim or claim.get("released") or float(claim.get("expires", 0)) <= now:
        return None
    if ConsumerLease._local(claim) and not _alive(claim["pid"], claim.get("pid_start")):
        return None
    return claim


class ProcessOwners:
    """The exclusive consumers this process owns: one lease per consumer, shared by every
    handle of it in the process, taken by the first handle's first ``receive`` and given up
    when the last handle closes, or when the process exits (a process killed on this host is
    seen dead at once by the next owner, see :meth:`ConsumerLease._free`).

    Concurrency guarantee: :meth:`take` and :meth:`give_back` of one key are serialised, so
    handles racing in two threads share one lease; a forked child owns nothing.
    """

    def __init__(self) -> None:
        # re-entrant, and finalizers only note keys (collected): the garbage collector runs
        # them in whatever thread allocates, this one included while it holds the lock
        self._lock = threading.RLock()
        self._held: dict[str, tuple[ConsumerLease, int]] = {}
        #: shares given back by collected handles, returned by the next call (see
        #: :meth:`collected`)
        self._dropped: collections.deque[str] = collections.deque()

    def collected(self, key: str) -> None:
        """A handle holding a share was garbage-collected. Called by its finalizer, which runs
        in whatever thread the collection happened in (fsspec's event loop thread too): so it
        only notes the key (``deque.append`` takes no lock); the next :meth:`take`,
        :meth:`give_back`, :meth:`release_all` or heartbeat gives the share back, so that an
        abandoned handle's lease goes within a third of ``consumerLeaseMs``."""
        self._dropped.append(key)

    def give_back_collected(self) -> bool:
        """Give back the shares of collected handles now (see :meth:`collected`); whether there
        were any. Called by a heartbeat, and by an acquire that finds this process's claim."""
        gave = False
        while True:
            try:
                key = self._dropped.popleft()
            except IndexError:
                return gave
            self._give_back_one(key)  # not give_back: one frame per key would recurse
            gave = True

    def take(self, key: str, make: Callable[[], ConsumerLease], wait_s: float) -> ConsumerLease:
        """The lease for ``key`` (a consumer's state path), acquired by this call or shared
        with the handles that hold it already; raises :class:`ConsumerInUseError` when another
        process holds it for longer than ``wait_s``."""
        with self._lock:
            held = self._held.get(key)
            if held is not None and held[0].held:
                self._held[key] = (held[0], held[1] + 1)
                return held[0]
            lease = make()
            lease.acquire(wait_s=wait_s)
            lease.before_beat = self.give_back_collected
            lease.start_heartbeat()
            held = self._held.get(key)
            # the handles of a lost lease still give their share back (close, collection):
            # they count towards the new one, or the first of them would release it
            self._held[key] = (lease, 1 + (0 if held is None else held[1]))
            return lease

    def lease_of(self, key: str) -> ConsumerLease | None:
        """The lease this process holds for ``key``, if any."""
        with self._lock:
            held = self._held.get(key)
        return None if held is None else held[0]

    def drop(self, key: str) -> None:
        """The consumer ``key`` was deleted: its lease goes without a word (a release, or a
        heartbeat, would write a claim into the folder just deleted, and at process exit
        into a store whose client is already closed); the handles' shares go with it."""
        with self._lock:
            held = self._held.pop(key, None)
        if held is not None:
            held[0].abandon()

    def give_back(self, key: str) -> None:
        """One handle is done with the lease; the last one releases it."""
        if self._dropped:
            self.give_back_collected()
        self._give_back_one(key)

    def _give_back_one(self, key: str) -> None:
        with self._lock:
            held = self._held.get(key)
            if held is None:
                return
            lease, count = held
            if count > 1:
                self._held[key] = (lease, count - 1)
                return
            del self._held[key]
        _release_quietly(lease)

    def release_all(self) -> None:
        """At process exit: every lease goes, so that the next owner starts at once."""
        self._dropped.clear()
        with self._lock:
            leases = [lease for lease, _ in self._held.values()]
            self._held.clear()
        for lease in leases:
            _release_quietly(lease)

    def forget_all(self) -> None:
        """In a forked child: the parent's leases are the parent's (their claims name its pid)."""
        self._lock = threading.RLock()
        self._held = {}
        self._dropped = collections.deque()


def _release_quietly(lease: ConsumerLease) -> None:
    if lease.failing:  # the claim expires by itself; a store that went away would hold us up
        lease._stop.set()
        return
    try:
        lease.release()
    except NotFound:
        pass  # the consumer or its address was deleted: nothing is left to release
    except Exception as exc:  # the claim then expires, or its dead pid frees it
        log.warning("consumer %s: could not release its lease: %s", lease.consumer, exc)


#: This process's exclusive consumers (see :class:`ProcessOwners`).
OWNERS = ProcessOwners()
atexit.register(OWNERS.release_all)
os.register_at_fork(after_in_child=OWNERS.forget_all)
