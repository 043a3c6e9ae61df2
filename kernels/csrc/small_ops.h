// Raw-pointer cores of the small CPU ops (small_ops.cpp binds them to tensors; decode_layer.cpp chains them into
// one decoder layer). Contracts are with the tensor functions in small_ops.cpp.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvrelay_cpu {

constexpr int kLanes = 16;

inline void spin_pause() {  // a spin-wait's pause (x86's PAUSE; nothing elsewhere)
#if defined(__AVX512F__) || defined(__AVX2__)
  _mm_pause();
#endif
}

// Spins until done() holds: a pause between tries, and after 2^14 of them the core yielded at each (a VM's
// descheduled peer, or a team sharing one CPU). The wait of DecodeStack's barrier and of thread_round_trip_ns.
template <typename Done>
inline void spin_until(const Done& done) {
  for (int spins = 0; !done(); ++spins)
    if (spins < (1 << 14)) spin_pause();
    else std::this_thread::yield();
}
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


// The float32 blocked layout: [G, in, 16, 1], sixteen output rows per input, a group's inputs in order (one
// 64-byte line each): each output summed in input order with fused multiply-adds.
constexpr int kTileF32 = 4;  // rows of x per pass over a group: 4 x 16 sums fill 8 of AVX2's 16 registers
// How far ahead the AVX2 pass asks for the weights (64-byte lines, PREFETCHT0). On a Zen 1 VM over SmolLM2's float32
// shapes, alternated in one process: 1.04-1.16x the hardware prefetchers alone at 1 and 4 rows, and batch-1 decode
// medians 1.05x and 1.08x in two runs (8 of 8 pairs faster in the first); 4, 6 and 12 lines within noise of 8, 32
// slower than none. The AVX-512 and bf16 passes were not measured with it (no such CPU here) and do without.
constexpr int kPrefetchLines = 8;

