"""``python -m autopar.cli ...``: the same as ``python -m autopar ...`` (as the old ``autopar/cli.py`` allowed)."""

import sys

from autopar.cli import main

if __name__ == "__main__":
    sys.exit(main())
