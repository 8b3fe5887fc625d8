"""Row-wise top-k: the DSA indexer's selection and the sampler's vocabulary top-k.

Semantics (the reference below defines them; the CUDA kernel satisfies them):
- x: [B, N] bf16 / fp16 / fp32, last dim contiguous. Row b considers x[b, :L_b] with
  L_b = clamp(lengths[b], 0, N) (L_b = N without lengths). k in [1, 4096]; k > N is allowed.
- Order: NaN (any sign or payload) is larger than +inf; otherwise the float order, with
  -0.0 and +0.0 equal. So NaNs are selected first, as torch.topk does.
- Each row gets min(k, L_b) selected entries in slots [0, min(k, L_b)); slots beyond are
  padding: index -1, value -inf.
- Ties: among equal values (in the order above) the lower index wins. So the selected set of
  a row is a function of that row's values (and L_b, k) alone: batching, chunking, padding N,
  or slicing a longer tensor cannot change it, on any device. Equivalently: with T the k-th
  largest value and c_gt entries strictly above T, the selection is those c_gt entries plus
  the (k - c_gt) lowest indices among the entries equal to T. The CUDA kernels select exactly
  this set. Results always satisfy: indices unique and in [0, L_b), min(selected) >=
  max(unselected), values == x[b, index].
- sorted=True: the selected entries of each row in descending value order (NaN first), equal
  values by ascending index; the padding stays at the end. sorted=False: the same set in any
  order.
- Values are returned bit-exact from x (NaN payloads included).
"""
from __future__ import annotations

import torch

from deepfuse import _ext
from deepfuse.ops._checks import check_int, check_tensor
from deepfuse.ops._registry import op

MAX_K = 4096
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_DMAX = torch.finfo(torch.float64).max


