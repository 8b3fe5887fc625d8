// Sparse attention over paged FP8 / bf16 KV, sm90: device code (bf16 tensor-core MMAs,
// mma.sync m16n8k16 with fp32 accumulation).
//
// A CTA (256 threads, 8 warps) owns a tile of 64 query heads of one query row t. A cluster
// of C = G * H / 64 CTAs owns the G consecutive query rows of a group (all their heads): key
// rows are fetched and dequantised once per cluster, each CTA doing 32 / C of every 32-key
// block and storing the bf16 rows into every cluster CTA's shared memory (DSMEM).
//
// Keys of row t: the virtual list p = 0 .. K0 + K1 - 1 (source 0 then source 1); position p
// is valid for row t when p < len[t] in its source and 0 <= slot < num_slots (anything else
// is skipped, never read). The G rows share a key at position p when their slots there are
// equal. Per block of 32 positions the cluster runs "passes" r = 0 .. G-1: pass r loads the
// slots of row r at the positions where no earlier row r' < r has the same valid slot, and
// row b takes key (r, p) iff its slot at p equals row r's and no earlier row has it. Every
// (row, position) key counts exactly once (duplicates at different positions count twice);
// when the rows' lists agree position by position only pass 0 runs.
//
// Per unit (block, pass): cp.async of the raw rows into a staging buffer (issued one unit
// ahead), dequantisation into a swizzled bf16 tile (double buffered), a cluster barrier, then
// per warp (rows 16*(w%4) .. +15, D-half w/4): S = Q K^T over its 256 dims, exchanged with
// the other half's warp through shared memory, online softmax (log2 domain), O += P V on
// its 256 output columns. The sink enters only at the end. Splits (gridDim.y) each take a
// contiguous range of blocks and write unnormalised partials; a combine kernel merges them.
#pragma once
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "attention/attn_device.cuh"
#include "attention/sparse_attention.h"
#include "common/fp8_utils.cuh"

