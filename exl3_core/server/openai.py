"""OpenAI-compatible routes on the continuous-batching generator, as a FastAPI application.

``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream`` true/false, streams as Server-Sent Events), ``GET /health`` and ``GET /metrics``
(Prometheus). Every request becomes one :class:`Job` submitted to a single
:class:`AsyncGenerator`, whose owner thread steps the :class:`Generator` for all of them, so
concurrent requests share forward passes.

Request handling keeps the event loop free: the body is parsed and validated, the chat template
rendered and the prompt tokenized on a small thread pool, and a prompt whose byte length alone
proves it cannot fit the context is refused before it is tokenized at all (see
:attr:`OpenAIApp.max_prompt_bytes`). A client that disconnects, or a request that passes
``request_timeout``, has its job cancelled and its cache pages freed.

Supported request fields: ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature``,
``top_p``, ``top_k`` and ``min_p`` (extensions), ``repetition_penalty`` (extension),
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``stop``, ``seed``, ``n`` (1 only),
``stream``, ``stream_options.include_usage``, ``ignore_eos`` (extension), ``logprobs`` (and chat's
``top_logprobs``; :mod:`exl3_core.server.logprobs`), ``response_format``
(``json_object`` / ``json_schema`` through the ``llguidance`` filter plugin), and LoRA adapters through
``model`` (``"BASE:ADAPTER"``) and ``loras`` (extension; see :mod:`exl3_core.server.loras`). Fields that would
change the answer but are not implemented (``tools``, ``echo``, ``suffix``, n > 1, ...)
are refused with 400 rather than ignored; unknown fields are refused as OpenAI refuses them.
"""
from __future__ import annotations

import asyncio
import collections.abc
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import torch
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from exl3_core.cache.pages import CacheExhausted
from exl3_core.filters.base import Filter
from exl3_core.generator import AsyncGenerator, AsyncJob, Generator, Job, NumericFault
from exl3_core.generator.generator import Result
from exl3_core.lora.config import LoraError
from exl3_core.sampling import Sampler, SamplerValueError
from exl3_core.server.asgi import (
    APIKeyMiddleware,
    EventStreamResponse,
    HostCheckMiddleware,
    read_body,
    require_json,
    wait_disconnect,
)
from exl3_core.server.errors import APIError
from exl3_core.server.logprobs import TokenTexts, completion_logprobs, token_logprobs
from exl3_core.server.loras import ServedLoras
from exl3_core.server.metrics import MetricsMiddleware, ServerMetrics
from exl3_core.server.schemas import (
    MAX_STOP_STRINGS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ModelCard,
    ModelList,
    ResponseFormat,
    TokenLogprob,
    Usage,
    refuse_unsupported,
    validation_error,
)

if TYPE_CHECKING:
    from exl3_core.plugins.registry import Plugins

#: generator ``eos_reason`` -> OpenAI ``finish_reason``
FINISH_REASONS = {"stop_token": "stop", "stop_string": "stop", "filter": "stop", "max_new_tokens": "length",
                  "max_seq_len": "length"}
#: a tokenizer's normalizer can merge characters (NFC composes a Hangul syllable's three jamo, 9
#: bytes, into one 3-byte character), so a token may stand for up to this many times its bytes
NORMALIZATION_SLACK = 4
#: threads that parse bodies, render templates and tokenize prompts
PROMPT_THREADS = 2

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)


