// Element types and conversions, shared by every kernel. NVRTC ships no toolkit headers, so
// 16-bit types are plain bit patterns converted with PTX `cvt` (f16) or bit operations (bf16).
#pragma once
#include "arch.cuh"

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

// A 16-bit element from the low half of a word, and the two halves of a word (lo, hi) as floats.
template <typename T> __device__ __forceinline__ T fk_bits(unsigned v) {
  T r;
  r.bits = (unsigned short)(v & 0xffffu);
  return r;
}
template <typename T> __device__ __forceinline__ float2 fk_unpack2(unsigned u) {
  return make_float2(fk_to_f32(fk_bits<T>(u)), fk_to_f32(fk_bits<T>(u >> 16)));
}
#if FK_ARCH >= 800
// Two floats to a packed pair (lo, hi), rounded to nearest even by one cvt (NaN stays NaN).
template <typename T> __device__ __forceinline__ unsigned fk_pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned fk_pack2<fk_bf16>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ unsigned fk_pack2<fk_f16>(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif

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
