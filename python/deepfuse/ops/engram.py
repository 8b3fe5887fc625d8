"""Engram (DeepSeek V4.1): hashed n-gram memory read into the mHC streams of a few layers.

Semantics (the references below define them; DeepSeek's release, inference/engram.py and
inference/model.py of DeepSeek-V4.1-Flash, and tile-kernels' tile_kernels.torch.engram are
the specification; docs/notes/v41.md cites them):
- Compressed vocabulary (host): every token id maps to a smaller id space in which tokens
  that normalise alike (NFKC, NFD, accents stripped, lowercase, whitespace runs -> one
  space, stripped; a lone space kept) share an id. compressed_token_map(tokenizer).
- Hash constants (host): per Engram layer l, multipliers [M] (M = max n-gram size): odd
  int64 from numpy's default_rng(10007 * layer_id), bounded so id * multiplier fits int64
  (bound derived from the compressed vocabulary size); per (n-gram order 2..M, head) a
  distinct prime above engram_vocab_size - 1 (drawn in order over all layers, never
  reused) and the running offset of its bucket range in the layer's table.
- N-gram ids: column s of token t is the compressed id at position t - s; positions before
  the sequence (or after a dead token, -1) take the pad id (the compressed id of the pad
  token), and so do all further look-backs.
- engram_hash(ngram_ids [N, M], multipliers [L, M], primes [L, C], offsets [L, C])
  -> [N, L, C] int64, C = (M - 1) * H: h = XOR_{s<=i} ids[s] * mult[s]; column
  (i - 1) * H + head = h mod prime + offset, for i = 1 .. M - 1.
- engram_lookup(table [R, D] e4m3, scale [R, D / 32] UE8M0 bytes, ids [N, C])
  -> [N, C, D] out_dtype: row values times 2^(scale - 127) per 32 columns. The table may
  live on another device than ids (pinned host memory with ids on the GPU): rows are
  gathered where the table is and returned on ids' device.
- engram_gate(hidden [N, n, d], kv [N, n + 1, d], w_hidden [n, d], w_embed [n, d], clamp,
  eps) -> [N, n, d] hidden.dtype: k = kv[:, :n], v = kv[:, n];
  dot = <x w_h, k w_e> rsqrt(mean x^2 + eps) rsqrt(mean k^2 + eps) d^-0.5 per stream,
  g = sigmoid(sign(dot) sqrt(max(|dot|, clamp))), out = x + g v (fp32 math).
The projection wkv between lookup and gate is the model's Linear (rows flattened to
C * D -> (n + 1) d).

- engram_embed(ngram [N, M], multipliers [M], primes [C], offsets [C], table, scale)
  -> [N, C, D]: one layer's engram_lookup(table, scale, engram_hash(...)[:, 0]) in one pass.

CUDA (csrc/engram): engram_hash (a thread per output); engram_lookup / engram_embed: the
gather reads 16 bytes of a row and its exponent per thread and writes the dequantised values
(exact: e4m3 -> fp32, times a power of two, rounded once to out_dtype; the same as the
reference), the row id read from ids or hashed in the kernel; the table in device memory or
in page-locked host memory on the host (read over UVA: no copy of the table, the rows cross
PCIe as the kernel reads them). Row ids outside [0, R) give zero rows (the reference raises).
engram_gate: a block per (token, stream), bf16 / fp32 hidden and kv of one dtype, d % 8 == 0,
weights read as fp32. No allocation inside the launch, no sync: graph-capturable. Other
inputs on CUDA (a pageable host table, ids on the CPU, fp16 gate inputs) run the references
only where allowed (ops._fallback), else NoKernelError. Prefetch of a step's rows on a side
stream: engine/engram_state.py (EngramPrefetch).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from deepfuse import _ext
from deepfuse.ops._checks import check_tensor
from deepfuse.ops._fallback import kernels_off_reason, need_reference
from deepfuse.ops._registry import Op, op

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)
SCALE_BLOCK = 32  # columns per UE8M0 scale of a table row
DEAD = -1         # a history entry with no token (before the sequence)


# ----------------------------------------------------------------------------- host helpers
def compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """(map [V] int64: token id -> compressed id, compressed vocabulary size) of a
    `tokenizers.Tokenizer` (or a transformers fast tokenizer), or of a tokenizer.json path /
    a folder holding one."""
    from tokenizers import Regex, Tokenizer, normalizers

    if isinstance(tokenizer, (str, Path)):
        p = Path(tokenizer)
        tokenizer = Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))
    tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)  # a transformers fast tokenizer
    lone_space = "\ue000"  # private-use: keeps a token that is one space from stripping to ""
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), lone_space),
        normalizers.Strip(), normalizers.Replace(lone_space, " "),
    ])
    V = tokenizer.get_vocab_size()
    ids: dict[str, int] = {}
    out = np.empty(V, dtype=np.int64)
    for t in range(V):
        text = tokenizer.decode([t], skip_special_tokens=False)
        if "\ufffd" in text:  # part of a UTF-8 sequence: keyed by its raw token
            key = tokenizer.id_to_token(t)
        else:
            key = norm.normalize_str(text) or text
        out[t] = ids.setdefault(key, len(ids))
    return out, len(ids)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):  # deterministic below 3.3e24
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def hash_primes(num_layers: int, max_ngram: int, n_heads: int, vocab_size: int) -> np.ndarray:
    """[L, (M - 1) * H] int64 bucket moduli: per layer, per n-gram order, per head the next
    prime above the previous one of that order (starting at vocab_size - 1), never reused."""
    seen: set[int] = set()
    out = np.empty((num_layers, (max_ngram - 1) * n_heads), dtype=np.int64)
    for layer in range(num_layers):
        for order in range(max_ngram - 1):
            cur = vocab_size - 1
            for head in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                out[layer, order * n_heads + head] = cur
    return out


def hash_offsets(primes: np.ndarray) -> np.ndarray:
    """[L, C] int64 first row of each bucket range (exclusive prefix sums per layer)."""
    return np.concatenate([np.zeros((primes.shape[0], 1), np.int64), np.cumsum(primes, axis=1)[:, :-1]], axis=1)


def hash_multipliers(layer_ids, max_ngram: int, compressed_vocab_size: int) -> np.ndarray:
    """[L, M] int64 odd multipliers, from default_rng(10007 * layer_id) per layer."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * int(i)).integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1
            for i in layer_ids]
    return np.stack(rows).astype(np.int64)