namespace deepfuse {
namespace attn {

using attn_dev::dequant16;
using attn_dev::load_i;
using attn_dev::pack_bf16;

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kRows = 64;       // query heads per CTA
constexpr int kBlock = 32;      // keys per unit
constexpr int kDim = 512;
constexpr int kRowBytes = 1024;  // a bf16 row in shared memory
constexpr int kQBytes = kRows * kRowBytes;        // 64 KB
constexpr int kKBytes = kBlock * kRowBytes;       // 32 KB per buffer
constexpr int kXchBytes = 8 * 512 * 4;            // 16 KB
constexpr float kLn2 = 0.69314718055994530942f;
constexpr float kLog2e = 1.44269504088896340736f;

__host__ __device__ constexpr int smem_bytes(int C) {
  return kQBytes + 2 * kKBytes + 2 * (kBlock / C) * kRowBytes + kXchBytes + 64;  // + 4 mbarriers
}

// Swizzled offset of 16-byte chunk c (0..63) of row r in a [rows][1024 B] tile.
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return static_cast<uint32_t>(r * kRowBytes + ((c ^ (r & 7)) << 4));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// mbarriers (cluster pipeline of the K tiles: "full" = the tile's bytes landed, "empty" =
// every CTA of the cluster finished reading it).
__device__ __forceinline__ uint32_t mapa(uint32_t a, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok = 0;
  do {
    asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }\n"
                 : "=r"(ok)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } while (!ok);
}
// Remote arrive, relaxed: it only releases reads (ldmatrix results already consumed by MMAs).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t cluster_bar) {
  asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_bar) : "memory");
}
// 16 bytes into a cluster CTA's shared memory, completing on that CTA's mbarrier.
__device__ __forceinline__ void st_async16(uint32_t cluster_addr, const uint4& v, uint32_t cluster_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   cluster_addr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(cluster_bar)
               : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Per-warp view of the key schedule. Lane l stands for position bi * 32 + l of the block.
// The raw slots of the next block are loaded one scan ahead (pre), so that the index loads'
// latency hides behind a unit's MMAs instead of stalling the schedule.
template <int G>
struct Sched {
  int bi;          // current block
  int r;           // current pass
  int slot[G];     // lane's slot per row (valid iff code >= 0)
  int code[G];     // first row with the same valid slot, -1 when invalid
  uint32_t passes; // passes needed in block bi (bit r)
  int pre_bi;      // block whose raw slots are in pre (or -1)
  int64_t pre[G];
};

// Raw slot of row r of the group at position p of the virtual list, or -1 (not loaded).
template <int G>
__device__ __forceinline__ void load_block(const AttnParams& P, int64_t (&out)[G], int bi, int group, int lane,
                                           const int (&len)[2][G]) {
  const int p = bi * kBlock + lane;
  const int K0 = P.src[0].K;
  const int si = p < K0 ? 0 : 1;
  const int pos = p - (si ? K0 : 0);
  const AttnSource& S = P.src[si];
#pragma unroll
  for (int r = 0; r < G; ++r) {
    const int64_t t = static_cast<int64_t>(group) * G + r;
    const bool ok = pos < (si ? len[1][r] : len[0][r]);  // len is 0 for rows past T
    out[r] = ok ? load_i(S.idx, S.idx64, t * S.K + pos) : -1;
  }
}

template <int G>
__device__ __forceinline__ void scan_block(const AttnParams& P, Sched<G>& s, int group, int lane, int b_end,
                                           const int (&len)[2][G]) {
  int64_t raw[G];
  if (s.pre_bi == s.bi) {
#pragma unroll
    for (int r = 0; r < G; ++r) raw[r] = s.pre[r];
  } else {
    load_block<G>(P, raw, s.bi, group, lane, len);
  }
  s.pre_bi = -1;
  if (s.bi + 1 < b_end) {
    load_block<G>(P, s.pre, s.bi + 1, group, lane, len);
    s.pre_bi = s.bi + 1;
  }
  const int p = s.bi * kBlock + lane;
  const int64_t n = P.src[p < P.src[0].K ? 0 : 1].num_slots;
#pragma unroll
  for (int r = 0; r < G; ++r) {
    const bool ok = raw[r] >= 0 && raw[r] < n;
    s.slot[r] = ok ? static_cast<int>(raw[r]) : -1;
    int c = -1;
    if (ok) {
      c = r;
#pragma unroll
      for (int r2 = r - 1; r2 >= 0; --r2)
        if (s.code[r2] >= 0 && s.slot[r2] == s.slot[r]) c = r2;
    }
    s.code[r] = c;
  }
  uint32_t pm = 0;
#pragma unroll
  for (int r = 0; r < G; ++r)
    if (__ballot_sync(0xffffffffu, s.code[r] == r)) pm |= 1u << r;
  s.passes = pm;
}

// Advance to the next unit (block, pass) with work, within [.., b_end). Returns false at the end.
template <int G>
__device__ __forceinline__ bool next_unit(const AttnParams& P, Sched<G>& s, int group, int lane, int b_end,
                                          const int (&len)[2][G]) {
  uint32_t rest = s.passes & ~((2u << s.r) - 1u);  // passes after r
  while (rest == 0) {
    if (++s.bi >= b_end) return false;
    scan_block<G>(P, s, group, lane, b_end, len);
    rest = s.passes;
  }
  s.r = __ffs(rest) - 1;
  return true;
}

template <int G>
__device__ __forceinline__ int sel(const int (&a)[G], int r) {
  int v = a[0];
#pragma unroll
  for (int i = 1; i < G; ++i)
    if (r == i) v = a[i];
  return v;
}

// A unit queued in the staging ring.
struct Unit {
  int have, ld, bi;
  uint32_t mask;
};

__device__ __forceinline__ int stage_bytes(const AttnParams& P) {
  const bool bf = (P.src[0].K > 0 && !P.src[0].fp8) || (P.src[1].K > 0 && !P.src[1].fp8);
  return bf ? kRowBytes : 640;  // per key: a bf16 row, or 584 FP8 bytes (rounded to 128)
}

template <int G>
__global__ void __launch_bounds__(kThreads, 1) sparse_attn_kernel(const __grid_constant__ AttnParams P) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int C = G * (P.H / kRows);
  const int NK = kBlock / C;      // keys this CTA fetches per unit
  const int TPK = kThreads / NK;  // threads per fetched key
  const int SB = stage_bytes(P);
  const int stg_total = 2 * NK * kRowBytes;
  const int NS = min(3, stg_total / (NK * SB));  // staging ring depth: 2 or 3 units
  uint8_t* Qs = smem;
  uint8_t* Ks = smem + kQBytes;                      // [2][32 keys][1024]
  uint8_t* Stg = Ks + 2 * kKBytes;                   // [NS][NK][SB]
  float* Xch = reinterpret_cast<float*>(Stg + stg_total);  // [8 warps][512]
  uint64_t* bars = reinterpret_cast<uint64_t*>(Xch + 8 * 512);  // full[2], empty[2] (C > 1)
  const uint32_t full0 = smem_u32(bars), empty0 = smem_u32(bars + 2);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rank = static_cast<int>(blockIdx.x) % C;
  const int group = static_cast<int>(blockIdx.x) / C;
  const int HT = P.H / kRows;
  const int brow = rank / HT;                  // this CTA's row within the group
  const int head0 = (rank % HT) * kRows;
  const int64_t t = static_cast<int64_t>(group) * G + brow;
  const bool t_ok = t < P.T;

  // Lengths of the group's rows, per source (0 past T).
  int len[2][G];
#pragma unroll
  for (int si = 0; si < 2; ++si)
#pragma unroll
    for (int r = 0; r < G; ++r) {
      const int64_t tr = static_cast<int64_t>(group) * G + r;
      const AttnSource& S = P.src[si];
      int64_t L = tr < P.T ? S.K : 0;
      if (tr < P.T && S.len != nullptr) L = min(L, load_i(S.len, S.len64, tr));
      len[si][r] = static_cast<int>(L);
    }

  // Q tile -> shared (swizzled) by cp.async (in the first group: it lands with unit 0's keys),
  // zeros for a row past T.
#pragma unroll
  for (int k = 0; k < kRows * 64 / kThreads; ++k) {
    const int i = tid + k * kThreads;
    const int r = i >> 6, c = i & 63;
    if (t_ok) {
      const __nv_bfloat16* src = static_cast<const __nv_bfloat16*>(P.q) + t * P.q_ld_t + (head0 + r) * P.q_ld_h + c * 8;
      cp_async16(smem_u32(Qs + swz(r, c)), src);
    } else {
      *reinterpret_cast<uint4*>(Qs + swz(r, c)) = make_uint4(0, 0, 0, 0);
    }
  }

  // This split's blocks.
  const int K_all = P.src[0].K + P.src[1].K;
  const int nblk = (K_all + kBlock - 1) / kBlock;
  const int bps = (nblk + P.splits - 1) / P.splits;
  const int b_begin = min(nblk, static_cast<int>(blockIdx.y) * bps);
  const int b_end = min(nblk, b_begin + bps);

  cg::cluster_group cluster = cg::this_cluster();
  if (C > 1) {
    if (tid == 0) {
      for (int b = 0; b < 2; ++b) {
        mbar_init(full0 + 8 * b, 1);
        mbar_init(empty0 + 8 * b, 8 * C);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      mbar_expect_tx(full0, kKBytes);  // units 0 and 1: every key row of a tile is written once
      mbar_expect_tx(full0 + 8, kKBytes);
    }
    cluster.sync();  // barriers initialised and every CTA of the cluster running before DSMEM traffic
  }

  // Fetch assignment: key kk of this CTA's share, 16-byte chunks j0, j0 + TPK, ...
  const int kk = tid / TPK, j0 = tid % TPK;
  const int lane_key = rank * NK + kk;  // position in the block

  Sched<G> s;
  s.bi = b_begin - 1;
  s.r = 31;  // no passes left: the first next_unit scans
  s.passes = 0;
  s.pre_bi = -1;

  // Find the next unit and issue its cp.async into staging slot `slot`; always commits a group.
  auto advance = [&](int slot, bool prev) -> Unit {
    Unit un{0, 0, 0, 0u};
    if (prev && next_unit<G>(P, s, group, lane, b_end, len)) {
      const int r = s.r;
      const int sl = __shfl_sync(0xffffffffu, sel<G>(s.slot, r), lane_key);
      const bool ld = __shfl_sync(0xffffffffu, sel<G>(s.code, r) == r ? 1 : 0, lane_key) != 0;
      if (ld) {
        const int p = s.bi * kBlock + lane_key;
        const AttnSource& S = P.src[p < P.src[0].K ? 0 : 1];
        const int64_t page = sl / S.page_size, row = sl % S.page_size;
        const uint8_t* pg = S.base + page * S.page_bytes;
        const uint32_t dst = smem_u32(Stg + (slot * NK + kk) * SB);
        if (S.fp8) {
          const uint8_t* rowp = pg + row * 576;
          for (int j = j0; j < 36; j += TPK) cp_async16(dst + j * 16, rowp + j * 16);
          if (j0 == 0) cp_async8(dst + 576, pg + static_cast<int64_t>(S.page_size) * 576 + row * 8);
        } else {
          const uint8_t* rowp = pg + row * kRowBytes;
          for (int j = j0; j < 64; j += TPK) cp_async16(dst + j * 16, rowp + j * 16);
        }
      }
      un.have = 1;
      un.ld = ld;
      un.bi = s.bi;
      un.mask = __ballot_sync(0xffffffffu, sel<G>(s.code, brow) == s.r && t_ok);
    }
    cp_async_commit();
    return un;
  };

  // Prologue: units 0 .. NS-2 into slots 0 .. NS-2.
  Unit q0 = advance(0, b_begin < b_end);
  Unit q1 = advance(1, q0.have && NS == 3);
  Unit q2{0, 0, 0, 0u};

  // MMA-side state.
  const int rg = warp & 3, hh = warp >> 2;
  const int g = lane >> 2, qd = lane & 3;
  float o[32][4];
#pragma unroll
  for (int j = 0; j < 32; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  for (int u = 0; q0.have; ++u) {
    const int buf = u & 1;
    const int slot = u % NS;
    if (NS == 3) asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    else asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();
    // (b) dequantise this CTA's keys of unit u into every cluster CTA's tile `buf`.
    {
      const int p = q0.bi * kBlock + lane_key;
      const bool fp8 = P.src[p < P.src[0].K ? 0 : 1].fp8 != 0;
      const uint8_t* st = Stg + (slot * NK + kk) * SB;
      const uint32_t kbase = static_cast<uint32_t>(buf * kKBytes);
      const int krow = lane_key;
      const bool ld = q0.ld != 0;
      // C > 1: wait until every CTA finished reading this tile (unit u - 2) before refilling it.
      if (C > 1 && u >= 2) mbar_wait(empty0 + 8 * buf, ((u >> 1) + 1) & 1);
      const uint32_t kloc = smem_u32(Ks) + kbase;
      auto put = [&](uint32_t off, const uint4& v) {
        if (C > 1) {
          for (int rk = 0; rk < C; ++rk) st_async16(mapa(kloc + off, rk), v, mapa(full0 + 8 * buf, rk));
        } else {
          *reinterpret_cast<uint4*>(Ks + kbase + off) = v;
        }
      };
      if (fp8) {
        for (int j = j0; j < 36; j += TPK) {
          uint4 a = make_uint4(0, 0, 0, 0), b = a;
          int c0, nc;
          if (j < 28) {
            if (ld) {
              const uint4 raw = *reinterpret_cast<const uint4*>(st + j * 16);
              dequant16(raw, exp2i(static_cast<int>(st[576 + (j >> 2)]) - 127), a, b);
            }
            c0 = 2 * j, nc = 2;
          } else {
            if (ld) a = *reinterpret_cast<const uint4*>(st + j * 16);
            c0 = j + 28, nc = 1;
          }
          put(swz(krow, c0), a);
          if (nc == 2) put(swz(krow, c0 + 1), b);
        }
      } else {
        for (int j = j0; j < 64; j += TPK) {
          uint4 a = make_uint4(0, 0, 0, 0);
          if (ld) a = *reinterpret_cast<const uint4*>(st + j * 16);
          put(swz(krow, j), a);
        }
      }
    }
    // (c) unit u + NS - 1 goes out (into the slot unit u - 1 used) before this unit's MMAs.
    const uint32_t mask = q0.mask;
    const bool last_have = NS == 3 ? q1.have : q0.have;
    Unit nu = advance((u + NS - 1) % NS, last_have != 0);
    if (NS == 3) {
      q2 = nu;
      q0 = q1;
      q1 = q2;
    } else {
      q0 = nu;
    }
    // (d) the tile is complete: C == 1 a CTA barrier; C > 1 its bytes landed (full barrier), and
    // the full barrier is re-armed for unit u + 2 (no peer writes it before our empty arrivals).
    if (C > 1) {
      mbar_wait(full0 + 8 * buf, (u >> 1) & 1);
      if (tid == 0) mbar_expect_tx(full0 + 8 * buf, kKBytes);
    } else {
      __syncthreads();
    }
    if (mask != 0) {  // CTA-uniform: some of this CTA's rows take keys of this unit

    // (e) S = Q K^T over this warp's 256 dims.
    // ldmatrix addresses: row r, chunk c = hh*32 + 2k + b (k = 0..15), swizzled c ^ (r & 7) with
    // r & 7 = lane & 7 for every operand here, so c ^ x = hh*32 + (k >> 2)*8 + ((2(k & 3) + b) ^ x):
    // four per-thread offsets per operand, the rest immediates.
    const uint32_t kb = smem_u32(Ks + buf * kKBytes);
    const int x7 = lane & 7;
    uint32_t qa[4], ka[4];
    {
      const uint32_t qrow = smem_u32(Qs) + (rg * 16 + (lane & 15)) * kRowBytes + hh * 512;
      const uint32_t krow = kb + (x7 + ((lane >> 4) << 3)) * kRowBytes + hh * 512;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        qa[k] = qrow + (((2 * k + (lane >> 4)) ^ x7) << 4);
        ka[k] = krow + (((2 * k + ((lane >> 3) & 1)) ^ x7) << 4);
      }
    }
    float sc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 16; ++ks) {
      uint32_t a0, a1, a2, a3;
      ldsm_x4(qa[ks & 3] + (ks >> 2) * 128, a0, a1, a2, a3);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(ka[ks & 3] + np * 16 * kRowBytes + (ks >> 2) * 128, b0, b1, b2, b3);
        mma_bf16(sc[2 * np], a0, a1, a2, a3, b0, b1);
        mma_bf16(sc[2 * np + 1], a0, a1, a2, a3, b2, b3);
      }
    }
    // Exchange the partial logits with the other D-half's warp.
    float* mine = Xch + warp * 512;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[(j * 4 + e) * 32 + lane] = sc[j][e];
    __syncthreads();
    const float* other = Xch + (warp ^ 4) * 512;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = j * 8 + 2 * qd + (e & 1);
        const float v = sc[j][e] + other[(j * 4 + e) * 32 + lane];
        sc[j][e] = (mask >> key) & 1u ? v * P.scale_log2 : -INFINITY;
      }
    // Online softmax (rows g and g + 8 of the warp's 16).
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(sc[j][0], sc[j][1]));
      mx[1] = fmaxf(mx[1], fmaxf(sc[j][2], sc[j][3]));
    }
    // Lazy rescaling: the reference max m_run moves only when a row's block max exceeds it by
    // more than 2^8 (then P <= 256: exact in fp32 sums, bf16 P keeps its relative precision);
    // the final normalisation uses the same reference, so the result is unchanged.
    bool need = false;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      need |= mx[i] > m_run[i] + 8.f;
    }
    if (__any_sync(0xffffffffu, need)) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float mn = fmaxf(m_run[i], mx[i]);
        const float alpha = mn == -INFINITY ? 1.f : exp2f(m_run[i] - mn);
        m_run[i] = mn;
        l_run[i] *= alpha;
