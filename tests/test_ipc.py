"""The Arrow IPC encoder of plain rows (``_format.ipc.BatchEncoder``,
``_format.schema.typed_stream``): its
bytes are Arrow's own, and it declines everything it does not write exactly as Arrow would."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_durable_queue._format.ipc import BatchEncoder, _Layout
from pyspark_durable_queue._format.schema import typed_stream, typed_table

SCHEMA = pa.schema([("i", pa.int64()), ("f", pa.float64()), ("s", pa.string()),
                    ("b", pa.binary()), ("t", pa.bool_())])

_VALUES = {
    "i": st.integers(min_value=-(2 ** 63), max_value=2 ** 63 - 1),
    "f": st.floats(allow_nan=True, allow_infinity=True),
    "s": st.text(max_size=40),
    "b": st.binary(max_size=40),
    "t": st.booleans(),
}
ROWS = st.lists(st.fixed_dictionaries({k: st.none() | v for k, v in _VALUES.items()}),
                min_size=1, max_size=70)


def arrows_stream(rows: list[dict], schema: pa.Schema = SCHEMA) -> bytes:
    """What the Arrow path stores for ``rows``: typed_table's batch through new_stream."""
    table = typed_table(rows, schema)
    assert table is not None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches():
            w.write_batch(batch)
    return sink.getvalue().to_pybytes()


@settings(max_examples=300, deadline=None)
@given(ROWS)
def test_rows_are_written_byte_for_byte_as_arrow_writes_them(rows):
    data = typed_stream(rows, SCHEMA)
    assert data == arrows_stream(rows)
    decoded = pa.ipc.open_stream(data).read_all()
    decoded.validate(full=True)
    for got, want in zip(decoded.to_pylist(), rows, strict=True):
        for name, value in want.items():
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(got[name])
            else:
                assert got[name] == value


@settings(max_examples=300, deadline=None)
@given(ROWS.map(lambda rows: rows[0]))
def test_a_single_row_is_written_byte_for_byte_as_arrow_writes_it(row):
    # one row (a single send) takes its own path, BatchEncoder.encode_one
    assert typed_stream([row], SCHEMA) == arrows_stream([row])


@pytest.mark.parametrize("row", [
    pytest.param({"i": 0, "f": 0.0, "s": "", "b": b"", "t": False}, id="empty-and-false"),
    pytest.param({"i": -1, "f": -0.0, "s": "é" * 3, "b": bytes(8), "t": True}, id="padded"),
    pytest.param({"i": None, "f": 1.5, "s": "a", "b": b"a", "t": True}, id="a-null"),
])
def test_the_one_row_path_is_the_batch_path(row):
    encoder = BatchEncoder(pa.struct(list(SCHEMA)))
    assert encoder.ok
    assert encoder.encode_one(row) == encoder.encode([row]) == arrows_stream([row])


@pytest.mark.parametrize("fields", [
    pytest.param([("i", pa.int64())], id="one-int"),
    pytest.param([("s", pa.string())], id="one-string"),
    pytest.param([("t", pa.bool_()), ("u", pa.bool_())], id="bools"),
    pytest.param([("b", pa.binary()), ("s", pa.string()), ("i", pa.int64())], id="mixed"),
])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 65, 1000])
def test_every_row_count_and_bitmap_length_is_arrows(fields, n):
    schema = pa.schema(fields)
    samples = {pa.int64(): lambda k: k * 7919, pa.string(): lambda k: "é" * (k % 5),
               pa.binary(): lambda k: bytes(k % 3), pa.bool_(): lambda k: k % 3 == 0}
    for nulls_every in (0, 1, 2, 5):  # none, all, every other, some
        rows = [{name: None if nulls_every and k % nulls_every == 0 else samples[t](k)
                 for name, t in fields} for k in range(n)]
        assert typed_stream(rows, schema) == arrows_stream(rows, schema)


def test_field_metadata_is_in_the_schema_message_as_arrow_writes_it():
    schema = pa.schema([pa.field("x", pa.int64(), metadata={"unit": "ms"})],
                       metadata={"owner": "billing"})
    rows = [{"x": 5}]
    assert typed_stream(rows, schema) == arrows_stream(rows, schema)