def ngram_ids(cids: torch.Tensor, pad_id: int, max_ngram: int, history: Optional[torch.Tensor] = None) -> torch.Tensor:
    """N-gram windows of compressed ids: cids [B, T] (the ids at positions p0 .. p0 + T - 1,
    -1 = dead) and history [B, M - 1] (the ids at p0 - M + 1 .. p0 - 1, -1 = none; None: the
    sequence starts at p0) -> [B, T, M] int64, column s the id at t - s, pad_id from the first
    missing or dead look-back on."""
    B, T = cids.shape
    if history is None:
        history = cids.new_full((B, max_ngram - 1), DEAD)
    seq = torch.cat([history.to(cids.dtype), cids], dim=1).long()  # [B, M - 1 + T]
    cols, blocked = [], torch.zeros(B, T, dtype=torch.bool, device=cids.device)
    for s in range(max_ngram):
        src = seq[:, max_ngram - 1 - s: max_ngram - 1 - s + T]
        blocked = blocked | (src < 0)
        cols.append(torch.where(blocked, torch.full_like(src, pad_id), src))
    return torch.stack(cols, dim=-1)


_ALL_KERNELS = frozenset(("engram_hash", "engram_lookup", "engram_embed", "engram_gate"))
_KERNELS = set(_ALL_KERNELS)  # ops whose csrc/engram kernel serves CUDA calls (set_kernels)


def set_kernels(enabled, ops=None) -> frozenset:
    """Switch the CUDA paths of the Engram ops (`ops`, default all) between csrc/engram's
    kernels and the policy of an op without a kernel (the reference where allowed, else
    NoKernelError); returns the previous set of ops with kernels on (pass it back as `enabled`
    to restore)."""
    prev = frozenset(_KERNELS)
    if isinstance(enabled, (set, frozenset)):
        _KERNELS.clear()
        _KERNELS.update(enabled)
        return prev
    names = _ALL_KERNELS if ops is None else frozenset(ops)
    if enabled:
        _KERNELS.update(names)
    else:
        _KERNELS.difference_update(names)
    return prev


def _off_reason(name: str) -> Optional[str]:
    if name not in _KERNELS:
        return f"the {name} kernel is switched off (ops.engram.set_kernels)"
    return kernels_off_reason()


def _kernel_op(name: str, ref: Callable, fake: Callable, kernel: Callable) -> Op:
    """deepfuse::<name> whose CPU path is `ref`; its CUDA path `kernel(*args)` returns the
    output, or a str saying why the kernel cannot serve the call (then the reference runs
    through need_reference)."""
    o = op(name)(ref)

    @o.register_kernel("cuda")
    def _(*args):
        r = kernel(*args)
        if isinstance(r, str):
            need_reference(name, r)
            return ref(*args)
        return r

    o.register_fake(fake)
    return o