#pragma unroll
        for (int j = 0; j < 32; ++j) o[j][2 * i] *= alpha, o[j][2 * i + 1] *= alpha;
      }
    }
    float muse[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) muse[i] = m_run[i] == -INFINITY ? 0.f : m_run[i];
    uint32_t pa[2][4];
    float ls[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p0 = exp2f(sc[j][0] - muse[0]), p1 = exp2f(sc[j][1] - muse[0]);
      const float p2 = exp2f(sc[j][2] - muse[1]), p3 = exp2f(sc[j][3] - muse[1]);
      ls[0] += p0 + p1;
      ls[1] += p2 + p3;
      pa[j >> 1][(j & 1) * 2 + 0] = pack_bf16(p0, p1);
      pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16(p2, p3);
    }
    l_run[0] += ls[0];
    l_run[1] += ls[1];
    // O += P V over this warp's 256 output columns.
    uint32_t va[4];
    {
      const uint32_t vrow = kb + (x7 + (((lane >> 3) & 1) << 3)) * kRowBytes + hh * 512;
#pragma unroll
      for (int k = 0; k < 4; ++k) va[k] = vrow + (((2 * k + (lane >> 4)) ^ x7) << 4);
    }
#pragma unroll
    for (int k2 = 0; k2 < 2; ++k2) {
#pragma unroll
      for (int np = 0; np < 16; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(va[np & 3] + k2 * 16 * kRowBytes + (np >> 2) * 128, b0, b1, b2, b3);
        mma_bf16(o[2 * np], pa[k2][0], pa[k2][1], pa[k2][2], pa[k2][3], b0, b1);
        mma_bf16(o[2 * np + 1], pa[k2][0], pa[k2][1], pa[k2][2], pa[k2][3], b2, b3);
      }
    }
    }  // mask != 0
    if (C > 1) {  // this warp is done with tile buf: tell every CTA of the cluster
      __syncwarp();
      if (lane == 0)
        for (int rk = 0; rk < C; ++rk) mbar_arrive_remote(mapa(empty0 + 8 * buf, rk));
    }
  }
  cp_async_wait_all();  // (only empty groups, or Q when there was no unit)
  if (C > 1) cluster.sync();  // no CTA leaves while a peer may still address its tile

  // Row sums over the quad.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
  }
  if (!t_ok) return;
  const int hrow[2] = {head0 + rg * 16 + g, head0 + rg * 16 + g + 8};

  attn_dev::write_output(P, t, hrow, hh, qd, m_run, l_run, [&](int j, int i, int k) -> float& { return o[j][2 * i + k]; });
}

