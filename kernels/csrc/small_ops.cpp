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

#include "small_ops.h"

using namespace kvrelay_cpu;  // NOLINT: this file binds the header's cores

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

// blocked_linear: y = x W^T + b for a few rows of bf16 x, with W bf16 in the blocked layout `block_weight` makes
// (kernels/cpu_small.py): [G, K2, 16, 2], sixteen output rows by two inputs per 64-byte block, a group's blocks in
// input order. A group of sixteen outputs then reads one linear stream (the row-major weight is sixteen streams
// 2*in bytes apart, which the prefetchers follow less well), and with AVX512-BF16 one VDPBF16PS multiplies a
// block by a pair of x's inputs into sixteen float32 sums: no sum across lanes at the end. oneDNN's packed bf16
// matmul read SmolLM2's weights at ~20 GB/s at one row on a Zen 4 VM whose float32 sum reads 35-50 GB/s.
//   x     [T, in] bfloat16, contiguous (T small: each block is loaded once for up to sixteen rows of x)
//   wb    [G, K2, 16, 2] bfloat16, G = ceil(out / 16), K2 = ceil(in / 2), zero-padded
//   bias  None, or bfloat16 [out] contiguous
//   out   the number of output features (16 (G - 1) < out <= 16 G)
//   returns [T, out] bfloat16: float32 sums plus the bias, rounded once to bf16 (round to nearest even), as
//   oneDNN's bf16 matmul does; the sums run in another order than its.
// Without AVX512-BF16 the same layout is summed in float32 by plain C++ (bf16 -> float32 is a 16-bit shift).

at::Tensor blocked_linear(at::Tensor x, at::Tensor wb, c10::optional<at::Tensor> bias, int64_t out) {
  TORCH_CHECK(x.dim() == 2 && wb.dim() == 4 && wb.size(2) == kLanes && wb.size(3) == 2,
              "blocked_linear: x must be [T, in] and wb [G, K2, 16, 2]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wb.scalar_type() == at::kBFloat16,
              "blocked_linear: x and wb must be bfloat16");
  TORCH_CHECK(x.is_contiguous() && wb.is_contiguous(), "blocked_linear: x and wb must be contiguous");
  const int64_t t_rows = x.size(0), in = x.size(1), groups = wb.size(0), k2 = wb.size(1);
  TORCH_CHECK(k2 == (in + 1) / 2, "blocked_linear: x has ", in, " columns, wb ", k2, " pairs");
  TORCH_CHECK(out > kLanes * (groups - 1) && out <= kLanes * groups, "blocked_linear: ", out,
              " outputs do not fit ", groups, " groups of 16");
  const at::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == out,
                "blocked_linear: bias must be bfloat16 [out] contiguous");
    b = bias->data_ptr<at::BFloat16>();
  }
  auto y = at::empty({t_rows, out}, x.options());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(wb.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  blocked_rows(x.data_ptr<at::BFloat16>(), t_rows, in, k2, wp, groups, b, out, yp);
  return y;
}

// rms_norm: y = (x * rsqrt(mean(x^2) + eps)) * w per row, Llama's RMSNorm in one pass over each row (torch's
// composite runs five ops of ~10 us each on a 576-wide row).
//   x [T, H] float32 or bfloat16, contiguous; w [H] of x's dtype, contiguous; returns [T, H] of x's dtype.
//   bfloat16 follows Llama's numerics (model/llama.py RMSNorm): the sum of squares and the normalisation in
//   float32, the normalised row rounded to bf16, then multiplied by w and rounded again.

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0),
              "rms_norm: x must be [T, H] and w [H]");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  w.scalar_type() == x.scalar_type(),
              "rms_norm: x and w must both be float32 or both bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "rms_norm: x and w must be contiguous");
  auto y = at::empty_like(x);
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1), e);
  else
    rms_norm_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), x.size(0),
                  x.size(1), e);
  return y;
}

