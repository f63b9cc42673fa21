"""Page allocator with reference counts and a prefix cache keyed by a hash chain of token ids.

Invariants (checked by :meth:`PageAllocator.check`):

* every page is in exactly one of three states: *live* (refcount > 0), *cached* (refcount 0, holds
  a full page of known tokens, listed in the LRU) or *free* (refcount 0, no tokens worth keeping);
* a page has a hash only while its contents are exactly the ``page_size`` tokens that hash names,
  chained to the page before it, so two sequences with the same hash at the same page index
  share an identical prefix up to the end of that page;
* cached pages are evicted least-recently-released first, and only when the free list is empty.

Only *full* pages are shared, and a sequence only ever writes past its shared prefix, so shared
pages are never written and no copy-on-write is needed in the normal path (rollback into a
shared page copies it, see :meth:`PageAllocator.make_private`).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class CacheExhausted(RuntimeError):
    """Not enough free cache pages for a request (the job needing them fails, others continue)."""


#: hash the chain starts from (page 0's "previous page")
ROOT_HASH = b"exl3-page-chain"


def chain_hash(prev: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one full page given the previous page's hash.

    Blake2b over the previous hash and the page's ids: collision-safe and stable across runs.
    """
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.digest()


def page_hashes(tokens: Sequence[int], page_size: int, max_pages: int | None = None,
                root: bytes = ROOT_HASH) -> list[bytes]:
    """Hash chain over the full pages of ``tokens`` (at most ``max_pages`` of them), starting from ``root`` (a
    chain whose pages hold other keys and values for the same tokens, e.g. under a LoRA adapter, starts elsewhere)."""
    n = len(tokens) // page_size
    if max_pages is not None:
        n = min(n, max_pages)
    out: list[bytes] = []
    prev = root
    for i in range(n):
        prev = chain_hash(prev, tokens[i * page_size:(i + 1) * page_size])
        out.append(prev)
    return out


class PageAllocator:
    """Host-side bookkeeping for ``num_pages`` cache pages (the tensors live in the cache layers)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"PageAllocator needs at least one page, got num_pages={num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.by_hash: dict[bytes, int] = {}
        # refcount-0 pages with a hash, oldest release first (eviction order)
        self.lru: OrderedDict[int, None] = OrderedDict()
        # LIFO free list: reusing recently freed pages keeps the working set small
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.hits = 0  # pages served from the prefix cache (stats)

    # -- queries ------------------------------------------------------------------------------
    def num_available(self) -> int:
        """Pages that an allocation could obtain now (free plus evictable cached pages)."""
        return len(self.free) + len(self.lru)

    def num_live(self) -> int:
        return sum(1 for r in self.refcount if r > 0)

    def num_cached(self) -> int:
        return len(self.lru)

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh private pages (refcount 1), evicting cached pages LRU-first if needed."""
        if n > self.num_available():
            raise CacheExhausted(
                f"cache has {self.num_available()} free pages of {self.page_size} tokens, {n} needed; "
                f"create the Cache with a larger max_num_tokens or run fewer concurrent jobs")
        out = []
        for _ in range(n):
            if self.free:
                p = self.free.pop()
            else:
                p, _ = self.lru.popitem(last=False)
                h = self.page_hash[p]
                assert h is not None
                del self.by_hash[h]
                self.page_hash[p] = None
            self.refcount[p] = 1
            out.append(p)
        return out

    def acquire(self, page: int) -> None:
        """Add a reference to a live or cached page."""
        if self.refcount[page] == 0:
            if page not in self.lru:
                raise RuntimeError(f"page {page} is free; only live or cached pages can be shared")
            del self.lru[page]
        self.refcount[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; hashed pages go to the LRU, others to the free list."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} released more often than it was acquired")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                if self.page_hash[p] is not None:
                    self.lru[p] = None
                else:
                    self.free.append(p)

    # -- prefix cache -------------------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Acquire the longest run of cached/live pages matching ``hashes`` from the start."""
        out: list[int] = []
        for h in hashes:
            p = self.by_hash.get(h)
            if p is None:
                break
            self.acquire(p)
            out.append(p)
        self.hits += len(out)
        return out

    def peek_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading pages :meth:`match_prefix` would return (no references taken)."""
        n = 0
        for h in hashes:
            if h not in self.by_hash:
                break
            n += 1
        return n

    def register(self, page: int, h: bytes) -> int:
        """Record that live ``page`` now holds the full page hashed ``h``.

        Returns the page that should be used from now on: ``page`` itself, or, when another
        page already holds the same tokens (two jobs computed the same prefix concurrently),
        ``page`` stays private and unhashed so the existing entry keeps serving later jobs.
        """
        if self.refcount[page] <= 0:
            raise RuntimeError(f"page {page} is not live; only live pages can be registered")
        if self.page_hash[page] is not None:
            return page
        if h in self.by_hash:
            return page
        self.page_hash[page] = h
        self.by_hash[h] = page
        return page

    def make_private(self, page: int) -> tuple[int, bool]:
        """Prepare ``page`` (referenced by the caller) to be overwritten.

        Returns ``(page_to_write, needs_copy)``: an unshared page loses its hash and is returned
        as is; a shared page is released and replaced by a fresh one whose contents the caller
        must copy (``CacheLayer.copy_page``) before writing.
        """
        if self.refcount[page] == 1:
            h = self.page_hash[page]
            if h is not None:
                del self.by_hash[h]
                self.page_hash[page] = None
            return page, False
        new = self.allocate(1)[0]
        self.release([page])
        return new, True

    def clear_prefix_cache(self) -> None:
        """Forget every cached (refcount 0) page; live pages keep their hashes."""
        while self.lru:
            p, _ = self.lru.popitem(last=False)
            h = self.page_hash[p]
            assert h is not None
            del self.by_hash[h]
            self.page_hash[p] = None
            self.free.append(p)

    def check(self) -> None:
        """Assert the invariants in the module docstring (tests call this)."""
        free = set(self.free)
        assert len(free) == len(self.free), "page listed twice in the free list"
        for p in range(self.num_pages):
            states = (self.refcount[p] > 0) + (p in self.lru) + (p in free)
            assert states == 1, f"page {p}: refcount={self.refcount[p]} lru={p in self.lru} free={p in free}"
            if p in self.lru:
                assert self.page_hash[p] is not None
            if p in free:
                assert self.page_hash[p] is None
        for h, p in self.by_hash.items():
            assert self.page_hash[p] == h
