"""OpenAI-compatible routes on the continuous-batching generator.

``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream`` true/false) and ``GET /health``. Every request becomes one :class:`Job` submitted to a
single :class:`BatchingGenerator` whose one loop task steps the :class:`Generator` for all of
them, so concurrent HTTP requests share forward passes.

Supported request fields: ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature``,
``top_p``, ``top_k`` and ``min_p`` (extensions), ``repetition_penalty`` (extension),
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``stop``, ``seed``, ``n`` (1 only),
``stream``, ``stream_options.include_usage``, ``ignore_eos`` (extension) and ``response_format``
(``json_object`` / ``json_schema`` through the ``llguidance`` filter plugin). Fields that would
change the answer but are not implemented (``logprobs``, ``tools``, ``echo``, ``suffix``, n > 1)
are refused with 400 rather than ignored.
"""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from exl3_core.cache.pages import CacheExhausted
from exl3_core.generator import AsyncGenerator, AsyncJob, Generator, Job
from exl3_core.generator.generator import Result
from exl3_core.sampling import Sampler, SamplerValueError
from exl3_core.server.http import EventStream, HTTPError, Request, Response, json_response

#: generator ``eos_reason`` -> OpenAI ``finish_reason``
FINISH_REASONS = {"stop_token": "stop", "stop_string": "stop", "filter": "stop", "max_new_tokens": "length",
                  "max_seq_len": "length"}
MAX_STOP_STRINGS = 16


class BatchingGenerator(AsyncGenerator):
    """:class:`AsyncGenerator` that records batch sizes (``max_batch``) and cancellations for the
    server's statistics."""

    def __init__(self, generator: Generator) -> None:
        super().__init__(generator)
        self.steps = 0
        self.batched_steps = 0  # steps that ran more than one job
        self.max_batch = 0
        self.cancelled = 0

    def _iterate(self) -> list[Result]:
        gen = self.generator
        with gen.lock:  # re-entrant; keeps the count below consistent with the step
            results = gen.iterate()
            # jobs in this step = still active + those it finished (admission failures never ran)
            n = len(gen.active) + sum(1 for r in results if r["eos"] and r["job"].t_admit)
        if n:
            self.steps += 1
            self.batched_steps += n > 1
            self.max_batch = max(self.max_batch, n)
        return results

    async def cancel(self, aj: AsyncJob) -> None:
        if aj.job.status in ("queued", "active"):
            self.cancelled += 1
        await super().cancel(aj)


@dataclass
class _Params:
    max_tokens: int | None
    sampler: Sampler
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    response_format: dict[str, Any] | None


def _bad(param: str, message: str) -> HTTPError:
    return HTTPError(400, message, param=param)


