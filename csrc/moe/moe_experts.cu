// moe_experts host launch: routing plan -> activation cast -> GEMM1 (w1 | w3, SwiGLU) ->
// cast of h -> GEMM2 (w2, routing weight) -> combine in slot order (deterministic). At decode
// (T <= stream_max_t) the streaming kernels of moe_stream.cu run both GEMMs with the casts fused.
//
// Plan: pairs q = t * ktot + j (ktot = k + shared) are counted per expert, experts laid out
// by an exclusive scan, cut into tasks of at most BM rows, and placed (atomics: the row
// order inside an expert does not change any result). inv[q] is the pair's position or -1.
// Small plans run in one CTA (one launch at decode); large ones in three launches.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>

#include "cast/cast.h"
#include "common/cuda_utils.h"
#include "moe/moe.h"
#include "moe/moe_prefill.h"
#include "moe/moe_route.cuh"
#include "moe/moe_stream.h"
#include "gemm/grouped_gemm_sm90.cuh"

namespace deepfuse {
namespace {

using gemm::GemmArgs;
using gemm::GemmCfg;
using gemm::GemmOperand;

constexpr int kPlanThreads = 1024;
constexpr int kMaxExperts = 2 * kPlanThreads - 1;  // E + 1 scan slots
constexpr int kSmallPlan = 16384;                    // pairs planned in one CTA
constexpr int kRouteFloats = 24576;                  // fused gate: routing warps' scratch (floats)
constexpr int kRouteSmem = kRouteFloats * 4;
constexpr int kStreamBoundaries = 192;               // decode: the stream kernels' grids are at most this

// decode: 64 weight rows x 16 tokens, all CTAs of a T = 1 step resident at once (two 128-K
// chunks per stage measured slower: 148 vs 119 us at T = 1);
// prefill: 128 weight rows x 128 tokens
template <bool MX>
using DecodeCfg = GemmCfg<16, 1, 4, MX>;
template <bool MX>
using PrefillCfg = GemmCfg<128, 2, 4, MX>;
constexpr int kDecodeBT = 16, kPrefillBT = 128;

struct PlanArgs {
  const void* ids;
  bool ids64;
  const float* weights;
  int T, k, ktot, E, nexp, BM;  // nexp = E + has_shared
  int* counts;                  // [nexp] (large plans)
  int* cursor;                  // [nexp] (large plans)
  int* tasks;                   // [U, 3]
  int* ntasks;
  int* rows;                    // [P] token of each position
  float* wrow;                  // [P] routing weight of each position
  int* inv;                     // [P] position of each pair, -1 if dropped
  int* bcnt;                    // [nbcnt] the stream kernels' boundary counters, zeroed here (or null)
  int nbcnt;
};

__device__ __forceinline__ int pair_expert(const PlanArgs& a, int q, int& t, float& w) {
  t = q / a.ktot;
  const int j = q - t * a.ktot;
  if (j == a.k) {
    w = 1.0f;
    return a.E;  // shared expert
  }
  const int64_t off = static_cast<int64_t>(t) * a.k + j;
  const int64_t id = a.ids64 ? static_cast<const int64_t*>(a.ids)[off] : static_cast<const int32_t*>(a.ids)[off];
  w = a.weights[off];
  return (id >= 0 && id < a.E) ? static_cast<int>(id) : -1;
}

// Exclusive scans of counts (-> first positions) and of tasks per expert; writes the task list.
// All kPlanThreads threads call it; cnt/base in shared memory ([kMaxExperts + 1]).
__device__ void plan_scan(const PlanArgs& a, const int* cnt, int* base) {
  using Scan = cub::BlockScan<int2, kPlanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int tid = threadIdx.x;
  int2 v[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = tid * 2 + i;
    const int c = e < a.nexp ? cnt[e] : 0;
    v[i] = make_int2(c, (c + a.BM - 1) / a.BM);
  }
  int2 total;
  struct Add {
    __device__ int2 operator()(int2 x, int2 y) const { return make_int2(x.x + y.x, x.y + y.y); }
  };
  Scan(tmp).ExclusiveScan(v, v, make_int2(0, 0), Add{}, total);
  // ntasks[1]: some routed expert spans several tasks (its rows' tasks then depend on the atomic placement)
  const int spans = __syncthreads_or((tid * 2 < a.E && cnt[tid * 2] > a.BM) || (tid * 2 + 1 < a.E && cnt[tid * 2 + 1] > a.BM));
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = tid * 2 + i;
    if (e >= a.nexp) continue;
    base[e] = v[i].x;
    const int c = cnt[e];
    for (int s = 0; s * a.BM < c; ++s) {
      int* tk = a.tasks + (v[i].y + s) * 3;
      tk[0] = e, tk[1] = v[i].x + s * a.BM, tk[2] = v[i].x + min(c, (s + 1) * a.BM);
    }
  }
  if (tid == 0) a.ntasks[0] = total.y, a.ntasks[1] = spans;
}

// The whole plan in one CTA (kPlanThreads threads; cnt / base in shared memory).
__device__ __forceinline__ void plan_small(const PlanArgs& a, int* cnt, int* base) {
  const int P = a.T * a.ktot;
  for (int e = threadIdx.x; e < a.nexp; e += kPlanThreads) cnt[e] = 0;
  for (int b = threadIdx.x; b < a.nbcnt; b += kPlanThreads) a.bcnt[b] = 0;
  __syncthreads();
  for (int q = threadIdx.x; q < P; q += kPlanThreads) {
    int t;
    float w;
    const int e = pair_expert(a, q, t, w);
    if (e >= 0) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  plan_scan(a, cnt, base);
  __syncthreads();
  for (int q = threadIdx.x; q < P; q += kPlanThreads) {
    int t;
    float w;
    const int e = pair_expert(a, q, t, w);
    int pos = -1;
    if (e >= 0) {  // the shared expert's rows in token order (every token has one), the others by atomics
      pos = e == a.E ? base[e] + t : atomicAdd(&base[e], 1);
      a.rows[pos] = t;
      a.wrow[pos] = w;
    }
    a.inv[q] = pos;
  }
}

__global__ void __launch_bounds__(kPlanThreads) plan_small_kernel(const PlanArgs a) {
  __shared__ int cnt[kMaxExperts + 1], base[kMaxExperts + 1];
  plan_small(a, cnt, base);
}

// The fused gate's second launch (after gate_logits_kernel, programmatic dependent launch): route
// every token (warps < nw, one token at a time, moe_route's semantics: moe_route.cuh), write
// ids / weights, then the plan from them in the same CTA.
struct RouteArgs {
  const float* logits;
  const float* bias;
  const void* hash_ids;
  bool hash_is64;
  float route_scale;
  int nw;  // routing warps (their scratch: 2 E floats each, dynamic shared memory)
};

template <ScoreFunc S>
__global__ void __launch_bounds__(kPlanThreads) route_plan_kernel(const PlanArgs a, const RouteArgs r) {
  extern __shared__ float rs[];
  __shared__ int cnt[kMaxExperts + 1], base[kMaxExperts + 1];
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  // the GEMMs after this kernel wait for its completion before reading the plan
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int warp = threadIdx.x / 32;
  if (warp < r.nw) {
    float* g = rs + warp * 2 * a.E;
    for (int t = warp; t < a.T; t += r.nw)
      route::route_token<S>(r.logits + static_cast<int64_t>(t) * a.E, r.bias, r.hash_ids, r.hash_is64, g, g + a.E,
                            t, a.E, a.k, r.route_scale, const_cast<float*>(a.weights),
                            static_cast<int64_t*>(const_cast<void*>(a.ids)));
  }
  __syncthreads();  // ids / weights (global) visible to the whole CTA
  plan_small(a, cnt, base);
}

template <ScoreFunc S>
void launch_route_plan(const PlanArgs& pa, const RouteArgs& ra, cudaStream_t stream) {
  auto kern = route_plan_kernel<S>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kRouteSmem);
  check_cuda(attr, "cudaFuncSetAttribute(route_plan_kernel)");
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(1, 1, 1);
  cfg.blockDim = dim3(kPlanThreads, 1, 1);
  cfg.dynamicSmemBytes = static_cast<size_t>(ra.nw) * 2 * pa.E * sizeof(float);
  cfg.stream = stream;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kern, pa, ra), "route_plan_kernel");
}

