// Paged decode attention on the CPU: one query token per sequence against its keys and values, read in
// place from the paged cache (no gathered copy), one pass over the keys and one over the values.
//
// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KV, D] (the KVCacheStore layout);
// block_tables [B, max_blocks] and context_lens [B] int64 -> out [B, H, D], in q's dtype.
// float32 or bfloat16; scores, softmax and sums in float32. (Sequence, KV head) pairs are shared out
// among torch's intra-op threads as each becomes free.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxHeadDim = 256;

// exp(x) for x <= 0 (scores less their maximum), written so that the compiler vectorizes the loop that calls
// it: exp(x) = 2^n exp(r), r = x - n ln2 in [-ln2/2, ln2/2], exp(r) by Cephes' expf polynomial (relative
// error about 2e-7). Below -87.3 the result is the smallest normal float's order, as good as 0 in a softmax.
constexpr float kExpFloor = -87.3f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 in two parts
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                              1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  x = std::max(x, kExpFloor);
  const float n = std::floor(x * kLog2e + 0.5f);
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// A cached row as float32: itself when the cache is float32, else converted into ``buffer``.
template <typename T>
inline const float* as_float(const T* row, float* buffer, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < dim; ++d) buffer[d] = static_cast<float>(row[d]);
    return buffer;
  }
}

// Asks for one cached row (``dim`` values) to be brought into the caches ahead of its use.
template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  constexpr int64_t kLine = 64;  // bytes per cache line
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < dim * static_cast<int64_t>(sizeof(T)); at += kLine) __builtin_prefetch(bytes + at, 0, 3);
}

// Calls visit(t, row) for tokens 0..length-1 of one sequence (length >= 1), ``row`` pointing at its head's
// values in the cache: block by block through ``table``, ``stride`` apart within a block. While it visits
// row i of a block it prefetches row i of the next block (and the first block's rows before it starts):
// blocks lie anywhere in the pool, so the hardware prefetcher, which follows a stream within a page,
// would start over at every block. Called between linear layers, as in a decode step, one layer's
// attention over 31 sequences of 250-460 tokens went from 583 to 408 us (float32, two threads).
template <typename T, typename Visit>
inline void each_token(const T* cache, const int64_t* table, int64_t length, int64_t block_size, int64_t stride,
                       int64_t head_offset, int64_t dim, Visit&& visit) {
  auto block_row = [&](int64_t b, int64_t i) { return cache + (table[b] * block_size + i) * stride + head_offset; };
  for (int64_t i = 0; i < std::min(block_size, length); ++i) prefetch_row(block_row(0, i), dim);
  for (int64_t start = 0, b = 0; start < length; start += block_size, ++b) {
    const int64_t n = std::min(block_size, length - start);
    const int64_t ahead = std::clamp<int64_t>(length - start - block_size, 0, block_size);  // next block's rows
    for (int64_t i = 0; i < n; ++i) {
      if (i < ahead) prefetch_row(block_row(b + 1, i), dim);
      visit(start + i, block_row(b, i));
    }
  }
}

// One (sequence, KV head) pair: its ``group`` query heads against its ``length`` cached tokens. G and D are
// template arguments where they are the common sizes (the loops then unroll and the accumulators stay in
// registers); 0 means "given at run time".
template <typename T, int64_t G, int64_t D>
void attend(const T* q, const T* k, const T* v, const int64_t* table, int64_t length, T* out, int64_t group_rt,
            int64_t dim_rt, int64_t kv_heads, int64_t h, int64_t block_size, float scale, std::vector<float>& scores,
            float* queries, float* acc) {
  const int64_t group = G ? G : group_rt;
  const int64_t dim = D ? D : dim_rt;
  if (length <= 0) {  // no token to attend to (the runner never sends one): zeros, not 0/0
    for (int64_t i = 0; i < group * dim; ++i) out[i] = static_cast<T>(0.f);
    return;
  }
  float row[kMaxHeadDim];
  scores.resize(group * length);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) queries[g * dim + d] = static_cast<float>(q[g * dim + d]) * scale;
  const int64_t stride = kv_heads * dim;  // between two tokens of a block
  // scores: one pass over the keys, block by block
  each_token(k, table, length, block_size, stride, h * dim, dim, [&](int64_t t, const T* key) {
    const float* kf = as_float(key, row, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = queries + g * dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < dim; ++d) s += qg[d] * kf[d];
      scores[g * length + t] = s;
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * length;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < length; ++t) top = std::max(top, sg[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < length; ++t) {
      sg[t] = exp_nonpositive(sg[t] - top);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < length; ++t) sg[t] *= inv;
  }
  // values: one pass, the weighted sums kept in ``acc``
  for (int64_t i = 0; i < group * dim; ++i) acc[i] = 0.f;
  each_token(v, table, length, block_size, stride, h * dim, dim, [&](int64_t t, const T* value) {
    const float* vf = as_float(value, row, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * length + t];
      float* ag = acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ag[d] += p * vf[d];
    }
  });
  for (int64_t i = 0; i < group * dim; ++i) out[i] = static_cast<T>(acc[i]);
}

