// What one attention node costs in a CUDA graph (what XLA's command buffers replay), beside
// kernels that do nothing with the same launch shape: B1 H4 S60 D64 causal f32, fa_short's body
// (probe_fa_w.cu's fa_xla_param = fa_short_f32_2_2 as kernels/ has it, and variants), 200 dependent
// launches captured into one graph, replayed; per node, median of 30 replays. Also the same
// launches back to back on a stream (no graph) and one launch + synchronize.
// Build (GPU machine): nvcc -O2 -arch=sm_90 -std=c++17 -I<kernels>/include -I<kernels>
//   -DFK_ONLY=fa_xla_none -DFK_CAP=900 -o graph_nodes graph_nodes.cu (FK_CAP: the host pass
//   must see the same kernels as the device pass)
// Run: ./graph_nodes [rounds]   or   ./graph_nodes --once (10 launches of each, for ncu)
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "probe_fa_w.cu"

#define CK(x)                                                                     \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

extern "C" __global__ void k_tiny(const float* q, float* o) {
  if (threadIdx.x == 0) o[0] = q[0] + 1.0f;
}
extern "C" __global__ void __launch_bounds__(128, 1) k_empty(const float* q, const float* k, const float* v,
                                                             const FaArgs* a, float* o, float* lse) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && a->sq < 0) o[0] = q[0];
}
// fa_short's body after waiting for the previous kernel (programmatic dependent launch).
extern "C" __global__ void __launch_bounds__(128, 1)
    fa_xla_pdl(const float* q, const float* k, const float* v, const FaArgs* a, float* o, float* lse) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  fa_short<float, 2, 2>(q, k, v, o, lse, *a);
}

// fa_short's body again, as its own function so that the carveout attribute set on it does not
// change the other variants.
extern "C" __global__ void __launch_bounds__(128, 1)
    fa_xla_carve(const float* q, const float* k, const float* v, const FaArgs* a, float* o, float* lse) {
  fa_short<float, 2, 2>(q, k, v, o, lse, *a);
}

typedef void (*Kern)(const float*, const float*, const float*, const FaArgs*, float*, float*);

struct Variant {
  const char* name;
  Kern f;  // null: k_tiny
  int rows, threads, smem;
  bool carveout, pdl;
};

