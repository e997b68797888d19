// What one attention node costs in a CUDA graph (what XLA's command buffers replay) beside
// kernels that do nothing with the same launch shape: B1 H4 S60 D64 causal f32, 200 dependent
// launches captured into one graph and replayed (per node, median of 30 replays), the same
// launches back to back on a stream, and each variant's output against fa_short's. Kernels from
// gn_kernels.cu (PTX or cubin, loaded with the driver API).
// Build (GPU machine): nvcc -O2 -std=c++17 -o graph_nodes graph_nodes.cpp -lcuda
// Run: ./graph_nodes MODULE [rounds]   or   ./graph_nodes MODULE --once (10 launches each, for ncu)
#include <cuda.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                 \
  do {                                                                        \
    CUresult r_ = (x);                                                        \
    if (r_ != CUDA_SUCCESS) {                                                 \
      const char* m_ = nullptr;                                               \
      cuGetErrorString(r_, &m_);                                              \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, m_ ? m_ : "?"); \
      exit(1);                                                                \
    }                                                                         \
  } while (0)

// kernels/flash_attention.cu's FaArgs.
struct FaArgs {
  int heads, group, sq, sk, d, left, right, tiles, bh;
  float scale_log2;
  long long q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, o_sb, o_ss, o_sh;
  int qk_norm;
};

