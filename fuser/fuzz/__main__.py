"""``python -m fuser.fuzz``: see :mod:`fuser.fuzz.cli`."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
