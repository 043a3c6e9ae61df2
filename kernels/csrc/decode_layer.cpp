// decode_layer: one Llama decoder layer for a few bf16 or float32 decode tokens, in one call (model/llama.py:
// DecoderLayer.decode_fused; DecodeStack below runs every layer of a step in one call). The same kernels the
// layer's Python calls one by one (RMSNorm, the blocked few-row linear, rotary, the KV write, paged decode
// attention, silu * up, the residual adds), in the same order on the same values: the same bits. What it saves
// is the ~35 torch ops and Python calls around them a layer
// (~3 ms of a ~11 ms bf16 SmolLM2 step on a Zen 4 VM; in float32 on a Zen 1 VM, where the blocked linear alone
// reads no faster than the row-major kernel it replaced at one row, batch-1 decode went from 11-13 to 17-24 tok/s).
// The layers of a step run in one OpenMP parallel region (run_layers), not one region per op: the team's threads
// split each linear layer's output groups as blocked_rows' at::parallel_for does, the attention's work items and
// merges as paged_decode_attention's do, and silu * up's columns; RMSNorm, rotary, the KV write and the residual adds
// run on the lead thread; spinning barriers join the phases (ten a layer, where ~180 regions a step started and
// joined before). The same bits at any thread count. SmolLM2 bf16, batch 1, a 64-token prompt, on a Zen 4 VM, the
// stack before and after alternated call by call in one process (6 runs of 4 rounds): the layers took 0.91-0.99x
// the time, median 0.965; 0.91-0.96x in the minutes of high read bandwidth (~55 GB/s), where they cost most.
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
// Raises (RuntimeError) naming the shape, dtype, slot or block table that does not fit (the table errors worded as
// paged_decode_attention's), before anything is written.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "small_ops.h"

using kvrelay_cpu::kLanes;

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

template <typename T>
void add_into(T* x, const T* y, int64_t n) {  // x += y, rounded to T as torch's add
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(y[i]));
}

// One layer's weights, checked once: what run_layer reads besides the step's inputs.
template <typename T>
struct LayerPlan {
  const T* in_norm;
  const T* post_norm;
  float eps;
  Blocked<T> qkv, out, gate_up, down;
  int64_t heads, kv_heads, d, inter, hidden;
  double scale;
  int64_t window;
};

template <typename T>
LayerPlan<T> plan_layer(int64_t hidden, const at::Tensor& in_norm, const at::Tensor& post_norm, double eps,
                        const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_b, const at::Tensor& o_w,
                        const c10::optional<at::Tensor>& o_b, const at::Tensor& gate_up_w,
                        const c10::optional<at::Tensor>& gate_up_b, const at::Tensor& down_w,
                        const c10::optional<at::Tensor>& down_b, const std::vector<int64_t>& dims, double scale,
                        int64_t window) {
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  TORCH_CHECK(dims.size() == 4, "decode_layer: dims must be {heads, kv_heads, head_dim, intermediate}");
  const int64_t heads = dims[0], kv_heads = dims[1], d = dims[2], inter = dims[3];
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "decode_layer: heads (", heads,
              ") must be a multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(window >= 0, "window must be >= 1, or 0 for none; got ", window);
  const int64_t nq = heads * d, nkv = kv_heads * d;
  for (const at::Tensor* w : {&in_norm, &post_norm})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == hidden && w->scalar_type() == dtype && w->is_contiguous(),
                "decode_layer: the norm weights must be contiguous ", dtype, " [hidden]");
  return {in_norm.data_ptr<T>(),
          post_norm.data_ptr<T>(),
          static_cast<float>(eps),
          blocked<T>(qkv_w, qkv_b, hidden, nq + 2 * nkv, "qkv_w"),
          blocked<T>(o_w, o_b, nq, hidden, "o_w"),
          blocked<T>(gate_up_w, gate_up_b, hidden, 2 * inter, "gate_up_w"),
          blocked<T>(down_w, down_b, inter, hidden, "down_w"),
          heads, kv_heads, d, inter, hidden, scale, window};
}

// A KV block group's block tables [T, W] and lengths [T] for one step, as the attention reads them: converted once
// a step, not once a layer (each torch op a layer cost more than its work: the weights streamed between two layers
// evict the code of torch's dispatcher, and a cold call of a few ops took ~50 us on a Zen 1 VM). On a Zen 4 VM the
// whole bf16 step was within noise of the per-layer conversion it replaced (20 of 40 alternated pairs faster).
struct StepTables {
  at::Tensor tables, lens;  // int32 [T, W] and int64 [T], contiguous; they own what the pointers point at
  const int32_t* tp;
  const int64_t* lp;
  int64_t width;
};

StepTables step_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t t_rows) {
  auto tables = block_tables.to(at::kInt).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == t_rows && lens.numel() == t_rows,
              "block_tables must be [T, W] and seq_lens [T]: one table row and length per sequence");
  return {tables, lens, tables.data_ptr<int32_t>(), lens.data_ptr<int64_t>(), tables.size(1)};
}

// The step's rotary rows, checked against a layer's plan: contiguous [T, head_dim] of the layer's dtype.
template <typename T>
void check_rotary(const LayerPlan<T>& p, int64_t t_rows, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  const int64_t d = p.d;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == t_rows && cos.size(1) == d &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.is_contiguous() &&
                  sin.is_contiguous() && d % 2 == 0,
              "decode_layer: cos and sin must be contiguous ", dtype, " [T, head_dim] (head_dim even)");
}

// A layer's KV cache: sizes and strides of its [num_blocks, 2, kv_heads, B, head_dim] slice (layer_cache, or one
// local layer of a [num_blocks, layers, 2, kv_heads, B, head_dim] pool read without making the slice a tensor: 30
// select()s and their tensors a step cost ~0.1 ms of a batch-1 bf16 SmolLM2 step on a Zen 4 VM, run cold).
struct CacheGeometry {
  void* data;  // block 0's K of this layer
  at::ScalarType dtype;
  int64_t sizes[5], strides[5];
};

inline CacheGeometry cache_geometry(const at::Tensor& layer_cache) {
  CacheGeometry g{layer_cache.data_ptr(), layer_cache.scalar_type(), {}, {}};
  for (int i = 0; i < 5; ++i) g.sizes[i] = layer_cache.size(i), g.strides[i] = layer_cache.stride(i);
  return g;
}