static FaArgs args_for(int rows) {
  const int tiles = (60 + rows - 1) / rows;
  FaArgs a = {4, 1, 60, 60, 64, -1, 0, tiles, 4, 0.125f * 1.4426950408889634f,
              15360, 256, 64, 15360, 256, 64, 15360, 256, 64, 0};
  return a;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const bool once = argc > 1 && !strcmp(argv[1], "--once");
  const int rounds = (argc > 1 && !once) ? atoi(argv[1]) : 3;
  const int n = 200, elems = 60 * 4 * 64;
  std::vector<float> host(elems);
  srand(11);
  for (auto& x : host) x = (float)rand() / RAND_MAX * 4.0f - 2.0f;
  float *q, *k, *v, *bufs[2], *lse;
  CK(cudaMalloc(&q, elems * 4));
  CK(cudaMalloc(&k, elems * 4));
  CK(cudaMalloc(&v, elems * 4));
  CK(cudaMalloc(&bufs[0], elems * 4));
  CK(cudaMalloc(&bufs[1], elems * 4));
  CK(cudaMalloc(&lse, 4 * 60 * 4));
  CK(cudaMemcpy(q, host.data(), elems * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k, host.data(), elems * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v, host.data(), elems * 4, cudaMemcpyHostToDevice));
  Variant vs[] = {
      {"tiny kernel (1 x 32, no smem)", nullptr, 0, 32, 0, false, false},
      {"empty, 120 x 128, no smem", k_empty, 2, 128, 0, false, false},
      {"empty, 120 x 128, 35360 B smem", k_empty, 2, 128, 35360, false, false},
      {"fa_short_f32_2_2 body (120 x 128)", fa_xla_param, 2, 128, 35360, false, false},
      {"same, max shared carveout", fa_xla_carve, 2, 128, 35360, true, false},
      {"same, programmatic dependent launch", fa_xla_pdl, 2, 128, 35360, false, true},
      {"P.V 2 keys per step (fa_xla_u2)", fa_xla_u2, 2, 128, 35360, false, false},
      {"P.V 4 keys per step (fa_xla_u4)", fa_xla_u4, 2, 128, 35360, false, false},
      {"P.V 8 keys per step (fa_xla_u8)", fa_xla_u8, 2, 128, 35360, false, false},
      {"8 warps, 4 rows (60 x 256)", fa_xla_w8, 4, 256, 36928, false, false},
      {"16 warps, 8 rows (32 x 512)", fa_xla_w16, 8, 512, 40064, false, false},
  };
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // The reference output of one call (fa_xla_param) to check every variant's against.
  std::vector<float> ref(elems), got(elems);
  FaArgs* dargs[9];
  for (int r = 1; r <= 8; ++r) {
    FaArgs a = args_for(r);
    CK(cudaMalloc(&dargs[r], sizeof(FaArgs)));
    CK(cudaMemcpy(dargs[r], &a, sizeof(FaArgs), cudaMemcpyHostToDevice));
  }
  auto launch = [&](const Variant& V, const float* in, float* out) {
    const int grid = V.f ? ((60 + V.rows - 1) / V.rows) * 4 : 1;
    if (!V.f) {
      k_tiny<<<1, 32, 0, s>>>(in, out);
      return;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(V.threads);
    cfg.dynamicSmemBytes = V.smem;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = V.pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, V.f, in, (const float*)k, (const float*)v, (const FaArgs*)dargs[V.rows], out, lse));
  };
  for (auto& V : vs) {
    if (V.f && V.smem > 48 * 1024)
      CK(cudaFuncSetAttribute(V.f, cudaFuncAttributeMaxDynamicSharedMemorySize, V.smem));
    if (V.f && V.carveout)
      CK(cudaFuncSetAttribute(V.f, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  }
  if (once) {
    for (auto& V : vs)
      for (int i = 0; i < 10; ++i) launch(V, q, bufs[i % 2]);
    CK(cudaStreamSynchronize(s));
    printf("graph_nodes once: done\n");
    return 0;
  }
  launch(vs[3], q, bufs[0]);
  CK(cudaStreamSynchronize(s));
  CK(cudaMemcpy(ref.data(), bufs[0], elems * 4, cudaMemcpyDeviceToHost));
  for (auto& V : vs) {
    if (!V.f || V.f == k_empty) continue;
    CK(cudaMemset(bufs[0], 0xff, elems * 4));  // NaN
    launch(V, q, bufs[0]);
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(got.data(), bufs[0], elems * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (int i = 0; i < elems; ++i) {
      num += (double)(got[i] - ref[i]) * (got[i] - ref[i]);
      den += (double)ref[i] * ref[i];
    }
    printf("graph_nodes %-40s one call rel_l2 vs fa_short %.2e\n", V.name, std::sqrt(num / den));
  }
  for (int round = 0; round < rounds; ++round) {
    for (auto& V : vs) {
      // Graph: n dependent launches (each reads the previous one's output).
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < n; ++i) launch(V, i == 0 ? q : bufs[(i - 1) % 2], bufs[i % 2]);
      cudaGraph_t g;
      CK(cudaStreamEndCapture(s, &g));
      cudaGraphExec_t ge;
      CK(cudaGraphInstantiate(&ge, g, 0));
      for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(ge, s));
      std::vector<double> per;
      for (int r = 0; r < 30; ++r) {
        CK(cudaEventRecord(e0, s));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        per.push_back(ms * 1e3 / n);
      }
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
      // Back to back on the stream.
      std::vector<double> b2b;
      for (int r = 0; r < 10; ++r) {
        CK(cudaEventRecord(e0, s));
        for (int i = 0; i < n; ++i) launch(V, i == 0 ? q : bufs[(i - 1) % 2], bufs[i % 2]);
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        b2b.push_back(ms * 1e3 / n);
      }
      printf("graph_nodes round %d %-40s graph %.2f us per node, stream back to back %.2f us per launch\n",
             round, V.name, median(per), median(b2b));
    }
  }
  return 0;
}