#if defined(__AVX512F__)
// The same pair with AVX-512 written out, for the compiled sizes (D a multiple of 16). What the compiler made
// of the loops above ran at a sixth of the machine's rate: the exponentials one at a time (the softmax was
// about half the call), 256-bit vectors, the value sums kept in memory. Here the queries and the value sums
// stay in registers, each score is one horizontal add, and the softmax runs 16 scores at a time. One
// layer's call between linear layers (31 sequences of 250-460 tokens, two threads): bfloat16 369 -> 171 us,
// float32 361 -> 199 us. Other sizes, and CPUs without AVX-512, run ``attend``.
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {  // bfloat16: the upper half of a float32
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
}

// exp_nonpositive, 16 lanes at a time (the same reduction and polynomial).
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(kExpFloor), x);  // this order keeps a NaN a NaN, as std::max(x, floor) does
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// Softmax in place over ``n`` scores.
inline void softmax16(float* s, int64_t n) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1u);
  top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (tail) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), m));
    _mm512_mask_storeu_ps(s + t, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (t = 0; t + 16 <= n; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
  if (tail) _mm512_mask_storeu_ps(s + t, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + t), inv));
}

// The sums of four vectors' lanes, as one vector [sum a, sum b, sum c, sum d]: half the shuffles and a
// third of the additions of four horizontal adds (a query token's four heads against one key).
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // quarters: [a0 + a2, a1 + a3, b0 + b2, b1 + b3] and the same for c, d
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // quarter k: four partial sums of vector k
  __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));  // within each quarter: [0+2, 1+3, 2+0, 3+1]
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0xB1));  // every lane of quarter k: the sum of vector k
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12,
                                                                        0, 4, 8, 12), w));
}

template <typename T, int64_t G, int64_t D>
void attend_avx512(const T* q, const T* k, const T* v, const int64_t* table, int64_t length, T* out, int64_t,
                   int64_t, int64_t kv_heads, int64_t h, int64_t block_size, float scale, std::vector<float>& scores,
                   float* queries, float* acc) {
  static_assert(D % 16 == 0, "head size a multiple of 16");
  constexpr int64_t C = D / 16;  // vectors per row
  if (length <= 0) {
    for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(0.f);
    return;
  }
  scores.resize(G * length);
  float* sc = scores.data();
  __m512 qv[G][C];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) qv[g][c] = _mm512_mul_ps(load16(q + g * D + 16 * c), _mm512_set1_ps(scale));
  const int64_t stride = kv_heads * D;
  each_token(k, table, length, block_size, stride, h * D, D, [&](int64_t t, const T* key) {
    __m512 kv[C];
    for (int64_t c = 0; c < C; ++c) kv[c] = load16(key + 16 * c);
    __m512 s[G];
    for (int64_t g = 0; g < G; ++g) {
      s[g] = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int64_t c = 1; c < C; ++c) s[g] = _mm512_fmadd_ps(qv[g][c], kv[c], s[g]);
    }
    if constexpr (G % 4 == 0) {
      for (int64_t g = 0; g < G; g += 4) {
        alignas(16) float four[4];
        _mm_store_ps(four, sum4(s[g], s[g + 1], s[g + 2], s[g + 3]));
        for (int64_t i = 0; i < 4; ++i) sc[(g + i) * length + t] = four[i];
      }
    } else {
      for (int64_t g = 0; g < G; ++g) sc[g * length + t] = _mm512_reduce_add_ps(s[g]);
    }
  });
  for (int64_t g = 0; g < G; ++g) softmax16(sc + g * length, length);
  __m512 av[G][C];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) av[g][c] = _mm512_setzero_ps();
  each_token(v, table, length, block_size, stride, h * D, D, [&](int64_t t, const T* value) {
    __m512 vv[C];
    for (int64_t c = 0; c < C; ++c) vv[c] = load16(value + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(sc[g * length + t]);
      for (int64_t c = 0; c < C; ++c) av[g][c] = _mm512_fmadd_ps(p, vv[c], av[g][c]);
    }
  });
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, av[g][c]);
  for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<T>(acc[i]);
}
#define LLMSRE_ATTEND attend_avx512

