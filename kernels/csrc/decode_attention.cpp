// Paged decode attention for the CPU: one pass over each sequence's K, one over its V, float32 math.
//
// Same contract as kernels/reference.py::paged_decode_attention (without token weights):
//   q            [N, Hq, D]            float32 or bfloat16 (contiguous)
//   k/v_cache    [num_blocks, Hkv, B, D] same dtype as q (strided over the block dimension allowed:
//                                        each block's [Hkv, B, D] must be contiguous)
//   block_tables [N, W] int32, seq_lens [N] int32 or int64; seq_lens[n] >= 1, ceil(len/B) <= W
//   window       sliding window in tokens, or 0 for none: sequence n reads positions max(0, len - window) .. len-1
//                only (table entries of blocks wholly before them are not read, not even checked)
//   sinks        None, or float32 [Hq] contiguous: one more softmax logit per query head, not scaled (gpt-oss)
//   parts        how many runs each (sequence, KV head)'s keys are split into, or 0 for attention_parts' rule
//                (more parts when the pairs are fewer than twice the threads). The parts decide the order of the
//                sums, so with the rule a sequence's bits depend on the batch and the thread count; with a fixed
//                count (1: deterministic mode, model/attention.py) they depend on neither.
//   returns      [N, Hq, D] in q's dtype
// Work is split over (sequence, kv head, part of the keys) with at::parallel_for (torch's thread pool): see
// decode_items and small_ops.h's AttentionWork (DecodeStack runs the same items in its own region). In bf16 at
// head dims 64 and 128 on a CPU with AVX512-BF16, both passes are written with intrinsics (scores_bf16,
// values_bf16): SmolLM2's shapes on a Zen 4 VM, 600 keys, 16.2 against 44.2 µs a call at batch 1, 233 against
// 628 µs at 16. In float32 at head dims divisible by 8 on a CPU with AVX2 and FMA, both
// passes are too (scores_f32, values_f32), walking each sequence's blocks without a division per key: SmolLM2's
// shapes at batch 1 on a Zen 1 VM, 22.1 / 32.4 / 109.6 against 27.1 / 42.1 / 152.3 µs a call at 65 / 129 / 600
// keys (medians of 5 alternated runs, the Python call included). The float32 math is the same; only the order of
// the sums differs.
// Read as a decode step reads them (every layer's K and V of a sequence, from a 4,096-block pool of SmolLM2's 30-layer
// blocks, tables in random order, bf16, one thread, Zen 4 VM, 3 alternated runs): 8 sequences of 300 keys took
// 7.6-8.8 ms for all layers against 10.3-10.6 ms before the table walks, the K and V requests ahead and the
// compile-time head counts of pass 2; 16 of 600 keys 30.3-33.2 against 41.5-47.3 ms.
// Bound into Python by small_ops.cpp (one extension, its files compiled side by side).
// Narrow headers, not <torch/extension.h>: that one parses for ~40 s here, and every clean clone (CI) builds
// these files.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "small_ops.h"  // kLanes; <immintrin.h> with AVX-512 or AVX2

