"""``python -m forebay.cli``: the ``forebay`` command."""

import sys

from . import main

sys.exit(main())
