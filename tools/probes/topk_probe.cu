// Standalone timing/phase probe for csrc/topk (no Python): per-shape graph-replayed and
// eager kernel time, plus per-CTA phase clocks recorded at the kernels' probe hooks
// (TOPK_PROBE* in topk_kernel.cuh, TOPK_ROWS_PROBE in topk_rows_kernel.cuh), which this file
// defines before including them. Not part of the library build. Build and run (sm_90a):
//   nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc tools/probes/topk_probe.cu csrc/topk/topk_plan.cpp \
//        csrc/common/cuda_utils.cu -o topk_probe && ./topk_probe
// -DDEEPFUSE_TOPK_ROWS_OFF: the general kernel only. PROBE_Z=z: the threshold margin.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <vector>

__device__ unsigned long long g_topk_probe[4096][32];
__device__ unsigned long long g_topk_rows_probe[4096][16];
#define TOPK_PROBE(i, v) \
  do { if (threadIdx.x == 0 && blockIdx.x < 4096) g_topk_probe[blockIdx.x][i] = (v); } while (0)
#define TOPK_PROBE_ADD(i) \
  do { if (threadIdx.x == 0 && blockIdx.x < 4096) g_topk_probe[blockIdx.x][i] += 1; } while (0)
#define TOPK_PROBE_AFTER(i, dep)                                              \
  do {                                                                        \
    unsigned long long t_;                                                    \
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t_) : "r"(dep)); /* after dep */ \
    TOPK_PROBE(i, t_);                                                        \
  } while (0)
#define TOPK_ROWS_PROBE(i) \
  do { if (threadIdx.x == 0 && blockIdx.x < 4096) g_topk_rows_probe[blockIdx.x][i] = clock64(); } while (0)

#include "topk/topk.h"
#include "topk/topk_kernel.cuh"
#include "topk/topk_rows_kernel.cuh"

namespace deepfuse {

void topk_probe_read(unsigned long long* host, int ctas) {
  check_cuda(cudaMemcpyFromSymbol(host, g_topk_probe, sizeof(unsigned long long) * 32 * ctas), "probe read");
}

void topk_rows_probe_read(unsigned long long* host, int ctas) {
  check_cuda(cudaMemcpyFromSymbol(host, g_topk_rows_probe, sizeof(unsigned long long) * 16 * ctas), "probe read");
}

// The plan topk() runs for contiguous rows (the general kernel only with ROWS_OFF), with the
// margin PROBE_Z when set.
TopkPlan probe_plan(TopkDtype dt, int64_t B, int64_t N, int k) {
#ifdef DEEPFUSE_TOPK_ROWS_OFF
  TopkPlan p = topk_plan(dt, B, N, k, false, num_sms(), false);
#else
  TopkPlan p = topk_plan(dt, B, N, k, false, num_sms());
#endif
  if (getenv("PROBE_Z")) p.margin = static_cast<float>(atof(getenv("PROBE_Z")));
  return p;
}

// topk() of the probe's builds: unsorted int32 indices, no values, contiguous rows.
void run_topk(const void* x, TopkDtype dt, int B, int N, int k, void* idx, cudaStream_t st) {
  static bool attrs = false;
  if (!attrs) {
    set_general_attributes();
    set_rows_attributes();
    attrs = true;
  }
  const TopkPlan p = probe_plan(dt, B, N, k);
  const TopkArgs a{x, N, nullptr, nullptr, idx, N, k, 0, 0};
  if (p.kernel == 1) {
    launch_rows(a, dt, B, p, st);
  } else {
    launch_general(a, dt, B, p, st);
  }
}

}  // namespace deepfuse

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); exit(1); } } while (0)

// Pseudo-normal values (Box-Muller on a hash), bf16 (fmt 0) or fp32 (fmt 2).
__global__ void fill(void* x, long long n, int fmt, unsigned seed, int mode) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15; h *= 0x846ca68bu; h ^= h >> 16;
    unsigned g = h * 747796405u + 2891336453u; g ^= g >> 13; g *= 0x5bd1e995u; g ^= g >> 15;
    float u1 = ((h >> 8) + 1) * (1.0f / 16777217.0f), u2 = (g >> 8) * (1.0f / 16777216.0f);
    float v = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
    if (mode == 1) v = 0.75f;                                    // allsame
    if (mode == 2) v = (float)(i % 3001) - 1500.f;               // ramp
    if (mode == 3) v = u2 < 0.45f ? -0.f : (u2 < 0.9f ? 0.f : fabsf(v) + 0.5f);  // signed zeros
    if (fmt == 0) ((__nv_bfloat16*)x)[i] = __float2bfloat16(v); else ((float*)x)[i] = v;
  }
}