@dataclass(frozen=True)
class ServerOptions:
    """HTTP-level settings of one server.

    :param api_key: when set, every ``/v1`` request needs ``Authorization: Bearer <api_key>``.
    :param max_request_bytes: largest request body (413 beyond).
    :param request_timeout: seconds a request may take from arrival to its last token (the body's
        arrival included); None: no limit.
    :param cors_origins: origins allowed to call the API from a browser (``*`` for any); empty: no CORS.
    :param allowed_hosts: ``Host`` header names served besides the address a request arrived on (and
        loopback names on loopback): exact names, ``.example.com`` for a domain and its subdomains,
        ``*`` for any (see :class:`~exl3_core.server.asgi.HostCheckMiddleware`).
    :param allow_special_tokens: text in chat messages that spells a special token (``<|im_start|>``)
        becomes that token; off (the default), it stays text, so a user cannot forge turns. Only for
        trusted callers.
    """

    api_key: str | None = None
    max_request_bytes: int = 16 * 1024 * 1024
    request_timeout: float | None = 600.0
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    allow_special_tokens: bool = False

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes={self.max_request_bytes} must be positive")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout={self.request_timeout} must be positive (None: no limit)")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; pass a non-empty key or None for no authentication")
        for h in self.allowed_hosts:
            if not h.strip() or any(c in h for c in "/ @"):
                raise ValueError(f"allowed_hosts entry {h!r} is not a host name (give e.g. 'myhost.lan', "
                                 f"'.example.com' or '*')")


class PromptTokenizer(Protocol):
    """What the server needs of a tokenizer (:class:`~exl3_core.Tokenizer` and the toy
    :class:`~exl3_core.generator.toy.ByteTokenizer` have it). ``encode`` raises ``ValueError`` for
    text that is not valid Unicode."""

    def encode(self, text: str, add_bos: bool | None = None, encode_special_tokens: bool = True) -> torch.Tensor: ...

    def get_vocab_bytes(self) -> list[bytes]: ...


@runtime_checkable
class ChatTokenizer(Protocol):
    """A tokenizer that renders chat templates (when its ``chat_template`` is set) and tokenizes
    them with message content kept as text (:meth:`~exl3_core.Tokenizer.encode_chat`)."""

    chat_template: str | Mapping[str, str] | None

    def chat_roles(self) -> frozenset[str]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True, *,
                    special_in_content: bool = False) -> list[int]: ...


#: roles of a conversation rendered without a chat template
PLAIN_ROLES = frozenset({"system", "user", "assistant"})


@dataclass
class _Params:
    max_tokens: int | None
    sampler: Sampler
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    response_format: ResponseFormat | None
    logprobs: int | None  # alternatives listed per generated token; None: no log probabilities


def _parse(model: type[_M], body: bytes) -> _M:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _params(req: CompletionRequest | ChatCompletionRequest) -> _Params:
    """The generation settings of a validated request (400 naming the field for bad combinations)."""
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    temperature = 1.0 if req.temperature is None else req.temperature
    top_k = req.top_k or 0
    top_k = 0 if top_k == -1 else top_k  # -1 means "disabled" in several servers' dialects
    presence = req.presence_penalty or 0.0
    frequency = req.frequency_penalty or 0.0
    repetition = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    bias: dict[int, float] = {}
    for k, v in (req.logit_bias or {}).items():
        try:
            tid = int(k)
        except ValueError:
            raise APIError.bad("logit_bias", f"'logit_bias' key {k!r} is not a token id") from None
        if not -100 <= v <= 100:
            raise APIError.bad("logit_bias", f"'logit_bias' value for {k} must be a number in [-100, 100], got {v!r}")
        bias[tid] = float(v)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError.bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
    try:
        penalties: dict[str, Any] = {"presence_penalty": presence, "frequency_penalty": frequency,
                                     "repetition_penalty": repetition, "logit_bias": bias or None}
        if temperature == 0 and presence == 0 and frequency == 0 and repetition == 1 and not bias:
            sampler = Sampler.greedy()  # argmax: the truncations cannot change it
        elif temperature == 0:
            sampler = Sampler.build(temperature=0.0, **penalties)
        else:
            sampler = Sampler.build(temperature=temperature, top_k=top_k, top_p=1.0 if req.top_p is None else req.top_p,
                                    min_p=req.min_p or 0.0, **penalties)
    except SamplerValueError as e:
        raise APIError(400, f"invalid sampling parameters: {e}") from None
    seed = None if req.seed is None else req.seed % 2**63  # any JSON integer is a valid OpenAI seed
    rf = req.response_format if req.response_format is not None and req.response_format.type != "text" else None
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    return _Params(max_tokens, sampler, seed, [s for s in stop if s], bool(req.ignore_eos), bool(req.stream),
                   bool(req.stream_options and req.stream_options.include_usage), rf, logprobs)


