// Global -> shared copies and uncached loads. cp.async needs sm_80; before that the same calls
// copy synchronously, so a kernel written as a cp.async pipeline stays correct there (its
// barriers already order the copies before their use).
#pragma once
#include "arch.cuh"

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
__device__ __forceinline__ float4 fk_ldcg_f4(const float* p) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p));
  return v;
}
// A counter other blocks publish to: the acquire load sees every write a block made before
// its release add (red.release) that the load observes.
__device__ __forceinline__ unsigned fk_ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fk_red_release_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// A flag set after this thread's writes (and those a barrier ordered before them).
__device__ __forceinline__ void fk_st_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// A counter added to and read back at once (release: this thread's writes go before it;
// acquire: the thread that completes a count sees every write released before it). The old
// value.
__device__ __forceinline__ unsigned fk_atom_add_acq_rel(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}
// The same at system scope: words in page-locked host memory mapped into the device, which the
// host reads and writes while a kernel runs.
__device__ __forceinline__ unsigned fk_ld_acquire_sys(const volatile unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void fk_st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

#if FK_ARCH >= 800
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
  *reinterpret_cast<uint4*>(dst) =
      valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
}
__device__ __forceinline__ void fk_cp4(void* dst, const void* src) {
  *reinterpret_cast<unsigned*>(dst) = *reinterpret_cast<const unsigned*>(src);
}
__device__ __forceinline__ void fk_cp_commit() {}
template <int N> __device__ __forceinline__ void fk_cp_wait() {}
#endif
