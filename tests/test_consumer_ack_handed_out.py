"""What ``ack`` settles: the rows this handle handed out, never rows it has not.

A consumer opened again hands out first the nacked rows its window kept above its watermark
(as they come due), then, from the watermark, the rows it had delivered and nobody
acknowledged. ``ack()`` must settle the first ones too (they were handed out, above the
cursor), and acknowledging one of them (``ack()``, ``ack(table)``, ``ack(_seq)``, the
``messages()`` loop) must settle it alone, never the rows below it that the handle has not
delivered again (those were never acknowledged: settling them would lose them). A row nacked
and not delivered again (its delay has not passed) is never settled by an ``ack``.

On a journal address and a file address (``journal=False``) on the local disk. What is
durable is read by a new ``DurableQueue`` (a crash as far as this process can make one: the
handle that acknowledged is never closed), never from the consumer that wrote it.
"""

from __future__ import annotations

import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._ops import window as window_file
from pyspark_durable_queue._ops.window import DeliveryWindow
from pyspark_durable_queue.errors import InvalidOptionError

LATER_MS = 600_000  # a delay no test waits for


@pytest.fixture(params=[True, False], ids=["journal", "file"])
def root(request, tmp_path):
    root = str(tmp_path / "dq")
    DurableQueue(root).address("jobs", journal=request.param)
    return root


def seqs(table):
    return table.column("_seq").to_pylist()


def address(root):
    return DurableQueue(root).address("jobs")


def reopened_with_row_kept(root, n=3, nacked=2, acked=0, later=()):
    """``n`` rows sent and received, ``nacked`` given back (due at once), the rows of
    ``later`` given back for ten minutes, ``acked`` acknowledged; the consumer closed and
    opened again: at its watermark (``acked + 1``), its window keeping ``nacked`` above it."""
    a = address(root)
    a.send([{"id": i} for i in range(n)])
    c = a.consumer("w")
    assert seqs(c.receive(n)) == list(range(n))
    c.nack(nacked, delay_ms=0)
    for s in later:
        c.nack(s, delay_ms=LATER_MS)
    c.ack(acked)
    c.close()
    return a.consumer("w")


def after_a_crash(root):
    """What a new handle delivers (everything available, until an empty receive), and its
    delivery counts: only what was written."""
    c = address(root).consumer("w")
    got = []
    while True:
        t = c.receive(100)
        if not t.num_rows:
            break
        got += zip(seqs(t), t.column("_delivery_count").to_pylist(), strict=True)
    c.close()
    return got


def on_disk(root):
    """``(position, ack_point, redelivery_pending)`` as a new handle's stats read them."""
    row = address(root).stats()["consumers"]["w"]
    return row["position"], row["ack_point"], row["redelivery_pending"]


def test_ack_settles_the_row_delivered_again_after_a_reopen(root):
    c = reopened_with_row_kept(root)
    t = c.receive()
    assert (seqs(t), c.cursor) == ([2], 1)  # the row the window kept comes first
    c.ack()
    # row 2 is settled on its own; row 1 was delivered before the reopen and never
    # acknowledged: it holds the watermark, and comes again (once)
    assert c.position == 1
    assert on_disk(root) == (1, 1, 0)
    assert after_a_crash(root) == [(1, 1)]


@pytest.mark.parametrize("how", ["table", "seq", "message"])
def test_acknowledging_the_row_delivered_again_never_settles_the_rows_below_it(root, how):
    c = reopened_with_row_kept(root)
    if how == "message":  # the loop messages() documents
        msg = next(c.messages(timeout_ms=0))
        c.ack(msg["_seq"])
    else:
        t = c.receive()
        assert seqs(t) == [2]
        c.ack(t if how == "table" else 2)
    assert (c.position, c.cursor) == (1, 1)
    assert on_disk(root) == (1, 1, 0)
    # row 1 was never acknowledged: lost if the ack of row 2 had settled it
    assert after_a_crash(root) == [(1, 1)]