inline CacheGeometry pool_geometry(const at::Tensor& kv_pool, int64_t local) {  // kv_pool.select(1, local)'s
  CacheGeometry g{static_cast<char*>(kv_pool.data_ptr()) + local * kv_pool.stride(1) * kv_pool.element_size(),
                  kv_pool.scalar_type(), {}, {}};
  for (int i = 0; i < 5; ++i) {
    const int dim = i == 0 ? 0 : i + 1;
    g.sizes[i] = kv_pool.size(dim), g.strides[i] = kv_pool.stride(dim);
  }
  return g;
}

// What a layer reads of a step besides its plan: its cache, slots and block tables (checked by check_cache,
// check_slots and check_block_tables).
template <typename T>
struct LayerStep {
  T* cache;  // block 0's K; V is kvs after
  int64_t block_size, bs, kvs, hs;
  const int64_t* sp;
  const StepTables* tb;
};

// The layer's cache checked against its plan; returns how run_layer reads it, with the step's slots and tables.
template <typename T>
LayerStep<T> check_cache(const LayerPlan<T>& p, const CacheGeometry& c, const int64_t* sp, const StepTables& tb) {
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  const int64_t d = p.d, block_size = c.sizes[3];
  TORCH_CHECK(c.sizes[1] == 2 && c.sizes[2] == p.kv_heads && c.sizes[4] == d && c.dtype == dtype &&
                  c.strides[4] == 1 && c.strides[3] == d && c.strides[2] == block_size * d &&
                  c.strides[1] == p.kv_heads * block_size * d,
              "decode_layer: layer_cache must be ", dtype,
              " [num_blocks, 2, kv_heads, B, head_dim], each block contiguous");
  return {static_cast<T*>(c.data), block_size, c.strides[0], c.strides[1], c.strides[2], sp, &tb};
}

// The step's slots for a cache of num_blocks blocks of block_size: int64 [T], each below num_blocks * block_size (a
// negative slot is padding); returns them contiguous.
inline at::Tensor check_slots(const at::Tensor& slot_mapping, int64_t t_rows, int64_t num_blocks,
                              int64_t block_size) {
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == t_rows && slot_mapping.scalar_type() == at::kLong,
              "decode_layer: slot_mapping must be int64 [T]");
  auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_rows; ++t)
    TORCH_CHECK(sp[t] < num_blocks * block_size, "decode_layer: token ", t, "'s slot ", sp[t], " is past the ",
                num_blocks, " blocks of the cache");
  return slots;
}

// Buffers of a step's intermediate rows, reused from layer to layer; sized (fit) before the team starts.
template <typename T>
struct Scratch {
  using Word = typename kvrelay_cpu::Blocking<T>::Word;
  std::vector<T> h, qkv_out, q, k_rot, attn, o, gu, act;
  std::vector<float> att;    // the attention's part buffers (kvrelay_cpu::AttentionWork)
  std::vector<Word> padded;  // a linear's input rows of odd bf16 width, padded (kvrelay_cpu::blocked_x)
  std::vector<T> head;       // the LM head's rows in T before they are widened to float32 (bf16 only)
  std::vector<float> best;   // [threads, T]: each thread's largest logit of each row in its columns,
  std::vector<int64_t> best_at;  // and its column (the first of equal ones; -1: no columns)
  void fit_head(const Blocked<T>& w, int64_t t_rows, int64_t threads) {
    if (!std::is_same_v<T, float> && static_cast<int64_t>(head.size()) < t_rows * w.out)
      head.resize(static_cast<size_t>(t_rows * w.out));
    if (static_cast<int64_t>(padded.size()) < t_rows * w.k) padded.resize(static_cast<size_t>(t_rows * w.k));
    best.assign(static_cast<size_t>(threads * t_rows), 0.f);
    best_at.assign(static_cast<size_t>(threads * t_rows), -1);
  }
  void fit(const LayerPlan<T>& p, int64_t t_rows, int64_t parts) {
    const auto grow = [](auto& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
    };
    grow(h, t_rows * p.hidden);
    grow(qkv_out, t_rows * p.qkv.out);
    grow(q, t_rows * p.heads * p.d);
    grow(k_rot, t_rows * p.kv_heads * p.d);
    grow(attn, t_rows * p.heads * p.d);
    grow(o, t_rows * p.hidden);
    grow(gu, t_rows * 2 * p.inter);
    grow(act, t_rows * p.inter);
    grow(att, kvrelay_cpu::attention_floats(t_rows, p.heads, p.kv_heads, p.d, parts));
    grow(padded, t_rows * std::max({p.qkv.k, p.out.k, p.gate_up.k, p.down.k}));
  }
};

// A spinning barrier for the threads of one parallel region (a step's layers in one region: an OpenMP region a
// linear layer, as at::parallel_for starts, cost ~5 us of handing over and waiting each, ~120 a step). A waiting
// thread yields its core after a while (a VM's descheduled peer), and leaves at once when `failed` is set.
class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}
  void set_threads(int threads) { threads_ = threads; }  // before any thread waits
  // Returns false when a thread of the team has failed (then the team stops where it is).
  bool wait() {
    if (threads_ == 1) return !failed.load(std::memory_order_relaxed);
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
    } else {
      kvrelay_cpu::spin_until(
          [&] { return gen_.load(std::memory_order_acquire) != gen || failed.load(std::memory_order_relaxed); });
    }
    return !failed.load(std::memory_order_relaxed);
  }
  std::atomic<bool> failed{false};

 private:
  int threads_;
  std::atomic<int> count_{0};
  std::atomic<int> gen_{0};
};

// One thread of the team that runs a step: its index, the team's size and barrier.
struct TeamThread {
  int64_t tid, threads;
  SpinBarrier* barrier;
  bool lead() const { return tid == 0; }
  bool sync() const { return barrier->wait(); }
  std::pair<int64_t, int64_t> share(int64_t n, int64_t grain) const {
    return kvrelay_cpu::team_share(n, grain, tid, threads);
  }
};

