"""``python -m kvoffload``: the ``kvoffload`` command line (the same as the installed script)."""

from __future__ import annotations

import sys

from kvoffload._cli import main

if __name__ == "__main__":
    sys.exit(main())
