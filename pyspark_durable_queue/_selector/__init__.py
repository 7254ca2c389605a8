"""Message selectors (Jakarta Messaging, JMS 2.0 section 3.8): three stages and the class over them.

- :mod:`.parse`: tokens, the AST, syntax errors (needs neither pyarrow nor pyspark);
- :mod:`.arrow`: the AST compiled per schema into Arrow compute calls (``Selector.mask``);
- :mod:`.stats`: the AST judged against page statistics (``Selector.may_match``);
- :mod:`.compiled`: :class:`Selector`, which the public :mod:`pyspark_durable_queue.selector`
  re-exports with the language's documentation.

Below the on-disk formats (``_format.schema`` compiles a selector against an address schema),
above nothing but the leaf helpers (``_bounded``, ``errors``). Surface: :class:`Selector`,
:func:`parse`.
"""

from .compiled import Selector
from .parse import parse

__all__ = ["Selector", "parse"]
