"""LLGuidanceFilter and FormatronFilter on the real default model's tokenizer and weights.

* JSON-schema-constrained greedy generation (a plain ``model.forward`` loop, and the Generator)
  yields JSON that ``jsonschema`` validates;
* rewinding restores the exact state (native rollback and the reset-and-replay path);
* every token a mask allows is accepted by the engine, disallowed ones are refused, and the
  packed bitmask decodes (``unpack_bitmask``) to the engine's own allowed set;
* invalid grammars / schemas fail at construction with the engine's message.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("llguidance")
pytest.importorskip("formatron")
jsonschema = pytest.importorskip("jsonschema")

from exl3_filters.formatron_filter import FormatronFilter  # noqa: E402 (after the importorskips)
from exl3_filters.llg import LLGuidanceFilter  # noqa: E402 (after the importorskips)

from exl3_core.filters.base import Filter, unpack_bitmask  # noqa: E402 (after the importorskips)

_CORE_TESTS = Path(__file__).resolve().parents[3] / "tests" / "core"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer"},  # no bounds: formatron 0.5.0 cannot enforce them (see README)
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
VALID_JSON = '{"name": "Ada", "age": 36}'
PROMPT = "Describe a fictional person as JSON with a name and an age."
# the cache-less loop re-runs the whole sequence every step: a short plain-text prompt keeps it cheap
RAW_PROMPT = "Alice is 30 years old. As JSON: "
MAX_NEW = 40


def _smol_dir() -> Path:
    if not (_CORE_TESTS / "smol_gguf.py").is_file():
        pytest.skip("tests/core/smol_gguf.py not found (run from the exl3 repository)")
    if str(_CORE_TESTS) not in sys.path:
        sys.path.insert(0, str(_CORE_TESTS))
    import smol_gguf  # the session-wide import of the default model, shared with the core tests

    get = getattr(smol_gguf, "imported_model", None) or getattr(smol_gguf, "imported_fp32", None)
    if get is None:
        pytest.skip("tests/core/smol_gguf.py has no imported_model()/imported_fp32() helper")
    return Path(get())


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return _smol_dir()


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Any:
    from exl3_core.tokenizer import Tokenizer

    return Tokenizer.from_directory(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    from exl3_core.archkit.config import Config
    from exl3_core.archkit.model import Model

    m = Model.from_config(Config.from_directory(model_dir))
    # fp32 on CPU (bf16 matmuls are slow there); the pure-torch attention backend runs anywhere
    m.load("cpu", dtype=torch.float32, attention=["torch"])
    return m


# -- factories: (name, build(tok, constraint kwargs) -> Filter) --------------------------------------
def _llg(tok: Any, **kw: Any) -> Filter:
    return LLGuidanceFilter(tok, **kw)


def _llg_replay(tok: Any, **kw: Any) -> Filter:
    """llguidance with native rollback switched off, to exercise the base class's replay path."""
    f = LLGuidanceFilter(tok, **kw)
    f.rollback_tokens = lambda n: False  # type: ignore[method-assign]
    return f


def _formatron(tok: Any, **kw: Any) -> Filter:
    return FormatronFilter(tok, **kw)


FACTORIES: dict[str, Callable[..., Filter]] = {"llguidance": _llg, "formatron": _formatron}
ROLLBACK_FACTORIES: dict[str, Callable[..., Filter]] = {
    "llguidance-native": _llg,
    "llguidance-replay": _llg_replay,
    "formatron-replay": _formatron,
}


def _prompt_ids(tok: Any) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=True)
    return [int(t) for t in ids.reshape(-1).tolist()]


def _check_json(text: str) -> Any:
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    return obj


