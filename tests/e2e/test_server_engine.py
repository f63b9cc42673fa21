"""The server's engine, :class:`AsyncGenerator`, without HTTP: one owner thread applies submits and
cancels between steps, so however consumers are cancelled (twice, at once, while queued) every
job ends and every cache page is freed."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from exl3_core.archkit.batch import BatchMeta
from exl3_core.cache import Cache
from exl3_core.cache.layer import CacheLayers
from exl3_core.generator import AsyncGenerator, AsyncJob, Generator, Job
from exl3_core.generator.toy import ByteTokenizer, ToyModel
from exl3_core.plugins import load_plugins

TOK = ByteTokenizer(264)


def make_generator(max_batch: int = 8, model: ToyModel | None = None) -> Generator:
    plugins = load_plugins(autoload=False)
    model = model or ToyModel(vocab_size=264, seed=5)
    gen = Generator(model, Cache(model, 4096, page_size=16, plugins=plugins), TOK, max_batch_size=max_batch,
                    plugins=plugins)
    gen.eos_ids = set()
    return gen


async def settle(agen: AsyncGenerator, seconds: float = 10.0) -> None:
    """Wait (bounded) until the owner thread reports no job and no page in use."""
    deadline = time.monotonic() + seconds
    while True:
        s = agen.stats
        if s.active_jobs == 0 and s.queued_jobs == 0 and s.pages_in_use == 0:
            return
        assert time.monotonic() < deadline, s
        await asyncio.sleep(0.01)


async def consume(aj: AsyncJob, started: asyncio.Event | None = None) -> list[dict]:
    out = []
    async for r in aj:
        out.append(r)
        if started is not None:
            started.set()
    return out


def test_consumers_cancelled_twice_at_once_free_every_page() -> None:
    gen = make_generator(max_batch=8)

    async def main() -> None:
        agen = AsyncGenerator(gen)
        for round_ in range(10):
            jobs = [await agen.submit(Job(TOK.encode(f"round {round_} job {i}"), max_new_tokens=3000))
                    for i in range(12)]  # 8 run, 4 wait in the queue
            flags = [asyncio.Event() for _ in jobs]
            tasks = [asyncio.create_task(consume(aj, f)) for aj, f in zip(jobs, flags)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags[:8])), 30)
            for t in tasks:  # a second cancel while the first unwinds: what a disconnect watcher does
                t.cancel()
            await asyncio.sleep(0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await settle(agen)
            assert all(aj.job.status == "cancelled" for aj in jobs)
        assert agen.stats.cancelled == 120
        # and the engine still serves
        last = [r async for r in await agen.submit(Job(TOK.encode("after"), max_new_tokens=5))]
        assert last[-1]["eos_reason"] == "max_new_tokens"
        await agen.close()

    asyncio.run(main())
    assert gen.num_remaining() == 0 and gen.cache.allocator.num_live() == 0


def test_end_gives_the_consumer_a_last_result_and_frees_pages() -> None:
    gen = make_generator()

    async def main() -> list[dict]:
        agen = AsyncGenerator(gen)
        aj = await agen.submit(Job(TOK.encode("deadline"), max_new_tokens=3000))
        out = []
        async for r in aj:
            out.append(r)
            if len(out) == 3:
                aj.end("timeout")
        await settle(agen)
        assert agen.stats.cancelled == 1
        await agen.close()
        return out

    out = asyncio.run(main())
    assert out[-1]["eos"] and out[-1]["eos_reason"] == "timeout"
    assert not any(r["eos"] for r in out[:-1])
    assert gen.cache.allocator.num_live() == 0


def test_refused_submit_raises_and_close_ends_live_consumers() -> None:
    gen = make_generator()

    async def main() -> list[dict]:
        agen = AsyncGenerator(gen)
        with pytest.raises(ValueError, match="does not fit"):
            await agen.submit(Job([65] * 5000, max_new_tokens=4))
        aj = await agen.submit(Job(TOK.encode("left running"), max_new_tokens=3000))
        started = asyncio.Event()
        task = asyncio.create_task(consume(aj, started))
        await asyncio.wait_for(started.wait(), 30)
        await agen.close()
        out = await asyncio.wait_for(task, 30)
        with pytest.raises(RuntimeError, match="closed"):
            await agen.submit(Job(TOK.encode("too late"), max_new_tokens=2))
        return out

    out = asyncio.run(main())
    assert out[-1]["eos_reason"] == "cancelled"
    assert gen.num_remaining() == 0 and gen.cache.allocator.num_live() == 0


class FlakyModel(ToyModel):
    """A toy model whose forwards raise while ``broken`` is set."""

    broken = False

    def forward_batch(self, meta: BatchMeta, cache: CacheLayers | None = None, *,
                      fp32_logits: bool = True) -> torch.Tensor:
        if self.broken:
            raise RuntimeError("device lost")
        return super().forward_batch(meta, cache, fp32_logits=fp32_logits)


def test_failed_step_ends_its_jobs_and_the_owner_keeps_serving() -> None:
    model = FlakyModel(vocab_size=264, seed=6)
    gen = make_generator(model=model)

    async def main() -> tuple[list[dict], list[dict]]:
        agen = AsyncGenerator(gen)
        jobs = [await agen.submit(Job(TOK.encode(f"doomed {i}"), max_new_tokens=3000)) for i in range(3)]
        started = asyncio.Event()
        tasks = [asyncio.create_task(consume(aj, started)) for aj in jobs]
        await asyncio.wait_for(started.wait(), 30)
        model.broken = True
        failed = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        model.broken = False
        await settle(agen)
        after = [r async for r in await agen.submit(Job(TOK.encode("recovered"), max_new_tokens=4))]
        assert agen.stats.failed_steps >= 1
        await agen.close()
        return [f[-1] for f in failed], after

    last, after = asyncio.run(main())
    assert all(r["eos_reason"] == "error" and "device lost" in str(r["error"]) for r in last)
    assert after[-1]["eos_reason"] == "max_new_tokens" and sum(len(r["token_ids"]) for r in after) == 4
    assert gen.cache.allocator.num_live() == 0