#if defined(__AVX512BF16__)
// bfloat16 on a CPU with AVX512_BF16: the products run on the cache's own pairs of bfloat16 (vdpbf16ps: 32
// products a vector, summed in float32, against 16 for a float32 FMA on values widened first). Scores: the
// query's and the key's values, pair by pair along the head; the sums: two tokens at a time, their values
// interleaved, against their probabilities rounded to bfloat16 (as a bfloat16 attention's second product
// takes them). Softmax stays in float32. One layer's call between linear layers (31 sequences of 250-460
// tokens, two threads, repeated in a loop): 90 -> 75 us.
template <int64_t G, int64_t D>
void attend_bf16(const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v, const int64_t* table,
                 int64_t length, c10::BFloat16* out, int64_t, int64_t, int64_t kv_heads, int64_t h,
                 int64_t block_size, float scale, std::vector<float>& scores, float*, float* acc) {
  static_assert(D % 32 == 0, "head size a multiple of 32");
  constexpr int64_t P = D / 32;  // vectors of 32 bfloat16 per row
  if (length <= 0) {
    for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<c10::BFloat16>(0.f);
    return;
  }
  // float32 scores [G, length], then the probabilities as bfloat16 [G, padded] (zeros past the length)
  const int64_t padded = (length + 31) / 32 * 32;
  scores.resize(G * length + G * padded / 2);
  float* sc = scores.data();
  uint16_t* probs = reinterpret_cast<uint16_t*>(sc + G * length);
  __m512bh qv[G][P];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < P; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c);
  const __m128 scale4 = _mm_set1_ps(scale);
  const int64_t stride = kv_heads * D;
  each_token(k, table, length, block_size, stride, h * D, D, [&](int64_t t, const c10::BFloat16* key) {
    __m512bh kv[P];
    for (int64_t c = 0; c < P; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
    __m512 s[G];
    for (int64_t g = 0; g < G; ++g) {
      s[g] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
      for (int64_t c = 1; c < P; ++c) s[g] = _mm512_dpbf16_ps(s[g], qv[g][c], kv[c]);
    }
    if constexpr (G % 4 == 0) {
      for (int64_t g = 0; g < G; g += 4) {
        alignas(16) float four[4];
        _mm_store_ps(four, _mm_mul_ps(sum4(s[g], s[g + 1], s[g + 2], s[g + 3]), scale4));
        for (int64_t i = 0; i < 4; ++i) sc[(g + i) * length + t] = four[i];
      }
    } else {
      for (int64_t g = 0; g < G; ++g) sc[g * length + t] = _mm512_reduce_add_ps(s[g]) * scale;
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* row = sc + g * length;
    softmax16(row, length);
    uint16_t* to = probs + g * padded;
    for (int64_t t = 0; t < padded; t += 16) {
      const int64_t left = std::clamp<int64_t>(length - t, 0, 16);
      const __mmask16 live = static_cast<__mmask16>((1u << left) - 1u);
      const __m256bh half = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, row + t));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + t), (__m256i)half);
    }
  }
  // the sums, lane j of vector 2c holding head dimension 32c + 8(j / 4) + j % 4 and of vector 2c + 1 the
  // four after it (unpacklo/unpackhi_epi16 interleave within 128-bit lanes)
  __m512 av[G][2 * P];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < 2 * P; ++c) av[g][c] = _mm512_setzero_ps();
  const c10::BFloat16* held = nullptr;
  each_token(v, table, length, block_size, stride, h * D, D, [&](int64_t t, const c10::BFloat16* value) {
    if ((t & 1) == 0) {
      held = value;
      if (t + 1 < length) return;
      // the last token alone: its partner is itself again, at probability 0
    }
    const int64_t first = t & ~int64_t{1};
    __m512bh pp[G];
    for (int64_t g = 0; g < G; ++g) {
      int32_t pair;
      std::memcpy(&pair, probs + g * padded + first, sizeof(pair));
      pp[g] = (__m512bh)_mm512_set1_epi32(pair);
    }
    for (int64_t c = 0; c < P; ++c) {
      const __m512i a = _mm512_loadu_si512(held + 32 * c), b = _mm512_loadu_si512(value + 32 * c);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int64_t g = 0; g < G; ++g) {
        av[g][2 * c] = _mm512_dpbf16_ps(av[g][2 * c], pp[g], lo);
        av[g][2 * c + 1] = _mm512_dpbf16_ps(av[g][2 * c + 1], pp[g], hi);
      }
    }
  });
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < P; ++c) {
      alignas(64) float lo[16], hi[16];
      _mm512_store_ps(lo, av[g][2 * c]);
      _mm512_store_ps(hi, av[g][2 * c + 1]);
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t d = 32 * c + 8 * (j / 4) + j % 4;
        acc[g * D + d] = lo[j];
        acc[g * D + d + 4] = hi[j];
      }
    }
  for (int64_t i = 0; i < G * D; ++i) out[i] = static_cast<c10::BFloat16>(acc[i]);
}
#endif  // __AVX512BF16__
#else
#define LLMSRE_ATTEND attend
#endif

template <typename T>
void decode(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens, T* out,
            int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
            int64_t max_blocks, float scale) {
  const int64_t group = heads / kv_heads;  // query heads per KV head
  using Attend = void (*)(const T*, const T*, const T*, const int64_t*, int64_t, T*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float, std::vector<float>&, float*, float*);
  Attend attend_one = &attend<T, 0, 0>;
  if (dim == 64 && group == 1) attend_one = &LLMSRE_ATTEND<T, 1, 64>;
  if (dim == 64 && group == 2) attend_one = &LLMSRE_ATTEND<T, 2, 64>;
  if (dim == 64 && group == 4) attend_one = &LLMSRE_ATTEND<T, 4, 64>;
  if (dim == 64 && group == 8) attend_one = &LLMSRE_ATTEND<T, 8, 64>;
  if (dim == 128 && group == 1) attend_one = &LLMSRE_ATTEND<T, 1, 128>;
  if (dim == 128 && group == 2) attend_one = &LLMSRE_ATTEND<T, 2, 128>;
  if (dim == 128 && group == 4) attend_one = &LLMSRE_ATTEND<T, 4, 128>;
  if (dim == 128 && group == 8) attend_one = &LLMSRE_ATTEND<T, 8, 128>;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (dim == 64 && group == 1) attend_one = &attend_bf16<1, 64>;
    if (dim == 64 && group == 2) attend_one = &attend_bf16<2, 64>;
    if (dim == 64 && group == 4) attend_one = &attend_bf16<4, 64>;
    if (dim == 64 && group == 8) attend_one = &attend_bf16<8, 64>;
    if (dim == 128 && group == 1) attend_one = &attend_bf16<1, 128>;
    if (dim == 128 && group == 2) attend_one = &attend_bf16<2, 128>;
    if (dim == 128 && group == 4) attend_one = &attend_bf16<4, 128>;
    if (dim == 128 && group == 8) attend_one = &attend_bf16<8, 128>;
  }
