// decode_layer: one Llama decoder layer for a few bf16 or float32 decode tokens, in one call (model/llama.py: the
// CPU decode path of LlamaForCausalLM.forward). The same kernels the layer's Python calls one by one (RMSNorm, the blocked
// few-row linear, rotary, the KV write, paged decode attention, silu * up, the residual adds), in the same order
// on the same values: the same bits. What it saves is the ~35 torch ops and Python calls around them a layer
// (~3 ms of a ~11 ms bf16 SmolLM2 step on a Zen 4 VM; in float32 on a Zen 1 VM, where the blocked linear alone
// reads no faster than the row-major kernel it replaced at one row, batch-1 decode went from 11-13 to 17-24 tok/s).
// Every tensor below is of one dtype, x's (bfloat16 or float32), but the indices.
//   x            [T, hidden], contiguous: the residual stream of T decode tokens (T >= 1)
//   in_norm, post_norm   [hidden]: the two RMSNorm weights; eps their epsilon
//   qkv_w, o_w, gate_up_w, down_w   weights in blocked_linear's layout (kernels/cpu_small.py block_weight) of
//                [q; k; v], o_proj, [gate; up], down_proj; *_b: their biases, or None
//   dims         {heads, kv_heads, head_dim, intermediate}
//   cos, sin     [T, head_dim], the tokens' rotary tables
//   layer_cache  [num_blocks, 2, kv_heads, B, head_dim] (a slice of the KV pool; K then V). Mutated:
//                token t's K and V go to slot slot_mapping[t] (block slot / B, offset slot % B); a negative
//                slot is padding and is not written
//   slot_mapping [T] int64; block_tables [T, W] int32; seq_lens [T]: as paged_decode_attention's
//   scale, window as paged_decode_attention's
//   returns      [T, hidden]: x + attn(norm(x)), then that + mlp(norm(that))
// Raises (RuntimeError) naming the shape, dtype or slot that does not fit, before anything is written; a block table
// that does not fit is found by the attention, after the KV write, as in the layer's Python path.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "small_ops.h"

using kvrelay_cpu::kLanes;

// Defined in decode_attention.cpp.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  int64_t window, c10::optional<at::Tensor> sinks);

namespace {

template <typename T>
struct Blocked {
  const uint32_t* w;
  int64_t groups, k;
  const T* bias;
  int64_t out;
};

template <typename T>
Blocked<T> blocked(const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t in, int64_t out,
                   const char* name) {
  constexpr int64_t per_word = 4 / sizeof(T);
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == dtype && w.is_contiguous() &&
                  w.size(1) == (in + per_word - 1) / per_word && w.size(2) == kLanes && w.size(3) == per_word &&
                  w.size(0) == (out + kLanes - 1) / kLanes,
              "decode_layer: ", name, " must be a blocked ", dtype, " weight of ", out, " x ", in);
  const T* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == out,
                "decode_layer: ", name, "'s bias must be ", dtype, " [", out, "]");
    b = bias->data_ptr<T>();
  }
  return {static_cast<const uint32_t*>(w.data_ptr()), w.size(0), w.size(1), b, out};
}

// y [T, out] = x [T, in] W^T + b.
template <typename T>
void linear(const Blocked<T>& w, const T* x, int64_t t_rows, int64_t in, T* y) {
  kvrelay_cpu::blocked_rows(x, t_rows, in, w.k, w.w, w.groups, w.bias, w.out, y);
}

template <typename T>
void add_into(T* x, const T* y, int64_t n) {  // x += y, rounded to T as torch's add
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(y[i]));
}

