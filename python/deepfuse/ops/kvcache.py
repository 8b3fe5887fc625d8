"""V4 KV cache ops: fill paged caches and sliding-window rings, gather and move window rows.

Formats (byte layouts, alignment, addressing): deepfuse/kv_format.py.

Semantics (the references below define them; the CUDA kernels match them bit for bit):
- KV rows are bf16 [.., 512] with RoPE already applied to values 448..511. FP8 rows: per
  group of 64 no-RoPE values, amax over the finite values, e = ue8m0_exponent(amax) (the
  smallest power of two with amax / 2^e <= 448, clamped to [-127, 127]; all-zero groups
  -127), stored byte e + 127; code = e4m3_rn(clamp(x * 2^-e, +-448)) (inf saturates, NaN
  stays NaN): ops.cast's "ue8m0" rule with group 64. RoPE values are stored as given (bf16);
  the pad byte is written 0. bf16 caches store rows unchanged.
- Indexer keys [.., 128]: one scale per row, ops.cast's rules with group 128: "fp32"
  s = max(amax / 448, 2^-126), code = e4m3_rn(clamp(x * (1 / s), +-448)); "ue8m0" s = 2^e,
  code = e4m3_rn(clamp(x * 2^-e, +-448)); s is stored as fp32 either way.
- Dequantisation: e4m3 * 2^(byte - 127) in fp32, rounded to bf16 (KV); e4m3 * s (keys).
- Leading layer dimension: caches are [L, ...]; row inputs are [T, D] (L = 1) or [L, T, D];
  slot mappings are [T] (shared by all layers) or [L, T]. One launch serves all layers.
- Index tensors are int32 or int64. Slot -1 (any negative), a page >= the number of pages,
  a negative request slot or a negative position skips the row. Slots within one call must
  be distinct (for rings: at most one token per (request, position % W); for a prefill
  longer than W pass only the last W rows or set the others' positions to -1).
- Windows: a request that has consumed n = lengths[b] positions has the window positions
  max(0, n - W) .. n - 1 (cnt = min(n, W) rows), in position order as rows j = 0 .. cnt-1.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from deepfuse import _ext
from deepfuse import kv_format as F
from deepfuse.kv_format import IndexerKeyPages, KVPages, SwaRing
from deepfuse.ops import cast as C
from deepfuse.ops._checks import check_choice, check_int, check_tensor
from deepfuse.ops._registry import op

_FP8 = torch.float8_e4m3fn
_IDX = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- row references
def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """2^e exactly as fp32 for integer e in [-127, 128] (2^-127 subnormal, 2^128 = inf)."""
    e = e.to(torch.int32)
    bits = torch.where(e >= -126, (e + 127) << 23, torch.full_like(e, 0x00400000))
    return bits.view(torch.float32)


def kv_quantise_rows(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [N, 512] -> (uint8 [N, 576] row data: 448 e4m3 + 64 bf16, uint8 [N, 8] scales + pad)."""
    N = kv.shape[0]
    nope = kv[:, :F.NOPE_DIM].float()
    e = C.ue8m0_exponent(C._group_amax(nope, F.KV_GROUP))  # [N, 7]
    mul = C._expand(exp2_int(-e), F.KV_GROUP, F.NOPE_DIM)
    q = (nope * mul).clamp(-C.E4M3_MAX, C.E4M3_MAX).to(_FP8)
    rope = kv[:, F.NOPE_DIM:].to(torch.bfloat16).contiguous()
    data = torch.cat([q.view(torch.uint8), rope.view(torch.uint8)], dim=1)
    scales = torch.cat([(e + 127).to(torch.uint8), torch.zeros(N, 1, dtype=torch.uint8, device=kv.device)], dim=1)
    return data, scales