__global__ void plan_count_kernel(const PlanArgs a) {
  const int P = a.T * a.ktot;
  for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < P; q += gridDim.x * blockDim.x) {
    int t;
    float w;
    const int e = pair_expert(a, q, t, w);
    if (e >= 0) atomicAdd(&a.counts[e], 1);
  }
}

__global__ void __launch_bounds__(kPlanThreads) plan_scan_kernel(const PlanArgs a) {
  __shared__ int cnt[kMaxExperts + 1], base[kMaxExperts + 1];
  for (int e = threadIdx.x; e < a.nexp; e += kPlanThreads) cnt[e] = a.counts[e];
  __syncthreads();
  plan_scan(a, cnt, base);
  __syncthreads();
  for (int e = threadIdx.x; e < a.nexp; e += kPlanThreads) a.cursor[e] = base[e];
}

__global__ void plan_place_kernel(const PlanArgs a) {
  const int P = a.T * a.ktot;
  for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < P; q += gridDim.x * blockDim.x) {
    int t;
    float w;
    const int e = pair_expert(a, q, t, w);
    int pos = -1;
    if (e >= 0) {
      pos = atomicAdd(&a.cursor[e], 1);
      a.rows[pos] = t;
      a.wrow[pos] = w;
    }
    a.inv[q] = pos;
  }
}

