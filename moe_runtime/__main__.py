"""`python -m moe_runtime ...`: the `moe-runtime` command line (moe_runtime.cli)."""
import sys

from .cli import main

sys.exit(main())
