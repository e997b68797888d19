// Shared by every kernel: prepended to each .cu source by the runtime (NVRTC ships no
// toolkit headers, so nothing here may #include). 16-bit types are plain bit patterns
// converted with PTX `cvt` (f16) or bit operations (bf16).

#define FK_NEG_INF (__int_as_float(0xff800000))

struct fk_f16 { unsigned short bits; };
struct fk_bf16 { unsigned short bits; };

__device__ __forceinline__ float fk_to_f32(float v) { return v; }
__device__ __forceinline__ float fk_to_f32(fk_f16 v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float fk_to_f32(fk_bf16 v) {
  return __uint_as_float(((unsigned)v.bits) << 16);
}

template <typename T> __device__ __forceinline__ T fk_from_f32(float f);
template <> __device__ __forceinline__ float fk_from_f32<float>(float f) { return f; }
template <> __device__ __forceinline__ fk_f16 fk_from_f32<fk_f16>(float f) {
  fk_f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
  return r;
}
template <> __device__ __forceinline__ fk_bf16 fk_from_f32<fk_bf16>(float f) {
  // Round to nearest even; keep NaN a (quiet) NaN instead of rounding it to infinity.
  unsigned u = __float_as_uint(f);
  fk_bf16 r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = (unsigned short)((u >> 16) | 0x40u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (unsigned short)(u >> 16);
  }
  return r;
}

// Element i of a T array as float, and a float stored into one.
template <typename T> __device__ __forceinline__ float fk_ld(const void* p, size_t i) {
  return fk_to_f32(reinterpret_cast<const T*>(p)[i]);
}
template <typename T> __device__ __forceinline__ void fk_st(void* p, size_t i, float v) {
  reinterpret_cast<T*>(p)[i] = fk_from_f32<T>(v);
}
// A run-time index into a kernel-parameter array may go through local memory; select instead.
__device__ __forceinline__ const void* fk_pick(const void* const* p, int g) {
  return g == 0 ? p[0] : g == 1 ? p[1] : g == 2 ? p[2] : p[3];
}
__device__ __forceinline__ float fk_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float fk_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float fk_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide reductions over all threads of the block; `scratch` holds one float per warp.
// Every thread gets the result.
__device__ __forceinline__ float fk_block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = fk_warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : FK_NEG_INF;
  return fk_warp_max(v);
}
__device__ __forceinline__ float fk_block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = fk_warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return fk_warp_sum(v);
}

// Asynchronous global -> shared copies (cp.async, sm_80+). Before sm_80 the same calls copy
// synchronously, so a kernel written as a cp.async pipeline stays correct there (its barriers
// already order the copies before their use).
__device__ __forceinline__ unsigned fk_smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
// Raw loads through L2 only: data other blocks or clusters wrote during this launch (L1 is not
// coherent with them).
__device__ __forceinline__ unsigned fk_ldcg32(const void* p) {
  unsigned v;
  asm volatile("ld.global.cg.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned short fk_ldcg16(const void* p) {
  unsigned short v;
  asm volatile("ld.global.cg.b16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
// 16 bytes to shared address `dst` (as fk_smem_addr gives it) of which the first `bytes` are
// read and the rest zero-filled (0: no read).
__device__ __forceinline__ void fk_cp16_to(unsigned dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(bytes));
}
__device__ __forceinline__ void fk_cp16_bytes(void* dst, const void* src, int bytes) {
  fk_cp16_to(fk_smem_addr(dst), src, bytes);
}
// 16 bytes, zero-filled when !valid.
__device__ __forceinline__ void fk_cp16(void* dst, const void* src, bool valid) {
  fk_cp16_bytes(dst, src, valid ? 16 : 0);
}
// 4 bytes (for rows that are not 16-byte aligned).
__device__ __forceinline__ void fk_cp4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(fk_smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void fk_cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void fk_cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
// c += a·b on one m16n8k16 tile: bf16 or f16 operands (a: 4 registers, b: 2), f32 accumulators.
template <typename T>
__device__ __forceinline__ void fk_mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void fk_mma16816<fk_bf16>(float* c, const unsigned* a, unsigned b0,
                                                     unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void fk_mma16816<fk_f16>(float* c, const unsigned* a, unsigned b0,
                                                    unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Four 8x8 b16 matrices from shared memory into mma.sync fragments (plain and transposed).
__device__ __forceinline__ void fk_ldmatrix_x4(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(fk_smem_addr(p)));
}
__device__ __forceinline__ void fk_ldmatrix_x4_trans(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(fk_smem_addr(p)));
}
// A float rounded to tf32, and c += a·b on one m16n8k8 tf32 tile (a: 4 registers, b: 2).
__device__ __forceinline__ unsigned fk_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void fk_mma1688_tf32(float (&c)[4], const unsigned (&a)[4],
                                                unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 3xTF32 on one tile: c += a·b with a = ahi + alo and b = bhi + blo split into tf32 parts,
// the small cross terms first (alo·bhi, ahi·blo, then ahi·bhi); alo·blo is below f32 rounding.
__device__ __forceinline__ void fk_mma1688_3xtf32(float (&c)[4], const unsigned (&ahi)[4],
                                                  const unsigned (&alo)[4], unsigned bh0,
                                                  unsigned bh1, unsigned bl0, unsigned bl1) {
  fk_mma1688_tf32(c, alo, bh0, bh1);
  fk_mma1688_tf32(c, ahi, bl0, bl1);
  fk_mma1688_tf32(c, ahi, bh0, bh1);
}
#else
__device__ __forceinline__ void fk_cp16_bytes(void* dst, const void* src, int bytes) {
  unsigned char* d = reinterpret_cast<unsigned char*>(dst);
  const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
  for (int i = 0; i < 16; ++i) d[i] = i < bytes ? s[i] : 0;
}
__device__ __forceinline__ void fk_cp16_to(unsigned dst, const void* src, int bytes) {
  unsigned long long p;
  asm("cvta.shared.u64 %0, %1;" : "=l"(p) : "l"((unsigned long long)dst));
  fk_cp16_bytes(reinterpret_cast<void*>(p), src, bytes);
}
__device__ __forceinline__ void fk_cp16(void* dst, const void* src, bool valid) {
  *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
}
__device__ __forceinline__ void fk_cp4(void* dst, const void* src) {
  *reinterpret_cast<unsigned*>(dst) = *reinterpret_cast<const unsigned*>(src);
}
__device__ __forceinline__ void fk_cp_commit() {}
template <int N> __device__ __forceinline__ void fk_cp_wait() {}
#endif
