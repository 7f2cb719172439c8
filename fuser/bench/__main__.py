"""``python -m fuser.bench``: see :mod:`fuser.bench.cli`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