# ----------------------------------------------------------------------------- reference
def topk_ref(x: torch.Tensor, k: int, lengths: torch.Tensor | None = None, *,
             index_dtype: torch.dtype = torch.int32) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [B, k] x.dtype, indices [B, k] index_dtype), sorted descending, padded."""
    B, N = x.shape
    W = max(N, k)
    # Total order in float64 (exact for every input dtype): NaN -> +inf, +inf -> DBL_MAX,
    # -inf -> -DBL_MAX; positions past the row's length (and past N) -> -inf, below all.
    xd = x.double()
    xd = torch.where(torch.isnan(xd), torch.full_like(xd, float("inf")),
                     xd.clamp(-_DMAX, _DMAX))
    keys = torch.full((B, W), float("-inf"), dtype=torch.float64, device=x.device)
    keys[:, :N] = xd
    if lengths is not None:
        L = lengths.to(torch.int64).clamp(0, N)
        cols = torch.arange(W, device=x.device)
        keys = keys.masked_fill(cols[None, :] >= L[:, None], float("-inf"))
    else:
        L = torch.full((B,), N, dtype=torch.int64, device=x.device)
    # Canonical ties: a stable descending sort keeps equal keys in ascending index order.
    idx = keys.sort(dim=1, descending=True, stable=True).indices[:, :k]
    pad = torch.arange(k, device=x.device)[None, :] >= torch.clamp(L, max=k)[:, None]
    idx = idx.masked_fill(pad, N)  # N: the -inf column appended below
    xp = torch.cat([x, torch.full((B, 1), float("-inf"), dtype=x.dtype, device=x.device)], dim=1)
    iview = torch.int32 if x.element_size() == 4 else torch.int16
    values = xp.view(iview).gather(1, idx).view(x.dtype)  # integer gather: NaN payloads kept
    idx = idx.masked_fill(pad, -1).to(index_dtype)
    return values, idx


# ----------------------------------------------------------------------------- custom ops
def _outputs(x: torch.Tensor, k: int, return_values: bool, index_dtype: torch.dtype):
    B = x.shape[0]
    values = torch.empty(B, k if return_values else 0, dtype=x.dtype, device=x.device)
    return values, torch.empty(B, k, dtype=index_dtype, device=x.device)


@op("topk", "(Tensor x, int k, Tensor? lengths, bool sorted, bool return_values, "
            "ScalarType index_dtype) -> (Tensor, Tensor)")
def _topk(x, k, lengths, sorted, return_values, index_dtype):
    v, i = topk_ref(x, k, lengths, index_dtype=index_dtype)
    return (v if return_values else v[:, :0].contiguous()), i


@_topk.register_kernel("cuda")
def _(x, k, lengths, sorted, return_values, index_dtype):
    values, indices = _outputs(x, k, return_values, index_dtype)
    _launch(x, k, lengths, sorted, indices, values if return_values else None)
    return values, indices


@_topk.register_fake
def _(x, k, lengths, sorted, return_values, index_dtype):
    return _outputs(x, k, return_values, index_dtype)


@op("topk_out", "(Tensor x, int k, Tensor? lengths, bool sorted, Tensor(a!) indices, "
                "Tensor(b!)? values) -> ()")
def _topk_out(x, k, lengths, sorted, indices, values):
    v, i = topk_ref(x, k, lengths, index_dtype=indices.dtype)
    indices.copy_(i)
    if values is not None:
        values.copy_(v)


@_topk_out.register_kernel("cuda")
def _(x, k, lengths, sorted, indices, values):
    _launch(x, k, lengths, sorted, indices, values)


@_topk_out.register_fake
def _(x, k, lengths, sorted, indices, values):
    return None


@op("topk_slots", "(Tensor x, int k, Tensor lengths, Tensor slot_map, Tensor map_rows) -> Tensor")
def _topk_slots(x, k, lengths, slot_map, map_rows):
    _, i = topk_ref(x, k, lengths, index_dtype=torch.int64)
    rows = slot_map[map_rows]
    return torch.where(i >= 0, rows.gather(1, i.clamp(min=0)), -1)


@_topk_slots.register_kernel("cuda")
def _(x, k, lengths, slot_map, map_rows):
    out = torch.empty(x.shape[0], k, dtype=torch.int64, device=x.device)
    if x.shape[0]:
        _ext.ext(x.device).topk(x=x, k=k, lengths=lengths, indices=out, sorted=False, slot_map=slot_map,
                                map_rows=map_rows)
    return out


@_topk_slots.register_fake
def _(x, k, lengths, slot_map, map_rows):
    return x.new_empty(x.shape[0], k, dtype=torch.int64)


def topk_slots(x: torch.Tensor, k: int, lengths: torch.Tensor, slot_map: torch.Tensor,
               map_rows: torch.Tensor) -> torch.Tensor:
    """Top-k of each row of x [B, N] among its first lengths[b] entries, written as slots:
    int64 [B, k] = slot_map[map_rows[b], index] (unsorted; padding -1). slot_map: int64 [M, >= N]
    (last dim contiguous), map_rows: int64 [B] in [0, M). The DSA indexer's selection, written
    as the cache slots the attention op reads."""
    name = "topk_slots"
    check_tensor(name, "x", x, dtypes=_DTYPES, ndim=2, last_dim_contiguous=True)
    check_int(name, "k", k, lo=1, hi=MAX_K)
    B, N = x.shape
    if x.stride(0) < 0:
        raise ValueError(f"deepfuse: {name}: x must have a non-negative row stride (strides {x.stride()})")
    check_tensor(name, "lengths", lengths, dtypes=(torch.int32,), shape=(B,), device=x.device, contiguous=True)
    check_tensor(name, "slot_map", slot_map, dtypes=(torch.int64,), ndim=2, device=x.device, last_dim_contiguous=True)
    if slot_map.shape[1] < N:
        raise ValueError(f"deepfuse: {name}: slot_map must have >= {N} columns, got {list(slot_map.shape)}")
    check_tensor(name, "map_rows", map_rows, dtypes=(torch.int64,), shape=(B,), device=x.device, contiguous=True)
    return torch.ops.deepfuse.topk_slots(x, k, lengths, slot_map, map_rows)


def launch_plan(dtype: torch.dtype, B: int, N: int, k: int, sorted: bool = False) -> tuple[int, int, int, int]:
    """The CUDA kernel's plan for a shape with 16-byte aligned rows (needs a GPU): (CTAs per
    row, threads per CTA, shared memory bytes per CTA, kernel: 0 general, 1 short rows)."""
    e = _ext.ext(torch.device("cuda"))
    return tuple(e.topk_plan(dtype=str(dtype).removeprefix("torch."), B=B, N=N, k=k, sorted=sorted, device=e.index))


def _launch(x, k, lengths, sorted, indices, values):
    if x.shape[0] == 0:
        return
    _ext.ext(x.device).topk(x=x, k=k, lengths=lengths, values=values, indices=indices, sorted=bool(sorted))


# ----------------------------------------------------------------------------- public API
def topk(x: torch.Tensor, k: int, *, lengths: torch.Tensor | None = None, sorted: bool = False,
         return_values: bool = True, index_dtype: torch.dtype = torch.int32, out=None):
    """Top-k of each row of x [B, N] (bf16 / fp16 / fp32). See the module docstring.

    lengths: optional int32 [B]; row b considers x[b, :lengths[b]] (clamped to [0, N]).
    Rows with fewer than k entries are padded with index -1 and value -inf.
    Returns (values [B, k] x.dtype, indices [B, k] index_dtype), or only indices when
    return_values=False. out: a preallocated index buffer [B, k] (index_dtype), or a pair
    (values, indices) of buffers (values None when return_values=False); the buffers are
    filled and returned (for CUDA graphs)."""
    name = "topk"
    check_tensor(name, "x", x, dtypes=_DTYPES, ndim=2, last_dim_contiguous=True)
    check_int(name, "k", k, lo=1, hi=MAX_K)
    if not isinstance(sorted, bool):
        raise TypeError(f"deepfuse: {name}: sorted must be a bool, got {type(sorted).__name__}")
    if not isinstance(return_values, bool):
        raise TypeError(f"deepfuse: {name}: return_values must be a bool, got {type(return_values).__name__}")
    if index_dtype not in _INDEX_DTYPES:
        raise TypeError(f"deepfuse: {name}: index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
    B, N = x.shape
    if N >= 2**31:
        raise ValueError(f"deepfuse: {name}: x.shape[1] (N = {N}) must be < 2^31")
    if x.stride(0) < 0:
        raise ValueError(f"deepfuse: {name}: x must have a non-negative row stride (strides {x.stride()})")
    if lengths is not None:
        check_tensor(name, "lengths", lengths, dtypes=(torch.int32,), shape=(B,), device=x.device,
                     contiguous=True)
    if out is None:
        v, i = torch.ops.deepfuse.topk(x, k, lengths, sorted, return_values, index_dtype)
        return (v, i) if return_values else i
    if isinstance(out, torch.Tensor):
        values, indices = None, out
    elif isinstance(out, (tuple, list)) and len(out) == 2:
        values, indices = out
    else:
        raise TypeError(f"deepfuse: {name}: out must be an index tensor or a pair (values, indices)")
    check_tensor(name, "out indices", indices, dtypes=(index_dtype,), shape=(B, k), device=x.device,
                 contiguous=True)
    if values is not None:
        if not return_values:
            raise ValueError(f"deepfuse: {name}: out has a values buffer but return_values=False")
        check_tensor(name, "out values", values, dtypes=(x.dtype,), shape=(B, k), device=x.device,
                     contiguous=True)
    elif return_values:
        values = torch.empty(B, k, dtype=x.dtype, device=x.device)
    torch.ops.deepfuse.topk_out(x, k, lengths, sorted, indices, values)
    return (values, indices) if return_values else indices