namespace {

using kvrelay_cpu::AttentionWork;
using kvrelay_cpu::kLanes;  // float32 lanes of an AVX-512 register

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

constexpr float kEmpty = -1e30f;  // the max of a part with no keys (finite: -ffast-math assumes no infinities)

// The rows of keys lo, lo+1, ... of KV head h in a cache of T, walked block by block (no division per key); a copy
// walks on independently (a cursor ahead, for prefetching).
template <typename T>
struct KeyRows {
  const T* cache;
  int64_t block_stride, h, block_size, d;
  const int32_t* table;
  int64_t block, off;
  KeyRows(const T* c, int64_t bs, const int32_t* tb, int64_t head, int64_t b_size, int64_t dim, int64_t lo)
      : cache(c), block_stride(bs), h(head), block_size(b_size), d(dim), table(tb), block(lo / b_size),
        off(lo % b_size) {}
  const T* next() {  // the next key's row
    const T* row = cache + table[block] * block_stride + (h * block_size + off) * d;
    if (++off == block_size) ++block, off = 0;
    return row;
  }
};

#if defined(__AVX512BF16__)
// values_bf16_heads asks for V rows this many keys ahead (Zen 4 VM: 16 measured the same; without the requests
// pass 2 ran ~7% slower)
constexpr int64_t kVAhead = 64;

// Ask for the rows of the next n keys of `rows` (a copy of the cursor: `rows` itself does not move), `bytes` each.
template <typename T>
inline void prefetch_rows(KeyRows<T> rows, int64_t n, int64_t bytes) {
  for (; n > 0; --n) {
    const char* row = reinterpret_cast<const char*>(rows.next());
    for (int64_t byte = 0; byte < bytes; byte += 64) _mm_prefetch(row + byte, _MM_HINT_T0);
  }
}

// One vector of the 16 horizontal sums: lane i = v[i][0] + ... + v[i][15] (a transpose by unpacks and lane
// shuffles with the adds on the way, ~45 instructions against ~8 for each reduction alone).
inline __m512 sum_each(const __m512* v) {
  __m512 x[8], y[4];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: the lane's sums of keys 4j .. 4j+3
    const __m512d a = _mm512_castps_pd(x[2 * j]), b = _mm512_castps_pd(x[2 * j + 1]);
    y[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// Pass 1 for bf16 at a compiled head dim: scores[g * span + t - lo] = scale (q_g . k_t) for keys lo .. hi-1 of KV
// head h, sixteen keys at a time: VDPBF16PS products of each key's row with q_g (float32 sums), then one
// transpose-sum for the sixteen scores. The keys' rows are found by walking the table (no division per key), and
// each pass over sixteen keys first asks for the next sixteen rows (PREFETCHT0): a block holds every layer, so one
// head's rows of a block are a 2 KiB run hundreds of KiB from the next, where the hardware prefetchers stop.
template <int DC>
void scores_bf16(const c10::BFloat16* qh, int64_t group, const c10::BFloat16* k_cache, int64_t block_stride,
                 const int32_t* table, int64_t h, int64_t block_size, int64_t lo, int64_t hi, float scale,
                 float* scores, int64_t span) {
  static_assert(DC % 32 == 0, "whole 32-value rows");
  alignas(64) static const c10::BFloat16 zeros[DC] = {};
  const __m512 sc = _mm512_set1_ps(scale);
  KeyRows<c10::BFloat16> rows(k_cache, block_stride, table, h, block_size, DC, lo);
  prefetch_rows(rows, std::min<int64_t>(kLanes, hi - lo), DC * 2);
  for (int64_t t0 = lo; t0 < hi; t0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, hi - t0);
    const c10::BFloat16* kp[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) kp[i] = i < n ? rows.next() : zeros;
    prefetch_rows(rows, std::min<int64_t>(kLanes, hi - t0 - n), DC * 2);
    for (int64_t g = 0; g < group; ++g) {
      const c10::BFloat16* qg = qh + g * DC;
      __m512 v[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < DC / 32; ++c)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kp[i] + 32 * c),
                                 (__m512bh)_mm512_loadu_si512(qg + 32 * c));
        v[i] = acc;
      }
      _mm512_mask_storeu_ps(scores + g * span + (t0 - lo), static_cast<__mmask16>((1u << n) - 1u),
                            _mm512_mul_ps(sum_each(v), sc));
    }
  }
}

