"""The hybrid V4 cache of the running requests: one manager for every layer's state.

Per main layer: a sliding-window ring per request slot (plus the scratch pages a step writes
its own rows to, see engine/context.py). Per compressed layer: paged compressed KV rows (CSA
1 row per 4 tokens, HCA 1 per 128) and, on CSA layers, paged indexer keys on the same page
ids; and per request slot the compressor state rings (un-pooled projections). Formats:
"fp8" = kv_format's serving rows (584-byte KV rows, 132-byte indexer keys; needs head_dim
512 and index_head_dim 128); "bf16" and "auto" (the model dtype: lossless) = dense rows
[pages, page_size, dim] of any width. Every dense pool has one trash page at its end: slot
-1 stores land there, so stores need no masking (no host sync).

Capacity is counted in context tokens: a request holding n tokens reserves n of
max_total_tokens; the page pools are sized so that they cannot run out before that budget
does (ceil(budget / (ratio * page_size)) pages + one partial page per request slot).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from deepfuse import kv_format as F
from deepfuse.step import LayerCacheView  # re-exported

from .allocator import PageAllocator
from .context import CacheGeometry
from .sampler import to_device

KV_DTYPES = ("auto", "fp8", "bf16")
CPU_TOTAL_TOKENS = 1 << 17  # max_total_tokens on the CPU when not given


@dataclass
class Snapshot:
    """A saved prefix state: `tokens` computed tokens; saved window / state slot; page refs."""

    tokens: int
    slot: int
    pages: dict


@dataclass
class ReqCache:
    """What one running request holds."""

    slot: int
    tokens: int = 0                                # context tokens reserved
    pages: dict = field(default_factory=dict)      # ratio -> list of page ids (block table row)
    page_limit: int = -1                           # most tokens the pages held can serve


@dataclass(frozen=True)
class CacheLayout:
    """A cache's device bytes as a function of max_total_tokens: the fixed part (window rings,
    compressor states, block tables) and per ratio the bytes of one page over its layers."""

    fixed: int
    pools: tuple                  # (ratio, bytes of one page: compressed rows + indexer keys of every layer)
    page_size: int
    num_slots: int
    factor: int = 1               # 2 with saved prefixes

    def bytes(self, tokens: int) -> int:
        return self.fixed + sum(((-(-tokens // (r * self.page_size)) + self.num_slots) * self.factor + 1) * b
                                for r, b in self.pools)


class CacheManager:
    def __init__(self, cfg, *, model_dtype: torch.dtype, device, kv_dtype: str = "auto", max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_total_tokens: int = 65536, max_model_len: int = 65536,
                 page_size: int = 64, num_draft_tokens: int = 0, num_mtp_layers: int = 0,
                 num_saved_prefixes: int = 0):
        self._init_settings(cfg, model_dtype, device, kv_dtype, max_num_seqs, max_total_tokens, page_size)
        S, ps, D, Di = max_num_seqs, page_size, cfg.head_dim, cfg.index_head_dim
        W = cfg.sliding_window
        extra = max(num_draft_tokens - 1, 0)  # rejected drafts must not overwrite live ring rows
        Wr = W + extra
        Wp = F.round_up(Wr, F.PAGE_ALIGN_ROWS)
        scratch = -(-max_num_batched_tokens // Wp)
        # main layers, then the MTP (draft) layers: layer(len(cfg.layer_types) + j) is MTP layer j
        types = list(cfg.layer_types) + list(cfg.mtp_layer_types[:num_mtp_layers])
        self.layer_ratio = [cfg.compress_ratio(t) for t in types]
        schedules = []
        for t in types:
            r = cfg.compress_ratio(t)
            if r and (r, t == "compressed_sparse_attention") not in schedules:
                schedules.append((r, t == "compressed_sparse_attention"))
        self.geometry = CacheGeometry(W, Wr, Wp, S * Wp, tuple(schedules), ps, extra)
        self._init_ring(len(types), Wp, scratch, num_saved_prefixes)
        self.state_rows: dict[int, tuple[int, int]] = {}  # ratio -> (ring rows Rs, live rows R0)
        # compressed pools per ratio: layers of that ratio, pages sized from the token budget
        self.pools: dict[int, PageAllocator] = {}
        self.comp: dict[int, torch.Tensor] = {}
        self.index: Optional[torch.Tensor] = None
        self.index_ratio = 0
        self.states: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.block_tables: dict[int, torch.Tensor] = {}      # ratio -> [slots, max_pages] on the device
        self.host_block_tables: dict[int, np.ndarray] = {}   # and its host copy
        self.layer_pos: list[int] = []  # index of layer i among the layers of its ratio
        counts: dict[int, int] = {}
        for r in self.layer_ratio:
            self.layer_pos.append(counts.get(r, 0))
            counts[r] = counts.get(r, 0) + 1
        for r, overlap in schedules:
            n = counts[r]
            P = self._add_pool(r, n, max_model_len)
            R0 = 2 * r if overlap else r
            R = R0 + extra
            self.state_rows[r] = (R, R0)
            coff = 2 if overlap else 1
            rows = S * R + num_saved_prefixes * R0 + 1  # request rings, saved prefix states, trash
            self.states[(r, "attn")] = self._state(n, rows, coff * D)
            if overlap:
                self.index = self._index_pool(n, P + 1, ps, Di)
                self.index_ratio = r
                self.states[(r, "index")] = self._state(n, rows, coff * Di)
        self._init_requests()

    def _init_settings(self, cfg, model_dtype: torch.dtype, device, kv_dtype: str, max_num_seqs: int,
                       max_total_tokens: int, page_size: int) -> None:
        """The checked settings every cache layout keeps: row format and dtype, slots, budget, page size."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"deepfuse: kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        self.cfg, self.device = cfg, torch.device(device)
        self.fp8 = kv_dtype == "fp8"
        self.kv_dtype = kv_dtype
        self.dtype = model_dtype if kv_dtype == "auto" else torch.bfloat16
        D, Di = cfg.head_dim, cfg.index_head_dim
        if self.fp8 and (D != F.KV_DIM or Di != F.IDX_DIM):
            raise ValueError(f"deepfuse: kv_dtype 'fp8' stores V4's {F.KV_DIM}-dim KV rows and {F.IDX_DIM}-dim indexer "
                             f"keys; this model has head_dim {D}, index_head_dim {Di} (use 'auto' or 'bf16')")
        if page_size < F.PAGE_ALIGN_ROWS or page_size % F.PAGE_ALIGN_ROWS:
            raise ValueError(f"deepfuse: page_size must be a positive multiple of 16, got {page_size}")
        self.num_slots = max_num_seqs
        self.max_total_tokens = max_total_tokens
        self.page_size = page_size

    def _init_ring(self, L: int, Wp: int, scratch: int, num_saved: int) -> None:
        """The window rings of L layers, Wp rows a page: request slots, scratch, saved prefix windows, trash."""
        self.num_saved = num_saved
        self.saved_base = self.num_slots + scratch
        self.ring = self._kv_pool(L, self.num_slots + scratch + num_saved + 1, Wp, self.cfg.head_dim)
        self._saved_free = list(range(num_saved - 1, -1, -1))

    def _add_pool(self, r: int, n: int, max_model_len: int) -> int:
        """Ratio r's page pool, compressed rows of its n layers and block tables -> its pages P
        (the trash page P not counted)."""
        S, ps = self.num_slots, self.page_size
        P = self._pool_pages(self.max_total_tokens, r)
        self.pools[r] = PageAllocator(P)
        self.comp[r] = self._kv_pool(n, P + 1, ps, self.cfg.head_dim)
        maxp = max(1, -(-(max_model_len // r) // ps))
        self.block_tables[r] = torch.zeros(S, maxp, dtype=torch.int64, device=self.device)
        self.host_block_tables[r] = np.zeros((S, maxp), dtype=np.int64)
        return P

    def _init_requests(self) -> None:
        """No request yet: every slot free, no pending block-table entry, no token reserved."""
        self._slots = list(range(self.num_slots - 1, -1, -1))
        self._pending: list[tuple[int, int, int, int]] = []  # (ratio, slot, column, page)
        self.journal: Optional[list] = None  # a list: flush() also appends the entries it writes (tensor parallel)
        self.used_tokens = 0
        self.peak_used_tokens = 0
        self.evict = None  # callback(pages_needed) -> bool: free index-held pages (the prefix cache)

    # ------------------------------------------------------------------ storage
    def _pool_pages(self, tokens: int, r: int) -> int:
        """Pages of ratio r's pool for a budget of `tokens` (the trash page not counted)."""
        P = -(-tokens // (r * self.page_size)) + self.num_slots
        return 2 * P if self.num_saved else P  # saved prefixes: pages the prefix index holds beyond the requests'

    def _kv_pool(self, L: int, P: int, ps: int, D: int) -> torch.Tensor:
        if self.fp8:
            return torch.zeros(L, P, ps * F.KV_ROW_BYTES, dtype=torch.uint8, device=self.device)
        return torch.zeros(L, P, ps, D, dtype=self.dtype, device=self.device)

    def _index_pool(self, L: int, P: int, ps: int, Di: int) -> torch.Tensor:
        if self.fp8:
            return torch.zeros(L, P, ps * F.IDX_ROW_BYTES, dtype=torch.uint8, device=self.device)
        return torch.zeros(L, P, ps, Di, dtype=self.dtype, device=self.device)

    def _state(self, L: int, rows: int, width: int):
        z = lambda: torch.zeros(L, rows, width, dtype=self.dtype, device=self.device)  # noqa: E731
        return z(), z()

    def nbytes(self) -> int:
        ts = [self.ring, *self.comp.values(), *(s for pair in self.states.values() for s in pair)]
        if self.index is not None:
            ts.append(self.index)
        return sum(t.numel() * t.element_size() for t in ts)

    def device_bytes(self) -> int:
        """Every device tensor of the cache: the pools and states (nbytes()) and the block tables."""
        return self.nbytes() + sum(t.numel() * t.element_size() for t in self.block_tables.values())

    def layout(self) -> "CacheLayout":
        """How device_bytes() depends on max_total_tokens, the other settings kept (memory planning)."""
        per_page = []
        for r in self.pools:
            b = self.comp[r][:, 0].numel() * self.comp[r].element_size()
            if r == self.index_ratio:
                b += self.index[:, 0].numel() * self.index.element_size()
            per_page.append((r, b))
        var = sum((self._pool_pages(self.max_total_tokens, r) + 1) * b for r, b in per_page)
        return CacheLayout(self.device_bytes() - var, tuple(per_page), self.page_size, self.num_slots,
                           2 if self.num_saved else 1)

    def layer(self, i: int) -> LayerCacheView:
        r = self.layer_ratio[i]
        v = LayerCacheView(self.fp8, self.ring[i], self.geometry.ring_page_rows, page_size=self.page_size)
        if r:
            j = self.layer_pos[i]
            v.comp = self.comp[r][j]
            for (rr, name), (kv, sc) in self.states.items():
                if rr == r:
                    v.states[name] = (kv[j], sc[j])
            if "index" in v.states:
                v.index = self.index[j]
        return v

    # ------------------------------------------------------------------ accounting
    @property
    def free_tokens(self) -> int:
        return self.max_total_tokens - self.used_tokens

    @property
    def free_slots(self) -> int:
        return len(self._slots)

    def admit(self) -> ReqCache:
        if not self._slots:
            raise MemoryError("deepfuse: no free request slot")
        return ReqCache(self._slots.pop(), 0, {r: [] for r in self.pools})

    def grow(self, rc: ReqCache, tokens: int) -> None:
        """Reserve context up to `tokens` and the compressed pages its complete blocks need."""
        extra = tokens - rc.tokens
        if extra <= 0:
            return
        if extra > self.max_total_tokens - self.used_tokens:
            raise MemoryError(f"deepfuse: cache budget exceeded ({extra} tokens asked, {self.free_tokens} free)")
        if tokens > rc.page_limit:
            self._alloc_pages(rc, tokens)
        rc.tokens = tokens
        self.used_tokens += extra
        if self.used_tokens > self.peak_used_tokens:
            self.peak_used_tokens = self.used_tokens

    def _alloc_pages(self, rc: ReqCache, tokens: int) -> None:
        limit = 1 << 62
        ps = self.page_size
        for r, pool in self.pools.items():
            need = -(-(tokens // r) // ps)
            have = rc.pages[r]
            if need > len(have):
                while pool.num_free < need - len(have) and self.evict is not None and self.evict():
                    pass
                new = pool.alloc(need - len(have))
                self.host_block_tables[r][rc.slot, len(have):need] = new
                for k, p in enumerate(new):
                    self._pending.append((r, rc.slot, len(have) + k, p))
                have.extend(new)
            limit = min(limit, (len(have) * ps + 1) * r - 1)
        rc.page_limit = limit

    def release(self, rc: ReqCache) -> None:
        for r, pages in rc.pages.items():
            self.pools[r].free(pages)
            pages.clear()
        self.used_tokens -= rc.tokens
        rc.tokens = 0
        rc.page_limit = -1
        self._slots.append(rc.slot)
        rc.slot = -1

    def flush(self) -> None:
        """Write the block-table entries of pages allocated since the last flush (one copy per ratio)."""
        if not self._pending:
            return
        if self.journal is not None:
            self.journal.extend(self._pending)
        a = np.asarray(self._pending, dtype=np.int64)
        self._pending.clear()
        a = a[np.argsort(a[:, 0], kind="stable")]  # one upload, one contiguous run per ratio
        idx = to_device(a[:, 1:], torch.int64, self.device)
        bounds = np.searchsorted(a[:, 0], list(self.block_tables), side="left")
        ends = np.searchsorted(a[:, 0], list(self.block_tables), side="right")
        for (r, bt), lo, hi in zip(self.block_tables.items(), bounds.tolist(), ends.tolist()):
            if hi > lo:
                bt[idx[lo:hi, 0], idx[lo:hi, 1]] = idx[lo:hi, 2]

    # ------------------------------------------------------------------ prefix snapshots
    def _ring_rows(self):
        """(data, scales | None) views of the ring as [L, pages, rows, ...] (fp8: the two parts)."""
        t, ps = self.ring, self.geometry.ring_page_rows
        if not self.fp8:
            return [t]
        return [F._data_view(t, ps, F.KV_DATA_BYTES), F._scale_view(t, ps, F.KV_DATA_BYTES, F.KV_SCALE_BYTES)]

    def _copy_window(self, src_page: int, src_rows, dst_page: int, dst_rows) -> None:
        dev = self.device
        sr, dr = to_device(src_rows, torch.int64, dev), to_device(dst_rows, torch.int64, dev)
        for v in self._ring_rows():
            v[:, dst_page, dr] = v[:, src_page, sr]

    def _copy_states(self, r: int, src_rows, dst_rows) -> None:
        dev = self.device
        sr, dr = to_device(src_rows, torch.int64, dev), to_device(dst_rows, torch.int64, dev)
        for (rr, _), pair in self.states.items():
            if rr == r:
                for t in pair:
                    t[:, dr] = t[:, sr]

    def snapshot(self, rc: ReqCache, n: int) -> Optional["Snapshot"]:
        """Keep the state of a request that has computed n tokens for later requests with the
        same first n tokens: references on its pages of compressed rows (entries < n / r),
        a copy of its window rows (positions n - W .. n - 1) and of its live compressor-state
        rows. None when no saved slot is free."""
        if not self._saved_free:
            return None
        k = self._saved_free.pop()
        g, W = self.geometry, self.geometry.window
        pos = list(range(max(0, n - W), n))
        self._copy_window(rc.slot, [p % g.ring_rows for p in pos], self.saved_base + k, [p - (n - W) for p in pos])
        for r, (R, R0) in self.state_rows.items():
            sp = list(range(max(0, n - R0 + 1), n))
            base = self.num_slots * R + k * R0
            self._copy_states(r, [rc.slot * R + p % R for p in sp], [base + p % R0 for p in sp])
        pages = {}
        for r, pool in self.pools.items():
            have = rc.pages[r][:-(-(n // r) // self.page_size)]
            pool.ref(have)
            pages[r] = list(have)
        return Snapshot(n, k, pages)

    def drop_snapshot(self, snap: "Snapshot") -> None:
        for r, pages in snap.pages.items():
            self.pools[r].free(pages)
        self._saved_free.append(snap.slot)

    def restore(self, rc: ReqCache, snap: "Snapshot") -> None:
        """Start rc (just admitted) from snap: share its complete pages, copy its partial last
        page (rc will append to it), restore its window and compressor states."""
        n, g, W, ps = snap.tokens, self.geometry, self.geometry.window, self.page_size
        for r, pages in snap.pages.items():
            full = (n // r) // ps
            shared = pages[:full]
            self.pools[r].ref(shared)
            rc.pages[r] = list(shared)
            if len(pages) > full:  # copy-on-write of the partial page
                src = pages[full]
                self.pools[r].ref([src])
                while self.pools[r].num_free < 1 and self.evict is not None and self.evict():
                    pass
                new = self.pools[r].alloc(1)[0]
                self.comp[r][:, new] = self.comp[r][:, src]
                if r == self.index_ratio:
                    self.index[:, new] = self.index[:, src]
                self.pools[r].free([src])
                rc.pages[r].append(new)
            self.host_block_tables[r][rc.slot, :len(rc.pages[r])] = rc.pages[r]
            self._pending += [(r, rc.slot, c, p) for c, p in enumerate(rc.pages[r])]
        pos = list(range(max(0, n - W), n))
        self._copy_window(self.saved_base + snap.slot, [p - (n - W) for p in pos], rc.slot, [p % g.ring_rows for p in pos])
        for r, (R, R0) in self.state_rows.items():
            sp = list(range(max(0, n - R0 + 1), n))
            base = self.num_slots * R + snap.slot * R0
            self._copy_states(r, [base + p % R0 for p in sp], [rc.slot * R + p % R for p in sp])
        extra = n - rc.tokens
        rc.tokens = n
        self.used_tokens += extra
        self.peak_used_tokens = max(self.peak_used_tokens, self.used_tokens)
        rc.page_limit = min(((len(rc.pages[r]) * ps + 1) * r - 1 for r in self.pools), default=1 << 62)

    def pages_in_use(self) -> dict[int, int]:
        return {r: p.num_pages - p.num_free for r, p in self.pools.items()}

    @staticmethod
    def bytes_per_token(cfg, kv_dtype: str, model_dtype: torch.dtype) -> float:
        el = 2 if kv_dtype == "bf16" else torch.empty(0, dtype=model_dtype).element_size()
        kv_row = F.KV_ROW_BYTES if kv_dtype == "fp8" else cfg.head_dim * el
        idx_row = F.IDX_ROW_BYTES if kv_dtype == "fp8" else cfg.index_head_dim * el
        b = 0.0
        for t in cfg.layer_types:
            r = cfg.compress_ratio(t)
            if r:
                b += (kv_row + (idx_row if t == "compressed_sparse_attention" else 0)) / r
        return max(b, 1.0)


def resolve_kv_dtype(kv_dtype: Optional[str], cfg, device, model_dtype: torch.dtype) -> str:
    """kv_dtype None -> "fp8" on CUDA for a bf16 model whose rows are V4's (head_dim 512,
    index_head_dim 128: what the fp8 kernels serve), else "auto" (the model dtype, lossless:
    the CPU default and the oracle path, an fp32 model on CUDA included)."""
    if kv_dtype is not None:
        return kv_dtype
    fits = cfg.head_dim == F.KV_DIM and cfg.index_head_dim == F.IDX_DIM
    if torch.device(device).type == "cuda" and model_dtype == torch.bfloat16 and fits:
        return "fp8"
    return "auto"


def default_total_tokens(cfg, kv_dtype: Optional[str], model_dtype, device, max_num_seqs: int,
                         max_model_len: int, manager=None) -> int:
    """max_total_tokens when not given and not planned (engine/memory.py plans it on CUDA):
    128K tokens on the CPU; half the free device memory on CUDA (tensor parallel ranks),
    never more than max_num_seqs full-length requests. kv_dtype None: resolve_kv_dtype.
    manager: the cache manager class whose bytes_per_token counts (default CacheManager;
    V4.1: V41CacheManager, engine/memory.py)."""
    kv_dtype = resolve_kv_dtype(kv_dtype, cfg, device, model_dtype)
    cap = max_num_seqs * max_model_len
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        n = int(0.5 * free / (manager or CacheManager).bytes_per_token(cfg, kv_dtype, model_dtype))
    else:
        n = CPU_TOTAL_TOKENS
    return max(1, min(cap, n, 1 << 31))

