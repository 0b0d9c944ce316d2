"""``python -m selfattention.fuzz --seconds N``."""

import sys

from . import main

sys.exit(main())
