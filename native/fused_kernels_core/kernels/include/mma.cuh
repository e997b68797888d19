// Tensor-core tiles (mma.sync) and their shared-memory fragment loads. sm_75 has ldmatrix and
// m16n8k8 for f16 only: there the f16 m16n8k16 tile is two k8 tiles (exact), and bf16 and tf32
// tiles are computed from the same register fragments with warp shuffles and f32 FMAs (correct,
// not fast: what a pre-sm_80 build of a tensor-core kernel falls back to).
#pragma once
#include "copy.cuh"
#include "types.cuh"

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

// A float rounded to tf32 (the bit pattern of a float whose low 13 mantissa bits are zero).
__device__ __forceinline__ unsigned fk_tf32(float x) {
#if FK_ARCH >= 800
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
#else
  // Round to nearest, ties away from zero, like cvt.rna (finite values; Inf/NaN kept).
  const unsigned u = __float_as_uint(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return u;
  return (u + 0x1000u) & 0xffffe000u;
#endif
}

#if FK_ARCH < 800
// c += a·b on one m16n8 tile from mma.sync register fragments, without tensor cores. Both
// fragment layouts used here (m16n8k16 16-bit pairs, KP = 2; m16n8k8 tf32, KP = 1) hold, in
// lane (g = lane / 4, t = lane % 4): a[0] row g, a[1] row g + 8 (k block 0), a[2] row g,
// a[3] row g + 8 (k block 1); b0 and b1 column g of k blocks 0 and 1, each register holding KP
// consecutive k. Lane (g, t) owns c rows g, g + 8 and columns 2t, 2t + 1.
template <int KP, class Unpack>
__device__ __forceinline__ void fk_mma_emulated(float* c, const unsigned* a, unsigned b0,
                                                unsigned b1, Unpack unpack) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int tt = 0; tt < 4; ++tt) {
    const int la = (g << 2) | tt, lb0 = ((2 * t) << 2) | tt, lb1 = ((2 * t + 1) << 2) | tt;
    unsigned ar[4], bc0[2], bc1[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) ar[i] = __shfl_sync(0xffffffffu, a[i], la);
    bc0[0] = __shfl_sync(0xffffffffu, b0, lb0);
    bc0[1] = __shfl_sync(0xffffffffu, b1, lb0);
    bc1[0] = __shfl_sync(0xffffffffu, b0, lb1);
    bc1[1] = __shfl_sync(0xffffffffu, b1, lb1);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < KP; ++e) {
        const float r0 = unpack(ar[2 * h], e), r8 = unpack(ar[2 * h + 1], e);
        const float n0 = unpack(bc0[h], e), n1 = unpack(bc1[h], e);
        c[0] = fmaf(r0, n0, c[0]);
        c[1] = fmaf(r0, n1, c[1]);
        c[2] = fmaf(r8, n0, c[2]);
        c[3] = fmaf(r8, n1, c[3]);
      }
  }
}
#endif

// c += a·b on one m16n8k16 tile: bf16 or f16 operands (a: 4 registers, b: 2), f32 accumulators.
template <typename T>
__device__ __forceinline__ void fk_mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void fk_mma16816<fk_bf16>(float* c, const unsigned* a, unsigned b0,
                                                     unsigned b1) {
#if FK_ARCH >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  fk_mma_emulated<2>(c, a, b0, b1, [](unsigned r, int e) {
    return __uint_as_float(e ? (r & 0xffff0000u) : (r << 16));
  });
#endif
}
template <>
__device__ __forceinline__ void fk_mma16816<fk_f16>(float* c, const unsigned* a, unsigned b0,
                                                    unsigned b1) {
#if FK_ARCH >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  // sm_75: m16n8k16 is the sum of two m16n8k8 tiles (k 0-7: a[0], a[1], b0; k 8-15: a[2],
  // a[3], b1).
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(b0));
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[2]), "r"(a[3]), "r"(b1));
#endif
}

// c += a·b on one m16n8k8 tf32 tile (a: 4 registers, b: 2).
__device__ __forceinline__ void fk_mma1688_tf32(float (&c)[4], const unsigned (&a)[4],
                                                unsigned b0, unsigned b1) {
#if FK_ARCH >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  fk_mma_emulated<1>(c, a, b0, b1, [](unsigned r, int) { return __uint_as_float(r); });
#endif
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