// out[t, :] = sum over j of Y[inv[t * ktot + j], :], in j order.
template <typename Out>
__global__ void combine_kernel(const float* __restrict__ Y, const int* __restrict__ inv, Out* __restrict__ out,
                               int ktot, int d) {
  const int64_t t = blockIdx.x;  // tokens on x: more than 65535 of them
  const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 4;
  if (c >= d) return;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j = 0; j < ktot; ++j) {
    const int p = inv[static_cast<int64_t>(t) * ktot + j];
    if (p < 0) continue;
    const float4 y = *reinterpret_cast<const float4*>(Y + static_cast<int64_t>(p) * d + c);
    s.x += y.x, s.y += y.y, s.z += y.z, s.w += y.w;
  }
  Out* o = out + static_cast<int64_t>(t) * d + c;
  if constexpr (sizeof(Out) == 4) {
    *reinterpret_cast<float4*>(o) = s;
  } else {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(s.x, s.y), hi = __floats2bfloat162_rn(s.z, s.w);
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t*>(&lo);
    u.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(o) = u;
  }
}

struct Workspace {
  int *counts, *cursor, *tasks, *ntasks, *rows, *inv;
  float *wrow, *logits;
  int* bcnt;            // decode: the stream kernels' boundary counters [2][nbd] and partial sums
  float* bpart;
  int nbd;
  uint8_t *xq, *hq;
  float *xs, *hs, *Y;
  __nv_bfloat16* h;
  uint8_t* xp;          // prefill path: x in position order, scales transposed (moe_prefill.cu)
  float *xsT, *hsT;
  int64_t bytes;
};

int64_t align256(int64_t v) { return (v + 255) / 256 * 256; }

int plan_bm(const MoeProblem& p) { return p.T <= 256 ? kDecodeBT : kPrefillBT; }

Workspace carve(const MoeProblem& p, void* base) {
  const int ktot = p.k + (p.has_shared ? 1 : 0), nexp = p.E + (p.has_shared ? 1 : 0);
  const int64_t P = static_cast<int64_t>(p.T) * ktot;
  const int BM = plan_bm(p);
  const int64_t U = P / BM + std::min<int64_t>(nexp, P) + 1;
  char* b = static_cast<char*>(base);
  int64_t off = 0;
  auto take = [&](int64_t n) {
    char* r = b ? b + off : nullptr;
    off += align256(n);
    return r;
  };
  Workspace w;
  w.counts = reinterpret_cast<int*>(take(4 * nexp));
  w.cursor = reinterpret_cast<int*>(take(4 * nexp));
  w.ntasks = reinterpret_cast<int*>(take(8));  // [0] tasks, [1] a routed expert spans several tasks
  w.tasks = reinterpret_cast<int*>(take(12 * U));
  w.rows = reinterpret_cast<int*>(take(4 * P));
  w.inv = reinterpret_cast<int*>(take(4 * P));
  w.wrow = reinterpret_cast<float*>(take(4 * P));
  w.logits = reinterpret_cast<float*>(take(p.T <= kGateMaxT ? 4LL * p.T * p.E : 0));  // the fused gate's
  w.nbd = BM == kDecodeBT ? kStreamBoundaries : 0;
  w.bcnt = reinterpret_cast<int*>(take(8LL * w.nbd));
  w.bpart = reinterpret_cast<float*>(take(4 * moe_stream_part_floats(w.nbd)));
  w.xq = reinterpret_cast<uint8_t*>(take(static_cast<int64_t>(p.T) * p.d));
  w.xs = reinterpret_cast<float*>(take(4LL * p.T * ceil_div(p.d, 128)));
  w.h = reinterpret_cast<__nv_bfloat16*>(take(2 * P * p.inter));
  w.hq = reinterpret_cast<uint8_t*>(take(P * p.inter));
  w.hs = reinterpret_cast<float*>(take(4 * P * ceil_div(p.inter, 128)));
  w.Y = reinterpret_cast<float*>(take(4 * P * p.d));
  if (BM == kPrefillBT && p.d % 128 == 0 && p.inter % 128 == 0) {  // (moe_workspace_bytes knows no format)
    const int64_t Pp = moe_prefill_pitch(P);
    w.xp = reinterpret_cast<uint8_t*>(take(P * p.d));
    w.xsT = reinterpret_cast<float*>(take(4 * Pp * ceil_div(p.d, 128)));
    w.hsT = reinterpret_cast<float*>(take(4 * Pp * ceil_div(p.inter, 128)));
  } else {
    w.xp = nullptr, w.xsT = w.hsT = nullptr;
  }
  w.bytes = off;
  return w;
}

