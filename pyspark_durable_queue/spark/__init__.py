"""The Spark data source ``durablequeue`` (Python Data Source API, Spark 4.x).

This adapter is thin: it translates Spark's calls into the store's (``Address``, ``Consumer``,
the page writer, and the read surface ``_read``); all the logic lives in modules that never
import pyspark. Writers live in ``_sink``; the streaming reader in ``_source``, the batch reader
in ``_batch``, what both share in ``_reader``.

Spark finds this class by itself after ``pip install``: it imports every top-level module named
``pyspark_*`` and registers its ``DefaultSource`` under ``DefaultSource.name()``. On Databricks,
register it explicitly: ``spark.dataSource.register(DurableQueueDataSource)``.
"""

from __future__ import annotations

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

__all__ = ["DurableQueueDataSource"]


class DurableQueueDataSource(DataSource):
    """``format("durablequeue")``: a durable message queue in files.

    Options are documented in the README (and validated when a query starts): ``address``,
    ``consumer``, ``selector``, ``startingPosition``, admission control, address settings.
    """

    @classmethod
    def name(cls) -> str:
        return "durablequeue"

    def schema(self) -> StructType | str:
        """Called on the driver when a read is planned: the address's schema plus ``_seq`` and
        ``_timestamp``."""
        from ._reader import read_schema

        return read_schema(self.options)

    def reader(self, schema: StructType) -> DataSourceReader:
        from ._batch import DurableQueueBatchReader

        return DurableQueueBatchReader(self.options, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from ._source import DurableQueueStreamReader

        return DurableQueueStreamReader(self.options, schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from ._sink import DurableQueueBatchWriter

        return DurableQueueBatchWriter(self.options, schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from ._sink import DurableQueueStreamWriter

        return DurableQueueStreamWriter(self.options, schema, overwrite)
