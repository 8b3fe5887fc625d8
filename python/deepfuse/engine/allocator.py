"""A page allocator with a free list and reference counts (prefix sharing takes references)."""
from __future__ import annotations

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = np.zeros(num_pages, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"deepfuse: page pool exhausted ({n} pages asked, {len(self._free)} free)")
        out = [self._free.pop() for _ in range(n)]
        self._refs[out] = 1
        return out

    def ref(self, pages) -> None:
        """Take one more reference on pages in use."""
        if len(pages) and (self._refs[pages] <= 0).any():
            raise ValueError("deepfuse: ref() on a free page")
        self._refs[pages] += 1

    def free(self, pages) -> None:
        """Drop one reference on each page; pages whose count reaches 0 return to the free list."""
        for p in pages:
            c = self._refs[p]
            if c <= 0:
                raise ValueError(f"deepfuse: page {p} freed twice")
            self._refs[p] = c - 1
            if c == 1:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])