#endif
  // (sequence, KV head) pairs longest first, taken one at a time by whichever thread is free. With a fixed
  // half each, the call waited for a thread woken from sleep to finish its half: in a decode step, where
  // the other threads sleep between parallel regions, a call took 510 us against 420 repeated at once;
  // taking pairs as they come it took 370-390 (float32, 31 sequences, two threads).
  const int64_t items = batch * kv_heads;
  std::vector<int64_t> order(items);
  for (int64_t i = 0; i < items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t c) { return lens[a / kv_heads] > lens[c / kv_heads]; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores, queries(group * dim), acc(group * dim);
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t item = order[i];
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t offset = (b * heads + h * group) * dim;
      attend_one(q + offset, k, v, tables + b * max_blocks, lens[b], out + offset, group, dim, kv_heads, h,
                 block_size, scale, scores, queries.data(), acc.data());
    }
  });
}

}  // namespace

namespace {

// paged_decode's work into ``out``: B x H x D values of q's dtype, contiguous (a fused layer passes the first
// rows of its padded buffer).
void paged_decode_into(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                       void* out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode: q must be [B, H, D] and the caches [blocks, block_size, KV, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode: q and the caches must have one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: caches must be contiguous");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && dim <= kMaxHeadDim && heads % kv_heads == 0,
              "paged_decode: head sizes do not match");
  const auto tables = block_tables.to(torch::kLong).contiguous();
  const auto lens = context_lens.to(torch::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lens.numel() == batch,
              "paged_decode: one block table row and one length per sequence");
  const auto query = q.contiguous();
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat) {
    decode<float>(query.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                  tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), static_cast<float*>(out), batch, heads,
                  kv_heads, dim, block_size, tables.size(1), s);
  } else if (q.scalar_type() == torch::kBFloat16) {
    using bf16 = c10::BFloat16;
    decode<bf16>(query.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(),
                 tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), static_cast<bf16*>(out), batch, heads,
                 kv_heads, dim, block_size, tables.size(1), s);
  } else {
    TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only, got ", q.scalar_type());
  }
}

}  // namespace

torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3, "paged_decode: q must be [B, H, D] and the caches [blocks, block_size, KV, D]");
  auto out = torch::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  paged_decode_into(q, k_cache, v_cache, block_tables, context_lens, scale, out.data_ptr());
  return out;
}

namespace {

#if defined(__AVX512F__)
// float32 -> bfloat16 as c10::BFloat16 rounds (to nearest, ties to even; a NaN stays a quiet NaN), 16 at a time.
inline __m256i bf16_bits16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// x rounded to T and back: what a value is once an operator has written it in T.
template <typename T>
inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits16(x)), 16));
  }
}

template <typename T>
inline void store16(T* p, __m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, x);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits16(x));
  }
}
#endif

// RMSNorm of each row as the model writes it (inference/models/llama.py): mean of squares and scaling in
// float32, the result rounded to T and then multiplied by the weight.
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r, x += n, out += n) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = load16(x + i);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const __m512 inv =
          _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(n) + eps));
      for (int64_t i = 0; i < n; i += 16)
        store16(out + i, _mm512_mul_ps(load16(weight + i), round16<T>(_mm512_mul_ps(load16(x + i), inv))));
      continue;
    }
#endif
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; ++i) squares += static_cast<float>(x[i]) * static_cast<float>(x[i]);
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i)
      out[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * inv)));
  }
}

// silu(gate) * up for each row of a fused gate/up projection [rows, 2 n] -> [rows, n], as F.silu(gate) * up
// computes it (silu in float32 rounded to T, then the product rounded to T).
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r, gate_up += 2 * n, out += n) {
    const T* gate = gate_up;
    const T* up = gate_up + n;
    int64_t i = 0;
#if defined(__AVX512F__)
    // silu(g) = g / (1 + exp(-g)), written with e = exp(-|g|) <= 1 so that the exponential never overflows
    for (; i + 16 <= n; i += 16) {
      const __m512 g = load16(gate + i);
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
      const __m512 numerator = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, e);
      const __m512 silu = round16<T>(_mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      store16(out + i, _mm512_mul_ps(silu, load16(up + i)));
    }
#endif
    for (; i < n; ++i) {
      const float g = static_cast<float>(gate[i]);
      const float silu = static_cast<float>(static_cast<T>(g / (1.f + std::exp(-g))));
      out[i] = static_cast<T>(silu * static_cast<float>(up[i]));
    }
  }
}

// Rows of a [rows, n] problem shared among torch's threads, in pieces of at least ~16k values (a decode
// step's few rows stay on the calling thread: waking another costs more than their work).
template <typename Fn>
void over_rows(int64_t rows, int64_t n, Fn&& fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { fn(begin, end); });
}

