"""What the engine hands back per request: tokens, their log-probabilities when asked for, text (stop
strings applied) and stage timings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """Engine-clock timestamps of one request's stages (seconds); None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    detokenize_seconds: float = 0.0
    # (start, end, tokens) of each step that computed part of the prompt, when the engine records them
    # (LLMEngine.record_prefill_chunks, set while traces are exported)
    prefill_chunks: list[tuple[float, float, int]] | None = None

    @property
    def queue_time(self) -> float:
        return _span(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_time(self) -> float:
        return _span(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float:
        return _span(self.first_token_time, self.last_token_time)

    @property
    def ttft(self) -> float:
        return _span(self.arrival_time, self.first_token_time)

    @property
    def e2e_time(self) -> float:
        return _span(self.arrival_time, self.finished_time)


def _span(start: float | None, end: float | None) -> float:
    return 0.0 if start is None or end is None else max(end - start, 0.0)


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives (most likely first), from
    the model's raw distribution; ``top`` holds as many as the request asked for."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    text: str
    delta_text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None
    # With ``SamplingParams.logprobs``: those of ``new_token_ids``, and (in the finished output of a request
    # added with ``keep_logprobs``, the default; a stream's keeps none) those of every output token.
    new_logprobs: list[TokenLogprob] | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class TextAssembler:
    """Incremental detokenization with stop strings held back until they can no longer match.

    ``push`` takes the text a token completed and returns (text safe to emit, stop matched). The
    emitted text never contains a stop string, as the OpenAI API specifies.
    """

    stop: tuple[str, ...]
    text: str = ""  # everything decoded so far (stop string cut off once matched)
    emitted: int = 0
    stopped: bool = False
    _hold: int = field(init=False)

    def __post_init__(self) -> None:
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def push(self, piece: str) -> tuple[str, bool]:
        if self.stopped or not piece:
            return "", self.stopped
        search_from = max(len(self.text) - self._hold, 0)
        self.text += piece
        cut = min((i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self._hold), False

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:upto], upto
        return out


Clock = Callable[[], float]