struct Variant {
  const char* label;
  const char* fn;
  int rows, threads, smem;
  bool carveout, pdl;
  CUfunction f;
};

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: graph_nodes MODULE [rounds | --once]\n");
    return 2;
  }
  const bool once = argc > 2 && !strcmp(argv[2], "--once");
  const int rounds = (argc > 2 && !once) ? atoi(argv[2]) : 3;
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUmodule mod;
  CK(cuModuleLoad(&mod, argv[1]));
  Variant vs[] = {
      {"tiny kernel (1 x 32, no smem)", "k_tiny", 2, 32, 0, false, false, nullptr},
      {"empty, 120 x 128, no smem", "k_empty", 2, 128, 0, false, false, nullptr},
      {"empty, 120 x 128, 35360 B smem", "k_empty", 2, 128, 35360, false, false, nullptr},
      {"fa_short_f32_2_2 body (the module's)", "fa_xla_param", 2, 128, 35360, false, false, nullptr},
      {"same, max shared carveout", "fa_xla_carve", 2, 128, 35360, true, false, nullptr},
      {"same, programmatic dependent launch", "fa_xla_pdl", 2, 128, 35360, false, true, nullptr},
      {"P.V 2 keys/step, no unroll pragma", "fa_xla_u2", 2, 128, 35360, false, false, nullptr},
      {"P.V 4 keys/step", "fa_xla_u4", 2, 128, 35360, false, false, nullptr},
      {"8 warps, 4 rows (60 x 256)", "fa_xla_w8", 4, 256, 36928, false, false, nullptr},
  };
  for (auto& V : vs) {
    CK(cuModuleGetFunction(&V.f, mod, V.fn));
    if (V.carveout)
      CK(cuFuncSetAttribute(V.f, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100));
  }
  const int n = 200, elems = 60 * 4 * 64;
  std::vector<float> host(elems);
  srand(11);
  for (auto& x : host) x = (float)rand() / RAND_MAX * 4.0f - 2.0f;
  CUdeviceptr q, k, v, bufs[2], lse, dargs[9];
  for (CUdeviceptr* p : {&q, &k, &v, &bufs[0], &bufs[1]}) CK(cuMemAlloc(p, elems * 4));
  CK(cuMemAlloc(&lse, 4 * 60 * 4));
  CK(cuMemcpyHtoD(q, host.data(), elems * 4));
  for (auto& x : host) x = (float)rand() / RAND_MAX * 4.0f - 2.0f;
  CK(cuMemcpyHtoD(k, host.data(), elems * 4));
  for (auto& x : host) x = (float)rand() / RAND_MAX * 4.0f - 2.0f;
  CK(cuMemcpyHtoD(v, host.data(), elems * 4));
  for (int r = 1; r <= 8; ++r) {
    const int tiles = (60 + r - 1) / r;
    FaArgs a = {4, 1, 60, 60, 64, -1, 0, tiles, 4, 0.125f * 1.4426950408889634f,
                15360, 256, 64, 15360, 256, 64, 15360, 256, 64, 0};
    CK(cuMemAlloc(&dargs[r], sizeof(FaArgs)));
    CK(cuMemcpyHtoD(dargs[r], &a, sizeof(FaArgs)));
  }
  CUstream s;
  CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUevent e0, e1;
  CK(cuEventCreate(&e0, CU_EVENT_DEFAULT));
  CK(cuEventCreate(&e1, CU_EVENT_DEFAULT));
  auto launch = [&](const Variant& V, CUdeviceptr in, CUdeviceptr out) {
    const bool tiny = !strcmp(V.fn, "k_tiny");
    CUlaunchConfig cfg = {};
    cfg.gridDimX = tiny ? 1 : ((60 + V.rows - 1) / V.rows) * 4;
    cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = V.threads;
    cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.sharedMemBytes = V.smem;
    cfg.hStream = s;
    CUlaunchAttribute at[1];
    at[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    at[0].value.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = V.pdl ? 1 : 0;
    void* params[] = {&in, &k, &v, &dargs[V.rows], &out, &lse};
    CK(cuLaunchKernelEx(&cfg, V.f, params, nullptr));
  };
  if (once) {
    for (auto& V : vs)
      for (int i = 0; i < 10; ++i) launch(V, i == 0 ? q : bufs[(i - 1) % 2], bufs[i % 2]);
    CK(cuStreamSynchronize(s));
    printf("graph_nodes once: done\n");
    return 0;
  }
  std::vector<float> ref(elems), got(elems);
  launch(vs[3], q, bufs[0]);
  CK(cuStreamSynchronize(s));
  CK(cuMemcpyDtoH(ref.data(), bufs[0], elems * 4));
  for (auto& V : vs) {
    if (!strcmp(V.fn, "k_tiny") || !strcmp(V.fn, "k_empty")) continue;
    CK(cuMemsetD8(bufs[0], 0xff, elems * 4));  // NaN
    launch(V, q, bufs[0]);
    CK(cuStreamSynchronize(s));
    CK(cuMemcpyDtoH(got.data(), bufs[0], elems * 4));
    double num = 0, den = 0;
    for (int i = 0; i < elems; ++i) {
      num += (double)(got[i] - ref[i]) * (got[i] - ref[i]);
      den += (double)ref[i] * ref[i];
    }
    printf("graph_nodes %-42s one call, rel_l2 vs fa_short %.2e\n", V.label, std::sqrt(num / den));
  }
  for (int round = 0; round < rounds; ++round) {
    for (auto& V : vs) {
      CK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
      for (int i = 0; i < n; ++i) launch(V, i == 0 ? q : bufs[(i - 1) % 2], bufs[i % 2]);
      CUgraph g;
      CK(cuStreamEndCapture(s, &g));
      CUgraphExec ge;
      CK(cuGraphInstantiate(&ge, g, 0));
      for (int w = 0; w < 3; ++w) CK(cuGraphLaunch(ge, s));
      std::vector<double> per, b2b;
      for (int r = 0; r < 30; ++r) {
        CK(cuEventRecord(e0, s));
        CK(cuGraphLaunch(ge, s));
        CK(cuEventRecord(e1, s));
        CK(cuEventSynchronize(e1));
        float ms;
        CK(cuEventElapsedTime(&ms, e0, e1));
        per.push_back(ms * 1e3 / n);
      }
      CK(cuGraphExecDestroy(ge));
      CK(cuGraphDestroy(g));
      for (int r = 0; r < 10; ++r) {
        CK(cuEventRecord(e0, s));
        for (int i = 0; i < n; ++i) launch(V, i == 0 ? q : bufs[(i - 1) % 2], bufs[i % 2]);
        CK(cuEventRecord(e1, s));
        CK(cuEventSynchronize(e1));
        float ms;
        CK(cuEventElapsedTime(&ms, e0, e1));
        b2b.push_back(ms * 1e3 / n);
      }
      printf("graph_nodes round %d %-42s graph %.2f us per node, stream back to back %.2f us per launch\n",
             round, V.label, median(per), median(b2b));
    }
  }
  return 0;
}