def test_the_rows_below_are_delivered_after_and_ack_settles_them_all(root):
    c = reopened_with_row_kept(root, n=6, nacked=3, acked=1)
    assert seqs(c.receive()) == [3]
    assert seqs(c.receive()) == [2, 4, 5]  # again from the watermark, without row 3
    c.ack()
    assert (c.position, c.cursor) == (6, 6)
    assert on_disk(root) == (6, 6, 0)
    assert after_a_crash(root) == []


def test_a_row_delivered_again_among_fresh_rows_is_settled_with_them(root):
    c = reopened_with_row_kept(root, n=6, nacked=3, acked=1)
    first = c.receive()
    c.ack(first)  # row 3 alone
    assert on_disk(root) == (2, 2, 0)
    assert seqs(c.receive(1)) == [2]
    c.ack()
    # rows 2 and 3 settled: the ack point passes both
    assert (c.position, c.cursor) == (4, 4)
    assert on_disk(root) == (4, 4, 0)
    assert after_a_crash(root) == [(4, 1), (5, 1)]


def test_ack_never_settles_a_row_nacked_with_a_delay_not_passed(root):
    c = reopened_with_row_kept(root, n=4, nacked=2, acked=0, later=[3])
    assert seqs(c.receive()) == [2]
    c.ack()
    assert on_disk(root) == (1, 1, 1)  # row 3 waits
    assert seqs(c.receive()) == [1]  # the cursor passes row 3, which is not due
    assert c.cursor == 4
    c.ack()
    assert c.position == 3
    assert on_disk(root) == (3, 4, 1)
    assert after_a_crash(root) == []  # row 3 comes back only when due
    window = address(root).registry.load_window("w")
    assert set(window["pending"]) == {3}


def test_ack_of_a_row_nacked_again_after_a_reopen_settles_nothing_above_the_cursor(root):
    c = reopened_with_row_kept(root)
    t = c.receive()
    c.nack(t, delay_ms=LATER_MS)  # given back again: not handed out any more
    c.ack(t)
    assert (c.position, c.cursor) == (1, 1)
    assert on_disk(root) == (1, 1, 1)
    assert after_a_crash(root) == [(1, 1)]


def test_without_a_reopen_ack_settles_a_row_delivered_again(root):
    a = address(root)
    a.send([{"id": i} for i in range(4)])
    c = a.consumer("w")
    c.receive(4)
    c.nack(1, delay_ms=0)
    c.nack(2, delay_ms=LATER_MS)
    assert seqs(c.receive()) == [1]
    c.ack()
    assert c.position == 2
    assert on_disk(root) == (2, 4, 1)


def test_a_row_settled_on_its_own_cannot_be_nacked(root):
    c = reopened_with_row_kept(root)
    c.receive()
    c.ack()
    with pytest.raises(InvalidOptionError, match=r"_seq 2 .* settled already"):
        c.nack(2)
    reopened = address(root).consumer("w2")  # another consumer: untouched
    assert seqs(reopened.receive()) == [0, 1, 2]
    reopened.close()


def test_a_window_with_a_row_settled_alone_round_trips_without_dead_letters():
    """The window file keeps a row settled on its own (its JSON tail, which only dead
    letters wrote before), and the ack point passes it once it reaches it."""
    window = DeliveryWindow(1, {2: (1, 0)})
    window.hand_out([2])
    assert window.settle_out([2]) and window.settled == {2}
    assert not window.settle_out([2])  # settled once
    restored = DeliveryWindow.restore(1, window_file.decode(window_file.encode(
        window.record(1))))
    assert (restored.ack_point, restored.pending_count(), restored.settled) == (1, 0, {2})
    assert restored.settle(2) and (restored.ack_point, restored.settled) == (3, set())


def test_ack_of_a_seq_not_handed_out_again_skips_as_before(root):
    """Only rows this handle handed out again hold an ack at the cursor: ``ack(_seq)`` of a
    row it has not delivered (as the Spark source acknowledges) reads on after it, as
    documented."""
    c = reopened_with_row_kept(root, n=4, nacked=2, acked=0)
    c.ack(3)  # nothing received: read on after _seq 3 (row 2 waits: it was nacked)
    assert (c.position, c.cursor) == (2, 4)
    assert seqs(c.receive()) == [2]
    c.ack()
    assert on_disk(root) == (4, 4, 0)
