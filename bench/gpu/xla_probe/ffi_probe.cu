// Control handlers for the XLA command-buffer probe: what any FFI custom call costs inside
// XLA's CUDA graphs, independent of fused_kernels. Built on the GPU machine against the XLA FFI
// headers jaxlib ships (jax.ffi.include_dir()).
#include <cuda_runtime.h>
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

extern "C" __global__ void probe_tiny(const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * 0.999f + 1.0f;
}

static ffi::Error TinyImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  int n = static_cast<int>(x.element_count());
  probe_tiny<<<(n + 127) / 128, 128, 0, stream>>>(x.typed_data(), y->typed_data(), n);
  return ffi::Error::Success();
}
static ffi::Error NopImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeTiny, TinyImpl,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>(),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeNop, NopImpl,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>(),
    {ffi::Traits::kCmdBufferCompatible});