// How a team of two splits the output groups of each kind of linear layer (a layer's [q; k; v], o, [gate; up],
// down, and the head): the lead takes the first `permille` thousandths, the other thread the rest, each one
// contiguous stream. The cut follows the two threads' measured speeds, step by step: in a Zen 4 VM's minutes of
// high read bandwidth one vCPU streamed the weights at ~8-10 bytes a cycle and the other at ~10-12, so that with
// halves the faster waited at every barrier (fixed cuts of 0.58 gained 7% in one such minute and lost 9% in the
// next; chunks of each weight, up to 64, drawn by the two threads from both ends lost 4-7%: a thread then starts a
// new stream at every chunk). Any cut gives the same bits: each group is computed alone. Batch-1 bf16 SmolLM2,
// alternated step by step with equal halves: 0.86-0.94x the step time in minutes where the threads differed,
// 0.99-1.05x where they did not, 0.99-1.00x in slow-memory minutes.
struct Balance {
  static constexpr int kKinds = 5;  // qkv, o, gate_up, down, head
  static constexpr int32_t kMin = 200, kMax = 800;  // the lead's share never leaves 0.2 .. 0.8
  std::atomic<int32_t> permille[kKinds];
  Balance() {
    for (auto& p : permille) p.store(500, std::memory_order_relaxed);
  }
};

// One step's measurements for Balance: each thread its own row (seconds in the linear kernel, groups computed).
struct StepBalance {
  const Balance* balance;
  double seconds[2][Balance::kKinds] = {};
  int64_t groups[2][Balance::kKinds] = {};
  // After the step: each kind's cut moves halfway to where the two threads' measured speeds would have met.
  void update(Balance& b) const {
    for (int k = 0; k < Balance::kKinds; ++k) {
      if (groups[0][k] == 0 || groups[1][k] == 0 || seconds[0][k] <= 0 || seconds[1][k] <= 0) continue;
      const double r0 = groups[0][k] / seconds[0][k], r1 = groups[1][k] / seconds[1][k];
      const int32_t old = b.permille[k].load(std::memory_order_relaxed);
      const auto next = static_cast<int32_t>(std::lround(0.5 * old + 500.0 * r0 / (r0 + r1)));
      b.permille[k].store(std::clamp(next, Balance::kMin, Balance::kMax), std::memory_order_relaxed);
    }
  }
};

// This thread's output groups begin .. end-1 of a linear layer of kind `kind` with `groups` groups: with balance (a
// team of two) the cut Balance holds; else blocked_rows' equal split.
inline std::pair<int64_t, int64_t> linear_share(const TeamThread& team, int64_t groups, const StepBalance* balance,
                                                int kind) {
  if (balance == nullptr || team.threads != 2) return team.share(groups, kvrelay_cpu::kGroupGrain);
  const int64_t cut = (groups * balance->balance->permille[kind].load(std::memory_order_relaxed) + 500) / 1000;
  return team.lead() ? std::pair<int64_t, int64_t>{0, cut} : std::pair<int64_t, int64_t>{cut, groups};
}

// y [T, out] = x [T, in] W^T + b, this thread's groups (linear_share), timed into balance where given. The caller
// syncs after.
template <typename T>
bool team_linear(const TeamThread& team, const Blocked<T>& w, const T* x, int64_t t_rows, int64_t in, T* y,
                 Scratch<T>& s, StepBalance* balance = nullptr, int kind = 0) {
  using Word = typename Scratch<T>::Word;
  const auto* xw = reinterpret_cast<const Word*>(x);
  if (in % static_cast<int64_t>(sizeof(Word) / sizeof(T)) != 0) {  // odd bf16 width: the lead pads the rows, once
    if (team.lead()) kvrelay_cpu::blocked_x(x, t_rows, in, w.k, s.padded);  // within the capacity fit gave
    if (!team.sync()) return false;
    xw = s.padded.data();
  }
  const auto [begin, end] = linear_share(team, w.groups, balance, kind);
  if (balance == nullptr || team.threads != 2) {
    kvrelay_cpu::blocked_groups(xw, t_rows, w.k, w.w, w.bias, w.out, y, begin, end);
    return true;
  }
  const auto t0 = std::chrono::steady_clock::now();
  kvrelay_cpu::blocked_groups(xw, t_rows, w.k, w.w, w.bias, w.out, y, begin, end);
  balance->seconds[team.tid][kind] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  balance->groups[team.tid][kind] += end - begin;
  return true;
}

