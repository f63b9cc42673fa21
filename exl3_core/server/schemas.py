"""Pydantic models of the OpenAI request and response shapes this server speaks.

Requests are validated strictly (a JSON string is not an integer, NaN is not a number) and
unknown fields are refused, as OpenAI's API does, so a misspelt parameter is an error instead of
silently having no effect. Fields that OpenAI defines but this server cannot honour are accepted
by the schema and refused with a 400 that names them (see :func:`refuse_unsupported`).
Extensions over OpenAI's fields: ``top_k``, ``min_p``, ``repetition_penalty`` and ``ignore_eos``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer
from pydantic_core import ErrorDetails

from exl3_core.server.errors import APIError

#: most stop strings per request
MAX_STOP_STRINGS = 16
#: most alternatives a request may ask to see beside each generated token (OpenAI allows 20 in chat)
MAX_TOP_LOGPROBS = 20

JSONObject = dict[str, object]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


# -- requests ------------------------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    # OpenAI's own rule; it also keeps a name from carrying template syntax or special tokens
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding field: there is nothing to obfuscate here


class JSONSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: JSONObject | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _GenerationRequest(_Strict):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: disabled
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    response_format: ResponseFormat | None = None
    loras: dict[str, float] | None = None  # extension: LoRA adapters and weights (exl3_core/server/loras.py)
    # accepted, no effect on the answer
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # how many most likely tokens to report beside each chosen one
    # refused unless neutral
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    parallel_tool_calls: bool | None = None  # only meaningful with tools, which are refused
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # refused unless neutral
    tools: list[JSONObject] | None = None
    tool_choice: str | JSONObject | None = None
    functions: list[JSONObject] | None = None
    function_call: str | JSONObject | None = None
    modalities: list[str] | None = None
    audio: JSONObject | None = None
    prediction: JSONObject | None = None
    reasoning_effort: str | None = None
    web_search_options: JSONObject | None = None


def refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for fields that would change the answer but are not implemented, instead of ignoring them."""
    if req.n is not None and req.n != 1:
        raise APIError.bad("n", f"n={req.n} is not supported: this server returns exactly one choice per request; "
                                f"omit 'n' or send n=1 (and send several requests for several samples)")
    if req.stream_options is not None and not req.stream:
        raise APIError.bad("stream_options", "'stream_options' needs stream=true")
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1):
            raise APIError.bad("best_of", f"best_of={req.best_of} is not supported; omit it or send 1")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError.bad("logprobs", f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}] (how many most "
                                           f"likely tokens to list beside each chosen one), got {req.logprobs}")
        if req.echo:
            raise APIError.bad("echo", "echo=true is not supported; omit 'echo' and prepend the prompt yourself")
        if req.suffix:
            raise APIError.bad("suffix", "'suffix' (insertion) is not supported; omit it")
        return
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError.bad("top_logprobs", "'top_logprobs' needs \"logprobs\": true")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError.bad("top_logprobs", f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                                               f"{req.top_logprobs}")
    if req.tools or req.functions or req.tool_choice not in (None, "none") or req.function_call not in (None, "none"):
        raise APIError.bad("tools", "tool/function calling is not supported by this server; omit "
                                    "'tools'/'tool_choice'/'functions'/'function_call'")
    if req.audio is not None or (req.modalities is not None and req.modalities != ["text"]):
        raise APIError.bad("modalities", "this server produces text only; omit 'audio' and 'modalities'")
    for name in ("prediction", "reasoning_effort", "web_search_options"):
        if getattr(req, name) is not None:
            raise APIError.bad(name, f"'{name}' is not supported by this server; omit it")


# -- request validation errors --------------------------------------------------------------------
_EXPECTED = {
    "prompt": "a string, a list of token ids, or a list holding one string or one list of token ids",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {\"role\": ..., \"content\": ...} objects whose content is a string or a list "
                "of text parts ({\"type\": \"text\", \"text\": ...})",
    "response_format": "{\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                       "\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "null"}


def _path(loc: tuple[int | str, ...]) -> str:
    """``('messages', 0, 'content', 'list[TextPart]', 1, 'type')`` -> ``messages[0].content[1].type``
    (pydantic's union-branch tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS or part[:1].isupper() or "-" in part:
            continue
        else:
            out += f".{part}" if out else part
    return out


_JSON_NAMES = {bool: "a boolean", float: "a number with a fraction", dict: "an object", type(None): "null",
               str: "a string", int: "an integer", list: "an array"}


def _json_kind(value: object) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def _prompt_problem(value: object) -> str | None:
    """What is wrong with a ``prompt`` that matched none of its accepted shapes, said about the
    element at fault (``prompt: [true, false]`` is a list of booleans, not a batch of prompts)."""
    if not isinstance(value, list):
        return f"'prompt' is {_json_kind(value)}; send a string or a list of integer token ids"
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (int, str, list)):
            shown = "true" if item is True else "false" if item is False else repr(item)[:40]
            return (f"prompt[{i}] is {_json_kind(item)} ({shown}); a prompt is a string or a list of integer token "
                    f"ids")
        if isinstance(item, list):
            bad = next((j for j, t in enumerate(item) if isinstance(t, bool) or not isinstance(t, int)), None)
            if bad is not None:
                return f"prompt[{i}][{bad}] is {_json_kind(item[bad])}; token ids are integers"
    kinds = {type(item) for item in value}
    if len(kinds) > 1:
        return "'prompt' mixes strings, token ids and lists; send one string or one list of integer token ids"
    return None


def _json_problem(msg: str) -> str:
    if any(w in msg.lower() for w in ("surrogate", "unicode", "utf-8", "hex escape")):
        return (f"the request body is not valid Unicode text ({msg}); send UTF-8 without lone surrogate escapes "
                f"(\\ud800-\\udfff not in a pair)")
    if "recursion limit" in msg:
        return f"the request body nests JSON arrays/objects too deeply ({msg}); flatten it"
    return f"the request body is not valid JSON: {msg}"


def validation_error(errors: list[ErrorDetails]) -> APIError:
    """One OpenAI-shaped 400 for a pydantic validation failure of a request body."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, _json_problem(str(first["msg"])))
    if not first["loc"]:
        return APIError(400, "the request body must be a JSON object")
    param = str(first["loc"][0])
    if first["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param} (this server does not know the field "
                             f"'{_path(first['loc'])}'; remove it)", param=param)
    if first["type"] == "missing":
        return APIError(400, f"'{_path(first['loc'])}' is required", param=param)
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    same = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    if param == "prompt" and len(first["loc"]) > 1 and (problem := _prompt_problem(_union_input(same))) is not None:
        return APIError(400, problem, param=param)
    if len(same) > 1 and param in _EXPECTED:  # a union's branches all failed: say what is accepted
        return APIError(400, f"invalid '{param}': expected {_EXPECTED[param]}", param=param)
    return APIError(400, f"invalid '{_path(first['loc'])}': {first['msg']}, got {shown}", param=param)


def _union_input(errors: list[ErrorDetails]) -> object:
    """The value a union field was given: the input of its branch error at the field itself (a
    branch's element errors carry only the element)."""
    for e in errors:
        if len(e["loc"]) == 2:
            return e.get("input")
    return errors[0].get("input")


# -- responses -----------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "exl3"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per generated token: its text, its log probability and the most likely alternatives (``logprobs`` of
    the request), and where its text starts in the completion."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A ``text_completion`` (whole, or one streamed chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _present_only(self, handler: object) -> dict[str, object]:
        # a delta carries only what changed: absent keys, not nulls
        data: dict[str, object] = handler(self)  # type: ignore[operator]
        return {k: v for k, v in data.items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
