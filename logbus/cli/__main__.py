"""``python -m logbus.cli``: the ``logbus`` command."""

import sys

from logbus.cli.parser import main

sys.exit(main())