// One layer by a team thread: x [T, hidden] (contiguous, updated in place) = x + attn(norm(x)), then that +
// mlp(norm(that)), with s.h = norm(x) on entry (the lead wrote it, then the team synced). On return the lead has
// written next_norm(x) into s.h, or normalised x in place with final_norm, or neither (both null); the team has
// synced. Every output is computed by the same kernels on the same values as one thread would: the same bits for
// any team size. Returns false when a team thread failed. No torch op runs here (see StepTables).
template <typename T>
bool run_layer(const TeamThread& team, const LayerPlan<T>& p, T* x, int64_t t_rows, const T* cp, const T* snp,
               const LayerStep<T>& ls, int64_t parts, const T* next_norm, float next_eps, const T* final_norm,
               float final_eps, StepBalance* balance, Scratch<T>& s) {
  const int64_t hidden = p.hidden, d = p.d, nq = p.heads * d, nkv = p.kv_heads * d;
  // Attention: [q; k; v], rotary of q and k, the KV write
  if (!team_linear(team, p.qkv, s.h.data(), t_rows, hidden, s.qkv_out.data(), s, balance, 0) || !team.sync())
    return false;
  if (team.lead()) {
    kvrelay_cpu::rotary_rows(s.qkv_out.data(), p.qkv.out, d, cp, snp, s.q.data(), t_rows, p.heads, d);
    kvrelay_cpu::rotary_rows(s.qkv_out.data() + nq, p.qkv.out, d, cp, snp, s.k_rot.data(), t_rows, p.kv_heads, d);
    // token t's [kv_heads, d] K and V rows into its slot
    for (int64_t t = 0; t < t_rows; ++t) {
      if (ls.sp[t] < 0) continue;
      T* kb = ls.cache + (ls.sp[t] / ls.block_size) * ls.bs + (ls.sp[t] % ls.block_size) * d;
      for (int64_t g = 0; g < p.kv_heads; ++g) {
        std::memcpy(kb + g * ls.hs, s.k_rot.data() + (t * p.kv_heads + g) * d, d * sizeof(T));
        std::memcpy(kb + ls.kvs + g * ls.hs, s.qkv_out.data() + t * p.qkv.out + nq + nkv + g * d, d * sizeof(T));
      }
    }
  }
  if (!team.sync()) return false;
  kvrelay_cpu::AttentionWork<T> att{s.q.data(), ls.cache, ls.cache + ls.kvs, ls.bs, ls.tb->tp, ls.tb->width,
                                    ls.tb->lp, s.attn.data(), t_rows, p.heads, p.kv_heads, ls.block_size, d,
                                    static_cast<float>(p.scale), p.window, nullptr, parts, p.heads / p.kv_heads,
                                    nullptr, nullptr, nullptr};
  att.place(s.att.data());
  {  // the splits paged_decode_attention's at::parallel_for calls make
    const auto [begin, end] = team.share(att.items(), 1);
    kvrelay_cpu::attention_items(att, begin, end);
  }
  if (!team.sync()) return false;
  {
    const auto [begin, end] = team.share(att.pairs(), 8);
    kvrelay_cpu::attention_merge(att, begin, end);
  }
  if (!team.sync()) return false;
  // o_proj, the residual, the MLP's norm
  if (!team_linear(team, p.out, s.attn.data(), t_rows, nq, s.o.data(), s, balance, 1) || !team.sync()) return false;
  if (team.lead()) {
    add_into(x, s.o.data(), t_rows * hidden);
    kvrelay_cpu::rms_norm_rows(static_cast<const T*>(x), p.post_norm, s.h.data(), t_rows, hidden, p.eps);
  }
  if (!team.sync()) return false;
  // MLP: [gate; up], silu * up, down, the residual
  if (!team_linear(team, p.gate_up, s.h.data(), t_rows, hidden, s.gu.data(), s, balance, 2) || !team.sync())
    return false;
  {  // split at multiples of kLanes: each column then takes the vector or scalar exp it takes in one whole-row loop
    const int64_t chunks = (p.inter + kLanes - 1) / kLanes;
    const auto [begin, end] = team.share(chunks, 4);
    kvrelay_cpu::silu_mul_cols(s.gu.data(), 2 * p.inter, s.act.data(), t_rows, p.inter, begin * kLanes,
                               std::min(p.inter, end * kLanes));
  }
  if (!team.sync()) return false;
  if (!team_linear(team, p.down, s.act.data(), t_rows, p.inter, s.o.data(), s, balance, 3) || !team.sync())
    return false;
  if (team.lead()) {
    add_into(x, s.o.data(), t_rows * hidden);
    if (next_norm != nullptr)
      kvrelay_cpu::rms_norm_rows(static_cast<const T*>(x), next_norm, s.h.data(), t_rows, hidden, next_eps);
    else if (final_norm != nullptr)  // in place: each row is read whole before it is written
      kvrelay_cpu::rms_norm_rows(static_cast<const T*>(x), final_norm, x, t_rows, hidden, final_eps);
  }
  return team.sync();
}

// Whether logit a ranks above b as torch.argmax ranks them: NaN above any number (found from the bits: this file
// builds with -ffast-math, under which a NaN test may be folded away), else the larger.
inline bool ranks_above(float a, float b) {
  const auto nan = [](float v) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    return (u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0;
  };
  if (nan(a)) return !nan(b);
  return !nan(b) && a > b;
}

// logits [T, head.out] (float32) = x W^T for the LM head's blocked W, this thread's groups: summed and rounded to T
// as blocked_linear does, then widened (the bits of torch's .float() of blocked_linear's result). With greedy
// (else null), the lead then writes each row's torch.argmax into greedy[t]: its largest logit's column, the first
// of equal ones, a NaN above any number. Syncs after.
template <typename T>
bool team_head(const TeamThread& team, const Blocked<T>& w, const T* x, int64_t t_rows, int64_t in, float* logits,
               int64_t* greedy, StepBalance* balance, Scratch<T>& s) {
  const auto [begin, end] = linear_share(team, w.groups, balance, 4);
  const int64_t c0 = begin * kLanes, c1 = std::min(w.out, end * kLanes);
  if constexpr (std::is_same_v<T, float>) {
    if (!team_linear(team, w, x, t_rows, in, logits, s, balance, 4)) return false;
  } else {
    if (!team_linear(team, w, x, t_rows, in, s.head.data(), s, balance, 4)) return false;
    for (int64_t t = 0; t < t_rows; ++t)
      for (int64_t c = c0; c < c1; ++c) logits[t * w.out + c] = static_cast<float>(s.head[t * w.out + c]);
  }
  if (greedy != nullptr) {  // each thread over its own columns (still in its cache), then the lead over the threads
    for (int64_t t = 0; t < t_rows; ++t) {
      const float* row = logits + t * w.out;
      int64_t at = c0 < c1 ? c0 : -1;
      for (int64_t c = c0 + 1; c < c1; ++c)
        if (ranks_above(row[c], row[at])) at = c;
      s.best_at[team.tid * t_rows + t] = at;
      if (at >= 0) s.best[team.tid * t_rows + t] = row[at];
    }
    if (!team.sync()) return false;
    if (team.lead())
      for (int64_t t = 0; t < t_rows; ++t) {
        int64_t at = -1;
        float best = 0.f;
        for (int64_t k = 0; k < team.threads; ++k) {  // in column order: a later thread wins only by ranking above
          const int64_t c = s.best_at[k * t_rows + t];
          if (c >= 0 && (at < 0 || ranks_above(s.best[k * t_rows + t], best))) at = c, best = s.best[k * t_rows + t];
        }
        greedy[t] = at;
      }
  }
  return team.sync();
}