def kv_dequantise_rows(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(uint8 [N, 576], uint8 [N, 8]) -> bf16 [N, 512]."""
    q = data[:, :F.NOPE_DIM].contiguous().view(_FP8).float()
    s = C._expand(exp2_int(scales[:, :F.KV_SCALES].to(torch.int32) - 127), F.KV_GROUP, F.NOPE_DIM)
    rope = data[:, F.NOPE_DIM:].contiguous().view(torch.bfloat16)
    return torch.cat([(q * s).to(torch.bfloat16), rope], dim=1)


def indexer_quantise_rows(k: torch.Tensor, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [N, 128] -> (uint8 [N, 128] e4m3 codes, fp32 [N] scales)."""
    xf = k.float()
    amax = C._group_amax(xf, F.IDX_DIM)[:, 0]
    if scale_fmt == "fp32":
        s = torch.clamp(amax / C.E4M3_MAX, min=C.FP32_TINY)
        mul = 1.0 / s
    else:
        e = C.ue8m0_exponent(amax)
        s, mul = exp2_int(e), exp2_int(-e)
    q = (xf * mul[:, None]).clamp(-C.E4M3_MAX, C.E4M3_MAX).to(_FP8)
    return q.view(torch.uint8), s


# ----------------------------------------------------------------------------- tensor views
def _kv_geom(cache: torch.Tensor) -> tuple[bool, int]:
    """-> (fp8, page_size) of a KV page tensor."""
    if cache.dtype == torch.uint8:
        return True, cache.shape[2] // F.KV_ROW_BYTES
    return False, cache.shape[2]


def _kv_views(cache: torch.Tensor):
    """-> (fp8, page_size, data [L, P, ps, 576 | 512], scales [L, P, ps, 8] | None)."""
    fp8, ps = _kv_geom(cache)
    if not fp8:
        return False, ps, cache, None
    return True, ps, F._data_view(cache, ps, F.KV_DATA_BYTES), F._scale_view(cache, ps, F.KV_DATA_BYTES, F.KV_SCALE_BYTES)


def _store_targets(index, positions, window, L, T, ps, P):
    idx = index.long()
    if positions is None:
        slots = idx.expand(L, T) if idx.dim() == 1 else idx
        page = torch.div(slots, ps, rounding_mode="floor")
        return page, slots - page * ps, (slots >= 0) & (page < P)
    pos = positions.long()
    valid = (idx >= 0) & (idx < P) & (pos >= 0)
    return idx.expand(L, T), pos.remainder(window).expand(L, T), valid.expand(L, T)


def _window_rows(lengths: torch.Tensor, window: int, rows: int):
    """-> (positions [B, rows], in-window mask [B, rows])."""
    n = lengths.long().clamp(min=0)
    start = (n - window).clamp(min=0)
    pos = start[:, None] + torch.arange(rows, device=lengths.device)
    return pos, pos < n[:, None]


def _locate(index: torch.Tensor, ring: bool, pos, valid, window: int, ps: int, P: int):
    """-> (page, row, valid) of window positions in a ring (index = req_slot [B]) or in
    pages (index = block_table [B, n])."""
    if ring:
        page = index.long()[:, None].expand_as(pos)
        row = pos.remainder(window)
    else:
        col = torch.div(pos, ps, rounding_mode="floor")
        ncols = index.shape[1]
        valid = valid & (col < ncols)
        page = index.long().gather(1, col.clamp(max=max(ncols - 1, 0)))
        row = pos - col * ps
    return page, row, valid & (page >= 0) & (page < P)


# ----------------------------------------------------------------------------- kv_store
@op("kv_store", "(Tensor(a!) cache, Tensor kv, Tensor index, Tensor? positions, int window) -> ()")
def _kv_store(cache: torch.Tensor, kv: torch.Tensor, index: torch.Tensor,
              positions: Optional[torch.Tensor], window: int) -> None:
    L, T = kv.shape[0], kv.shape[1]
    fp8, ps, d4, s4 = _kv_views(cache)
    page, row, valid = _store_targets(index, positions, window, L, T, ps, cache.shape[1])
    for l in range(L):
        v = valid[l]
        pg, rw = page[l][v], row[l][v]
        if fp8:
            data, sc = kv_quantise_rows(kv[l][v])
            d4[l, pg, rw] = data
            s4[l, pg, rw] = sc
        else:
            d4[l, pg, rw] = kv[l][v].to(torch.bfloat16)


def _check_cuda_rows(op: str, name: str, x: torch.Tensor) -> None:
    if x.data_ptr() % 16 or any((x.stride(i) * x.element_size()) % 16 for i in range(x.dim() - 1) if x.shape[i] > 1):
        raise ValueError(f"deepfuse: {op}: {name} rows must be 16-byte aligned (data pointer and strides)")


def _check_cuda_pages(op: str, name: str, cache: torch.Tensor) -> None:
    page_bytes = cache.stride(1) * cache.element_size()
    if cache.data_ptr() % 16 or page_bytes % 16 or (cache.stride(0) * cache.element_size()) % 16:
        raise ValueError(f"deepfuse: {op}: {name} pages must be 16-byte aligned (page_size a multiple of 16)")


@_kv_store.register_kernel("cuda")
def _(cache, kv, index, positions, window):
    L, T = kv.shape[0], kv.shape[1]
    if L == 0 or T == 0 or cache.shape[1] == 0:
        return
    _check_cuda_rows("kv_store", "kv", kv)
    _check_cuda_pages("kv_store", "cache", cache)
    _ext.ext(kv.device).kv_store(kv=kv, cache=cache, index=index, positions=positions, window=window)


@_kv_store.register_fake
def _(cache, kv, index, positions, window):
    return None


# ----------------------------------------------------------------------------- indexer keys
@op("indexer_key_store", "(Tensor(a!) cache, Tensor k, Tensor slot_mapping, str scale_fmt) -> ()")
def _indexer_key_store(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, scale_fmt: str) -> None:
    L, T = k.shape[0], k.shape[1]
    fp8 = cache.dtype == torch.uint8
    ps = cache.shape[2] // F.IDX_ROW_BYTES if fp8 else cache.shape[2]
    page, row, valid = _store_targets(slot_mapping, None, 0, L, T, ps, cache.shape[1])
    if fp8:
        keys = F._data_view(cache, ps, F.IDX_DIM)
        scales = F._scale_view(cache, ps, F.IDX_DIM, 4)
    for l in range(L):
        v = valid[l]
        pg, rw = page[l][v], row[l][v]
        if fp8:
            q, s = indexer_quantise_rows(k[l][v], scale_fmt)
            keys[l, pg, rw] = q
            scales[l, pg, rw] = s.view(torch.uint8).view(-1, 4)
        else:
            cache[l, pg, rw] = k[l][v].to(torch.bfloat16)


@_indexer_key_store.register_kernel("cuda")
def _(cache, k, slot_mapping, scale_fmt):
    L, T = k.shape[0], k.shape[1]
    if L == 0 or T == 0 or cache.shape[1] == 0:
        return
    _check_cuda_rows("indexer_key_store", "k", k)
    _check_cuda_pages("indexer_key_store", "cache", cache)
    _ext.ext(k.device).indexer_key_store(k=k, cache=cache, slots=slot_mapping, scale_fmt=scale_fmt)


@_indexer_key_store.register_fake
def _(cache, k, slot_mapping, scale_fmt):
    return None


# ----------------------------------------------------------------------------- window copies
def _gather_out(cache: torch.Tensor, B: int, window: int, dequant: bool) -> torch.Tensor:
    L = cache.shape[0]
    if cache.dtype == torch.uint8 and not dequant:
        wp = F.round_up(window, F.PAGE_ALIGN_ROWS)
        return torch.empty(L, B, wp * F.KV_ROW_BYTES, dtype=torch.uint8, device=cache.device)
    return torch.empty(L, B, window, F.KV_DIM, dtype=torch.bfloat16, device=cache.device)


@op("kv_window_gather", "(Tensor cache, Tensor lengths, Tensor index, int window, bool ring, bool dequant) -> Tensor")
def _kv_window_gather(cache: torch.Tensor, lengths: torch.Tensor, index: torch.Tensor, window: int,
                      ring: bool, dequant: bool) -> torch.Tensor:
    B = lengths.shape[0]
    out = _gather_out(cache, B, window, dequant)
    out.zero_()
    fp8, ps, d4, s4 = _kv_views(cache)
    raw = fp8 and not dequant
    rows = out.shape[2] // F.KV_ROW_BYTES if raw else window
    pos, valid = _window_rows(lengths, window, rows)
    page, row, valid = _locate(index, ring, pos, valid, window, ps, cache.shape[1])
    if raw:
        _, _, od4, os4 = _kv_views(out)
    for l in range(cache.shape[0]):
        pg, rw = page[valid], row[valid]
        if raw:
            od4[l][valid] = d4[l, pg, rw]
            os4[l][valid] = s4[l, pg, rw]
        elif fp8:
            out[l][valid] = kv_dequantise_rows(d4[l, pg, rw], s4[l, pg, rw])
        else:
            out[l][valid] = d4[l, pg, rw]
    return out


@_kv_window_gather.register_kernel("cuda")
def _(cache, lengths, index, window, ring, dequant):
    B = lengths.shape[0]
    out = _gather_out(cache, B, window, dequant)
    if out.numel() == 0:
        return out
    _check_cuda_pages("window_gather", "cache", cache)
    # index [B] (ring) or [B, n] (block table) locates the rows; out is dense (one page per request)
    _ext.ext(cache.device).kv_window_copy(src_cache=cache, src_index=index, dst_cache=out, dst_index=None,
                                          lengths=lengths, window=window, fill_missing=True)
    return out


@_kv_window_gather.register_fake
def _(cache, lengths, index, window, ring, dequant):
    return _gather_out(cache, lengths.shape[0], window, dequant)


def _restore_ref(src, dst, block_table, req_slot, lengths, window, to_ring: bool):
    fp8, sps, sd4, ss4 = _kv_views(src)
    _, dps, dd4, ds4 = _kv_views(dst)
    pos, valid = _window_rows(lengths, window, window)
    sp, sr, valid = _locate(req_slot if not to_ring else block_table, not to_ring, pos, valid, window, sps, src.shape[1])
    dp, dr, valid = _locate(block_table if not to_ring else req_slot, to_ring, pos, valid, window, dps, dst.shape[1])
    for l in range(src.shape[0]):
        dd4[l, dp[valid], dr[valid]] = sd4[l, sp[valid], sr[valid]]
        if fp8:
            ds4[l, dp[valid], dr[valid]] = ss4[l, sp[valid], sr[valid]]


def _restore_cuda(src, dst, block_table, req_slot, lengths, window, to_ring: bool):
    B = lengths.shape[0]
    if B == 0 or src.shape[0] == 0:
        return
    _check_cuda_pages("window_restore", "src", src)
    _check_cuda_pages("window_restore", "dst", dst)
    src_index, dst_index = (block_table, req_slot) if to_ring else (req_slot, block_table)
    _ext.ext(src.device).kv_window_copy(src_cache=src, src_index=src_index, dst_cache=dst, dst_index=dst_index,
                                        lengths=lengths, window=window, fill_missing=False)


@op("kv_window_to_ring", "(Tensor pages, Tensor(a!) ring, Tensor block_table, Tensor req_slot, Tensor lengths, int window) -> ()")
def _kv_window_to_ring(pages, ring, block_table, req_slot, lengths, window) -> None:
    _restore_ref(pages, ring, block_table, req_slot, lengths, window, True)


@_kv_window_to_ring.register_kernel("cuda")
def _(pages, ring, block_table, req_slot, lengths, window):
    _restore_cuda(pages, ring, block_table, req_slot, lengths, window, True)


@_kv_window_to_ring.register_fake
def _(pages, ring, block_table, req_slot, lengths, window):
    return None


@op("kv_window_to_pages", "(Tensor ring, Tensor(a!) pages, Tensor block_table, Tensor req_slot, Tensor lengths, int window) -> ()")
def _kv_window_to_pages(ring, pages, block_table, req_slot, lengths, window) -> None:
    _restore_ref(ring, pages, block_table, req_slot, lengths, window, False)


@_kv_window_to_pages.register_kernel("cuda")
def _(ring, pages, block_table, req_slot, lengths, window):
    _restore_cuda(ring, pages, block_table, req_slot, lengths, window, False)


@_kv_window_to_pages.register_fake
def _(ring, pages, block_table, req_slot, lengths, window):
    return None


# ----------------------------------------------------------------------------- validation
def _check_pages(op: str, name: str, t: torch.Tensor, fmt) -> None:
    check_tensor(op, name, t, dtypes=(fmt.torch_dtype(),), shape=(None, None, *fmt.page_shape()))
    if not t[0:1].is_contiguous() and t.shape[1] > 1:
        raise ValueError(f"deepfuse: {op}: {name} pages of a layer must be contiguous (strides {t.stride()})")
    if t.dim() == 4 and (t.stride(3) != 1 or t.stride(2) != t.shape[3] or t.stride(1) != t.shape[2] * t.shape[3]):
        raise ValueError(f"deepfuse: {op}: {name} pages of a layer must be contiguous (strides {t.stride()})")
    if t.dim() == 3 and t.stride(2) != 1 or t.dim() == 3 and t.shape[1] > 1 and t.stride(1) != t.shape[2]:
        raise ValueError(f"deepfuse: {op}: {name} pages of a layer must be contiguous (strides {t.stride()})")


def _check_index(op: str, name: str, t, shape, device) -> None:
    check_tensor(op, name, t, dtypes=_IDX, shape=shape, device=device, contiguous=True)


def _rows3(op: str, name: str, x: torch.Tensor, dim: int, L: int, device) -> torch.Tensor:
    check_tensor(op, name, x, dtypes=(torch.bfloat16,), device=device, last_dim_contiguous=True)
    if x.dim() == 2:
        x = x.unsqueeze(0)
    if x.dim() != 3 or x.shape[2] != dim:
        raise ValueError(f"deepfuse: {op}: {name} must have shape [T, {dim}] or [L, T, {dim}], got {list(x.shape)}")
    if x.shape[0] != L:
        raise ValueError(f"deepfuse: {op}: {name} has {x.shape[0]} layers but the cache has {L} "
                         f"(pass [T, {dim}] rows with a one-layer cache, e.g. pages.layer(i))")
    return x


def _as_pages(op: str, cache) -> KVPages:
    if isinstance(cache, KVPages):
        return cache
    if isinstance(cache, torch.Tensor):
        try:
            return F.kv_pages_from(cache)
        except ValueError:
            pass
    raise TypeError(f"deepfuse: {op}: cache must be a KVPages (or its tensor), got {type(cache).__name__}")


def _check_store_index(op: str, name: str, idx, T: int, L: int, device, allow_layers: bool) -> None:
    check_tensor(op, name, idx, dtypes=_IDX, device=device, contiguous=True)
    ok = idx.dim() == 1 and idx.shape[0] == T or allow_layers and idx.dim() == 2 and tuple(idx.shape) == (L, T)
    if not ok:
        want = f"[{T}]" + (f" or [{L}, {T}]" if allow_layers else "")
        raise ValueError(f"deepfuse: {op}: {name} must have shape {want}, got {list(idx.shape)}")


# ----------------------------------------------------------------------------- public API
def kv_store(cache: Union[KVPages, torch.Tensor], slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """Quantise bf16 kv rows ([T, 512] with a one-layer cache, or [L, T, 512]) into paged slots.

    slot_mapping: int32/int64 [T] (all layers) or [L, T]; slot = page * page_size + row;
    negative slots skip the row. Slots must be distinct within a call."""
    op = "kv_store"
    cache = _as_pages(op, cache)
    _check_pages(op, "cache", cache.data, cache.fmt)
    L = cache.num_layers
    kv = _rows3(op, "kv", kv, F.KV_DIM, L, cache.data.device)
    _check_store_index(op, "slot_mapping", slot_mapping, kv.shape[1], L, kv.device, True)
    torch.ops.deepfuse.kv_store(cache.data, kv, slot_mapping, None, 1)


def swa_store(ring: SwaRing, req_slot: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor) -> None:
    """Write kv rows ([T, 512] / [L, T, 512]) to ring rows (req_slot[t], positions[t] % W).

    req_slot, positions: int32/int64 [T]; a negative entry skips the row. At most one row
    per (request, position % W) per call."""
    op = "swa_store"
    if not isinstance(ring, SwaRing):
        raise TypeError(f"deepfuse: {op}: ring must be a SwaRing, got {type(ring).__name__}")
    _check_pages(op, "ring", ring.data, ring.fmt)
    L = ring.num_layers
    kv = _rows3(op, "kv", kv, F.KV_DIM, L, ring.data.device)
    T = kv.shape[1]
    _check_store_index(op, "req_slot", req_slot, T, L, kv.device, False)
    _check_store_index(op, "positions", positions, T, L, kv.device, False)
    torch.ops.deepfuse.kv_store(ring.data, kv, req_slot, positions, ring.window)


def indexer_key_store(cache: IndexerKeyPages, slot_mapping: torch.Tensor, k: torch.Tensor) -> None:
    """Quantise bf16 indexer keys ([T, 128] / [L, T, 128]) into paged slots (see module doc)."""
    op = "indexer_key_store"
    if not isinstance(cache, IndexerKeyPages):
        raise TypeError(f"deepfuse: {op}: cache must be an IndexerKeyPages, got {type(cache).__name__}")
    _check_pages(op, "cache", cache.data, cache.fmt)
    L = cache.num_layers
    k = _rows3(op, "k", k, F.IDX_DIM, L, cache.data.device)
    _check_store_index(op, "slot_mapping", slot_mapping, k.shape[1], L, k.device, True)
    torch.ops.deepfuse.indexer_key_store(cache.data, k, slot_mapping, cache.fmt.scale_fmt)


def window_gather(src: Union[KVPages, SwaRing], lengths: torch.Tensor, *, req_slot: Optional[torch.Tensor] = None,
                  block_table: Optional[torch.Tensor] = None, window: Optional[int] = None,
                  dequant: bool = True) -> Union[torch.Tensor, KVPages]:
    """The last W rows of each request, in position order (row j = position max(0, n - W) + j).

    src: a SwaRing with req_slot [B] (W = the ring's window), or KVPages with block_table
    [B, max_pages] and window (default 128). lengths [B]: positions consumed per request.
    dequant or a bf16 source: bf16 [L, B, W, 512]; rows j >= min(n, W) (and rows whose page
    is missing) are zeros. FP8 with dequant=False: the raw rows as KVPages with one page
    (page_size round_up(W, 16)) per (layer, request): row j of page b; missing rows zeroed."""
    op = "window_gather"
    if isinstance(src, SwaRing):
        if req_slot is None or block_table is not None:
            raise ValueError(f"deepfuse: {op}: a SwaRing source takes req_slot (and no block_table)")
        if window is not None and window != src.window:
            raise ValueError(f"deepfuse: {op}: window ({window}) must equal the ring's window ({src.window})")
        W, pages, index, ring = src.window, src.pages, req_slot, True
    else:
        pages = _as_pages(op, src)
        if block_table is None or req_slot is not None:
            raise ValueError(f"deepfuse: {op}: a KVPages source takes block_table (and no req_slot)")
        W, index, ring = (F.WINDOW if window is None else window), block_table, False
    check_int(op, "window", W, lo=1)
    _check_pages(op, "src", pages.data, pages.fmt)
    dev = pages.data.device
    check_tensor(op, "lengths", lengths, dtypes=_IDX, ndim=1, device=dev, contiguous=True)
    B = lengths.shape[0]
    if ring:
        _check_index(op, "req_slot", index, (B,), dev)
    else:
        _check_index(op, "block_table", index, (B, None), dev)
        if index.shape[1] == 0:
            raise ValueError(f"deepfuse: {op}: block_table must have at least one column")
    out = torch.ops.deepfuse.kv_window_gather(pages.data, lengths, index, W, ring, bool(dequant))
    if out.dtype == torch.uint8:
        return KVPages(F.KVFormat(out.shape[2] // F.KV_ROW_BYTES, "fp8"), out)
    return out


def window_restore(pages: KVPages, ring: SwaRing, block_table: torch.Tensor, req_slot: torch.Tensor,
                   lengths: torch.Tensor, *, to: str = "ring") -> None:
    """Copy each request's window rows (positions max(0, n - W) .. n - 1, n = lengths[b])
    between paged storage (block_table [B, max_pages]) and its ring (req_slot [B]).

    to="ring": pages -> ring (prefix-cache hit); to="pages": ring -> pages (caching a
    request). Raw row copies (no requantisation); both must have the same row format.
    Rows whose page or request slot is missing (negative / out of range) are skipped."""
    op = "window_restore"
    check_choice(op, "to", to, ("ring", "pages"))
    pages = _as_pages(op, pages)
    if not isinstance(ring, SwaRing):
        raise TypeError(f"deepfuse: {op}: ring must be a SwaRing, got {type(ring).__name__}")
    _check_pages(op, "pages", pages.data, pages.fmt)
    _check_pages(op, "ring", ring.data, ring.fmt)
    if pages.fmt.dtype != ring.fmt.dtype:
        raise ValueError(f"deepfuse: {op}: pages ({pages.fmt.dtype}) and ring ({ring.fmt.dtype}) formats differ")
    if pages.num_layers != ring.num_layers:
        raise ValueError(f"deepfuse: {op}: pages have {pages.num_layers} layers, ring {ring.num_layers}")
    dev = pages.data.device
    check_tensor(op, "ring", ring.data, device=dev)
    check_tensor(op, "lengths", lengths, dtypes=_IDX, ndim=1, device=dev, contiguous=True)
    B = lengths.shape[0]
    _check_index(op, "req_slot", req_slot, (B,), dev)
    _check_index(op, "block_table", block_table, (B, None), dev)
    if block_table.shape[1] == 0:
        raise ValueError(f"deepfuse: {op}: block_table must have at least one column")
    if to == "ring":
        torch.ops.deepfuse.kv_window_to_ring(pages.data, ring.data, block_table, req_slot, lengths, ring.window)
    else:
        torch.ops.deepfuse.kv_window_to_pages(ring.data, pages.data, block_table, req_slot, lengths, ring.window)


def kv_dequant(cache: Union[KVPages, SwaRing]) -> torch.Tensor:
    """Every row of a KV cache as bf16 [L, P, page_size, 512] (any device; reference math)."""
    pages = cache.pages if isinstance(cache, SwaRing) else _as_pages("kv_dequant", cache)
    fp8, ps, d4, s4 = _kv_views(pages.data)
    if not fp8:
        return d4.clone()
    L, P = d4.shape[:2]
    return kv_dequantise_rows(d4.reshape(-1, F.KV_DATA_BYTES), s4.reshape(-1, F.KV_SCALE_BYTES)).view(L, P, ps, F.KV_DIM)


def indexer_key_dequant(cache: IndexerKeyPages) -> torch.Tensor:
    """Every key as fp32 [L, P, page_size, 128] (any device)."""
    if cache.fmt.dtype == "bf16":
        return cache.data.float()
    return cache.keys().float() * cache.scales()[..., None]


# ----------------------------------------------------------------------------- row targets
# Where a fused kernel (ops.norm_rope_store, ops.compress_store) stores its rows: one
# layer's pages of a cache in one of the kv_format formats.
ROW_STORE_KINDS = ("kv_fp8", "idx_fp8", "idx_fp8_ue8m0", "dense")


class RowTarget:
    """One layer's pages and their format. kind: "kv_fp8" (uint8 [P, page_size * 584]),
    "idx_fp8" / "idx_fp8_ue8m0" (uint8 [P, page_size * 132], fp32 / power-of-two scales) or
    "dense" ([P, page_size, D] rows of any float dtype; its last page is the trash page:
    slot -1 stores land there)."""

    __slots__ = ("pages", "kind", "page_size")

    def __init__(self, pages: torch.Tensor, kind: str, page_size: int):
        self.pages, self.kind, self.page_size = pages, kind, page_size

    def check(self, op: str, D: int, device) -> None:
        check_choice(op, "target kind", self.kind, ROW_STORE_KINDS)
        fp8 = self.kind != "dense"
        dims = {"kv_fp8": F.KV_DIM, "idx_fp8": F.IDX_DIM, "idx_fp8_ue8m0": F.IDX_DIM}
        if fp8 and D != dims[self.kind]:
            raise ValueError(f"deepfuse: {op}: {self.kind} rows must be {dims[self.kind]} wide, got {D}")
        row_bytes = F.KV_ROW_BYTES if self.kind == "kv_fp8" else F.IDX_ROW_BYTES
        if fp8:
            check_tensor(op, "target pages", self.pages, dtypes=(torch.uint8,), ndim=2, device=device,
                         contiguous=True)
            if self.pages.shape[1] != self.page_size * row_bytes:
                raise ValueError(f"deepfuse: {op}: target pages must be [P, {self.page_size} * {row_bytes}], "
                                 f"got {list(self.pages.shape)}")
        else:
            check_tensor(op, "target pages", self.pages, ndim=3, device=device, contiguous=True)
            if tuple(self.pages.shape[1:]) != (self.page_size, D):
                raise ValueError(f"deepfuse: {op}: dense target pages must be [P, {self.page_size}, {D}], "
                                 f"got {list(self.pages.shape)}")

    def kernel_ok(self) -> bool:
        return self.kind != "dense" or self.pages.dtype == torch.bfloat16


def store_rows(target: RowTarget, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Store rows [N, D] at slots [N] of target through the cache's store ops (negative slots:
    skipped, or the trash page of a dense target). The reference of the fused stores."""
    if target.kind == "kv_fp8":
        kv_store(KVPages(F.KVFormat(target.page_size, "fp8"), target.pages.unsqueeze(0)), slots,
                 rows.to(torch.bfloat16))
    elif target.kind in ("idx_fp8", "idx_fp8_ue8m0"):
        fmt = F.IndexerKeyFormat(target.page_size, "fp8", "fp32" if target.kind == "idx_fp8" else "ue8m0")
        indexer_key_store(IndexerKeyPages(fmt, target.pages.unsqueeze(0)), slots, rows.to(torch.bfloat16))
    else:
        flat = target.pages.view(-1, target.pages.shape[-1])
        trash = flat.shape[0] - 1
        flat.index_copy_(0, torch.where(slots >= 0, slots, trash), rows.to(flat.dtype))
