"""What a simulation runs under: the SLO it judges requests by (:class:`Slo`), the policy it runs
(:class:`PolicySpec`: ``ours``, ``hpa`` or ``static:N``) and the simulated fleet's settings
(:class:`SimSettings`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.sim.replica import RequestOutcome
from controlplane.vocabulary import HPA, OURS, STATIC, static_policy


@dataclass(slots=True, frozen=True)
class Slo:
    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"slo: ttft_s and tpot_s must be > 0, got {self.ttft_s}/{self.tpot_s}")

    def is_met(self, outcome: RequestOutcome) -> bool:
        ttft, tpot = outcome.ttft, outcome.tpot
        return ttft is not None and tpot is not None and ttft <= self.ttft_s and tpot <= self.tpot_s


@dataclass(slots=True, frozen=True)
class PolicySpec:
    """``ours``, ``hpa`` or ``static:N``."""

    kind: str
    replicas: int = 0

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        name, _, count = text.strip().partition(":")
        if name in (OURS, HPA) and not count:
            return cls(name)
        if name == STATIC and count.isdigit() and int(count) >= 1:
            return cls(STATIC, int(count))
        raise ValueError(f"policy: expected ours, hpa or static:N (N >= 1), got {text!r}")

    @property
    def label(self) -> str:
        return static_policy(self.replicas) if self.kind == STATIC else self.kind


@dataclass(slots=True, frozen=True)
class SimSettings:
    slo: Slo = Slo()
    min_replicas: int = 1
    max_replicas: int = 12
    initial_replicas: int = 2
    ours_tick_s: float = 5.0
    hpa_tick_s: float = 15.0
    stabilization_s: float = 300.0  # both policies' scale-down window, and the reversal window
    crashes: tuple[float, ...] = ()  # simulated times at which the busiest ready replica dies
    sample_s: float = 10.0
    # None: every replica has cores of its own; N: the replicas share N cores (steps stretch, see fleet.py)
    host_cores: int | None = None
    # with host_cores: core-seconds per request the host's other processes spend (gateway, a co-located
    # load client), which the replicas then do not have (fleet.py)
    host_cpu_per_request_s: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("need 1 <= min_replicas <= initial_replicas <= max_replicas")
        if self.ours_tick_s <= 0 or self.hpa_tick_s <= 0 or self.sample_s <= 0:
            raise ValueError("ticks and sample_s: must be > 0")
        if self.host_cores is not None and self.host_cores < 1:
            raise ValueError(f"host_cores: must be >= 1 or None, got {self.host_cores}")
        if not self.host_cpu_per_request_s >= 0:
            raise ValueError(f"host_cpu_per_request_s: must be >= 0, got {self.host_cpu_per_request_s!r}")

    @classmethod
    def what_if(cls, *, ttft_slo_s: float, tpot_slo_s: float, max_replicas: int,
                crashes: Sequence[float] = ()) -> SimSettings:
        """An operator's what-if (``controlplane simulate``, the REST API): two replicas at the start, or
        fewer when the bound is lower."""
        return cls(slo=Slo(ttft_slo_s, tpot_slo_s), max_replicas=max_replicas,
                   initial_replicas=min(2, max_replicas), crashes=tuple(crashes))
