"""Job entry for a Ray cluster: `ray job submit -- python -m moe_runtime.deploy --model DIR ...`.

Same arguments as `moe-runtime generate`; the driver joins the cluster the job runs on
(RAY_ADDRESS, set by `ray job submit`, else "auto": a cluster started on this machine with
`ray start`) instead of starting Ray embedded, and places one RankWorker actor per GPU (per CPU
slot on a CPU-only cluster). The checkpoint directory must be readable at the same path on
every node (shared storage, or copied beforehand).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

PROG = "python -m moe_runtime.deploy"


def build_parser() -> argparse.ArgumentParser:
    """generate's arguments under this entry's name, its --ray-address default described."""
    from .cli import DefaultsHelp, add_generate_args
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelp)
    add_generate_args(parser, ray_address_help=(
        'join this Ray cluster ("auto" or host:port); default: $RAY_ADDRESS (set by `ray job '
        'submit`), else "auto" (a cluster started on this machine with `ray start`)'))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .cli import main as cli_main
    args = list(sys.argv[1:] if argv is None else argv)
    if "--ray-address" not in args and not any(a in ("-h", "--help") for a in args):
        args = ["--ray-address", os.environ.get("RAY_ADDRESS") or "auto"] + args  # ("": unset)
    return cli_main(args, build_parser())


if __name__ == "__main__":
    from .cli import exit_with
    exit_with(main())
