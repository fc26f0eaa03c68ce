"""`python -m moe_runtime ...`: the `moe-runtime` command line (moe_runtime.cli)."""
from .cli import run

run()
