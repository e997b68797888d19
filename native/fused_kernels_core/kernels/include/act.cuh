// Activations, in two numerics: FkExact (expf, tanhf, true division: the default of every
// kernel) and FkFast (ex2 + approximate reciprocal on the special-function unit, tanh as
// 2·sigmoid(2x) - 1: a few ulp, in a short dependent chain), which the kernels that use it were
// checked with against the f64 references (rnn_cluster's cells, rel. L2 <= 1e-5 in f32 over
// whole sequences; dense_sm90's exponentials). Each kernel keeps the numerics it was
// validated with.
#pragma once

// 2^x on the special-function unit (PTX ex2.approx, flush-to-zero), for exponentials whose
// argument the caller has already scaled by log2(e) (FK_LOG2E).
#define FK_LOG2E 1.4426950408889634f
__device__ __forceinline__ float fk_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

struct FkExact {
  static __device__ __forceinline__ float exp(float x) { return expf(x); }
  static __device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
  static __device__ __forceinline__ float tanh(float x) { return tanhf(x); }
};
struct FkFast {
  static __device__ __forceinline__ float exp(float x) { return __expf(x); }
  // e^-x as one flush-to-zero ex2: the same value as __expf(-x) wherever 1 + e^-x can tell
  // (a flushed denormal leaves 1 + e^-x at 1 either way), and one instruction where __expf's
  // non-flushing ex2 takes range fix-ups that cannot absorb the rounded product of an exact
  // build (kernels::Build::exact: 60 more FMULs in rnn_cluster_lstm_f32's SASS).
  static __device__ __forceinline__ float sigmoid(float x) {
    return __fdividef(1.0f, 1.0f + fk_ex2(x * -FK_LOG2E));
  }
  static __device__ __forceinline__ float tanh(float x) {
    return fmaf(2.0f, sigmoid(2.0f * x), -1.0f);
  }
};

__device__ __forceinline__ float fk_sigmoid(float x) { return FkExact::sigmoid(x); }

// silu(x) = x · sigmoid(x), written as x / (1 + e^-x); E picks the exponential.
template <class E> __device__ __forceinline__ float fk_silu(float x) {
  return x / (1.0f + E::exp(-x));
}
// mamba_ssm's softplus (dt's): log1p(e^x) up to 20, x itself above (where they agree in f32).
__device__ __forceinline__ float fk_softplus(float x) { return x <= 20.0f ? log1pf(expf(x)) : x; }

// The activation codes of ops/dense/common.rs: 0 identity, 1 relu, 2 gelu (erf), 3 gelu (tanh
// approximation), 4 silu, 5 sigmoid, 6 tanh. E picks the exponential (silu, sigmoid).
template <class E> __device__ __forceinline__ float fk_act(float v, int act) {
  switch (act) {
    case 1: return v > 0.0f ? v : (v == v ? 0.0f : v);  // relu; NaN stays NaN
    case 2: return 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
    case 3: {
      const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
      return 0.5f * v * (1.0f + tanhf(u));
    }
    case 4: return fk_silu<E>(v);
    case 5: return 1.0f / (1.0f + E::exp(-v));
    case 6: return tanhf(v);
    default: return v;
  }
}
// SwiGLU's gate: silu(g) · u.
template <class E> __device__ __forceinline__ float fk_swiglu(float g, float u) {
  return fk_silu<E>(g) * u;
}

// 1 / x for a normal, finite x (a softmax sum, >= 1): the approximate reciprocal refined by one
// Newton step (within an ulp of 1.0f / x). 1.0f / x itself carries a called slow path for
// denormals whose register saves ptxas reports as spills in register-held rows (sm_75, sm_100).
__device__ __forceinline__ float fk_rcp_normal(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return fmaf(fmaf(-x, r, 1.0f), r, r);
}
