"""Token sampling: penalties, greedy, temperature, top-k, top-p, per-request seeds, log-probabilities.

Each step works on the batch's logits at once: log-probabilities (when a row asks) come from the raw
logits, then banned tokens, penalties (vLLM's: repetition on prompt and output tokens, presence and
frequency on output tokens), temperature and filters shape what is sampled. A batch whose rows ask for
none of these extras pays for none of them.

A seeded request draws the noise for its ``i``-th output token from a generator seeded with
``(seed, i)`` alone, so it gets the same tokens whatever batch it shares and whichever replica resumes it.
Sampling uses the exponential race (argmax of ``p / E`` with ``E ~ Exp(1)``), equivalent to drawing from
``p`` and free of a CPU sync per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference.output import TokenLogprob
from inference.sampling_params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    output_index: int  # how many tokens the request has generated before this one
    banned_token_ids: frozenset[int] = frozenset()  # e.g. EOS before min_tokens
    # With penalties only: prompt and output tokens so far; the first ``num_prompt_tokens`` are the prompt
    # proper, the rest count as output (a resumed stream's prompt ends with tokens it output elsewhere).
    history: Sequence[int] = ()
    num_prompt_tokens: int = 0
    seq_id: int | None = None  # keys the penalty counts kept across steps; None: counted afresh


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the row did not ask


def seed_for(seed: int, output_index: int) -> int:
    return (seed * _GOLDEN + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK63


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.penalties = Penalties()

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: float32 [N, V], one row per entry of ``rows``; one token id per row, and its
        log-probabilities where the row asks for them."""
        sampled = self._sample(self.penalties(self._ban(logits, rows), rows), rows)
        token_ids: list[int] = sampled.tolist()
        return SamplerOutput(token_ids, _logprobs(logits, sampled, token_ids, rows))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        if all(r.params.is_greedy for r in rows):
            return logits.argmax(dim=-1)
        greedy = torch.tensor([r.params.is_greedy for r in rows], device=logits.device)
        temps = torch.tensor([r.params.temperature if not r.params.is_greedy else 1.0 for r in rows],
                             device=logits.device, dtype=logits.dtype)
        filtered = _top_k_top_p(logits / temps.unsqueeze(1), rows)
        probs = torch.softmax(filtered, dim=-1)
        noise = self._exponential_noise(probs, rows)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

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


@dataclass(slots=True)
class _TokenCounts:
    """One sequence's penalty state, kept across steps so that a step adds only its new tokens."""

    seen: torch.Tensor  # [V] bool: in the prompt or the output
    output: torch.Tensor  # [V] how many times in the output
    num_tokens: int = 0  # tokens of the history counted so far


class Penalties:
    """vLLM's penalties over a batch: per-sequence token counts, kept on the device and updated with each
    step's new tokens (a request's history is read once, not every step), stacked for the rows that have
    penalties and applied in a few tensor operations."""

    def __init__(self) -> None:
        self._counts: dict[int, _TokenCounts] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        index = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not index:
            self._counts.clear()
            return logits
        penalized = [rows[i] for i in index]
        counts = [self._update(r, logits) for r in penalized]
        live = {r.seq_id for r in penalized}
        for gone in [k for k in self._counts if k not in live]:  # finished, aborted or preempted
            del self._counts[gone]
        seen = torch.stack([c.seen for c in counts])
        output = torch.stack([c.output for c in counts])
        device, dtype = logits.device, logits.dtype
        sub = logits[index]
        repetition = torch.where(seen, _column(penalized, "repetition_penalty", device, dtype), 1.0)
        sub = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub -= _column(penalized, "frequency_penalty", device, dtype) * output
        sub -= _column(penalized, "presence_penalty", device, dtype) * (output > 0)
        logits = logits.clone()
        logits[index] = sub
        return logits

    def _update(self, row: SamplingRow, logits: torch.Tensor) -> _TokenCounts:
        counts = self._counts.get(row.seq_id) if row.seq_id is not None else None
        if counts is None:
            vocab = logits.shape[-1]
            counts = _TokenCounts(torch.zeros(vocab, dtype=torch.bool, device=logits.device),
                                  torch.zeros(vocab, dtype=logits.dtype, device=logits.device))
            if row.seq_id is not None:
                self._counts[row.seq_id] = counts
        new = row.history[counts.num_tokens:]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=logits.device)
            counts.seen[ids] = True
            out = ids[max(row.num_prompt_tokens - counts.num_tokens, 0):]
            counts.output.index_put_((out,), torch.ones_like(out, dtype=logits.dtype), accumulate=True)
            counts.num_tokens += len(new)
        return counts


def _column(rows: list[SamplingRow], name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, 1] column of one sampling parameter."""
    return torch.tensor([getattr(r.params, name) for r in rows], device=device, dtype=dtype).unsqueeze(1)


def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, token_ids: list[int],
              rows: list[SamplingRow]) -> list[TokenLogprob | None]:
    """The raw distribution's log-probabilities of the sampled tokens and of the top alternatives, for the
    rows that ask; two transfers to the host for the whole batch."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    index = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not index:
        return out
    logprobs = torch.log_softmax(logits[index], dim=-1)
    chosen = logprobs.gather(1, sampled[index].unsqueeze(1)).squeeze(1)
    k = max(rows[i].params.logprobs or 0 for i in index)
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        host = torch.cat([chosen.unsqueeze(1), top_values], dim=1).tolist()
        ids = top_ids.tolist()
    else:  # the chosen tokens' only
        host, ids = chosen.unsqueeze(1).tolist(), [[] for _ in index]
    for j, i in enumerate(index):
        n = rows[i].params.logprobs or 0
        out[i] = TokenLogprob(token_ids[i], host[j][0], tuple(zip(ids[j][:n], host[j][1:n + 1])))
    return out


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
