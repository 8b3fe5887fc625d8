"""The cache of a DeepSeek V4.1 model (models/v41.py): V4's CacheManager with V4.1's layout.

Per layer a sliding-window ring (as V4). Compressed rows, indexer keys and compressor state
rings exist for the kv source layers only (V4.1's KV sharing): a compressed layer's view
holds the pages of the kv source it reads, so sources write and consumers read the same
pages, and an index source that is not a kv source scores its kv source's keys. One
schedule (ratio, no overlap) per ratio of the sources; per ratio one page pool and block
table shared by its sources, whose keys share the pages' ids. Saved prefixes (prefix
caching) as V4's: window rows, the open groups' state rows and references on the pages of
compressed rows and keys. Under speculation (DSpark: V4.1 has no MTP layer) the window rings
hold num_draft_tokens - 1 extra rows and the compressor state rings as many (V4's rule: a
rejected draft never overwrites a live row), and `dspark` holds the drafter's context rings
(engine/dspark_rings.py; the draft stages themselves keep no KV: their block attends to those
rows and to itself).
"""
from __future__ import annotations

import torch

from deepfuse import kv_format as F
from deepfuse.step import LayerCacheView

from .cache import CacheLayout, CacheManager
from .context import CacheGeometry
from .dspark_rings import DSparkRings


class V41CacheManager(CacheManager):
    def __init__(self, cfg, *, model_dtype: torch.dtype, device, kv_dtype: str = "auto", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_total_tokens: int = 65536, max_model_len: int = 65536,
                 page_size: int = 64, num_draft_tokens: int = 0, num_mtp_layers: int = 0,
                 num_saved_prefixes: int = 0, prefix_windows: bool = True):
        # num_mtp_layers: unused (the DSpark stages keep no KV cache)
        # prefix_windows False: saved prefixes keep no window rows (encoder-side replay rebuilds them
        # on a hit: engine/replay.py EncoderReplay); their ring pages are not allocated
        if num_draft_tokens and not (cfg.dspark_block_size and cfg.dspark_target_layer_ids
                                     and cfg.num_nextn_predict_layers):
            raise ValueError("deepfuse: num_draft_tokens > 0 needs a DSpark head (dspark_block_size, "
                             "dspark_target_layer_ids, num_nextn_predict_layers); V4.1 has no MTP layer")
        self._init_settings(cfg, model_dtype, device, kv_dtype, max_num_seqs, max_total_tokens, page_size)
        S, ps, D, Di = max_num_seqs, page_size, cfg.head_dim, cfg.index_head_dim
        W = cfg.sliding_window
        extra = max(num_draft_tokens - 1, 0)  # rejected drafts must not overwrite live ring rows
        Wp = F.round_up(W + extra, F.PAGE_ALIGN_ROWS)
        scratch = -(-max_num_batched_tokens // Wp)
        L = cfg.num_hidden_layers
        self.layer_ratio = list(cfg.ratios)
        sources = list(cfg.kv_source_layers)
        ratios = sorted({cfg.ratios[j] for j in sources}, reverse=True)
        self.geometry = CacheGeometry(W, W + extra, Wp, S * Wp, tuple((r, False) for r in ratios), ps, extra)
        self.prefix_windows = prefix_windows
        self._init_ring(L, Wp, scratch, num_saved_prefixes if prefix_windows else 0)
        if not prefix_windows:  # ring pages: request slots, scratch, trash (no saved windows)
            self.num_saved = num_saved_prefixes
            self._saved_free = list(range(num_saved_prefixes - 1, -1, -1))
        self.source_pos = {j: [s for s in sources if cfg.ratios[s] == cfg.ratios[j]].index(j) for j in sources}
        self.state_rows, self.pools, self.comp, self.keys, self.states = {}, {}, {}, {}, {}
        self.block_tables, self.host_block_tables = {}, {}
        self.index, self.index_ratio = None, 0
        for r in ratios:
            n = sum(cfg.ratios[j] == r for j in sources)
            P = self._add_pool(r, n, max_model_len)
            self.keys[r] = self._index_pool(n, P + 1, ps, Di)
            self.state_rows[r] = (r + extra, r)
            self.states[(r, "attn")] = self._state(n, S * (r + extra) + num_saved_prefixes * r + 1, D)
        self.layer_pos = [self.source_pos.get(cfg.kv_source_for(i), 0) for i in range(L)]
        self.dspark = None
        if num_draft_tokens:
            self.dspark = DSparkRings(cfg.num_nextn_predict_layers, W, D, S, num_saved_prefixes, model_dtype,
                                      self.device)
        self._init_requests()

    def nbytes(self) -> int:
        ts = [self.ring, *self.comp.values(), *self.keys.values(), *(s for pair in self.states.values() for s in pair)]
        return sum(t.numel() * t.element_size() for t in ts) + (self.dspark.nbytes() if self.dspark else 0)

    def admit(self):
        rc = super().admit()
        if self.dspark is not None:
            self.dspark.reset(rc.slot)
        return rc

    def snapshot(self, rc, n: int):
        snap = super().snapshot(rc, n)
        if snap is not None and self.dspark is not None:
            self.dspark.save(rc.slot, snap.slot)
        return snap

    def layout(self) -> CacheLayout:
        per_page = [(r, (self.comp[r][:, 0].numel() * self.comp[r].element_size()
                         + self.keys[r][:, 0].numel() * self.keys[r].element_size())) for r in self.pools]
        var = sum((self._pool_pages(self.max_total_tokens, r) + 1) * b for r, b in per_page)
        return CacheLayout(self.device_bytes() - var, tuple(per_page), self.page_size, self.num_slots,
                           2 if self.num_saved else 1)

    def _copy_states(self, r: int, src_rows, dst_rows) -> None:
        if len(src_rows):  # ratio 1 keeps no open group
            super()._copy_states(r, src_rows, dst_rows)

    def _copy_window(self, src_page: int, src_rows, dst_page: int, dst_rows) -> None:
        if not self.prefix_windows and max(src_page, dst_page) >= self.saved_base:
            return  # windowless prefix entries (encoder-side replay)
        super()._copy_window(src_page, src_rows, dst_page, dst_rows)

    def restore(self, rc, snap) -> None:
        """CacheManager.restore, whose copy of the partial last page also covers the keys. Without
        prefix windows rc is marked (replay_from: the hit's tokens) for the encoder-side replay."""
        super().restore(rc, snap)
        if not self.prefix_windows:
            rc.replay_from = snap.tokens
        if self.dspark is not None:
            self.dspark.load(snap.slot, rc.slot)
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
