"""Generator text handling: stop strings across tokens, UTF-8 deltas, banned strings with
rollback, filters, and the asyncio front end."""
from __future__ import annotations

import asyncio

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.cache import Cache
from exl3_core.filters import Filter, unpack_bitmask
from exl3_core.generator import AsyncGenerator, Generator, Job
from exl3_core.cache.geometry import LayerGeometry
from exl3_core.generator.toy import ByteTokenizer, ToyModel, _ToyConfig

TOK = ByteTokenizer(264)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ScriptedModel:
    """Predicts ``script[p + 1]`` at position p (logit 10), else ``fallback`` (logit 5)."""

    def __init__(self, script: list[int], vocab: int = 264, fallback: int = ord("X")) -> None:
        self.script, self.vocab_size, self.fallback = script, vocab, fallback
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.config = _ToyConfig([])
        self.loaded = True

    def cache_geometry(self) -> tuple[LayerGeometry, ...]:
        return (LayerGeometry("kv", 1, 8, 8),)

    def forward_batch(self, meta: BatchMeta, cache=None, *, fp32_logits: bool = True) -> torch.Tensor:
        pos = meta.positions if meta.logits_indices is None else meta.positions[meta.logits_indices]
        out = torch.zeros(pos.numel(), self.vocab_size)
        out[:, self.fallback] = 5.0
        nxt = [self.script[p + 1] if p + 1 < len(self.script) else self.fallback for p in pos.tolist()]
        out[torch.arange(pos.numel()), torch.tensor(nxt)] = 10.0
        return out


def ids_of(pieces: list[bytes]) -> list[int]:
    return [TOK.pieces.index(p) for p in pieces]


def scripted_run(plugins, script: list[int], n_prompt: int, **job_kw) -> tuple[list[dict], Job]:
    m = ScriptedModel(script)
    gen = Generator(m, Cache(m, 1024, page_size=16, plugins=plugins), TOK)
    job = Job(script[:n_prompt], identifier=0, **job_kw)
    gen.enqueue(job)
    results = []
    while gen.num_remaining():
        results += gen.iterate()
    assert gen.cache.allocator.num_live() == 0
    return results, job


def test_stop_string_spanning_tokens_is_never_leaked(plugins) -> None:
    script = ids_of([b"Q", b":"]) + ids_of([b"hello", b" world", b",", b" ", b"S", b"T", b"O", b"P", b" ", b"x"])
    results, _ = scripted_run(plugins, script, 2, max_new_tokens=50, stop_conditions=["STOP", 999])
    deltas = [r["text"] for r in results]
    assert "".join(deltas) == "hello world, "
    assert all("S" not in d for d in deltas)
    assert results[-1]["eos_reason"] == "stop_string" and results[-1]["full_completion"] == "hello world, "
    # a stop string that never completes is released at the end
    results, _ = scripted_run(plugins, script[:8], 2, max_new_tokens=6, stop_conditions=["STOPPED"])
    assert "".join(r["text"] for r in results) == "hello world, ST"
    assert results[-1]["eos_reason"] == "max_new_tokens"


def test_stop_token_ends_without_text(plugins) -> None:
    script = ids_of([b"a", b"b", b"c", b"d"])
    results, _job = scripted_run(plugins, script, 1, max_new_tokens=10, stop_conditions=[ord("d")])
    assert "".join(r["text"] for r in results) == "bc" and results[-1]["stop_token"] == ord("d")
    assert results[-1]["eos_reason"] == "stop_token"


def test_utf8_deltas_never_split_characters(plugins) -> None:
    # "é" split over two tokens, then a token holding "\xa9t\xc3\xa9" (tail of one char, a head+tail)
    script = ids_of([b">", b"\xc3", b"\xa9", b"\xc3", b"\xa9t\xc3\xa9", b"\xe2\x82\xac", b"\xe2", b"\x82", b"\xac"])
    results, _ = scripted_run(plugins, script, 1, max_new_tokens=8)
    deltas = [r["text"] for r in results]
    assert "".join(deltas) == "éété€€" and all("\ufffd" not in d for d in deltas)
    assert "" in deltas or len(deltas) < 8  # some tokens produced no complete character yet


def test_banned_string_rolls_back_and_bans_its_first_token(plugins) -> None:
    text = b"say a bad word now"
    script = list(text)
    results, job = scripted_run(plugins, script, 4, max_new_tokens=len(text) - 4, banned_strings=["bad"])
    out = "".join(r["text"] for r in results)
    # 'b' of "bad" banned at its position: the model's fallback 'X' is used there instead
    assert out == "a Xad word now" and "bad" not in out
    assert job.ban_at == {6: {ord("b")}}


def test_banned_string_rollback_keeps_cache_consistent(plugins) -> None:
    """With real attention: after rollbacks every kept token is still the argmax (among allowed
    tokens) of a fresh full forward over the final sequence, so the cache was rewound right."""
    model = ToyModel(vocab_size=128, hidden=32, num_layers=2, seed=5)
    tok = ByteTokenizer(128)
    prompt = list(b"The quick brown fox")

    def run(**kw) -> tuple[str, Job]:
        gen = Generator(model, Cache(model, 2048, page_size=4, plugins=plugins), tok)
        gen.eos_ids = set()
        job = Job(prompt, max_new_tokens=30, identifier=0, **kw)
        gen.enqueue(job)
        text = ""
        while gen.num_remaining():
            text += "".join(r["text"] for r in gen.iterate())
        assert gen.cache.allocator.num_live() == 0
        return text, job

    free_text, _ = run()
    banned = free_text[10:12]
    text, job = run(banned_strings=[banned])
    assert banned not in text and job.ban_at
    full = model.forward_batch(BatchMeta.full(torch.tensor([job.seq])), None)
    for p in range(len(prompt), len(job.seq)):
        row = full[p - 1].clone()
        row[list(job.ban_at.get(p, ()))] = float("-inf")
        assert int(row.argmax()) == job.seq[p], p


