"""Job entry for a Ray cluster: `ray job submit -- python -m moe_runtime.deploy --model DIR ...`.

Same arguments as `moe-runtime generate`; the driver joins the cluster the job runs on
(RAY_ADDRESS, set by `ray job submit`, else "auto") instead of starting Ray embedded, and places
one RankWorker actor per GPU (per CPU slot on a CPU-only cluster). The checkpoint directory must
be readable at the same path on every node (shared storage, or copied beforehand).
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .cli import main as cli_main
    args = list(sys.argv[1:] if argv is None else argv)
    if "--ray-address" not in args:
        args = ["--ray-address", os.environ.get("RAY_ADDRESS", "auto")] + args
    return cli_main(["generate"] + args)


if __name__ == "__main__":
    sys.exit(main())
