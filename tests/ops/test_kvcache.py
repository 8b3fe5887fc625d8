"""V4 KV cache formats and ops: reference semantics (CPU) and bit-exact kernels (GPU).

Round-trip bound (FP8 rows): per 64-value group with scale s = 2^e, e4m3 keeps 3 mantissa
bits, so |deq - x| <= max(|x| * 2^-4, s * 2^-10) (normal codes: half an ulp = 2^-4
relative; subnormal codes: spacing 2^-9 * s), plus bf16 rounding of the dequantised value
(<= 2^-8 relative); RoPE values (bf16) round-trip exactly. Indexer keys: same with the
row's fp32 scale (no bf16 rounding: dequantised in fp32).
"""
import pytest
import torch

from deepfuse import _ext, ops
from deepfuse import kv_format as F
from deepfuse.ops import cast as C
from deepfuse.ops import kvcache as K

FP8 = torch.float8_e4m3fn


def rand_rows(n, dim=512, device="cpu", seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    # wide dynamic range across groups of 64, so scales differ within a row
    x = torch.randn(n, dim, generator=g)
    x = x * torch.exp2(torch.randint(-12, 12, (n, dim // 64), generator=g).float()).repeat_interleave(64, 1)
    return x.to(torch.bfloat16).to(device)


def bound(x, s_full):
    xf = x.float().abs()
    return torch.maximum(xf * 2.0**-4, s_full * 2.0**-10) * (1 + 2.0**-7) + xf * 2.0**-8


def check_row_roundtrip(deq, x, scales):
    """deq, x: [N, 512] bf16; scales uint8 [N, 8]."""
    s = C._expand(K.exp2_int(scales[:, :7].int() - 127), 64, 448)
    err = (deq[:, :448].float() - x[:, :448].float()).abs()
    assert bool((err <= bound(x[:, :448], s)).all()), f"max err {err.max()}"
    assert torch.equal(deq[:, 448:], x[:, 448:])
    assert bool((scales[:, 7] == 0).all()), "pad byte"


def slots_of(n, num_slots, gen, n_skip=0):
    s = torch.randperm(num_slots, generator=gen)[:n].clone()
    if n_skip:
        s[torch.randperm(n, generator=gen)[:n_skip]] = -1
    return s


# ----------------------------------------------------------------------------- formats
def test_format_layout_facts():
    f = F.KVFormat(64)
    assert f.row_bytes == 584 and f.page_bytes == 64 * 584 and f.scale_offset == 64 * 576
    assert f.page_bytes % 128 == 0 and f.scale_offset % 128 == 0
    assert F.KVFormat(16, "bf16").page_shape() == (16, 512)
    assert F.IndexerKeyFormat(64).page_bytes == 64 * 132
    with pytest.raises(ValueError, match="page_size"):
        F.KVFormat(24)
    with pytest.raises(ValueError, match="dtype"):
        F.KVFormat(16, "fp16")
    r = F.alloc_swa_rings(3, 5, F.ring_rows(2), device="cpu")
    assert r.window == 129 and r.fmt.page_size == 144 and r.data.shape == (3, 5, 144 * 584)
    p = F.alloc_kv_pages(2, 3, 16, device="cpu", poison=True)
    assert p.nope().shape == (2, 3, 16, 448) and p.nope().dtype == FP8
    assert p.rope().shape == (2, 3, 16, 64) and p.rope().dtype == torch.bfloat16
    assert p.scales().shape == (2, 3, 16, 8) and bool((p.data == 0xFF).all())
    ik = F.alloc_indexer_pages(2, 3, 16, device="cpu")
    assert ik.keys().shape == (2, 3, 16, 128) and ik.scales().shape == (2, 3, 16)


def test_row_format_byte_offsets():
    # One row written by kv_store sits exactly where kv_format says.
    pages = F.alloc_kv_pages(1, 2, 16, device="cpu", poison=True)
    x = rand_rows(1, seed=1)
    ops.kv_store(pages, torch.tensor([16 + 5]), x)  # page 1, row 5
    data, sc = K.kv_quantise_rows(x)
    base = 1 * pages.fmt.page_bytes
    raw = pages.data[0].view(-1)
    assert torch.equal(raw[base + 5 * 576: base + 6 * 576], data[0])
    assert torch.equal(raw[base + 16 * 576 + 5 * 8: base + 16 * 576 + 6 * 8], sc[0])
    # the e4m3 part is the ue8m0 group-64 cast of the no-RoPE values
    q, s = C.fp8_group_cast_ref(x[:, :448], 64, "ue8m0")
    assert torch.equal(data[0, :448], q.view(torch.uint8)[0]) and torch.equal(sc[0, :7], s[0])
    touched = torch.zeros_like(raw, dtype=torch.bool)
    touched[base + 5 * 576: base + 6 * 576] = True
    touched[base + 16 * 576 + 40: base + 16 * 576 + 48] = True
    assert bool((raw[~touched] == 0xFF).all()), "bytes outside the row were written"


# ----------------------------------------------------------------------------- kv_store
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_kv_store_roundtrip_and_placement(dtype, per_layer):
    g = torch.Generator().manual_seed(0)
    L, P, ps, T = 3, 5, 16, 37
    pages = F.alloc_kv_pages(L, P, ps, dtype, device="cpu", poison=True)
    x = torch.stack([rand_rows(T, seed=10 + l) for l in range(L)])
    x[0, 3, 7] = float("nan")
    x[1, 4, 9] = float("inf")
    x[2, 5, :64] = 0
    if per_layer:
        slots = torch.stack([slots_of(T, P * ps, g, 4) for _ in range(L)]).int()
    else:
        slots = slots_of(T, P * ps, g, 4)
    ops.kv_store(pages, slots, x)
    full = ops.kv_dequant(pages).view(L, P * ps, 512)
    if dtype == "fp8":
        sc_all = pages.scales().reshape(L, P * ps, 8)
        d4 = F._data_view(pages.data, ps, 576).reshape(L, P * ps, 576)
    for l in range(L):
        s = slots[l] if per_layer else slots
        keep = s >= 0
        xs = x[l][keep]
        if dtype == "bf16":
            assert torch.equal(full[l][s[keep]].view(torch.int16), xs.view(torch.int16))
        else:
            deq, sc = full[l][s[keep]], sc_all[l][s[keep]]
            fin = torch.isfinite(xs.float()).all(dim=1)
            check_row_roundtrip(deq[fin], xs[fin], sc[fin])
            data, scr = K.kv_quantise_rows(xs)
            assert torch.equal(d4[l][s[keep]], data) and torch.equal(sc, scr)
        untouched = torch.ones(P * ps, dtype=torch.bool)
        untouched[s[keep].long()] = False
        raw = pages.data.view(torch.uint8).view(L, -1)
        if dtype == "bf16":
            assert bool((raw[l].view(P * ps, 1024)[untouched] == 0xFF).all())
        else:
            assert bool((d4[l][untouched] == 0xFF).all()) and bool((sc_all[l][untouched] == 0xFF).all())
    # special values: NaN stays NaN, inf saturates, zero group gets byte 0 and zero codes
    if dtype == "fp8":
        q = pages.nope().reshape(L, P * ps, 448)
        s0 = slots[0] if per_layer else slots
        if s0[3] >= 0:
            assert torch.isnan(q[0, s0[3], 7].float())
        s1 = slots[1] if per_layer else slots
        if s1[4] >= 0:
            assert q[1, s1[4], 9].float().item() == 448.0
        s2 = slots[2] if per_layer else slots
        if s2[5] >= 0:
            assert sc_all[2, s2[5], 0].item() == 0 and bool((q[2, s2[5], :64].float() == 0).all())


def test_kv_store_single_layer_view():
    L, P, ps = 3, 2, 16
    pages = F.alloc_kv_pages(L, P, ps, device="cpu", poison=True)
    x = rand_rows(4, seed=3)
    ops.kv_store(pages.layer(1), torch.tensor([0, 1, 2, 3]), x)
    assert bool((pages.data[0] == 0xFF).all()) and bool((pages.data[2] == 0xFF).all())
    deq = ops.kv_dequant(pages)[1, 0, :4]
    check_row_roundtrip(deq, x, pages.scales()[1, 0, :4])


# ----------------------------------------------------------------------------- rings
def stream_ring(ring, seqs, chunks, req_slots, L):
    """Write the sequences through swa_store in chunks (last W rows of each chunk)."""
    W = ring.window
    done = [0] * len(seqs)
    for step in range(len(chunks[0])):
        rs, ps_, rows = [], [], []
        for b, seq in enumerate(seqs):
            n = chunks[b][step]
            lo = max(done[b], done[b] + n - W)
            for p in range(lo, done[b] + n):
                rs.append(req_slots[b]); ps_.append(p); rows.append(seq[:, p])
            done[b] += n
        if rows:
            kv = torch.stack(rows, dim=1)
            if L == 1:
                kv = kv[0]
            dev = ring.data.device
            ops.swa_store(ring, torch.tensor(rs, dtype=torch.int32, device=dev), torch.tensor(ps_, device=dev), kv.to(dev))
    return done


def expected_window(seq, n, W, fp8):
    """[L, W, 512] bf16: the dequantised last min(n, W) rows, zeros after."""
    L = seq.shape[0]
    out = torch.zeros(L, W, 512, dtype=torch.bfloat16)
    lo = max(0, n - W)
    for l in range(L):
        rows = seq[l, lo:n]
        if fp8:
            rows = K.kv_dequantise_rows(*K.kv_quantise_rows(rows))
        out[l, :n - lo] = rows
    return out


def same_bf16(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16)) or bool(
        ((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("W", [128, 129])
def test_ring_wraparound_ragged_and_gather(dtype, W):
    L, S = 2, 6
    ring = F.alloc_swa_rings(L, S, W, dtype, device="cpu", poison=True)
    lens = [3, W - 1, W, W + 1, 2 * W + 37]
    seqs = [torch.stack([rand_rows(n, seed=100 * b + l) for l in range(L)]) for b, n in enumerate(lens)]
    req_slots = [4, 0, 2, 5, 1]
    # chunks: a prefill then single-token decodes
    chunks = [[n - 3, 1, 1, 1] if n > 3 else [n, 0, 0, 0] for n in lens]
    done = stream_ring(ring, seqs, chunks, req_slots, L)
    assert done == lens
    lengths = torch.tensor(lens, dtype=torch.int64)
    got = ops.window_gather(ring, lengths, req_slot=torch.tensor(req_slots))
    assert got.shape == (L, len(lens), W, 512)
    for b, n in enumerate(lens):
        assert same_bf16(got[:, b], expected_window(seqs[b], n, W, dtype == "fp8")), f"request {b}"
    # request slot 3 was never written: still poisoned
    assert bool((ring.data[:, 3].view(torch.uint8) == 0xFF).all())
    # positions < W at the start: rows beyond n are zeros (request 0 has 3 rows)
    assert bool((got[:, 0, 3:] == 0).all())


def test_swa_store_skips_negative():
    ring = F.alloc_swa_rings(1, 2, 128, device="cpu", poison=True)
    x = rand_rows(3, seed=5)
    ops.swa_store(ring, torch.tensor([0, -1, 1]), torch.tensor([5, 6, -1]), x)
    d = ring.pages.scales()[0]
    assert bool((d[0, 5, :7] != 0xFF).all())
    assert bool((d[0, 6] == 0xFF).all()) and bool((d[1] == 0xFF).all())


# ----------------------------------------------------------------------------- pages <-> ring
def paged_setup(dtype, L=2, ps=16, W=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [0, 5, W, W + 3, 3 * W + 1]
    B = len(lens)
    max_pages = -(-max(lens) // ps)
    P = B * max_pages + 3
    perm = torch.randperm(P, generator=g)[:B * max_pages].view(B, max_pages).int()
    pages = F.alloc_kv_pages(L, P, ps, dtype, device="cpu", poison=True)
    seqs = []
    for b, n in enumerate(lens):
        seq = torch.stack([rand_rows(n, seed=1000 * seed + 10 * b + l) for l in range(L)])
        seqs.append(seq)
        if n:
            pos = torch.arange(n)
            slots = perm[b, pos // ps].long() * ps + pos % ps
            ops.kv_store(pages, slots, seq)
    return pages, perm, torch.tensor(lens, dtype=torch.int32), seqs


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_paged_gather_restore_roundtrip(dtype):
    W = 129
    pages, table, lengths, seqs = paged_setup(dtype, W=W)
    B = lengths.shape[0]
    got = ops.window_gather(pages, lengths, block_table=table, window=W)
    for b in range(B):
        assert same_bf16(got[:, b], expected_window(seqs[b], int(lengths[b]), W, dtype == "fp8")), f"request {b}"
    # pages -> ring (prefix hit) -> gather from the ring: same rows
    ring = F.alloc_swa_rings(pages.num_layers, B + 2, W, dtype, device="cpu", poison=True)
    req = torch.tensor([6, 0, 3, 1, 5])
    ops.window_restore(pages, ring, table, req, lengths, to="ring")
    assert same_bf16(ops.window_gather(ring, lengths, req_slot=req), got)
    for s in (2, 4):
        assert bool((ring.data[:, s].view(torch.uint8) == 0xFF).all())
    # ring -> fresh pages -> gather: same rows; pages outside the windows stay poisoned
    pages2 = F.alloc_kv_pages(pages.num_layers, pages.num_pages, pages.fmt.page_size, dtype, device="cpu", poison=True)
    ops.window_restore(pages2, ring, table, req, lengths, to="pages")
    assert same_bf16(ops.window_gather(pages2, lengths, block_table=table, window=W), got)
    used = set()
    for b in range(B):
        n = int(lengths[b])
        for p in range(max(0, n - W), n):
            used.add(int(table[b, p // pages.fmt.page_size]))
    for p in range(pages.num_pages):
        if p not in used:
            assert bool((pages2.data[:, p].view(torch.uint8) == 0xFF).all()), f"page {p} written"


def test_raw_gather_matches_dequant_and_missing_pages():
    W = 128
    pages, table, lengths, seqs = paged_setup("fp8", W=W, seed=1)
    table = table.clone()
    table[3, 0] = -1  # request 3 (n = W + 3) window starts at position 3: rows 0..12 missing
    deq = ops.window_gather(pages, lengths, block_table=table, window=W)
    raw = ops.window_gather(pages, lengths, block_table=table, window=W, dequant=False)
    assert isinstance(raw, F.KVPages) and raw.fmt.page_size == 128 and raw.data.shape == (2, 5, 128 * 584)
    assert same_bf16(ops.kv_dequant(raw), deq)
    assert bool((deq[:, 3, :13] == 0).all()) and bool((deq[:, 3, 13:] != 0).any())
    assert bool((raw.data[:, 0] == 0).all())  # empty request: zeros


# ----------------------------------------------------------------------------- indexer keys
@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_indexer_key_store(fmt):
    g = torch.Generator().manual_seed(2)
    L, P, ps, T = 2, 3, 16, 29
    cache = F.alloc_indexer_pages(L, P, ps, device="cpu", scale_fmt=fmt, poison=True)
    k = torch.stack([rand_rows(T, 128, seed=20 + l) for l in range(L)])
    slots = slots_of(T, P * ps, g, 3)
    ops.indexer_key_store(cache, slots, k)
    keep = slots >= 0
    q = cache.keys().reshape(L, -1, 128)
    s = cache.scales().reshape(L, -1)
    deq = ops.indexer_key_dequant(cache).reshape(L, -1, 128)
    for l in range(L):
        qr, sr = C.fp8_group_cast_ref(k[l][keep], 128, fmt)
        assert torch.equal(q[l][slots[keep]].view(torch.uint8), qr.view(torch.uint8))
        assert torch.equal(s[l][slots[keep]], C._scale_values(sr)[:, 0])
        x = k[l][keep].float()
        err = (deq[l][slots[keep]] - x).abs()
        assert bool((err <= torch.maximum(x.abs() * 2.0**-4, s[l][slots[keep]][:, None] * 2.0**-10) * (1 + 1e-6)).all())
        free = torch.ones(P * ps, dtype=torch.bool)
        free[slots[keep]] = False
        assert bool(torch.isnan(s[l][free]).all())  # 0xFFFFFFFF poison
    bf = F.alloc_indexer_pages(L, P, ps, "bf16", device="cpu", poison=True)
    ops.indexer_key_store(bf, slots, k)
    assert torch.equal(bf.data.view(L, -1, 128)[:, slots[keep]], k[:, keep])


# ----------------------------------------------------------------------------- validation, opcheck
def test_validation_errors():
    pages = F.alloc_kv_pages(2, 2, 16, device="cpu")
    x = rand_rows(3)
    with pytest.raises(ValueError, match="layers"):
        ops.kv_store(pages, torch.tensor([0, 1, 2]), x)
    with pytest.raises(TypeError, match="kv has dtype"):
        ops.kv_store(pages.layer(0), torch.tensor([0, 1, 2]), x.float())
    with pytest.raises(ValueError, match="kv must have shape"):
        ops.kv_store(pages.layer(0), torch.tensor([0, 1, 2]), rand_rows(3, 448))
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        ops.kv_store(pages.layer(0), torch.tensor([0, 1]), x)
    with pytest.raises(TypeError, match="slot_mapping has dtype"):
        ops.kv_store(pages.layer(0), torch.tensor([0.0, 1, 2]), x)
    with pytest.raises(TypeError, match="SwaRing"):
        ops.swa_store(pages, torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]), x)
    ring = F.alloc_swa_rings(1, 2, 128, device="cpu")
    with pytest.raises(ValueError, match="req_slot"):
        ops.window_gather(ring, torch.tensor([1]))
    with pytest.raises(ValueError, match="block_table"):
        ops.window_gather(pages, torch.tensor([1]))
    with pytest.raises(ValueError, match="block_table must have shape"):
        ops.window_gather(pages, torch.tensor([1]), block_table=torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="layers"):
        ops.window_restore(pages, ring, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                           torch.tensor([1]))
    with pytest.raises(ValueError, match="to must be"):
        ops.window_restore(pages, ring, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                           torch.tensor([1]), to="both")
    with pytest.raises(ValueError, match="not a KV page tensor"):
        F.kv_pages_from(torch.zeros(1, 2, 100, dtype=torch.uint8))


def test_opcheck_cpu():
    pages = F.alloc_kv_pages(2, 3, 16, device="cpu")
    pages.data.zero_()
    kv = torch.stack([rand_rows(5, seed=7), rand_rows(5, seed=8)])
    slots = torch.tensor([0, 17, -1, 40, 3])
    torch.library.opcheck(torch.ops.deepfuse.kv_store.default, (pages.data, kv, slots, None, 1))
    ring = F.alloc_swa_rings(2, 3, 129, device="cpu")
    ring.data.zero_()
    torch.library.opcheck(torch.ops.deepfuse.kv_store.default,
                          (ring.data, kv, torch.tensor([0, 1, 2, 0, 1]), torch.tensor([0, 1, 2, 130, 300]), 129))
    ik = F.alloc_indexer_pages(2, 3, 16, device="cpu")
    ik.data.zero_()
    torch.library.opcheck(torch.ops.deepfuse.indexer_key_store.default,
                          (ik.data, torch.stack([rand_rows(5, 128), rand_rows(5, 128)]), slots, "ue8m0"))
    table = torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32)
    lengths = torch.tensor([40, 7])
    for dq in (True, False):
        torch.library.opcheck(torch.ops.deepfuse.kv_window_gather.default, (pages.data, lengths, table, 128, False, dq))
    req = torch.tensor([2, 0])
    torch.library.opcheck(torch.ops.deepfuse.kv_window_to_ring.default, (pages.data, ring.data, table, req, lengths, 129))
    torch.library.opcheck(torch.ops.deepfuse.kv_window_to_pages.default, (ring.data, pages.data, table, req, lengths, 129))


def test_compile_cpu():
    pages = F.alloc_kv_pages(1, 2, 16, device="cpu", poison=True)
    kv = rand_rows(4, seed=9)
    slots = torch.tensor([3, -1, 20, 7])

    def step(data, kv, slots, lengths, table):
        torch.ops.deepfuse.kv_store(data, kv[None], slots, None, 1)
        return torch.ops.deepfuse.kv_window_gather(data, lengths, table, 128, False, True)

    f = torch.compile(step, fullgraph=True, backend="aot_eager")
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    out = f(pages.data, kv, slots, torch.tensor([21]), table)
    ref_pages = F.alloc_kv_pages(1, 2, 16, device="cpu", poison=True)
    ops.kv_store(ref_pages, slots, kv)
    assert torch.equal(pages.data, ref_pages.data)
    assert same_bf16(out, ops.window_gather(ref_pages, torch.tensor([21]), block_table=table))


# ----------------------------------------------------------------------------- the C++ launchers' checks
_needs_ext = pytest.mark.skipif(not _ext.has_cuda_kernels(), reason="needs the compiled extension")
BF16, I32, I64, U8 = torch.bfloat16, torch.int32, torch.int64, torch.uint8


def _store_args(device="cpu", **change):
    a = dict(kv=torch.zeros(2, 5, 512, dtype=BF16), cache=F.alloc_kv_pages(2, 3, 16, device="cpu").data,
             index=torch.zeros(5, dtype=I64))
    a.update(change)
    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in a.items()}


@_needs_ext
@pytest.mark.parametrize("change, match", [
    (dict(kv=torch.zeros(2, 5, 512)), r"kv_store: argument 'kv' must be bfloat16 \(got float32\[2, 5, 512\] on cpu\)"),
    (dict(kv=torch.zeros(2, 5, 448, dtype=BF16)), r"argument 'kv' must have shape \[\*, \*, 512\]"),
    (dict(kv=torch.zeros(2, 5, 1024, dtype=BF16)[..., ::2]), "argument 'kv' must have stride 1 in its last dim"),
    (dict(kv=torch.zeros(3, 5, 512, dtype=BF16)), "argument 'cache' must have 3 layers"),
    (dict(cache=torch.zeros(2, 3, 100, dtype=U8)), "argument 'cache' must hold whole 584-byte rows"),
    (dict(cache=torch.zeros(2, 3, 16, 448, dtype=BF16)), r"argument 'cache' must have shape \[\*, \*, \*, 512\]"),
    (dict(cache=torch.zeros(2, 3, 16 * 584)), "argument 'cache' must be uint8 or bfloat16"),
    (dict(index=torch.zeros(5)), "argument 'index' must be int32 or int64"),
    (dict(index=torch.zeros(4, dtype=I64)), r"argument 'index' must have shape \[5\]"),
    (dict(index=torch.zeros(3, 5, dtype=I32)), r"argument 'index' must have shape \[2, 5\]"),
    (dict(positions=torch.zeros(5, dtype=I64), window=129), "argument 'cache' must hold window = 129 rows"),
    (dict(positions=torch.zeros(5, dtype=torch.int16), window=16), "argument 'positions' must be int32 or int64"),
    (dict(), "argument 'kv' must be a CUDA tensor"),
    (dict(index=torch.zeros(2, 5, dtype=I32), positions=torch.zeros(5, dtype=I64), window=16),
     "argument 'index' must have 1 dims"),
])
def test_kv_store_launcher_rejects(change, match):
    with pytest.raises(ValueError, match=match):
        _ext._C.kv_store(**_store_args(**change))


@_needs_ext
def test_indexer_key_store_launcher_rejects():
    C = _ext._C
    cache = F.alloc_indexer_pages(2, 3, 16, device="cpu").data
    k, slots = torch.zeros(2, 5, 128, dtype=BF16), torch.zeros(5, dtype=I32)
    with pytest.raises(ValueError, match="indexer_key_store: argument 'scale_fmt' must be fp32 or ue8m0"):
        C.indexer_key_store(k=k, cache=cache, slots=slots, scale_fmt="e8m0")
    with pytest.raises(ValueError, match=r"argument 'k' must have shape \[\*, \*, 128\]"):
        C.indexer_key_store(k=torch.zeros(2, 5, 512, dtype=BF16), cache=cache, slots=slots)
    with pytest.raises(ValueError, match="argument 'k' must be bfloat16"):
        C.indexer_key_store(k=k.half(), cache=cache, slots=slots)
    with pytest.raises(ValueError, match="argument 'cache' must hold whole 132-byte rows"):
        C.indexer_key_store(k=k, cache=torch.zeros(2, 3, 584, dtype=U8), slots=slots)
    with pytest.raises(ValueError, match=r"argument 'slots' must have shape \[5\]"):
        C.indexer_key_store(k=k, cache=cache, slots=slots[:4])
    with pytest.raises(ValueError, match="argument 'k' must be a CUDA tensor"):
        C.indexer_key_store(k=k, cache=cache, slots=slots, scale_fmt="ue8m0")


def _copy_args(**change):
    # fp8 pages (block table) -> a dense bf16 [L, B, W, 512] buffer: the dequantising gather
    a = dict(src_cache=F.alloc_kv_pages(2, 4, 16, device="cpu").data, src_index=torch.zeros(3, 2, dtype=I32),
             dst_cache=torch.zeros(2, 3, 128, 512, dtype=BF16), dst_index=None, lengths=torch.zeros(3, dtype=I64),
             window=128, fill_missing=True)
    a.update(change)
    return a


@_needs_ext
@pytest.mark.parametrize("change, match", [
    (dict(lengths=torch.zeros(3)), "kv_window_copy: argument 'lengths' must be int32 or int64"),
    (dict(lengths=torch.zeros(3, 1, dtype=I64)), "argument 'lengths' must have 1 dims"),
    (dict(window=0), "argument 'window' must be positive"),
    (dict(src_index=torch.zeros(3, 2, 1, dtype=I32)), r"argument 'src_index' must be None \(dense pages\), \[B\]"),
    (dict(src_index=torch.zeros(4, 2, dtype=I32)), r"argument 'src_index' must have shape \[3, \*\]"),
    (dict(src_index=torch.zeros(3, dtype=I32)), "argument 'src_cache' must hold window = 128 rows per ring page"),
    (dict(src_index=torch.zeros(3, 2)), "argument 'src_index' must be int32 or int64"),
    (dict(dst_cache=torch.zeros(2, 2, 128, 512, dtype=BF16)),
     r"argument 'dst_cache' must have one page per request \(3\)"),
    (dict(dst_cache=torch.zeros(1, 3, 128, 512, dtype=BF16)), "argument 'dst_cache' must have 2 layers"),
    (dict(src_cache=torch.zeros(2, 4, 16, 512, dtype=BF16), dst_cache=torch.zeros(2, 3, 128 * 584, dtype=U8)),
     "argument 'dst_cache' must be bfloat16 when src_cache is"),
    (dict(dst_cache=torch.zeros(2, 3, 128, 512, dtype=BF16), dst_index=torch.zeros(3, dtype=I64)),
     "argument 'dst_index' must be None when fill_missing"),
    (dict(src_cache=F.alloc_kv_pages(2, 4, 16, device="cpu").data[:, :, :-8]), "must hold whole 584-byte rows"),
    (dict(), "argument 'src_cache' must be a CUDA tensor"),
])
def test_kv_window_copy_launcher_rejects(change, match):
    with pytest.raises(ValueError, match=match):
        _ext._C.kv_window_copy(**_copy_args(**change))


@pytest.mark.gpu
def test_launchers_reject_mixed_devices():
    a = _store_args(device="cuda")
    a["index"] = a["index"].cpu()
    with pytest.raises(ValueError, match="kv_store: argument 'index' must be a CUDA tensor"):
        _ext._C.kv_store(**a)
    a = _copy_args(**{n: t.cuda() for n, t in _copy_args().items() if isinstance(t, torch.Tensor)})
    a["lengths"] = a["lengths"].cpu()
    with pytest.raises(ValueError, match="kv_window_copy: argument 'lengths' must be a CUDA tensor"):
        _ext._C.kv_window_copy(**a)
    a["lengths"] = a["lengths"].cuda()
    a["dst_cache"].fill_(1.0)
    _ext._C.kv_window_copy(**a)  # on one device it launches: no rows in the windows, every row zero-filled
    torch.cuda.synchronize()
    assert not a["dst_cache"].any()


# ----------------------------------------------------------------------------- GPU kernels
def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, what: str):
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    if a.dtype == torch.bfloat16:
        same = (a.view(torch.int16) == b.view(torch.int16)) | (torch.isnan(a) & torch.isnan(b))
    else:
        same = a.view(torch.uint8) == b.view(torch.uint8)
    bad = (~same).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} of {a.numel()} elements differ, first at {bad[0].tolist()}"


def to_cuda(obj):
    if isinstance(obj, F.KVPages):
        return F.KVPages(obj.fmt, obj.data.cuda())
    if isinstance(obj, F.SwaRing):
        return F.SwaRing(obj.window, to_cuda(obj.pages))
    if isinstance(obj, F.IndexerKeyPages):
        return F.IndexerKeyPages(obj.fmt, obj.data.cuda())
    return obj.cuda()


def special(x):
    """NaN, -inf, an all-zero scale group and a subnormal, on rows that exist (cycling)."""
    x = x.clone()
    rows = x.view(-1, x.shape[-1])
    n = rows.shape[0]
    rows[0 % n, 5] = float("nan")
    rows[1 % n, 70] = float("-inf")
    rows[2 % n, :64] = 0
    rows[3 % n, 100] = 1e-40
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("L,T,P,ps,idx", [(1, 1, 4, 16, torch.int64), (4, 64, 40, 64, torch.int32),
                                          (8, 512, 128, 64, torch.int64), (1, 20000, 400, 64, torch.int32)])
@pytest.mark.parametrize("per_layer", [False, True])
def test_kv_store_gpu_bit_exact(dtype, L, T, P, ps, idx, per_layer):
    g = torch.Generator().manual_seed(L * 7 + T)
    kv = special(torch.stack([rand_rows(T, seed=l + T) for l in range(L)]))
    if per_layer:
        slots = torch.stack([slots_of(T, P * ps, g, T // 7) for _ in range(L)]).to(idx)
    else:
        slots = slots_of(T, P * ps, g, T // 7).to(idx)
    ref = F.alloc_kv_pages(L, P, ps, dtype, device="cpu", poison=True)
    gpu = to_cuda(ref)
    ops.kv_store(ref, slots, kv if L > 1 else kv[0])
    ops.kv_store(gpu, slots.cuda(), kv.cuda() if L > 1 else kv[0].cuda())
    torch.cuda.synchronize()
    assert_same_bytes(gpu.data, ref.data, "cache")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("W", [128, 129, 131])
def test_ring_gpu_bit_exact(dtype, W):
    L, S = 3, 7
    lens = [1, 5, W - 1, W, W + 1, 2 * W + 37, 700]
    seqs = [torch.stack([special(rand_rows(max(n, 4), seed=100 * b + l))[:n] for l in range(L)]) for b, n in enumerate(lens)]
    req_slots = [4, 0, 2, 5, 1, 6, 3]
    chunks = [[n - 1, 1] for n in lens]
    ref = F.alloc_swa_rings(L, S + 1, W, dtype, device="cpu", poison=True)
    gpu = to_cuda(ref)

    stream_ring(ref, seqs, chunks, req_slots, L)
    stream_ring(gpu, seqs, chunks, req_slots, L)
    torch.cuda.synchronize()
    assert_same_bytes(gpu.data, ref.data, "ring")
    lengths = torch.tensor(lens)
    req = torch.tensor(req_slots, dtype=torch.int32)
    for dq in (True, False):
        a = ops.window_gather(ref, lengths, req_slot=req, dequant=dq)
        b = ops.window_gather(gpu, lengths.cuda(), req_slot=req.cuda(), dequant=dq)
        a, b = (a.data, b.data) if isinstance(a, F.KVPages) else (a, b)
        assert_same_bytes(b, a, f"gather dequant={dq}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("ps,W", [(16, 128), (64, 129)])
def test_paged_window_gpu_bit_exact(dtype, ps, W):
    pages, table, lengths, _ = paged_setup(dtype, L=3, ps=ps, W=W, seed=ps)
    table = table.clone()
    table[4, 2] = -1  # a missing page
    gp, gt, gl = to_cuda(pages), table.cuda(), lengths.cuda()
    for dq in (True, False):
        a = ops.window_gather(pages, lengths, block_table=table, window=W, dequant=dq)
        b = ops.window_gather(gp, gl, block_table=gt, window=W, dequant=dq)
        a, b = (a.data, b.data) if isinstance(a, F.KVPages) else (a, b)
        assert_same_bytes(b, a, f"gather dequant={dq}")
    req = torch.tensor([6, 0, 3, 1, 5], dtype=torch.int64)
    ring = F.alloc_swa_rings(3, 8, W, dtype, device="cpu", poison=True)
    gring = to_cuda(ring)
    ops.window_restore(pages, ring, table, req, lengths, to="ring")
    ops.window_restore(gp, gring, gt, req.cuda(), gl, to="ring")
    assert_same_bytes(gring.data, ring.data, "pages -> ring")
    p2 = F.alloc_kv_pages(3, pages.num_pages, ps, dtype, device="cpu", poison=True)
    gp2 = to_cuda(p2)
    ops.window_restore(p2, ring, table, req, lengths, to="pages")
    ops.window_restore(gp2, gring, gt, req.cuda(), gl, to="pages")
    assert_same_bytes(gp2.data, p2.data, "ring -> pages")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("L,T", [(1, 3), (4, 300), (1, 16384)])
def test_indexer_key_store_gpu_bit_exact(fmt, dtype, L, T):
    g = torch.Generator().manual_seed(T)
    P, ps = -(-T // 64) + 2, 64
    k = special(torch.stack([rand_rows(T + 4, 128, seed=l)[:T] for l in range(L)])) if T >= 4 else \
        torch.stack([rand_rows(T, 128, seed=l) for l in range(L)])
    slots = torch.stack([slots_of(T, P * ps, g, T // 5) for _ in range(L)]).int()
    ref = F.alloc_indexer_pages(L, P, ps, dtype, device="cpu", scale_fmt=fmt, poison=True)
    gpu = to_cuda(ref)
    ops.indexer_key_store(ref, slots, k)
    ops.indexer_key_store(gpu, slots.cuda(), k.cuda())
    torch.cuda.synchronize()
    assert_same_bytes(gpu.data, ref.data, "indexer cache")


@pytest.mark.gpu
def test_gpu_validation():
    pages = F.alloc_kv_pages(1, 2, 16, device="cuda")
    x = rand_rows(3, device="cuda")
    with pytest.raises(ValueError, match="16-byte aligned"):
        ops.kv_store(pages, torch.tensor([0, 1, 2], device="cuda"), torch.empty(3, 520, dtype=torch.bfloat16, device="cuda")[:, 4:516])
    with pytest.raises(ValueError, match="is on"):
        ops.kv_store(pages, torch.tensor([0, 1, 2]), x)
    # empty batches are no-ops
    ops.kv_store(pages, torch.empty(0, dtype=torch.int64, device="cuda"), torch.empty(0, 512, dtype=torch.bfloat16, device="cuda"))
    out = ops.window_gather(pages, torch.empty(0, dtype=torch.int32, device="cuda"),
                            block_table=torch.zeros(0, 1, dtype=torch.int32, device="cuda"))
    assert out.shape == (1, 0, 128, 512)


@pytest.mark.gpu
def test_kv_store_cuda_graph():
    L, T, P, ps = 4, 96, 16, 64
    g = torch.Generator().manual_seed(5)
    pages = F.alloc_kv_pages(L, P, ps, device="cuda", poison=True)
    kv = torch.empty(L, T, 512, dtype=torch.bfloat16, device="cuda")
    slots = torch.empty(T, dtype=torch.int64, device="cuda")
    kv.copy_(rand_rows(L * T).view(L, T, 512))
    slots.copy_(slots_of(T, P * ps, g, 10))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.kv_store(pages, slots, kv)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.kv_store(pages, slots, kv)
    pages.data.fill_(0xFF)
    new_kv, new_slots = rand_rows(L * T, seed=77).view(L, T, 512), slots_of(T, P * ps, g, 20)
    kv.copy_(new_kv)
    slots.copy_(new_slots)
    graph.replay()
    torch.cuda.synchronize()
    ref = F.alloc_kv_pages(L, P, ps, device="cpu", poison=True)
    ops.kv_store(ref, new_slots, new_kv)
    assert_same_bytes(pages.data, ref.data, "graph replay")


@pytest.mark.gpu
def test_compile_gpu():
    pages = F.alloc_kv_pages(2, 4, 16, device="cuda", poison=True)
    kv = rand_rows(2 * 10, seed=3).view(2, 10, 512).cuda()
    slots = torch.arange(10, device="cuda") * 3
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([28], device="cuda")

    def step(data, kv, slots):
        torch.ops.deepfuse.kv_store(data, kv, slots, None, 1)
        return torch.ops.deepfuse.kv_window_gather(data, lengths, table, 128, False, True)

    out = torch.compile(step, fullgraph=True)(pages.data, kv, slots)
    ref = F.alloc_kv_pages(2, 4, 16, device="cpu", poison=True)
    ops.kv_store(ref, slots.cpu(), kv.cpu())
    assert_same_bytes(pages.data, ref.data, "compiled store")
    assert_same_bytes(out, ops.window_gather(ref, lengths.cpu(), block_table=table.cpu()), "compiled gather")


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_kvcache_sanitize(dtype):
    g = torch.Generator().manual_seed(11)
    L, T, P, ps = 2, 37, 4, 16
    kv = rand_rows(L * T).view(L, T, 512)
    slots = slots_of(T, P * ps, g, 5)
    ref = F.alloc_kv_pages(L, P, ps, dtype, device="cpu", poison=True)
    gpu = to_cuda(ref)
    ops.kv_store(ref, slots, kv)
    ops.kv_store(gpu, slots.cuda(), kv.cuda())
    table = torch.tensor([[0, 1, 2, 3], [3, -1, 1, 0]], dtype=torch.int32)
    lengths = torch.tensor([50, 33], dtype=torch.int32)
    req = torch.tensor([1, 0])
    ring = F.alloc_swa_rings(L, 2, 20, dtype, device="cpu", poison=True)
    gring = to_cuda(ring)
    ops.window_restore(ref, ring, table, req, lengths)
    ops.window_restore(gpu, gring, table.cuda(), req.cuda(), lengths.cuda())
    for dq in (True, False):
        a = ops.window_gather(ring, lengths, req_slot=req, dequant=dq)
        b = ops.window_gather(gring, lengths.cuda(), req_slot=req.cuda(), dequant=dq)
        a, b = (a.data, b.data) if isinstance(a, F.KVPages) else (a, b)
        assert_same_bytes(b, a, "gather")
    ik = F.alloc_indexer_pages(L, P, ps, dtype, device="cpu", poison=True)
    gik = to_cuda(ik)
    k = rand_rows(T, 128)
    ops.indexer_key_store(F.IndexerKeyPages(ik.fmt, ik.data[:1]), slots, k)
    ops.indexer_key_store(F.IndexerKeyPages(gik.fmt, gik.data[:1]), slots.cuda(), k.cuda())
    torch.cuda.synchronize()
    assert_same_bytes(gpu.data, ref.data, "pages")
    assert_same_bytes(gring.data, ring.data, "ring")
    assert_same_bytes(gik.data, ik.data, "indexer")


# ----------------------------------------------------------------------------- benchmark smoke (CPU)
def test_bench_cases_run_on_cpu(monkeypatch):
    # Every microbenchmark case and its PyTorch baseline runs (small sizes, CPU), and the
    # baselines compute the same thing as the ops.
    from microbench import bench_kvcache as BK

    monkeypatch.setattr(BK, "DEV", "cpu")
    names = sorted({c[0] for c in BK.cases(True, 3)})
    for name in names:
        fn, tfn, nbytes, rows = BK.setup(name, "decode" if "store" in name else "window", 2, 16)
        a, b = fn(), tfn()
        assert nbytes > 0 and rows > 0
        if name == "gather_ring_bf16" or name == "gather_pages_bf16":
            assert same_bf16(a.view(-1, 512), b)
    # store baselines == ops (same bytes)
    g = torch.Generator().manual_seed(4)
    kv = rand_rows(2 * 20).view(2, 20, 512)
    slots = slots_of(20, 64, g)
    a, b = (F.alloc_kv_pages(2, 4, 16, device="cpu", poison=True) for _ in range(2))
    ops.kv_store(a, slots, kv)
    BK.torch_kv_store(b.data, slots, kv, 16)
    assert torch.equal(a.data, b.data)
    k = rand_rows(2 * 20, 128).view(2, 20, 128)
    a, b = (F.alloc_indexer_pages(2, 4, 16, device="cpu", poison=True) for _ in range(2))
    ops.indexer_key_store(a, slots, k)
    BK.torch_idx_store(b.data, slots, k, 16)
    assert torch.equal(a.data, b.data)
