"""``python -m ccoll``: the ``ccoll`` command (see ccoll/cli.py)."""

import sys

from ccoll.cli import main

sys.exit(main())
