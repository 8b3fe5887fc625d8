"""Row-wise top-k: reference semantics (CPU) and the kernel's invariants (GPU).

GPU checks (every case, every row, vectorised on the GPU):
- padding slots [min(k, L), k): index -1, value -inf (bit-exact);
- real slots: indices unique and in [0, L); values == x at the indices (bit-exact);
- the multiset of selected keys equals the top min(k, L) keys of the row (so also
  min(selected) >= max(unselected)); keys order NaN above +inf and merge -0.0 with +0.0;
- sorted=True: keys non-increasing along the row;
- canonical ties: the selected index set (sorted=True: the index sequence) equals the
  canonical one, computed independently from the integer keys by a stable sort (among
  equal keys the lower index wins; sorted ties in ascending index order).
Failures name the case (dtype, B, N, k, input kind, lengths, launch plan) and the row.
"""
from __future__ import annotations

import importlib
import random

import pytest
import torch

from deepfuse import _ext, ops
T = importlib.import_module("deepfuse.ops.topk")  # the module (ops.topk is the function)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_NAN_BELOW = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


# ----------------------------------------------------------------------------- helpers
def raw_bits(x: torch.Tensor) -> torch.Tensor:
    """Unsigned bit patterns as int64."""
    if x.element_size() == 4:
        return x.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    return x.contiguous().view(torch.int16).long() & 0xFFFF


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys with the op's order: NaN > +inf > ... > -inf; -0.0 == +0.0."""
    bits = 8 * x.element_size()
    r = raw_bits(x)
    sign, allm = 1 << (bits - 1), (1 << bits) - 1
    nan = (r & (sign - 1)) > (0x7F800000 if bits == 32 else _NAN_BELOW[x.dtype])
    r = torch.where(r == sign, torch.zeros_like(r), r)  # -0.0 -> +0.0
    k = torch.where((r & sign) != 0, r ^ allm, r | sign)
    return torch.where(nan, torch.full_like(k, allm), k)


NEG_INF_BITS = {torch.bfloat16: 0xFF80, torch.float16: 0xFC00, torch.float32: 0xFF800000}


def make_input(kind: str, B: int, N: int, dtype, device, gen: torch.Generator) -> torch.Tensor:
    def rn(*s):
        return torch.randn(*s, generator=gen, device=device)

    def ru(*s):
        return torch.rand(*s, generator=gen, device=device)

    if kind == "randn":
        x = rn(B, N) * 3
    elif kind == "scores":  # indexer-like: sums of relus, positive, many close values
        x = torch.relu(rn(B, N)) * 0.1 + torch.relu(rn(B, N))
    elif kind == "ties":  # heavy ties: 5 distinct values
        x = torch.randint(-2, 3, (B, N), generator=gen, device=device).float()
    elif kind == "relu":  # an indexer with few heads: ~half the scores exactly 0
        x = torch.relu(rn(B, N))
    elif kind == "zeros":  # 90% zeros of both signs (equal values): ties at any k
        x = rn(B, N).abs() + 0.5
        u = ru(B, N)
        x = torch.where(u < 0.9, torch.zeros_like(x), x)
        x = torch.where(u < 0.45, -torch.zeros_like(x), x)
    elif kind == "allsame":
        x = torch.full((B, N), 0.75, device=device)
    elif kind == "narrow":  # one binade: few distinct bf16/fp16 values, deep radix levels
        x = 1.0 + ru(B, N)
    elif kind == "special":  # NaN (both signs), +-inf, +-0, subnormals
        x = rn(B, N)
        u = ru(B, N)
        x = torch.where(u < 0.02, torch.full_like(x, float("nan")), x)
        x = torch.where((u >= 0.02) & (u < 0.03), -torch.full_like(x, float("nan")).abs(), x)
        x = torch.where((u >= 0.03) & (u < 0.05), torch.full_like(x, float("inf")), x)
        x = torch.where((u >= 0.05) & (u < 0.07), torch.full_like(x, float("-inf")), x)
        x = torch.where((u >= 0.07) & (u < 0.09), torch.full_like(x, -0.0), x)
        x = torch.where((u >= 0.09) & (u < 0.11), torch.zeros_like(x), x)
        x = torch.where((u >= 0.11) & (u < 0.13), x * 1e-40, x)
    elif kind == "ramp":  # all distinct, ascending
        x = torch.arange(B * N, device=device, dtype=torch.float32).view(B, N) % 3001 - 1500
    else:
        raise ValueError(kind)
    x = x.to(dtype)
    if kind == "special" and N > 3:
        # a positive NaN with a payload and a negative NaN: bit-exact through the op
        if dtype == torch.float32:
            iv, pos, neg = x.view(torch.int32), 0x7FC00123, 0xFFC00321 - (1 << 32)
        else:
            iv = x.view(torch.int16)
            pos, neg = (0x7FC5, 0xFFA1 - (1 << 16)) if dtype == torch.bfloat16 else (0x7E05, 0xFE05 - (1 << 16))
        iv[:, 1] = pos
        iv[:, 3] = neg
    return x