template <typename T>
void rms_norm_parallel(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  over_rows(rows, n, [&](int64_t begin, int64_t end) {
    rms_norm_rows(x + begin * n, weight, out + begin * n, end - begin, n, eps);
  });
}

template <typename T>
void silu_mul_parallel(const T* gate_up, T* out, int64_t rows, int64_t n) {
  over_rows(rows, n, [&](int64_t begin, int64_t end) {
    silu_mul_rows(gate_up + begin * 2 * n, out + begin * n, end - begin, n);
  });
}

// The rows of a step's fused q/k/v projection [T, (H + 2 KV) D]: queries and keys rotated on half-width
// tables (inference/models/rope.py, apply_rotary; cos/sin [T, D/2]), the queries into ``q`` [T, H, D],
// each token's key and value straight into its cache slot.
template <typename T>
void rotate_and_store(const T* qkv, const T* cos, const T* sin, T* q, T* k_cache, T* v_cache, const int64_t* slots,
                      int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
  for (int64_t t = 0; t < tokens; ++t) {
    const T* row = qkv + t * width;
    const T* c = cos + t * half;
    const T* s = sin + t * half;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const T* x = row + h * dim;
      T* y = h < heads ? q + (t * heads + h) * dim : k_cache + (slots[t] * kv_heads + (h - heads)) * dim;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= half; i += 16) {
        const __m512 x1 = load16(x + i), x2 = load16(x + i + half), ci = load16(c + i), si = load16(s + i);
        store16(y + i, _mm512_fmsub_ps(x1, ci, _mm512_mul_ps(x2, si)));
        store16(y + i + half, _mm512_fmadd_ps(x2, ci, _mm512_mul_ps(x1, si)));
      }
#endif
      for (; i < half; ++i) {
        const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
        const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
        y[i] = static_cast<T>(x1 * ci - x2 * si);
        y[i + half] = static_cast<T>(x2 * ci + x1 * si);
      }
    }
    std::memcpy(v_cache + slots[t] * kv_heads * dim, row + (heads + kv_heads) * dim, kv_heads * dim * sizeof(T));
  }
}

// ---- linear layers in blocks of 16 output columns (inference/packed_linear.py, BlockedLinear) ----------
// The weight [N, K] laid out once as N / 16 blocks of 16 columns, each block's K values per column
// interleaved so that one vector load takes the 16 columns' values at one k: float32 [N / 16, K, 16];
// bfloat16 [N / 16, K / 2, 32], pairs along K, the operand vdpbf16ps takes. A tile of up to 6 rows x 64
// columns keeps 24 sums in registers over the whole K: per k, 4 weight loads and one broadcast a row. At
// a decode batch oneDNN's linear spent about 20 us a call finding its primitive and wrapping its tensors
// (a [32, 64] x [64, 64] product took 23-35 us); here the call is the product. 32 rows, two threads, AMD
// EPYC (Zen 4): 256 -> 384, 256, 1536 and 768 -> 256 columns in 16, 11, 58, 29 us (bfloat16, 390-430
// GFLOP/s) against oneDNN's 40, 35, 86, 56; float32 31, 21, 117, 60 (200-215 GFLOP/s) against 55, 44,
// 146, 106.
#if defined(__AVX512F__)
constexpr int64_t kTileRows = 6, kTileBlocks = 4;

template <typename T>
struct Blocked;  // how a dtype's weight is blocked along K: one step's weights, its input broadcast, its sums

