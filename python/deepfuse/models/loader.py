"""Load a V4 checkpoint: config.json plus safetensors shards in the official key naming.

Accepted key spellings (canonicalised before matching):
- with or without a leading "model." (transformers' save_pretrained keeps it on a few keys);
- transformers' save_pretrained spellings: embed_tokens / lm_head / hc_head.hc_{fn,base,scale}
  and <layer>.attn.norm.weight for the official <layer>.attn.kv_norm.weight;
- block-scale tensors named <linear>.scale (official) or <linear>.weight_scale_inv.
Weight formats, told apart by dtype: bf16/fp16/fp32 (cast to `dtype`), FP8 e4m3 with a
[ceil(N/128), ceil(K/128)] scale (fp32 or UE8M0 float8_e8m0fnu/uint8) and, for the routed
experts, MXFP4: float4_e2m1fn_x2 (or int8/uint8) [N, K/2] packed e2m1 (low nibble = even
column) with a [N, K/32] UE8M0 scale. Norms, mHC parameters, sinks, ape and router
weights/biases are kept in fp32. Shards are memory-mapped and read one tensor at a time.
"""
from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from .config import V4Config
from .linear import Linear, slots
from .model import V4Model
from .moe import Experts
from .v41 import V41Model, token_map_for
from .v41_config import V41Config, is_v41

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_PACKED = tuple(t for t in (getattr(torch, "float4_e2m1fn_x2", None), torch.int8, torch.uint8) if t is not None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_ALIASES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_V41_SKIP = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
_KV_NORM = re.compile(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$")


class CheckpointError(ValueError):
    pass


def canonical_key(key: str) -> str:
    if key.startswith("model."):
        key = key[len("model."):]
    key = _ALIASES.get(key, key)
    key = _KV_NORM.sub(r"\1.kv_norm.weight", key)
    if key.endswith(".weight_scale_inv"):
        key = key[: -len(".weight_scale_inv")] + ".scale"
    return key


def shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"deepfuse: {index} names shards that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"deepfuse: no *.safetensors files in {path}")
    return files


class _Reader:
    """Memory-mapped access to every tensor of the shards, by canonical key."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self.handles, self.where = [], {}
        for f in files:
            h = safe_open(str(f), framework="pt", device="cpu")
            self.handles.append(h)
            for k in h.keys():
                ck = canonical_key(k)
                if ck in self.where:
                    other = self.where[ck]
                    raise CheckpointError(f"deepfuse: tensor {ck!r} appears twice: as {other[1]!r} in "
                                          f"{other[2].name} and as {k!r} in {f.name}")
                self.where[ck] = (h, k, f)
        self.used: set[str] = set()

    def __contains__(self, key):
        return key in self.where

    def get(self, key: str, part: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
        """The tensor, or with part = (dim, start, stop) only that slice of it (read from the
        file alone; packed FP4 tensors are read whole and sliced, safetensors cannot slice them)."""
        h, k, _ = self.where[key]
        self.used.add(key)
        if part is None:
            return h.get_tensor(k)
        dim, a, b = part
        sl = h.get_slice(k)
        if sl.get_dtype() in ("F4", "F6_E2M3", "F6_E3M2"):
            return h.get_tensor(k).narrow(dim, a, b - a).contiguous()
        idx = [slice(None)] * len(sl.get_shape())
        idx[dim] = slice(a, b)
        return sl[tuple(idx)]

    def shape(self, key: str) -> list[int]:
        """The tensor's shape as torch sees it (packed FP4: [N, K / 2])."""
        h, k, _ = self.where[key]
        sl = h.get_slice(k)
        shape = list(sl.get_shape())
        if sl.get_dtype() == "F4":
            shape[-1] //= 2
        return shape

    def dtype_code(self, key: str) -> str:
        h, k, _ = self.where[key]
        return h.get_slice(k).get_dtype()

    def skip(self, key: str) -> None:
        """Another rank's tensor: not read here, not reported unused."""
        if key in self.where:
            self.used.add(key)

    def origin(self, key: str) -> str:
        _, k, f = self.where[key]
        return f"{k!r} in {f.name}"

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in {w[2] for w in self.where.values()})


def _scale(t: torch.Tensor) -> torch.Tensor:
    if _E8M0 is not None and t.dtype == _E8M0:
        return t.view(torch.uint8)
    if t.dtype == torch.uint8:
        return t
    return t.float()


class _Loader:
    def __init__(self, reader: _Reader, device, dtype, dequantize: bool, bar, block: int = 128,
                 engram_placement: str = "device"):
        self.r, self.device, self.dtype, self.dequantize, self.bar = reader, device, dtype, dequantize, bar
        self.missing: list[str] = []
        self.block = block  # FP8 weight block edge (V4: 128; V4.1: 32, dequantised at load)
        self.engram_placement = engram_placement

    def tick(self, n=1):
        if self.bar is not None:
            self.bar.update(n)

    def fetch(self, key: str) -> Optional[torch.Tensor]:
        if key not in self.r:
            self.missing.append(key)
            return None
        t = self.r.get(key)
        self.tick()
        return t

    def shape_error(self, key, want, got, what="shape"):
        return CheckpointError(f"deepfuse: tensor {key!r} ({self.r.origin(key)}) has {what} {got}; expected {want}")

    def slot(self, key: str, shape, kind: str, shard=None) -> Optional[torch.Tensor]:
        if shard is not None:
            return self._sharded_slot(key, shape, kind, shard)
        t = self.fetch(key)
        if t is None:
            return None
        if tuple(t.shape) != tuple(shape):
            raise self.shape_error(key, list(shape), list(t.shape))
        if kind == "index":
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise self.shape_error(key, "an integer dtype", t.dtype, "dtype")
            return t.to(self.device).long()
        if t.dtype not in _FLOATS:
            raise self.shape_error(key, "bf16/fp16/fp32", t.dtype, "dtype")
        return t.to(self.device).to(torch.float32 if kind == "fp32" else self.dtype)

    def _sharded_slot(self, key: str, shape, kind: str, shard) -> Optional[torch.Tensor]:
        dim, a, b, size = shard
        if key not in self.r:
            self.missing.append(key)
            return None
        full = self.r.shape(key)
        if len(full) != len(shape) or any(f != s for i, (f, s) in enumerate(zip(full, shape)) if i != dim) \
                or full[dim] < b:
            raise self.shape_error(key, f"{list(shape)} with {b}+ along dim {dim} (sharded)", full)
        t = _pad(self.r.get(key, (dim, a, b)), dim, size)
        self.tick()
        if kind == "index" or t.dtype not in _FLOATS:
            raise self.shape_error(key, "bf16/fp16/fp32 (a sharded slot)", t.dtype, "dtype")
        return t.to(self.device).to(torch.float32 if kind == "fp32" else self.dtype)

    def weight(self, prefix: str, N: int, K: int, dense_dtype=None, shard=None):
        """-> (weight, scale, fmt) of the linear `prefix` with logical shape [N, K] (with
        shard = (dim, start, stop, size): that slice of the checkpoint's tensor, see
        models/parallel.py)."""
        if shard is not None:
            return self._sharded_weight(prefix, N, K, dense_dtype, shard)
        wk, sk = prefix + ".weight", prefix + ".scale"
        w = self.fetch(wk)
        if w is None:
            return None
        dense_dtype = dense_dtype or self.dtype
        if w.dtype in _FLOATS:
            if tuple(w.shape) != (N, K):
                raise self.shape_error(wk, [N, K], list(w.shape))
            return w.to(self.device).to(dense_dtype), None, "dense"
        if w.dtype == torch.float8_e4m3fn:
            fmt, want, grid = "fp8", (N, K), (-(-N // 128), -(-K // 128))
        elif w.dtype in _PACKED:
            fmt, want, grid = "mxfp4", (N, K // 2), (N, K // 32)
            if K % 32:
                raise self.shape_error(wk, f"a dense dtype (K = {K} is not a multiple of 32)", w.dtype, "dtype")
        else:
            raise self.shape_error(wk, "bf16/fp16/fp32, float8_e4m3fn or packed e2m1", w.dtype, "dtype")
        if tuple(w.shape) != want:
            raise self.shape_error(wk, f"{list(want)} ({fmt})", list(w.shape))
        if sk not in self.r:
            raise CheckpointError(f"deepfuse: {fmt} weight {wk!r} ({self.r.origin(wk)}) has no scale tensor {sk!r}")
        s = self.r.get(sk)
        small = (-(-N // self.block), -(-K // self.block))
        if fmt == "fp8" and self.block != 128 and tuple(s.shape) == small:
            # FP8 with block x block scales (V4.1: 32): no kernel reads them; dense at load
            s = _scale(s)
            s = torch.exp2(s.float() - 127.0) if s.dtype == torch.uint8 else s
            s = s.repeat_interleave(self.block, 0)[:N].repeat_interleave(self.block, 1)[:, :K]
            return (w.float() * s).to(self.device).to(dense_dtype or self.dtype), None, "dense"
        if tuple(s.shape) != grid:
            raise self.shape_error(sk, f"{list(grid)} (scales of the {fmt} weight {wk})", list(s.shape))
        return self._placed(w, s, fmt, dense_dtype)

    def _placed(self, w: torch.Tensor, s: torch.Tensor, fmt: str, dense_dtype):
        """A quantised weight and its scales (as read) on the device -> (weight, scale, fmt),
        or (dense weight, None, "dense") when the loader dequantises."""
        w = w.to(self.device)
        w = w.view(torch.uint8) if fmt == "mxfp4" else w
        s = _scale(s.to(self.device))
        if self.dequantize:
            from deepfuse.ops.linear import dequant_weight

            return dequant_weight(w, s, fmt, dense_dtype), None, "dense"
        return w, s, fmt

    def _sharded_weight(self, prefix: str, N: int, K: int, dense_dtype, shard):
        """Rows (dim 0) or columns (dim 1) [a, b) of the checkpoint weight, zero-padded to
        `size`. Quantised weights stay quantised when the slice keeps whole scale blocks
        (fp8: 128 x 128, mxfp4: 32 columns) or lies inside one fp8 block; otherwise the
        touched blocks are dequantised and the slice is kept dense."""
        from deepfuse.ops.linear import FP8_BLOCK, MXFP4_GROUP, dequant_weight

        dim, a, b, size = shard
        wk, sk = prefix + ".weight", prefix + ".scale"
        if wk not in self.r:
            self.missing.append(wk)
            return None
        dense_dtype = dense_dtype or self.dtype
        code = self.r.dtype_code(wk)
        full = self.r.shape(wk)
        if code in ("F4", "I8", "U8"):
            fmt, u, p = "mxfp4", (1 if dim == 0 else MXFP4_GROUP), (1 if dim == 0 else 2)
            n_g = full[dim] * p
            other = (N, K // 2)[1 - dim] if dim == 0 else N
        else:
            fmt, u, p = ("fp8" if code == "F8_E4M3" else "dense"), FP8_BLOCK, 1
            n_g = full[dim]
            other = (N, K)[1 - dim]
        if len(full) != 2 or full[1 - dim] != other or n_g < b:
            raise self.shape_error(wk, f"[{N if dim else '..'}, {K if not dim else '..'}] with {b}+ along "
                                       f"dim {dim} (sharded)", full)
        if fmt == "dense":
            if code not in ("BF16", "F16", "F32"):
                raise self.shape_error(wk, "bf16/fp16/fp32, float8_e4m3fn or packed e2m1", code, "dtype")
            w = _pad(self.r.get(wk, (dim, a, b)), dim, size)
            self.tick()
            return w.to(self.device).to(dense_dtype), None, "dense"
        if sk not in self.r:
            raise CheckpointError(f"deepfuse: {fmt} weight {wk!r} ({self.r.origin(wk)}) has no scale tensor {sk!r}")
        u0, u1 = a // u, -(-b // u)
        whole = a % u == 0 and (b % u == 0 or b == n_g)
        if size == b - a and (whole or (fmt == "fp8" and u1 - u0 == 1)):
            w = self.r.get(wk, (dim, a // p, b // p))
            s = self.r.get(sk, (dim, u0, u1))
            self.tick()
            return self._placed(w, s, fmt, dense_dtype)
        # the slice cuts a scale block (or is padded): dequantise the blocks it touches
        lo, hi = u0 * u, min(u1 * u, n_g)
        w = self.r.get(wk, (dim, lo // p, hi // p))
        s = _scale(self.r.get(sk, (dim, u0, u1)))
        self.tick()
        w = w.view(torch.uint8) if fmt == "mxfp4" else w
        d = dequant_weight(w, s, fmt, torch.float32).narrow(dim, a - lo, b - a)
        return _pad(d, dim, size).to(self.device).to(dense_dtype), None, "dense"

    def experts(self, prefix: str, mod: Experts):
        ws, ss, fmts = {}, {}, set()
        off = getattr(mod, "expert_offset", 0)
        shards = getattr(mod, "shards", {})
        for e in range(getattr(mod, "total_experts", mod.num_experts)):
            if not off <= e < off + mod.num_experts:  # another rank's expert
                for name in ("w1", "w3", "w2"):
                    self.r.skip(f"{prefix}.{e}.{name}.weight")
                    self.r.skip(f"{prefix}.{e}.{name}.scale")
        for name in ("w1", "w3", "w2"):
            N, K = mod.proj_shape(name)
            parts, scales = [], []
            for e in range(off, off + mod.num_experts):
                got = self.weight(f"{prefix}.{e}.{name}", N, K, shard=shards.get(name))
                if got is None:
                    continue
                w, s, fmt = got
                parts.append(w)
                scales.append(s)
                fmts.add(fmt)
            if len(parts) != mod.num_experts:
                continue
            ws[name] = torch.stack(parts)
            if parts and scales[0] is not None:
                ss[name] = torch.stack(scales)
        if shards and len(fmts) > 1 and "dense" in fmts:
            # a sharded projection had to be dequantised (its slice cuts scale blocks): all dense
            from deepfuse.ops.linear import dequant_weight

            for name, w in ws.items():
                s = ss.pop(name, None)
                if s is not None:
                    fmt = (fmts - {"dense"}).pop()
                    ws[name] = torch.stack([dequant_weight(w[e], s[e], fmt, self.dtype) for e in range(w.shape[0])])
            fmts = {"dense"}
        if len(fmts) > 1:
            raise CheckpointError(f"deepfuse: the routed experts of {prefix} mix weight formats {sorted(fmts)}")
        if len(ws) == 3:
            mod.set_weights(ws, ss, fmts.pop())


def count_tensors(model: nn.Module) -> int:
    n = 0
    for _, m in model.named_modules():
        n += len(slots(m))
        if isinstance(m, Linear):
            n += 1
        elif isinstance(m, Experts):
            n += 3 * m.num_experts
    return n


def load(path, *, device="cpu", dtype: torch.dtype = torch.bfloat16, dequantize: bool = False,
         progress: Optional[bool] = None, config: Optional[V4Config] = None, parallel=None, tokenizer=None,
         engram_placement: Optional[str] = None):
    """Build the V4 (or V4.1: models/v41.py) graph from a checkpoint directory (config.json +
    *.safetensors).

    device / dtype: where the weights live and the activation dtype (bf16 or fp32; norms,
    mHC, sinks and router stay fp32). FP8 / MXFP4 weights stay quantised unless
    dequantize=True. progress: tqdm bar (default: on for checkpoints over 1 GB).
    parallel: a models.parallel.ParallelConfig: build and read only rank parallel.rank's
    part of the model (its heads, experts and vocab rows; see models/parallel.py).
    V4.1: tokenizer (a tokenizer.json path or folder; default the checkpoint's own, else the
    bundled V4 tokenizer) gives the Engram token map; engram_placement (default
    config.engram_placement, "device") places the Engram tables: "device" or "host" (host
    memory, page-locked when CUDA is present)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"deepfuse: checkpoint directory {path} does not exist")
    if dtype not in _FLOATS:
        raise ValueError(f"deepfuse: dtype must be one of {_FLOATS}, got {dtype}")
    if config is None and (path / "config.json").is_file():
        with open(path / "config.json") as f:
            if is_v41(json.load(f)):
                config = V41Config.from_json(path)
    cfg = config if config is not None else V4Config.from_json(path)
    v41 = isinstance(cfg, V41Config)
    if engram_placement is not None:
        if not v41:
            raise ValueError("deepfuse: engram_placement applies to V4.1 checkpoints only")
        cfg = dataclasses.replace(cfg, engram_placement=engram_placement).validate()
    if v41 and parallel is not None and parallel.world_size > 1:
        raise ValueError("deepfuse: tensor / expert parallel loading of V4.1 checkpoints is not built")
    device = torch.device(device)
    reader = _Reader(shard_files(path))
    if cfg.num_nextn_predict_layers and not any(k.startswith("mtp.") for k in reader.where):
        # transformers' save_pretrained drops the MTP layers: build the graph without them
        warnings.warn(f"deepfuse: {path} has no mtp.* tensors; loading without the MTP layer(s)", stacklevel=2)
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0, mtp_layer_types=[])
    model = V41Model(cfg) if v41 else V4Model(cfg)
    model.dtype = dtype
    if parallel is not None and parallel.world_size > 1:
        from .parallel import shard_modules

        shard_modules(model, parallel)
    if progress is None:
        progress = reader.nbytes() > (1 << 30)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=count_tensors(model), desc=f"loading {path.name}", unit="tensor")
    if v41:
        for k in reader.where:  # vision tower, aligner, image embeddings, VL routing bias: text-only here
            if k.startswith(_V41_SKIP) or k.endswith(".gate.bias_vl"):
                reader.skip(k)
        ld = _Loader(reader, device, dtype, dequantize, bar, cfg.weight_block_size, cfg.engram_placement)
    else:
        ld = _Loader(reader, device, dtype, dequantize, bar)
    try:
        for prefix, mod in model.named_modules():
            dot = prefix + "." if prefix else ""
            shards = getattr(mod, "_slot_shards", {})
            for name, kind in slots(mod).items():
                t = ld.slot(dot + name, tuple(getattr(mod, name).shape), kind, shards.get(name))
                if t is not None:
                    setattr(mod, name, t)
            if isinstance(mod, Linear):
                got = ld.weight(prefix, mod.out_features, mod.in_features, shard=getattr(mod, "shard", None))
                if got is not None:
                    mod.set_weight(*got)
            elif isinstance(mod, Experts):
                ld.experts(prefix, mod)
            elif hasattr(mod, "load_checkpoint"):
                mod.load_checkpoint(ld, prefix)
    finally:
        if bar is not None:
            bar.close()
    if ld.missing:
        shown = ", ".join(ld.missing[:20]) + (" ..." if len(ld.missing) > 20 else "")
        raise CheckpointError(f"deepfuse: checkpoint {path} lacks {len(ld.missing)} tensors the config needs: {shown}")
    for name, t in list(model.named_buffers()):
        if t.is_meta:
            raise CheckpointError(f"deepfuse: tensor {name!r} was not loaded")
    unused = sorted(set(reader.where) - reader.used)
    if unused:
        warnings.warn(f"deepfuse: {len(unused)} checkpoint tensors are not used by the graph: "
                      f"{', '.join(unused[:10])}{' ...' if len(unused) > 10 else ''}", stacklevel=2)
    _check_tid2eid(model)
    if v41 and model.engram_hasher is not None:
        model.set_token_map(*token_map_for(tokenizer if tokenizer is not None else path))
    return model.eval()


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _check_tid2eid(model: V4Model) -> None:
    E = model.cfg.n_routed_experts
    for i, layer in enumerate(model.layers):
        g = layer.ffn.gate
        if g.is_hash:
            t = g.tid2eid
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= E):
                raise CheckpointError(f"deepfuse: layers.{i}.ffn.gate.tid2eid holds expert ids outside [0, {E})")
