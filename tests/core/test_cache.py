"""Paged cache: allocator refcounts, prefix-cache hash chain and LRU, the fp16 layer, the Cache."""
from __future__ import annotations

import random

import pytest
import torch

from exl3_core.cache import Cache, CacheExhausted, PageAllocator, page_hashes
from exl3_core.cache.kv import KVCacheLayer
from exl3_core.generator.toy import ToyModel
from exl3_core.plugins import RegistryError


def test_allocate_release_and_exhaustion() -> None:
    a = PageAllocator(4, 16)
    p = a.allocate(3)
    assert len(set(p)) == 3 and a.num_available() == 1
    with pytest.raises(CacheExhausted, match="2 needed"):
        a.allocate(2)
    a.acquire(p[0])
    a.release([p[0]])
    assert a.refcount[p[0]] == 1
    a.release(p)
    assert a.num_available() == 4 and a.num_live() == 0
    with pytest.raises(RuntimeError, match="released more often"):
        a.release([p[0]])
    a.check()


def test_hash_chain_depends_on_all_previous_tokens() -> None:
    t = list(range(64))
    h1 = page_hashes(t, 16)
    t2 = list(t)
    t2[3] = 99  # change in page 0 changes every later hash
    h2 = page_hashes(t2, 16)
    assert len(h1) == 4 and all(x != y for x, y in zip(h1, h2))
    t3 = list(t)
    t3[40] = 99  # change in page 2 leaves pages 0, 1 alone
    assert page_hashes(t3, 16)[:2] == h1[:2] and page_hashes(t3, 16)[2] != h1[2]
    assert page_hashes(t[:20], 16) == h1[:1]


def test_prefix_match_share_and_lru_eviction() -> None:
    a = PageAllocator(4, 4)
    toks = list(range(12))
    hs = page_hashes(toks, 4)
    pages = a.allocate(3)
    for p, h in zip(pages, hs):
        assert a.register(p, h) == p
    # a live page is shared by a second sequence
    m = a.match_prefix(hs[:2])
    assert m == pages[:2] and a.refcount[pages[0]] == 2
    a.release(m)
    a.release(pages)  # all three hashed pages are now cached, oldest release first
    assert a.num_cached() == 3 and a.num_live() == 0
    assert a.peek_prefix(hs) == 3
    # 2 pages needed, 1 free: evicts exactly the least recently released cached page
    got = a.allocate(2)
    assert pages[0] in got and a.peek_prefix(hs) == 0 and a.num_cached() == 2
    assert a.match_prefix(page_hashes(list(range(100, 108)), 4)) == []
    a.check()


def test_duplicate_registration_keeps_first_page() -> None:
    a = PageAllocator(3, 4)
    h = page_hashes([1, 2, 3, 4], 4)[0]
    p1, p2 = a.allocate(2)
    a.register(p1, h)
    a.register(p2, h)  # same tokens computed concurrently: p2 stays private
    assert a.by_hash[h] == p1 and a.page_hash[p2] is None
    a.release([p1, p2])
    assert a.num_cached() == 1
    a.check()


def test_make_private_copies_only_shared_pages() -> None:
    a = PageAllocator(4, 4)
    h = page_hashes([1, 2, 3, 4], 4)[0]
    (p,) = a.allocate(1)
    a.register(p, h)
    assert a.make_private(p) == (p, False) and a.page_hash[p] is None  # sole owner: just unhash
    a.register(p, h)
    a.acquire(p)  # now shared
    q, copy = a.make_private(p)
    assert copy and q != p and a.refcount[p] == 1 and a.refcount[q] == 1
    a.check()


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(0)
    a = PageAllocator(24, 4)
    live: list[list[int]] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            toks = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            hs = page_hashes(toks, 4)
            got = a.match_prefix(hs)
            try:
                fresh = a.allocate(len(hs) - len(got) + 1)
            except CacheExhausted:
                a.release(got)
                continue
            seq = got + fresh
            for p, h in zip(seq[len(got):], hs[len(got):]):
                a.register(p, h)
            live.append(seq)
        elif op < 0.9 and live:
            a.release(live.pop(rng.randrange(len(live))))
        elif op < 0.95:
            a.clear_prefix_cache()
        a.check()
    for seq in live:
        a.release(seq)
    a.check()
    assert a.num_live() == 0 and a.num_available() == a.num_pages


