"""`python -m kvledger ...` = `kvledger ...` (how `kvledger up` starts its processes)."""

import sys

from kvledger.cli import main

sys.exit(main())