class OpenAIApp:
    """One model served over the OpenAI API; :meth:`asgi` is the FastAPI application.

    :param generator: the :class:`Generator` all requests share (its ``max_batch_size`` bounds
        how many run at once; the rest wait in its queue).
    :param tokenizer: default ``generator.tokenizer``; chat uses its ``apply_chat_template`` when
        it has a ``chat_template`` (else messages are joined as ``role: content`` lines).
    :param model_id: the name reported by ``/v1/models`` and in responses.
    :param max_context: longest prompt + completion (default: the generator's ``max_seq_len``).
    :param plugins: plugin set providing the ``llguidance`` filter (default: the global one).
    :param options: HTTP-level settings (API key, body limit, timeout, CORS).
    :param lora_weights: the weight of each LoRA adapter when a request names it in ``model`` (default 1.0).
    """

    def __init__(self, generator: Generator, tokenizer: PromptTokenizer | None = None, *, model_id: str = "exl3",
                 max_context: int | None = None, plugins: Plugins | None = None,
                 options: ServerOptions | None = None, lora_weights: Mapping[str, float] | None = None) -> None:
        self.generator = generator
        tok = tokenizer if tokenizer is not None else generator.tokenizer
        if tok is None:
            raise ValueError("OpenAIApp needs a tokenizer: pass tokenizer= or build the Generator with one")
        self.tokenizer: PromptTokenizer = tok
        self.model_id = model_id
        #: the LoRA adapters requests may choose
        self.loras = ServedLoras(model_id, generator.model, lora_weights)
        self.max_context = min(generator.max_seq_len, max_context or generator.max_seq_len)
        self.options = options or ServerOptions()
        self._plugins = plugins
        self.agen = AsyncGenerator(generator)
        self.metrics = ServerMetrics(lambda: self.agen.stats)
        self.created = int(time.time())
        #: the longest text one token stands for (bytes)
        self.max_token_bytes = max(1, max((len(b) for b in tok.get_vocab_bytes()), default=1))
        #: a prompt longer than this (UTF-8 bytes) has at least ``max_context`` tokens whatever the
        #: tokenizer does with it, so it is refused without being tokenized
        self.max_prompt_bytes = self.max_context * self.max_token_bytes * NORMALIZATION_SLACK
        self._pool = ThreadPoolExecutor(max_workers=PROMPT_THREADS, thread_name_prefix="exl3-prompt")
        self._texts = TokenTexts(tok.get_vocab_bytes())
        self._asgi: FastAPI | None = None

    # -- application ------------------------------------------------------------------------------
    def asgi(self) -> FastAPI:
        """The FastAPI application (built once)."""
        if self._asgi is None:
            self._asgi = self._build()
        return self._asgi

    def _build(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            yield
            await self.close()

        api = FastAPI(title="exl3", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
        api.add_api_route("/health", self._health, methods=["GET", "HEAD"])
        api.add_api_route("/metrics", self._metrics, methods=["GET"])
        api.add_api_route("/v1/models", self._models, methods=["GET", "HEAD"])
        api.add_api_route("/v1/models/{name:path}", self._model, methods=["GET", "HEAD"])
        api.add_api_route("/v1/completions", self._completions, methods=["POST"])
        api.add_api_route("/v1/chat/completions", self._chat_completions, methods=["POST"])
        api.add_exception_handler(APIError, self._on_api_error)
        api.add_exception_handler(StarletteHTTPException, self._on_http_error)
        api.add_exception_handler(RequestValidationError, self._on_validation_error)
        api.add_exception_handler(Exception, self._on_crash)
        # added innermost first: CORS answers preflights before the key check, metrics count everything
        if self.options.api_key is not None:
            api.add_middleware(APIKeyMiddleware, api_key=self.options.api_key)
        api.add_middleware(HostCheckMiddleware, allowed_hosts=self.options.allowed_hosts)
        api.add_middleware(MetricsMiddleware, metrics=self.metrics)
        if self.options.cors_origins:
            api.add_middleware(CORSMiddleware, allow_origins=list(self.options.cors_origins),
                               allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["Authorization", "Content-Type"],
                               expose_headers=["X-Request-Id"])
        return api

    async def close(self) -> None:
        """End every running request's job and stop the generator's owner thread."""
        await self.agen.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _offload(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- errors -----------------------------------------------------------------------------------
    @staticmethod
    async def _on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def _on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            routes = ["/health", "/metrics", "/v1/chat/completions", "/v1/completions", "/v1/models"]
            return APIError(404, f"Invalid URL ({request.method} {request.url.path}): no such route; available: "
                                 f"{', '.join(routes)}", code="unknown_url").response()
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            return APIError(405, f"{request.method} is not allowed on {request.url.path}; use {allow}",
                            headers={"Allow": allow}).response()
        return APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})).response()

    @staticmethod
    async def _on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return validation_error(list(exc.errors())).response()

    @staticmethod
    async def _on_crash(_: Request, exc: Exception) -> Response:
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    # -- simple routes ----------------------------------------------------------------------------
    def _model_card(self, name: str | None = None) -> ModelCard:
        return ModelCard(id=name or self.model_id, created=self.created, max_model_len=self.max_context)

    async def _models(self) -> Response:
        return _json(ModelList(data=[self._model_card(), *(self._model_card(n) for n in self.loras.model_ids())]))

    async def _model(self, name: str) -> Response:
        if name != self.model_id and name not in self.loras.model_ids():
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                                f"{', '.join([self.model_id, *self.loras.model_ids()])}",
                           code="model_not_found", param="model")
        return _json(self._model_card(name))

    async def _health(self) -> Response:
        s = self.agen.stats
        return JSONResponse({
            "status": "ok", "model": self.model_id, "active_jobs": s.active_jobs, "queued_jobs": s.queued_jobs,
            "steps": s.steps, "batched_steps": s.batched_steps, "max_batch_seen": s.max_batch,
            "cancelled_jobs": s.cancelled, "preemptions": s.preemptions,
            "cache": {"pages": s.pages, "page_size": s.page_size, "pages_in_use": s.pages_in_use,
                      "pages_cached": s.pages_cached},
        })

    async def _metrics(self) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    # -- prompts (on the prompt threads) ----------------------------------------------------------
    def _too_long(self, n_bytes: int, chat: bool) -> APIError:
        return APIError(400, f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                             f"{n_bytes} bytes, so at least {math.ceil(n_bytes / (self.max_token_bytes * NORMALIZATION_SLACK))} "
                             f"tokens. Shorten the prompt", param="messages" if chat else "prompt",
                        code="context_length_exceeded")

    def _encode(self, text: str, chat: bool, **kwargs: Any) -> list[int]:
        # a character is at least one byte: the cheap test first, then the exact one
        if len(text) > self.max_prompt_bytes or len(text.encode("utf-8", "surrogatepass")) > self.max_prompt_bytes:
            raise self._too_long(len(text.encode("utf-8", "surrogatepass")), chat)
        try:
            t = self.tokenizer.encode(text, **kwargs)
        except ValueError as e:  # text that is not valid Unicode
            raise APIError.bad("messages" if chat else "prompt", str(e)) from None
        return [int(x) for x in t.reshape(-1).tolist()]

    def _roles(self, template: bool) -> frozenset[str]:
        tok = self.tokenizer
        if template and isinstance(tok, ChatTokenizer):
            try:
                return tok.chat_roles()
            except ValueError as e:  # a template jinja2 cannot parse fails every chat request alike
                raise APIError(500, f"the model's chat template cannot be read: {e}") from None
        return PLAIN_ROLES

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.tokenizer
        template = isinstance(tok, ChatTokenizer) and bool(tok.chat_template)
        roles = self._roles(template)
        msgs: list[dict[str, str]] = []
        for i, m in enumerate(req.messages):
            role = m.role
            if role == "developer" and role not in roles:
                role = "system"  # OpenAI's newer name for the system turn
            if role not in roles:
                raise APIError.bad("messages", f"messages[{i}].role {m.role[:40]!r} is not a role this model's chat "
                                               f"template knows; use one of {', '.join(sorted(roles))}")
            entry = {"role": role, "content": m.text()}
            if m.name is not None:
                entry["name"] = m.name
            msgs.append(entry)
        if template:
            assert isinstance(tok, ChatTokenizer)
            if sum(len(m["content"]) for m in msgs) > self.max_prompt_bytes:
                raise self._too_long(sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in msgs), chat=True)
            try:
                ids = tok.encode_chat(msgs, add_generation_prompt=True,
                                      special_in_content=self.options.allow_special_tokens)
            except Exception as e:  # noqa: BLE001 - templates raise their own errors for unsupported turns
                raise APIError.bad("messages", f"the model's chat template rejected the messages: {e}") from None
            return ids
        # without a template nothing in the text is a control token: special-token text stays text
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
        return self._encode(text, chat=True, encode_special_tokens=self.options.allow_special_tokens)

    def _text_prompt(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise APIError.bad("prompt", "'prompt' is empty; send at least one character or token id")
            return self._encode(p, chat=False)
        if p and all(isinstance(t, int) for t in p):
            return [int(t) for t in p]  # type: ignore[arg-type]
        if len(p) > 1:
            raise APIError.bad("prompt", f"a batch of {len(p)} prompts is not supported; send one prompt per request")
        raise APIError.bad("prompt", "'prompt' must be a non-empty string or a list of token ids")

    def _json_filter(self, rf: ResponseFormat) -> Filter:
        schema: object
        if rf.type == "json_object":
            schema = {"type": "object"}
        else:
            schema = rf.json_schema.schema_ if rf.json_schema is not None else None
            if not isinstance(schema, (dict, bool)):
                raise APIError.bad("response_format", "response_format json_schema needs \"json_schema\": {\"name\": "
                                                      "..., \"schema\": {...}} with the schema as an object")
        plugins = self._plugins
        if plugins is None:
            from exl3_core.plugins import get_plugins

            plugins = get_plugins()
        try:
            cls = plugins.filter("llguidance")
        except LookupError as e:
            raise APIError.bad("response_format", f"response_format '{rf.type}' needs the 'llguidance' filter of the "
                                                  f"exl3-filters plugin, which is not available: {e}. Install it "
                                                  f"(pip install -e plugins/filters) or omit response_format") from None
        kwargs: dict[str, Any] = {"json_schema": schema}
        if self.generator.vocab_size is not None:
            kwargs["n_vocab"] = self.generator.vocab_size  # model vocab may be padded past the tokenizer's
        try:
            f: Filter = cls(self.tokenizer, **kwargs)
        except (ValueError, TypeError) as e:
            raise APIError.bad("response_format", f"invalid JSON schema in response_format: {e}") from None
        return f

    # -- completions ------------------------------------------------------------------------------
    async def _chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        t0 = time.perf_counter()
        timeout = self.options.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        require_json(request.headers.get("content-type"))
        body = await read_body(request, self.options.max_request_bytes, timeout)
        if not body.strip():
            raise APIError(400, "the request body is empty; send a JSON object")
        req: CompletionRequest | ChatCompletionRequest
        if chat:
            req = await self._offload(_parse, ChatCompletionRequest, body)
        else:
            req = await self._offload(_parse, CompletionRequest, body)
        refuse_unsupported(req)
        p = _params(req)
        loras = self.loras.choice(req.model, req.loras)
        if isinstance(req, ChatCompletionRequest):
            ids = await self._offload(self._chat_prompt, req)
        else:
            ids = await self._offload(self._text_prompt, req)
        room = self.max_context - len(ids)
        if room < 1 or (p.max_tokens is not None and p.max_tokens > room):
            raise APIError(400, f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                                f"{len(ids)} tokens and max_tokens is {p.max_tokens if p.max_tokens else 'at least 1'}. "
                                f"Shorten the prompt or lower max_tokens", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        filters = [] if p.response_format is None else [await self._offload(self._json_filter, p.response_format)]
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            job = Job(ids, max_new_tokens=p.max_tokens or room, sampler=p.sampler, seed=p.seed,
                      stop_conditions=p.stop, stop_at_eos=not p.ignore_eos, filters=filters, identifier=rid,
                      loras=loras, return_logits=p.logprobs is not None)
            aj = await self.agen.submit(job)
        except SamplerValueError as e:
            raise APIError(400, f"invalid sampling parameters: {e}", param="logit_bias") from None
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        meta = _Meta(rid, int(time.time()), self.loras.response_model(req.model), chat, p.include_usage, t0, deadline,
                     p.logprobs)
        headers = {"X-Request-Id": rid}
        try:
            if p.stream:
                return EventStreamResponse(self._events(aj, meta), headers=headers, on_close=aj.cancel)
            return await self._whole(request, aj, meta, headers)
        except BaseException:
            aj.cancel()  # nothing will consume the job any more
            raise

    async def _results(self, aj: AsyncJob, meta: _Meta) -> AsyncIterator[Result]:
        """The job's results; at the request's deadline the job is ended with ``eos_reason``
        ``"timeout"``. Records the time to the first token."""
        timer = None
        if meta.deadline is not None:
            timer = asyncio.get_running_loop().call_later(max(0.0, meta.deadline - time.monotonic()), aj.end, "timeout")
        timed = False
        try:
            async for r in aj:
                if not timed and aj.job.t_first:
                    timed = True
                    self.metrics.ttft.observe(aj.job.t_first - meta.t0)
                yield r
        finally:
            if timer is not None:
                timer.cancel()

    def _timeout_error(self) -> APIError:
        return APIError(504, f"the request did not finish within {self.options.request_timeout:g} s (exl3 serve "
                             f"--request-timeout); its generation was cancelled. Lower max_tokens or raise the timeout",
                        code="timeout")

    async def _whole(self, request: Request, aj: AsyncJob, meta: _Meta, headers: dict[str, str]) -> Response:
        entries: list[TokenLogprob] = []

        async def collect() -> Result:
            last: Result = {}
            async for r in self._results(aj, meta):
                entries.extend(self._logprobs(r, meta))
                last = r
            return last

        consume = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await asyncio.wait({consume, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (consume, watch):
                t.cancel()
            await asyncio.gather(consume, watch, return_exceptions=True)
        if not consume.done() or consume.cancelled():
            aj.cancel()
            raise APIError(499, "the client closed the connection; the request was cancelled",
                           code="client_closed_request")
        last = consume.result()
        if not last or last.get("eos_reason") not in FINISH_REASONS:
            err = self._job_error(last)
            err.headers.update(headers)  # the request id names the job in the server's log and metrics
            raise err
        text = last["full_completion"]
        finish = FINISH_REASONS[last["eos_reason"]]
        usage = self._usage(aj.job, last)
        doc: BaseModel
        want = meta.logprobs is not None
        if meta.chat:
            doc = ChatCompletion(id=meta.id, created=meta.created, model=meta.model, usage=usage,
                                 choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish,
                                                     logprobs=ChatLogprobs(content=entries) if want else None)])
        else:
            lp = completion_logprobs(entries, 0, meta.logprobs or 0)[0] if want else None
            doc = Completion(id=meta.id, created=meta.created, model=meta.model, usage=usage,
                             choices=[CompletionChoice(text=text, finish_reason=finish, logprobs=lp)])
        return _json(doc, headers)

    def _logprobs(self, r: Result, meta: _Meta) -> list[TokenLogprob]:
        """The log probabilities of the tokens ``r`` emits, when the request asked for them."""
        if meta.logprobs is None or not r.get("token_ids"):
            return []
        return token_logprobs(r["token_ids"], r["logits"], meta.logprobs, self._texts)

    async def _events(self, aj: AsyncJob, meta: _Meta) -> collections.abc.AsyncGenerator[str, None]:
        """The SSE payloads of a streamed (chat) completion."""
        exclude = None if meta.include_usage else {"usage"}
        offset = 0  # of the next token's text in the completion (the completions shape's text_offset)

        def chunk(text: str | None, finish: str | None, first: bool = False,
                  entries: list[TokenLogprob] | None = None) -> str:
            nonlocal offset
            doc: BaseModel
            if meta.chat:
                delta = ChatDelta(role="assistant", content="") if first else ChatDelta(content=text)
                lp = ChatLogprobs(content=entries) if entries else None
                doc = ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model,
                                          choices=[ChatChunkChoice(delta=delta, finish_reason=finish, logprobs=lp)])
            else:
                clp = None
                if entries:
                    clp, offset = completion_logprobs(entries, offset, meta.logprobs or 0)
                doc = Completion(id=meta.id, created=meta.created, model=meta.model,
                                 choices=[CompletionChoice(text=text or "", finish_reason=finish, logprobs=clp)])
            return doc.model_dump_json(exclude=exclude)

        if meta.chat:
            yield chunk(None, None, first=True)
        async for r in self._results(aj, meta):
            if r["eos"] and r.get("eos_reason") not in FINISH_REASONS:
                yield json.dumps(self._job_error(r).body())
                return
            entries = self._logprobs(r, meta)
            if r["text"] or entries:
                yield chunk(r["text"], None, entries=entries)
            if r["eos"]:
                yield chunk(None, FINISH_REASONS[r["eos_reason"]])
                if meta.include_usage:
                    usage = self._usage(aj.job, r)
                    doc: BaseModel = (ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model,
                                                          choices=[], usage=usage) if meta.chat else
                                      Completion(id=meta.id, created=meta.created, model=meta.model, choices=[],
                                                 usage=usage))
                    yield doc.model_dump_json()

    @staticmethod
    def _usage(job: Job, last: Result) -> Usage:
        n_in, n_out = len(job.prompt), int(last.get("new_tokens", job.new_tokens))
        return Usage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out)

    def _job_error(self, last: Result) -> APIError:
        if last.get("eos_reason") == "timeout":
            return self._timeout_error()
        if last.get("eos_reason") == "cancelled":
            return APIError(503, "the server is shutting down; the request was cancelled", code="server_shutting_down")
        err = last.get("error")
        if isinstance(err, LoraError):
            return APIError(404, f"the request's LoRA adapter is gone: {err}", code="model_not_found", param="model")
        if isinstance(err, NumericFault):
            return APIError(500, f"generation failed: {err}", code="numeric_fault")
        if isinstance(err, CacheExhausted):
            return APIError(503, f"the server's cache is full ({err}); retry later or with a shorter request",
                            code="cache_exhausted")
        return APIError(500, f"generation failed: {type(err).__name__}: {err}")


@dataclass(frozen=True)
class _Meta:
    id: str
    created: int
    model: str
    chat: bool
    include_usage: bool
    t0: float  # perf_counter at arrival (time to first token)
    deadline: float | None  # monotonic
    logprobs: int | None  # as _Params.logprobs


def _json(doc: BaseModel, headers: dict[str, str] | None = None) -> Response:
    return Response(doc.model_dump_json(), media_type="application/json", headers=headers)
