"""The entry point of the Python client: a store root holding addresses."""

from __future__ import annotations

from typing import Any

from ._storage import open_storage
from .address import Address
from .errors import AddressNotFoundError, LinkRefusedError
from .settings import validate_name

__all__ = ["DurableQueue"]


class DurableQueue:
    """A durable message store under a root folder: a local path (the embedded default) or any
    fsspec URL (``s3://bucket/dq``, ``gs://...``, ``abfs://...``, ``/Volumes/...``,
    ``memory://...``).

    Parameters
    ----------
    root : str
        Where the store lives; created on first write.
    storage_options : dict, optional
        fsspec options (credentials, endpoint, ...).

    Examples
    --------
    >>> q = DurableQueue("/tmp/dq")                                  # doctest: +SKIP
    >>> orders = q.address("orders", address_full_policy="BLOCK")    # doctest: +SKIP
    >>> orders.send([{"region": "EU", "amount": 120}])               # doctest: +SKIP
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.storage = open_storage(str(root), storage_options)

    def __repr__(self) -> str:
        return f"DurableQueue({self.storage.url!r})"

    def address(self, name: str, *, create: bool = True, **settings: Any) -> Address:
        """Open the address ``name``, creating it (with ``settings``) if it does not exist.

        Settings are the Spark options in snake_case: ``page_size_bytes``, ``max_size_bytes``,
        ``max_size_messages``, ``address_full_policy``, ``block_timeout_ms``, ``compression``,
        ``fsync``, ``archive_data_logs``, ``directory_archive``, ``cleanup_interval_ms``,
        ``orphan_grace_ms``, ``page_max_cache_size``.
        """
        return Address.open(self.storage, name, create=create, **settings)

    def addresses(self) -> list[str]:
        """Names of the addresses in the store (a symbolic link under the root is not one:
        opening it is refused, see :class:`~pyspark_durable_queue.errors.LinkRefusedError`)."""
        names = []
        for name in sorted(self.storage.list(self.storage.root)):
            if name.startswith((".", "_")):
                continue
            try:
                if self.storage.exists(self.storage.join(name, "address.json")):
                    names.append(name)
            except LinkRefusedError:
                continue
        return names

    def delete_address(self, name: str) -> None:
        """Remove an address with all its messages and consumers."""
        validate_name(name)
        folder = self.storage.join(name)
        if not self.storage.exists(f"{folder}/address.json"):
            raise AddressNotFoundError(f"address {name!r} does not exist under "
                                       f"{self.storage.url}")
        self.storage.delete_tree(folder)