// Pass 2 for bf16 at a compiled head dim, GN query heads at once: acc[g * DC ..] = sum_t p[g * span + t - lo] v_t
// over keys lo .. hi-1 of KV head h for g < GN, the GN x DC / 16 sums in registers over one pass of the V rows
// (GN a compile-time count: with a run-time one the compiler kept the sums on the stack). Each key first asks for
// the V row kVAhead keys ahead (both cursors walk the table, no division per key).
template <int DC, int GN>
void values_bf16_heads(const float* p, int64_t span, const c10::BFloat16* v_cache, int64_t block_stride,
                       const int32_t* table, int64_t h, int64_t block_size, int64_t lo, int64_t hi, float* acc) {
  constexpr int kVecs = DC / kLanes;
  __m512 a[GN][kVecs];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < kVecs; ++c) a[g][c] = _mm512_setzero_ps();
  KeyRows<c10::BFloat16> rows(v_cache, block_stride, table, h, block_size, DC, lo);
  KeyRows<c10::BFloat16> ahead(v_cache, block_stride, table, h, block_size, DC, std::min(hi, lo + kVAhead));
  for (int64_t t = lo; t < hi; ++t) {
    if (t + kVAhead < hi) prefetch_rows(ahead, 1, DC * 2), ahead.next();
    const c10::BFloat16* vp = rows.next();
    __m512 vf[kVecs];
    for (int c = 0; c < kVecs; ++c)  // bf16 -> float32: the 16 bits above 16 zeros
      vf[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp + kLanes * c))), 16));
    for (int g = 0; g < GN; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * span + t - lo]);
      for (int c = 0; c < kVecs; ++c) a[g][c] = _mm512_fmadd_ps(w, vf[c], a[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(acc + g * DC + kLanes * c, a[g][c]);
}

// Pass 2 for bf16 at a compiled head dim: acc[g * DC ..] = sum_t p[g * span + t - lo] v_t over keys lo .. hi-1 of
// KV head h, for every query head g of the group, up to 16 / (DC / 16) of them per pass over the V rows.
template <int DC>
void values_bf16(const float* p, int64_t span, int64_t group, const c10::BFloat16* v_cache, int64_t block_stride,
                 const int32_t* table, int64_t h, int64_t block_size, int64_t lo, int64_t hi, float* acc) {
  constexpr int kHeads = kLanes / (DC / kLanes);
  static_assert(kHeads >= 1 && kHeads <= 4, "one to four heads a pass");
  for (int64_t g0 = 0; g0 < group; g0 += kHeads) {
    const float* pg = p + g0 * span;
    float* ag = acc + g0 * DC;
    switch (std::min<int64_t>(kHeads, group - g0)) {
      case 1: values_bf16_heads<DC, 1>(pg, span, v_cache, block_stride, table, h, block_size, lo, hi, ag); break;
      case 2: values_bf16_heads<DC, 2>(pg, span, v_cache, block_stride, table, h, block_size, lo, hi, ag); break;
      case 3: values_bf16_heads<DC, 3>(pg, span, v_cache, block_stride, table, h, block_size, lo, hi, ag); break;
      default: values_bf16_heads<DC, 4>(pg, span, v_cache, block_stride, table, h, block_size, lo, hi, ag); break;
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// One vector of the 8 horizontal sums: lane i = v[i][0] + ... + v[i][7].
inline __m256 sum_each8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a: the low and high 128-bit halves' sums of v[0..3]; b: of v[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}


// Pass 1 for float32 at a compiled head dim: scores[g * span + t - lo] = qf_g . k_t (qf: the group's query heads,
// already scaled) for keys lo .. hi-1 of KV head h, eight keys at a time: each key's products with qf_g summed in
// eight lanes, then one transpose-sum for the eight scores.
template <int DC>
void scores_f32(const float* qf, int64_t group, const float* k_cache, int64_t block_stride, const int32_t* table,
                int64_t h, int64_t block_size, int64_t lo, int64_t hi, float* scores, int64_t span) {
  static_assert(DC % 8 == 0, "whole 8-value rows");
  alignas(32) static const float zeros[DC] = {};
  KeyRows<float> rows(k_cache, block_stride, table, h, block_size, DC, lo);
  for (int64_t t0 = lo; t0 < hi; t0 += 8) {
    const int64_t n = std::min<int64_t>(8, hi - t0);
    const float* kp[8];
    for (int64_t i = 0; i < 8; ++i) kp[i] = i < n ? rows.next() : zeros;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * DC;
      __m256 v[8];
      for (int i = 0; i < 8; ++i) {
        __m256 acc = _mm256_setzero_ps();
        for (int c = 0; c < DC / 8; ++c)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(kp[i] + 8 * c), _mm256_loadu_ps(qg + 8 * c), acc);
        v[i] = acc;
      }
      alignas(32) float out[8];
      _mm256_store_ps(out, sum_each8(v));
      std::copy(out, out + n, scores + g * span + (t0 - lo));
    }
  }
}

// Pass 2 for float32 at a compiled head dim: acc[g * DC ..] = sum_t p[g * span + t - lo] v_t over keys lo .. hi-1
// of KV head h, a query head's sums over 64 values at a time in eight registers.
template <int DC>
void values_f32(const float* p, int64_t span, int64_t group, const float* v_cache, int64_t block_stride,
                const int32_t* table, int64_t h, int64_t block_size, int64_t lo, int64_t hi, float* acc) {
  constexpr int kCols = DC < 64 ? DC : 64, kVecs = kCols / 8;
  static_assert(DC % kCols == 0, "whole column chunks");
  for (int64_t g = 0; g < group; ++g)
    for (int c0 = 0; c0 < DC; c0 += kCols) {
      __m256 a[kVecs];
      for (int c = 0; c < kVecs; ++c) a[c] = _mm256_setzero_ps();
      KeyRows<float> rows(v_cache, block_stride, table, h, block_size, DC, lo);
      for (int64_t t = lo; t < hi; ++t) {
        const float* vp = rows.next() + c0;
        const __m256 w = _mm256_set1_ps(p[g * span + t - lo]);
        for (int c = 0; c < kVecs; ++c) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp + 8 * c), a[c]);
      }
      for (int c = 0; c < kVecs; ++c) _mm256_storeu_ps(acc + g * DC + c0 + 8 * c, a[c]);
    }
}
#endif

