// The LSTM and GRU cell updates of Axon, shared by every RNN kernel. Arguments are the gates'
// pre-activations (x·Wi + b + h·Wh, summed by the caller in its own order); A is the
// activation numerics (act.cuh).
#pragma once
#include "act.cuh"

// LSTM, gates i, f, g, o: c = f·c + i·g, returns h = o·tanh(c).
template <class A>
__device__ __forceinline__ float fk_lstm_cell(float i, float f, float g, float o, float& c) {
  const float ig = A::sigmoid(i), fg = A::sigmoid(f), gg = A::tanh(g), og = A::sigmoid(o);
  c = fmaf(fg, c, ig * gg);
  return og * A::tanh(c);
}

// GRU, Axon's form: r = σ(r_pre), z = σ(z_pre), n = tanh(xn + r·hn), h = (1 - z)·n + z·h_prev,
// where xn = x·Win + b_in and hn = h·Whn + b_hn.
template <class A>
__device__ __forceinline__ float fk_gru_cell(float r_pre, float z_pre, float xn, float hn,
                                             float h_prev) {
  const float r = A::sigmoid(r_pre), z = A::sigmoid(z_pre);
  const float n = A::tanh(fmaf(r, hn, xn));
  return fmaf(1.0f - z, n, z * h_prev);
}