// Layers 0 .. n-1 of a step over x [T, hidden] (in place), by a team of at::get_num_threads() threads in one
// parallel region (one thread: no region). steps[i] is layer i's cache, slots and tables; final_norm (or null)
// normalises the last layer's output; s is the step's scratch (sized here: grown, never shrunk, so that a caller
// that keeps it allocates nothing in the steady state); head (or null: logits and greedy are then unused) then
// writes the LM head's float32 logits [T, head->out] into logits, and each row's argmax into greedy [T] where not
// null. With balance (or null), a team of two cuts each linear layer where it says and moves the cuts after the
// step. fixed_parts > 0: the attention splits each sequence's keys into that many parts whatever the batch and the
// thread count (paged_decode_attention's `parts`: deterministic mode's 1); 0: attention_parts' rule. Raises
// (RuntimeError) what a team thread raised (none is expected: the inputs are checked and the buffers sized before
// the team starts).
template <typename T>
void run_layers(const std::vector<const LayerPlan<T>*>& plans, const std::vector<LayerStep<T>>& steps, T* x,
                int64_t t_rows, const T* cp, const T* snp, const T* final_norm, float final_eps, Scratch<T>& s,
                const Blocked<T>* head = nullptr, float* logits = nullptr, int64_t* greedy = nullptr,
                Balance* balance = nullptr, int64_t fixed_parts = 0) {
  const int64_t threads = std::max<int64_t>(1, at::in_parallel_region() ? 1 : at::get_num_threads());
  // the parts paged_decode_attention splits the keys into, from the thread count it sees (the same bits)
  const int64_t parts = fixed_parts > 0 ? fixed_parts
                                        : kvrelay_cpu::attention_parts(t_rows, plans[0]->kv_heads,
                                                                       at::get_num_threads());
  for (const LayerPlan<T>* p : plans) s.fit(*p, t_rows, parts);
  if (head != nullptr) s.fit_head(*head, t_rows, threads);
  const int64_t n = static_cast<int64_t>(plans.size());
  StepBalance step_balance{balance};
  StepBalance* const timed = balance != nullptr ? &step_balance : nullptr;
  SpinBarrier barrier(static_cast<int>(threads));
  std::exception_ptr error;
  std::mutex error_mutex;
  const auto body = [&](int64_t tid, int64_t team_size) {
    const TeamThread team{tid, team_size, &barrier};
    try {
      if (team.lead())
        kvrelay_cpu::rms_norm_rows(static_cast<const T*>(x), plans[0]->in_norm, s.h.data(), t_rows, plans[0]->hidden,
                                   plans[0]->eps);
      if (!team.sync()) return;
      for (int64_t i = 0; i < n; ++i) {
        const bool last = i + 1 == n;
        if (!run_layer(team, *plans[i], x, t_rows, cp, snp, steps[i], parts, last ? nullptr : plans[i + 1]->in_norm,
                       last ? 0.f : plans[i + 1]->eps, last ? final_norm : nullptr, final_eps, timed, s))
          return;
      }
      if (head != nullptr && !team_head(team, *head, x, t_rows, plans[0]->hidden, logits, greedy, timed, s)) return;
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      barrier.failed.store(true);
    }
  };
  if (threads == 1) {
    body(0, 1);
  } else {
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
      barrier.set_threads(omp_get_num_threads());  // the team may be smaller than asked; single ends in a barrier
      body(omp_get_thread_num(), omp_get_num_threads());
    }
  }
  if (error) std::rethrow_exception(error);
  if (balance != nullptr) step_balance.update(*balance);
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
  const int64_t t_rows = x.size(0);
  const LayerPlan<T> p = plan_layer<T>(x.size(1), in_norm, post_norm, eps, qkv_w, qkv_b, o_w, o_b, gate_up_w,
                                       gate_up_b, down_w, down_b, dims, scale, window);
  const StepTables tb = step_tables(block_tables, seq_lens, t_rows);
  check_rotary(p, t_rows, cos, sin);
  TORCH_CHECK(layer_cache.dim() == 5, "decode_layer: layer_cache must be [num_blocks, 2, kv_heads, B, head_dim]");
  const CacheGeometry c = cache_geometry(layer_cache);
  LayerStep<T> step = check_cache(p, c, nullptr, tb);
  kvrelay_cpu::check_block_tables(tb.tp, tb.width, tb.lp, t_rows, step.block_size, p.window, c.sizes[0]);
  const at::Tensor slots = check_slots(slot_mapping, t_rows, c.sizes[0], step.block_size);
  step.sp = slots.data_ptr<int64_t>();
  auto y = x.clone();
  Scratch<T> s;
  run_layers<T>({&p}, {step}, y.data_ptr<T>(), t_rows, cos.data_ptr<T>(), sin.data_ptr<T>(), nullptr, 0.f, s);
  return y;
}

}  // namespace