template <>
struct Blocked<float> {
  using Vec = __m512;
  static constexpr int64_t kStep = 1;  // K values a step
  static Vec weights(const float* w) { return _mm512_loadu_ps(w); }
  static Vec input(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 add(__m512 acc, Vec a, Vec w) { return _mm512_fmadd_ps(a, w, acc); }
  static void store(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
};

#if defined(__AVX512BF16__)
template <>
struct Blocked<c10::BFloat16> {
  using Vec = __m512bh;
  static constexpr int64_t kStep = 2;  // a pair of K values a step
  static Vec weights(const c10::BFloat16* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static Vec input(const c10::BFloat16* x) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static __m512 add(__m512 acc, Vec a, Vec w) { return _mm512_dpbf16_ps(acc, a, w); }
  static void store(c10::BFloat16* y, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
  }
};
#endif

// y[MR rows, 16 NB columns] = x[MR rows, K] W^T (+ bias) for NB consecutive blocks of the blocked weight.
template <typename T, int64_t MR, int64_t NB>
void blocked_tile(const T* x, int64_t K, const T* w, const T* bias, T* y, int64_t ldy) {
  using B = Blocked<T>;
  constexpr int64_t kBlockStride = 16 * B::kStep;  // values from one step of K to the next within a block
  const int64_t block = K * 16;  // values a block
  __m512 acc[MR][NB];
  for (int64_t r = 0; r < NB; ++r) {
    const __m512 start = bias != nullptr ? load16(bias + 16 * r) : _mm512_setzero_ps();
    for (int64_t m = 0; m < MR; ++m) acc[m][r] = start;
  }
  for (int64_t k = 0, at = 0; k < K; k += B::kStep, at += kBlockStride) {
    typename B::Vec weights[NB];
    for (int64_t r = 0; r < NB; ++r) weights[r] = B::weights(w + r * block + at);
    for (int64_t m = 0; m < MR; ++m) {
      const typename B::Vec a = B::input(x + m * K + k);
      for (int64_t r = 0; r < NB; ++r) acc[m][r] = B::add(acc[m][r], a, weights[r]);
    }
  }
  for (int64_t m = 0; m < MR; ++m)
    for (int64_t r = 0; r < NB; ++r) B::store(y + m * ldy + 16 * r, acc[m][r]);
}

template <typename T, int64_t NB>
void blocked_rows(const T* x, int64_t rows, int64_t K, const T* w, const T* bias, T* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kTileRows <= rows; m += kTileRows) blocked_tile<T, kTileRows, NB>(x + m * K, K, w, bias, y + m * ldy, ldy);
  switch (rows - m) {
    case 1: blocked_tile<T, 1, NB>(x + m * K, K, w, bias, y + m * ldy, ldy); break;
    case 2: blocked_tile<T, 2, NB>(x + m * K, K, w, bias, y + m * ldy, ldy); break;
    case 3: blocked_tile<T, 3, NB>(x + m * K, K, w, bias, y + m * ldy, ldy); break;
    case 4: blocked_tile<T, 4, NB>(x + m * K, K, w, bias, y + m * ldy, ldy); break;
    case 5: blocked_tile<T, 5, NB>(x + m * K, K, w, bias, y + m * ldy, ldy); break;
    default: break;
  }
}

// y [M, N] = x [M, K] W^T + bias, the work shared out as (96 rows x 64 columns) pieces.
template <typename T>
void blocked_linear_rows(const T* x, int64_t M, int64_t K, const T* w, const T* bias, T* y, int64_t N) {
  constexpr int64_t kChunkRows = 16 * kTileRows;
  const int64_t blocks = N / 16, groups = (blocks + kTileBlocks - 1) / kTileBlocks;
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, chunks * groups, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t piece = lo; piece < hi; ++piece) {
      const int64_t c = piece / groups, g = piece % groups;
      const int64_t row = c * kChunkRows, rows = std::min(kChunkRows, M - row);
      const int64_t first = g * kTileBlocks, nb = std::min(kTileBlocks, blocks - first);
      const T* xs = x + row * K;
      const T* ws = w + first * K * 16;
      const T* bs = bias != nullptr ? bias + first * 16 : nullptr;
      T* ys = y + row * N + first * 16;
      switch (nb) {
        case 4: blocked_rows<T, 4>(xs, rows, K, ws, bs, ys, N); break;
        case 3: blocked_rows<T, 3>(xs, rows, K, ws, bs, ys, N); break;
        case 2: blocked_rows<T, 2>(xs, rows, K, ws, bs, ys, N); break;
        default: blocked_rows<T, 1>(xs, rows, K, ws, bs, ys, N); break;
      }
    }
  });
}
#endif  // __AVX512F__

// Whether this build runs blocked linears of the dtype: float32 with AVX-512, bfloat16 with AVX512_BF16.
bool blocked_supported(torch::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == torch::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == torch::kFloat) return true;
#endif
  return false;
}

bool is_blocked(const torch::Tensor& weight) { return !weight.is_mkldnn() && weight.dim() == 3; }

int64_t in_features(const torch::Tensor& weight) {
  return is_blocked(weight) ? weight.size(1) * weight.size(2) / 16 : weight.size(1);
}

int64_t out_features(const torch::Tensor& weight) { return is_blocked(weight) ? weight.size(0) * 16 : weight.size(0); }

torch::Tensor blocked_product(const torch::Tensor& x, const torch::Tensor& weight,
                              const c10::optional<torch::Tensor>& bias) {
  const int64_t K = in_features(weight), N = out_features(weight);
  TORCH_CHECK(blocked_supported(weight.scalar_type()) && x.scalar_type() == weight.scalar_type() &&
                  x.size(-1) == K && weight.is_contiguous() && (!bias || bias->scalar_type() == x.scalar_type()),
              "blocked_linear: x [..., K] and the blocked weight of one dtype this build runs");
  const auto input = x.contiguous();
  const int64_t M = input.numel() / std::max<int64_t>(K, 1);
  auto sizes = input.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, input.options());
#if defined(__AVX512F__)
  const auto b = bias ? bias->contiguous() : torch::Tensor();
  if (input.scalar_type() == torch::kFloat) {
    blocked_linear_rows<float>(input.data_ptr<float>(), M, K, weight.data_ptr<float>(),
                               bias ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), N);
  }
#if defined(__AVX512BF16__)
  if (input.scalar_type() == torch::kBFloat16) {
    using BF = c10::BFloat16;
    blocked_linear_rows<BF>(input.data_ptr<BF>(), M, K, weight.data_ptr<BF>(), bias ? b.data_ptr<BF>() : nullptr,
                            y.data_ptr<BF>(), N);
  }
#endif
#endif
  return y;
}

// A linear layer's product over x [R, K] (contiguous): through ATen for a plain weight, through the loops
// above for a blocked one; for a weight packed once for oneDNN (inference/packed_linear.py, an opaque
// oneDNN tensor) through oneDNN's linear, the call PackedLinear makes, at R rows, which the caller pads to
// that layer's row bucket so that oneDNN builds its primitives for the same bounded set of row counts.
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  if (is_blocked(weight)) return blocked_product(x, weight, bias);
  if (!weight.is_mkldnn()) return at::linear(x, weight, bias);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, weight, bias ? c10::IValue(*bias) : c10::IValue(), c10::IValue("none"),
                                 c10::IValue(c10::List<c10::optional<at::Scalar>>()), c10::IValue()};
  op.callBoxed(&stack);
  return std::move(stack[0]).toTensor();
}