template <class C, bool MX, bool SWIGLU>
void launch_gemm(const GemmArgs& args, int n_tiles, int64_t U, cudaStream_t stream) {
  gemm::launch_grouped_gemm<C, MX, SWIGLU>(args, dim3(n_tiles, static_cast<unsigned>(U)), stream,
                                           "grouped_gemm_kernel (moe)");
}

template <template <bool> class Cfg>
void run_gemms(const MoeProblem& p, const Workspace& w, int64_t U, int64_t P, cudaStream_t stream) {
  auto op = [](const ExpertWeight& x) {
    return GemmOperand{static_cast<const uint8_t*>(x.w), x.scale, x.scale_u8};
  };
  const bool mx = p.fmt == WeightFmt::kMxfp4;
  GemmArgs g1{};
  g1.a = w.xq, g1.a_scale = w.xs, g1.a_rows = w.rows;
  g1.K = p.d, g1.N = p.inter, g1.E = p.E;
  g1.b0 = op(p.w1), g1.b1 = op(p.w3), g1.sb0 = op(p.sw1), g1.sb1 = op(p.sw3);
  g1.tasks = w.tasks, g1.ntasks = w.ntasks, g1.ksplit = 1, g1.groups = 0, g1.out = w.h, g1.limit = p.limit;
  const int n1 = ceil_div(p.inter, Cfg<false>::IPT);
  if (mx)
    launch_gemm<Cfg<true>, true, true>(g1, n1, U, stream);
  else
    launch_gemm<Cfg<false>, false, true>(g1, n1, U, stream);

  fp8_group_cast(w.h, true, w.hq, w.hs, ScaleKind::kFp32, P, p.inter, p.inter, 128, 0, stream);

  GemmArgs g2{};
  g2.a = w.hq, g2.a_scale = w.hs, g2.a_rows = nullptr;
  g2.K = p.inter, g2.N = p.d, g2.E = p.E;
  g2.b0 = op(p.w2), g2.b1 = op(p.w2), g2.sb0 = op(p.sw2), g2.sb1 = op(p.sw2);
  g2.tasks = w.tasks, g2.ntasks = w.ntasks, g2.ksplit = 1, g2.groups = 0, g2.out = w.Y, g2.row_weight = w.wrow;
  const int n2 = ceil_div(p.d, Cfg<false>::ROWS);
  if (mx)
    launch_gemm<Cfg<true>, true, false>(g2, n2, U, stream);
  else
    launch_gemm<Cfg<false>, false, false>(g2, n2, U, stream);
}

}  // namespace

int64_t moe_workspace_bytes(const MoeProblem& p) { return carve(p, nullptr).bytes; }