template <typename T>
at::Tensor decode_layer_t(const at::Tensor& x, const at::Tensor& in_norm, const at::Tensor& post_norm, double eps,
                          const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_b, const at::Tensor& o_w,
                          const c10::optional<at::Tensor>& o_b, const at::Tensor& gate_up_w,
                          const c10::optional<at::Tensor>& gate_up_b, const at::Tensor& down_w,
                          const c10::optional<at::Tensor>& down_b, const std::vector<int64_t>& dims,
                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& layer_cache,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          double scale, int64_t window) {
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  const int64_t heads = dims[0], kv_heads = dims[1], d = dims[2], inter = dims[3];
  const int64_t t_rows = x.size(0), hidden = x.size(1), nq = heads * d, nkv = kv_heads * d;
  for (const at::Tensor* w : {&in_norm, &post_norm})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == hidden && w->scalar_type() == dtype && w->is_contiguous(),
                "decode_layer: the norm weights must be contiguous ", dtype, " [hidden]");
  const Blocked<T> qkv = blocked<T>(qkv_w, qkv_b, hidden, nq + 2 * nkv, "qkv_w");
  const Blocked<T> out_proj = blocked<T>(o_w, o_b, nq, hidden, "o_w");
  const Blocked<T> gate_up = blocked<T>(gate_up_w, gate_up_b, hidden, 2 * inter, "gate_up_w");
  const Blocked<T> down = blocked<T>(down_w, down_b, inter, hidden, "down_w");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == t_rows && cos.size(1) == d &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.is_contiguous() &&
                  sin.is_contiguous() && d % 2 == 0,
              "decode_layer: cos and sin must be contiguous ", dtype, " [T, head_dim] (head_dim even)");
  TORCH_CHECK(layer_cache.dim() == 5 && layer_cache.size(1) == 2 && layer_cache.size(2) == kv_heads &&
                  layer_cache.size(4) == d && layer_cache.scalar_type() == dtype &&
                  layer_cache.stride(4) == 1 && layer_cache.stride(3) == d &&
                  layer_cache.stride(2) == layer_cache.size(3) * d &&
                  layer_cache.stride(1) == kv_heads * layer_cache.size(3) * d,
              "decode_layer: layer_cache must be ", dtype,
              " [num_blocks, 2, kv_heads, B, head_dim], each block contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == t_rows && slot_mapping.scalar_type() == at::kLong,
              "decode_layer: slot_mapping must be int64 [T]");
  const int64_t num_blocks = layer_cache.size(0), block_size = layer_cache.size(3);
  auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_rows; ++t)
    TORCH_CHECK(sp[t] < num_blocks * block_size, "decode_layer: token ", t, "'s slot ", sp[t], " is past the ",
                num_blocks, " blocks of the cache");
  const float e = static_cast<float>(eps);
  const auto opts = x.options();

  // Attention: norm, [q; k; v], rotary of q and k
  std::vector<T> h(static_cast<size_t>(t_rows * hidden)), qkv_out(static_cast<size_t>(t_rows * qkv.out));
  std::vector<T> k_rot(static_cast<size_t>(t_rows * nkv));
  kvrelay_cpu::rms_norm_rows(x.data_ptr<T>(), in_norm.data_ptr<T>(), h.data(), t_rows, hidden, e);
  linear(qkv, h.data(), t_rows, hidden, qkv_out.data());
  auto q = at::empty({t_rows, heads, d}, opts);
  const T* cp = cos.data_ptr<T>();
  const T* snp = sin.data_ptr<T>();
  kvrelay_cpu::rotary_rows(qkv_out.data(), qkv.out, d, cp, snp, q.data_ptr<T>(), t_rows, heads, d);
  kvrelay_cpu::rotary_rows(qkv_out.data() + nq, qkv.out, d, cp, snp, k_rot.data(), t_rows, kv_heads, d);
  // The KV write: token t's [kv_heads, d] K and V rows into its slot
  T* cache = layer_cache.data_ptr<T>();
  const int64_t bs = layer_cache.stride(0), kvs = layer_cache.stride(1), hs = layer_cache.stride(2);
  for (int64_t t = 0; t < t_rows; ++t) {
    if (sp[t] < 0) continue;
    T* kb = cache + (sp[t] / block_size) * bs + (sp[t] % block_size) * d;
    for (int64_t g = 0; g < kv_heads; ++g) {
      std::memcpy(kb + g * hs, k_rot.data() + (t * kv_heads + g) * d, d * sizeof(T));
      std::memcpy(kb + kvs + g * hs, qkv_out.data() + t * qkv.out + nq + nkv + g * d, d * sizeof(T));
    }
  }
  auto attn = paged_decode_attention(q, layer_cache.select(1, 0), layer_cache.select(1, 1), block_tables, seq_lens,
                                     scale, window, c10::nullopt);
  // o_proj and the residual
  auto y = at::empty({t_rows, hidden}, opts);
  std::memcpy(y.data_ptr<T>(), x.data_ptr<T>(), t_rows * hidden * sizeof(T));
  T* yp = y.data_ptr<T>();
  std::vector<T> o(static_cast<size_t>(t_rows * hidden));
  linear(out_proj, attn.data_ptr<T>(), t_rows, nq, o.data());
  add_into(yp, o.data(), t_rows * hidden);
  // MLP: norm, [gate; up], silu * up, down, the residual
  std::vector<T> gu(static_cast<size_t>(t_rows * 2 * inter)), act(static_cast<size_t>(t_rows * inter));
  kvrelay_cpu::rms_norm_rows(static_cast<const T*>(yp), post_norm.data_ptr<T>(), h.data(), t_rows, hidden, e);
  linear(gate_up, h.data(), t_rows, hidden, gu.data());
  kvrelay_cpu::silu_mul_rows(gu.data(), 2 * inter, act.data(), t_rows, inter);
  linear(down, act.data(), t_rows, inter, o.data());
  add_into(yp, o.data(), t_rows * hidden);
  return y;
}

}  // namespace

at::Tensor decode_layer(at::Tensor x, at::Tensor in_norm, at::Tensor post_norm, double eps, at::Tensor qkv_w,
                        c10::optional<at::Tensor> qkv_b, at::Tensor o_w, c10::optional<at::Tensor> o_b,
                        at::Tensor gate_up_w, c10::optional<at::Tensor> gate_up_b, at::Tensor down_w,
                        c10::optional<at::Tensor> down_b, std::vector<int64_t> dims, at::Tensor cos, at::Tensor sin,
                        at::Tensor layer_cache, at::Tensor slot_mapping, at::Tensor block_tables,
                        at::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(dims.size() == 4, "decode_layer: dims must be {heads, kv_heads, head_dim, intermediate}");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.is_contiguous() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "decode_layer: x must be a contiguous bf16 or float32 [T, hidden], T >= 1");
  if (x.scalar_type() == at::kFloat)
    return decode_layer_t<float>(x, in_norm, post_norm, eps, qkv_w, qkv_b, o_w, o_b, gate_up_w, gate_up_b, down_w,
                                 down_b, dims, cos, sin, layer_cache, slot_mapping, block_tables, seq_lens, scale,
                                 window);
  return decode_layer_t<at::BFloat16>(x, in_norm, post_norm, eps, qkv_w, qkv_b, o_w, o_b, gate_up_w, gate_up_b,
                                      down_w, down_b, dims, cos, sin, layer_cache, slot_mapping, block_tables,
                                      seq_lens, scale, window);
}