def _number(body: dict[str, Any], name: str, default: float | None, *, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False, integer: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise _bad(name, f"'{name}' must be {kind}, got {v!r}")
    if not math.isfinite(v):
        raise _bad(name, f"'{name}' must be finite, got {v!r}")
    below = lo is not None and (v <= lo if lo_open else v < lo)
    above = hi is not None and v > hi
    if below or above:
        lo_s = "" if lo is None else f"{'>' if lo_open else '>='} {lo:g}"
        hi_s = "" if hi is None else f"<= {hi:g}"
        raise _bad(name, f"'{name}' must be {' and '.join(s for s in (lo_s, hi_s) if s)}, got {v!r}")
    return v


def _flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be true or false, got {v!r}")
    return v


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad("n", f"n={n!r} is not supported: this server returns exactly one choice per request; omit 'n' or "
                        f"send n=1 (and send several requests for several samples)")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise _bad("best_of", f"best_of={best_of!r} is not supported; omit it or send 1")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise _bad("logprobs", "logprobs are not supported by this server; omit 'logprobs'/'top_logprobs'")
    if body.get("tools") or body.get("functions"):
        raise _bad("tools", "tool/function calling is not supported by this server; omit 'tools'/'functions'")
    if not chat:
        if body.get("echo"):
            raise _bad("echo", "echo=true is not supported; omit 'echo' and prepend the prompt yourself")
        if body.get("suffix"):
            raise _bad("suffix", "'suffix' (insertion) is not supported; omit it")


def parse_params(body: dict[str, Any], chat: bool) -> _Params:
    """Validate the generation fields of a (chat) completion request (400 naming the field)."""
    _refuse_unsupported(body, chat)
    if "model" in body and body["model"] is not None and not isinstance(body["model"], str):
        raise _bad("model", f"'model' must be a string, got {body['model']!r}")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, None, lo=1, integer=True)
    temperature = _number(body, "temperature", 1.0, lo=0.0)
    top_p = _number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = _number(body, "top_k", 0, lo=-1, integer=True)
    top_k = 0 if top_k == -1 else top_k  # -1 means "disabled" in several servers' dialects
    min_p = _number(body, "min_p", 0.0, lo=0.0, hi=1.0)
    presence = _number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0)
    frequency = _number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)
    repetition = _number(body, "repetition_penalty", 1.0, lo=0.0, lo_open=True)
    seed = _number(body, "seed", None, integer=True)
    if seed is not None:
        seed %= 2**63  # any JSON integer is a valid OpenAI seed; torch wants a 64-bit one
    bias_raw = body.get("logit_bias")
    bias: dict[int, float] = {}
    if bias_raw is not None:
        if not isinstance(bias_raw, dict):
            raise _bad("logit_bias", "'logit_bias' must be an object mapping token ids to biases")
        for k, v in bias_raw.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                raise _bad("logit_bias", f"'logit_bias' key {k!r} is not a token id") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise _bad("logit_bias", f"'logit_bias' value for {k} must be a number in [-100, 100], got {v!r}")
            bias[tid] = float(v)
    stop_raw = body.get("stop")
    stop = [stop_raw] if isinstance(stop_raw, str) else stop_raw if stop_raw is not None else []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", f"'stop' must be a string or a list of strings, got {stop_raw!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise _bad("stream_options", "'stream_options' must be an object and needs stream=true")
    include_usage = bool(opts and _flag(opts, "include_usage"))
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema")):
        raise _bad("response_format", "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                      "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {...}}}")
    try:
        penalties = {"presence_penalty": presence, "frequency_penalty": frequency, "repetition_penalty": repetition,
                     "logit_bias": bias or None}
        if temperature == 0 and presence == 0 and frequency == 0 and repetition == 1 and not bias:
            sampler = Sampler.greedy()  # argmax: the truncations cannot change it
        elif temperature == 0:
            sampler = Sampler.build(temperature=0.0, **penalties)
        else:
            sampler = Sampler.build(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, **penalties)
    except SamplerValueError as e:
        raise HTTPError(400, f"invalid sampling parameters: {e}") from None
    return _Params(max_tokens, sampler, seed, [s for s in stop if s], _flag(body, "ignore_eos"), stream,
                   include_usage, rf if rf and rf.get("type") != "text" else None)


