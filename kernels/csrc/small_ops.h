// Raw-pointer cores of the small CPU ops (small_ops.cpp binds them to tensors; decode_layer.cpp chains them into
// one decoder layer). Contracts are with the tensor functions in small_ops.cpp.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace kvrelay_cpu {

constexpr int kLanes = 16;
constexpr int kTile = 16;  // rows of x per pass over a group's blocks: sixteen sums in registers

#if defined(__AVX512BF16__)
template <int TT>
inline void group_dot(const uint32_t* __restrict w, int64_t k2, const uint32_t* __restrict x, int64_t xs,
                      float* __restrict s) {
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k2; ++j) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * kLanes);
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_dpbf16_ps(acc[t], wv, (__m512bh)_mm512_set1_epi32(x[t * xs + j]));
  }
  for (int t = 0; t < TT; ++t) _mm512_storeu_ps(s + t * kLanes, acc[t]);
}
#else
inline float bf16_bits_to_float(uint32_t v) {
  const uint32_t u = v << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <int TT>
inline void group_dot(const uint32_t* __restrict w, int64_t k2, const uint32_t* __restrict x, int64_t xs,
                      float* __restrict s) {
  float acc[TT][kLanes] = {};
  for (int64_t j = 0; j < k2; ++j) {
    const uint32_t* wj = w + j * kLanes;
    for (int t = 0; t < TT; ++t) {
      const float x0 = bf16_bits_to_float(x[t * xs + j] & 0xffffu), x1 = bf16_bits_to_float(x[t * xs + j] >> 16);
#pragma omp simd
      for (int l = 0; l < kLanes; ++l)
        acc[t][l] += bf16_bits_to_float(wj[l] & 0xffffu) * x0 + bf16_bits_to_float(wj[l] >> 16) * x1;
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int l = 0; l < kLanes; ++l) s[t * kLanes + l] = acc[t][l];
}
#endif


// group_dot<tt> for a run-time tt in 1 .. TT.
template <int TT>
inline void group_dot_up_to(int64_t tt, const uint32_t* w, int64_t k2, const uint32_t* x, int64_t xs, float* s) {
  if constexpr (TT == 1) {
    group_dot<1>(w, k2, x, xs, s);
  } else {
    if (tt == TT) group_dot<TT>(w, k2, x, xs, s);
    else group_dot_up_to<TT - 1>(tt, w, k2, x, xs, s);
  }
}

// y[t, :out] = x[t] W^T + b for the blocked W (see small_ops.cpp: blocked_linear), x [T, in] bf16 contiguous,
// k2 = ceil(in / 2). x's rows are read as pairs of bf16 (one 32-bit word each); with an odd `in` they are copied
// first, each with a zero after it.
inline void blocked_rows(const at::BFloat16* x, int64_t t_rows, int64_t in, int64_t k2, const uint32_t* wp,
                         int64_t groups, const at::BFloat16* b, int64_t out, at::BFloat16* yp) {
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  std::vector<uint32_t> padded;
  if (in % 2 != 0) {
    padded.assign(static_cast<size_t>(t_rows * k2), 0u);
    for (int64_t t = 0; t < t_rows; ++t)
      std::memcpy(padded.data() + t * k2, x + t * in, static_cast<size_t>(in) * sizeof(at::BFloat16));
    xp = padded.data();
  }
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float s[kTile * kLanes];
    for (int64_t g = begin; g < end; ++g) {
      const uint32_t* wg = wp + g * k2 * kLanes;
      const int64_t o = g * kLanes, n = std::min<int64_t>(kLanes, out - o);
      for (int64_t t = 0; t < t_rows; t += kTile) {
        const int64_t tt = std::min<int64_t>(kTile, t_rows - t);
        const uint32_t* xt = xp + t * k2;
        group_dot_up_to<kTile>(tt, wg, k2, xt, k2, s);
        for (int64_t u = 0; u < tt; ++u)
          for (int64_t k = 0; k < n; ++k)
            yp[(t + u) * out + o + k] = at::BFloat16(s[u * kLanes + k] + (b ? static_cast<float>(b[o + k]) : 0.f));
      }
    }
  });
}

template <typename T>
inline void rms_norm_rows(const T* xp, const T* wp, T* yp, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(static_cast<size_t>(h));
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * h;
      T* yr = yp + r * h;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) {
        xf[i] = static_cast<float>(xr[i]);
        ss += xf[i] * xf[i];
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
      for (int64_t i = 0; i < h; ++i)
        yr[i] = static_cast<T>(static_cast<float>(static_cast<T>(xf[i] * inv)) * static_cast<float>(wp[i]));
    }
  });
}


// Products rounded apart from the sum (no FMA contraction under -ffast-math): float32 then equals torch's ops.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotary_head(const T* x, const T* c, const T* s, T* y,
                                                             int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float rot = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    const T a = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
    const T b = static_cast<T>(rot * static_cast<float>(s[i]));
    y[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
  }
}

template <typename T>
inline void rotary_rows(const T* xp, int64_t xs0, int64_t xs1, const T* cp, const T* sp, T* yp, int64_t t_rows,
                 int64_t heads, int64_t d) {
  at::parallel_for(0, t_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h) rotary_head(xp + t * xs0 + h * xs1, cp + t * d, sp + t * d,
                                                      yp + (t * heads + h) * d, d);
  });
}

// silu(g) * u per element, g and u the two halves of each row (a fused [gate; up] matmul's output); bf16 rounds
// silu's result to bf16 before the product, as torch's two ops do.
template <typename T>
inline void silu_mul_rows(const T* xp, int64_t xs0, T* yp, int64_t t_rows, int64_t inter) {
  at::parallel_for(0, t_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = xp + t * xs0;
      const T* u = g + inter;
      T* y = yp + t * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float gf = static_cast<float>(g[i]);
        const T act = static_cast<T>(gf / (1.0f + std::exp(-gf)));
        y[i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(u[i]));
      }
    }
  });
}



}  // namespace kvrelay_cpu
