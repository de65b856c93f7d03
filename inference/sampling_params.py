"""Per-request sampling parameters, validated at the edge (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # alternatives per token: chat's top_logprobs maximum, and vLLM's for completions
PENALTY_RANGE = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI and vLLM document


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request picks its next tokens.

    ``temperature == 0`` is greedy. ``top_k == 0`` disables top-k; ``top_p == 1`` disables top-p.
    ``seed`` makes sampling reproducible whatever the batch the request shares.

    Penalties follow vLLM: ``presence_penalty`` and ``frequency_penalty`` are subtracted from the logits
    of tokens the request generated so far (once, and once per occurrence); ``repetition_penalty``
    divides the positive logits and multiplies the negative ones of every token seen in the prompt or the
    output (1 disables it). ``logprobs`` asks for the log-probability of each generated token and of its
    ``logprobs`` most likely alternatives, from the model's raw distribution (before penalties,
    temperature and filters, as vLLM V1 returns them by default); None asks for none.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    # Tokens this request already produced elsewhere (a resumed stream): seeded sampling continues
    # from that position, so the resumed output equals an undisturbed run.
    output_offset: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1,
                 "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _require(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0,
                 "temperature", f"must be between 0 and 100, got {self.temperature!r}")
        _require(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
                 "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and self.top_k >= 0,
                 "top_k", f"must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        _require(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
                 "seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        _require(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
                 "stop", "must be a tuple of non-empty strings")
        _require(len(self.stop) <= MAX_STOP_STRINGS,
                 "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        _require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                 "min_tokens", f"must be between 0 and max_tokens, got {self.min_tokens!r}")
        _require(_is_int(self.output_offset) and self.output_offset >= 0,
                 "output_offset", f"must be an integer >= 0, got {self.output_offset!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and -PENALTY_RANGE <= value <= PENALTY_RANGE,
                     name, f"must be between -{PENALTY_RANGE:g} and {PENALTY_RANGE:g}, got {value!r}")
        _require(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < math.inf,
                 "repetition_penalty", f"must be > 0 (1 disables it), got {self.repetition_penalty!r}")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                 "logprobs", f"must be an integer between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(name, message)


class InvalidParameterError(ValueError):
    """A request parameter is out of range; ``param`` names the field (for the OpenAI error shape)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