def ragged(B: int, N: int, k: int, device, seed: int) -> torch.Tensor:
    """Lengths covering 0, < k, == k, N, > N (clamped), negative (clamped) and random."""
    gen = torch.Generator().manual_seed(seed)
    L = torch.randint(0, N + 1, (B,), generator=gen, dtype=torch.int32)
    special = [0, max(0, min(N, k) - 1), min(N, k), N, N + 5, -3, min(N, k + 1), N // 2]
    for i, v in enumerate(special[:B]):
        L[(i * 7919) % B] = v
    return L.to(device)


def canonical(x: torch.Tensor, k: int, lengths: torch.Tensor | None) -> torch.Tensor:
    """int64 [B, k]: the canonical sorted selection (key descending, equal keys by ascending
    index), padded with -1; from the integer keys, independent of the float64 reference."""
    B, N = x.shape
    dev = x.device
    L = lengths.long().clamp(0, N) if lengths is not None else torch.full((B,), N, device=dev)
    out = torch.full((B, k), -1, dtype=torch.int64, device=dev)
    if B == 0 or N == 0:
        return out
    valid = torch.arange(N, device=dev)[None, :] < L[:, None]
    keys = torch.where(valid, order_keys(x), torch.full((B, N), -1, dtype=torch.int64, device=dev))
    W = min(k, N)
    idx = keys.sort(dim=1, descending=True, stable=True).indices[:, :W]
    real = torch.arange(W, device=dev)[None, :] < L.clamp(max=k)[:, None]
    out[:, :W] = torch.where(real, idx, -1)
    return out


def check(x, k, lengths, sorted_, values, indices, tag: str) -> None:
    B, N = x.shape
    dev = x.device
    assert indices.shape == (B, k), f"{tag}: indices shape {tuple(indices.shape)}"
    if values is not None:
        assert values.shape == (B, k) and values.dtype == x.dtype, f"{tag}: values {values.shape} {values.dtype}"
    if B == 0:
        return
    L = lengths.long().clamp(0, N) if lengths is not None else torch.full((B,), N, device=dev)
    kk = L.clamp(max=k)
    real = torch.arange(k, device=dev)[None, :] < kk[:, None]
    idx = indices.long()

    def fail(mask: torch.Tensor, what: str):
        rows = mask.reshape(B, -1).any(1).nonzero().flatten()
        if len(rows):
            r = int(rows[0])
            raise AssertionError(f"{tag}: {what} in {len(rows)} row(s); first row {r} (L={int(L[r])}, "
                                 f"kk={int(kk[r])}): idx[:16]={idx[r, :16].tolist()}")

    fail(~real & (idx != -1), "padding index != -1")
    if values is not None:
        fail(~real & (raw_bits(values) != NEG_INF_BITS[x.dtype]), "padding value != -inf")
    fail(real & ((idx < 0) | (idx >= L[:, None])), "index out of range")
    g = torch.where(real, idx, 0).clamp(0, max(N - 1, 0))
    if N == 0:
        return
    cnt = torch.zeros(B, N + 1, dtype=torch.int32, device=dev)
    cnt.scatter_add_(1, torch.where(real, idx, N).clamp(0, N), torch.ones_like(idx, dtype=torch.int32))
    fail(cnt[:, :N] > 1, "duplicate index")
    if values is not None:
        fail(real & (raw_bits(values) != raw_bits(x).gather(1, g)), "value != x[index] (bits)")
    keys = order_keys(x)
    selk = torch.where(real, keys.gather(1, g), torch.full_like(g, -1))
    valid = torch.arange(N, device=dev)[None, :] < L[:, None]
    masked = torch.where(valid, keys, torch.full_like(keys, -1))
    W = min(k, N)
    ref = masked.topk(W, dim=1, sorted=True).values
    if W < k:
        ref = torch.cat([ref, torch.full((B, k - W), -1, dtype=ref.dtype, device=dev)], 1)
    mine = selk.sort(dim=1, descending=True).values
    fail((mine != ref).any(1), "selected multiset != top-k multiset")
    chosen = cnt[:, :N] > 0
    max_un = torch.where(valid & ~chosen, keys, torch.full_like(keys, -1)).amax(1)
    min_sel = torch.where(real, selk, torch.full_like(selk, 1 << 40)).amin(1)
    fail((kk > 0) & (min_sel < max_un), "min(selected) < max(unselected)")
    if sorted_ and k > 1:
        fail(real[:, 1:] & (selk[:, 1:] > selk[:, :-1]), "sorted=True row not descending")
    can = canonical(x, k, lengths)
    if sorted_:
        fail(idx != can, "sorted=True indices != canonical (ties: lower index first)")
    else:
        fail(idx.sort(1).values != can.sort(1).values, "selected set != canonical (ties: lower index wins)")


def plan_of(dtype, B, N, k, sorted_=False) -> str:
    try:
        g, nt, smem, kern = T.launch_plan(dtype, B, N, k, sorted_)
        return f"plan({'short-row' if kern else 'general'}, G={g}, {nt} threads, {smem // 1024} KB)"
    except Exception as e:  # CPU-only runs
        return f"plan(?: {e})"


def run_case(dtype, B, N, k, *, kind="randn", use_lengths=False, sorted_=False, return_values=True,
             index_dtype=torch.int32, seed=0, x=None, margin=None):
    """margin: the launcher's threshold margin instead of the plan's (through _C: the op has none)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if x is None:
        x = make_input(kind, B, N, dtype, "cuda", gen)
    lengths = ragged(B, N, k, "cuda", seed) if use_lengths else None
    tag = (f"{str(dtype).removeprefix('torch.')} B={B} N={N} k={k} kind={kind} lengths={use_lengths} "
           f"sorted={sorted_} vals={return_values} idx={str(index_dtype).removeprefix('torch.')} "
           f"{plan_of(dtype, B, N, k, sorted_)}" + (f" margin={margin}" if margin is not None else ""))
    # poison the allocator's free blocks so that unwritten outputs show up
    junk = torch.empty(B * k * 16 + 1024, dtype=torch.uint8, device="cuda").fill_(0x5A)
    del junk
    if margin is None:
        r = ops.topk(x, k, lengths=lengths, sorted=sorted_, return_values=return_values, index_dtype=index_dtype)
        values, indices = r if return_values else (None, r)
    else:
        indices = torch.empty(B, k, dtype=index_dtype, device="cuda")
        values = torch.empty(B, k, dtype=dtype, device="cuda") if return_values else None
        _ext.ext(x.device).topk(x=x, k=k, lengths=lengths, values=values, indices=indices, sorted=sorted_,
                                margin=margin)
    assert indices.dtype == index_dtype, tag
    check(x, k, lengths, sorted_, values, indices, tag)
    return x, lengths, values, indices


# ----------------------------------------------------------------------------- CPU semantics
def test_reference_matches_torch_topk():
    x = torch.randn(7, 300)
    v, i = ops.topk(x, 20, sorted=True)
    tv, ti = torch.topk(x, 20, dim=1)
    torch.testing.assert_close(v, tv, rtol=0, atol=0)
    assert torch.equal(i, ti.int())
    assert i.dtype == torch.int32 and v.dtype == x.dtype


def test_reference_lengths_and_padding():
    x = torch.randn(5, 10, dtype=torch.bfloat16)
    L = torch.tensor([0, 3, 10, 12, -1], dtype=torch.int32)
    v, i = ops.topk(x, 6, lengths=L, sorted=True, index_dtype=torch.int64)
    assert i.dtype == torch.int64
    assert (i[0] == -1).all() and torch.isneginf(v[0].float()).all()
    assert (i[4] == -1).all()
    tv, ti = torch.topk(x[1, :3], 3)
    assert torch.equal(i[1, :3], ti) and (i[1, 3:] == -1).all() and torch.isneginf(v[1, 3:].float()).all()
    torch.testing.assert_close(v[1, :3], tv, rtol=0, atol=0)
    for r in (2, 3):  # L >= N: the whole row
        torch.testing.assert_close(v[r], torch.topk(x[r], 6).values, rtol=0, atol=0)


def test_reference_k_larger_than_n_and_empty_rows():
    x = torch.randn(3, 4)
    v, i = ops.topk(x, 7, sorted=True)
    assert torch.equal(i[:, 4:], torch.full((3, 3), -1, dtype=torch.int32))
    assert torch.equal(torch.sort(i[:, :4], dim=1).values, torch.arange(4).int().expand(3, 4))
    v, i = ops.topk(torch.empty(2, 0), 3)
    assert (i == -1).all() and torch.isneginf(v).all()
    v, i = ops.topk(torch.empty(0, 5), 3)
    assert v.shape == (0, 3) and i.shape == (0, 3)


def test_reference_nan_inf_zero_order():
    nan_payload = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)
    x = torch.tensor([[1.0, float("nan"), float("inf"), -0.0, float("-inf"), 0.0, -5.0, 2.0]])
    x[0, 3] = -0.0
    x = torch.cat([x, nan_payload.view(1, 1), -torch.tensor([[float("nan")]])], 1)
    v, i = ops.topk(x, 10, sorted=True)
    assert set(i[0, :3].tolist()) == {1, 8, 9}  # the three NaNs first (any sign, any payload)
    assert i[0, 3].item() == 2 and i[0, 4].item() == 7 and i[0, 5].item() == 0
    assert set(i[0, 6:8].tolist()) == {3, 5}  # -0.0 and +0.0 are equal
    assert i[0, 8].item() == 6 and i[0, 9].item() == 4
    # values are bit-exact (the NaN payload survives)
    assert torch.equal(raw_bits(v).sort(1).values, raw_bits(x).sort(1).values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_invariants(dtype):
    gen = torch.Generator().manual_seed(1)
    for kind in ("randn", "ties", "special", "narrow"):
        x = make_input(kind, 6, 257, dtype, "cpu", gen)
        L = ragged(6, 257, 40, "cpu", 1)
        v, i = ops.topk(x, 40, lengths=L, sorted=True)
        # the CPU checker shares the GPU's logic
        check(x, 40, L, True, v, i, f"cpu {dtype} {kind}")


def _brute_canonical(x: torch.Tensor, k: int, L: int) -> list[int]:
    """One row, by hand: sort positions by (key descending, index ascending), keep k."""
    keys = order_keys(x[None])[0].tolist()
    return sorted(range(L), key=lambda j: (-keys[j], j))[:k]


def _tie_rows(dtype, gen: torch.Generator) -> list[tuple[torch.Tensor, int, int]]:
    """(row, k, L) with many exact ties, ties straddling the k boundary, ragged lengths."""
    rows = []
    z = torch.zeros(300, dtype=dtype)
    rows += [(z, 7, 300), (z, 300, 300), (z, 64, 100), (z, 1, 0), (z, 512, 300)]
    r = torch.relu(torch.randn(300, generator=gen)).to(dtype)  # ~half exact zeros
    npos = int((r > 0).sum())
    rows += [(r, npos + 5, 300), (r, npos, 300), (r, npos + 1, 250), (r, 200, 300), (r, 3, 300)]
    t = torch.randint(-2, 3, (300,), generator=gen).to(dtype)  # 5 values: every boundary a tie
    rows += [(t, k, L) for k in (1, 59, 60, 61, 150, 299) for L in (300, 123)]
    sz = torch.where(torch.rand(300, generator=gen) < 0.5, -0.0, 0.0).to(dtype)  # -0.0 == +0.0
    sz[::17] = 1.0
    rows += [(sz, 30, 300), (sz, 5, 300)]
    nn = torch.randn(300, generator=gen).to(dtype)  # NaNs of both signs / payloads tie
    nn[::7] = float("nan")
    nn[3::11] = -float("nan")
    nn[5::13] = float("inf")
    rows += [(nn, 20, 300), (nn, 50, 300), (nn, 80, 200)]
    return rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_canonical_ties(dtype):
    gen = torch.Generator().manual_seed(3)
    for n, (row, k, L) in enumerate(_tie_rows(dtype, gen)):
        want = _brute_canonical(row, k, L)
        v, i = ops.topk(row[None], k, lengths=torch.tensor([L], dtype=torch.int32), sorted=True)
        got = i[0].tolist()
        assert got[:len(want)] == want and all(g == -1 for g in got[len(want):]), (dtype, n, k, L, got[:20])
        assert torch.equal(raw_bits(v[0, :len(want)]), raw_bits(row[want])), (dtype, n)
        i2 = ops.topk(row[None], k, lengths=torch.tensor([L], dtype=torch.int32), return_values=False)
        assert sorted(x for x in i2[0].tolist() if x >= 0) == sorted(want), (dtype, n)
    z = torch.zeros(4, 1000, dtype=dtype)  # all zeros: exactly the first k
    assert torch.equal(ops.topk(z, 100, sorted=True)[1], torch.arange(100, dtype=torch.int32).expand(4, 100))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_selection_independent_of_shape(dtype):
    """A row's selection is the same alone, in a batch, as a slice of a longer tensor (with
    lengths) or of a shorter one, for any neighbours, k > N included."""
    gen = torch.Generator().manual_seed(4)
    for n, (row, k, L) in enumerate(_tie_rows(dtype, gen)):
        want = ops.topk(row[None, :L].contiguous(), k, sorted=True)[1][0]
        others = torch.randint(-1, 2, (5, 700), generator=gen).to(dtype)
        wide = others.clone()
        wide[2, :L] = row[:L]
        wide[2, L:] = torch.randint(-1, 3, (700 - L,), generator=gen).to(dtype)  # junk past L
        lens = torch.tensor([700, 13, L, 0, 699], dtype=torch.int32)
        assert torch.equal(ops.topk(wide, k, lengths=lens, sorted=True)[1][2], want), (dtype, n)
        assert torch.equal(ops.topk(wide[1:4], k, lengths=lens[1:4], sorted=True)[1][1], want), (dtype, n)
        narrow = torch.cat([others[:3, :L], row[None, :L], others[3:, :L]])  # N = L exactly
        assert torch.equal(ops.topk(narrow, k, sorted=True)[1][3], want), (dtype, n)
        got = ops.topk(wide, k, lengths=lens, return_values=False)[2]
        assert torch.equal(got.sort().values, want.sort().values), (dtype, n)
    # topk_slots inherits the rule: slots of the lower indices among ties
    x = torch.zeros(3, 50, dtype=dtype)
    x[:, 40] = 1.0
    smap = torch.arange(4 * 64, dtype=torch.int64).view(4, 64) * 10
    lens = torch.tensor([50, 20, 45], dtype=torch.int32)
    rows = torch.tensor([3, 0, 1])
    s = ops.topk_slots(x, 5, lens, smap, rows)
    want = [[40, 0, 1, 2, 3], [0, 1, 2, 3, 4], [40, 0, 1, 2, 3]]
    for b in range(3):
        assert sorted(s[b].tolist()) == sorted(smap[rows[b], want[b]].tolist()), b


def test_return_values_false_and_out_buffers_cpu():
    x = torch.randn(4, 50)
    i = ops.topk(x, 5, return_values=False)
    assert isinstance(i, torch.Tensor) and i.shape == (4, 5)
    buf = torch.full((4, 5), 123, dtype=torch.int64)
    r = ops.topk(x, 5, return_values=False, index_dtype=torch.int64, out=buf)
    assert r is buf and torch.equal(buf, torch.topk(x, 5).indices)
    vb = torch.empty(4, 5)
    ib = torch.empty(4, 5, dtype=torch.int32)
    v, i = ops.topk(x, 5, sorted=True, out=(vb, ib))
    assert v is vb and i is ib and torch.equal(vb, torch.topk(x, 5).values)
    v, i = ops.topk(x, 5, out=ib)  # index buffer only: values are allocated
    assert i is ib and v.shape == (4, 5)


def test_validation_errors():
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="x has dtype"):
        ops.topk(x.long(), 3)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ops.topk([1.0, 2.0], 1)
    with pytest.raises(ValueError, match="x must be 2-D"):
        ops.topk(x.view(2, 2, 64), 3)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ops.topk(x.t(), 3)
    with pytest.raises(ValueError, match="k must be >= 1"):
        ops.topk(x, 0)
    with pytest.raises(ValueError, match="k must be <= 4096"):
        ops.topk(x, 4097)
    with pytest.raises(TypeError, match="k must be an int"):
        ops.topk(x, 3.0)
    with pytest.raises(TypeError, match="k must be an int"):
        ops.topk(x, True)
    with pytest.raises(TypeError, match="lengths has dtype"):
        ops.topk(x, 3, lengths=torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"lengths must have shape \[4\]"):
        ops.topk(x, 3, lengths=torch.ones(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="lengths must be contiguous"):
        ops.topk(x, 3, lengths=torch.ones(8, dtype=torch.int32)[::2])
    with pytest.raises(TypeError, match="index_dtype"):
        ops.topk(x, 3, index_dtype=torch.int16)
    with pytest.raises(TypeError, match="sorted must be a bool"):
        ops.topk(x, 3, sorted=1)
    with pytest.raises(TypeError, match="return_values must be a bool"):
        ops.topk(x, 3, return_values=None)
    with pytest.raises(TypeError, match="out indices has dtype"):
        ops.topk(x, 3, out=torch.empty(4, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"out indices must have shape \[4, 3\]"):
        ops.topk(x, 3, out=torch.empty(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out indices must be contiguous"):
        ops.topk(x, 3, out=torch.empty(3, 4, dtype=torch.int32).t())
    with pytest.raises(TypeError, match="out values has dtype"):
        ops.topk(x, 3, out=(torch.empty(4, 3, dtype=torch.bfloat16), torch.empty(4, 3, dtype=torch.int32)))
    with pytest.raises(ValueError, match="return_values=False"):
        ops.topk(x, 3, return_values=False, out=(torch.empty(4, 3), torch.empty(4, 3, dtype=torch.int32)))
    with pytest.raises(TypeError, match="out must be"):
        ops.topk(x, 3, out=[torch.empty(4, 3)])


def test_opcheck():
    x = torch.randn(5, 37, dtype=torch.bfloat16)
    L = torch.tensor([0, 3, 37, 40, -2], dtype=torch.int32)
    torch.library.opcheck(torch.ops.deepfuse.topk.default, (x, 8, L, True, True, torch.int64))
    torch.library.opcheck(torch.ops.deepfuse.topk.default, (x.float(), 8, None, False, False, torch.int32))
    torch.library.opcheck(torch.ops.deepfuse.topk_out.default,
                          (x, 8, L, False, torch.empty(5, 8, dtype=torch.int32), torch.empty(5, 8, dtype=torch.bfloat16)))
    torch.library.opcheck(torch.ops.deepfuse.topk_out.default,
                          (x, 8, None, True, torch.empty(5, 8, dtype=torch.int64), None))


def test_compile_fullgraph_cpu():
    x = torch.randn(5, 37)
    L = torch.tensor([0, 3, 37, 40, 9], dtype=torch.int32)
    f = torch.compile(lambda x, L: ops.topk(x, 8, lengths=L, sorted=True), fullgraph=True, backend="aot_eager")
    v, i = f(x, L)
    rv, ri = ops.topk(x, 8, lengths=L, sorted=True)
    assert torch.equal(i, ri) and torch.equal(v, rv)
    buf = torch.empty(5, 8, dtype=torch.int32)
    g = torch.compile(lambda x, L, b: ops.topk(x, 8, lengths=L, return_values=False, out=b), fullgraph=True,
                      backend="aot_eager")
    g(x, L, buf)
    assert torch.equal(torch.sort(buf, 1).values, torch.sort(ri, 1).values)


# ----------------------------------------------------------------------------- the C++ launcher's checks
def _launcher_args(B=4, N=64, k=8, dtype=torch.bfloat16, index_dtype=torch.int32, device="cpu", **change):
    a = dict(x=torch.randn(B, N, device=device).to(dtype), k=k, lengths=None,
             values=torch.empty(B, k, dtype=dtype, device=device),
             indices=torch.empty(B, k, dtype=index_dtype, device=device), sorted=False)
    a.update(change)
    return a


@pytest.mark.skipif(not _ext.has_cuda_kernels(), reason="needs the compiled extension")
@pytest.mark.parametrize("change, match", [
    (dict(dtype=torch.float64), r"topk: argument 'x' must be bfloat16 or float16 or float32 \(got float64\[4, 64\]"),
    (dict(x=torch.randn(4, 64, 2)), r"argument 'x' must have 2 dims"),
    (dict(x=torch.randn(64, 4).t()), r"argument 'x' must have stride 1 in its last dim"),
    (dict(k=0), r"argument 'k' must be in \[1, 4096\] \(got 0\)"),
    (dict(k=4097), r"argument 'k' must be in \[1, 4096\]"),
    (dict(lengths=torch.zeros(4, dtype=torch.int64)), r"argument 'lengths' must be int32"),
    (dict(lengths=torch.zeros(3, dtype=torch.int32)), r"argument 'lengths' must have shape \[4\]"),
    (dict(indices=torch.empty(4, 8)), r"argument 'indices' must be int32 or int64"),
    (dict(indices=torch.empty(4, 7, dtype=torch.int32)), r"argument 'indices' must have shape \[4, 8\]"),
    (dict(indices=torch.empty(8, 4, dtype=torch.int32).t()), r"argument 'indices' must be contiguous"),
    (dict(values=torch.empty(4, 8)), r"argument 'values' must be bfloat16 \(got float32\[4, 8\]"),
    (dict(slot_map=torch.zeros(4, 64, dtype=torch.int64)), r"argument 'indices' must be int64 with a slot_map"),
    (dict(index_dtype=torch.int64, slot_map=torch.zeros(4, 63, dtype=torch.int64)),
     r"argument 'slot_map' must have >= 64 columns"),
    (dict(index_dtype=torch.int64, slot_map=torch.zeros(4, 64, dtype=torch.int32)),
     r"argument 'slot_map' must be int64"),
    (dict(index_dtype=torch.int64, map_rows=torch.zeros(4, dtype=torch.int64)),
     r"argument 'map_rows' needs a slot_map"),
    (dict(index_dtype=torch.int64, slot_map=torch.zeros(2, 64, dtype=torch.int64),
          map_rows=torch.zeros(4, dtype=torch.int32)), r"argument 'map_rows' must be int64"),
    (dict(), r"argument 'x' must be a CUDA tensor \(got bfloat16\[4, 64\] on cpu\)"),
    (dict(lengths=torch.zeros(4, dtype=torch.int32)), r"argument 'x' must be a CUDA tensor"),
])
def test_launcher_rejects_bad_arguments(change, match):
    """The C++ launcher checks dtype and shape (testable on CPU), then the device."""
    a = _launcher_args(**{k: change.pop(k) for k in ("dtype", "index_dtype") if k in change})
    a.update(change)
    with pytest.raises(ValueError, match=match):
        _ext._C.topk(**a)


@pytest.mark.skipif(not _ext.has_cuda_kernels(), reason="needs the compiled extension")
def test_launcher_plan_rejects_bad_dtype():
    with pytest.raises(ValueError, match=r"topk_plan: argument 'dtype' must be bfloat16, float16 or float32"):
        _ext._C.topk_plan(dtype="float64", B=1, N=8, k=1, sorted=False)


@pytest.mark.gpu
@pytest.mark.parametrize("on_cpu", ["indices", "values", "lengths", None])
def test_gpu_launcher_rejects_mixed_devices(on_cpu):
    """One argument left on the CPU is named; all on one device: the launch runs."""
    a = _launcher_args(device="cuda", lengths=torch.full((4,), 60, dtype=torch.int32, device="cuda"))
    if on_cpu is None:
        _ext._C.topk(**a)
        check(a["x"], 8, a["lengths"], False, a["values"], a["indices"], "launcher")
        return
    a[on_cpu] = a[on_cpu].cpu()
    with pytest.raises(ValueError, match=f"topk: argument '{on_cpu}' must be a CUDA tensor"):
        _ext._C.topk(**a)


# ----------------------------------------------------------------------------- GPU
KINDS = ["randn", "scores", "ties", "special", "narrow", "ramp", "allsame", "relu"]


def _grid_cases(N: int):
    """(B, k) pairs for one row length: every k regime, B from 1 to 512 within ~16M elements."""
    out = []
    for B in (1, 3, 16, 64, 512):
        if B * max(N, 1) > (1 << 24):
            continue
        ks = (1, 7, 50, 512, 1024, 2048, 4096) if B <= 16 else (50, 512, 2048)
        out += [(B, k) for k in ks]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 37, 511, 2048, 4097, 8192, 32771, 131072, 262144])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_grid(dtype, N):
    rng = random.Random(N * 31 + DTYPES.index(dtype))
    for j, (B, k) in enumerate(_grid_cases(N)):
        run_case(dtype, B, N, k, kind=KINDS[j % len(KINDS)], use_lengths=rng.random() < 0.5,
                 sorted_=rng.random() < 0.25, seed=j)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_input_kinds(dtype, kind):
    # cluster split (small B, long rows) and one CTA per row (large B)
    for j, (B, N, k) in enumerate([(1, 131072, 2048), (4, 40000, 512), (300, 8192, 1024), (64, 5000, 4096),
                                   (2, 129280, 50)]):
        run_case(dtype, B, N, k, kind=kind, use_lengths=j % 2 == 1, sorted_=j == 3, seed=j)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_long_rows(dtype):
    # long rows: many rounds per CTA, buffer compactions (k = 4096, heavy ties), re-streams
    N = 1_000_003 if dtype != torch.float32 else 500_001
    for j, kind in enumerate(["randn", "ties", "special", "narrow"]):
        run_case(dtype, 2, N, [4096, 1000, 50, 2048][j], kind=kind, use_lengths=j % 2 == 0, sorted_=j == 1, seed=j)
    run_case(dtype, 33, N // 4, 512, kind="scores", seed=9)
    run_case(dtype, 3, N, 4096, kind="ramp", seed=10)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_adversarial_order(dtype):
    # sorted rows defeat the sampled threshold (ascending: every element raises it;
    # descending: the top sits in rank 0's part) and reversed ones: exact either way
    for B, N, k in [(1, 131072, 2048), (2, 40000, 512), (300, 8192, 1024), (4, 300000, 4096)]:
        base = torch.randn(B, N, device="cuda").sort(dim=1).values.to(dtype)
        run_case(dtype, B, N, k, x=base.contiguous(), seed=1)
        run_case(dtype, B, N, k, x=base.flip(1).contiguous(), seed=2)
        run_case(dtype, B, N, k, x=base.flip(1).contiguous(), use_lengths=True, sorted_=True, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_threshold_at_signed_zero(dtype):
    # the K-th largest is 0: thresholds at key(-0.0) / key(+0.0), where the float compare
    # and the key order differ (-0.0 == +0.0 as floats); rows long enough to stream
    gen = torch.Generator(device="cuda").manual_seed(21)
    for B, N, k in [(1, 40000, 3000), (3, 131072, 4096), (200, 20000, 1500)]:
        x = torch.randn(B, N, generator=gen, device="cuda").abs() + 0.5
        u = torch.rand(B, N, generator=gen, device="cuda")
        x = torch.where(u < 0.9, torch.zeros_like(x), x)  # ~10% positive values
        x = torch.where(u < 0.45, -torch.zeros_like(x), x)  # half of the zeros negative
        x = x.to(dtype)
        for j, kk in enumerate((k, N // 10, N // 2)):
            kk = max(1, min(kk, 4096))
            run_case(dtype, B, N, kk, x=x, sorted_=j == 2, use_lengths=j == 1, seed=j)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_short_row_kernel(dtype):
    # the short-row kernel (aligned rows of <= 2048 16-byte vectors): every input kind,
    # lengths, sorted, int64 / no values, thresholds at signed zeros, one-vector rows; the
    # same rows through a misaligned view take the general kernel
    nmax = 16384 if dtype != torch.float32 else 8192
    cases = [(1, nmax, 512), (5, nmax, 4096), (64, 8192, 2048), (300, 4096, 1024), (2, 1000, 999), (9, 8, 3),
             (600, 2048, 50), (3, nmax // 2, 1)]
    for j, (B, N, k) in enumerate(cases):
        assert T.launch_plan(dtype, B, N, k)[3] == 1, (B, N, k)
        for kind in KINDS:
            run_case(dtype, B, N, k, kind=kind, use_lengths=j % 2 == 0, sorted_=kind == "ties" or j == 3,
                     seed=j)
        run_case(dtype, B, N, k, index_dtype=torch.int64, return_values=False, use_lengths=True, seed=j)
    gen = torch.Generator(device="cuda").manual_seed(22)
    x = torch.randn(4, nmax, generator=gen, device="cuda").abs() + 0.5
    u = torch.rand(4, nmax, generator=gen, device="cuda")
    x = torch.where(u < 0.9, torch.zeros_like(x), x)
    x = torch.where(u < 0.45, -torch.zeros_like(x), x).to(dtype)
    for j, kk in enumerate((nmax // 10, nmax // 20, 4096)):
        run_case(dtype, 4, nmax, kk, x=x, sorted_=j == 2, use_lengths=j == 1, seed=j)
    base = make_input("randn", 1, 3 * 8192 + 8, dtype, "cuda", gen).view(-1)
    run_case(dtype, 3, 8192, 700, x=base[1:1 + 3 * 8192].view(3, 8192), seed=4)  # general kernel
    run_case(dtype, 3, 8192, 700, x=base[8:8 + 3 * 8192].view(3, 8192), seed=4)  # 16-byte aligned


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_fallback_paths(dtype):
    # The sampled threshold too high on most rows (a negative margin through the launcher's
    # margin argument): with z = -1 the fallback's retry from the sample at z + 3 = 2 mostly
    # succeeds, with z = -4 it mostly misses too and the row is streamed from 0. Clusters
    # (G = 8, 2), one 512-thread CTA with and without per-warp segments, 256-thread CTAs (from 0
    # at once). (heavy ties put a 16-bit threshold below a tie group: no fallback; one case only)
    cases = [(1, 131072, 1024, "randn"), (16, 131072, 2048, "scores"), (2, 40000, 512, "ties"),
             (100, 100000, 50, "randn"), (100, 50000, 512, "scores"), (300, 30000, 512, "randn"),
             (1, 1_000_003, 4096, "scores")]
    for z in (-1.0, -4.0):
        for j, (B, N, k, kind) in enumerate(cases):
            run_case(dtype, B, N, k, kind=kind, use_lengths=j % 2 == 1, sorted_=j == 2, seed=j, margin=z)
    run_case(dtype, 16, 131072, 2048, seed=1)  # the plan's margin


@pytest.mark.gpu
def test_gpu_plans_cover_every_cluster_size():
    seen = set()
    for B, N in [(512, 8192), (1, 8192), (64, 32768), (32, 131072), (128, 131072), (1, 131072), (512, 131072),
                 (16, 262144), (1, 4_000_000)]:
        for dt in DTYPES:
            for k in (1, 2048, 4096):
                for srt in (False, True):
                    g, nt, smem, kern = T.launch_plan(dt, B, N, k, srt)
                    assert g in (1, 2, 4, 8) and nt in (256, 512, 1024) and smem <= 227 * 1024 and kern in (0, 1)
                    assert kern == (N <= (16384 if dt != torch.float32 else 8192)), (dt, B, N, kern)
                    seen.add(g)
    assert {1, 2, 4, 8} <= seen, seen


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_sorted(dtype):
    for j, (B, N, k) in enumerate([(1, 131072, 4096), (3, 32768, 2048), (200, 8192, 512), (2, 100, 4096),
                                   (5, 300000, 1024), (1, 9000, 1)]):
        run_case(dtype, B, N, k, kind=KINDS[j % len(KINDS)], sorted_=True, use_lengths=j % 2 == 1, seed=j)
    # select-all rows (L <= k) on a cluster-split row, sorted: pairs gathered across CTAs
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = make_input("randn", 4, 40000, dtype, "cuda", gen)
    L = torch.tensor([100, 4096, 0, 3000], dtype=torch.int32, device="cuda")
    v, i = ops.topk(x, 4096, lengths=L, sorted=True)
    check(x, 4096, L, True, v, i, f"{dtype} select-all sorted, {plan_of(dtype, 4, 40000, 4096, True)}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_strided_and_misaligned_rows(dtype):
    gen = torch.Generator(device="cuda").manual_seed(3)
    for j, (B, N, k) in enumerate([(3, 33333, 512), (40, 8191, 100), (2, 150001, 2048), (7, 45, 60)]):
        base = make_input("randn", 1, B * (N + 13) + 16, dtype, "cuda", gen).view(-1)
        for off in (1, 3, 8):
            x = base[off:off + B * N].view(B, N)  # data pointer not 16-byte aligned
            run_case(dtype, B, N, k, x=x, use_lengths=j % 2 == 0, seed=j)
            xs = base[off:off + B * (N + 13)].view(B, N + 13)[:, :N]  # row stride N + 13
            run_case(dtype, B, N, k, x=xs, use_lengths=j % 2 == 1, sorted_=off == 3, seed=j)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_index_dtype_return_values_and_out(dtype):
    for j, (B, N, k) in enumerate([(2, 60000, 1024), (128, 8192, 512), (1, 300, 512)]):
        run_case(dtype, B, N, k, index_dtype=torch.int64, use_lengths=True, seed=j)
        run_case(dtype, B, N, k, return_values=False, seed=j)
        run_case(dtype, B, N, k, return_values=False, index_dtype=torch.int64, sorted_=True, seed=j)
        gen = torch.Generator(device="cuda").manual_seed(j)
        x = make_input("scores", B, N, dtype, "cuda", gen)
        L = ragged(B, N, k, "cuda", j)
        for idt in (torch.int32, torch.int64):
            ib = torch.full((B, k), 0x5A5A5A5A, dtype=idt, device="cuda")
            vb = torch.empty(B, k, dtype=dtype, device="cuda")
            vb.view(torch.uint8).fill_(0x5A)
            v, i = ops.topk(x, k, lengths=L, index_dtype=idt, out=(vb, ib))
            assert v is vb and i is ib
            check(x, k, L, False, vb, ib, f"out=(values, indices) {dtype} {idt} B={B} N={N} k={k}")
            ib.fill_(0x5A5A5A5A)
            i = ops.topk(x, k, lengths=L, index_dtype=idt, return_values=False, sorted=True, out=ib)
            assert i is ib
            check(x, k, L, True, None, ib, f"out=indices {dtype} {idt} B={B} N={N} k={k}")


@pytest.mark.gpu
def test_gpu_agrees_with_cpu_reference():
    # distinct values: the sorted result is unique, so indices match the reference exactly
    gen = torch.Generator(device="cuda").manual_seed(11)
    for j, (B, N, k) in enumerate([(3, 70000, 2048), (50, 8192, 512), (2, 129280, 50)]):
        x = torch.randperm(B * N, generator=gen, device="cuda").view(B, N).float() * 0.5 - 1000
        L = ragged(B, N, k, "cuda", j)
        v, i = ops.topk(x, k, lengths=L, sorted=True)
        rv, ri = T.topk_ref(x.cpu(), k, L.cpu())
        assert torch.equal(i.cpu(), ri), f"B={B} N={N} k={k}"
        assert torch.equal(v.cpu(), rv), f"B={B} N={N} k={k}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_gpu_canonical_ties(dtype):
    # Tie-heavy rows: the selection (sorted: the sequence) is exactly the canonical one (check)
    # on the short-row kernel (1, 2 and 4 vectors per thread), the general kernel (clusters,
    # the 512-thread ring with per-warp segments, 256-thread CTAs) and its fallback with
    # compactions (allsame; odd N: unaligned heads and tails hold tied values).
    nmax = 16384 if dtype != torch.float32 else 8192
    short = [(3, nmax, 4096), (7, nmax, 512), (200, nmax, 2048), (200, nmax // 2, 1000), (600, 2048, 50),
             (5, 1000, 999)]
    general = [(1, 131072, 2048), (4, 40000, 4096), (300, 30000, 512), (16, 70001, 1024), (100, 100003, 1024),
               (2, 1_000_003, 4096), (3, 9001, 3000)]
    plans = set()
    for j, (B, N, k) in enumerate(short + general):
        plans.add(plan_of(dtype, B, N, k))
        for kind in ("relu", "zeros", "ties", "allsame"):
            run_case(dtype, B, N, k, kind=kind, use_lengths=j % 2 == 0, sorted_=(j + len(kind)) % 3 == 0, seed=j)
    assert {p.split(",")[0] for p in plans} == {"plan(short-row", "plan(general"} and len(plans) >= 6, plans


@pytest.mark.gpu
def test_gpu_selection_independent_of_batch():
    # The same rows alone, in batches of other sizes (other plans) and through the CPU
    # reference: the same index sets.
    gen = torch.Generator(device="cuda").manual_seed(32)
    for dtype in DTYPES:
        for N, k in [(8192, 2048), (40000, 2048), (131072, 512)]:
            x = make_input("relu", 300, N, dtype, "cuda", gen)
            full = ops.topk(x, k, return_values=False).long().sort(1).values
            for rows in ([5], list(range(64)), list(range(100, 300, 7))):
                got = ops.topk(x[rows], k, return_values=False).long().sort(1).values
                assert torch.equal(got, full[rows]), (dtype, N, k, len(rows))
            ri = T.topk_ref(x[:8].cpu(), k)[1].long().sort(1).values
            assert torch.equal(ri, full[:8].cpu()), (dtype, N, k)


@pytest.mark.gpu
def test_gpu_topk_slots_canonical():
    gen = torch.Generator(device="cuda").manual_seed(33)
    for dtype in DTYPES:
        for B, N, k in [(64, 8192, 2048), (3, 40000, 4096), (200, 20000, 512)]:
            x = make_input("relu", B, N, dtype, "cuda", gen)
            L = ragged(B, N, k, "cuda", 7)
            smap = torch.randperm(4 * (N + 5), generator=gen, device="cuda").view(4, N + 5)
            mrows = torch.randint(0, 4, (B,), generator=gen, device="cuda")
            s = ops.topk_slots(x, k, L, smap, mrows)
            rs = ops.topk_slots(x.cpu(), k, L.cpu(), smap.cpu(), mrows.cpu())
            assert torch.equal(s.sort(1).values.cpu(), rs.sort(1).values), (dtype, B, N, k)


@pytest.mark.gpu
def test_gpu_empty_and_tiny():
    for dtype in DTYPES:
        v, i = ops.topk(torch.empty(3, 0, dtype=dtype, device="cuda"), 5)
        assert (i == -1).all() and torch.isneginf(v.float()).all()
        v, i = ops.topk(torch.empty(0, 10, dtype=dtype, device="cuda"), 5)
        assert v.shape == (0, 5)
        run_case(dtype, 1, 1, 1)
        run_case(dtype, 5, 1, 4096, use_lengths=True)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    B, N, k = 64, 32768, 512
    x = torch.randn(B, N, device="cuda", dtype=torch.bfloat16)
    L = torch.full((B,), N, dtype=torch.int32, device="cuda")
    ib = torch.empty(B, k, dtype=torch.int32, device="cuda")
    x1 = torch.randn(1, 40000, device="cuda")  # a cluster-split plan too
    ib1 = torch.empty(1, 2048, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            ops.topk(x, k, lengths=L, return_values=False, out=ib)
            ops.topk(x1, 2048, return_values=False, sorted=True, out=ib1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.topk(x, k, lengths=L, return_values=False, out=ib)
        ops.topk(x1, 2048, return_values=False, sorted=True, out=ib1)
    for it in range(3):
        x.copy_(torch.randn(B, N, device="cuda", dtype=torch.bfloat16))
        L.copy_(torch.randint(0, N + 1, (B,), device="cuda", dtype=torch.int32))
        x1.copy_(torch.randn(1, 40000, device="cuda"))
        ib.fill_(0x5A5A5A5A)
        ib1.fill_(0x5A5A5A5A)
        g.replay()
        torch.cuda.synchronize()
        check(x, k, L, False, None, ib, f"graph replay {it}")
        check(x1, 2048, None, True, None, ib1, f"graph replay {it} (cluster, sorted)")


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    x = torch.randn(16, 20000, device="cuda")
    L = torch.randint(0, 20001, (16,), device="cuda", dtype=torch.int32)

    def f(x, L):
        v, i = ops.topk(x * 2, 512, lengths=L, sorted=True)
        return v, i, v.float().sum()

    cf = torch.compile(f, fullgraph=True)
    v, i, _ = cf(x, L)
    check(x * 2, 512, L, True, v, i, "compiled")
    buf = torch.empty(16, 512, dtype=torch.int64, device="cuda")
    g = torch.compile(lambda x, b: ops.topk(x, 512, return_values=False, index_dtype=torch.int64, out=b),
                      fullgraph=True)
    g(x, buf)
    check(x, 512, None, False, None, buf, "compiled out=")


@pytest.mark.gpu
def test_gpu_validation():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match="lengths is on cpu"):
        ops.topk(x, 3, lengths=torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out indices is on cpu"):
        ops.topk(x, 3, out=torch.empty(4, 3, dtype=torch.int32))


# small cases for compute-sanitizer (memcheck, racecheck, synccheck): cluster-split rows
# (DSMEM appends), 256- and 512-thread CTAs, the fallback (overflow, compaction), sorted
# through rank 0's buffer, select-all, streamed; the short-row kernel
@pytest.mark.gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sanitize_small(dtype):
    run_case(dtype, 3, 40000, 512, kind="scores", use_lengths=True, seed=1)  # clusters
    run_case(dtype, 300, 700, 64, kind="ties", seed=2)  # one 256-thread CTA per row
    run_case(dtype, 200, 9000, 64, kind="randn", seed=6)  # sampled, 256 threads
    run_case(dtype, 2, 70000, 1000, kind="allsame", seed=7)  # cluster overflow -> fallback
    run_case(dtype, 1, 30000, 700, kind="allsame", seed=8)  # one CTA: fallback compactions
    run_case(dtype, 2, 9000, 100, kind="special", sorted_=True, seed=3)
    run_case(dtype, 2, 9000, 4096, kind="randn", use_lengths=True, sorted_=True, seed=4)  # select-all
    # the short-row kernel: levels, sorted pairs, select-all, ragged lengths
    run_case(dtype, 5, 8192, 512, kind="ties", use_lengths=True, sorted_=True, seed=9)
    run_case(dtype, 3, 8192, 4096, kind="special", use_lengths=True, seed=10)
    run_case(dtype, 4, 1000, 100, kind="randn", return_values=False, index_dtype=torch.int64, seed=11)
    # canonical ties: the short-row kernel's index-order scan (2 vectors per thread), the
    # general kernel's index select (a cluster; 256 threads), the fallback's ordered tail
    nmax = 16384 if dtype != torch.float32 else 8192
    run_case(dtype, 3, nmax, 2048, kind="zeros", sorted_=True, seed=14)
    run_case(dtype, 2, 40000, 4096, kind="relu", use_lengths=True, seed=15)
    run_case(dtype, 140, 3001, 512, kind="zeros", seed=16)
    run_case(dtype, 2, 30001, 700, kind="allsame", sorted_=True, seed=17)
    # the fallback's sampled retry and its stream from 0 (a negative margin: the sampled
    # threshold too high): a cluster, one CTA
    for z in (-1.0, -4.0):
        run_case(dtype, 2, 70000, 1000, kind="scores", use_lengths=True, seed=12, margin=z)
        run_case(dtype, 1, 30000, 700, kind="randn", seed=13, margin=z)


@pytest.mark.gpu
@pytest.mark.sanitize
def test_sanitize_streamed():
    run_case(torch.float32, 1, 500_001, 300, kind="narrow", use_lengths=False, seed=5)
