"""Per-request sampling parameters, validated at the edge (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request picks its next tokens.

    ``temperature == 0`` is greedy. ``top_k == 0`` disables top-k; ``top_p == 1`` disables top-p.
    ``seed`` makes sampling reproducible whatever the batch the request shares.
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


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