// Split-KV combine: one CTA of 128 threads per (t, h); thread i owns columns 4i .. 4i+3. Launched as a
// programmatic dependent of the main kernel (sparse_attention_paged): it may start early and waits here
// until the main kernel has completed and its partials are visible (a no-op for a plain launch).
__global__ void __launch_bounds__(128) sparse_attn_combine_kernel(const __grid_constant__ AttnParams P) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  const int64_t th = blockIdx.x;  // t * H + h
  const int64_t t = th / P.H;
  const int h = static_cast<int>(th % P.H);
  const int i = threadIdx.x;
  const int64_t TH = static_cast<int64_t>(P.T) * P.H;
  float M = P.sink[h] * kLog2e;
  const float sk = M;
  for (int s = 0; s < P.splits; ++s) M = fmaxf(M, P.ws_ml[(s * TH + th) * 2]);
  if (M == -INFINITY) M = 0.f;
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, l = 0.f;
  for (int s = 0; s < P.splits; ++s) {
    const float2 ml = *reinterpret_cast<const float2*>(P.ws_ml + (s * TH + th) * 2);
    if (ml.y == 0.f) continue;
    const float w = exp2f(ml.x - M);
    l += w * ml.y;
    const float4 v = *reinterpret_cast<const float4*>(P.ws_o + (s * TH + th) * kDim + 4 * i);
    acc[0] += w * v.x, acc[1] += w * v.y, acc[2] += w * v.z, acc[3] += w * v.w;
  }
  attn_dev::combine_row_out(P, t, th, acc, l, M, sk, i);
}

}  // namespace attn
}  // namespace deepfuse
