"""The Artemis stall scenario: a restrictive selector behind a million non-matching messages.

Artemis documents that a consumer with ``color = 'red'`` cannot get the one red message sent
after a million blue ones until the blue ones are consumed. Here page statistics (value sets)
let the consumer skip the blue pages without reading them; inside a page, frame statistics let
it fetch only the frames that can match.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pyspark_durable_queue import DurableQueue
from pyspark_durable_queue._read.cache import page_cache

pytestmark = pytest.mark.slow

N_BLUE = 1_000_000


def blue(n: int, start: int = 0) -> pa.Table:
    return pa.table({
        "id": pa.array(np.arange(start, start + n, dtype=np.int64)),
        "color": pa.array(["blue"] * n),
        "amount": pa.array(np.arange(n, dtype=np.float64) % 997),
    })


def red(i: int) -> pa.Table:
    return pa.table({"id": pa.array([i], pa.int64()), "color": ["red"],
                     "amount": pa.array([1.0])})


@pytest.fixture
def reads():
    cache = page_cache()
    cache.clear()
    before = cache.stats()["bytes_read"]
    return lambda: cache.stats()["bytes_read"] - before


def test_red_after_a_million_blue_reads_under_one_percent(tmp_path, reads):
    a = DurableQueue(str(tmp_path)).address("colors", page_size_bytes=1 << 20)
    for start in range(0, N_BLUE, 100_000):
        a.send(blue(100_000, start))
    a.send(red(N_BLUE))
    blue_bytes = a.stats()["bytes"]
    assert a.stats()["pages"] > 10

    c = a.consumer("reds", selector="color = 'red'")
    got = c.receive(max_messages=10)
    assert got.column("id").to_pylist() == [N_BLUE]
    assert got.column("_seq").to_pylist() == [N_BLUE]
    assert reads() <= 0.01 * blue_bytes, (reads(), blue_bytes)

    # acknowledging moves the watermark past every blue message, so cleanup may free them
    c.ack(got)
    assert c.position == N_BLUE + 1
    assert c.receive().num_rows == 0


def test_red_inside_a_blue_page_reads_only_its_frame(tmp_path, reads):
    # one send, one big page: the red message sits in the last frame of a page of blues
    a = DurableQueue(str(tmp_path)).address("mixed", page_size_bytes=64 << 20)
    a.send(pa.concat_tables([blue(N_BLUE), red(N_BLUE)]))
    page_bytes = a.stats()["bytes"]
    assert a.stats()["pages"] == 1

    c = a.consumer("reds", selector="color = 'red' AND amount < 5")
    got = c.receive()
    assert got.column("id").to_pylist() == [N_BLUE]
    # the footer and the one frame holding the red message (frames are about 1 MiB)
    assert reads() <= (1 << 20) + 64 * 1024 + 0.05 * page_bytes, (reads(), page_bytes)
    assert reads() < 0.2 * page_bytes


def test_blue_consumer_is_not_affected(tmp_path, reads):
    a = DurableQueue(str(tmp_path)).address("colors", page_size_bytes=1 << 20)
    a.send(blue(200_000))
    a.send(red(200_000))
    c = a.consumer("blues", selector="color = 'blue' AND id >= 199990")
    got = []
    while (batch := c.receive(max_messages=100_000)).num_rows:
        got += batch.column("id").to_pylist()
        c.ack(batch)
    assert got == list(range(199_990, 200_000))
    assert c.position == 200_001


def test_selector_sees_a_column_added_after_the_consumer_compiled_it(tmp_path):
    a = DurableQueue(str(tmp_path)).address("grow")
    a.send([{"id": i} for i in range(10)])
    c = a.consumer("late", selector="flag = 'yes'")
    assert c.receive().num_rows == 0  # 'flag' is not a column yet: NULL, nothing selected
    c.ack()
    a.send([{"id": 10, "flag": "yes"}, {"id": 11, "flag": "no"}], merge_schema=True)
    assert c.receive().column("id").to_pylist() == [10]