// Work items begin .. end-1 of `a` (small_ops.h: AttentionWork); DC: the head dim when known at compile time (64,
// 128: fully unrolled, vectorized loops), else 0 (a.d). A part's keys are a contiguous run of those its sequence
// sees (parts split a pair's keys so that every thread gets work: batch 1 of SmolLM2, 3 KV heads on 2 threads, left
// one idle a third of the time); it returns its max score, its sum of exp(score - max) and its unnormalised sum of
// weighted values, merged (log-sum-exp) by decode_merge. The scores and the softmax are float32.
template <typename T, int DC>
void decode_items(const AttentionWork<T>& a, int64_t begin, int64_t end) {
  const T* q = a.q;
  const T* k_cache = a.k_cache;
  const T* v_cache = a.v_cache;
  const int32_t* tables = a.tables;
  const int64_t* lens = a.lens;
  const int64_t block_stride = a.block_stride, table_width = a.width, hq = a.hq, hkv = a.hkv,
                block_size = a.block_size, window = a.window, group = a.group, parts = a.parts;
  const float scale = a.scale;
  const int64_t d = DC > 0 ? DC : a.d;
  // each thread's scratch, kept from call to call (every element is written before it is read): a decode step calls
  // this once a layer on each thread, when the allocator's code and data are cold. With the runner's shared empty
  // tensors, batch-1 bf16 SmolLM2 steps alternated against the commit before: median 0.996x (20 rounds), noise
  thread_local std::vector<float> qf, row, scores;
  qf.resize(static_cast<size_t>(group * d));
  row.resize(static_cast<size_t>(d));
  for (int64_t item = begin; item < end; ++item) {
    const int64_t pair = item / parts, part = item % parts, n = pair / hkv, h = pair % hkv, len = lens[n];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t per_part = (len - first + parts - 1) / parts;
    const int64_t lo = std::min(len, first + part * per_part), hi = std::min(len, lo + per_part);
    const int64_t span = hi - lo;  // this part's keys: positions lo .. hi-1, stored from index 0
    const int64_t head0 = h * group;
    float* pm = a.part_max + item * group;
    float* ps = a.part_sum + item * group;
    float* acc = a.part_acc + item * group * d;
    std::fill(acc, acc + group * d, 0.0f);
    if (span == 0) {
      std::fill(pm, pm + group, kEmpty);
      std::fill(ps, ps + group, 0.0f);
      continue;
    }
#if defined(__AVX512BF16__)
    constexpr bool kFast = std::is_same_v<T, c10::BFloat16> && DC > 0 && DC % 32 == 0;  // scores_bf16, values_bf16
#else
    constexpr bool kFast = false;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    constexpr bool kFast32 = std::is_same_v<T, float> && DC > 0 && DC % 8 == 0;  // scores_f32, values_f32
#else
    constexpr bool kFast32 = false;
#endif
    if constexpr (!kFast) {
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_float(q[(n * hq + head0 + g) * d + i]) * scale;
    }
    scores.assign(group * span, 0.0f);
    // Pass 1: scores[g, t - lo] = (scale q_g) . k_t
#if defined(__AVX512BF16__)
    if constexpr (kFast) {
      scores_bf16<DC>(q + (n * hq + head0) * d, group, k_cache, block_stride, tables + n * table_width, h,
                      block_size, lo, hi, scale, scores.data(), span);
    } else
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (kFast32) {
      scores_f32<DC>(qf.data(), group, k_cache, block_stride, tables + n * table_width, h, block_size, lo, hi,
                     scores.data(), span);
    } else
#endif
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t block = tables[n * table_width + t / block_size];
      const T* kp = k_cache + block * block_stride + (h * block_size + t % block_size) * d;
      float* kf = row.data();
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) kf[i] = to_float(kp[i]);  // once per token, not per query head
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf.data() + g * d;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < d; ++i) s += qg[i] * kf[i];
        scores[g * span + t - lo] = s;
      }
    }
    // This part's max and sum of exp(score - max), per query head
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores.data() + g * span;
      const float mx = *std::max_element(sg, sg + span);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < span; ++t) {
        sg[t] = std::exp(sg[t] - mx);  // vectorized through glibc's libmvec
        sum += sg[t];
      }
      pm[g] = mx;
      ps[g] = sum;
    }
    // Pass 2: acc_g = sum_t exp(score - max) v_t