void moe_experts(const MoeProblem& p, const void* x, bool x_bf16, const void* ids, bool ids_is64,
                 const float* weights, void* out, void* workspace, cudaStream_t stream, const MoeGate* gate) {
  require_sm90a("moe_experts");
  if (p.T <= 0) return;
  const int ktot = p.k + (p.has_shared ? 1 : 0), nexp = p.E + (p.has_shared ? 1 : 0);
  if (nexp > kMaxExperts) throw std::runtime_error("deepfuse: moe_experts: too many experts");
  const int64_t P = static_cast<int64_t>(p.T) * ktot;
  if (P > (1LL << 30)) throw std::runtime_error("deepfuse: moe_experts: too many tokens");
  const Workspace w = carve(p, workspace);
  const int BM = plan_bm(p);
  const int64_t U = P / BM + std::min<int64_t>(nexp, P) + 1;

  PlanArgs pa{ids, ids_is64, weights, p.T, p.k, ktot, p.E, nexp, BM, w.counts, w.cursor,
              w.tasks, w.ntasks, w.rows, w.wrow, w.inv, w.bcnt, 2 * w.nbd};
  if (gate != nullptr) {  // ids (int64) / weights are the router's outputs
    if (p.T > kGateMaxT || P > kSmallPlan || p.E > 1024 || p.k > 32)
      throw std::runtime_error("deepfuse: moe_experts: the fused gate takes T <= 256, E <= 1024, k <= 32");
    pa.ids64 = true;
    moe_gate_logits(x, x_bf16, gate->w, p.T, p.d, p.E, w.logits, stream);
    const RouteArgs ra{w.logits, gate->bias, gate->hash_ids, gate->hash_is64, gate->route_scale,
                       std::min(kPlanThreads / 32, kRouteFloats / (2 * p.E))};
    switch (gate->score) {
      case ScoreFunc::kSqrtSoftplus: launch_route_plan<ScoreFunc::kSqrtSoftplus>(pa, ra, stream); break;
      case ScoreFunc::kSigmoid: launch_route_plan<ScoreFunc::kSigmoid>(pa, ra, stream); break;
      case ScoreFunc::kSoftmax: launch_route_plan<ScoreFunc::kSoftmax>(pa, ra, stream); break;
    }
  } else if (P <= kSmallPlan) {
    plan_small_kernel<<<1, kPlanThreads, 0, stream>>>(pa);
    check_launch("plan_small_kernel");
  } else {
    check_cuda(cudaMemsetAsync(w.counts, 0, 4 * nexp, stream), "cudaMemsetAsync");
    const int blocks = static_cast<int>(std::min<int64_t>(ceil_div<int64_t>(P, 256), 1024));
    plan_count_kernel<<<blocks, 256, 0, stream>>>(pa);
    check_launch("plan_count_kernel");
    plan_scan_kernel<<<1, kPlanThreads, 0, stream>>>(pa);
    check_launch("plan_scan_kernel");
    plan_place_kernel<<<blocks, 256, 0, stream>>>(pa);
    check_launch("plan_place_kernel");
  }
  const MoeStreamIO io{x, x_bf16, w.rows, w.tasks, w.ntasks, U, w.h, w.Y, w.wrow, w.bcnt, w.bpart, w.nbd};
  if (BM == kDecodeBT && p.T <= p.stream_max_t && moe_stream_gemms(p, io, stream)) {
    // the decode path: both casts fused into the streaming GEMMs
  } else if (BM == kPrefillBT && p.prefill_min_t > 0 && p.T >= p.prefill_min_t && w.xp != nullptr &&
             moe_prefill_gemms(p, MoePrefillIO{x, x_bf16, w.rows, w.tasks, w.ntasks, U, P, w.xp, w.xsT, w.h, w.hq,
                                               w.hsT, w.Y, w.wrow},
                               stream)) {
    // the prefill path: tokens on wgmma's M side, TMA producer + two consumer warpgroups
  } else if (BM == kDecodeBT) {
    fp8_group_cast(x, x_bf16, w.xq, w.xs, ScaleKind::kFp32, p.T, p.d, p.d, 128, 0, stream);
    run_gemms<DecodeCfg>(p, w, U, P, stream);
  } else {
    fp8_group_cast(x, x_bf16, w.xq, w.xs, ScaleKind::kFp32, p.T, p.d, p.d, 128, 0, stream);
    run_gemms<PrefillCfg>(p, w, U, P, stream);
  }

  const dim3 cgrid(static_cast<unsigned>(p.T), ceil_div(p.d, 1024));
  if (x_bf16)
    combine_kernel<__nv_bfloat16><<<cgrid, 256, 0, stream>>>(w.Y, w.inv, static_cast<__nv_bfloat16*>(out), ktot, p.d);
  else
    combine_kernel<float><<<cgrid, 256, 0, stream>>>(w.Y, w.inv, static_cast<float*>(out), ktot, p.d);
  check_launch("combine_kernel");
}

}  // namespace deepfuse
