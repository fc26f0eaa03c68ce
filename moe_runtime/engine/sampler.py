"""Sampling: greedy, or temperature + top-p (nucleus) with one seeded generator per request."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_new_tokens: generate at most this many tokens per request (an int >= 1).
        temperature: 0 = greedy (argmax); > 0 divides the logits before the softmax.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (0 < p <= 1).
        seed: an int; request i (its position in the batch passed to generate) draws from a
            torch.Generator seeded with (seed, i). So the same seed and the same position draw
            the same random numbers whatever the other prompts of the batch contain, the world
            size or the topology; the same prompt at another position of the batch draws other
            samples. Unused when greedy. In float32 the completions are then the same too
            (tested). In bfloat16 / float16 they may not be: the logits of a prompt depend on
            the batch and the ranks (the matmuls round differently for other row counts, and
            `tp` sums partial results), so a near-tie between two tokens can go either way
            there, greedy included (as in HF transformers, which also differs from float32).
        stop_token_ids: stop a request when it samples one of these (included in its output);
            None = the model's EOS ids.

    Raises:
        TypeError: max_new_tokens or seed not an int (a bool or a float included).
        ValueError: out-of-range values.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """The construction checks (again): Engine.generate calls it before anything reaches the
        ranks, in case a field was changed after construction.

        Raises:
            TypeError, ValueError: as the constructor.
        """
        for name in ("max_new_tokens", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, int(value))  # e.g. numpy.int64 -> int
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also rejects nan
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def request_generators(seed: int, request_ids: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per request, seeded from (seed, global request index)."""
    gens = []
    for i in request_ids:
        g = torch.Generator()
        g.manual_seed((int(seed) * 1_000_003 + int(i)) % (2 ** 63))
        gens.append(g)
    return gens


def sample(logits: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: fp32 [B, V].
        params: temperature / top_p (greedy when temperature == 0).
        generators: B CPU generators (used only when sampling).

    Returns:
        int64 [B] token ids on the CPU. Greedy picks on the logits' device (only the ids come
        to the host); sampling runs on the CPU with the per-request CPU generators (the same
        draws whatever the device).
    """
    if params.temperature < torch.finfo(torch.float32).tiny or logits.shape[0] == 0:
        return logits.argmax(-1).cpu()  # (below fp32's smallest normal, x / T is 0 / 0 at the max)
    logits = logits.float().cpu()
    # shifted so that the largest is 0: a tiny temperature sends the others to -inf (greedy)
    # instead of overflowing every logit to +-inf (nan probabilities)
    shifted = logits - logits.max(-1, keepdim=True).values
    probs = torch.softmax(shifted / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p          # mass of the more likely tokens
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])