# -- generation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", list(FACTORIES))
def test_greedy_forward_loop_yields_schema_valid_json(engine: str, tok: Any, model: Any) -> None:
    flt = FACTORIES[engine](tok, json_schema=SCHEMA)
    flt.attach()
    seq = tok.encode_ids(RAW_PROMPT, add_bos=None)
    out: list[int] = []
    eos = set(tok.eos_token_ids)
    with torch.inference_mode():
        for _ in range(MAX_NEW):
            logits = model.forward(torch.tensor([seq]))[0, -1].float()
            m = flt.mask(logits.numel())
            assert m is not None and m.any(), f"{engine}: empty mask after {tok.decode(out)!r}"
            t = int(logits.masked_fill(~m, float("-inf")).argmax())
            if t in eos:
                break
            flt.feed(t)
            seq.append(t)
            out.append(t)
            if flt.is_completed():
                break
    text = tok.decode(out)
    assert flt.is_completed() or isinstance(flt, LLGuidanceFilter) and flt.is_accepting(), (
        f"{engine}: constraint not finished within {MAX_NEW} tokens: {text!r}"
    )
    obj = _check_json(text)
    if isinstance(flt, FormatronFilter):  # formatron parses its own capture: must agree with json.loads
        assert flt.captures["json"] == obj


def test_generator_jobs_with_filters_yield_schema_valid_json(tok: Any, model: Any) -> None:
    from exl3_core.cache import Cache
    from exl3_core.generator import Generator, Job

    filters = {name: make(tok, json_schema=SCHEMA) for name, make in FACTORIES.items()}
    gen = Generator(model, Cache(model, max_num_tokens=256), tok, max_seq_len=256)
    prompt = _prompt_ids(tok)
    # both filtered jobs share the generator's batched forward passes
    jobs = [Job(prompt, max_new_tokens=MAX_NEW, filters=[f], identifier=name) for name, f in filters.items()]
    gen.enqueue(jobs)
    text: dict[str, str] = {}
    reason: dict[str, str] = {}
    while gen.num_remaining():
        for r in gen.iterate():
            if r.get("error") is not None:
                raise AssertionError(f"{r['identifier']}: job failed: {r['error']}")
            if r["eos"]:
                text[r["identifier"]], reason[r["identifier"]] = r["full_completion"], r["eos_reason"]
    assert set(text) == set(filters)
    for name, f in filters.items():
        assert f.is_completed(), (
            f"{name}: job ended ({reason[name]}) before the schema was complete: {text[name]!r}"
        )
        assert reason[name] in ("filter", "stop_token")
        obj = _check_json(text[name])
        assert _check_json(tok.decode(list(f.journal))) == obj  # the filter saw exactly the emitted tokens


