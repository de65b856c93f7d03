"""Sizing the fleet by the work it is offered: prefill, decode, KV cache and the TPOT tail as separate terms.

Request rates alone hide what a request costs: a 1,500-token prompt takes a replica a hundred times longer
to prefill than a 15-token one, and a reasoning answer holds a decode slot a hundred times longer than a code
completion. :func:`work_needs` turns the request rate and the mean prompt and output lengths of the
requests that finished in the window into four replica counts, each from the replica profile
(:mod:`controlplane.autoscale.profile`) and the SLO, with no tuned constant:

- **prefill** (TTFT): the gateway routes to the least loaded replica, so the fleet is a queue of
  prefills with ``c`` servers. A prefill occupies a replica for ``S`` seconds
  (:func:`prefill_occupancy`): what its tokens add to the steps they ride on, plus their share, by the
  tokens they fill of the step's budget, of those steps' own cost (the step's fixed part and the decode
  batch it carries). Prefills that wait share a step, so a short one takes a fraction of a step and a
  prompt that fills whole steps takes them. The share of prompt tokens the replicas' prefix caches
  served in the window is not prefilled, though its tokens still count as context for the rest. The
  count is the smallest ``c`` whose waiting time meets the TTFT SLO, less the request's own steps
  (:func:`prefill_seconds`), at the SLO quantile, ``P(wait > t) <= 1 - q``, with
  ``P(wait > t) = C(c, a) exp(-(c - a) t / (k S))`` and ``a = rate x S``: Erlang C (the classic
  staffing rule) with the Allen-Cunneen factor ``k = (1 + cs^2) / 2`` of an M/G/c queue, ``cs^2`` the
  squared coefficient of variation of prefill times. Exponential prefill times (``cs^2 = 1``, and what is
  assumed while the spread of prompt lengths is unknown) give M/M/c; prompts all of one length wait half
  as long, and a long tail of prompts longer. ``cs^2`` comes from the prompts' standard deviation through
  the prefill time's slope around the mean prompt (:func:`prefill_variability`); with prefix hits the
  spread of what is computed is unknown, and M/M/c stands.
- **decode** (TPOT, and the wait for a slot): the largest batch ``b`` whose step, at the requests' mean
  context, takes at most half the TPOT SLO (the other half is for the prefill chunks that share those
  steps); Little's law gives the sequences decoding at once, ``L = rate x output x step(b)``, and ``L / b``
  replicas hold them. The same replicas' steps carry the prefills, whose tokens take ``p = rate x``
  :func:`prefill_added` seconds of engine time a second from the decode slots' time, so no fewer than
  ``ceil(L / b + p)`` replicas serve the sequences at all. That count runs the slots full: a sequence
  that finds all ``n x b`` of them taken waits, unprefilled, for one to free, and near full the wait grows
  without bound. So the slots are a queue too (:func:`decode_slot_replicas`): ``n x b`` servers, each
  holding a sequence for ``output`` steps of ``step(b) / (1 - p / n)`` (a full batch's step, stretched by
  the prefills riding on it), and the count is the fewest ``n`` from that floor up whose wait for a slot
  meets the TTFT budget at the SLO quantile, by the same Erlang C and Allen-Cunneen factor as the prefill
  queue, ``cs^2`` from the outputs' spread. Many slots take a high load with short waits: on the
  evaluation set's shared-prefix requests one replica is sized up to its 64 slots 92% full (30 requests/s),
  two from 94% (30.5).
- **KV cache**: those ``L`` sequences hold ``prompt + output / 2`` tokens each on average; the count keeps
  the fleet's KV capacity at most ``kv_headroom`` full (the target of the KV-usage metric, so preemption
  stays rare).
- **TPOT tail**: the decode term holds the *mean* step within the TPOT SLO, but a request's TPOT is the
  mean of *its own* steps, and a step that carries a prefill chunk takes several decode steps' time (a full
  1,024-token chunk on the reference profile is over a 0.1 s SLO by itself). A short answer whose few steps
  carry the prompts queued behind it misses. The count is the fewest replicas whose share of such requests
  is within ``1 - q`` (:meth:`TpotTail.miss_share`): a request of ``k`` steps misses when the prompts its
  steps carry add more than ``k x (SLO - decode step)``, that is when at least ``m_k`` prompts ride on
  them: those left queued on its replica when it got its first token (the M/M/c queue an arrival sees,
  ``C rho^n`` for ``n`` or more) plus those routed to it meanwhile (Poisson, at its share of the rate
  times ``rho^(c-1)``, the chance that every other replica is busy too, since the gateway routes to the
  least loaded). Output lengths are log-normal with the window's mean and standard deviation (geometric
  where the spread is unknown: the most spread a mean allows), taken at their quantiles.

The largest of the four is the ``work`` proposal of :func:`controlplane.autoscale.decide.decide`; the queue
and TTFT guards still hold scale-down back, and every input and count is in the proposal's reason. Where
the fleet shows what the model does not (a queue growing past its target while TTFT misses the SLO, every
replica ready), :func:`controlplane.autoscale.decide.backlog_proposal` adds one replica at a time.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field

from controlplane.autoscale.profile import ReplicaProfile

MAX_REPLICAS_CONSIDERED = 1000  # the Erlang-C search stops here (an SLO no fleet meets)


@dataclass(slots=True, frozen=True)
class WorkNeeds:
    prefill: int
    decode: int
    kv: int
    reason: str
    tpot: int = 0
    # the replicas the same work needs at the rate plus the policy's tolerance: a scale-down goes no lower
    # (a rate hovering at a step of the count would otherwise flip it every window, as HPA's tolerance
    # prevents for its ratios)
    with_margin: int = 0
    tail: TpotTail | None = field(default=None, compare=False, repr=False)  # the TPOT tail term's model

    @property
    def replicas(self) -> int:
        return max(self.prefill, self.decode, self.kv, self.tpot)

    def proposal(self, current: int) -> int:
        """Up to what the work needs now; down only to what it needs with the margin."""
        return self.replicas if self.replicas >= current else min(current, max(self.replicas,
                                                                               self.with_margin))


def work_needs(profile: ReplicaProfile, *, rate: float | None, mean_prompt: float | None,
               mean_output: float | None, ttft_slo_s: float, tpot_slo_s: float, quantile: float = 0.95,
               kv_headroom: float = 0.8, prefix_hit_share: float | None = None,
               prompt_sd: float | None = None, output_sd: float | None = None) -> WorkNeeds | None:
    """Replicas the offered work needs per term; None when the rate or the request sizes are unknown.
    ``prefix_hit_share``: of the prompt tokens, the share the replicas' prefix caches hold (None: none).
    ``prompt_sd``: the standard deviation of the prompts' lengths (None: unknown, prefill times are taken
    as exponential). ``output_sd``: that of the outputs' (None: unknown, output lengths are taken as
    geometric)."""
    if rate is None or mean_prompt is None or mean_output is None:
        return None
    if rate <= 0:
        return WorkNeeds(0, 0, 0, "no request in the window")
    prompt, output = max(mean_prompt, 1.0), max(mean_output, 1.0)
    context = prompt + output / 2
    batch, step = decode_batch(profile, context, tpot_slo_s)
    in_decode = rate * output * step  # Little's law: sequences decoding at once
    slots = math.ceil(in_decode / batch)  # replicas the decode slots alone need
    # the decode batch a replica carries while it prefills: the decoding sequences over those replicas
    carried = math.ceil(in_decode / max(slots, 1))
    hit = cached_share(prefix_hit_share)
    cached = min(round(prompt * hit), round(prompt) - 1)
    ride = prefill_seconds(profile, prompt, decoding=carried, context=context, cached=max(cached, 0))
    service = prefill_occupancy(profile, prompt, decoding=carried, context=context, cached=max(cached, 0))
    # A prefill longer than the TTFT SLO misses it on any fleet: more replicas cannot help that request,
    # so the queue is then held to a wait no longer than the prefill itself.
    budget = ttft_slo_s - ride if ride < ttft_slo_s else ride
    # the spread is of whole prompts: where prefix caches hold part of them, what is computed spreads
    # differently (a shared system prompt plus a unique suffix), and M/M/c stands
    cs2 = None if prompt_sd is None or cached > 0 else prefill_variability(profile, prompt, prompt_sd,
                                                                           decoding=carried, context=context)
    variability = 1.0 if cs2 is None else (1 + cs2) / 2
    prefill = erlang_c_servers(rate * service, service, budget, quantile, variability)
    # the decoding replicas' steps also carry the prefills: the engine time those add is taken from the
    # decode slots' time, so both terms are met by the same replicas
    prefilling = rate * prefill_added(profile, prompt, cached=max(cached, 0),
                                      budget=max(profile.max_num_batched_tokens - carried, 1))
    floor = math.ceil(in_decode / batch + prefilling - 1e-9)
    decode, slot_step = decode_slot_replicas(rate=rate, output=output, output_sd=output_sd, batch=batch,
                                             step=step, prefilling=prefilling, floor=floor,
                                             wait_budget_s=budget, quantile=quantile)
    kv = math.ceil(in_decode * context / (kv_headroom * profile.kv_capacity_tokens))
    lengths = output_quantiles(output, output_sd)
    tail = TpotTail(profile, rate=rate, prompt=prompt, cached=max(cached, 0), context=context,
                    in_decode=in_decode, outputs=lengths, tpot_slo_s=tpot_slo_s)
    tpot, tpot_share = tail.fewest(1 - quantile)
    within = (f"{ttft_slo_s:g}s TTFT less its own {ride * 1e3:.0f} ms of steps" if ride < ttft_slo_s else
              f"the prefill's own {ride:.2f}s (it alone is over the {ttft_slo_s:g}s TTFT SLO)")
    tokens = f"{prompt:.0f} tokens" + (f", {cached} of them cached ({hit:.0%} prefix hits)" if cached > 0
                                       else "")
    if cs2 is not None:
        spread = (f"prompts' sd {prompt_sd:.0f} tokens, prefill times' cs^2 {cs2:.2f}, "
                  f"Allen-Cunneen x{variability:.2f}")
    elif prompt_sd is not None:
        spread = "prefill times taken as exponential (the spread of the uncached part is unknown)"
    else:
        spread = "prefill times taken as exponential"
    prefill_note = (f"{prefill} (Erlang C: {rate:.3g} req/s x {service * 1e3:.0f} ms prefill of {tokens}, "
                    f"{spread}, P{quantile * 100:g} wait within {within})")
    slot_note = ""
    if decode > floor:  # the slots at the floor, full enough that the wait for one misses the budget
        full = rate * output * step / max(1 - prefilling / floor, 1e-9) / (floor * batch)
        slot_note = (f"; {floor} would keep their {floor * batch} slots {min(full, 1):.0%} full, and the "
                     f"wait for one within the P{quantile * 100:g} TTFT budget needs {decode} (a sequence "
                     f"holds one for {output:.0f} steps of {slot_step * 1e3:.0f} ms with the prefills)")
    reason = (f"prefill {prefill_note}; decode {decode} ({in_decode:.1f} sequences of {output:.0f} tokens "
              f"at batch {batch}, {step * 1e3:.0f} ms steps within {tpot_slo_s:g}s TPOT / 2: "
              f"{in_decode / batch:.2f} replicas, plus {prefilling:.2f} of prefill in their steps"
              f"{slot_note}); KV {kv} "
              f"({in_decode * context:,.0f} tokens held, {kv_headroom:.0%} of {profile.kv_capacity_tokens:,} "
              f"each); TPOT tail {tpot} ({tpot_share:.1%} of requests over {tpot_slo_s:g}s TPOT "
              f"there, within {1 - quantile:.0%}; outputs "
              + ("geometric" if output_sd is None else f"log-normal, sd {output_sd:.0f}")
              + f", {tail.per_prompt_s * 1e3:.0f} ms of prefill per prompt in their steps)")
    return WorkNeeds(min(prefill, MAX_REPLICAS_CONSIDERED), decode, kv, reason,
                     min(tpot, MAX_REPLICAS_CONSIDERED), tail=tail)


QUANTILE_POINTS = 64  # output lengths are taken at this many quantiles of their distribution
NEGLIGIBLE = 1e-9  # a probability the TPOT tail leaves out of its sums


def output_quantiles(mean: float, sd: float | None, points: int = QUANTILE_POINTS) -> tuple[int, ...]:
    """Output lengths at ``points`` evenly spaced quantiles (their midpoints): log-normal with ``mean`` and
    ``sd`` (the usual shape of generated lengths: positive, skewed, a long right tail), or geometric with
    ``mean`` when ``sd`` is None (the widest spread a mean alone allows, as exponential prefill times are
    for the prefill queue)."""
    mean = max(mean, 1.0)
    levels = [(i + 0.5) / points for i in range(points)]
    if sd is None:
        if mean <= 1.0:
            return tuple(1 for _ in levels)
        stay = 1 - 1 / mean  # geometric on 1, 2, ... with this mean: P(length > n) = stay^n
        return tuple(max(1, math.ceil(math.log(1 - u) / math.log(stay))) for u in levels)
    if sd <= 0:
        return tuple(round(mean) for _ in levels)
    sigma = math.sqrt(math.log(1 + (sd / mean) ** 2))
    normal = statistics.NormalDist(math.log(mean) - sigma * sigma / 2, sigma)
    return tuple(max(1, round(math.exp(normal.inv_cdf(u)))) for u in levels)


class TpotTail:
    """The share of requests whose TPOT is over the SLO at ``c`` replicas, from the prefill chunks their
    decode steps carry (the module's TPOT tail term)."""

    def __init__(self, profile: ReplicaProfile, *, rate: float, prompt: float, cached: int, context: float,
                 in_decode: float, outputs: tuple[int, ...], tpot_slo_s: float) -> None:
        self.profile, self.rate, self.prompt, self.cached = profile, rate, prompt, cached
        self.context, self.in_decode, self.outputs, self.slo = context, in_decode, outputs, tpot_slo_s
        self.per_prompt_s = prefill_added(profile, prompt, cached=cached)
        self.lengths = collections.Counter(n for n in outputs if n > 1)  # one-token answers have no TPOT

    def fewest(self, allowed: float) -> tuple[int, float]:
        """The fewest replicas whose share of TPOT misses is within ``allowed``, and that share."""
        c, share = 1, self.miss_share(1)
        while c < MAX_REPLICAS_CONSIDERED and share > allowed:
            c += 1
            share = self.miss_share(c)
        return c, share

    def miss_share(self, replicas: int) -> float:
        """The share of requests over the TPOT SLO at ``replicas`` (0..1): over the output lengths, the
        chance that at least ``need`` prompts ride on a request's steps, ``j`` of them routed to its replica
        while it decodes and the rest left queued there when it got its first token."""
        c = max(replicas, 1)
        decoding = max(math.ceil(self.in_decode / c), 1)
        step = _step_cost(self.profile, decoding, self.context)
        slack = self.slo - step  # what prefill may add to each of a request's steps, on average
        if slack <= 0:
            return 1.0
        budget = max(self.profile.max_num_batched_tokens - decoding, 1)
        added = prefill_added(self.profile, self.prompt, cached=self.cached, budget=budget)
        if added <= 0 or prefill_added(self.profile, budget, budget=budget) <= slack:
            return 0.0  # no prompt, or not even a full chunk in every step, takes a request over the SLO
        offered = self.rate * prefill_occupancy(self.profile, self.prompt, decoding=decoding,
                                                context=self.context, cached=self.cached)
        if offered >= c:
            return 1.0
        rho = offered / c
        waits = erlang_c(c, offered)
        joining = self.rate / c * rho ** (c - 1)
        # queues this long or longer are rarer than NEGLIGIBLE: past them only routed prompts count
        deep = 0 if waits * rho <= NEGLIGIBLE else math.ceil(math.log(NEGLIGIBLE / waits) / math.log(rho))

        def misses(steps: int) -> float:
            need = math.floor(steps * slack / added) + 1  # prompts riding on its steps that take it over
            mean = joining * (steps * step + need * added)  # prompts routed to it while it decodes
            if need - deep > mean + 10 * math.sqrt(mean) + 10:
                return 0.0  # neither a queue left behind nor the prompts routed to it reach ``need``
            below, share = 0.0, 0.0
            for j in range(need):
                pmf = _poisson(j, mean)
                share += pmf * waits * rho ** (need - j)  # j routed to it meanwhile, the rest left queued
                below += pmf
                if j > mean and pmf < NEGLIGIBLE:
                    return share  # the rest of the Poisson tail adds nothing a share can show
            return share + max(1.0 - below, 0.0)

        return sum(count * misses(n - 1) for n, count in self.lengths.items()) / len(self.outputs)


def _poisson(k: int, mean: float) -> float:
    """P(K = k) for a Poisson count of this mean, in logs (``exp(-mean)`` underflows past 745)."""
    if mean <= 0:
        return 1.0 if k == 0 else 0.0
    return math.exp(k * math.log(mean) - mean - math.lgamma(k + 1))


def poisson_at_least(count: int, mean: float) -> float:
    """P(K >= count) for a Poisson count of this mean, summed exactly (a normal approximation understates
    the upper tail several-fold a few standard errors out when the mean is a few dozen)."""
    if count <= 0:
        return 1.0
    if count <= mean:
        return max(1.0 - sum(_poisson(k, mean) for k in range(count)), 0.0)
    total, k = 0.0, count
    while True:  # past the mean each term is smaller than the last
        term = _poisson(k, mean)
        total += term
        if term <= total * 1e-12:
            return total
        k += 1


def cached_share(prefix_hit_share: float | None) -> float:
    """The share of prompt tokens the prefix caches held, within 0..1 (unknown: none)."""
    return min(max(prefix_hit_share or 0.0, 0.0), 1.0)


def decode_batch(profile: ReplicaProfile, context: float, tpot_slo_s: float) -> tuple[int, float]:
    """The largest batch whose decode step at ``context`` tokens each takes at most half the TPOT SLO
    (at least 1), and that step's seconds."""
    best = 1
    for batch in range(1, profile.max_num_seqs + 1):
        if _decode_step(profile, batch, context) <= tpot_slo_s / 2:
            best = batch
    return best, _decode_step(profile, best, context)


def decode_slot_replicas(*, rate: float, output: float, output_sd: float | None, batch: int, step: float,
                         prefilling: float, floor: int, wait_budget_s: float,
                         quantile: float) -> tuple[int, float]:
    """The fewest replicas from ``floor`` up whose ``batch`` decode slots each keep the wait for a slot
    within ``wait_budget_s`` at ``quantile`` (module docstring, decode), and the step a full batch takes
    on that many with ``prefilling`` engine-seconds a second of prefill riding on their steps.
    ``output_sd`` None: outputs geometric, ``cs^2`` about 1."""
    cs2 = 1.0 - 1.0 / output if output_sd is None else (output_sd / output) ** 2
    variability = (1 + cs2) / 2
    n = max(floor, 1)
    while n < MAX_REPLICAS_CONSIDERED:
        left = 1 - prefilling / n  # the share of each replica's time its decode steps get
        if left > 0:
            full_step = step / left
            hold = output * full_step  # seconds a sequence holds its slot
            if waits_within(n * batch, rate * hold, hold, wait_budget_s, quantile, variability):
                return n, full_step
        n += 1
    return MAX_REPLICAS_CONSIDERED, step


def _decode_step(profile: ReplicaProfile, batch: int, context: float) -> float:
    return profile.step_time(num_decode=batch, num_prefill_tokens=0, context_tokens=round(batch * context))


def prefill_seconds(profile: ReplicaProfile, prompt: float, *, decoding: int, context: float,
                    cached: int = 0) -> float:
    """Seconds a replica takes to prefill a prompt of ``prompt`` tokens, the first ``cached`` of them from
    its prefix cache, in chunks of its step budget, each step also decoding ``decoding`` sequences of
    ``context`` tokens (chunked prefill shares the step): the steps' own cost for each chunk plus what the
    chunks add (the profile is linear in a step's terms)."""
    budget = max(profile.max_num_batched_tokens - decoding, 1)
    chunks = math.ceil(max(round(prompt) - cached, 0) / budget)
    return (chunks * _step_cost(profile, decoding, context)
            + prefill_added(profile, prompt, cached=cached, budget=budget))


def _step_cost(profile: ReplicaProfile, decoding: int, context: float) -> float:
    """A step's own seconds, before any prefill token: its fixed part and ``decoding`` sequences of
    ``context`` tokens."""
    return profile.step_time(num_decode=decoding, num_prefill_tokens=0,
                             context_tokens=round(decoding * context), prefill_pairs=0)


def prefill_occupancy(profile: ReplicaProfile, prompt: float, *, decoding: int, context: float,
                      cached: int = 0) -> float:
    """Seconds of a replica's time a prompt's prefill takes when prefills queue: what its tokens add to
    the steps they ride on (:func:`prefill_added`), plus their share of those steps' own cost (the carried
    decode batch and the step's fixed part) by the tokens they fill of the step's budget. A waiting
    prefill shares its step with the others waiting, so a 50-token suffix takes a twentieth of a step, not
    a step; a prompt that fills whole steps takes them (:func:`prefill_seconds` less its last chunk's
    unfilled share)."""
    budget = max(profile.max_num_batched_tokens - decoding, 1)
    computed = max(round(prompt) - cached, 0)
    return (_step_cost(profile, decoding, context) * computed / budget
            + prefill_added(profile, prompt, cached=cached, budget=budget))


def prefill_added(profile: ReplicaProfile, prompt: float, *, cached: int = 0,
                  budget: int | None = None) -> float:
    """Seconds a prompt's prefill adds to the steps it rides on: its computed tokens and their attention
    pairs, in chunks of ``budget`` tokens (default: the replica's whole step budget), the first
    ``cached`` tokens served by the prefix cache."""
    left, done, added = round(prompt) - cached, cached, 0.0
    budget = max(budget or profile.max_num_batched_tokens, 1)
    while left > 0:
        chunk = min(left, budget)
        added += profile.seconds(steps=0, num_decode=0, num_prefill_tokens=chunk, context_tokens=0,
                                 prefill_pairs=chunk * done + chunk * (chunk + 1) // 2)
        left, done = left - chunk, done + chunk
    return added


def prefill_variability(profile: ReplicaProfile, mean_prompt: float, prompt_sd: float, *, decoding: int,
                        context: float) -> float:
    """The squared coefficient of variation of prefill times for prompts of ``mean_prompt`` tokens on
    average, ``prompt_sd`` apart: the slope of what a prefill occupies (:func:`prefill_occupancy`) around
    the mean (over one deviation either side, or as far down as a one-token prompt) times the deviation,
    over the mean prompt's."""
    reach = min(prompt_sd, mean_prompt - 1.0)
    mean = prefill_occupancy(profile, mean_prompt, decoding=decoding, context=context)
    if reach <= 0 or mean <= 0:
        return 0.0
    low = prefill_occupancy(profile, mean_prompt - reach, decoding=decoding, context=context)
    high = prefill_occupancy(profile, mean_prompt + reach, decoding=decoding, context=context)
    return ((high - low) / (2 * reach) * prompt_sd / mean) ** 2


def erlang_c_servers(offered: float, service_s: float, wait_budget_s: float, quantile: float,
                     variability: float = 1.0) -> int:
    """The fewest servers of a queue with ``offered`` Erlangs (arrival rate x ``service_s``) whose waiting
    time stays within ``wait_budget_s`` at ``quantile``; MAX_REPLICAS_CONSIDERED when none does. M/M/c at
    ``variability`` 1; otherwise the waits scaled by it (Allen-Cunneen's ``(ca^2 + cs^2) / 2``)."""
    if wait_budget_s <= 0:
        return MAX_REPLICAS_CONSIDERED
    c = max(1, math.floor(offered) + 1)
    while c < MAX_REPLICAS_CONSIDERED:
        if waits_within(c, offered, service_s, wait_budget_s, quantile, variability):
            return c
        c += 1
    return MAX_REPLICAS_CONSIDERED


def waits_within(servers: int, offered: float, service_s: float, wait_budget_s: float, quantile: float,
                 variability: float = 1.0) -> bool:
    """Whether an M/G/c queue of ``servers`` at ``offered`` Erlangs keeps ``P(wait > wait_budget_s)``
    within ``1 - quantile``: Erlang C times the wait's exponential tail, scaled by ``variability``."""
    if offered >= servers or wait_budget_s <= 0:
        return False
    tail = math.exp(-(servers - offered) * wait_budget_s / (service_s * variability))
    return erlang_c(servers, offered) * tail <= 1 - quantile


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue (Erlang C), computed through Erlang B's stable
    recurrence; 1.0 when the queue is unstable."""
    if offered >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    rho = offered / servers
    return b / (1 - rho + rho * b)