template <int TT>
inline void group_dot(const float* __restrict w, int64_t in, const float* __restrict x, int64_t xs,
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
    // past the group's last line this asks for the next group's (or, at the end, lines never read: no fault)
    _mm_prefetch(reinterpret_cast<const char*>(w + (i + kPrefetchLines) * kLanes), _MM_HINT_T0);
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

// group_dot<tt> for a run-time tt in 1 .. TT: Word is uint32_t (a pair of bf16) or float.
template <int TT, typename Word>
inline void group_dot_up_to(int64_t tt, const Word* w, int64_t k, const Word* x, int64_t xs, float* s) {
  if constexpr (TT == 1) {
    group_dot<1>(w, k, x, xs, s);
  } else {
    if (tt == TT) group_dot<TT>(w, k, x, xs, s);
    else group_dot_up_to<TT - 1>(tt, w, k, x, xs, s);
  }
}

// What blocked_rows reads a T weight and row as: 32-bit words (two bf16 or one float32), and the rows of x per pass.
template <typename T>
struct Blocking;
template <>
struct Blocking<at::BFloat16> {
  using Word = uint32_t;
  static constexpr int kRows = kTile;
};
template <>
struct Blocking<float> {
  using Word = float;
  static constexpr int kRows = kTileF32;
};

// Groups g_begin .. g_end-1 (outputs 16 g_begin .. 16 g_end - 1) of y = x W^T + b for the blocked W; xw is x as
// words (blocked_x: bf16 rows of odd width padded), each row k words apart. The float32 sums plus the bias are
// rounded once to T. Any split of the groups gives the same bits.
template <typename T>
inline void blocked_groups(const typename Blocking<T>::Word* xw, int64_t t_rows, int64_t k, const uint32_t* wbits,
                           const T* b, int64_t out, T* yp, int64_t g_begin, int64_t g_end) {
  using Word = typename Blocking<T>::Word;
  constexpr int kRows = Blocking<T>::kRows;
  const Word* wp = reinterpret_cast<const Word*>(wbits);
  alignas(64) float s[kRows * kLanes];
  for (int64_t g = g_begin; g < g_end; ++g) {
    const Word* wg = wp + g * k * kLanes;
    const int64_t o = g * kLanes, n = std::min<int64_t>(kLanes, out - o);
    for (int64_t t = 0; t < t_rows; t += kRows) {
      const int64_t tt = std::min<int64_t>(kRows, t_rows - t);
      group_dot_up_to<kRows>(tt, wg, k, xw + t * k, k, s);
      for (int64_t u = 0; u < tt; ++u)
        for (int64_t j = 0; j < n; ++j)
          yp[(t + u) * out + o + j] = static_cast<T>(s[u * kLanes + j] + (b ? static_cast<float>(b[o + j]) : 0.f));
    }
  }
}

// x [T, in] as blocked_groups reads it: the rows themselves, or (bf16 of odd `in`) copies into `padded`, each with
// a zero after it, k words a row.
template <typename T>
inline const typename Blocking<T>::Word* blocked_x(const T* x, int64_t t_rows, int64_t in, int64_t k,
                                                   std::vector<typename Blocking<T>::Word>& padded) {
  using Word = typename Blocking<T>::Word;
  constexpr int64_t per_word = sizeof(Word) / sizeof(T);
  if (in % per_word == 0) return reinterpret_cast<const Word*>(x);
  padded.assign(static_cast<size_t>(t_rows * k), Word{});
  for (int64_t t = 0; t < t_rows; ++t)
    std::memcpy(padded.data() + t * k, x + t * in, static_cast<size_t>(in) * sizeof(T));
  return padded.data();
}

// The groups at::parallel_for(0, groups, kGroupGrain, ...) gives thread `tid` of `threads`: the split blocked_rows
// makes, for a team that runs it in its own parallel region.
constexpr int64_t kGroupGrain = 4;
inline std::pair<int64_t, int64_t> team_share(int64_t n, int64_t grain, int64_t tid, int64_t threads) {
  const int64_t used = std::max<int64_t>(1, std::min<int64_t>(threads, (n + grain - 1) / grain));
  const int64_t chunk = (n + used - 1) / used;
  const int64_t begin = std::min(n, tid * chunk);
  return {begin, tid < used ? std::min(n, begin + chunk) : begin};
}

// y[t, :out] = x[t] W^T + b for the blocked W (see small_ops.cpp: blocked_linear), x [T, in] contiguous of the
// weight's dtype, k = ceil(in / P) words a row. bf16 rows are read as pairs (one 32-bit word each); with an odd `in`
// they are copied first, each with a zero after it. The float32 sums plus the bias are rounded once to T.
template <typename T>
inline void blocked_rows(const T* x, int64_t t_rows, int64_t in, int64_t k, const uint32_t* wbits, int64_t groups,
                         const T* b, int64_t out, T* yp) {
  std::vector<typename Blocking<T>::Word> padded;
  const auto* xw = blocked_x(x, t_rows, in, k, padded);
  at::parallel_for(0, groups, kGroupGrain, [&](int64_t begin, int64_t end) {
    blocked_groups(xw, t_rows, k, wbits, b, out, yp, begin, end);
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
// silu's result to bf16 before the product, as torch's two ops do. silu_mul_cols: columns i0 .. i1-1 of each row
// only. Splits at multiples of 16 give the bits of one whole-row loop; others may not (the loop's vector exp and its
// scalar tail's can differ in the last bit, which float32 keeps).
#if defined(__AVX512BF16__)
// Sixteen bf16 columns at a time: silu in float32 through the compiler's vector exp (glibc's libmvec under
// -ffast-math), then bf16 rounding (round to nearest even, as c10::BFloat16) with VCVTNEPS2BF16. Returns the first
// column not done (the tail, fewer than sixteen, is left to the plain loop).
inline int64_t silu_mul_bf16x16(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* y, int64_t i0,
                                int64_t i1) {
  const auto widen = [](const c10::BFloat16* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  };
  const auto narrow_widen = [](__m512 v) {  // v rounded to bf16, as float32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
  };
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    alignas(64) float gf[16], e[16];
    const __m512 gv = widen(g + i);
    _mm512_store_ps(gf, gv);
#pragma omp simd
    for (int j = 0; j < 16; ++j) e[j] = std::exp(-gf[j]);
    const __m512 act = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_load_ps(e)));
    const __m512 prod = _mm512_mul_ps(narrow_widen(act), widen(u + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), (__m256i)_mm512_cvtneps_pbh(prod));
  }
  return i;
}
#endif

template <typename T>
inline void silu_mul_cols(const T* xp, int64_t xs0, T* yp, int64_t t_rows, int64_t inter, int64_t i0, int64_t i1) {
  for (int64_t t = 0; t < t_rows; ++t) {
    const T* g = xp + t * xs0;
    const T* u = g + inter;
    T* y = yp + t * inter;
    int64_t start = i0;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) start = silu_mul_bf16x16(g, u, y, i0, i1);
#endif
#pragma omp simd
    for (int64_t i = start; i < i1; ++i) {
      const float gf = static_cast<float>(g[i]);
      const T act = static_cast<T>(gf / (1.0f + std::exp(-gf)));
      y[i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(u[i]));
    }
  }
}

