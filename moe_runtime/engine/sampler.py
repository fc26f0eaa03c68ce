"""Sampling: greedy, or temperature + top-k + top-p (nucleus) with one seeded generator per request."""
from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_new_tokens: generate at most this many tokens per request (an int >= 1).
        temperature: 0 = greedy (argmax); > 0 divides the logits before the softmax.
        top_k: keep the top_k most likely tokens (an int >= 1; None = all), before top_p.
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
            a sequence of ints, None = the model's EOS ids.

    Raises:
        TypeError: max_new_tokens, seed, top_k or a stop token id not an int (a bool or a
            float included), temperature / top_p not a real number, stop_token_ids a string
            or not a sequence.
        ValueError: out-of-range values.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: Optional[tuple[int, ...]] = None
    top_k: Optional[int] = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """The construction checks (again): Engine.generate calls it before anything reaches the
        ranks, in case a field was changed after construction.

        Raises:
            TypeError, ValueError: as the constructor.
        """
        for name in ("max_new_tokens", "seed") + (("top_k",) if self.top_k is not None else ()):
            object.__setattr__(self, name, as_int(name, getattr(self, name)))
        for name in ("temperature", "top_p"):
            object.__setattr__(self, name, as_real(name, getattr(self, name)))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also rejects nan
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise TypeError(f"stop_token_ids must be a sequence of ints or None, got "
                                f"{type(ids).__name__} {ids!r}")
            object.__setattr__(self, "stop_token_ids",
                               tuple(as_int("a stop token id", t) for t in ids))


def as_int(name: str, value) -> int:
    """value as an int (numpy integers and one-element integer tensors included). Raises
    TypeError for a bool, a float or anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not (
            value.dtype == torch.bool or value.is_floating_point() or value.is_complex()):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def as_real(name: str, value) -> float:
    """value as a float (ints, numpy numbers and one-element real tensors included). Raises
    TypeError for a bool, a string or anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not (
            value.dtype == torch.bool or value.is_complex()):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def request_generators(seed: int, request_ids: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per request, seeded with a 64-bit BLAKE2b hash of (seed, global
    request index): distinct pairs get distinct streams (any int seed, no wrap-around)."""
    gens = []
    for i in request_ids:
        g = torch.Generator()
        digest = hashlib.blake2b(f"{int(seed)}:{int(i)}".encode(), digest_size=8).digest()
        g.manual_seed(int.from_bytes(digest, "little"))
        gens.append(g)
    return gens


def sample(logits: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: fp32 [B, V].
        params: temperature / top_k / top_p (greedy when temperature == 0).
        generators: B CPU generators (used only when sampling).

    Returns:
        int64 [B] token ids on the CPU. Greedy picks on the logits' device (only the ids come
        to the host); sampling runs on the CPU with the per-request CPU generators (the same
        draws whatever the device).

    Raises:
        ValueError: a row's largest logit is not finite (the row holds NaN or +inf, or no
            finite value: non-finite weights or activations), greedy or not (argmax would
            pick an arbitrary token there, torch.multinomial fail naming no cause).
    """
    if logits.shape[0] == 0:
        return logits.argmax(-1).cpu()
    top, ids = logits.max(-1)  # (NaN anywhere in a row makes its max NaN; first index of ties)
    if params.temperature < torch.finfo(torch.float32).tiny:  # (x / T is 0 / 0 at the max)
        ids = torch.where(top.isfinite(), ids, -1).cpu()  # (one transfer: the ids, -1 if bad)
        _check_finite(ids >= 0)
        return ids
    logits, top = logits.float().cpu(), top.float().cpu()
    _check_finite(top.isfinite())
    # shifted so that the largest is 0: a tiny temperature sends the others to -inf (greedy)
    # instead of overflowing every logit to +-inf (nan probabilities)
    shifted = logits - top[:, None]
    if params.top_k is not None and params.top_k < shifted.shape[-1]:
        kth = shifted.topk(params.top_k, dim=-1).values[:, -1:]
        shifted = shifted.masked_fill(shifted < kth, float("-inf"))  # (ties at the k-th kept)
    # (a temperature above fp32's largest would round to inf, and -inf / inf is nan)
    probs = torch.softmax(shifted / min(params.temperature, torch.finfo(torch.float32).max), dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p          # mass of the more likely tokens
        drop = before >= params.top_p
        drop[:, 0] = False  # the most likely token always stays (a top_p below fp32's smallest
        sorted_p = sorted_p.masked_fill(drop, 0.0)  # value rounds to 0 there and dropped all)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


def _check_finite(ok: torch.Tensor) -> None:
    """ValueError naming the first row whose largest logit is not finite (ok: bool [B], CPU)."""
    if not bool(ok.all()):
        raise ValueError(f"sampling: the logits of row {int((~ok).nonzero()[0])} hold NaN or +inf "
                         "or no finite value (non-finite weights or activations: check the "
                         "checkpoint)")
