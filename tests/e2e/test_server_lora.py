"""LoRA adapters over the OpenAI API: ``/v1/models`` lists ``BASE:ADAPTER``; a request picks an adapter with
``"model": "BASE:ADAPTER"`` (at its ``--lora DIR:WEIGHT`` weight) or the ``loras`` extension field (the ``openai``
client's ``extra_body``), and gets what the generator gives a job with that choice; unknown adapters are
OpenAI-shaped errors; an adapter unloaded while a request runs ends only that request."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_support import VOCAB, request, served

from exl3_core.archkit.config import Config
from exl3_core.archkit.model import Model
from exl3_core.cache import Cache
from exl3_core.generator import Generator, Job
from exl3_core.generator.toy import ByteTokenizer
from exl3_core.server.openai import OpenAIApp
from exl3_core.testing.arch import build_checkpoint, tiny_variants
from exl3_core.testing.lora import random_adapter

PROMPT = [5, 17, 33, 2, 99, 140, 7, 61]
NEW = 6


@pytest.fixture(scope="module")
def served_lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, OpenAIApp, dict[str, str]]]:
    """A tiny Qwen3 (byte vocabulary) with adapters "ad" (default weight 0.5) and "other", served; the text a plain
    generator gives each choice."""
    torch.set_num_threads(1)
    cfg = next(iter(tiny_variants("Qwen3ForCausalLM").values()))
    cfg.vocab_size = VOCAB
    d = tmp_path_factory.mktemp("tiny")
    build_checkpoint("Qwen3ForCausalLM", cfg, d, seed=6)
    model = Model.from_config(Config.from_directory(d)).load()
    linears = {m.key: (m.in_features, m.out_features) for m in model.modules()
               if hasattr(m, "adapters") and ".layers." in getattr(m, "key", "")}
    for name, seed in (("ad", 1), ("other", 2)):
        random_adapter(d.parent / f"{d.name}_{name}", linears, r=4, seed=seed, gain=3.0)
        model.load_lora(d.parent / f"{d.name}_{name}", name=name)
    refs: dict[str, str] = {}
    for key, choice in (("base", None), ("ad@0.5", {"ad": 0.5}), ("ad@1", {"ad": 1.0}),
                        ("mix", {"ad": 0.5, "other": -1.0})):
        gen = Generator(model, Cache(model, max_num_tokens=512, page_size=16), ByteTokenizer(VOCAB))
        job = Job(PROMPT, max_new_tokens=NEW, stop_at_eos=False, loras=choice)
        gen.enqueue(job)
        while gen.num_remaining():
            for r in gen.iterate():
                if r["eos"]:
                    refs[key] = r["full_completion"]
    assert len(set(refs.values())) == 4, "the choices give the same text: the test would be vacuous"
    gen = Generator(model, Cache(model, max_num_tokens=1024, page_size=16), ByteTokenizer(VOCAB), max_batch_size=4)
    app = OpenAIApp(gen, model_id="tiny", lora_weights={"ad": 0.5})
    with served(app) as port:
        yield port, app, refs


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)


def _complete(port: int, **kw: Any) -> Any:
    return _client(port).completions.create(prompt=PROMPT, max_tokens=NEW, temperature=0,
                                            extra_body={"ignore_eos": True, **kw.pop("extra_body", {})}, **kw)


def test_models_list_adapters(served_lora: tuple[int, OpenAIApp, dict]) -> None:
    port, _, _ = served_lora
    assert [m.id for m in _client(port).models.list().data] == ["tiny", "tiny:ad", "tiny:other"]
    assert _client(port).models.retrieve("tiny:ad").id == "tiny:ad"
    with pytest.raises(openai.NotFoundError):
        _client(port).models.retrieve("tiny:nope")


def test_requests_choose_adapters(served_lora: tuple[int, OpenAIApp, dict]) -> None:
    port, _, refs = served_lora

    def text(resp: Any) -> str:
        return str(resp.choices[0].text)

    base = _complete(port, model="tiny")
    assert base.model == "tiny" and text(base) == refs["base"]
    by_model = _complete(port, model="tiny:ad")
    assert by_model.model == "tiny:ad" and text(by_model) == refs["ad@0.5"]
    assert text(_complete(port, model="ad")) == refs["ad@0.5"]
    assert text(_complete(port, model="tiny", extra_body={"loras": {"ad": 1.0}})) == refs["ad@1"]
    assert text(_complete(port, model="tiny:ad", extra_body={"loras": {"other": -1.0}})) == refs["mix"]


def test_unknown_adapters_are_openai_errors(served_lora: tuple[int, OpenAIApp, dict]) -> None:
    port, _, _ = served_lora
    status, body, _ = request(port, "POST", "/v1/completions", {"model": "tiny:nope", "prompt": PROMPT})
    assert status == 404 and body["error"]["code"] == "model_not_found" and "tiny:ad" in body["error"]["message"]
    status, body, _ = request(port, "POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT,
                                                                "loras": {"nope": 1.0}})
    assert status == 400 and body["error"]["param"] == "loras" and "nope" in body["error"]["message"]
    status, body, _ = request(port, "POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT,
                                                                "loras": {"ad": "much"}})
    assert status == 400


def test_unloading_an_adapter_ends_only_its_requests(served_lora: tuple[int, OpenAIApp, dict]) -> None:
    port, app, refs = served_lora
    gen = app.generator
    gen.unload_lora("other")
    try:
        assert [m.id for m in _client(port).models.list().data] == ["tiny", "tiny:ad"]
        status, body, _ = request(port, "POST", "/v1/completions", {"model": "tiny:other", "prompt": PROMPT})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert _complete(port, model="tiny:ad").choices[0].text == refs["ad@0.5"]
    finally:
        gen.load_lora(Path(str(app.generator.model.config.directory) + "_other"), "other")


def test_adapter_unloaded_mid_request_ends_that_request(served_lora: tuple[int, OpenAIApp, dict]) -> None:
    import threading
    import time

    port, app, refs = served_lora
    out: dict[str, Any] = {}

    def long_request() -> None:
        out["other"] = request(port, "POST", "/v1/completions", {"model": "tiny:other", "prompt": PROMPT,
                                                                 "max_tokens": 600, "ignore_eos": True})[:2]

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while app.agen.stats.active_jobs == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.005)
    app.generator.unload_lora("other")
    try:
        assert _complete(port, model="tiny:ad").choices[0].text == refs["ad@0.5"]
        t.join(60)
        status, body = out["other"]
        assert status == 404 and body["error"]["code"] == "model_not_found", body
        assert "'other'" in body["error"]["message"] and "unloaded" in body["error"]["message"]
    finally:
        app.generator.load_lora(Path(str(app.generator.model.config.directory) + "_other"), "other")
