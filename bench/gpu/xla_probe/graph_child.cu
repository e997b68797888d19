// Per-node cost of a kernel node vs the same kernel inside a child-graph node (what XLA's
// command buffers make of a traced custom call), CUDA driver/runtime only.
#include <cstdio>
#include <cuda_runtime.h>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); return 1; } } while (0)
__global__ void tiny(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = x[i] * 0.999f + 1.0f; }
static float time_graph(cudaGraphExec_t ge, cudaStream_t s, int reps, int nodes) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 5; i++) cudaGraphLaunch(ge, s);
  cudaStreamSynchronize(s);
  std::vector<float> t;
  for (int r = 0; r < reps; r++) {
    cudaEventRecord(a, s); cudaGraphLaunch(ge, s); cudaEventRecord(b, s); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); t.push_back(ms * 1000.f / nodes);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
int main() {
  const int N = 200, blocks = 120, threads = 128, n = blocks * threads;
  float* x; CK(cudaMalloc(&x, n * sizeof(float))); CK(cudaMemset(x, 0, n * sizeof(float)));
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // A: 200 kernel nodes (stream capture).
  cudaGraph_t ga; CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < N; i++) tiny<<<blocks, threads, 0, s>>>(x, n);
  CK(cudaStreamEndCapture(s, &ga));
  cudaGraphExec_t ea; CK(cudaGraphInstantiate(&ea, ga, 0));
  // B: 200 child-graph nodes in a chain, each a captured graph of one launch.
  cudaGraph_t gb; CK(cudaGraphCreate(&gb, 0));
  cudaGraphNode_t prev = nullptr;
  for (int i = 0; i < N; i++) {
    cudaGraph_t child; CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    tiny<<<blocks, threads, 0, s>>>(x, n);
    CK(cudaStreamEndCapture(s, &child));
    cudaGraphNode_t node;
    CK(cudaGraphAddChildGraphNode(&node, gb, prev ? &prev : nullptr, prev ? 1 : 0, child));
    prev = node; cudaGraphDestroy(child);
  }
  cudaGraphExec_t eb; CK(cudaGraphInstantiate(&eb, gb, 0));
  // C: 200 empty child graphs (a handler that launches nothing).
  cudaGraph_t gc; CK(cudaGraphCreate(&gc, 0)); prev = nullptr;
  for (int i = 0; i < N; i++) {
    cudaGraph_t child; CK(cudaGraphCreate(&child, 0));
    cudaGraphNode_t node;
    CK(cudaGraphAddChildGraphNode(&node, gc, prev ? &prev : nullptr, prev ? 1 : 0, child));
    prev = node; cudaGraphDestroy(child);
  }
  cudaGraphExec_t ec; CK(cudaGraphInstantiate(&ec, gc, 0));
  // D: alternate kernel node / empty node (XLA may put barrier nodes between commands).
  cudaGraph_t gd; CK(cudaGraphCreate(&gd, 0)); prev = nullptr;
  for (int i = 0; i < N; i++) {
    cudaGraph_t child; CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    tiny<<<blocks, threads, 0, s>>>(x, n);
    CK(cudaStreamEndCapture(s, &child));
    cudaGraphNode_t node, en;
    CK(cudaGraphAddChildGraphNode(&node, gd, prev ? &prev : nullptr, prev ? 1 : 0, child));
    CK(cudaGraphAddEmptyNode(&en, gd, &node, 1));
    prev = en; cudaGraphDestroy(child);
  }
  cudaGraphExec_t ed; CK(cudaGraphInstantiate(&ed, gd, 0));
  for (int round = 0; round < 3; round++) {
    printf("graph_child round %d: per node (median of 50 graph launches of %d nodes): kernel nodes %.2f us, "
           "child graphs of one kernel %.2f us, empty child graphs %.2f us, child + empty node %.2f us\n",
           round, N, time_graph(ea, s, 50, N), time_graph(eb, s, 50, N), time_graph(ec, s, 50, N), time_graph(ed, s, 50, N));
  }
  CK(cudaStreamSynchronize(s));
  return 0;
}
