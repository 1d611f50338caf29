"""``python -m cli``: the ``flywheel`` command without its console script."""

import sys

from cli.main import main

sys.exit(main())
