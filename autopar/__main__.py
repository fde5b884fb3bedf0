"""``python -m autopar ...``: the same command line as the ``autopar`` console script."""

import sys

from autopar.cli import main

if __name__ == "__main__":
    sys.exit(main())
