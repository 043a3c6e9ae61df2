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

#if defined(__AVX512F__) || defined(__AVX2__)
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

// The float32 blocked layout: [G, in, 16, 1], sixteen output rows per input, a group's inputs in order (one
// 64-byte line each). y[t, :out] = x[t] W^T + b for x [T, in] float32 contiguous, each output summed in input order
// with fused multiply-adds.
constexpr int kTileF32 = 4;  // rows of x per pass over a group: 4 x 16 sums fill 8 of AVX2's 16 registers

template <int TT>
inline void group_dot_f32(const float* __restrict w, int64_t in, const float* __restrict x, int64_t xs,
                          float* __restrict s) {
#if defined(__AVX512F__)
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; ++i) {
    const __m512 wv = _mm512_loadu_ps(w + i * kLanes);
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[t * xs + i]), acc[t]);
  }
  for (int t = 0; t < TT; ++t) _mm512_storeu_ps(s + t * kLanes, acc[t]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 lo[TT], hi[TT];
  for (int t = 0; t < TT; ++t) lo[t] = hi[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in; ++i) {
    const __m256 wl = _mm256_loadu_ps(w + i * kLanes), wh = _mm256_loadu_ps(w + i * kLanes + 8);
    for (int t = 0; t < TT; ++t) {
      const __m256 xv = _mm256_set1_ps(x[t * xs + i]);
      lo[t] = _mm256_fmadd_ps(wl, xv, lo[t]);
      hi[t] = _mm256_fmadd_ps(wh, xv, hi[t]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    _mm256_storeu_ps(s + t * kLanes, lo[t]);
    _mm256_storeu_ps(s + t * kLanes + 8, hi[t]);
  }
#else
  float acc[TT][kLanes] = {};
  for (int64_t i = 0; i < in; ++i)
    for (int t = 0; t < TT; ++t) {
      const float xv = x[t * xs + i];
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) acc[t][l] = std::fma(w[i * kLanes + l], xv, acc[t][l]);
    }
  for (int t = 0; t < TT; ++t)
    for (int l = 0; l < kLanes; ++l) s[t * kLanes + l] = acc[t][l];
#endif
}

template <int TT>
inline void group_dot_f32_up_to(int64_t tt, const float* w, int64_t in, const float* x, int64_t xs, float* s) {
  if constexpr (TT == 1) {
    group_dot_f32<1>(w, in, x, xs, s);
  } else {
    if (tt == TT) group_dot_f32<TT>(w, in, x, xs, s);
    else group_dot_f32_up_to<TT - 1>(tt, w, in, x, xs, s);
  }
}

inline void blocked_rows(const float* xp, int64_t t_rows, int64_t in, int64_t k, const uint32_t* wbits,
                         int64_t groups, const float* b, int64_t out, float* yp) {
  const float* wp = reinterpret_cast<const float*>(wbits);
  (void)k;  // == in: one float32 per lane and input
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float s[kTileF32 * kLanes];
    for (int64_t g = begin; g < end; ++g) {
      const float* wg = wp + g * in * kLanes;
      const int64_t o = g * kLanes, n = std::min<int64_t>(kLanes, out - o);
      for (int64_t t = 0; t < t_rows; t += kTileF32) {
        const int64_t tt = std::min<int64_t>(kTileF32, t_rows - t);
        group_dot_f32_up_to<kTileF32>(tt, wg, in, xp + t * in, in, s);
        for (int64_t u = 0; u < tt; ++u)
          for (int64_t j = 0; j < n; ++j) yp[(t + u) * out + o + j] = s[u * kLanes + j] + (b ? b[o + j] : 0.f);
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
  // Two halves, each without a branch: rotate_half(x) is -x[i + half] below half, x[i - half] from it
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const T a = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
    const T b = static_cast<T>(-static_cast<float>(x[i + half]) * static_cast<float>(s[i]));
    y[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
  }
#pragma omp simd
  for (int64_t i = half; i < d; ++i) {
    const T a = static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
    const T b = static_cast<T>(static_cast<float>(x[i - half]) * static_cast<float>(s[i]));
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
