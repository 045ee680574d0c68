"""``python -m prefixq`` = the ``prefixq`` command."""

import sys

from prefixq.cli import main

if __name__ == "__main__":
    sys.exit(main())
