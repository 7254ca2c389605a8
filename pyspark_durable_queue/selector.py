"""Jakarta Messaging message selectors, evaluated column-wise on Arrow data.

A selector (JMS 2.0 section 3.8) such as ``color = 'red' AND amount > 100`` is parsed once into
a small AST, then

- compiled per schema into Arrow compute calls: a :class:`pyarrow.compute.Expression` for
  dataset scans and :meth:`pyarrow.Table.filter`, and the same calls run eagerly on a batch by
  :meth:`Selector.mask` (no ``eval``, no Python per row);
- interpreted abstractly over page statistics (see :mod:`pyspark_durable_queue._format.stats`) by
  :meth:`Selector.may_match`, which lets a consumer skip pages that cannot match instead of
  reading them. This is what avoids the stall Artemis documents for a restrictive selector
  behind a long run of non-matching messages.

Semantics
---------
Three-valued logic as in SQL-92: comparisons involving NULL are UNKNOWN, ``AND``/``OR``/``NOT``
follow Kleene's tables, and a row is selected only when the selector is TRUE.

- An identifier names a top-level column (``_seq`` and ``_timestamp`` included); identifiers are
  case-sensitive, keywords are not. An identifier that is not a column is NULL, as an absent
  message property is in JMS (:meth:`Selector.unknown_identifiers` lists them for a warning).
- Column values: integers (any width) are exact numerics, floats and decimals are approximate
  numerics (``float64``), timestamps are epoch milliseconds and dates epoch days (both exact),
  strings and booleans are themselves. Other types (binary, nested, time...) can only be tested
  with ``IS [NOT] NULL``; any other use is UNKNOWN.
- Comparing values of different kinds (string with number, boolean with string...) is UNKNOWN,
  not an error. Exact and approximate numerics compare as ``float64``.
- Strings and booleans support only ``=`` and ``<>``, as JMS requires; ``<``, ``>`` etc. on them
  are UNKNOWN (so never selected), which matches Artemis rather than inventing an ordering.
- Arithmetic: exact op exact is exact ``int64`` (wrapping on overflow, as Java ``long``;
  ``/`` truncates toward zero); any approximate operand makes it ``float64``. Division by zero
  is NULL rather than an error or an infinity. Arithmetic on non-numbers is NULL.
- ``x [NOT] BETWEEN a AND b`` means ``x >= a AND x <= b`` (``x < a OR x > b``), as the
  specification defines it; NaN is therefore in neither.
- ``x [NOT] IN (...)`` takes string literals as in JMS or, as an extension, numeric literals (not
  both). NULL ``x`` gives UNKNOWN.
- ``LIKE``: ``_`` is one character, ``%`` any sequence. With ``ESCAPE 'c'``, ``c`` followed by
  ``_``, ``%`` or ``c`` stands for that character literally; anywhere else (the end of the
  pattern included) ``c`` is an ordinary pattern character, a wildcard if it is ``_`` or ``%``.
  So ``'_D__' ESCAPE '_'`` matches ``xD_`` and ``'a!b!' ESCAPE '!'`` matches ``a!b!``, as in
  ActiveMQ and Artemis.
- An identifier on its own is a condition only when it is a boolean column; otherwise UNKNOWN.

Not supported (syntax errors): hexadecimal/octal literals and ``L``/``F``/``D`` suffixes, which
are Artemis extensions rather than JMS.

Implementation
--------------
This module re-exports the public :class:`Selector` (defined in :mod:`._selector.compiled`) and
:func:`parse`. The work is split along the three stages above so each can be read and tested
alone: :mod:`._selector.parse` (tokens, AST, syntax errors), :mod:`._selector.arrow` (AST to
Arrow compute calls) and :mod:`._selector.stats` (``may_match`` over page statistics). None of
them imports pyspark.
"""

from __future__ import annotations

from ._selector.compiled import Selector

# The AST node classes stay importable from here, where they lived before the split, for callers
# that inspect what parse() returns (the tests' reference interpreter). The redundant aliases
# mark them as deliberate re-exports; they remain outside __all__ as before.
from ._selector.parse import Between as Between
from ._selector.parse import Binary as Binary
from ._selector.parse import Ident as Ident
from ._selector.parse import In as In
from ._selector.parse import IsNull as IsNull
from ._selector.parse import Like as Like
from ._selector.parse import Lit as Lit
from ._selector.parse import Unary as Unary
from ._selector.parse import parse

__all__ = ["Selector", "parse"]
