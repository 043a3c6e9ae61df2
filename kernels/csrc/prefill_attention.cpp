// Flash-style paged prefill attention for bf16 on the CPU: the score matrix is never materialised.
//
// Same contract as kernels/reference.py::prefill_attention without token weights, window or sinks:
//   q               [T, Hq, D] bfloat16, contiguous, D a multiple of 16: each sequence's chunk of queries, in order
//   k/v_cache       [num_blocks, Hkv, B, D] bfloat16 (strided over the block dimension allowed: each block's
//                   [Hkv, B, D] must be contiguous)
//   block_tables    [N, W] int32 or int64, seq_lens [N], query_start_loc [N + 1]: sequence n's queries are rows
//                   query_start_loc[n] .. query_start_loc[n+1]-1 of q, at positions len - q_len .. len - 1, and
//                   each sees every key up to its own position (a causal chunk over a cached prefix)
//   returns         [T, Hq, D] bfloat16
// For each sequence its keys are first copied out of the pages into small_ops.h's blocked layout (K as a weight
// of [len, D], V^T as one of [D, len]: 16 lanes by 2 bf16 per word), so that both products of attention are
// group_dot calls: VDPBF16PS over 16 query rows at a time where the CPU has AVX512-BF16. Work items are
// (query head, tile of 16 query rows), each walking its keys in chunks of kChunk with an online softmax
// (running max and sum per row, float32); the probabilities are rounded to bf16 for the product with V, as
// torch's flash attention does for bf16. A tile stops at its last row's position, so the causal half above the
// diagonal is skipped. torch's CPU flash attention ran this at ~0.12 TFLOP/s on a 2-core Zen 4 VM (SmolLM2,
// 2,048 tokens), against ~0.4 for its bf16 matmuls.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "small_ops.h"

namespace {

using kvrelay_cpu::group_dot_up_to;
using kvrelay_cpu::kLanes;
using kvrelay_cpu::kTile;

constexpr int64_t kChunk = 128;    // keys per step of the online softmax (a multiple of kLanes)
constexpr float kMasked = -1e30f;  // the score of a key a row may not see (finite: -ffast-math assumes no infinities)

inline uint32_t pair_bits(const at::BFloat16& lo, const at::BFloat16& hi) {
  return static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
}

// Sequence n's keys in the blocked layouts: kb [Hkv][ceil(len/16)][D/2][16] and vt [Hkv][D/16][pairs][16], pairs =
// ceil(len/2) rounded up to a whole chunk; words past the keys are zero.
void pack_sequence(const at::BFloat16* k_cache, const at::BFloat16* v_cache, int64_t block_stride,
                   const int64_t* table, int64_t len, int64_t hkv, int64_t block_size, int64_t d, int64_t key_groups,
                   int64_t pairs, uint32_t* kb, uint32_t* vt) {
  const int64_t d2 = d / 2, dg = d / kLanes;
  at::parallel_for(0, hkv * key_groups, 8, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / key_groups, g = item % key_groups;
      uint32_t* kg = kb + (h * key_groups + g) * d2 * kLanes;
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        const int64_t t = g * kLanes + lane;
        if (t >= len) {
          for (int64_t p = 0; p < d2; ++p) kg[p * kLanes + lane] = 0u;
          continue;
        }
        const at::BFloat16* kp = k_cache + table[t / block_size] * block_stride + (h * block_size + t % block_size) * d;
        for (int64_t p = 0; p < d2; ++p) kg[p * kLanes + lane] = pair_bits(kp[2 * p], kp[2 * p + 1]);
      }
      // V^T: this group's 16 keys are 8 pairs of every dimension's row.
      for (int64_t j = g * kLanes / 2; j < (g + 1) * kLanes / 2; ++j) {
        const int64_t t0 = 2 * j, t1 = 2 * j + 1;
        const at::BFloat16 zero(0.0f);
        const at::BFloat16* v0 = t0 < len
            ? v_cache + table[t0 / block_size] * block_stride + (h * block_size + t0 % block_size) * d : nullptr;
        const at::BFloat16* v1 = t1 < len
            ? v_cache + table[t1 / block_size] * block_stride + (h * block_size + t1 % block_size) * d : nullptr;
        for (int64_t i = 0; i < d; ++i)
          vt[((h * dg + i / kLanes) * pairs + j) * kLanes + i % kLanes] =
              pair_bits(v0 ? v0[i] : zero, v1 ? v1[i] : zero);
      }
    }
  });
  // Pairs past the key groups (the rest of the last chunk) stay zero.
  const int64_t packed_pairs = key_groups * kLanes / 2;
  for (int64_t row = 0; row < hkv * dg; ++row)
    std::fill(vt + (row * pairs + packed_pairs) * kLanes, vt + (row + 1) * pairs * kLanes, 0u);
}

