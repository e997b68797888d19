// Streaming state on the device: a window of the last W rows per batch element.
// stream_shift_append: out[b, t] = cache[b, t + 1] for t < W - 1, out[b, W - 1] = row[b]
// (a row is `width` elements); the oldest row drops out, the newest comes in. Elements are
// moved as raw 4- or 2-byte words, so one kernel serves every type of that size.

#include "types.cuh"
template <typename W>
__device__ __forceinline__ void fk_shift_append(const W* cache, const W* row, W* out, int batch,
                                                int window, int width) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long per = (long long)window * width;
  if (i >= batch * per) return;
  const long long b = i / per;
  const long long r = i - b * per;
  const int t = (int)(r / width);
  const int c = (int)(r - (long long)t * width);
  out[i] = t + 1 < window ? cache[i + width] : row[b * width + c];
}

// The instances (kernels.rs STREAM_STATE): by word size (w4: 4 bytes, w2: 2 bytes).
#define FK_SHIFT_W_w4 unsigned int
#define FK_SHIFT_W_w2 unsigned short
#define FK_SHIFT_APPEND(FN, WN)                                                                \
  extern "C" __global__ void __launch_bounds__(256)                                            \
      FN(const FK_SHIFT_W_##WN* cache, const FK_SHIFT_W_##WN* row, FK_SHIFT_W_##WN* out,       \
         int batch, int window, int width) {                                                   \
    if constexpr (FK_WANT(FN)) {                                                               \
      fk_shift_append<FK_SHIFT_W_##WN>(cache, row, out, batch, window, width);                 \
    }                                                                                          \
  }