#if defined(__AVX512BF16__)
    if constexpr (kFast) {
      values_bf16<DC>(scores.data(), span, group, v_cache, block_stride, tables + n * table_width, h, block_size,
                      lo, hi, acc);
    } else
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (kFast32) {
      values_f32<DC>(scores.data(), span, group, v_cache, block_stride, tables + n * table_width, h, block_size,
                     lo, hi, acc);
    } else
#endif
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t block = tables[n * table_width + t / block_size];
      const T* vp = v_cache + block * block_stride + (h * block_size + t % block_size) * d;
      float* vf = row.data();
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) vf[i] = to_float(vp[i]);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * span + t - lo];
        float* ag = acc + g * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ag[i] += p * vf[i];
      }
    }
  }
}

template <typename T>
void decode_merge(const AttentionWork<T>& a, int64_t begin, int64_t end) {
  const int64_t d = a.d, hq = a.hq, hkv = a.hkv, group = a.group, parts = a.parts;
  const float* sinks = a.sinks;
  const float* part_max = a.part_max;
  const float* part_sum = a.part_sum;
  T* out = a.out;
  std::vector<float> merged(d);
  for (int64_t pair = begin; pair < end; ++pair) {
    const int64_t n = pair / hkv, head0 = pair % hkv * group;
    for (int64_t g = 0; g < group; ++g) {
      float mx = sinks != nullptr ? sinks[head0 + g] : kEmpty;
      for (int64_t part = 0; part < parts; ++part) mx = std::max(mx, part_max[(pair * parts + part) * group + g]);
      float sum = sinks != nullptr ? std::exp(sinks[head0 + g] - mx) : 0.0f;
      float* op = merged.data();
      std::fill(op, op + d, 0.0f);
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t at = (pair * parts + part) * group + g;
        const float w = std::exp(part_max[at] - mx);
        sum += part_sum[at] * w;
        const float* pa = a.part_acc + at * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) op[i] += w * pa[i];
      }
      const float inv = 1.0f / sum;
      for (int64_t i = 0; i < d; ++i) out[(n * hq + head0 + g) * d + i] = static_cast<T>(op[i] * inv);
    }
  }
}