// x[0 .. n-1] (n a multiple of 16) rounded to bf16 (to nearest, even), as pairs: p[j] = (x[2j], x[2j+1]).
inline void to_bf16_pairs(const float* x, int64_t n, uint32_t* p) {
#if defined(__AVX512BF16__)
  int64_t j = 0;
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
    const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + j + kLanes), _mm512_loadu_ps(x + j));
    _mm512_storeu_si512(p + j / 2, (__m512i)pair);
  }
  if (j < n) {
    const __m256bh half = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j / 2), (__m256i)half);
  }
#else
  for (int64_t j = 0; j < n / 2; ++j) p[j] = pair_bits(at::BFloat16(x[2 * j]), at::BFloat16(x[2 * j + 1]));
#endif
}

// One tile: rows r0 .. r0+tt-1 of sequence's queries (q points at the sequence's first row) for query head qh.
void attend_tile(const at::BFloat16* q, at::BFloat16* out, int64_t hq, int64_t d, int64_t qh, int64_t h, int64_t r0,
                 int64_t tt, int64_t ctx, const uint32_t* kb, const uint32_t* vt, int64_t key_groups, int64_t pairs,
                 float scale, float* scores, uint32_t* probs, float* acc, float* row_max, float* row_sum,
                 float* dot) {
  const int64_t d2 = d / 2, dg = d / kLanes;
  const int64_t keys = ctx + r0 + tt;  // the last row sees keys 0 .. keys-1
  const uint32_t* qx = reinterpret_cast<const uint32_t*>(q + (r0 * hq + qh) * d);
  const int64_t qs = hq * d / 2;  // words between rows of one head
  const uint32_t* kh = kb + h * key_groups * d2 * kLanes;
  const uint32_t* vh = vt + h * dg * pairs * kLanes;
  std::fill(acc, acc + tt * d, 0.0f);
  std::fill(row_max, row_max + tt, kMasked);
  std::fill(row_sum, row_sum + tt, 0.0f);
  for (int64_t c0 = 0; c0 < keys; c0 += kChunk) {
    const int64_t cn = std::min(kChunk, keys - c0);
    const int64_t groups = (cn + kLanes - 1) / kLanes;
    for (int64_t g = 0; g < groups; ++g) {
      group_dot_up_to<kTile>(tt, kh + (c0 / kLanes + g) * d2 * kLanes, d2, qx, qs, dot);
      for (int64_t t = 0; t < tt; ++t)
        std::copy(dot + t * kLanes, dot + (t + 1) * kLanes, scores + t * kChunk + g * kLanes);
    }
    const int64_t width = groups * kLanes;  // scores filled; the keys past cn (and past each row's own) are masked
    for (int64_t t = 0; t < tt; ++t) {
      float* s = scores + t * kChunk;
      const int64_t visible = std::min(cn, ctx + r0 + t + 1 - c0);  // this row's keys in the chunk (may be <= 0)
      for (int64_t j = std::max<int64_t>(visible, 0); j < width; ++j) s[j] = kMasked;
      // Unscaled dot products: the scale (> 0) goes into the exponent, after the max.
      float mx = row_max[t];
      for (int64_t j = 0; j < width; ++j) mx = std::max(mx, s[j]);
      const float corr = std::exp((row_max[t] - mx) * scale);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < width; ++j) {
        s[j] = std::exp((s[j] - mx) * scale);  // vectorized through glibc's libmvec (-ffast-math)
        sum += s[j];
      }
      row_sum[t] = row_sum[t] * corr + sum;
      row_max[t] = mx;
      float* a = acc + t * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] *= corr;
      to_bf16_pairs(s, width, probs + t * (kChunk / 2));
    }
    for (int64_t i = 0; i < dg; ++i) {
      group_dot_up_to<kTile>(tt, vh + (i * pairs + c0 / 2) * kLanes, width / 2, probs, kChunk / 2, dot);
      for (int64_t t = 0; t < tt; ++t)
        for (int64_t l = 0; l < kLanes; ++l) acc[t * d + i * kLanes + l] += dot[t * kLanes + l];
    }
  }
  for (int64_t t = 0; t < tt; ++t) {
    const float inv = 1.0f / row_sum[t];
    at::BFloat16* o = out + ((r0 + t) * hq + qh) * d;
    for (int64_t i = 0; i < d; ++i) o[i] = at::BFloat16(acc[t * d + i] * inv);
  }
}

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4 && cache.scalar_type() == at::kBFloat16, name,
              " must be a bf16 [num_blocks, Hkv, B, D]");
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == cache.size(3) &&
                  cache.stride(1) == cache.size(2) * cache.size(3),
              name, ": each block's [Hkv, B, D] must be contiguous");
}

}  // namespace

