"""The operations of an address (commit, cleanup, compaction, sealing) share one context."""

from __future__ import annotations

import pickle

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._ops.context import AddressContext


def _operations(a):
    return [a._committer, a._cleaner, a._compactor, a._sealer(), a._scheduler()]


def test_an_addresss_operations_are_built_on_one_context_of_its_own_parts(tmp_path):
    a = DurableQueue(str(tmp_path)).address("orders", max_size_messages=10)
    ctx = a._context
    assert isinstance(ctx, AddressContext)
    assert all(op.ctx is ctx for op in _operations(a))
    # the handle's own objects, not copies
    assert (ctx.name, ctx.storage, ctx.layout, ctx.log, ctx.consumers, ctx.settings) == (
        "orders", a.storage, a.layout, a.log, a.registry, a.settings)
    assert ctx.log is a.log and ctx.storage is a.storage and ctx.consumers is a.registry
    assert a._committer.settings.max_size_messages == 10


def test_new_settings_reach_every_operation_and_keep_the_cleanup_clock(tmp_path):
    a = DurableQueue(str(tmp_path)).address("orders", max_size_messages=10)
    a._cleaner.last = 123.0
    a.settings = a.settings.replace(max_size_messages=20)
    assert all(op.ctx is a._context for op in _operations(a))
    assert {op.settings.max_size_messages for op in _operations(a)} == {20}
    assert a._cleaner.last == 123.0


def test_an_unpickled_address_builds_its_context_on_its_own_log(tmp_path):
    a = DurableQueue(str(tmp_path)).address("orders")
    a.send([{"x": 1}])
    b = pickle.loads(pickle.dumps(a))
    assert b._context.log is b.log and b.log is not a.log
    assert all(op.ctx is b._context for op in _operations(b))
    assert b.send([{"x": 2}]).seq == 1
    assert b._scheduler().clock is b._clock  # the process's clock of the address