def test_kv_layer_write_read_copy() -> None:
    layer = KVCacheLayer(num_pages=5, page_size=4, num_kv_heads=2, head_dim=8, head_dim_v=6, dtype=torch.float32,
                         device="cpu")
    assert layer.views() == ("kv/fp32",)
    k, v = torch.randn(7, 2, 8), torch.randn(7, 2, 6)
    slots = torch.tensor([17, 18, 19, 0, 1, 2, 3])  # page 4 offsets 1..3, then page 0
    layer.write(k, v, slots)
    kc, vc = layer.attn_tensors()
    assert torch.equal(kc[4, 1:4], k[:3]) and torch.equal(vc[0], v[3:])
    layer.copy_page(4, 2)
    assert torch.equal(kc[2], kc[4]) and torch.equal(vc[2], vc[4])
    assert layer.storage_size() == 5 * 4 * 2 * (8 + 6) * 4
    with pytest.raises(ValueError, match="mla"):
        layer.write(k, None, slots)


def test_cache_builds_layers_and_plans_memory(plugins) -> None:
    m = ToyModel(num_layers=3, num_kv_heads=2, head_dim=8)
    c = Cache(m, max_num_tokens=100, page_size=16, plugins=plugins)
    assert c.num_pages == 7 and c.max_num_tokens == 112 and len(c.layers) == 3
    assert c.scratch_page == 7 and c.layers[0].k.shape == (8, 16, 2, 8)  # + scratch page
    assert Cache.bytes_required(m, 100, page_size=16, plugins=plugins) == c.storage_size()
    with pytest.raises(RegistryError, match="variants for 'kv': fp16"):
        Cache(m, 100, variant="nope", page_size=16, plugins=plugins)


def test_default_page_size_comes_from_settings(plugins, clean_settings) -> None:
    from exl3_core import settings

    clean_settings.setenv("EXL3_PAGE_SIZE", "32")
    settings.reload()
    assert Cache(ToyModel(num_layers=1), 100, plugins=plugins).page_size == 32


def test_cache_made_before_load_is_allocated_by_load_or_the_generator(tmp_path) -> None:
    """Cache(model) before load() reads the model's geometry only; load(caches=[...]) plans and allocates it,
    or a Generator does on first use. The model holds no reference to it: freeing is the cache's."""
    import gc
    import weakref

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from exl3_core import Cache, Config, Generator, Model

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = Model.from_config(Config.from_directory(tmp_path))
    cache = Cache(model, max_num_tokens=512, page_size=256)
    assert cache.layers == [] and cache.storage_size() == 0 and not cache.allocated
    assert [tuple(g) for g in cache.geometry] == [("kv", 2, 16, 16)] * 2
    model.load("cpu", caches=[cache])
    assert len(cache.layers) == 2 and cache.dtype == torch.float32
    expected = 2 * 2 * (2 + 1) * 256 * 2 * 16 * 4  # layers, k+v, pages+scratch, page size, heads, dim, fp32
    assert cache.storage_size() == expected == cache.bytes_for(torch.float32)
    assert model.memory_report()["planned"]["caches"] == expected
    model.unload()
    assert cache.allocated, "the model does not own the cache"
    cache.free()
    assert cache.layers == [] and cache.storage_size() == 0

    late = Cache(model, max_num_tokens=512, page_size=256)
    model.load("cpu")
    assert not late.allocated or late.device == torch.device("cpu")
    Generator(model, late, None)
    assert late.allocated and late.dtype == torch.float32
    ref = weakref.ref(late)
    del late
    gc.collect()
    assert ref() is None, "nothing in the model keeps a cache alive"
    with pytest.raises(ValueError, match="free"):
        c2 = Cache(model, max_num_tokens=64, page_size=16)
        c2.allocate("cpu", torch.float16)