def _message_text(i: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad("messages", f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                       f"are supported, got {str(part)[:80]}")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad("messages", f"messages[{i}].content must be a string or a list of text parts")


class OpenAIApp:
    """The request handler (``await app(request)``) serving one model.

    :param generator: the :class:`Generator` all requests share (its ``max_batch_size`` bounds
        how many run at once; the rest wait in its queue).
    :param tokenizer: default ``generator.tokenizer``; needs ``encode``/``decode`` and, for chat,
        ``apply_chat_template`` with a ``chat_template`` (else messages are joined as
        ``role: content`` lines).
    :param model_id: the name reported by ``/v1/models`` and in responses.
    :param max_context: longest prompt + completion (default: the generator's ``max_seq_len``).
    :param plugins: plugin set providing the ``llguidance`` filter (default: the global one).
    """

    def __init__(self, generator: Generator, tokenizer: Any = None, *, model_id: str = "exl3",
                 max_context: int | None = None, plugins: Any = None) -> None:
        self.generator = generator
        tok = tokenizer if tokenizer is not None else generator.tokenizer
        if tok is None:
            raise ValueError("OpenAIApp needs a tokenizer: pass tokenizer= or build the Generator with one")
        self.tokenizer: Any = tok
        self.model_id = model_id
        self.max_context = min(generator.max_seq_len, max_context or generator.max_seq_len)
        self._plugins = plugins
        self.agen = BatchingGenerator(generator)
        self.created = int(time.time())
        self.routes: dict[str, dict[str, Callable[[Request], Awaitable[Response | EventStream]]]] = {
            "/health": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat_completions},
        }

    async def __call__(self, req: Request) -> Response | EventStream:
        path = req.path.rstrip("/") or "/"
        method = "GET" if req.method == "HEAD" else req.method
        if path.startswith("/v1/models/") and method == "GET":
            return self._model(path.removeprefix("/v1/models/"))
        route = self.routes.get(path)
        if route is None:
            raise HTTPError(404, f"Invalid URL ({req.method} {req.path}): no such route; available: "
                                 f"{', '.join(sorted(self.routes))}", code="unknown_url")
        handler = route.get(method)
        if handler is None:
            raise HTTPError(405, f"{req.method} is not allowed on {path}; use {', '.join(route)}",
                            headers={"Allow": ", ".join(route)})
        return await handler(req)

    async def close(self) -> None:
        """Cancel every running request's job and stop the generator loop."""
        await self.agen.close()

    # -- simple routes ----------------------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "exl3",
                "max_model_len": self.max_context}

    async def _models(self, req: Request) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    def _model(self, name: str) -> Response:
        if name != self.model_id:
            raise HTTPError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                            code="model_not_found", param="model")
        return json_response(self._model_card())

    async def _health(self, req: Request) -> Response:
        gen, alloc = self.generator, self.generator.cache.allocator
        return json_response({
            "status": "ok", "model": self.model_id, "active_jobs": len(gen.active), "queued_jobs": len(gen.queue),
            "steps": self.agen.steps, "batched_steps": self.agen.batched_steps, "max_batch_seen": self.agen.max_batch,
            "cancelled_jobs": self.agen.cancelled,
            "cache": {"pages": alloc.num_pages, "page_size": alloc.page_size, "pages_in_use": alloc.num_live(),
                      "pages_cached": alloc.num_cached()},
        })

    # -- prompts ----------------------------------------------------------------------------------
    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("messages", "'messages' must be a non-empty list of {\"role\", \"content\"} objects")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad("messages", f"messages[{i}] must be an object with a string 'role'")
            entry = {"role": m["role"], "content": _message_text(i, m.get("content"))}
            if isinstance(m.get("name"), str):
                entry["name"] = m["name"]
            clean.append(entry)
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            try:
                text = tok.apply_chat_template(clean, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - templates raise their own errors for unsupported turns
                raise _bad("messages", f"the model's chat template rejected the messages: {e}") from None
            return self._ids(tok.encode(text, add_bos=False))
        text = "".join(f"{m['role']}: {m['content']}\n" for m in clean) + "assistant:"
        return self._ids(tok.encode(text))

    def _text_prompt(self, body: dict[str, Any]) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            ids = self._ids(self.tokenizer.encode(p))
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids = list(p)
        elif isinstance(p, list) and len(p) > 1:
            raise _bad("prompt", f"a batch of {len(p)} prompts is not supported; send one prompt per request")
        else:
            raise _bad("prompt", "'prompt' must be a non-empty string or a list of token ids")
        return ids

    @staticmethod
    def _ids(t: Any) -> list[int]:
        return [int(x) for x in (t.reshape(-1).tolist() if hasattr(t, "reshape") else t)]

    # -- constrained output -----------------------------------------------------------------------
    def _json_filter(self, rf: dict[str, Any]) -> Any:
        if rf["type"] == "json_object":
            schema: Any = {"type": "object"}
        else:
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise _bad("response_format", "response_format json_schema needs \"json_schema\": {\"name\": ..., "
                                              "\"schema\": {...}} with the schema as an object")
        plugins = self._plugins
        if plugins is None:
            from exl3_core.plugins import get_plugins

            plugins = get_plugins()
        try:
            cls = plugins.filter("llguidance")
        except LookupError as e:
            raise _bad("response_format", f"response_format '{rf['type']}' needs the 'llguidance' filter of the "
                                          f"exl3-filters plugin, which is not available: {e}. Install it "
                                          f"(pip install -e plugins/filters) or omit response_format") from None
        kwargs: dict[str, Any] = {"json_schema": schema}
        if self.generator.vocab_size is not None:
            kwargs["n_vocab"] = self.generator.vocab_size  # model vocab may be padded past the tokenizer's
        try:
            return cls(self.tokenizer, **kwargs)
        except (ValueError, TypeError) as e:
            raise _bad("response_format", f"invalid JSON schema in response_format: {e}") from None

    # -- completions ------------------------------------------------------------------------------
    async def _chat_completions(self, req: Request) -> Response | EventStream:
        return await self._complete(req, chat=True)

    async def _completions(self, req: Request) -> Response | EventStream:
        return await self._complete(req, chat=False)

    async def _complete(self, req: Request, chat: bool) -> Response | EventStream:
        body = req.json()
        if not isinstance(body, dict):
            raise HTTPError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        p = parse_params(body, chat)
        ids = self._chat_prompt(body) if chat else self._text_prompt(body)
        room = self.max_context - len(ids)
        if room < 1 or (p.max_tokens is not None and p.max_tokens > room):
            raise HTTPError(400, f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                                 f"{len(ids)} tokens and max_tokens is {p.max_tokens if p.max_tokens else 'at least 1'}. "
                                 f"Shorten the prompt or lower max_tokens", param="messages" if chat else "prompt",
                            code="context_length_exceeded")
        filters = []
        if p.response_format is not None:
            # building the engine's vocabulary can take a second: keep the event loop free
            filters.append(await asyncio.get_running_loop().run_in_executor(None, self._json_filter,
                                                                            p.response_format))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            job = Job(ids, max_new_tokens=p.max_tokens or room, sampler=p.sampler, seed=p.seed,
                      stop_conditions=p.stop, stop_at_eos=not p.ignore_eos, filters=filters, identifier=rid)
            aj = await self.agen.submit(job)
        except SamplerValueError as e:
            raise HTTPError(400, f"invalid sampling parameters: {e}", param="logit_bias") from None
        except (ValueError, TypeError) as e:
            raise HTTPError(400, str(e)) from None
        meta = {"id": rid, "created": int(time.time()), "model": self.model_id}
        headers = {"X-Request-Id": rid}
        if p.stream:
            return EventStream(self._stream(aj, meta, chat, p.include_usage), headers=headers,
                               on_close=lambda: self._abandon(aj))
        last: Result = {}
        try:
            async for r in aj:
                last = r
        finally:
            await self._abandon(aj)
        if last.get("eos_reason") == "error" or not last:
            raise self._job_error(last)
        text = last["full_completion"]
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": FINISH_REASONS[last["eos_reason"]]}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return json_response({**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                              "usage": self._usage(job, last)}, headers=headers)

    async def _abandon(self, aj: AsyncJob) -> None:
        if not aj.done:
            await aj.cancel()

    @staticmethod
    def _usage(job: Job, last: Result) -> dict[str, int]:
        n_in, n_out = len(job.prompt), int(last.get("new_tokens", job.new_tokens))
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    @staticmethod
    def _job_error(last: Result) -> HTTPError:
        err = last.get("error")
        if isinstance(err, CacheExhausted):
            return HTTPError(503, f"the server's cache is full ({err}); retry later or with a shorter request",
                             type="server_error", code="cache_exhausted")
        return HTTPError(500, f"generation failed: {type(err).__name__}: {err}")

    async def _stream(self, aj: AsyncJob, meta: dict[str, Any], chat: bool, include_usage: bool) -> AsyncIterator[Any]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                    {"content": text} if text is not None else {})
                c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = {**meta, "object": obj, "choices": [c]}
            if include_usage:
                out["usage"] = None
            return out

        if chat:
            yield chunk(None, None, first=True)
        async for r in aj:
            if r.get("eos_reason") == "error":
                yield self._job_error(r).body()
                return
            if r["text"]:
                yield chunk(r["text"], None)
            if r["eos"]:
                yield chunk(None, FINISH_REASONS[r["eos_reason"]])
                if include_usage:
                    yield {**meta, "object": obj, "choices": [], "usage": self._usage(aj.job, r)}