class AllowSet(Filter):
    """Allows only ``allowed`` tokens; completes after ``n`` tokens. Returns a packed bitmask."""

    def __init__(self, allowed: set[int], n: int, vocab: int, background: bool) -> None:
        super().__init__()
        self.allowed, self.n, self.vocab, self.background = allowed, n, vocab, background
        self.count = 0
        self.rebuilds = 0

    def reset(self) -> None:
        self.count = 0
        self.rebuilds += 1

    def accept_token(self, token: int) -> None:
        assert token in self.allowed
        self.count += 1

    def get_next_logit_mask(self) -> torch.Tensor:
        words = torch.zeros((self.vocab + 31) // 32, dtype=torch.int64)
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        return words.to(torch.int32) if self.vocab < 32 else words.view(-1).to(torch.int64).to(torch.int32)

    def is_completed(self) -> bool:
        return self.count >= self.n

    def use_background_worker(self) -> bool:
        return self.background


def test_unpack_bitmask() -> None:
    words = torch.tensor([0b1011, -(2**31)], dtype=torch.int32)  # bits 0,1,3 and bit 63
    m = unpack_bitmask(words, 64)
    assert torch.nonzero(m).flatten().tolist() == [0, 1, 3, 63]


@pytest.mark.parametrize("background", [False, True])
def test_filters_constrain_and_complete(plugins, background: bool) -> None:
    model = ToyModel(vocab_size=128, seed=2)
    gen = Generator(model, Cache(model, 1024, page_size=16, plugins=plugins), ByteTokenizer(128))
    allowed = {ord(c) for c in "xyz"}
    f = AllowSet(allowed, 7, 128, background)
    other = Job(list(b"free"), max_new_tokens=5, identifier="free")
    gen.enqueue([Job(list(b"abc"), max_new_tokens=50, filters=[f], identifier="f", sampler="creative", seed=1), other])
    res: dict = {}
    while gen.num_remaining():
        for r in gen.iterate():
            res.setdefault(r["identifier"], []).append(r)
    text = "".join(r["text"] for r in res["f"])
    assert len(text) == 7 and set(text) <= set("xyz") and res["f"][-1]["eos_reason"] == "filter"
    assert f.journal == tuple(ord(c) for c in text)
    f.rewind(3)  # journal replay when the filter cannot roll back natively
    assert f.count == 4 and f.journal == tuple(ord(c) for c in text[:4])


def test_async_generator_streams_and_cancels(plugins) -> None:
    model = ToyModel(vocab_size=264, seed=4)
    gen = Generator(model, Cache(model, 2048, page_size=16, plugins=plugins), TOK)
    gen.eos_ids = set()
    reference = Generator(model, Cache(model, 2048, page_size=16, plugins=plugins), TOK)
    reference.eos_ids = set()
    want = reference.generate(prompt="abc", max_new_tokens=12)

    async def main() -> tuple[str, bool]:
        agen = AsyncGenerator(gen)
        a = await agen.submit(Job(TOK.encode("abc"), max_new_tokens=12, identifier="a"))
        b = await agen.submit(Job(TOK.encode("zzz"), max_new_tokens=500, identifier="b"))
        started = asyncio.Event()

        async def consume_b() -> None:
            async for _ in b:
                started.set()

        task = asyncio.create_task(consume_b())
        text = ""
        async for r in a:
            text += r["text"]
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await agen.close()
        return text, b.job.status == "cancelled"

    text, cancelled = asyncio.run(main())
    assert text == want and cancelled
    assert gen.num_remaining() == 0 and gen.cache.allocator.num_live() == 0


class FailingModel(ScriptedModel):
    """A scripted model whose forward raises from its ``fail_at``-th call on (a broken step)."""

    def __init__(self, script: list[int], fail_at: int) -> None:
        super().__init__(script)
        self.calls, self.fail_at = 0, fail_at

    def forward_batch(self, meta: BatchMeta, cache=None, *, fp32_logits: bool = True) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("device lost")
        return super().forward_batch(meta, cache, fp32_logits=fp32_logits)


def test_async_generator_failed_step_ends_every_job_with_an_error(plugins) -> None:
    model = FailingModel(list(range(3, 200)), fail_at=4)
    gen = Generator(model, Cache(model, 1024, page_size=16, plugins=plugins), TOK)
    gen.eos_ids = set()

    async def main() -> list[list[dict]]:
        agen = AsyncGenerator(gen)
        jobs = [await agen.submit(Job([3, 4, 5], max_new_tokens=50, identifier=i)) for i in range(3)]

        async def consume(aj) -> list[dict]:
            return [r async for r in aj]

        # without the fix the consumers waited forever: bound the wait
        return await asyncio.wait_for(asyncio.gather(*(consume(aj) for aj in jobs)), timeout=30)

    streams = asyncio.run(main())
    for results in streams:
        last = results[-1]
        assert last["eos"] and last["eos_reason"] == "error"
        assert isinstance(last["error"], RuntimeError) and "device lost" in str(last["error"])
        assert all(not r["eos"] for r in results[:-1])
    assert gen.num_remaining() == 0 and gen.cache.allocator.num_live() == 0
