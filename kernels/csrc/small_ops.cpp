// Small CPU ops of a decode step, where torch's per-op overhead or its few-row matmul path dominate: the few-row
// linear layer over a blocked weight, RMSNorm, rotary, silu * up; and a probe of how long a hand-off between two
// threads takes (thread_round_trip_ns). The ops' raw-pointer cores are in small_ops.h.
// This file also holds the Python module of the whole extension (kernels/cpu_build.py: CPU_KERNELS), whose other
// files compile beside it.
// Narrow headers, not <torch/extension.h>: that one parses for ~40 s on the AVX2 VM, and every clean clone (CI)
// builds these files.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <memory>

#include "small_ops.h"

using namespace kvrelay_cpu;  // NOLINT: this file binds the header's cores

// blocked_linear: y = x W^T + b for a few rows of x, with W in the blocked layout `block_weight` makes
// (kernels/cpu_small.py): [G, K, 16, P], sixteen output rows by P inputs per 64-byte block (P = 2 for bf16, 1 for
// float32: one 32-bit word a lane), a group's blocks in input order. A group of sixteen outputs then reads one
// linear stream (the row-major weight is sixteen streams `in` elements apart, which the prefetchers follow less
// well), and no sum runs across lanes at the end.
// bf16: with AVX512-BF16 one VDPBF16PS multiplies a block by a pair of x's inputs into sixteen float32 sums
// (oneDNN's packed bf16 matmul read SmolLM2's weights at ~20 GB/s at one row on a Zen 4 VM whose float32 sum read
// 35-50 GB/s); without it, plain C++ sums the same layout in float32 (bf16 -> float32 is a 16-bit shift).
// float32: fused multiply-adds of each 16-float block by one of x's inputs, AVX-512 or AVX2 (plain C++ elsewhere),
// up to four rows of x per pass. On a Zen 1 VM (AVX2) over SmolLM2's weights: even with the row-major eight-row
// kernel it replaced at one row (both at the read bandwidth), 1.2-1.4x its speed at 4 to 16 rows.
//   x     [T, in] bfloat16 or float32, contiguous (T small: each block is loaded once for a tile of x's rows)
//   wb    [G, K, 16, P] of x's dtype, G = ceil(out / 16), K = ceil(in / P), zero-padded
//   bias  None, or [out] of x's dtype, contiguous
//   out   the number of output features (16 (G - 1) < out <= 16 G)
//   returns [T, out] of x's dtype. bf16: float32 sums plus the bias, rounded once to bf16 (round to nearest even),
//   as oneDNN's bf16 matmul does; float32: each output summed in input order. Either way the sums run in another
//   order than torch's.

at::Tensor blocked_linear(at::Tensor x, at::Tensor wb, c10::optional<at::Tensor> bias, int64_t out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "blocked_linear: x must be bfloat16 or float32");
  TORCH_CHECK(wb.scalar_type() == x.scalar_type(), "blocked_linear: x and wb must have one dtype");
  const int64_t per_word = x.scalar_type() == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(x.dim() == 2 && wb.dim() == 4 && wb.size(2) == kLanes && wb.size(3) == per_word,
              "blocked_linear: x must be [T, in] and wb [G, K, 16, ", per_word, "]");
  TORCH_CHECK(x.is_contiguous() && wb.is_contiguous(), "blocked_linear: x and wb must be contiguous");
  const int64_t t_rows = x.size(0), in = x.size(1), groups = wb.size(0), k = wb.size(1);
  TORCH_CHECK(k == (in + per_word - 1) / per_word, "blocked_linear: x has ", in, " columns, wb ", k, " steps of ",
              per_word);
  TORCH_CHECK(out > kLanes * (groups - 1) && out <= kLanes * groups, "blocked_linear: ", out,
              " outputs do not fit ", groups, " groups of 16");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == out,
                "blocked_linear: bias must be ", x.scalar_type(), " [out] contiguous");
  const bool has_bias = bias.has_value() && bias->defined();
  auto y = at::empty({t_rows, out}, x.options());
  const uint32_t* wp = static_cast<const uint32_t*>(wb.data_ptr());
  if (x.scalar_type() == at::kFloat)
    blocked_rows(x.data_ptr<float>(), t_rows, in, k, wp, groups, has_bias ? bias->data_ptr<float>() : nullptr, out,
                 y.data_ptr<float>());
  else
    blocked_rows(x.data_ptr<at::BFloat16>(), t_rows, in, k, wp, groups,
                 has_bias ? bias->data_ptr<at::BFloat16>() : nullptr, out, y.data_ptr<at::BFloat16>());
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