at::Tensor prefill_attention_bf16(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, at::Tensor query_start_loc, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16 && q.device().is_cpu(),
              "q must be a contiguous bf16 [T, Hq, D] CPU tensor");
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.stride(0) == v_cache.stride(0),
              "k_cache and v_cache must have the same shape and block stride");
  const int64_t total = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(1), block_size = k_cache.size(2), num_blocks = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == d && d % kLanes == 0 && hq % hkv == 0,
              "head shapes of q and the caches do not match (or D is not a multiple of 16)");
  TORCH_CHECK(scale > 0, "scale must be > 0, got ", scale);
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  auto starts = query_start_loc.to(at::kLong).contiguous();
  const int64_t n = lens.numel();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == n && starts.numel() == n + 1,
              "one table row and length per sequence, and N + 1 query starts");
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  TORCH_CHECK(sp[0] == 0 && sp[n] == total, "query_start_loc must run from 0 to q's rows");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t q_len = sp[i + 1] - sp[i];
    TORCH_CHECK(q_len >= 0 && q_len <= lp[i], "sequence ", i, ": ", q_len, " queries for length ", lp[i]);
    TORCH_CHECK((lp[i] + block_size - 1) / block_size <= tables.size(1),
                "sequence ", i, ": length ", lp[i], " does not fit its block table");
    for (int64_t b = 0; b < (lp[i] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tp[i * tables.size(1) + b] >= 0 && tp[i * tables.size(1) + b] < num_blocks,
                  "sequence ", i, ": block id out of range");
  }
  auto out = at::empty_like(q);
  const auto* qp = q.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const auto* kc = k_cache.data_ptr<at::BFloat16>();
  const auto* vc = v_cache.data_ptr<at::BFloat16>();
  const int64_t group = hq / hkv, d2 = d / 2;
  std::vector<uint32_t> kb, vt;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t q_len = sp[i + 1] - sp[i], len = lp[i], ctx = len - q_len;
    if (q_len == 0) continue;
    const int64_t key_groups = (len + kLanes - 1) / kLanes;
    const int64_t pairs = (len + kChunk - 1) / kChunk * kChunk / 2;
    kb.resize(static_cast<size_t>(hkv * key_groups * d2 * kLanes));
    vt.resize(static_cast<size_t>(hkv * (d / kLanes) * pairs * kLanes));
    pack_sequence(kc, vc, k_cache.stride(0), tp + i * tables.size(1), len, hkv, block_size, d, key_groups, pairs,
                  kb.data(), vt.data());
    const int64_t tiles = (q_len + kTile - 1) / kTile;
    // Items run head by head, so that each thread's share holds short and long tiles alike.
    at::parallel_for(0, hq * tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(kTile * kChunk), acc(kTile * d), row_max(kTile), row_sum(kTile), dot(kTile * kLanes);
      std::vector<uint32_t> probs(kTile * kChunk / 2);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t qh = item / tiles, r0 = item % tiles * kTile;
        attend_tile(qp + sp[i] * hq * d, op + sp[i] * hq * d, hq, d, qh, qh / group, r0,
                    std::min<int64_t>(kTile, q_len - r0), ctx, kb.data(), vt.data(), key_groups, pairs,
                    static_cast<float>(scale), scores.data(), probs.data(), acc.data(), row_max.data(),
                    row_sum.data(), dot.data());
      }
    });
  }
  return out;
}
