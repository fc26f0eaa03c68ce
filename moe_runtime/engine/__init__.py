"""Serving engine: the Ray driver (`Engine`), RankWorker actors, request scheduler, KV cache and
sampler. See driver.py for the life cycle and failure handling."""
from .driver import Completion, Engine, GenerationResult, RankError, choose_topology
from .sampler import SamplingParams

__all__ = ["Completion", "Engine", "GenerationResult", "RankError", "SamplingParams", "choose_topology"]