template <typename T>
inline void silu_mul_rows(const T* xp, int64_t xs0, T* yp, int64_t t_rows, int64_t inter) {
  at::parallel_for(0, t_rows, 16, [&](int64_t begin, int64_t end) {
    silu_mul_cols(xp + begin * xs0, xs0, yp + begin * inter, end - begin, inter, 0, inter);
  });
}


// Defined in decode_attention.cpp (paged_decode_attention's checks on raw pointers, for decode_layer.cpp).
// Raises (RuntimeError, c10::Error) naming sequence i when its length is below 1 or past its table's `width` blocks,
// or when a block it reads (those of its window, with window > 0) is outside 0 .. num_blocks-1. tables [n, width]
// int32 and lens [n] int64, both contiguous.
void check_block_tables(const int32_t* tables, int64_t width, const int64_t* lens, int64_t n, int64_t block_size,
                        int64_t window, int64_t num_blocks);

// Paged decode attention split into work items for a team of threads (decode_layer.cpp's DecodeStack runs them in
// its own parallel region; paged_decode_attention through at::parallel_for). Items are (sequence, KV head, part):
// with fewer (sequence, KV head) pairs than twice the threads, each pair's keys are split into `parts` contiguous
// runs so that every thread gets work. An item writes only its own part's max, sum and accumulator, and a merge of
// pairs begin .. end-1 writes only their rows of `out`: any split of items (then of pairs) over any threads gives
// the same bits; the parts count alone decides them.
inline int64_t attention_parts(int64_t n_seqs, int64_t hkv, int64_t threads) {
  const int64_t pairs = n_seqs * hkv;
  return pairs >= 2 * threads ? 1 : (2 * threads + pairs - 1) / pairs;
}
// floats of scratch a step's attention needs (part_max, part_sum, part_acc)
inline int64_t attention_floats(int64_t n_seqs, int64_t hq, int64_t hkv, int64_t d, int64_t parts) {
  return n_seqs * hkv * parts * (hq / hkv) * (2 + d);
}
template <typename T>
struct AttentionWork {
  const T* q;  // [n_seqs, hq, d]
  const T* k_cache;
  const T* v_cache;  // block 0 of [num_blocks, hkv, block_size, d] caches, blocks block_stride apart
  int64_t block_stride;
  const int32_t* tables;  // [n_seqs, width]
  int64_t width;
  const int64_t* lens;  // [n_seqs]
  T* out;               // [n_seqs, hq, d]
  int64_t n_seqs, hq, hkv, block_size, d;
  float scale;
  int64_t window;
  const float* sinks;  // [hq] or nullptr
  int64_t parts, group;
  float* part_max;  // [items, group]
  float* part_sum;  // [items, group]
  float* part_acc;  // [items, group, d]
  int64_t pairs() const { return n_seqs * hkv; }
  int64_t items() const { return pairs() * parts; }
  // points the part buffers into attention_floats(...) floats at buf
  void place(float* buf) {
    part_max = buf;
    part_sum = buf + items() * group;
    part_acc = buf + 2 * items() * group;
  }
};
// Items begin .. end-1, then (after every item is done) the merge of pairs begin .. end-1; checked inputs only.
void attention_items(const AttentionWork<float>& a, int64_t begin, int64_t end);
void attention_items(const AttentionWork<c10::BFloat16>& a, int64_t begin, int64_t end);
void attention_merge(const AttentionWork<float>& a, int64_t begin, int64_t end);
void attention_merge(const AttentionWork<c10::BFloat16>& a, int64_t begin, int64_t end);

}  // namespace kvrelay_cpu