// The work items of a's pairs, items begin .. end-1 (any split gives the same bits: each item writes its own part).
template <typename T>
void decode_items_any(const AttentionWork<T>& a, int64_t begin, int64_t end) {
  if (a.d == 64)
    decode_items<T, 64>(a, begin, end);
  else if (a.d == 128)
    decode_items<T, 128>(a, begin, end);
  else
    decode_items<T, 0>(a, begin, end);
}

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, int64_t block_stride, const int32_t* tables,
                   int64_t table_width, const int64_t* lens, T* out, int64_t n_seqs, int64_t hq, int64_t hkv,
                   int64_t block_size, int64_t d, float scale, int64_t window, const float* sinks,
                   int64_t fixed_parts) {
  const int64_t parts =
      fixed_parts > 0 ? fixed_parts : kvrelay_cpu::attention_parts(n_seqs, hkv, at::get_num_threads());
  std::vector<float> buf(static_cast<size_t>(kvrelay_cpu::attention_floats(n_seqs, hq, hkv, d, parts)));
  AttentionWork<T> a{q, k_cache, v_cache, block_stride, tables, table_width, lens, out, n_seqs, hq, hkv,
                     block_size, d, scale, window, sinks, parts, hq / hkv, nullptr, nullptr, nullptr};
  a.place(buf.data());
  at::parallel_for(0, a.items(), 1, [&](int64_t begin, int64_t end) { decode_items_any(a, begin, end); });
  // Merge the parts of each (sequence, query head); a sink is one more logit in the max and the sum. Split over the
  // threads too: at large batches (one part each) this is the softmax's normalisation of every output row.
  at::parallel_for(0, a.pairs(), 8, [&](int64_t begin, int64_t end) { decode_merge(a, begin, end); });
}

void check_cache(const at::Tensor& cache, const at::Tensor& q, const char* name) {
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, Hkv, B, D]");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type(), name, " dtype must equal q's");
  TORCH_CHECK(cache.stride(3) == 1 && cache.stride(2) == cache.size(3) &&
                  cache.stride(1) == cache.size(2) * cache.size(3),
              name, ": each block's [Hkv, B, D] must be contiguous");
}

}  // namespace

namespace kvrelay_cpu {

void check_block_tables(const int32_t* tables, int64_t width, const int64_t* lens, int64_t n, int64_t block_size,
                        int64_t window, int64_t num_blocks) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lens[i] >= 1 && (lens[i] + block_size - 1) / block_size <= width,
                "sequence ", i, ": length ", lens[i], " does not fit its block table");
    const int64_t first_block = window > 0 ? std::max<int64_t>(0, lens[i] - window) / block_size : 0;
    for (int64_t b = first_block; b < (lens[i] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[i * width + b] >= 0 && tables[i * width + b] < num_blocks,
                  "sequence ", i, ": block id out of range");
  }
}

void attention_items(const AttentionWork<float>& a, int64_t begin, int64_t end) { decode_items_any(a, begin, end); }
void attention_items(const AttentionWork<c10::BFloat16>& a, int64_t begin, int64_t end) {
  decode_items_any(a, begin, end);
}
void attention_merge(const AttentionWork<float>& a, int64_t begin, int64_t end) { decode_merge(a, begin, end); }
void attention_merge(const AttentionWork<c10::BFloat16>& a, int64_t begin, int64_t end) {
  decode_merge(a, begin, end);
}

}  // namespace kvrelay_cpu

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  int64_t window, c10::optional<at::Tensor> sinks, int64_t parts) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [N, Hq, D]");
  TORCH_CHECK(parts >= 0, "parts must be >= 1, or 0 for the thread-count rule; got ", parts);
  TORCH_CHECK(q.device().is_cpu(), "q must be on the CPU");
  check_cache(k_cache, q, "k_cache");
  check_cache(v_cache, q, "v_cache");
  TORCH_CHECK(k_cache.stride(0) == v_cache.stride(0), "k_cache and v_cache must share the block stride");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && hq % hkv == 0, "head shapes of q and the caches do not match");
  auto tables = block_tables.to(at::kInt).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == n && lens.numel() == n, "one table row and length per sequence");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  TORCH_CHECK(window >= 0, "window must be >= 1, or 0 for none; got ", window);
  const float* sp = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->device().is_cpu() && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == hq,
                "sinks must be a contiguous float32 [Hq] CPU tensor");
    sp = sinks->data_ptr<float>();
  }
  kvrelay_cpu::check_block_tables(tp, tables.size(1), lp, n, block_size, window, k_cache.size(0));
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.stride(0),
                         tp, tables.size(1), lp, out.data_ptr<float>(), n, hq, hkv, block_size, d, float(scale),
                         window, sp, parts);
  } else if (q.scalar_type() == at::kBFloat16) {
    using T = c10::BFloat16;
    decode_kernel<T>(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.stride(0), tp,
                     tables.size(1), lp, out.data_ptr<T>(), n, hq, hkv, block_size, d, float(scale), window, sp,
                     parts);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: dtype must be float32 or bfloat16, got ", q.scalar_type());
  }
  return out;
}
