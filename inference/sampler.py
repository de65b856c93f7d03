"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws the noise for its ``i``-th output token from a generator seeded with
``(seed, i)`` alone, so it gets the same tokens whatever batch it shares and whichever replica resumes it.
Sampling uses the exponential race (argmax of ``p / E`` with ``E ~ Exp(1)``), equivalent to drawing from
``p`` and free of a CPU sync per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.sampling_params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    output_index: int  # how many tokens the request has generated before this one
    banned_token_ids: frozenset[int] = frozenset()  # e.g. EOS before min_tokens


def seed_for(seed: int, output_index: int) -> int:
    return (seed * _GOLDEN + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK63


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """logits: float32 [N, V], one row per entry of ``rows``; returns one token id per row."""
        logits = self._ban(logits, rows)
        if all(r.params.is_greedy for r in rows):
            return logits.argmax(dim=-1).tolist()
        greedy = torch.tensor([r.params.is_greedy for r in rows], device=logits.device)
        temps = torch.tensor([r.params.temperature if not r.params.is_greedy else 1.0 for r in rows],
                             device=logits.device, dtype=logits.dtype)
        filtered = _top_k_top_p(logits / temps.unsqueeze(1), rows)
        probs = torch.softmax(filtered, dim=-1)
        noise = self._exponential_noise(probs, rows)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled).tolist()

    def _ban(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if not any(r.banned_token_ids for r in rows):
            return logits
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.banned_token_ids:
                logits[i, list(r.banned_token_ids)] = float("-inf")
        return logits

    def _exponential_noise(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None and not r.params.is_greedy:
                g = torch.Generator(device=probs.device)
                g.manual_seed(seed_for(r.params.seed, r.output_index))
                noise[i].exponential_(generator=g)
        return noise.clamp_min_(1e-10)


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k], device=logits.device).unsqueeze(1)
    remove = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token; the first is always kept
    p = torch.tensor(top_p, device=logits.device, dtype=probs.dtype).unsqueeze(1)
    remove |= before >= p
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
