"""``python -m pyspark_durable_queue.cli``: the ``durablequeue`` command line (see :mod:`.`)."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
