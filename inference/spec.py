"""The OpenAI request and response bodies as the OpenAPI spec publishes them (``/openapi.json`` of a
replica, and of the gateway, which forwards the same bodies).

Where it sits: beside :mod:`inference.protocol`, which parses requests and builds responses as plain dicts
(cheap on the hot path, and its refusals name the field as OpenAI does). These pydantic models are for
the spec only; they describe what ``protocol`` accepts and answers, field by field, so that clients can
be generated from the spec and a fuzzer can aim at it. :func:`document_openai` puts them into an app's spec,
with the errors it answers in the OpenAI shape (:class:`ErrorResponse`, also the control plane API's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from inference.openai_fields import REFUSED
from inference.protocol import MAX_PRIORITY, MIN_PRIORITY
from inference.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, PENALTY_RANGE

IDENTIFIER = "accepted: an identifier that does not change the answer (not stored)"


def _refused(name: str) -> Any:
    """The field's spec: null, or only the values that ask for nothing; anything else is a 400."""
    return Field(None, description=f"refused unless it asks for nothing: {REFUSED[name][1]}")


# ---- errors ----------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every refusal: the OpenAI error shape."""

    error: ErrorDetail


# ---- requests --------------------------------------------------------------------------------------
TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    include_usage: bool | None = Field(None, description="a last chunk with the usage, choices empty")


class TextFormat(BaseModel):
    type: Literal["text"]


class SamplingFields(BaseModel):
    """The fields both endpoints share: sampling, streaming and this server's extensions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="the served model's name; null: the one this serves")
    max_tokens: int | None = Field(None, ge=1, description="null: 16 for completions, the context for chat")
    max_completion_tokens: int | None = Field(None, ge=1, description="wins over max_tokens")
    temperature: float | None = Field(None, ge=0, le=100, description="0 is greedy; null: 1")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="extension: 0, -1 or null disable it")
    n: Literal[1] | None = Field(None, description="only 1")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(None, description="extension: generate max_tokens tokens")
    min_tokens: int = Field(0, ge=0, description="extension: at most max_tokens")
    priority: int = Field(0, description=f"extension: clamped to [{MIN_PRIORITY}, {MAX_PRIORITY}], lower "
                                         "first")
    return_token_ids: bool | None = Field(None, description="extension: token ids in every choice, prompt "
                                                            "ids in the first chunk")
    output_offset: int = Field(0, ge=0, description="extension: tokens already produced elsewhere (resume)")
    presence_penalty: float | None = Field(None, ge=-PENALTY_RANGE, le=PENALTY_RANGE,
                                           description="subtracted once from each output token's logit")
    frequency_penalty: float | None = Field(None, ge=-PENALTY_RANGE, le=PENALTY_RANGE,
                                            description="subtracted per occurrence in the output")
    repetition_penalty: float | None = Field(None, gt=0, description="extension (vLLM's): divides positive "
                                             "and multiplies negative logits of prompt and output tokens")
    user: Any = Field(None, description=IDENTIFIER)
    metadata: Any = Field(None, description=IDENTIFIER)
    prompt_cache_key: Any = Field(None, description=IDENTIFIER)
    safety_identifier: Any = Field(None, description=IDENTIFIER)
    best_of: Literal[1] | None = _refused("best_of")
    echo: Literal[False] | None = _refused("echo")
    suffix: Literal[""] | None = _refused("suffix")
    logit_bias: Annotated[dict[str, Any], Field(max_length=0)] | None = _refused("logit_bias")
    tools: Annotated[list[Any], Field(max_length=0)] | None = _refused("tools")
    tool_choice: Literal["none"] | None = _refused("tool_choice")
    parallel_tool_calls: None = _refused("parallel_tool_calls")
    functions: Annotated[list[Any], Field(max_length=0)] | None = _refused("functions")
    function_call: Literal["none"] | None = _refused("function_call")
    response_format: TextFormat | None = _refused("response_format")
    store: Literal[False] | None = _refused("store")
    service_tier: Literal["auto", "default"] | None = _refused("service_tier")
    modalities: Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None = \
        _refused("modalities")
    audio: None = _refused("audio")
    prediction: None = _refused("prediction")
    reasoning_effort: None = _refused("reasoning_effort")
    verbosity: None = _refused("verbosity")
    web_search_options: None = _refused("web_search_options")


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids (a batch of one is accepted)."""

    prompt: (Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=(
        "log-probabilities of each token and of this many alternatives (the model's raw distribution)"))


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message: its role and its text (a string, or text parts); other keys are ignored."""

    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: the messages, rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = Field(None, description="log-probabilities of each output token (the model's "
                                                    "raw distribution)")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="alternatives per token; "
                                                                              "needs logprobs: true")


# ---- responses -------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] = Field(description="the most likely tokens and the chosen one")
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description="with return_token_ids")


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description="with return_token_ids")


TIMINGS = "extension: where the request's time went (seconds), and which replica served it"


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: dict[str, Any] | None = Field(None, description=TIMINGS)
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: dict[str, Any] | None = Field(None, description=TIMINGS)
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids")


class CompletionDelta(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description="with return_token_ids")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str


class ChatDeltaChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description="with return_token_ids")


class CompletionChunk(BaseModel):
    """One event of a streamed completion; the last one with ``include_usage`` has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionDelta]
    usage: Usage | None = None
    timings: dict[str, Any] | None = Field(None, description=TIMINGS)
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids, first chunk")


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion; the last one with ``include_usage`` has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatDeltaChoice]
    usage: Usage | None = None
    timings: dict[str, Any] | None = Field(None, description=TIMINGS)
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids, first chunk")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