@pytest.mark.parametrize("row", [
    pytest.param({"i": True, "f": None, "s": None, "b": None, "t": None}, id="bool-for-int"),
    pytest.param({"i": 1.0, "f": None, "s": None, "b": None, "t": None}, id="float-for-int"),
    pytest.param({"i": None, "f": 1, "s": None, "b": None, "t": None}, id="int-for-float"),
    pytest.param({"i": None, "f": None, "s": b"x", "b": None, "t": None}, id="bytes-for-str"),
    pytest.param({"i": None, "f": None, "s": None, "b": "x", "t": None}, id="str-for-bytes"),
    pytest.param({"i": None, "f": None, "s": None, "b": None, "t": 1}, id="int-for-bool"),
    pytest.param({"i": 2 ** 63, "f": None, "s": None, "b": None, "t": None}, id="int-too-big"),
    pytest.param({"i": None, "f": None, "s": "\ud800", "b": None, "t": None},
                 id="lone-surrogate"),
    pytest.param({"i": None, "f": None, "s": None, "b": None}, id="missing-column"),
    pytest.param({"i": None, "f": None, "s": None, "b": None, "t": None, "x": 1},
                 id="extra-column"),
    pytest.param({"i": None, "f": None, "s": None, "b": None, "u": None}, id="other-column"),
])
def test_what_it_does_not_write_exactly_as_arrow_would_is_left_to_arrow(row):
    # the caller then converts with Arrow, which gives the usual result or the usual error
    assert typed_stream([{"i": 1, "f": 1.0, "s": "a", "b": b"a", "t": True}, row],
                        SCHEMA) is None
    assert typed_stream([row], SCHEMA) is None  # alone: the one-row path


def test_dict_subclasses_are_left_to_arrow():
    class Row(dict):
        pass

    assert typed_stream([Row(i=1, f=1.0, s="a", b=b"a", t=True)], SCHEMA) is None
    assert typed_stream([Row(i=1, f=1.0, s="a", b=b"a", t=True)] * 2, SCHEMA) is None


@pytest.mark.parametrize("field", [
    pytest.param(pa.field("x", pa.int32()), id="int32"),
    pytest.param(pa.field("x", pa.timestamp("us")), id="timestamp"),
    pytest.param(pa.field("x", pa.list_(pa.int64())), id="list"),
    pytest.param(pa.field("x", pa.int64(), nullable=False), id="not-nullable"),
])
def test_an_encoder_is_off_for_columns_it_does_not_write(field):
    assert not BatchEncoder(pa.struct([pa.field("i", pa.int64()), field])).ok
    assert typed_stream([{"i": 1, "x": None}], pa.schema([pa.field("i", pa.int64()), field])) \
        is None


def test_the_layout_reader_refuses_what_is_not_a_plain_record_batch_message():
    with pytest.raises(ValueError, match="record batch"):
        _Layout(SCHEMA.serialize().to_pybytes())  # a schema message
    with pytest.raises(ValueError, match="continuation"):
        _Layout(b"\x00" * 16)


def test_an_encoder_that_disagrees_with_arrow_when_made_stays_off(monkeypatch):
    # Another Arrow version could lay batches out otherwise: the encoder checks its own
    # output against Arrow's once, when it is made, and stays off if they differ.
    import pyspark_durable_queue._format.ipc as ipc

    monkeypatch.setattr(ipc, "_ZEROS", b"\x01" * 8)  # wrong padding: a different body
    assert not BatchEncoder(pa.struct([pa.field("t", pa.bool_())])).ok  # 1 byte + 7 of padding


def test_an_encoder_whose_nulls_disagree_with_arrow_when_made_stays_off(monkeypatch):
    # The check when made covers a row of nulls too: a row without nulls writes no validity
    # bitmap, so an Arrow that lays nulls out otherwise would not be noticed by it.
    import pyspark_durable_queue._format.ipc as ipc

    real = ipc._bits
    monkeypatch.setattr(ipc, "_bits", lambda flags, n: bytes(len(real(flags, n))))  # all 0
    assert not BatchEncoder(pa.struct([pa.field("i", pa.int64())])).ok