// A [rows, n] buffer whose rows past ``tokens`` (the padding of a packed linear's input) are zero.
torch::Tensor padded_rows(int64_t rows, int64_t tokens, int64_t n, const torch::TensorOptions& options) {
  auto buffer = torch::empty({rows, n}, options);
  if (rows > tokens) buffer.narrow(0, tokens, rows - tokens).zero_();
  return buffer;
}

template <typename T>
torch::Tensor decode_layer(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                           const torch::Tensor& input_norm, double input_eps, const torch::Tensor& qkv_weight,
                           const c10::optional<torch::Tensor>& qkv_bias, const torch::Tensor& o_weight,
                           const c10::optional<torch::Tensor>& o_bias, const torch::Tensor& post_norm,
                           double post_eps, const torch::Tensor& gate_up_weight, const torch::Tensor& down_weight,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                           int64_t heads, int64_t kv_heads, int64_t dim, int64_t rows) {
  // the linears run at ``rows`` rows (the tokens, or a packed layer's bucket), every other part at the tokens'
  const int64_t tokens = x.size(0), hidden = x.size(1), inter = in_features(down_weight);
  const auto in_norm = input_norm.contiguous(), out_norm = post_norm.contiguous();
  const auto cos_t = cos.contiguous(), sin_t = sin.contiguous(), slot_ids = slots.to(torch::kLong).contiguous();
  auto normed = padded_rows(rows, tokens, hidden, x.options());
  rms_norm_parallel(x.data_ptr<T>(), in_norm.data_ptr<T>(), normed.data_ptr<T>(), tokens, hidden,
                    static_cast<float>(input_eps));
  const auto qkv = project(normed, qkv_weight, qkv_bias).contiguous();
  auto q = torch::empty({tokens, heads, dim}, x.options());
  rotate_and_store(qkv.data_ptr<T>(), cos_t.data_ptr<T>(), sin_t.data_ptr<T>(), q.data_ptr<T>(), k_cache.data_ptr<T>(),
                   v_cache.data_ptr<T>(), slot_ids.data_ptr<int64_t>(), tokens, heads, kv_heads, dim);
  auto attended = padded_rows(rows, tokens, heads * dim, x.options());
  paged_decode_into(q, k_cache, v_cache, block_tables, context_lens, scale, attended.data_ptr());
  auto h = project(attended, o_weight, o_bias).narrow(0, 0, tokens);
  h.add_(x);
  rms_norm_parallel(h.data_ptr<T>(), out_norm.data_ptr<T>(), normed.data_ptr<T>(), tokens, hidden,
                    static_cast<float>(post_eps));
  const auto gate_up = project(normed, gate_up_weight, c10::nullopt).contiguous();
#if defined(__AVX512F__)
  auto act = torch::empty({rows, inter}, x.options());
  silu_mul_parallel(gate_up.data_ptr<T>(), act.data_ptr<T>(), rows, inter);  // the padding's rows: silu(0) * 0
#else  // ATen's SiLU is vectorized, the portable loop calls expf: about 45 us a layer slower
  auto act = at::silu(gate_up.narrow(1, 0, inter));
  act.mul_(gate_up.narrow(1, inter, inter));
#endif
  auto out = project(act.contiguous(), down_weight, c10::nullopt).narrow(0, 0, tokens);
  out.add_(h);
  return out;
}

}  // namespace

// One Llama decoder layer for a step of decoding sequences only (one query token each), as
// LlamaDecoderLayer.forward computes it in Python with the kernel above for its attention: the linear
// layers through ATen (or oneDNN, for weights packed at load), the norms, rotary, SiLU and the cache writes
// as loops of their own, each token's key and value written straight into its slot. What goes is about
// fifty operator calls a layer (each a few microseconds at a decode batch) and their temporaries.
// x [T, hidden]; cos, sin [T, 1, D/2]; the caches and tables as for paged_decode; slots [T] where each
// token's key and value go; rows: the row count the linears run at, T or, with packed weights, T's bucket
// (inference/packed_linear.py, row_bucket).
torch::Tensor llama_decode_layer(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& input_norm, double input_eps, const torch::Tensor& qkv_weight,
                                 const c10::optional<torch::Tensor>& qkv_bias, const torch::Tensor& o_weight,
                                 const c10::optional<torch::Tensor>& o_bias, const torch::Tensor& post_norm,
                                 double post_eps, const torch::Tensor& gate_up_weight,
                                 const torch::Tensor& down_weight, const torch::Tensor& k_cache,
                                 const torch::Tensor& v_cache, const torch::Tensor& slots,
                                 const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == k_cache.scalar_type() &&
                  input_norm.scalar_type() == x.scalar_type() && post_norm.scalar_type() == x.scalar_type() &&
                  cos.scalar_type() == x.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "llama_decode_layer: x [T, hidden] contiguous, and x, the norms, cos/sin and the caches of one dtype");
  TORCH_CHECK(out_features(qkv_weight) == (num_heads + 2 * num_kv_heads) * head_dim && head_dim % 2 == 0 &&
                  k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim,
              "llama_decode_layer: the projection, the heads and the cache do not match");
  TORCH_CHECK(cos.numel() == x.size(0) * head_dim / 2 && sin.numel() == cos.numel() && slots.numel() == x.size(0),
              "llama_decode_layer: one rotary row and one slot per token");
  TORCH_CHECK(rows >= x.size(0), "llama_decode_layer: the linears' rows cannot be fewer than the tokens");
  if (x.scalar_type() == torch::kFloat)
    return decode_layer<float>(x, cos, sin, input_norm, input_eps, qkv_weight, qkv_bias, o_weight, o_bias,
                               post_norm, post_eps, gate_up_weight, down_weight, k_cache, v_cache, slots,
                               block_tables, context_lens, scale, num_heads, num_kv_heads, head_dim, rows);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "llama_decode_layer: float32 or bfloat16 only");
  return decode_layer<c10::BFloat16>(x, cos, sin, input_norm, input_eps, qkv_weight, qkv_bias, o_weight, o_bias,
                                     post_norm, post_eps, gate_up_weight, down_weight, k_cache, v_cache, slots,
                                     block_tables, context_lens, scale, num_heads, num_kv_heads, head_dim, rows);
}

