"""V4 KV cache formats: the one place that defines them (engine, ops and attention kernels).

Three kinds of storage, each with an FP8 serving format and a bf16 variant (no quantisation,
for reference and debugging), and each allocated with a leading layer dimension so that one
kernel launch can serve all layers:

1. Paged KV pages (compressed rows, and window rows saved for prefix caching).
2. Sliding-window rings: per request slot, W = 128 + spec_tokens - 1 rows in the same row
   format, row of position p at (request slot, p % W).
3. Indexer key pages: 128-dim keys of the lightning indexer.

KV row (one token, K = V, 512 dims = 448 no-RoPE + 64 RoPE, RoPE already applied)
---------------------------------------------------------------------------------
FP8 ("fp8"), 584 bytes per row, split in two per page (a page is `page_size` rows):

  page base + r * 576 + [0, 448)    e4m3 no-RoPE values 0..447 of row r
  page base + r * 576 + [448, 576)  bf16 RoPE values 448..511 (64 x 2 bytes, little endian)
  page base + page_size * 576 + r * 8 + [0, 7)  UE8M0 scale of values 64g..64g+63, g = 0..6
  page base + page_size * 576 + r * 8 + 7       pad byte, written as 0

  page_bytes = page_size * 584. Quantisation (ops.kvcache, same rules as ops.cast "ue8m0"):
  per group of 64 no-RoPE values, amax over the finite values, e = the smallest exponent with
  amax / 2^e <= 448 (clamped to [-127, 127], all-zero groups -127), stored byte e + 127;
  code = e4m3_rn(clamp(x * 2^-e, +-448)) (inf saturates, NaN stays NaN). Dequantised value =
  e4m3 * 2^(byte - 127), rounded to bf16 (exact except below bf16's subnormal range).

bf16 ("bf16"): [page_size, 512] bf16 rows, 1024 bytes per row, no scales.

Alignment guarantees (the attention kernel may rely on them):
- page_size is a multiple of 16 (rings: the W rows are padded to Wp = round_up(W, 16) rows;
  rows W..Wp-1 are never addressed). So page_bytes is a multiple of 16 * 584 = 9344 = 73 * 128
  and every page, its data block and its scale block start 128-byte aligned (the storage
  is allocated by torch, >= 256-byte aligned; layer stride = num_pages * page_bytes).
- Row data (576 bytes = 36 x 16) and the RoPE part (offset 448 = 28 x 16) are 16-byte aligned:
  a page's data block is a [page_size, 576] byte matrix with row pitch 576 (TMA: box of
  rows x 576 bytes, or 448 + 128); the scale block is a [page_size, 8] byte matrix (one
  8-byte load per row, 16-byte loads for row pairs).

Indexer key row (128 dims)
--------------------------
FP8: page base + r * 128: 128 e4m3; page base + page_size * 128 + r * 4: fp32 scale.
  132 bytes per row; page_bytes = page_size * 132 (multiple of 16 * 132 = 2112 = 33 * 64).
  Scale per row (group 128), the cast's rules: "fp32": s = max(amax / 448, 2^-126),
  code = e4m3_rn(clamp(x * (1 / s), +-448)); "ue8m0": s = 2^e as above, stored as the fp32
  value 2^e. Dequantised value = e4m3 * s.
bf16: [page_size, 128] bf16 rows (256 bytes).

Addressing
----------
Pages: slot = page * page_size + row (vLLM-style slot mapping; -1 = no slot). A request's
positions map to pages through a block table [B, max_pages]: page of position p =
block_table[b, p // page_size], row = p % page_size.
Rings: row of position p of request slot s = (page s, row p % W). The ring of a request
that has consumed n positions holds positions max(0, n - W) .. n - 1.

Tensors: FP8 formats are uint8 [L, num_pages, page_bytes]; bf16 formats are bfloat16
[L, num_pages, page_size, dim]. Rings are the same with num_pages = request slots and
page_size = Wp.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

KV_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
KV_GROUP = 64  # no-RoPE values per UE8M0 scale
KV_SCALES = NOPE_DIM // KV_GROUP  # 7
KV_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: e4m3 no-RoPE + bf16 RoPE
KV_SCALE_BYTES = 8  # 7 UE8M0 + 1 pad
KV_ROW_BYTES = KV_DATA_BYTES + KV_SCALE_BYTES  # 584

IDX_DIM = 128
IDX_ROW_BYTES = IDX_DIM + 4  # 132

PAGE_ALIGN_ROWS = 16
WINDOW = 128  # V4 sliding window

_FMTS = ("fp8", "bf16")


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def ring_rows(spec_tokens: int = 1) -> int:
    """W = 128 + spec_tokens - 1 (spec_tokens = tokens verified per step, 1 without MTP)."""
    if spec_tokens < 1:
        raise ValueError(f"deepfuse: spec_tokens must be >= 1, got {spec_tokens}")
    return WINDOW + spec_tokens - 1


@dataclass(frozen=True)
class _PagedRows:
    """Shared shape of the paged row formats: `page_size` rows per page; "fp8" pages are raw
    bytes ([page_size, data bytes] then the page's scale block), "bf16" pages are
    [page_size, dim] bf16."""

    page_size: int
    dtype: str = "fp8"

    DIM: ClassVar[int]
    FP8_ROW_BYTES: ClassVar[int]
    FP8_DATA_BYTES: ClassVar[int]

    def __post_init__(self):
        name = type(self).__name__
        if self.dtype not in _FMTS:
            raise ValueError(f"deepfuse: {name}.dtype must be one of {_FMTS}, got {self.dtype!r}")
        if self.page_size < PAGE_ALIGN_ROWS or self.page_size % PAGE_ALIGN_ROWS:
            raise ValueError(f"deepfuse: {name}.page_size must be a positive multiple of 16, got {self.page_size}")

    @property
    def row_bytes(self) -> int:
        return self.FP8_ROW_BYTES if self.dtype == "fp8" else 2 * self.DIM

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.row_bytes

    @property
    def scale_offset(self) -> int:
        """Byte offset of the page's scale block (fp8)."""
        return self.page_size * self.FP8_DATA_BYTES

    def page_shape(self) -> tuple[int, ...]:
        return (self.page_bytes,) if self.dtype == "fp8" else (self.page_size, self.DIM)

    def torch_dtype(self) -> torch.dtype:
        return torch.uint8 if self.dtype == "fp8" else torch.bfloat16


@dataclass(frozen=True)
class KVFormat(_PagedRows):
    """Row format of KV pages and rings ("fp8": 584-byte rows; "bf16": 512 bf16)."""

    DIM: ClassVar[int] = KV_DIM
    FP8_ROW_BYTES: ClassVar[int] = KV_ROW_BYTES
    FP8_DATA_BYTES: ClassVar[int] = KV_DATA_BYTES


@dataclass(frozen=True)
class IndexerKeyFormat(_PagedRows):
    """Row format of indexer key pages ("fp8": 128 e4m3 + fp32 scale; "bf16": 128 bf16)."""

    scale_fmt: str = "fp32"  # fp8 only: "fp32" (amax / 448) or "ue8m0" (power of two, stored as fp32)

    DIM: ClassVar[int] = IDX_DIM
    FP8_ROW_BYTES: ClassVar[int] = IDX_ROW_BYTES
    FP8_DATA_BYTES: ClassVar[int] = IDX_DIM

    def __post_init__(self):
        super().__post_init__()
        if self.scale_fmt not in ("fp32", "ue8m0"):
            raise ValueError(f"deepfuse: IndexerKeyFormat.scale_fmt must be fp32 or ue8m0, got {self.scale_fmt!r}")


class _LayerPages:
    """data [L, num_pages, ...]: the shape queries shared by the paged stores below."""

    data: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    @property
    def num_pages(self) -> int:
        return self.data.shape[1]


@dataclass
class KVPages(_LayerPages):
    """Paged KV cache of all layers: data [L, num_pages, *fmt.page_shape()]."""

    fmt: KVFormat
    data: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.fmt.page_size

    def layer(self, i: int) -> "KVPages":
        return KVPages(self.fmt, self.data[i:i + 1])

    # views (fp8): [L, P, page_size, ...]
    def nope(self) -> torch.Tensor:
        return _data_view(self.data, self.fmt.page_size, KV_DATA_BYTES)[..., :NOPE_DIM].view(torch.float8_e4m3fn)

    def rope(self) -> torch.Tensor:
        return _data_view(self.data, self.fmt.page_size, KV_DATA_BYTES)[..., NOPE_DIM:].view(torch.bfloat16)

    def scales(self) -> torch.Tensor:
        """uint8 [L, P, page_size, 8]: 7 UE8M0 bytes + pad."""
        return _scale_view(self.data, self.fmt.page_size, KV_DATA_BYTES, KV_SCALE_BYTES)


@dataclass
class SwaRing:
    """Sliding-window rings of all layers: a KVPages with one page per request slot."""

    window: int  # W rows addressed (position % W); pages hold round_up(W, 16)
    pages: KVPages

    @property
    def data(self) -> torch.Tensor:
        return self.pages.data

    @property
    def fmt(self) -> KVFormat:
        return self.pages.fmt

    @property
    def num_layers(self) -> int:
        return self.pages.num_layers

    @property
    def num_slots(self) -> int:
        return self.pages.num_pages


@dataclass
class IndexerKeyPages(_LayerPages):
    """Paged indexer keys of all layers: data [L, num_pages, *fmt.page_shape()]."""

    fmt: IndexerKeyFormat
    data: torch.Tensor

    def keys(self) -> torch.Tensor:
        """e4m3 [L, P, page_size, 128] (fp8)."""
        return _data_view(self.data, self.fmt.page_size, IDX_DIM).view(torch.float8_e4m3fn)

    def scales(self) -> torch.Tensor:
        """fp32 [L, P, page_size] (fp8)."""
        return _scale_view(self.data, self.fmt.page_size, IDX_DIM, 4).view(torch.float32)[..., 0]


def _data_view(data: torch.Tensor, ps: int, row: int) -> torch.Tensor:
    L, P, _ = data.shape
    return data[:, :, :ps * row].view(L, P, ps, row)


def _scale_view(data: torch.Tensor, ps: int, row: int, sb: int) -> torch.Tensor:
    L, P, _ = data.shape
    return data[:, :, ps * row:ps * row + ps * sb].view(L, P, ps, sb)


def _alloc(shape, dtype, device, poison: bool):
    t = torch.empty(shape, dtype=dtype, device=device)
    if poison:  # 0xFF bytes: e4m3 NaN codes, bf16 NaN, scale byte 255
        t.view(torch.uint8).fill_(0xFF)
    return t


def alloc_kv_pages(num_layers: int, num_pages: int, page_size: int = 64, dtype: str = "fp8",
                   device="cuda", *, poison: bool = False) -> KVPages:
    fmt = KVFormat(page_size, dtype)
    return KVPages(fmt, _alloc((num_layers, num_pages, *fmt.page_shape()), fmt.torch_dtype(), device, poison))


def alloc_swa_rings(num_layers: int, num_slots: int, window: int = WINDOW, dtype: str = "fp8",
                    device="cuda", *, poison: bool = False) -> SwaRing:
    if window < 1:
        raise ValueError(f"deepfuse: window must be >= 1, got {window}")
    pages = alloc_kv_pages(num_layers, num_slots, round_up(window, PAGE_ALIGN_ROWS), dtype, device, poison=poison)
    return SwaRing(window, pages)


def alloc_indexer_pages(num_layers: int, num_pages: int, page_size: int = 64, dtype: str = "fp8",
                        device="cuda", *, scale_fmt: str = "fp32", poison: bool = False) -> IndexerKeyPages:
    fmt = IndexerKeyFormat(page_size, dtype, scale_fmt)
    return IndexerKeyPages(fmt, _alloc((num_layers, num_pages, *fmt.page_shape()), fmt.torch_dtype(), device, poison))


def kv_pages_from(data: torch.Tensor) -> KVPages:
    """Wrap an existing tensor (uint8 [L, P, ps * 584] or bf16 [L, P, ps, 512])."""
    if data.dtype == torch.uint8 and data.dim() == 3 and data.shape[2] % KV_ROW_BYTES == 0:
        return KVPages(KVFormat(data.shape[2] // KV_ROW_BYTES, "fp8"), data)
    if data.dtype == torch.bfloat16 and data.dim() == 4 and data.shape[3] == KV_DIM:
        return KVPages(KVFormat(data.shape[2], "bf16"), data)
    raise ValueError(f"deepfuse: not a KV page tensor: {data.dtype} {list(data.shape)}")