STREAM = ("with stream: true, server-sent events: `data: <chunk>` per chunk (the OpenAI chunk objects), "
          "then `data: [DONE]`; an error after the stream started is one `data: {\"error\": ...}` event")
OPERATIONS: dict[str, tuple[type[BaseModel], type[BaseModel], type[BaseModel]]] = {
    "/v1/completions": (CompletionRequest, CompletionResponse, CompletionChunk),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk),
}
DONE = "[DONE]"
MODELS = "/v1/models"


def document_openai(app: FastAPI, errors: Mapping[int, str], *, models_errors: Mapping[int, str]) -> None:
    """Publish in ``app``'s spec the request and response bodies of the OpenAI endpoints, and the
    ``errors`` each may answer (``models_errors`` for ``/v1/models``), all in the OpenAI error shape."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:  # built and completed already
            return app.openapi_schema
        spec = build()  # FastAPI's, cached in app.openapi_schema and completed here
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        models: list[type[BaseModel]] = [ErrorResponse, ModelList]
        for pair in OPERATIONS.values():
            models.extend(pair)
        for model in models:
            schemas[model.__name__] = _component(model, schemas)
        for path, (request, response, chunk) in OPERATIONS.items():
            operation = spec["paths"][path]["post"]
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": _ref(request)}}}
            operation["responses"] = {"200": {"description": "the completion", "content": {
                "application/json": {"schema": _ref(response)},
                "text/event-stream": {"itemSchema": _event(chunk)}}}, **_errors(errors)}
        if MODELS in spec["paths"]:
            spec["paths"][MODELS]["get"]["responses"] = {
                "200": {"description": "the served models", "content": {"application/json": {
                    "schema": _ref(ModelList)}}}, **_errors(models_errors)}
        return spec

    app.openapi = openapi  # type: ignore[method-assign]


def _component(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    return schema


def _event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream: a chunk, an error, or the closing ``[DONE]``."""
    return {"type": "object", "description": STREAM, "required": ["data"], "properties": {
        "event": {"const": "message"},
        "data": {"anyOf": [{"const": DONE}, {
            "type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}]}}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _errors(errors: Mapping[int, str]) -> dict[str, Any]:
    content = {"application/json": {"schema": _ref(ErrorResponse)}}
    return {str(status): {"description": text, "content": content} for status, text in errors.items()}