namespace {

template <typename Fn>
torch::Tensor by_dtype(const torch::Tensor& x, const char* what, Fn&& fn) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, what, ": a CPU tensor of at least one dimension");
  if (x.scalar_type() == torch::kFloat) return fn(float{});
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, what, ": float32 or bfloat16 only, got ", x.scalar_type());
  return fn(c10::BFloat16{});
}

}  // namespace

// RMSNorm over the last dimension as inference/models/llama.py's RMSNorm computes it; weight in x's dtype.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return by_dtype(x, "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = x.size(-1);
    TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == n, "rms_norm: one weight per column");
    const auto input = x.contiguous();
    const auto w = weight.contiguous();
    auto out = torch::empty_like(input);
    rms_norm_parallel(input.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(), input.numel() / std::max<int64_t>(n, 1),
                      n, static_cast<float>(eps));
    return out;
  });
}

// F.silu(gate) * up for gate, up = gate_up.chunk(2, dim=-1).
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  return by_dtype(gate_up, "silu_mul", [&](auto zero) {
    using T = decltype(zero);
    const int64_t width = gate_up.size(-1);
    TORCH_CHECK(width % 2 == 0, "silu_mul: the last dimension holds gate and up, an even size");
    const auto input = gate_up.contiguous();
    auto sizes = input.sizes().vec();
    sizes.back() = width / 2;
    auto out = torch::empty(sizes, input.options());
    silu_mul_parallel(input.data_ptr<T>(), out.data_ptr<T>(), input.numel() / std::max<int64_t>(width, 1),
                      width / 2);
    return out;
  });
}

// The weight [N, K] of a linear layer in blocks (see blocked_tile): N a multiple of 16, for bfloat16 K even.
torch::Tensor pack_blocked(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() && blocked_supported(weight.scalar_type()),
              "pack_blocked: a CPU weight [N, K] of a dtype this build runs blocked (blocked_dtypes)");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t pairs = weight.scalar_type() == torch::kBFloat16 ? 2 : 1;
  TORCH_CHECK(N % 16 == 0 && K % pairs == 0, "pack_blocked: N a multiple of 16 (and K even for bfloat16), got [",
              N, ", ", K, "]");
  // [N/16, 16, K/p, p] -> [N/16, K/p, 16, p]: a block's 16 columns side by side at each step of K
  return weight.contiguous().view({N / 16, 16, K / pairs, pairs}).permute({0, 2, 1, 3}).contiguous()
      .view({N / 16, K / pairs, 16 * pairs});
}

// x [..., K] W^T + bias over a weight from pack_blocked.
torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& weight,
                             const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && is_blocked(weight), "blocked_linear: a CPU input and a blocked weight");
  return blocked_product(x, weight, bias);
}

// The dtypes this build runs blocked linears for.
std::vector<std::string> blocked_dtypes() {
  std::vector<std::string> names;
  if (blocked_supported(torch::kFloat)) names.emplace_back("float32");
  if (blocked_supported(torch::kBFloat16)) names.emplace_back("bfloat16");
  return names;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_blocked", &pack_blocked, "a linear weight [N, K] laid out in blocks of 16 columns (CPU)");
  m.def("blocked_linear", &blocked_linear, "x W^T + bias over a blocked weight (CPU)");
  m.def("blocked_dtypes", &blocked_dtypes, "the dtypes this build runs blocked linears for");
  m.def("paged_decode", &paged_decode, "paged decode attention over the KV cache in place (CPU)");
  m.def("llama_decode_layer", &llama_decode_layer, "a Llama decoder layer for a pure decode step (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, as the Llama layers compute it (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up over a fused gate/up projection's output (CPU)");
  // whether the loops above were built with AVX-512 (-march=native on a CPU that has it): without, rms_norm
  // and silu_mul are portable loops that ATen's own vectorized operators beat, and the engine keeps those
#if defined(__AVX512F__)
  m.attr("avx512") = true;
#else
  m.attr("avx512") = false;
#endif
}