def _table_gap(table: torch.Tensor, scale: torch.Tensor, dev: torch.device) -> Optional[str]:
    """Why the gather cannot read table / scale from a kernel on `dev` (None: it can)."""
    if dev.type != "cuda":
        return f"the row ids are on {dev} (the kernel runs where the ids are: on a GPU)"
    for arg, t in (("table", table), ("scale", scale)):
        if t.device.type == "cuda":
            if t.device != dev:
                return f"{arg} is on {t.device}, the ids on {dev}"
        elif t.device.type != "cpu":
            return f"{arg} is on {t.device}"
        elif t.numel() and not torch.cuda.is_current_stream_capturing() and not t.is_pinned():
            return (f"{arg} is in pageable host memory (the kernel reads page-locked host memory; "
                    f"ops.engram.to_host pins)")
    return None


# ----------------------------------------------------------------------------- engram_hash
def engram_hash_ref(ngram: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
    L, M = multipliers.shape
    H = primes.shape[1] // (M - 1)
    prod = ngram.long().unsqueeze(1) * multipliers.long().unsqueeze(0)  # [N, L, M]
    h = prod[..., 0]
    out = []
    for i in range(1, M):
        h = torch.bitwise_xor(h, prod[..., i])
        cols = slice((i - 1) * H, i * H)
        out.append(h.unsqueeze(-1) % primes[:, cols].long() + offsets[:, cols].long())
    return torch.cat(out, dim=-1)


def _engram_hash_fake(ngram, multipliers, primes, offsets):
    return ngram.new_empty(ngram.shape[0], multipliers.shape[0], primes.shape[1], dtype=torch.int64)


def _engram_hash_cuda(ngram, multipliers, primes, offsets):
    why = _off_reason("engram_hash")
    if why is not None:
        return why
    out = torch.empty(ngram.shape[0], multipliers.shape[0], primes.shape[1], dtype=torch.int64, device=ngram.device)
    _ext.ext(ngram.device).engram_hash(ngram=_inner(ngram), multipliers=multipliers.contiguous(),
                                       primes=primes.contiguous(), offsets=offsets.contiguous(), out=out)
    return out


def _inner(t: torch.Tensor) -> torch.Tensor:
    """t with a unit last-dim stride (the kernels take any row stride)."""
    return t if t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t contiguous and 16-byte aligned (the vector loads of the gate)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


_engram_hash = _kernel_op("engram_hash", engram_hash_ref, _engram_hash_fake, _engram_hash_cuda)


def engram_hash(ngram: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
    """Table rows [N, L, C] int64 of the n-gram windows ngram [N, M] (see module doc)."""
    name = "engram_hash"
    check_tensor(name, "ngram", ngram, dtypes=_INTS, ndim=2)
    N, M = ngram.shape
    if M < 2:
        raise ValueError(f"deepfuse: {name}: ngram must have >= 2 columns (max n-gram size), got {M}")
    check_tensor(name, "multipliers", multipliers, dtypes=(torch.int64,), shape=(None, M), device=ngram.device)
    L = multipliers.shape[0]
    check_tensor(name, "primes", primes, dtypes=(torch.int64,), ndim=2, device=ngram.device)
    if primes.shape[0] != L or primes.shape[1] == 0 or primes.shape[1] % (M - 1):
        raise ValueError(f"deepfuse: {name}: primes must have shape [{L}, (M - 1) * H] = [{L}, {M - 1} * H], "
                         f"got {list(primes.shape)}")
    check_tensor(name, "offsets", offsets, dtypes=(torch.int64,), shape=tuple(primes.shape), device=ngram.device)
    return torch.ops.deepfuse.engram_hash(ngram, multipliers, primes, offsets)


# ----------------------------------------------------------------------------- engram_lookup
def engram_lookup_ref(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    N, C = ids.shape
    D = table.shape[1]
    flat = ids.reshape(-1).to(table.device, torch.int64)
    vals = table.index_select(0, flat).float().unflatten(-1, (D // SCALE_BLOCK, SCALE_BLOCK))
    exps = scale.view(torch.uint8).index_select(0, flat).float()
    rows = (vals * torch.exp2(exps - 127.0).unsqueeze(-1)).flatten(-2)
    return rows.view(N, C, D).to(out_dtype).to(ids.device)


def _engram_lookup_fake(table, scale, ids, out_dtype):
    return ids.new_empty(ids.shape[0], ids.shape[1], table.shape[1], dtype=out_dtype)


def _engram_lookup_cuda(table, scale, ids, out_dtype):
    why = _off_reason("engram_lookup") or _table_gap(table, scale, ids.device)
    if why is not None:
        return why
    out = torch.empty(ids.shape[0], ids.shape[1], table.shape[1], dtype=out_dtype, device=ids.device)
    _ext.ext(ids.device).engram_lookup(table=table.view(torch.uint8), scale=scale, ids=_inner(ids), out=out)
    return out


_engram_lookup = _kernel_op("engram_lookup", engram_lookup_ref, _engram_lookup_fake, _engram_lookup_cuda)


def engram_lookup(table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantised table rows [N, C, D] (out_dtype, on ids' device) of the rows ids [N, C]."""
    name = "engram_lookup"
    _check_table(name, table, scale)
    check_tensor(name, "ids", ids, dtypes=_INTS, ndim=2)
    if out_dtype not in _FLOATS:
        raise TypeError(f"deepfuse: {name}: out_dtype must be one of {_FLOATS}, got {out_dtype}")
    return torch.ops.deepfuse.engram_lookup(table, scale.view(torch.uint8), ids, out_dtype)


def _check_table(name: str, table: torch.Tensor, scale: torch.Tensor) -> None:
    check_tensor(name, "table", table, dtypes=(torch.float8_e4m3fn,), ndim=2, contiguous=True)
    R, D = table.shape
    if D % SCALE_BLOCK or D == 0:
        raise ValueError(f"deepfuse: {name}: table rows must be a positive multiple of {SCALE_BLOCK} wide, got {D}")
    scale_dtypes = (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())
    check_tensor(name, "scale", scale, dtypes=scale_dtypes, shape=(R, D // SCALE_BLOCK), device=table.device,
                 contiguous=True)


def lookup_into(out: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """engram_lookup written into out [N, C, D] (a preallocated CUDA buffer; the kernel only:
    raises NoKernelError where it cannot serve) on the current stream; returns out."""
    name = "engram_lookup"
    _check_table(name, table, scale)
    check_tensor(name, "ids", ids, dtypes=_INTS, ndim=2)
    check_tensor(name, "out", out, dtypes=_FLOATS, shape=(ids.shape[0], ids.shape[1], table.shape[1]),
                 device=ids.device, contiguous=True)
    why = _off_reason("engram_lookup") or _table_gap(table, scale, ids.device)
    if why is not None:
        from deepfuse.ops._fallback import NoKernelError
        raise NoKernelError(f"deepfuse: {name}: {why}")
    _ext.ext(ids.device).engram_lookup(table=table.view(torch.uint8), scale=scale.view(torch.uint8),
                                       ids=_inner(ids), out=out)
    return out


# ----------------------------------------------------------------------------- engram_embed
def engram_embed_ref(ngram: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
                     table: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    ids = engram_hash_ref(ngram, multipliers.unsqueeze(0), primes.unsqueeze(0), offsets.unsqueeze(0))[:, 0]
    return engram_lookup_ref(table, scale, ids, out_dtype)


def _engram_embed_fake(ngram, multipliers, primes, offsets, table, scale, out_dtype):
    return ngram.new_empty(ngram.shape[0], primes.shape[0], table.shape[1], dtype=out_dtype)


def _engram_embed_cuda(ngram, multipliers, primes, offsets, table, scale, out_dtype):
    why = _off_reason("engram_embed") or _table_gap(table, scale, ngram.device)
    if why is not None:
        return why
    out = torch.empty(ngram.shape[0], primes.shape[0], table.shape[1], dtype=out_dtype, device=ngram.device)
    _ext.ext(ngram.device).engram_embed(ngram=_inner(ngram), multipliers=multipliers.contiguous(),
                                        primes=primes.contiguous(), offsets=offsets.contiguous(),
                                        table=table.view(torch.uint8), scale=scale, out=out)
    return out


_engram_embed = _kernel_op("engram_embed", engram_embed_ref, _engram_embed_fake, _engram_embed_cuda)


def engram_embed(ngram: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor,
                 table: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One Engram layer's dequantised rows [N, C, D] of the n-gram windows ngram [N, M]
    (multipliers [M], primes / offsets [C] of that layer): hash, gather and dequantise in one
    pass (module doc). The table may be in page-locked host memory (ids on the GPU)."""
    name = "engram_embed"
    check_tensor(name, "ngram", ngram, dtypes=_INTS, ndim=2)
    N, M = ngram.shape
    if M < 2:
        raise ValueError(f"deepfuse: {name}: ngram must have >= 2 columns (max n-gram size), got {M}")
    check_tensor(name, "multipliers", multipliers, dtypes=(torch.int64,), shape=(M,), device=ngram.device)
    check_tensor(name, "primes", primes, dtypes=(torch.int64,), ndim=1, device=ngram.device)
    C = primes.shape[0]
    if C == 0 or C % (M - 1):
        raise ValueError(f"deepfuse: {name}: primes must have shape [(M - 1) * H] = [{M - 1} * H], got [{C}]")
    check_tensor(name, "offsets", offsets, dtypes=(torch.int64,), shape=(C,), device=ngram.device)
    _check_table(name, table, scale)
    if out_dtype not in _FLOATS:
        raise TypeError(f"deepfuse: {name}: out_dtype must be one of {_FLOATS}, got {out_dtype}")
    return torch.ops.deepfuse.engram_embed(ngram, multipliers, primes, offsets, table, scale.view(torch.uint8),
                                           out_dtype)


# ----------------------------------------------------------------------------- engram_gate
def engram_gate_ref(hidden: torch.Tensor, kv: torch.Tensor, w_hidden: torch.Tensor, w_embed: torch.Tensor,
                    clamp: float, eps: float) -> torch.Tensor:
    n, d = hidden.shape[-2:]
    x = hidden.float()
    k = kv[:, :n].float()
    v = kv[:, n].float()
    rx = torch.rsqrt(x.square().mean(-1) + eps)
    rk = torch.rsqrt(k.square().mean(-1) + eps)
    dot = torch.einsum("...d,...d->...", x * w_hidden.float().unsqueeze(0), k * w_embed.float().unsqueeze(0))
    dot = dot * rx * rk * d ** -0.5
    gate = torch.sigmoid(dot.abs().clamp_min(clamp).sqrt() * dot.sign())
    return (x + gate.unsqueeze(-1) * v.unsqueeze(-2)).to(hidden.dtype)


def _engram_gate_fake(hidden, kv, w_hidden, w_embed, clamp, eps):
    return torch.empty_like(hidden)


def _engram_gate_cuda(hidden, kv, w_hidden, w_embed, clamp, eps):
    why = _off_reason("engram_gate")
    if why is None and hidden.dtype not in (torch.bfloat16, torch.float32):
        why = f"hidden has dtype {str(hidden.dtype)[6:]} (the gate kernel takes bfloat16 or float32)"
    if why is None and kv.dtype != hidden.dtype:
        why = f"kv has dtype {str(kv.dtype)[6:]}, hidden {str(hidden.dtype)[6:]} (the gate kernel takes one dtype)"
    if why is None and hidden.shape[-1] % 8:
        why = f"hidden rows are {hidden.shape[-1]} wide (the gate kernel takes d % 8 == 0)"
    if why is not None:
        return why
    h = _dense(hidden)
    out = torch.empty_like(h)
    _ext.ext(h.device).engram_gate(hidden=h, kv=_dense(kv), w_hidden=_dense(w_hidden.float()),
                                   w_embed=_dense(w_embed.float()), out=out, clamp=clamp, eps=eps)
    return out


_engram_gate = _kernel_op("engram_gate", engram_gate_ref, _engram_gate_fake, _engram_gate_cuda)


def engram_gate(hidden: torch.Tensor, kv: torch.Tensor, w_hidden: torch.Tensor, w_embed: torch.Tensor,
                clamp: float = 1e-6, eps: float = 1e-6) -> torch.Tensor:
    """Streams hidden [N, n, d] plus the gated shared value of kv [N, n + 1, d] (module doc)."""
    name = "engram_gate"
    check_tensor(name, "hidden", hidden, dtypes=_FLOATS, ndim=3)
    N, n, d = hidden.shape
    check_tensor(name, "kv", kv, dtypes=_FLOATS, shape=(N, n + 1, d), device=hidden.device)
    check_tensor(name, "w_hidden", w_hidden, dtypes=_FLOATS, shape=(n, d), device=hidden.device)
    check_tensor(name, "w_embed", w_embed, dtypes=_FLOATS, shape=(n, d), device=hidden.device)
    for arg, v in (("clamp", clamp), ("eps", eps)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
            raise ValueError(f"deepfuse: {name}: {arg} must be a float >= 0, got {v!r}")
    return torch.ops.deepfuse.engram_gate(hidden, kv, w_hidden, w_embed, float(clamp), float(eps))


def to_host(t: torch.Tensor, pin: Optional[bool] = None) -> torch.Tensor:
    """A host copy of a table tensor, page-locked when CUDA is present (pin=None) so a GPU can
    read it over UVA; pin=False keeps it pageable."""
    h = t.detach().to("cpu")
    if pin is None:
        pin = torch.cuda.is_available()
    return h.pin_memory() if pin else h