int main(int argc, char** argv) {
  struct S { int fmt, B, N, k; };
  std::vector<S> shapes;
  for (int N : {8192, 32768, 131072})
    for (int k : {512, 2048})
      for (int B : {1, 16, 64, 128, 512}) shapes.push_back({0, B, N, k});
  for (int k : {50, 512})
    for (int B : {1, 16, 256}) shapes.push_back({2, B, 129280, k});
  if (argc == 4) {  // one shape: B N k (bf16 unless k is negative: fp32)
    const int k = atoi(argv[3]);
    shapes = {{k < 0 ? 2 : 0, atoi(argv[1]), atoi(argv[2]), k < 0 ? -k : k}};
  }
  const int fill_mode = getenv("PROBE_FILL") ? atoi(getenv("PROBE_FILL")) : 0;  // 1 allsame 2 ramp 3 zeros
  void* flush;
  CK(cudaMalloc(&flush, 256 << 20));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<unsigned long long> pr(4096 * 32);
  printf("%-4s %5s %7s %5s %5s %9s %9s | CTA0 cycles: sample stream range select emit | mean n  max att  compactions | sel: hist find levels | stream: edge round0 | r0: mask prebar bar\n",
         "dt", "B", "N", "k", "plan", "graph_us", "cold_us");
  for (const S& s : shapes) {
    const size_t es = s.fmt == 0 ? 2 : 4;
    void *x, *idx;
    CK(cudaMalloc(&x, (size_t)s.B * s.N * es));
    CK(cudaMalloc(&idx, (size_t)s.B * s.k * 4));
    fill<<<1024, 256, 0, st>>>(x, (long long)s.B * s.N, s.fmt, 1234u + s.B, fill_mode);
    const auto dt = s.fmt == 0 ? deepfuse::TopkDtype::kBf16 : deepfuse::TopkDtype::kF32;
    auto run = [&]() { deepfuse::run_topk(x, dt, s.B, s.N, s.k, idx, st); };
    run();
    CK(cudaStreamSynchronize(st));
    {  // invariants: indices unique and in range, min(selected) >= max(unselected)
      std::vector<unsigned char> hx((size_t)s.B * s.N * es);
      std::vector<int> hi((size_t)s.B * s.k);
      CK(cudaMemcpy(hx.data(), x, hx.size(), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hi.data(), idx, hi.size() * 4, cudaMemcpyDeviceToHost));
      auto val = [&](long long i) -> float {
        if (s.fmt == 2) return ((const float*)hx.data())[i];
        unsigned u = ((const unsigned short*)hx.data())[i];
        u <<= 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
      };
      int bad = 0;
      std::vector<char> mark(s.N);
      for (int b = 0; b < s.B && bad < 3; ++b) {
        std::fill(mark.begin(), mark.end(), 0);
        float mn = 1e30f, mx = -1e30f;
        for (int j = 0; j < s.k; ++j) {
          int e = hi[(size_t)b * s.k + j];
          if (e < 0 || e >= s.N || mark[e]) { ++bad; printf("  BAD row %d slot %d index %d\n", b, j, e); break; }
          mark[e] = 1;
          mn = std::min(mn, val((long long)b * s.N + e));
        }
        for (int e = 0; e < s.N; ++e) if (!mark[e]) mx = std::max(mx, val((long long)b * s.N + e));
        if (mx > mn) { ++bad; printf("  BAD row %d: max unselected %g > min selected %g\n", b, mx, mn); }
      }
      if (bad) printf("  CHECK FAILED\n");
    }
    if (getenv("PROBE_ONCE")) {  // one checked launch (e.g. under compute-sanitizer)
      CK(cudaFree(x));
      CK(cudaFree(idx));
      continue;
    }
    const auto plan = deepfuse::probe_plan(dt, s.B, s.N, s.k);
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    // 512 threads, G = 1: persistent CTAs (each records its last row)
    const int grid = plan.ctas_per_row > 1 ? s.B * plan.ctas_per_row : (plan.threads == 512 ? std::min(s.B, sms) : s.B);
    const int ctas = std::min(4096, grid);
    // eager: one launch between events after an L2 flush (as microbench/), median of 20
    std::vector<float> ev;
    for (int r = 0; r < 20; ++r) {
      CK(cudaMemsetAsync(flush, r, 256 << 20, st));
      CK(cudaEventRecord(e0, st));
      run();
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      ev.push_back(ms * 1000.f);
    }
    std::sort(ev.begin(), ev.end());
    // graph: 20 launches captured, replayed 5x
    cudaGraph_t g;
    cudaGraphExec_t ge;
    // PROBE_WARM=1: each launch preceded by the same kernel over 132 rows (every SM runs it
    // first: warm instruction caches); graph time then includes those launches too.
    const bool warm = getenv("PROBE_WARM") != nullptr;
    void *xw = nullptr, *iw = nullptr;
    if (warm) {
      CK(cudaMalloc(&xw, (size_t)132 * s.N * es));
      CK(cudaMalloc(&iw, (size_t)132 * s.k * 4));
      fill<<<1024, 256, 0, st>>>(xw, (long long)132 * s.N, s.fmt, 99u, 0);
    }
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int r = 0; r < 20; ++r) {
      if (warm) deepfuse::run_topk(xw, dt, 132, s.N, s.k, iw, st);
      run();
    }
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e0, st));
    for (int r = 0; r < 5; ++r) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float gms;
    CK(cudaEventElapsedTime(&gms, e0, e1));
    if (plan.kernel == 1) {  // short-row kernel: CTA 0's phases (TOPK_ROWS_PROBE points)
      std::vector<unsigned long long> rp(16 * std::min(s.B, 4096));
      deepfuse::topk_rows_probe_read(rp.data(), std::min(s.B, 4096));
      auto d = [&](int a, int b) { return (long long)(rp[b] - rp[a]); };
      printf("%-4s %5d %7d %5d R%dx%-3d %9.2f %9.2f | rows: load %5lld level1 %5lld find1 %5lld masks %5lld levels %5lld (open %lld bar %lld find %lld refine %lld) scan %5lld emit %5lld\n",
             s.fmt == 0 ? "bf16" : "fp32", s.B, s.N, s.k, plan.ctas_per_row, plan.threads, gms * 1000.f / 100.f,
             ev[ev.size() / 2], d(0, 1), d(1, 2), d(2, 3), d(3, 7), d(7, 4), d(7, 8), d(8, 9), d(9, 10), d(10, 4), d(4, 5), d(5, 6));
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
      CK(cudaFree(x));
      CK(cudaFree(idx));
      continue;
    }
    deepfuse::topk_probe_read(pr.data(), ctas);  // the last replayed launch (warm)
    double nsum = 0;
    unsigned long long att = 0, comp = 0;
    for (int c = 0; c < ctas; ++c) {
      nsum += pr[c * 32 + 5];
      att = std::max(att, pr[c * 32 + 4]);
      comp += pr[c * 32 + 8];
    }
    const unsigned long long* p = pr.data();
    auto d = [&](int a, int b) { return (long long)(p[b] - p[a]); };
    printf("%-4s %5d %7d %5d G%dx%-3d %9.2f %9.2f | %6lld %6lld %6lld %6lld %6lld | %7.0f %3llu %5llu | %6lld %6lld %llu | %6lld %6lld | %6lld %6lld %6lld\n",
           s.fmt == 0 ? "bf16" : "fp32", s.B, s.N, s.k, plan.ctas_per_row, plan.threads, gms * 1000.f / 100.f,
           ev[ev.size() / 2], p[9] ? d(0, 9) : 0ll, p[9] ? d(9, 1) : d(0, 1), d(1, 2), d(2, 3), d(3, 6),
           nsum / ctas, att, comp, d(2, 11), d(11, 12), p[14], d(9, 13), d(13, 15), d(13, 7), d(7, 16), d(16, 17));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    CK(cudaFree(x));
    CK(cudaFree(idx));
  }
  return 0;
}