at::Tensor decode_layer(at::Tensor x, at::Tensor in_norm, at::Tensor post_norm, double eps, at::Tensor qkv_w,
                        c10::optional<at::Tensor> qkv_b, at::Tensor o_w, c10::optional<at::Tensor> o_b,
                        at::Tensor gate_up_w, c10::optional<at::Tensor> gate_up_b, at::Tensor down_w,
                        c10::optional<at::Tensor> down_b, std::vector<int64_t> dims, at::Tensor cos, at::Tensor sin,
                        at::Tensor layer_cache, at::Tensor slot_mapping, at::Tensor block_tables,
                        at::Tensor seq_lens, double scale, int64_t window) {
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

inline at::Tensor long_tensor(const std::vector<int64_t>& values) {  // int64 [n], a copy of values
  auto out = at::empty({static_cast<int64_t>(values.size())}, at::kLong);
  if (!values.empty()) std::memcpy(out.data_ptr<int64_t>(), values.data(), values.size() * sizeof(int64_t));
  return out;
}

// Ragged block tables (T lists of block ids) as int32 [T, W], W the longest, each padded with block 0 (never
// read past the sequence's length). Raises (RuntimeError) on an id outside int32, named as the table checks name a
// bad id.
inline at::Tensor padded_tables(const std::vector<std::vector<int64_t>>& lists) {
  size_t width = 0;
  for (const auto& l : lists) width = std::max(width, l.size());
  auto out = at::zeros({static_cast<int64_t>(lists.size()), static_cast<int64_t>(width)}, at::kInt);
  int32_t* p = out.data_ptr<int32_t>();
  for (size_t t = 0; t < lists.size(); ++t)
    for (size_t j = 0; j < lists[t].size(); ++j) {
      const int64_t id = lists[t][j];
      TORCH_CHECK(id >= 0 && id <= INT32_MAX, "sequence ", t, ": block id out of range (", id, ")");
      p[t * width + j] = static_cast<int32_t>(id);
    }
  return out;
}

// DecodeStack: a model's decoder layers for decode_layer, planned (checked) once, then run as one call a step:
// the per-layer Python call (its ~21 arguments converted, the KV pool sliced, the step's metadata looked up) was
// ~130 us a layer, ~4 ms of a ~46 ms batch-1 float32 SmolLM2 step on a Zen 1 VM. The layers run in the order
// added, each exactly as decode_layer runs it (the same bits).
//   add_layer(<decode_layer's weight arguments>, dims, scale, window, group, local): the layer reads and writes
//       local layer `local` of the KV pool's blocks through KV block group `group`'s slots and tables. Every layer
//       must share the first one's dtype and hidden size. Raises (RuntimeError) as decode_layer does.
//   forward(x, cos, sin, kv_pool, slot_mappings, block_tables, seq_lens): x [T, hidden] contiguous, the first
//       layer's input; kv_pool [num_blocks, layers per block, 2, kv_heads, B, head_dim]; the three lists hold one
//       tensor per KV block group, as decode_layer's. Returns the last layer's output [T, hidden], through the
//       final norm where one is set. Every input is checked for every layer before any KV is written. Runs without
//       Python's GIL.
//   set_final_norm(weight, eps): the model's final RMSNorm, applied by forward after the last layer with the
//       kernel of the layers' norms (the bits of kernels.cpu_small.rms_norm). In the step's own call it costs a
//       few us; as its own call after the layers it took 133-148 us of a batch-1 bf16 SmolLM2 step on a Zen 4 VM
//       (its code is cold once the step has streamed the weights). weight [hidden] contiguous, of the layers'
//       dtype; raises (RuntimeError) otherwise or when the stack has no layers.
//   set_ends(embedding, head_w, vocab): the model's token embedding [rows, hidden] (contiguous, the layers' dtype)
//       and its LM head (head_w in blocked_linear's layout of a [vocab, hidden] weight, no bias), for logits. Needs
//       the final norm set first; raises (RuntimeError) otherwise or on a shape or dtype that does not fit.
//   logits(ids, rope_rows, cos_table, sin_table, kv_pool, slots, tables, lens): forward from the T token ids (a
//       list of ints), with token t's cos and sin row rope_rows[t] of the tables ([rows, head_dim], the layers'
//       dtype; model.rope.RotaryRows), then the head, in the one parallel region. The step's metadata comes as
//       lists, per KV block group: slots[group] (T ints) and tables[group] (T lists of block ids, ragged: padded
//       here with block 0); lens (T ints) for every group (the lists cost less to pass than tensors built in Python
//       each step: a batch-1 bf16 SmolLM2 step on a Zen 4 VM spent ~0.2 ms building them and the step's
//       AttentionBatch). Returns
//       (float32 [T, vocab], the bits of blocked_linear's head over forward's output, widened to float32 (torch's
//       .float()); each row's torch.argmax as a list of T ints: the first of equal maxima, a NaN above any number).
//       The embedding rows are copied as torch.embedding's lookup gives them. A batch-1 bf16 SmolLM2 step on a Zen
//       4 VM, alternated step by step with forward then compute_logits (6 rounds of 128 steps each): 0.95-1.02x the
//       time with the head in this call, 0.92-0.96x with the greedy token and the rotary rows too.
//       Raises (RuntimeError) on an id outside the embedding's rows or a row outside the tables, a list of the
//       wrong length, a block id outside int32, and as forward does, before any KV is written; or when set_ends was
//       not called.
//   cuts(), set_cuts(permille): where a team of two splits the output groups of each kind of linear layer ([q; k;
//       v], o, [gate; up], down, the head), in thousandths of the groups the lead takes (Balance: each step of
//       forward or logits measures both threads and moves the cuts; set_cuts starts them elsewhere, each in
//       200 .. 800, else raises RuntimeError). The cuts change which thread computes a group, never its bits.
class DecodeStack {
 public:
  void add_layer(const at::Tensor& in_norm, const at::Tensor& post_norm, double eps, const at::Tensor& qkv_w,
                 const c10::optional<at::Tensor>& qkv_b, const at::Tensor& o_w, const c10::optional<at::Tensor>& o_b,
                 const at::Tensor& gate_up_w, const c10::optional<at::Tensor>& gate_up_b, const at::Tensor& down_w,
                 const c10::optional<at::Tensor>& down_b, const std::vector<int64_t>& dims, double scale,
                 int64_t window, int64_t group, int64_t local) {
    TORCH_CHECK(in_norm.dim() == 1 && (in_norm.scalar_type() == at::kFloat || in_norm.scalar_type() == at::kBFloat16),
                "DecodeStack: the norm weights must be bf16 or float32 [hidden]");
    if (groups_.empty()) {
      dtype_ = in_norm.scalar_type();
      hidden_ = in_norm.size(0);
    }
    TORCH_CHECK(in_norm.scalar_type() == dtype_ && in_norm.size(0) == hidden_, "DecodeStack: layer ",
                groups_.size(), " is not ", dtype_, " of hidden size ", hidden_, " as the first layer is");
    TORCH_CHECK(group >= 0 && local >= 0, "DecodeStack: group and local must be >= 0");
    if (dtype_ == at::kFloat)
      f32_.push_back(plan_layer<float>(hidden_, in_norm, post_norm, eps, qkv_w, qkv_b, o_w, o_b, gate_up_w,
                                       gate_up_b, down_w, down_b, dims, scale, window));
    else
      bf16_.push_back(plan_layer<at::BFloat16>(hidden_, in_norm, post_norm, eps, qkv_w, qkv_b, o_w, o_b, gate_up_w,
                                               gate_up_b, down_w, down_b, dims, scale, window));
    for (const at::Tensor* t : {&in_norm, &post_norm, &qkv_w, &o_w, &gate_up_w, &down_w}) keep_.push_back(*t);
    for (const c10::optional<at::Tensor>* b : {&qkv_b, &o_b, &gate_up_b, &down_b})
      if (b->has_value()) keep_.push_back(**b);
    groups_.push_back(group);
    locals_.push_back(local);
  }

  int64_t size() const { return static_cast<int64_t>(groups_.size()); }

  void set_ends(const at::Tensor& embedding, const at::Tensor& head_w, int64_t vocab) {
    TORCH_CHECK(final_norm_.defined(), "DecodeStack: set the final norm before the embedding and head");
    TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == hidden_ && embedding.scalar_type() == dtype_ &&
                    embedding.is_contiguous() && embedding.size(0) >= 1,
                "DecodeStack: the embedding must be contiguous ", dtype_, " [vocab, ", hidden_, "]");
    TORCH_CHECK(vocab >= 1, "DecodeStack: the head's vocabulary must be >= 1, got ", vocab);
    if (dtype_ == at::kFloat)
      head_f32_ = blocked<float>(head_w, c10::nullopt, hidden_, vocab, "head_w");
    else
      head_bf16_ = blocked<at::BFloat16>(head_w, c10::nullopt, hidden_, vocab, "head_w");
    embedding_ = embedding;
    head_w_ = head_w;
    vocab_ = vocab;
  }

  bool has_ends() const { return embedding_.defined(); }

  std::vector<int64_t> cuts() const {
    std::vector<int64_t> v;
    for (const auto& p : balance_.permille) v.push_back(p.load(std::memory_order_relaxed));
    return v;
  }

  void set_cuts(const std::vector<int64_t>& permille) {
    TORCH_CHECK(permille.size() == Balance::kKinds, "DecodeStack: one cut for each of the ", Balance::kKinds,
                " kinds of linear layer");
    for (const int64_t p : permille)
      TORCH_CHECK(p >= Balance::kMin && p <= Balance::kMax, "DecodeStack: a cut must lie in ", Balance::kMin, " .. ",
                  Balance::kMax, " thousandths; got ", p);
    for (int k = 0; k < Balance::kKinds; ++k)
      balance_.permille[k].store(static_cast<int32_t>(permille[k]), std::memory_order_relaxed);
  }

  // Each sequence's keys in `parts` parts at every step (paged_decode_attention's `parts`), or 0 for the rule that
  // splits them when the batch is small (the default).
  void set_fixed_parts(int64_t parts) {
    TORCH_CHECK(parts >= 0, "DecodeStack: parts must be >= 1, or 0 for the thread-count rule; got ", parts);
    fixed_parts_ = parts;
  }
  int64_t fixed_parts() const { return fixed_parts_; }

  void set_final_norm(const at::Tensor& weight, double eps) {
    TORCH_CHECK(!groups_.empty(), "DecodeStack: add the layers before the final norm");
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden_ && weight.scalar_type() == dtype_ &&
                    weight.is_contiguous(),
                "DecodeStack: the final norm weight must be contiguous ", dtype_, " [", hidden_, "]");
    final_norm_ = weight;
    final_eps_ = eps;
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_pool,
                     const std::vector<at::Tensor>& slot_mappings, const std::vector<at::Tensor>& block_tables,
                     const std::vector<at::Tensor>& seq_lens) const {
    TORCH_CHECK(!groups_.empty(), "DecodeStack: no layers");
    TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == hidden_ && x.is_contiguous() &&
                    x.scalar_type() == dtype_,
                "DecodeStack: x must be a contiguous ", dtype_, " [T, ", hidden_, "], T >= 1");
    TORCH_CHECK(kv_pool.dim() == 6, "DecodeStack: kv_pool must be [num_blocks, layers, 2, kv_heads, B, head_dim]");
    TORCH_CHECK(slot_mappings.size() == block_tables.size() && slot_mappings.size() == seq_lens.size(),
                "DecodeStack: one slot mapping, block table and length tensor per KV block group");
    auto y = x.clone();
    if (dtype_ == at::kFloat) run<float>(f32_, y, cos, sin, kv_pool, slot_mappings, block_tables, seq_lens, nullptr);
    else run<at::BFloat16>(bf16_, y, cos, sin, kv_pool, slot_mappings, block_tables, seq_lens, nullptr);
    return y;
  }

  std::tuple<at::Tensor, std::vector<int64_t>> logits(
      const std::vector<int64_t>& ids, const std::vector<int64_t>& rope_rows, const at::Tensor& cos_table,
      const at::Tensor& sin_table, const at::Tensor& kv_pool, const std::vector<std::vector<int64_t>>& slot_lists,
      const std::vector<std::vector<std::vector<int64_t>>>& table_lists, const std::vector<int64_t>& len_list) const {
    TORCH_CHECK(!groups_.empty(), "DecodeStack: no layers");
    TORCH_CHECK(has_ends(), "DecodeStack: no embedding and head (set_ends)");
    TORCH_CHECK(!ids.empty() && rope_rows.size() == ids.size(), "DecodeStack: one rotary row per token id, T >= 1");
    TORCH_CHECK(cos_table.dim() == 2 && cos_table.sizes() == sin_table.sizes() &&
                    cos_table.scalar_type() == dtype_ && sin_table.scalar_type() == dtype_ &&
                    cos_table.is_contiguous() && sin_table.is_contiguous(),
                "DecodeStack: the rotary tables must be contiguous ", dtype_, " [rows, head_dim], both alike");
    TORCH_CHECK(kv_pool.dim() == 6, "DecodeStack: kv_pool must be [num_blocks, layers, 2, kv_heads, B, head_dim]");
    const int64_t t_rows = static_cast<int64_t>(ids.size()), rows = embedding_.size(0);
    TORCH_CHECK(slot_lists.size() == table_lists.size(),
                "DecodeStack: one slot list and table list per KV block group");
    TORCH_CHECK(static_cast<int64_t>(len_list.size()) == t_rows, "DecodeStack: one KV length per token id");
    std::vector<at::Tensor> slot_mappings, block_tables, seq_lens;  // the lists as run reads them
    for (size_t g = 0; g < slot_lists.size(); ++g) {
      TORCH_CHECK(static_cast<int64_t>(slot_lists[g].size()) == t_rows &&
                      static_cast<int64_t>(table_lists[g].size()) == t_rows,
                  "DecodeStack: KV block group ", g, " needs one slot and one block table per token id");
      slot_mappings.push_back(long_tensor(slot_lists[g]));
      block_tables.push_back(padded_tables(table_lists[g]));
      seq_lens.push_back(long_tensor(len_list));
    }
    const int64_t table_rows = cos_table.size(0);
    for (int64_t t = 0; t < t_rows; ++t) {
      TORCH_CHECK(ids[t] >= 0 && ids[t] < rows, "DecodeStack: token ", t, "'s id ", ids[t], " is outside the ", rows,
                  " rows of the embedding");
      TORCH_CHECK(rope_rows[t] >= 0 && rope_rows[t] < table_rows, "DecodeStack: token ", t, "'s rotary row ",
                  rope_rows[t], " is outside the ", table_rows, " rows of the tables");
    }
    const auto gather = [t_rows](const at::Tensor& table, const std::vector<int64_t>& at_rows) {
      auto out = at::empty({t_rows, table.size(1)}, table.options());
      const auto row_bytes = static_cast<size_t>(table.size(1) * table.element_size());
      for (int64_t t = 0; t < t_rows; ++t)
        std::memcpy(static_cast<char*>(out.data_ptr()) + t * row_bytes,
                    static_cast<const char*>(table.data_ptr()) + at_rows[t] * row_bytes, row_bytes);
      return out;
    };
    auto y = gather(embedding_, ids);
    // checked by run's check_rotary
    const auto cos = gather(cos_table, rope_rows), sin = gather(sin_table, rope_rows);
    auto out = at::empty({t_rows, vocab_}, embedding_.options().dtype(at::kFloat));
    std::vector<int64_t> greedy(static_cast<size_t>(t_rows), -1);
    if (dtype_ == at::kFloat)
      run<float>(f32_, y, cos, sin, kv_pool, slot_mappings, block_tables, seq_lens, out.data_ptr<float>(),
                 greedy.data());
    else
      run<at::BFloat16>(bf16_, y, cos, sin, kv_pool, slot_mappings, block_tables, seq_lens, out.data_ptr<float>(),
                        greedy.data());
    return {out, greedy};
  }

 private:
  // y [T, hidden] (the first layer's input) through every layer, in place; with logits (float32 [T, vocab_], or
  // null) through the final norm and the head too.
  template <typename T>
  void run(const std::vector<LayerPlan<T>>& plans, at::Tensor& y, const at::Tensor& cos, const at::Tensor& sin,
           const at::Tensor& kv_pool, const std::vector<at::Tensor>& slot_mappings,
           const std::vector<at::Tensor>& block_tables, const std::vector<at::Tensor>& seq_lens,
           float* logits, int64_t* greedy = nullptr) const {
    const int64_t t_rows = y.size(0), n = size();
    std::vector<StepTables> tables;  // one per KV block group, as its slots
    std::vector<at::Tensor> slots;
    tables.reserve(block_tables.size());
    for (size_t g = 0; g < block_tables.size(); ++g)
      tables.push_back(step_tables(block_tables[g], seq_lens[g], t_rows));
    const int64_t num_blocks = kv_pool.size(0), block_size = kv_pool.size(4);
    for (const auto& slot_mapping : slot_mappings)
      slots.push_back(check_slots(slot_mapping, t_rows, num_blocks, block_size));
    std::vector<const LayerPlan<T>*> ptrs;
    std::vector<LayerStep<T>> steps;
    std::vector<std::pair<int64_t, int64_t>> checked;  // the (group, window) pairs whose tables are checked
    for (int64_t i = 0; i < n; ++i) {
      const int64_t group = groups_[i];
      TORCH_CHECK(group < static_cast<int64_t>(slot_mappings.size()), "DecodeStack: layer ", i,
                  " reads KV block group ", group, " of ", slot_mappings.size());
      TORCH_CHECK(locals_[i] < kv_pool.size(1), "DecodeStack: layer ", i, " reads local layer ", locals_[i],
                  " of kv_pool's ", kv_pool.size(1));
      check_rotary(plans[i], t_rows, cos, sin);
      const StepTables& tb = tables[group];
      steps.push_back(
          check_cache(plans[i], pool_geometry(kv_pool, locals_[i]), slots[group].data_ptr<int64_t>(), tb));
      if (std::find(checked.begin(), checked.end(), std::pair{group, plans[i].window}) == checked.end()) {
        kvrelay_cpu::check_block_tables(tb.tp, tb.width, tb.lp, t_rows, block_size, plans[i].window, num_blocks);
        checked.emplace_back(group, plans[i].window);
      }
      ptrs.push_back(&plans[i]);
    }
    const Blocked<T>* head = nullptr;
    if (logits != nullptr) {
      if constexpr (std::is_same_v<T, float>) head = &head_f32_;
      else head = &head_bf16_;
    }
    std::lock_guard<std::mutex> lock(scratch_mutex_);  // one step at a time on the stack's scratch
    Scratch<T>* scratch;
    if constexpr (std::is_same_v<T, float>) scratch = &scratch_f32_;
    else scratch = &scratch_bf16_;
    run_layers<T>(ptrs, steps, y.data_ptr<T>(), t_rows, cos.data_ptr<T>(), sin.data_ptr<T>(),
                  final_norm_.defined() ? final_norm_.data_ptr<T>() : nullptr, static_cast<float>(final_eps_),
                  *scratch, head, logits, greedy, &balance_, fixed_parts_);
  }

  at::ScalarType dtype_ = at::kFloat;
  int64_t hidden_ = 0;
  std::vector<LayerPlan<float>> f32_;
  std::vector<LayerPlan<at::BFloat16>> bf16_;
  std::vector<at::Tensor> keep_;  // the planned weights, alive while the stack is
  std::vector<int64_t> groups_, locals_;
  at::Tensor final_norm_;  // undefined: none
  double final_eps_ = 0.0;
  at::Tensor embedding_, head_w_;  // undefined: none (set_ends)
  Blocked<float> head_f32_{};
  Blocked<at::BFloat16> head_bf16_{};
  int64_t vocab_ = 0;
  mutable Balance balance_;  // how the team of two splits each kind of linear layer, learnt step by step
  int64_t fixed_parts_ = 0;  // set_fixed_parts
  // A step's intermediate rows, kept from step to step: sized anew each step they allocated, and at 16 rows the
  // head's ~1.5 MB bf16 buffer was mapped and faulted in each step.
  mutable std::mutex scratch_mutex_;
  mutable Scratch<float> scratch_f32_;
  mutable Scratch<at::BFloat16> scratch_bf16_;
};

void bind_decode_stack(pybind11::module_& m) {
  // module_local: a second build of this extension in one process (the tests' plain build) registers its own type
  pybind11::class_<DecodeStack>(m, "DecodeStack", pybind11::module_local(),
                                "decoder layers run as one call a decode step (decode_layer.cpp)")
      .def(pybind11::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("__len__", &DecodeStack::size)
      .def("set_final_norm", &DecodeStack::set_final_norm)
      .def("set_ends", &DecodeStack::set_ends)
      .def("cuts", &DecodeStack::cuts)
      .def("set_cuts", &DecodeStack::set_cuts)
      .def("set_fixed_parts", &DecodeStack::set_fixed_parts)
      .def("fixed_parts", &DecodeStack::fixed_parts)
      .def("has_ends", &DecodeStack::has_ends)
      .def("logits", &DecodeStack::logits, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
