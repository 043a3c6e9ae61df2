// Small float32 CPU ops of a decode step, where torch's per-op overhead or its few-row matmul path dominate.
//
// small_linear: y = x W^T + b for a few rows of x (batch-1 and small-batch decode).
//   x     [T, in]   float32, contiguous (T small: each weight row is read once and used for every row of x)
//   w     [out, in] float32, contiguous
//   bias  None, or float32 [out] contiguous
//   returns [T, out] float32
// At one to a few rows a linear layer is a matrix-vector product that reads every weight once: memory-bound.
// Eight weight rows at a time give eight independent sums that share each load of x (oneDNN/MKL's sgemv reaches
// ~10 GB/s on the AVX2 VM against ~20 GB/s of read bandwidth). Eight rows, not four: 5-25% more GB/s at 1 and 4
// rows on SmolLM2's shapes, AVX-512 and AVX2 code alike (measured on a Zen 4 VM, 2026-12-04). Output rows are
// split over torch's thread pool.
// Sums run in another order than F.linear's (and -ffast-math lets the compiler reassociate): results differ
// in the last bits, as any two BLAS libraries do.
// This file also holds the Python module of the whole extension (kernels/cpu_build.py: CPU_KERNELS), whose
// other file, decode_attention.cpp, compiles beside it.
// Narrow headers, not <torch/extension.h>: that one parses for ~40 s on the AVX2 VM, and every clean clone (CI)
// builds these files.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

inline void dot8(const float* __restrict w, int64_t in, const float* __restrict x, float* s) {
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f, a4 = 0.f, a5 = 0.f, a6 = 0.f, a7 = 0.f;
  const float *w0 = w, *w1 = w + in, *w2 = w + 2 * in, *w3 = w + 3 * in, *w4 = w + 4 * in, *w5 = w + 5 * in,
              *w6 = w + 6 * in, *w7 = w + 7 * in;
#pragma omp simd reduction(+ : a0, a1, a2, a3, a4, a5, a6, a7)
  for (int64_t i = 0; i < in; ++i) {
    const float xi = x[i];
    a0 += w0[i] * xi; a1 += w1[i] * xi; a2 += w2[i] * xi; a3 += w3[i] * xi;
    a4 += w4[i] * xi; a5 += w5[i] * xi; a6 += w6[i] * xi; a7 += w7[i] * xi;
  }
  s[0] = a0; s[1] = a1; s[2] = a2; s[3] = a3; s[4] = a4; s[5] = a5; s[6] = a6; s[7] = a7;
}

inline float dot1(const float* __restrict w, int64_t in, const float* __restrict x) {
  float a = 0.f;
#pragma omp simd reduction(+ : a)
  for (int64_t i = 0; i < in; ++i) a += w[i] * x[i];
  return a;
}

}  // namespace

at::Tensor small_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "small_linear: x must be [T, in] and w [out, in]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "small_linear: x and w must be float32");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_linear: x and w must be contiguous");
  TORCH_CHECK(x.size(1) == w.size(1), "small_linear: x has ", x.size(1), " columns, w ", w.size(1));
  const int64_t t_rows = x.size(0), in = x.size(1), out = w.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out,
                "small_linear: bias must be float32 [out] contiguous");
    b = bias->data_ptr<float>();
  }
  auto y = at::empty({t_rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = (out + 7) / 8;
  at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
    float s[8];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t o = g * 8;
      if (o + 8 <= out) {
        for (int64_t t = 0; t < t_rows; ++t) {
          dot8(wp + o * in, in, xp + t * in, s);
          for (int64_t k = 0; k < 8; ++k) yp[t * out + o + k] = s[k] + (b ? b[o + k] : 0.f);
        }
      } else {
        for (int64_t r = o; r < out; ++r)
          for (int64_t t = 0; t < t_rows; ++t) yp[t * out + r] = dot1(wp + r * in, in, xp + t * in) + (b ? b[r] : 0.f);
      }
    }
  });
  return y;
}

// rms_norm: y = (x * rsqrt(mean(x^2) + eps)) * w per row, Llama's RMSNorm in one pass over each row (torch's
// composite runs five ops of ~10 us each on a 576-wide row).
//   x [T, H] float32 contiguous, w [H] float32 contiguous; returns [T, H] float32
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0),
              "rms_norm: x must be [T, H] and w [H]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "rms_norm: x and w must be float32");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "rms_norm: x and w must be contiguous");
  const int64_t rows = x.size(0), h = x.size(1);
  auto y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * h;
      float* yr = yp + r * h;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) ss += xr[i] * xr[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + e);
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) yr[i] = (xr[i] * inv) * wp[i];
    }
  });
  return y;
}

// Defined in decode_attention.cpp. A declaration that drifted from the definition would name another (mangled)
// symbol, and the extension would fail to import: the CPU kernel tests load it.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  int64_t window, c10::optional<at::Tensor> sinks);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "y = x W^T + b for a few rows of x (CPU, float32)");
  m.def("rms_norm", &rms_norm, "Llama RMSNorm per row (CPU, float32)");
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
