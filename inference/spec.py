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

from inference.protocol import MAX_PRIORITY, MIN_PRIORITY
from inference.sampling_params import MAX_STOP_STRINGS

IGNORED = "accepted for compatibility and ignored"
UNSUPPORTED = "not supported: only absent, null, false or empty is accepted"


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
    user: Any = Field(None, description=IGNORED)
    frequency_penalty: Any = Field(None, description=IGNORED)
    presence_penalty: Any = Field(None, description=IGNORED)
    best_of: Any = Field(None, description=IGNORED)
    metadata: Any = Field(None, description=IGNORED)
    store: Any = Field(None, description=IGNORED)
    service_tier: Any = Field(None, description=IGNORED)
    response_format: Any = Field(None, description=IGNORED)
    tool_choice: Any = Field(None, description=IGNORED)
    function_call: Any = Field(None, description=IGNORED)
    parallel_tool_calls: Any = Field(None, description=IGNORED)
    modalities: Any = Field(None, description=IGNORED)
    audio: Any = Field(None, description=IGNORED)
    prediction: Any = Field(None, description=IGNORED)
    reasoning_effort: Any = Field(None, description=IGNORED)
    web_search_options: Any = Field(None, description=IGNORED)
    verbosity: Any = Field(None, description=IGNORED)
    prompt_cache_key: Any = Field(None, description=IGNORED)
    safety_identifier: Any = Field(None, description=IGNORED)
    logprobs: Literal[False, 0] | None = Field(None, description=UNSUPPORTED)
    top_logprobs: Literal[False, 0] | None = Field(None, description=UNSUPPORTED)
    echo: Literal[False] | None = Field(None, description=UNSUPPORTED)
    suffix: Literal[False] | None = Field(None, description=UNSUPPORTED)
    logit_bias: dict[str, Any] | None = Field(None, max_length=0, description=UNSUPPORTED)
    tools: list[Any] | None = Field(None, max_length=0, description=UNSUPPORTED)
    functions: list[Any] | None = Field(None, max_length=0, description=UNSUPPORTED)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids (a batch of one is accepted)."""

    prompt: (Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])


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


# ---- responses -------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description="with return_token_ids")


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
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
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description="with return_token_ids")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str


class ChatDeltaChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
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