# -- rollback ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(ROLLBACK_FACTORIES))
def test_rewind_restores_state_exactly(kind: str, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    make = ROLLBACK_FACTORIES[kind]
    ids = tok.encode_ids(VALID_JSON, add_bos=False)
    V = tok.vocab_size
    flt = make(tok, json_schema=SCHEMA)
    replays: list[int] = []
    orig_rebuild = flt._rebuild
    monkeypatch.setattr(flt, "_rebuild", lambda toks: (replays.append(len(toks)), orig_rebuild(toks)))
    for n, m in [(2, 3), (4, len(ids) - 4), (0, 5), (5, 1)]:
        flt.attach()
        for t in ids[:n]:
            flt.feed(t)
        snapshot = flt.mask(V)
        for t in ids[n : n + m]:
            flt.feed(t)
        flt.rewind(m)
        assert flt.journal == tuple(ids[:n])
        assert torch.equal(flt.mask(V), snapshot), f"{kind}: mask after rewind({m}) differs from before"
        # and equals a fresh filter fed the same prefix (the state is not merely mask-equal by chance)
        fresh = make(tok, json_schema=SCHEMA)
        fresh.attach()
        for t in ids[:n]:
            fresh.feed(t)
        assert torch.equal(fresh.mask(V), snapshot)
        # the rewound filter carries on to a complete document
        for t in ids[n:]:
            flt.feed(t)
        assert flt.is_completed()
    if kind == "llguidance-native":
        assert replays == [], "llguidance rewinds natively; the replay path should not run"
    else:
        assert replays == [2, 4, 0, 5], f"{kind}: expected one replay per rewind, got {replays}"


def test_rewind_after_completion_reopens_the_document(tok: Any) -> None:
    ids = tok.encode_ids(VALID_JSON, add_bos=False)
    for name, make in FACTORIES.items():
        flt = make(tok, json_schema=SCHEMA)
        flt.attach()
        for t in ids:
            flt.feed(t)
        assert flt.is_completed()
        flt.rewind(1)
        assert not flt.is_completed(), name
        assert flt.mask(tok.vocab_size)[ids[-1]], f"{name}: the last token must be allowed again"


# -- masks against the engines -------------------------------------------------------------------
def _engine_allowed(flt: Filter, V: int) -> torch.Tensor:
    """The engine's own allowed set, through an API other than the bitmask the filter returns."""
    if isinstance(flt, LLGuidanceFilter):
        bias = torch.frombuffer(bytearray(flt._matcher.compute_logit_bias()), dtype=torch.uint8)
        return bias[:V] > 0
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[list(flt.formatter.get_allowed_tokens_since_last_computation())] = True
    return allowed


@pytest.mark.parametrize("engine", list(FACTORIES))
def test_bitmask_layout_matches_engine_allowed_set(engine: str, tok: Any) -> None:
    V = tok.vocab_size
    flt = FACTORIES[engine](tok, json_schema=SCHEMA)
    flt.attach()
    ids = tok.encode_ids(VALID_JSON, add_bos=False)
    for k in range(len(ids)):
        raw = flt.get_next_logit_mask()
        assert raw.dtype == torch.int32 and raw.numel() == (V + 31) // 32
        unpacked = unpack_bitmask(raw, V)
        ref = _engine_allowed(flt, V)
        assert torch.equal(unpacked, ref), f"{engine}: bitmask != engine's allowed set after {k} tokens"
        assert torch.equal(flt.mask(V), ref)
        assert unpacked[ids[k]], f"{engine}: token {ids[k]} of a valid document is masked out"
        flt.feed(ids[k])


@pytest.mark.parametrize("engine", list(FACTORIES))
def test_allowed_tokens_are_accepted_and_disallowed_refused(engine: str, tok: Any) -> None:
    rng = random.Random(0)
    V = tok.vocab_size
    ids = tok.encode_ids(VALID_JSON, add_bos=False)
    flt = FACTORIES[engine](tok, json_schema=SCHEMA)
    flt.attach()
    for k in range(len(ids)):
        mask = flt.mask(V)
        allowed = mask.nonzero().flatten().tolist()
        banned = (~mask).nonzero().flatten().tolist()
        picks = rng.sample(allowed, min(12, len(allowed))) + [allowed[0], allowed[-1]]
        for t in picks:
            flt.feed(t)  # must not raise
            flt.rewind(1)
        for t in rng.sample(banned, min(12, len(banned))):
            with pytest.raises(ValueError, match=type(flt).__name__):
                flt.feed(t)
        assert flt.journal == tuple(ids[:k]) and torch.equal(flt.mask(V), mask), (
            "state changed by a refused token"
        )
        flt.feed(ids[k])


@pytest.mark.parametrize("engine", list(FACTORIES))
def test_mask_covers_padded_model_vocab(engine: str, tok: Any) -> None:
    V = tok.vocab_size
    flt = FACTORIES[engine](tok, regex=r"[0-9]{2}", n_vocab=V + 40)
    flt.attach()
    raw = flt.get_next_logit_mask()
    assert raw.numel() == (V + 40 + 31) // 32
    m = flt.mask(V + 40)
    assert not m[V:].any(), "ids past the tokenizer's vocabulary must never be allowed"
    digits = [i for i, b in enumerate(tok.get_vocab_bytes()) if b and b.isdigit() and len(b) <= 2]
    assert digits and bool(m[digits].all())
    assert torch.equal(m[:V], FACTORIES[engine](tok, regex=r"[0-9]{2}").mask(V))
    with pytest.raises(ValueError, match="n_vocab"):
        FACTORIES[engine](tok, regex="a", n_vocab=V - 1)


# -- other constraint kinds ----------------------------------------------------------------------
@pytest.mark.parametrize("engine", list(FACTORIES))
def test_regex_constraint_completes(engine: str, tok: Any) -> None:
    flt = FACTORIES[engine](tok, regex=r"[0-9]{3}-[a-z]{2}")
    flt.attach()
    for t in tok.encode_ids("123-ab", add_bos=False):
        assert flt.mask(tok.vocab_size)[t]
        flt.feed(t)
    assert flt.is_completed()
    for bad in tok.encode_ids("12x", add_bos=False)[-1:]:
        flt.attach()
        for t in tok.encode_ids("12", add_bos=False):
            flt.feed(t)
        assert not flt.mask(tok.vocab_size)[bad]


def test_llguidance_lark_and_raw_grammar(tok: Any) -> None:
    lark = 'start: "yes" | "no"'
    for flt in (
        LLGuidanceFilter(tok, lark=lark),
        LLGuidanceFilter(tok, grammar={"grammars": [{"lark_grammar": lark}]}),
    ):
        flt.attach()
        for t in tok.encode_ids("no", add_bos=False):
            flt.feed(t)
        assert flt.is_completed()
        assert flt.use_background_worker()


def test_formatron_custom_builder(tok: Any) -> None:
    from exl3_filters.formatron_filter import _import_formatron

    FormatterBuilder = _import_formatron()[0]
    fb = FormatterBuilder()
    fb.append_str(f"Answer: {fb.regex('(yes|no)', capture_name='ans')}.")
    flt = FormatronFilter(tok, formatter_builder=fb)
    flt.attach()
    for t in tok.encode_ids("Answer: no.", add_bos=False):
        assert flt.mask(tok.vocab_size)[t]
        flt.feed(t)
    assert flt.is_completed() and flt.captures["ans"].group(0) == "no"  # regex captures are re.Match
    assert flt.mask(tok.vocab_size).nonzero().flatten().tolist() == sorted(set(tok.eos_token_ids))


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "engine,kwargs,fragment",
    [
        ("llguidance", {"json_schema": {"type": "objekt"}}, "objekt"),
        ("llguidance", {"json_schema": '{"type": "object",'}, "json_schema"),
        ("llguidance", {"regex": "a(b"}, "unclosed group"),
        ("llguidance", {"lark": "start: undefined_rule"}, "undefined_rule"),
        ("llguidance", {"grammar": {"grammars": [{"lark_grammar": "start: ("}]}}, "grammar"),
        ("formatron", {"json_schema": {"type": "string"}}, "Root schema type"),
        ("formatron", {"json_schema": {"type": "object", "properties": {"a": {"type": 5}}}}, "json_schema"),
        ("formatron", {"json_schema": "{not json"}, "not valid JSON"),
        (
            "formatron",
            {"json_schema": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}},
            "#/properties/n",
        ),
        ("formatron", {"regex": "a(b"}, "regex"),
        ("formatron", {"formatter_builder": "nope"}, "FormatterBuilder"),
    ],
)
def test_invalid_constraint_fails_at_construction(
    engine: str, kwargs: dict[str, Any], fragment: str, tok: Any
) -> None:
    cls = {"llguidance": LLGuidanceFilter, "formatron": FormatronFilter}[engine]
    with pytest.raises(ValueError) as err:
        cls(tok, **kwargs)
    msg = str(err.value)
    assert msg.startswith(f"{cls.__name__}: invalid {next(iter(kwargs))}"), msg
    assert fragment in msg, msg


@pytest.mark.parametrize("cls", [LLGuidanceFilter, FormatronFilter])
def test_exactly_one_constraint(cls: type, tok: Any) -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        cls(tok)
    with pytest.raises(ValueError, match="got json_schema, regex"):
        cls(tok, json_schema=SCHEMA, regex="a")


# -- plugin registration -------------------------------------------------------------------------
def test_plugin_registers_both_filters() -> None:
    from exl3_filters import plugin

    from exl3_core.plugins import load_plugins

    plugins = load_plugins(autoload=False, extra=[plugin])
    specs = plugins.filter_specs()
    assert specs["llguidance"].requires == ("llguidance",)
    assert specs["formatron"].requires == ("formatron",)
    assert plugins.filter("llguidance") is LLGuidanceFilter
    assert plugins.filter("formatron") is FormatronFilter