// rotary: NeoX-style rotation (model/rope.py apply_rotary) in one pass: y = x * cos + rotate_half(x) * sin, where
// rotate_half(x) = [-x[D/2:], x[:D/2]].
//   x   [T, H, D] float32 or bfloat16, last dimension contiguous (rows may be strided: a split of a wider matmul)
//   cos, sin [T, D] of x's dtype, contiguous
//   returns [T, H, D] of x's dtype, contiguous, rounded as torch's three ops are: each product to x's dtype, then
//   their sum (the same bits, float32 and bf16).

namespace {

bool float_or_bf16(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
}

}  // namespace

at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && x.size(2) % 2 == 0,
              "rotary: x must be [T, H, D] (D even) and cos, sin [T, D]");
  TORCH_CHECK(float_or_bf16(x) && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: x, cos and sin must all be float32 or all bfloat16");
  TORCH_CHECK(x.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous(),
              "rotary: x's last dimension, cos and sin must be contiguous");
  auto y = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == at::kFloat)
    rotary_rows(x.data_ptr<float>(), x.stride(0), x.stride(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
                y.data_ptr<float>(), x.size(0), x.size(1), x.size(2));
  else
    rotary_rows(x.data_ptr<at::BFloat16>(), x.stride(0), x.stride(1), cos.data_ptr<at::BFloat16>(),
                sin.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), x.size(0), x.size(1), x.size(2));
  return y;
}

//   gate_up [T, 2 I] float32 or bfloat16, last dimension contiguous; returns [T, I] silu(gate) * up, contiguous.
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be [T, 2 I]");
  TORCH_CHECK(float_or_bf16(gate_up), "silu_mul: gate_up must be float32 or bfloat16");
  TORCH_CHECK(gate_up.stride(1) == 1, "silu_mul: gate_up's last dimension must be contiguous");
  const int64_t inter = gate_up.size(1) / 2;
  auto y = at::empty({gate_up.size(0), inter}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat)
    silu_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), y.data_ptr<float>(), gate_up.size(0), inter);
  else
    silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), gate_up.stride(0), y.data_ptr<at::BFloat16>(),
                  gate_up.size(0), inter);
  return y;
}

// Defined in decode_attention.cpp. A declaration that drifted from the definition would name another (mangled)
// symbol, and the extension would fail to import: the CPU kernel tests load it.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  int64_t window, c10::optional<at::Tensor> sinks);

// Defined in prefill_attention.cpp (its contract is there).
at::Tensor prefill_attention_bf16(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, at::Tensor query_start_loc, double scale);

// Defined in decode_layer.cpp (its contract is there).
at::Tensor decode_layer(at::Tensor x, at::Tensor in_norm, at::Tensor post_norm, double eps, at::Tensor qkv_w,
                        c10::optional<at::Tensor> qkv_b, at::Tensor o_w, c10::optional<at::Tensor> o_b,
                        at::Tensor gate_up_w, c10::optional<at::Tensor> gate_up_b, at::Tensor down_w,
                        c10::optional<at::Tensor> down_b, std::vector<int64_t> dims, at::Tensor cos, at::Tensor sin,
                        at::Tensor layer_cache, at::Tensor slot_mapping, at::Tensor block_tables,
                        at::Tensor seq_lens, double scale, int64_t window);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "y = x W^T + b for a few rows of x (CPU, float32)");
  m.def("blocked_linear", &blocked_linear, "y = x W^T + b for a few rows of x, W blocked (CPU, bf16)");
  m.def("rotary", &rotary, "NeoX rotary embedding of [T, H, D] (CPU, float32 or bf16)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [T, 2 I] [gate; up] row (CPU, float32 or bf16)");
  m.def("rms_norm", &rms_norm, "Llama RMSNorm per row (CPU, float32 or bf16)");
  m.def("decode_layer", &decode_layer, "one Llama decoder layer for a few bf16 decode tokens (CPU)");
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("prefill_attention_bf16", &prefill_attention_bf16, "flash-style causal paged prefill attention (CPU, bf16)");
}