// thread_round_trip_ns: the mean time (ns) for a cache line to go from one thread of an OpenMP team of two (the
// team torch's ops and a decode step run on) to the other and back, over `trips` round trips (each thread spins
// until the other has written the line). Where the two threads run on cores that share a cache it is that cache's
// latency, where they sit on different dies the link's: on a 2-vCPU Zen 4 VM 61-75 ns in some minutes and 304-338 ns
// in others, as the hypervisor places the vCPUs (`kvrelay bench bandwidth` records it each round; every hand-off
// between a decode step's two threads pays it). NaN when the team has one thread. Raises (RuntimeError) when
// trips < 1.
double thread_round_trip_ns(int64_t trips) {
  TORCH_CHECK(trips >= 1, "thread_round_trip_ns: trips must be at least 1, got ", trips);
  struct alignas(64) Line {  // alone on its cache line: nothing else either thread touches shares it
    std::atomic<int64_t> value{0};
    char pad[64 - sizeof(std::atomic<int64_t>)];
  };
  const auto line = std::make_unique<Line>();
  const auto await = [&line](int64_t value) {
    spin_until([&] { return line->value.load(std::memory_order_acquire) == value; });
  };
  double ns = std::numeric_limits<double>::quiet_NaN();
#pragma omp parallel num_threads(2)
  if (omp_get_num_threads() == 2) {
    if (omp_get_thread_num() == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < trips; ++i) {
        line->value.store(2 * i + 1, std::memory_order_release);
        await(2 * i + 2);
      }
      ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
           static_cast<double>(trips);
    } else {
      for (int64_t i = 0; i < trips; ++i) {
        await(2 * i + 1);
        line->value.store(2 * i + 2, std::memory_order_release);
      }
    }
  }
  return ns;
}

// Defined in decode_attention.cpp. A declaration that drifted from the definition would name another (mangled)
// symbol, and the extension would fail to import: the CPU kernel tests load it.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  int64_t window, c10::optional<at::Tensor> sinks, int64_t parts);

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
void bind_decode_stack(pybind11::module_& m);  // decode_layer.cpp: the DecodeStack class

// Every kernel runs without the GIL (its arguments are converted before and its result after, with the GIL held):
// an engine node's event loop thread (KV leases, pulls, streams) then runs while its engine thread computes. On a
// 2-core machine, 1P1D at 2.5 long-mix req/s, this alone took a decode node's KV pull from 0.48 s median (p90 1.35 s)
// to 0.23-0.39 s (p90 1.04-1.10 s); the rest was lease renewals waiting for the engine thread (transfer/owner.py).
constexpr auto kNoGil = pybind11::call_guard<pybind11::gil_scoped_release>();

// What this build was made from (kernels/isa.py build_id: sources, headers, flags, torch's version): the loader takes
// a prebuilt module only when it matches the files beside it.
#ifndef KVRELAY_BUILD_ID
#define KVRELAY_BUILD_ID unknown
#endif
#define KVRELAY_STR2(x) #x
#define KVRELAY_STR(x) KVRELAY_STR2(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("build_id", []() { return std::string(KVRELAY_STR(KVRELAY_BUILD_ID)); }, "what this build was made from");
  m.def("blocked_linear", &blocked_linear, "y = x W^T + b for a few rows of x, W blocked (CPU, bf16 or float32)",
        kNoGil);
  m.def("rotary", &rotary, "NeoX rotary embedding of [T, H, D] (CPU, float32 or bf16)", kNoGil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [T, 2 I] [gate; up] row (CPU, float32 or bf16)", kNoGil);
  m.def("rms_norm", &rms_norm, "Llama RMSNorm per row (CPU, float32 or bf16)", kNoGil);
  m.def("decode_layer", &decode_layer, "one Llama decoder layer for a few bf16 or float32 decode tokens (CPU)", kNoGil);
  bind_decode_stack(m);
  m.def("thread_round_trip_ns", &thread_round_trip_ns, "ns for a cache line to go to another thread and back",
        kNoGil);
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", kNoGil);
  m.def("prefill_attention_bf16", &prefill_attention_bf16, "flash-style causal paged prefill attention (CPU, bf16)",
        kNoGil);
}
