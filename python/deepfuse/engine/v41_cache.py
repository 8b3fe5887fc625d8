"""The cache of a DeepSeek V4.1 model (models/v41.py): V4's CacheManager with V4.1's layout.

Per layer a sliding-window ring (as V4). Compressed rows, indexer keys and compressor state
rings exist for the kv source layers only (V4.1's KV sharing): a compressed layer's view
holds the pages of the kv source it reads, so sources write and consumers read the same
pages, and an index source that is not a kv source scores its kv source's keys. One
schedule (ratio, no overlap) per ratio of the sources; per ratio one page pool and block
table shared by its sources, whose keys share the pages' ids. Saved prefixes (prefix
caching) as V4's: window rows, the open groups' state rows and references on the pages of
compressed rows and keys. Not built yet: draft-layer rings (DSpark).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from deepfuse import kv_format as F
from deepfuse.step import LayerCacheView

from .allocator import PageAllocator
from .cache import KV_DTYPES, CacheLayout, CacheManager
from .context import CacheGeometry


class V41CacheManager(CacheManager):
    def __init__(self, cfg, *, model_dtype: torch.dtype, device, kv_dtype: str = "auto", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_total_tokens: int = 65536, max_model_len: int = 65536,
                 page_size: int = 64, num_draft_tokens: int = 0, num_mtp_layers: int = 0,
                 num_saved_prefixes: int = 0):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"deepfuse: kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if num_mtp_layers or num_draft_tokens:
            raise ValueError("deepfuse: the V4.1 cache has no draft layers (DSpark) yet")
        self.cfg, self.device = cfg, torch.device(device)
        self.fp8 = kv_dtype == "fp8"
        self.kv_dtype = kv_dtype
        self.dtype = model_dtype if kv_dtype == "auto" else torch.bfloat16
        D, Di = cfg.head_dim, cfg.index_head_dim
        if self.fp8 and (D != F.KV_DIM or Di != F.IDX_DIM):
            raise ValueError(f"deepfuse: kv_dtype 'fp8' stores {F.KV_DIM}-dim KV rows and {F.IDX_DIM}-dim indexer "
                             f"keys; this model has head_dim {D}, index_head_dim {Di} (use 'auto' or 'bf16')")
        if page_size < F.PAGE_ALIGN_ROWS or page_size % F.PAGE_ALIGN_ROWS:
            raise ValueError(f"deepfuse: page_size must be a positive multiple of 16, got {page_size}")
        S = self.num_slots = max_num_seqs
        self.max_total_tokens = max_total_tokens
        self.page_size = ps = page_size
        W = cfg.sliding_window
        Wp = F.round_up(W, F.PAGE_ALIGN_ROWS)
        scratch = -(-max_num_batched_tokens // Wp)
        L = cfg.num_hidden_layers
        self.layer_ratio = list(cfg.ratios)
        sources = list(cfg.kv_source_layers)
        ratios = sorted({cfg.ratios[j] for j in sources}, reverse=True)
        self.geometry = CacheGeometry(W, W, Wp, S * Wp, tuple((r, False) for r in ratios), ps, 0)
        self.num_saved = num_saved_prefixes
        self.saved_base = S + scratch
        self.ring = self._kv_pool(L, S + scratch + num_saved_prefixes + 1, Wp, D)
        self._saved_free = list(range(num_saved_prefixes - 1, -1, -1))
        self.source_pos = {j: [s for s in sources if cfg.ratios[s] == cfg.ratios[j]].index(j) for j in sources}
        self.state_rows, self.pools, self.comp, self.keys, self.states = {}, {}, {}, {}, {}
        self.block_tables, self.host_block_tables = {}, {}
        self.index, self.index_ratio = None, 0
        for r in ratios:
            n = sum(cfg.ratios[j] == r for j in sources)
            P = self._pool_pages(max_total_tokens, r)
            self.pools[r] = PageAllocator(P)
            self.comp[r] = self._kv_pool(n, P + 1, ps, D)
            self.keys[r] = self._index_pool(n, P + 1, ps, Di)
            maxp = max(1, -(-(max_model_len // r) // ps))
            self.block_tables[r] = torch.zeros(S, maxp, dtype=torch.int64, device=self.device)
            self.host_block_tables[r] = np.zeros((S, maxp), dtype=np.int64)
            self.state_rows[r] = (r, r)
            self.states[(r, "attn")] = self._state(n, S * r + num_saved_prefixes * r + 1, D)
        self.layer_pos = [self.source_pos.get(cfg.kv_source_for(i), 0) for i in range(L)]
        self._slots = list(range(S - 1, -1, -1))
        self._pending: list[tuple[int, int, int, int]] = []
        self.journal: Optional[list] = None
        self.used_tokens = 0
        self.peak_used_tokens = 0
        self.evict = None

    def nbytes(self) -> int:
        ts = [self.ring, *self.comp.values(), *self.keys.values(), *(s for pair in self.states.values() for s in pair)]
        return sum(t.numel() * t.element_size() for t in ts)

    def layout(self) -> CacheLayout:
        per_page = [(r, (self.comp[r][:, 0].numel() * self.comp[r].element_size()
                         + self.keys[r][:, 0].numel() * self.keys[r].element_size())) for r in self.pools]
        var = sum((self._pool_pages(self.max_total_tokens, r) + 1) * b for r, b in per_page)
        return CacheLayout(self.device_bytes() - var, tuple(per_page), self.page_size, self.num_slots,
                           2 if self.num_saved else 1)

    def _copy_states(self, r: int, src_rows, dst_rows) -> None:
        if len(src_rows):  # ratio 1 keeps no open group
            super()._copy_states(r, src_rows, dst_rows)

    def restore(self, rc, snap) -> None:
        """CacheManager.restore, whose copy of the partial last page also covers the keys."""
        super().restore(rc, snap)
        for r, pages in snap.pages.items():
            full = (snap.tokens // r) // self.page_size
            if len(pages) > full:  # the snapshot still references its page: the source rows are intact
                self.keys[r][:, rc.pages[r][full]] = self.keys[r][:, pages[full]]

    def layer(self, i: int) -> LayerCacheView:
        """Layer i's ring; a compressed layer also its kv source's rows and keys (and, on the
        source itself, the compressor state rings)."""
        v = LayerCacheView(self.fp8, self.ring[i], self.geometry.ring_page_rows, page_size=self.page_size)
        r = self.layer_ratio[i]
        if r:
            src = self.cfg.kv_source_for(i)
            j = self.source_pos[src]
            v.comp, v.index = self.comp[r][j], self.keys[r][j]
            if src == i:
                kv, sc = self.states[(r, "attn")]
                v.states["attn"] = (kv[j], sc[j])
        return v

    @staticmethod
    def bytes_per_token(cfg, kv_dtype: str, model_dtype: torch.dtype) -> float:
        el = 2 if kv_dtype == "bf16" else torch.empty(0, dtype=model_dtype).element_size()
        kv_row = F.KV_ROW_BYTES if kv_dtype == "fp8" else cfg.head_dim * el
        idx_row = F.IDX_ROW_BYTES if kv_dtype == "fp8" else cfg.index_head_dim * el
        return max(sum((kv_row + idx_row) / cfg.ratios[j] for j in cfg.kv_source_layers), 1.0)
