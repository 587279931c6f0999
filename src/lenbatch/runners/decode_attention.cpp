// One decode step's attention over a KV window, reading only each row's real columns.
//
// Built just in time by lenbatch/runners/decode_attention.py (torch.utils.cpp_extension.load,
// -O3 -march=native -ffast-math), on a CPU with AVX-512 or AVX2 + FMA (there without the
// bfloat16 ops; see the module's registrations at the end). Why a kernel: torch's CPU
// attention runs a decode step as rows x kv_heads tiny problems and reads every padded column;
// this loop reads each real key and value once per (row, key/value head), for all the query
// heads that share it, and skips the padding.
//
// q      [rows, kv_heads * group, head_dim]          (contiguous)
// keys   [rows, kv_heads, width, head_dim]           (any strides, head_dim contiguous)
// values [rows, kv_heads, width, head_dim]           (same)
// mask   [rows, width] bool                          (true = attend)
// out    [rows, kv_heads * group, head_dim]          (q's dtype)
//
// Scores, softmax and the weighted sum are float32, as torch's bfloat16 attention accumulates.
//
// Beside it, `add_rms_norm` (a decoder layer's residual add and the next RMSNorm), `rope`
// (rotary embedding of the queries and keys in place) and `silu_mul` (the gated MLP's
// activation), each one pass where torch runs a
// handful of small ops, each paying its dispatch on every layer; `group_linear`, weight-only
// products in groups of 32 with float32 activations (GGUF's Q4_1 / Q8_0 blocks); and
// `bf16_linear`, bfloat16 products of a few rows that stream the weights once (on AMX tiles,
// of a prompt's rows too), and `bf16_gate_up_silu`, a gated MLP's gate/up product that writes
// its activation; `quantize_rows` and `scale_rows`, the passes around an encoder's int8 product
// (`runners/int8.py`).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define LENBATCH_AVX512 1
#endif
// The group loop (`group_linear`) has an AVX2 form too: on a CPU without AVX-512 (a Zen 3) the
// build holds it, the fused passes and the portable attention loop, and not the bfloat16 ops.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define LENBATCH_GROUP_LOOP 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define LENBATCH_AMX 1
#endif

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// `n` elements of `buf` from a 64-byte boundary (`zeroed64`: all zero): each row a tile loads or
// stores is then one cache line, not two.
template <typename T>
T* at64(std::vector<T>& buf, int64_t n) {
  const size_t need = static_cast<size_t>(n) + 64 / sizeof(T);
  if (buf.size() < need) buf.resize(need);
  const auto at = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<T*>((at + 63) & ~uintptr_t(63));
}
template <typename T>
T* zeroed64(std::vector<T>& buf, int64_t n) {
  buf.assign(static_cast<size_t>(n) + 64 / sizeof(T), T(0));
  return at64(buf, n);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Rows of keys / values fetched ahead of their use: 64 (8 KiB of a 64-wide head's keys). 30
// layers' attention at 32 / 48 / 64 rows x 310 columns (214-428 MB of cache) took 7.5 / 15.7 /
// 24.2 ms against 8.1 / 17.3 / 26.1 with 16 rows ahead, and 128 was no faster (builds side by
// side, alternated, Intel Xeon family 6 model 207).
constexpr int64_t kAhead = 64;

// Ask for one key or value row (`bytes` long) ahead of its use: a step's cache is far larger
// than the CPU's caches, and its rows are read once.
inline void fetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}
#endif

#if defined(__AVX512F__)
// 16 values as float32: bfloat16 is the top half of a float32, so widening is a shift.
inline __m512 widen16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::BFloat16* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// 16 float32 values stored as bfloat16, rounded to nearest even as c10::BFloat16 rounds
// (integer arithmetic on the bits, so a CPU without AVX512_BF16 gives the same bits).
inline __m256i round16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round16(v));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// The element types `load16` / `store16` take (the ops also dispatch float64, which runs
// the scalar loops).
template <typename T>
constexpr bool kVectors = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// e^x of 16 float32 lanes: x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), e^r by its degree-6
// Taylor polynomial (error < 2e-7 relative), times 2^n by scalef. x is clamped to where
// float32 e^x is finite or vanishes.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 2^x of 16 float32 lanes for x <= 0, to about 5e-5 relative (a degree-4 polynomial on the
// fraction): enough where the result is rounded to bfloat16 (a step of 4e-3) before use.
inline __m512 exp2_coarse16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, k);
  __m512 e = _mm512_set1_ps(0.0096181291f);  // (ln 2)^4 / 4!
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(0.0555041087f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(0.2402265070f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(0.6931471806f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(e, k);
}

constexpr int64_t kMaxVectors = 32;  // group x head_dim / 16 kept in registers (or close)

// The same computation as `attend_task` below with explicit 512-bit vectors, for a head_dim
// that is a multiple of 16 and a group small enough to keep every query in registers.
template <typename T>
void attend_task_avx512(const T* qrow, const T* kbase, int64_t ks2, const T* vbase, int64_t vs2,
                        const std::vector<int32_t>& cols, int64_t group, int64_t head_dim,
                        float scale, std::vector<float>& scores, T* orow) {
  const int64_t nv = head_dim / 16, n = static_cast<int64_t>(cols.size());
  __m512 qv[kMaxVectors], acc[kMaxVectors], kv[kMaxVectors];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t v = 0; v < nv; ++v)
      qv[g * nv + v] = _mm512_mul_ps(load16(qrow + g * head_dim + v * 16), vscale);
  scores.resize(group * n);
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < std::min(n, kAhead); ++j) fetch_row(kbase + cols[j] * ks2, row_bytes);
  for (int64_t j = 0; j < n; ++j) {
    if (j + kAhead < n) fetch_row(kbase + cols[j + kAhead] * ks2, row_bytes);
    else if (j + kAhead - n < n) fetch_row(vbase + cols[j + kAhead - n] * vs2, row_bytes);
    const T* krow = kbase + cols[j] * ks2;
    for (int64_t v = 0; v < nv; ++v) kv[v] = load16(krow + v * 16);
    for (int64_t g = 0; g < group; ++g) {
      __m512 a = _mm512_mul_ps(qv[g * nv], kv[0]);
      for (int64_t v = 1; v < nv; ++v) a = _mm512_fmadd_ps(qv[g * nv + v], kv[v], a);
      scores[g * n + j] = _mm512_reduce_add_ps(a);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * n;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) top = std::max(top, sg[j]);
    float total = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = std::exp(sg[j] - top);
      total += sg[j];
    }
    const float inv = 1.f / total;
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  for (int64_t i = 0; i < group * nv; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (j + kAhead < n) fetch_row(vbase + cols[j + kAhead] * vs2, row_bytes);
    const T* vrow = vbase + cols[j] * vs2;
    for (int64_t v = 0; v < nv; ++v) kv[v] = load16(vrow + v * 16);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * n + j]);
      for (int64_t v = 0; v < nv; ++v)
        acc[g * nv + v] = _mm512_fmadd_ps(p, kv[v], acc[g * nv + v]);
    }
  }
  alignas(64) float lane[16];
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t v = 0; v < nv; ++v) {
      _mm512_store_ps(lane, acc[g * nv + v]);
      T* dst = orow + g * head_dim + v * 16;
      for (int i = 0; i < 16; ++i) dst[i] = static_cast<T>(lane[i]);
    }
  }
}

// bfloat16 keys and values, head_dim 32, 64 or 128 (NV2 = head_dim / 32 vectors of 32 values
// a row): the same computation as `attend_task_avx512`, arranged so that no score needs a
// horizontal sum of its own and no value is widened twice.
// - A row of 32 bfloat16 values widens to float32 as two vectors, its even and its odd
//   elements (a shift and a mask; the order of a dot product's terms is free, and the weighted
//   sum's even / odd halves are interleaved back when stored).
// - Scores go 16 keys at a time: 16 accumulators, then one transposing sum gives the 16
//   scores as one vector (45 instructions for 16 horizontal sums).
// - Softmax on vectors (exp16); the weighted sum of values keeps up to 16 accumulators in
//   registers, GC query heads at a time (a compile-time count: the accumulators live in
//   registers only then).
// Scores use AVX512_BF16's dot product where the CPU has it (bfloat16 pairs multiplied
// exactly, summed in float32), the scale applied to the summed scores.
// Measured on an Intel Xeon family 6 model 207, 2 threads, 32 rows x 3 key/value heads x 310
// columns x 30 layers (SmolLM2's decode step at 32 rows), the two interleaved: 28.6 / 25.3 ms
// with `attend_task_avx512`, 17.6 / 16.3 ms with this (two runs; medians of 15).

// 16 vectors -> one vector whose lane j is the sum of a[j]'s lanes.
inline __m512 sum16x16(__m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                  _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                  _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

inline __m512 bf16_even(__m512i raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)); }
inline __m512 bf16_odd(__m512i raw) {
  return _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m512i load32(const c10::BFloat16* p) {
  return _mm512_loadu_si512(reinterpret_cast<const void*>(p));
}
// float32 even / odd halves rounded to bfloat16 (to nearest even, as store16) and interleaved.
inline void store32(c10::BFloat16* p, __m512 even, __m512 odd) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
  __m512i e = _mm512_castps_si512(even), o = _mm512_castps_si512(odd);
  e = _mm512_add_epi32(e, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(e, 16), one), bias));
  o = _mm512_add_epi32(o, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(o, 16), one), bias));
  const __m512i out = _mm512_or_si512(
      _mm512_srli_epi32(e, 16),
      _mm512_and_si512(o, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  _mm512_storeu_si512(reinterpret_cast<void*>(p), out);
}

// Scores of query head `qrow` against 16 keys starting at cols[j0] (past n: the last key
// again; the caller masks those), times `scale`, into s[0..15].
template <int NV2>
inline void scores16(const c10::BFloat16* qrow, const c10::BFloat16* kbase, int64_t ks2,
                     const int32_t* cols, int64_t j0, int64_t n, float scale, float* s) {
  __m512 a[16];
#if defined(__AVX512BF16__)
  // bfloat16 pairs multiplied exactly and summed in float32 by one instruction
  __m512i qr[NV2];
  for (int c = 0; c < NV2; ++c) qr[c] = load32(qrow + 32 * c);
  for (int j = 0; j < 16; ++j) {
    const c10::BFloat16* krow = kbase + cols[std::min(j0 + j, n - 1)] * ks2;
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < NV2; ++c)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)qr[c], (__m512bh)load32(krow + 32 * c));
    a[j] = acc;
  }
#else
  __m512 qe[NV2], qo[NV2];
  for (int c = 0; c < NV2; ++c) {
    const __m512i raw = load32(qrow + 32 * c);
    qe[c] = bf16_even(raw);
    qo[c] = bf16_odd(raw);
  }
  for (int j = 0; j < 16; ++j) {
    const c10::BFloat16* krow = kbase + cols[std::min(j0 + j, n - 1)] * ks2;
    __m512i raw = load32(krow);
    __m512 acc = _mm512_mul_ps(qe[0], bf16_even(raw));
    acc = _mm512_fmadd_ps(qo[0], bf16_odd(raw), acc);
    for (int c = 1; c < NV2; ++c) {
      raw = load32(krow + 32 * c);
      acc = _mm512_fmadd_ps(qe[c], bf16_even(raw), acc);
      acc = _mm512_fmadd_ps(qo[c], bf16_odd(raw), acc);
    }
    a[j] = acc;
  }
#endif
  _mm512_storeu_ps(s, _mm512_mul_ps(sum16x16(a), _mm512_set1_ps(scale)));
}

// out[g] = sum_j p[g][j] v_j for GC query heads (probabilities p unnormalised; times inv[g]).
template <int NV2, int GC>
inline void weighted_values(const c10::BFloat16* vbase, int64_t vs2, const int32_t* cols,
                            int64_t n, const float* p, int64_t pstride, const float* inv,
                            c10::BFloat16* out, int64_t head_dim) {
  __m512 ae[GC][NV2], ao[GC][NV2];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < NV2; ++c) ae[g][c] = ao[g][c] = _mm512_setzero_ps();
  const int64_t row_bytes = 64 * NV2;
  for (int64_t j = 0; j < n; ++j) {
    if (j + kAhead < n) fetch_row(vbase + cols[j + kAhead] * vs2, row_bytes);
    const c10::BFloat16* vrow = vbase + cols[j] * vs2;
    for (int c = 0; c < NV2; ++c) {
      const __m512i raw = load32(vrow + 32 * c);
      const __m512 e = bf16_even(raw), o = bf16_odd(raw);
      for (int g = 0; g < GC; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * pstride + j]);
        ae[g][c] = _mm512_fmadd_ps(w, e, ae[g][c]);
        ao[g][c] = _mm512_fmadd_ps(w, o, ao[g][c]);
      }
    }
  }
  for (int g = 0; g < GC; ++g) {
    const __m512 k = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < NV2; ++c)
      store32(out + g * head_dim + 32 * c, _mm512_mul_ps(ae[g][c], k), _mm512_mul_ps(ao[g][c], k));
  }
}

template <int NV2>
void attend_task_bf16(const c10::BFloat16* qrow, const c10::BFloat16* kbase, int64_t ks2,
                      const c10::BFloat16* vbase, int64_t vs2, const std::vector<int32_t>& cols,
                      int64_t group, float scale, std::vector<float>& scores,
                      c10::BFloat16* orow) {
  constexpr int64_t D = 32 * NV2;
  constexpr int kMaxGroup = NV2 == 4 ? 2 : 4;  // 2 x GC x NV2 accumulators <= 16
  const int64_t n = static_cast<int64_t>(cols.size()), n16 = (n + 15) / 16 * 16;
  const int32_t* cp = cols.data();
  scores.resize(group * n16);
  float inv[64];
  for (int64_t j = 0; j < std::min(n, kAhead); ++j) fetch_row(kbase + cols[j] * ks2, 64 * NV2);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * n16;
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      if (g == 0)
        for (int64_t j = j0 + kAhead; j < std::min(n, j0 + kAhead + 16); ++j)
          fetch_row(kbase + cols[j] * ks2, 64 * NV2);
      scores16<NV2>(qrow + g * D, kbase, ks2, cp, j0, n, scale, sg + j0);
    }
    for (int64_t j = n; j < n16; ++j) sg[j] = -std::numeric_limits<float>::infinity();
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n16; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(sg + j));
    const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < n16; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), vtop));
      _mm512_storeu_ps(sg + j, e);
      total = _mm512_add_ps(total, e);
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(total);
  }
  for (int64_t j = 0; j < std::min(n, kAhead); ++j) fetch_row(vbase + cols[j] * vs2, 64 * NV2);
  for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
    const int64_t gc = std::min<int64_t>(kMaxGroup, group - g0);
    const float* p = scores.data() + g0 * n16;
    c10::BFloat16* out = orow + g0 * D;
    switch (gc) {
      case 1: weighted_values<NV2, 1>(vbase, vs2, cp, n, p, n16, inv + g0, out, D); break;
      case 2: weighted_values<NV2, 2>(vbase, vs2, cp, n, p, n16, inv + g0, out, D); break;
      case 3:
        if constexpr (kMaxGroup >= 3) weighted_values<NV2, 3>(vbase, vs2, cp, n, p, n16, inv + g0, out, D);
        break;
      default:
        if constexpr (kMaxGroup >= 4) weighted_values<NV2, 4>(vbase, vs2, cp, n, p, n16, inv + g0, out, D);
        break;
    }
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// e^x of 8 float32 lanes (the AVX-512 exp16's polynomial; 2^n built in the exponent bits, so
// x is clamped where 2^n stays a normal float).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// Transposes 8 rows of 8 floats in place (row i becomes column i).
inline void transpose8x8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}


// Horizontal sums of 8 vectors at once: lane i of the result is the sum of a[i]'s lanes.
inline __m256 hsum8x8(const __m256 a[8]) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// The weighted sum of one pass: GN queries (of the group, from g0) x VN vectors of 8 values
// (from vector v0) accumulate in registers (GN x VN <= 12 of the 16), the value rows read
// as memory operands.
template <int GN, int VN>
void weigh_values_avx2(const float* vbase, int64_t vs2, const std::vector<int32_t>& cols,
                       const float* scores, int64_t n, int64_t g0, int64_t v0, int64_t head_dim,
                       bool fetch, float* orow) {
  __m256 acc[GN * VN];
  for (int i = 0; i < GN * VN; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(float));
  for (int64_t j = 0; j < n; ++j) {
    if (fetch && j + kAhead < n) fetch_row(vbase + cols[j + kAhead] * vs2, row_bytes);
    const float* vrow = vbase + cols[j] * vs2 + v0 * 8;
    for (int g = 0; g < GN; ++g) {
      const __m256 p = _mm256_broadcast_ss(scores + (g0 + g) * n + j);
      for (int v = 0; v < VN; ++v)
        acc[g * VN + v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vrow + v * 8), acc[g * VN + v]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int v = 0; v < VN; ++v)
      _mm256_storeu_ps(orow + (g0 + g) * head_dim + (v0 + v) * 8, acc[g * VN + v]);
}

template <int GN>
void weigh_values_avx2(int vn, const float* vbase, int64_t vs2, const std::vector<int32_t>& cols,
                       const float* scores, int64_t n, int64_t g0, int64_t v0, int64_t head_dim,
                       bool fetch, float* orow) {
  switch (vn) {
    case 1: weigh_values_avx2<GN, 1>(vbase, vs2, cols, scores, n, g0, v0, head_dim, fetch, orow); break;
    case 2: weigh_values_avx2<GN, 2>(vbase, vs2, cols, scores, n, g0, v0, head_dim, fetch, orow); break;
    case 3: weigh_values_avx2<GN, 3>(vbase, vs2, cols, scores, n, g0, v0, head_dim, fetch, orow); break;
    default: weigh_values_avx2<GN, 4>(vbase, vs2, cols, scores, n, g0, v0, head_dim, fetch, orow); break;
  }
}

// `attend_rows`' portable loop for float32 on AVX2 (a Zen 3), head_dim a multiple of 8: a
// query's scores 8 keys at a time (8 accumulators, one tree of horizontal sums per 8), the
// softmax with `exp8`, the weighted sum in register blocks (`weigh_values_avx2`), and each
// key and value row asked for `kAhead` rows ahead. The portable loop read a step's cache at
// 9.0 GB/s here (SmolLM2's shapes, 32 rows x 600 columns, 2 threads), against 21 GB/s that
// the two cores read.
void attend_task_avx2(const float* qrow, const float* kbase, int64_t ks2, const float* vbase,
                      int64_t vs2, const std::vector<int32_t>& cols, int64_t group,
                      int64_t head_dim, float scale, std::vector<float>& qf,
                      std::vector<float>& scores, float* orow) {
  const int64_t nv = head_dim / 8, n = static_cast<int64_t>(cols.size());
  for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = qrow[i] * scale;
  scores.resize(group * n);
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(float));
  for (int64_t j = 0; j < std::min(n, kAhead); ++j) fetch_row(kbase + cols[j] * ks2, row_bytes);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const float* kr[8];
    for (int t = 0; t < 8; ++t) {
      const int64_t ahead = j + t + kAhead;
      if (ahead < n) fetch_row(kbase + cols[ahead] * ks2, row_bytes);
      else if (ahead - n < n) fetch_row(vbase + cols[ahead - n] * vs2, row_bytes);
      kr[t] = kbase + cols[j + t] * ks2;
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * head_dim;
      __m256 a[8];
      for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
      for (int64_t v = 0; v < nv; ++v) {
        const __m256 qv = _mm256_loadu_ps(qg + v * 8);
        for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[t] + v * 8), a[t]);
      }
      _mm256_storeu_ps(scores.data() + g * n + j, hsum8x8(a));
    }
  }
  for (; j < n; ++j) {  // the last keys, one at a time
    const float* krow = kbase + cols[j] * ks2;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * head_dim;
      __m256 a = _mm256_setzero_ps();
      for (int64_t v = 0; v < nv; ++v)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + v * 8), _mm256_loadu_ps(krow + v * 8), a);
      scores[g * n + j] = hsum8(a);
    }
  }
  const int64_t n8 = n - n % 8;
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * n;
    float top = -std::numeric_limits<float>::infinity();
    if (n8 > 0) {
      __m256 m = _mm256_loadu_ps(sg);
      for (int64_t k = 8; k < n8; k += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sg + k));
      top = hmax8(m);
    }
    for (int64_t k = n8; k < n; ++k) top = std::max(top, sg[k]);
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 vtotal = _mm256_setzero_ps();
    for (int64_t k = 0; k < n8; k += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + k), vtop));
      _mm256_storeu_ps(sg + k, e);
      vtotal = _mm256_add_ps(vtotal, e);
    }
    float total = hsum8(vtotal);
    for (int64_t k = n8; k < n; ++k) {
      sg[k] = std::exp(sg[k] - top);
      total += sg[k];
    }
    const __m256 vinv = _mm256_set1_ps(1.f / total);
    for (int64_t k = 0; k < n8; k += 8) _mm256_storeu_ps(sg + k, _mm256_mul_ps(_mm256_loadu_ps(sg + k), vinv));
    for (int64_t k = n8; k < n; ++k) sg[k] *= 1.f / total;
  }
  for (int64_t g0 = 0; g0 < group; g0 += 3) {
    const int64_t gn = std::min<int64_t>(3, group - g0);
    for (int64_t v0 = 0; v0 < nv; v0 += 4) {
      const int vn = static_cast<int>(std::min<int64_t>(4, nv - v0));
      const bool fetch = g0 == 0 && v0 == 0;  // the first pass brings each value row in
      if (gn == 3) weigh_values_avx2<3>(vn, vbase, vs2, cols, scores.data(), n, g0, v0, head_dim, fetch, orow);
      else if (gn == 2) weigh_values_avx2<2>(vn, vbase, vs2, cols, scores.data(), n, g0, v0, head_dim, fetch, orow);
      else weigh_values_avx2<1>(vn, vbase, vs2, cols, scores.data(), n, g0, v0, head_dim, fetch, orow);
    }
  }
}
#endif

template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                 const at::Tensor& mask, double scale, at::Tensor& out) {
  const int64_t rows = keys.size(0), kv_heads = keys.size(1), width = keys.size(2);
  const int64_t head_dim = keys.size(3);
  const int64_t group = q.size(1) / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const bool* mp = mask.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  const int64_t ms0 = mask.stride(0), ms1 = mask.stride(1);
  const float fscale = static_cast<float>(scale);
#if defined(__AVX512F__)
  const bool fast = head_dim % 16 == 0 && (head_dim / 16) * std::max<int64_t>(group, 1) <= kMaxVectors;
  const bool blocked = (head_dim == 32 || head_dim == 64 || head_dim == 128) && group <= 64;
#endif

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), kf(head_dim);
    std::vector<float> scores;
    std::vector<int32_t> cols;
    int64_t cols_row = -1;  // the row `cols` was built for (a row's key/value heads share it)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, h = task % kv_heads;
      if (r != cols_row) {
        const bool* mrow = mp + r * ms0;
        cols.clear();
        for (int64_t c = 0; c < width; ++c) {
          if (mrow[c * ms1]) cols.push_back(static_cast<int32_t>(c));
        }
        cols_row = r;
      }
      const int64_t n = static_cast<int64_t>(cols.size());
      T* orow = op + (r * kv_heads + h) * group * head_dim;
      if (n == 0) {  // nothing to attend to: zeros (a padding row's output is unused)
        std::fill(orow, orow + group * head_dim, T(0));
        continue;
      }
      const T* qrow = qp + (r * kv_heads + h) * group * head_dim;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (blocked) {
          const T* kb = kp + r * ks0 + h * ks1;
          const T* vb = vp + r * vs0 + h * vs1;
          if (head_dim == 32) attend_task_bf16<1>(qrow, kb, ks2, vb, vs2, cols, group, fscale, scores, orow);
          else if (head_dim == 64) attend_task_bf16<2>(qrow, kb, ks2, vb, vs2, cols, group, fscale, scores, orow);
          else attend_task_bf16<4>(qrow, kb, ks2, vb, vs2, cols, group, fscale, scores, orow);
          continue;
        }
      }
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
        if (fast) {
          attend_task_avx512<T>(qrow, kp + r * ks0 + h * ks1, ks2, vp + r * vs0 + h * vs1, vs2, cols,
                                group, head_dim, fscale, scores, orow);
          continue;
        }
      }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, float>) {
        if (head_dim % 8 == 0) {
          attend_task_avx2(qrow, kp + r * ks0 + h * ks1, ks2, vp + r * vs0 + h * vs1, vs2, cols,
                           group, head_dim, fscale, qf, scores, orow);
          continue;
        }
      }
#endif
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = to_float(qrow[i]) * fscale;
      scores.resize(group * n);
      const T* kbase = kp + r * ks0 + h * ks1;
      for (int64_t j = 0; j < n; ++j) {
        const T* krow = kbase + cols[j] * ks2;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) kf[d] = to_float(krow[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kf[d];
          scores[g * n + j] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) top = std::max(top, sg[j]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = std::exp(sg[j] - top);
          total += sg[j];
        }
        const float inv = 1.f / total;
        for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const T* vbase = vp + r * vs0 + h * vs1;
      for (int64_t j = 0; j < n; ++j) {
        const T* vrow = vbase + cols[j] * vs2;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) kf[d] = to_float(vrow[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + j];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * kf[d];
        }
      }
      for (int64_t i = 0; i < group * head_dim; ++i) orow[i] = static_cast<T>(acc[i]);
    }
  });
}

// h[r] += delta[r] (rounded to h's dtype, as `h + delta` is); out[r] = h[r] / rms(h[r]) * w,
// the mean of squares in float32 and one rounding at the end, as torch's fused rms_norm does.
template <typename T>
void add_rms_rows(T* hp, const T* dp, const T* wp, T* op, int64_t rows, int64_t hidden,
                  float eps) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> x(hidden);
    for (int64_t r = begin; r < end; ++r) {
      T* h = hp + r * hidden;
      const T* d = dp + r * hidden;
      float squares = 0.f;
      int64_t i = 0;
#if defined(__AVX512F__)
      // 16 columns at a time: the sum rounded to T through memory (as h holds it), then
      // squared; the tail below is the scalar loop. Measured on an Intel Xeon family 6 model
      // 167, 2 threads, bfloat16 448 x 576: 39-43 us, against 171 us for the scalar loop alone.
      if constexpr (kVectors<T>) {
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= hidden; i += 16) {
          store16(h + i, _mm512_add_ps(load16(h + i), load16(d + i)));
          const __m512 v = load16(h + i);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        squares = _mm512_reduce_add_ps(acc);
      }
#endif
      const int64_t vectorised = i;
      for (; i < hidden; ++i) {
        const T sum = static_cast<T>(to_float(h[i]) + to_float(d[i]));
        h[i] = sum;
        x[i] = to_float(sum);
        squares += x[i] * x[i];
      }
      const float rstd = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      T* o = op + r * hidden;
      i = 0;
#if defined(__AVX512F__)
      if constexpr (kVectors<T>) {
        const __m512 vr = _mm512_set1_ps(rstd);
        for (; i < vectorised; i += 16) {
          store16(o + i, _mm512_mul_ps(_mm512_mul_ps(load16(h + i), vr), load16(wp + i)));
        }
      }
#endif
      for (; i < hidden; ++i) o[i] = static_cast<T>(x[i] * rstd * to_float(wp[i]));
    }
  });
}

// Rotary embedding in place on the first `rotated` heads of each (row, column) of x
// [rows, new, heads, dim], with cos / sin [rows, new, dim]: x * cos + rotate_half(x) * sin in
// float32, one rounding.
template <typename T>
void rope_rows(T* xp, const T* cp, const T* sp, int64_t cells, int64_t heads, int64_t rotated,
               int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, cells, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> a(half), b(half);
    for (int64_t c = begin; c < end; ++c) {
      const T* cs = cp + c * dim;
      const T* sn = sp + c * dim;
      for (int64_t h = 0; h < rotated; ++h) {
        T* x = xp + (c * heads + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          a[i] = to_float(x[i]);
          b[i] = to_float(x[i + half]);
        }
        for (int64_t i = 0; i < half; ++i) {
          x[i] = static_cast<T>(a[i] * to_float(cs[i]) - b[i] * to_float(sn[i]));
          x[i + half] = static_cast<T>(b[i] * to_float(cs[i + half]) + a[i] * to_float(sn[i + half]));
        }
      }
    }
  });
}

#if defined(__AVX512F__)
// silu(g) * u of 16 float32 lanes, with a vector e^x.
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  // 1 / den: the 14-bit estimate and one Newton step (~1e-8 relative), not a divide.
  __m512 inv = _mm512_rcp14_ps(den);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(_mm512_mul_ps(g, inv), u);
}
#endif

// out[r] = silu(gu[r][:inter]) * gu[r][inter:], float32 inside, one rounding.
template <typename T>
void silu_mul_rows(const T* gp, T* op, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> g(inter), u(inter);
    for (int64_t r = begin; r < end; ++r) {
      const T* row = gp + r * 2 * inter;
      T* o = op + r * inter;
      int64_t start = 0;
#if defined(__AVX512F__)
      // 16 at a time with a vector e^x; the tail below is the scalar loop. Measured on an
      // Intel Xeon family 6 model 167, 2 threads, bfloat16 448 x 2 x 1536: 144-152 us, against
      // 224 us for the scalar loops alone (compute-bound: ~16 cycles per vector on one core).
      if constexpr (kVectors<T>) {
        for (; start + 16 <= inter; start += 16)
          store16(o + start, silu_mul16(load16(row + start), load16(row + inter + start)));
      }
#endif
      for (int64_t i = start; i < inter; ++i) {
        g[i] = to_float(row[i]);
        u[i] = to_float(row[inter + i]);
      }
#pragma omp simd
      // e^-g capped at e^88 (finite in float32): with -ffast-math the vectorised exp of a
      // gate below -88 gave NaN (an AVX2 build, AMD EPYC family 25 model 1), where silu is ~0.
      for (int64_t i = start; i < inter; ++i)
        g[i] = g[i] / (1.f + std::exp(std::min(-g[i], 88.f))) * u[i];
      for (int64_t i = start; i < inter; ++i) o[i] = static_cast<T>(g[i]);
    }
  });
}


// ---- Weight-only products in groups of 32 input columns, float32 activations ----
//
// `group_linear` computes y = x @ W.T for W stored as GGUF's Q4_1 and Q8_0 blocks store it:
// 4-bit, w = q * scale + lo with q in 0..15 (16 bytes a group: element j in the low nibble of
// byte j, element j + 16 in the high one); or 8-bit, w = q * scale with q in -127..127. One
// scale (and lo) per output row and group, float32. Why a kernel: torch's weight-only kernels
// (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) are fast only with bfloat16
// activations (float32: 89 ms against 4.0 ms for SmolLM2's 210 layer products at one row,
// Intel Xeon family 6 model 167, 2 threads), and bfloat16 activations fail the generation
// agreement gate. With this loop a GGUF's 4-bit model runs its own weights exactly (up to
// float32 summation order) at a fraction of the dense float32 weights' bytes.

constexpr int64_t kGroup = 32;
constexpr int64_t kGroupAhead = 4;  // output rows `group_tile` asks for ahead of its loads

#if defined(LENBATCH_GROUP_LOOP)
// Sixteen float32 lanes: one AVX-512 register, or two AVX2 ones. The group loop is written once
// against these few operations.
#if defined(__AVX512F__)
using V16 = __m512;
inline V16 v_zero() { return _mm512_setzero_ps(); }
inline V16 v_load(const float* p) { return _mm512_loadu_ps(p); }
inline V16 v_set1(float x) { return _mm512_set1_ps(x); }
inline V16 v_add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 v_mul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 v_fmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
inline float v_sum(V16 a) { return _mm512_reduce_add_ps(a); }
// Rows a block of the group loop takes at once: 8 x 1 accumulators of 32 registers.
constexpr int kGroupRows = 8;
#else
struct V16 {
  __m256 a, b;
};
inline V16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 v_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 v_add(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline V16 v_mul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline V16 v_fmadd(V16 x, V16 y, V16 z) {
  return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
inline float v_sum(V16 x) {
  const __m256 s = _mm256_add_ps(x.a, x.b);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_hadd_ps(q, q);
  q = _mm_hadd_ps(q, q);
  return _mm_cvtss_f32(q);
}
// AVX2: eight rows of one-register accumulators (`group_tile_avx2`).
constexpr int kGroupRows = 8;
#endif

// One group's 32 weights as two float32 vectors (elements 0..15, 16..31).
template <bool Q4>
inline void unpack_group(const uint8_t* q, int64_t g, V16& w0, V16& w1) {
#if defined(__AVX512F__)
  if constexpr (Q4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    const __m128i m = _mm_set1_epi8(0x0F);
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m)));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
  } else {
    const __m128i* p = reinterpret_cast<const __m128i*>(q + g * kGroup);
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
  }
#else
  // Eight bytes widened to eight lanes at a time.
  const auto lanes = [](__m128i bytes, bool is_signed) {
    return is_signed ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))
                     : _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  };
  if constexpr (Q4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(b, m), high = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    w0 = {lanes(low, false), lanes(_mm_srli_si128(low, 8), false)};
    w1 = {lanes(high, false), lanes(_mm_srli_si128(high, 8), false)};
  } else {
    const __m128i* p = reinterpret_cast<const __m128i*>(q + g * kGroup);
    const __m128i b0 = _mm_loadu_si128(p), b1 = _mm_loadu_si128(p + 1);
    w0 = {lanes(b0, true), lanes(_mm_srli_si128(b0, 8), true)};
    w1 = {lanes(b1, true), lanes(_mm_srli_si128(b1, 8), true)};
  }
#endif
}

// R input rows against U output rows: each group's weights are unpacked once and used for
// every row. The 4-bit `lo` term is sum_g lo[o, g] * sum(x[r, group g]), added at the end.
template <int R, int U, bool Q4>
inline void group_tile(const float* x, int64_t in, const uint8_t* q, const float* sc,
                       const float* lo, const float* xsum, float* y, int64_t out, int64_t o) {
  const int64_t nb = in / kGroup, qrow = Q4 ? in / 2 : in;
  V16 acc[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = v_zero();
  for (int64_t g = 0; g < nb; ++g) {
    for (int u = 0; u < U; ++u) {
      V16 w0, w1;
      // The rows kGroupAhead further on, at this group: 4.6 against 5.1 ms for SmolLM2's
      // 121 int4 products at one row (2-4 % at 2-4 rows; Intel Xeon family 6 model 207).
      _mm_prefetch(reinterpret_cast<const char*>(q + (o + u + kGroupAhead) * qrow +
                                                 g * (Q4 ? kGroup / 2 : kGroup)),
                   _MM_HINT_T0);
      unpack_group<Q4>(q + (o + u) * qrow, g, w0, w1);
      const V16 s = v_set1(sc[(o + u) * nb + g]);
      if constexpr (R == 1) {
        // One row: the group's dot product first, then one scaled add into the accumulator
        // (a single dependent operation a group).
        V16 t = v_mul(w0, v_load(x + g * kGroup));
        t = v_fmadd(w1, v_load(x + g * kGroup + 16), t);
        acc[u][0] = v_fmadd(t, s, acc[u][0]);
      } else {
        // Several rows: scale the weights once, then two fused multiply-adds a row (8 rows
        // and more: 9 % faster than the one-row form on the Xeon above).
        w0 = v_mul(w0, s);
        w1 = v_mul(w1, s);
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * in + g * kGroup;
          acc[u][r] = v_fmadd(w0, v_load(xr), acc[u][r]);
          acc[u][r] = v_fmadd(w1, v_load(xr + 16), acc[u][r]);
        }
      }
    }
  }
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) {
      float v = v_sum(acc[u][r]);
      if constexpr (Q4) {
        const float* l = lo + (o + u) * nb;
        const float* xs = xsum + r * nb;
        float m = 0.f;
#pragma omp simd reduction(+ : m)
        for (int64_t g = 0; g < nb; ++g) m += l[g] * xs[g];
        v += m;
      }
      y[r * out + o + u] = v;
    }
}

// Output rows [o0, o1) for R input rows. Two output rows a pass at one or two input rows:
// one alone leaves the loop waiting on its accumulator (SmolLM2's 210 layer products at one
// row, Intel Xeon family 6 model 167, 2 threads: 5.9-6.1 ms, against 6.9 with one and
// 6.4-6.8 with four).
#if !defined(__AVX512F__)
// AVX2, several input rows against one output row: each group's weights eight at a time
// (one register, scaled once) into one accumulator register a row. The sixteen-lane form
// above keeps two registers a row and ran out of AVX2's sixteen from four rows on.
template <int R, bool Q4>
inline void group_tile_avx2(const float* x, int64_t in, const uint8_t* q, const float* sc,
                            const float* lo, const float* xsum, float* y, int64_t out,
                            int64_t o) {
  const int64_t nb = in / kGroup, qrow = Q4 ? in / 2 : in;
  const uint8_t* qo = q + o * qrow;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < nb; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(q + (o + kGroupAhead) * qrow +
                                               g * (Q4 ? kGroup / 2 : kGroup)),
                 _MM_HINT_T0);
    const __m256 s = _mm256_set1_ps(sc[o * nb + g]);
    __m128i parts[4];  // elements 0-7, 8-15, 16-23, 24-31 in each part's low eight bytes
    if constexpr (Q4) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qo + g * 16));
      const __m128i m = _mm_set1_epi8(0x0F);
      const __m128i low = _mm_and_si128(b, m), high = _mm_and_si128(_mm_srli_epi16(b, 4), m);
      parts[0] = low;
      parts[1] = _mm_srli_si128(low, 8);
      parts[2] = high;
      parts[3] = _mm_srli_si128(high, 8);
    } else {
      const __m128i* p = reinterpret_cast<const __m128i*>(qo + g * kGroup);
      const __m128i b0 = _mm_loadu_si128(p), b1 = _mm_loadu_si128(p + 1);
      parts[0] = b0;
      parts[1] = _mm_srli_si128(b0, 8);
      parts[2] = b1;
      parts[3] = _mm_srli_si128(b1, 8);
    }
    for (int k = 0; k < 4; ++k) {
      const __m256i wide = Q4 ? _mm256_cvtepu8_epi32(parts[k]) : _mm256_cvtepi8_epi32(parts[k]);
      const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(wide), s);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * in + g * kGroup + 8 * k), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    t = _mm_hadd_ps(t, t);
    t = _mm_hadd_ps(t, t);
    float v = _mm_cvtss_f32(t);
    if constexpr (Q4) {
      const float* l = lo + o * nb;
      const float* xs = xsum + r * nb;
      float m = 0.f;
#pragma omp simd reduction(+ : m)
      for (int64_t g = 0; g < nb; ++g) m += l[g] * xs[g];
      v += m;
    }
    y[r * out + o] = v;
  }
}
#endif

template <int R, bool Q4>
void group_block(const float* x, int64_t in, const uint8_t* q, const float* sc, const float* lo,
                 const float* xsum, float* y, int64_t out, int64_t o0, int64_t o1) {
  int64_t o = o0;
#if !defined(__AVX512F__)
  if constexpr (R >= 2) {
    for (; o < o1; ++o) group_tile_avx2<R, Q4>(x, in, q, sc, lo, xsum, y, out, o);
  } else
#endif
  {
    constexpr int U = R <= kGroupRows / 2 ? 2 : 1;
    for (; o + U <= o1; o += U) group_tile<R, U, Q4>(x, in, q, sc, lo, xsum, y, out, o);
    for (; o < o1; ++o) group_tile<R, 1, Q4>(x, in, q, sc, lo, xsum, y, out, o);
  }
}

template <bool Q4>
void group_rows(const float* x, int64_t rows, int64_t in, const uint8_t* q, const float* sc,
                const float* lo, const float* xsum, float* y, int64_t out, int64_t o0,
                int64_t o1) {
  const int64_t nb = in / kGroup;
  int64_t r = 0;
  for (; r + kGroupRows <= rows; r += kGroupRows)
    group_block<kGroupRows, Q4>(x + r * in, in, q, sc, lo, xsum + r * nb, y + r * out, out, o0,
                                o1);
  const float* xr = x + r * in;
  const float* xs = xsum + r * nb;
  float* yr = y + r * out;
  switch (rows - r) {
    case 1: group_block<1, Q4>(xr, in, q, sc, lo, xs, yr, out, o0, o1); break;
    case 2: group_block<2, Q4>(xr, in, q, sc, lo, xs, yr, out, o0, o1); break;
    case 3: group_block<3, Q4>(xr, in, q, sc, lo, xs, yr, out, o0, o1); break;
    case 4: group_block<4, Q4>(xr, in, q, sc, lo, xs, yr, out, o0, o1); break;
    case 5: group_block<5, Q4>(xr, in, q, sc, lo, xs, yr, out, o0, o1); break;
    case 6: group_block<6, Q4>(xr, in, q, sc, lo, xs, yr, out, o0, o1); break;
    case 7: group_block<7, Q4>(xr, in, q, sc, lo, xs, yr, out, o0, o1); break;
    default: break;
  }
}
#endif

}  // namespace

// y [rows, out] = x [rows, in] @ W.T for W in groups of 32 (see `group_tile`): q uint8
// [out, in / 2] (4-bit, with lo) or int8 [out, in] (8-bit, lo empty); scale, lo float32
// [out, in / 32]. x float32, contiguous.
at::Tensor group_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                        const at::Tensor& lo) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "group_linear: x must be float32 [rows, in], contiguous");
  const bool q4 = q.scalar_type() == at::kByte;
  TORCH_CHECK(q4 || q.scalar_type() == at::kChar, "group_linear: q must be uint8 or int8");
  const int64_t rows = x.size(0), in = x.size(1), out = q.size(0), nb = in / kGroup;
  TORCH_CHECK(in % kGroup == 0 && q.dim() == 2 && q.is_contiguous() &&
                  q.size(1) == (q4 ? in / 2 : in),
              "group_linear: q must be [out, in / 2] (4-bit) or [out, in] (8-bit), in a "
              "multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == out * nb,
              "group_linear: scale must be float32 [out, in / 32]");
  TORCH_CHECK(!q4 || (lo.scalar_type() == at::kFloat && lo.is_contiguous() &&
                      lo.numel() == out * nb),
              "group_linear: lo must be float32 [out, in / 32] for 4-bit weights");
  auto y = at::empty({rows, out}, x.options());
#if defined(LENBATCH_GROUP_LOOP)
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(q4 ? rows * nb : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(xsum.size()); ++i)
    xsum[i] = v_sum(v_add(v_load(xp + i * kGroup), v_load(xp + i * kGroup + 16)));
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* lp = q4 ? lo.data_ptr<float>() : nullptr;
  const float* xs = xsum.data();
  float* yp = y.data_ptr<float>();
  // Work in units of four output rows, at least 16 units a thread (a call is ~15 us).
  const int64_t units = (out + 3) / 4;
  at::parallel_for(0, units, 16, [&](int64_t b0, int64_t b1) {
    const int64_t o0 = b0 * 4, o1 = std::min(out, b1 * 4);
    if (q4)
      group_rows<true>(xp, rows, in, qp, sp, lp, xs, yp, out, o0, o1);
    else
      group_rows<false>(xp, rows, in, qp, sp, lp, xs, yp, out, o0, o1);
  });
  return y;
#else
  TORCH_CHECK(false, "group_linear: built without AVX-512 or AVX2");
#endif
}

// ---- bfloat16 products of a few rows, streaming the weights once ----
//
// `bf16_linear` computes y = x @ W.T for bfloat16 x [rows, in], float32 sums, bfloat16 out,
// for the few rows of a decode step, from W reordered once (`pack_bf16_weight` in
// runners/rowlinears.py) into blocks of 16 output rows, each block's columns in pairs:
// wp [ceil(out / 16), ceil(in / 2), 16, 2], so that one 64-byte load holds two columns of 16
// outputs and AVX512_BF16's dot product adds both into 16 float32 sums, with the input's pair of
// values broadcast: no horizontal sums, every weight byte read once, in order. Why a kernel: at
// one to a few rows a product only streams its weights, and oneDNN's (prepacked or not) read
// them at ~12 GB/s on an Intel Xeon family 6 model 207 (2 threads: SmolLM2's 121 products at
// one row in 21.5 ms), under half of what the two cores read (27.5 GB/s summing float32). A CPU
// with AVX-512 but not AVX512_BF16 widens each pair to float32 and uses two FMAs.

// Above this many rows `bf16_linear` runs on AMX tiles (where there are any): 16 x 32 by
// 32 x 16 products, the weights still streamed once (B tiles straight from the packed
// layout), the rows padded to whole tiles. At one to four rows the vector loop below is as
// fast and pads nothing; above, its dot products bound it (16.4 ms at 8 rows, 46.7 at 32).
// SmolLM2's 120 layer products on an Intel Xeon family 6 model 207, 2 threads, weights from
// memory: 11.8 / 11.7 / 10.5 / 13.1 / 15.1 ms at 8 / 16 / 32 / 48 / 64 rows, against 17.7 /
// 18.0 / 14.7 / 14.8 / 17.5 for oneDNN prepacked (at more rows: `amx_linear_blocks`).
constexpr int64_t kAmxAbove = 4;

#if defined(__AVX512F__)
// 16 float32 sums rounded to bfloat16 as c10::BFloat16 does (`store16`), stored to the outputs
// `mask` keeps (a block's outputs past the weight's end are dropped).
inline void store16_masked(uint16_t* dst, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(dst, mask, round16(v));
}

inline __m512 bf16_pair_dot(__m512 acc, __m512i x2, __m512i w) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)x2, (__m512bh)w);
#else
  const __m512i lo_mask = _mm512_set1_epi32(0xFFFF);
  const __m512 x_lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_and_si512(x2, lo_mask), 16));
  const __m512 w_lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_and_si512(w, lo_mask), 16));
  const __m512 x_hi = _mm512_castsi512_ps(_mm512_andnot_si512(lo_mask, x2));
  const __m512 w_hi = _mm512_castsi512_ps(_mm512_andnot_si512(lo_mask, w));
  return _mm512_fmadd_ps(x_hi, w_hi, _mm512_fmadd_ps(x_lo, w_lo, acc));
#endif
}

// How far ahead of its loads `gemv_tile` asks for each block's weights: 32 column pairs, 2 KiB
// a block. The hardware prefetcher alone kept SmolLM2's 121 products (269 MB of weights, from
// memory) at 26-27 GB/s on 2 threads; asked 32 pairs ahead they read at 34-36 GB/s (1 and 4
// rows: 9.8 -> 7.8 ms and 10.0 -> 7.5 ms; 16 and 64 pairs ahead about as fast, 128 and an L2
// hint slower; Intel Xeon family 6 model 207, alternated). Past a block's end it asks for the next
// block's first weights (a prefetch past the weight's end does not fault).
constexpr int64_t kGemvAhead = 32;

// R input rows against U blocks of 16 outputs, from block `b`. `pairs` = ceil(in / 2); `x2`
// holds each row's pairs as 32-bit words (the odd column's pad is zero).
template <int R, int U>
inline void gemv_tile(const uint32_t* x2, int64_t pairs, const uint16_t* wp, uint16_t* y,
                      int64_t out, int64_t b) {
  __m512 acc[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  const int64_t block = pairs * 32;  // bfloat16 values a block of 16 outputs holds
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_set1_epi32(static_cast<int>(x2[r * pairs + p]));
    for (int u = 0; u < U; ++u) {
      _mm_prefetch(reinterpret_cast<const char*>(wp + (b + u) * block + (p + kGemvAhead) * 32),
                   _MM_HINT_T0);
      const __m512i wv = _mm512_loadu_si512(wp + (b + u) * block + p * 32);
      for (int r = 0; r < R; ++r) acc[u][r] = bf16_pair_dot(acc[u][r], xv[r], wv);
    }
  }
  for (int u = 0; u < U; ++u) {
    const int64_t o = (b + u) * 16;
    const int64_t n = std::min<int64_t>(16, out - o);
    if (n <= 0) continue;
    const __mmask16 m = (__mmask16)((1U << n) - 1);
    for (int r = 0; r < R; ++r) store16_masked(y + r * out + o, acc[u][r], m);
  }
}

// Blocks [b0, b1) for R input rows: U blocks a pass, as many accumulators as the 32 vector
// registers hold beside the inputs (several independent sums hide the dot product's latency).
template <int R>
void gemv_blocks(const uint32_t* x2, int64_t pairs, const uint16_t* wp, uint16_t* y, int64_t out,
                 int64_t b0, int64_t b1) {
  constexpr int U = R <= 2 ? 4 : (R <= 4 ? 3 : 2);
  int64_t b = b0;
  for (; b + U <= b1; b += U) gemv_tile<R, U>(x2, pairs, wp, y, out, b);
  for (; b < b1; ++b) gemv_tile<R, 1>(x2, pairs, wp, y, out, b);
}

void gemv_rows(const uint32_t* x2, int64_t rows, int64_t pairs, const uint16_t* wp, uint16_t* y,
               int64_t out, int64_t b0, int64_t b1) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8)
    gemv_blocks<8>(x2 + r * pairs, pairs, wp, y + r * out, out, b0, b1);
  const uint32_t* xr = x2 + r * pairs;
  uint16_t* yr = y + r * out;
  switch (rows - r) {
    case 1: gemv_blocks<1>(xr, pairs, wp, yr, out, b0, b1); break;
    case 2: gemv_blocks<2>(xr, pairs, wp, yr, out, b0, b1); break;
    case 3: gemv_blocks<3>(xr, pairs, wp, yr, out, b0, b1); break;
    case 4: gemv_blocks<4>(xr, pairs, wp, yr, out, b0, b1); break;
    case 5: gemv_blocks<5>(xr, pairs, wp, yr, out, b0, b1); break;
    case 6: gemv_blocks<6>(xr, pairs, wp, yr, out, b0, b1); break;
    case 7: gemv_blocks<7>(xr, pairs, wp, yr, out, b0, b1); break;
    default: break;
  }
}
#endif

#if defined(LENBATCH_AMX)
namespace {
bool amx_ready();
template <bool Gated>
void amx_linear_blocks(const uint16_t* x, const uint16_t* xlast, int64_t mtiles, int64_t in,
                       const uint16_t* wp, int64_t pairs, uint16_t* y, int64_t rows, int64_t out,
                       int64_t b0, int64_t b1);
}  // namespace
#endif

#if defined(__AVX512F__)
// Each row of bfloat16 x [rows, in] as ceil(in / 2) 32-bit column pairs (an odd column's pad 0).
std::vector<uint32_t> column_pairs(const at::Tensor& x) {
  const int64_t rows = x.size(0), in = x.size(1), pairs = (in + 1) / 2;
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  std::vector<uint32_t> x2(rows * pairs, 0);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(x2.data() + r * pairs, xp + r * in, in * sizeof(uint16_t));
  return x2;
}
#endif

#if defined(LENBATCH_AMX)
// x @ W.T into y on the tile unit, blocks of W in pairs across the threads (`Gated`: y holds
// silu(gate) * up, a pair being gate block j and up block j).
template <bool Gated>
void amx_linear(const at::Tensor& x, const at::Tensor& wp, at::Tensor& y) {
  const int64_t rows = x.size(0), in = x.size(1), pairs = wp.size(1), blocks = wp.size(0);
  const int64_t mtiles = (rows + 15) / 16;
  const auto* xp = static_cast<const uint16_t*>(x.data_ptr());
  std::vector<uint16_t> pad;
  uint16_t* last = nullptr;  // a last partial row tile, padded with zero rows
  if (rows % 16) {
    last = zeroed64(pad, 16 * in);
    std::memcpy(last, xp + (mtiles - 1) * 16 * in, (rows % 16) * in * sizeof(uint16_t));
  }
  const auto* w = static_cast<const uint16_t*>(wp.data_ptr());
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  const int64_t duos = (blocks + 1) / 2;  // blocks go in pairs (two B tiles)
  at::parallel_for(0, duos, 4, [&](int64_t d0, int64_t d1) {
    amx_linear_blocks<Gated>(xp, last, mtiles, in, w, pairs, yp, rows, y.size(1), 2 * d0,
                             std::min(blocks, 2 * d1));
  });
}
#endif

// x bfloat16 [rows, in], contiguous, and wp `blocks` blocks of 16 outputs by x's column pairs
// (`what` names that count in the error), as `bf16_linear` and `bf16_gate_up_silu` read them.
void check_packed_operands(const at::Tensor& x, const at::Tensor& wp, int64_t blocks,
                           const char* op, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op,
              ": x must be bfloat16 [rows, in], contiguous");
  TORCH_CHECK(wp.dim() == 4 && wp.scalar_type() == at::kBFloat16 && wp.is_contiguous() &&
                  wp.size(0) == blocks && wp.size(1) == (x.size(1) + 1) / 2 &&
                  wp.size(2) == 16 && wp.size(3) == 2,
              op, ": wp must be bfloat16 [", what, ", ceil(in / 2), 16, 2], contiguous, for x's "
              "columns");
}

// y [rows, out] = x [rows, in] @ W.T, x bfloat16 contiguous, W as `wp` (see above); more than
// `kAmxAbove` rows run on the AMX tile unit where the CPU has one and `use_amx` is true.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& wp, int64_t out, bool use_amx) {
  const int64_t rows = x.size(0), in = x.size(1), pairs = (in + 1) / 2, blocks = (out + 15) / 16;
  check_packed_operands(x, wp, blocks, "bf16_linear", "ceil(out / 16)");
  auto y = at::empty({rows, out}, x.options());
#if defined(LENBATCH_AMX)
  if (use_amx && rows > kAmxAbove && in % 32 == 0 && amx_ready()) {
    amx_linear<false>(x, wp, y);
    return y;
  }
#endif
#if defined(__AVX512F__)
  const std::vector<uint32_t> x2 = column_pairs(x);
  const uint16_t* w = static_cast<const uint16_t*>(wp.data_ptr());
  uint16_t* yp = static_cast<uint16_t*>(y.data_ptr());
  // At least 8 blocks (128 outputs) a thread: a small call is ~10 us.
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    gemv_rows(x2.data(), rows, pairs, w, yp, out, b0, b1);
  });
  return y;
#else
  TORCH_CHECK(false, "bf16_linear: built without AVX-512");
#endif
}

// A gated MLP's input product and activation in one: silu(x @ G.T) * (x @ U.T) [rows, inter],
// from G and U interleaved by blocks of 16 outputs (gate block j, then up block j) and packed
// as for `bf16_linear` (`pack_gate_up` in runners/rowlinears.py). Each product is rounded to
// bfloat16 before the activation, as `bf16_linear` then `silu_mul` round: the same bits, but
// the 2 x inter products are never written out and read back. Why: at a prompt's rows the
// gate/up output is the widest a layer writes; writing it evicts x from L2, and `silu_mul`
// then reads it back (SmolLM2, 400 rows, 30 layers: 6.1 ms for `silu_mul` alone).
at::Tensor bf16_gate_up_silu(const at::Tensor& x, const at::Tensor& wp, int64_t inter,
                             bool use_amx) {
  TORCH_CHECK(inter > 0 && inter % 16 == 0, "bf16_gate_up_silu: inter must be a multiple of 16");
  const int64_t rows = x.size(0), in = x.size(1), pairs = (in + 1) / 2, blocks = inter / 8;
  check_packed_operands(x, wp, blocks, "bf16_gate_up_silu", "inter / 8");
  auto y = at::empty({rows, inter}, x.options());
#if defined(LENBATCH_AMX)
  if (use_amx && rows > kAmxAbove && in % 32 == 0 && amx_ready()) {
    amx_linear<true>(x, wp, y);
    return y;
  }
#endif
#if defined(__AVX512F__)
  const std::vector<uint32_t> x2 = column_pairs(x);
  const uint16_t* w = static_cast<const uint16_t*>(wp.data_ptr());
  auto* yp = static_cast<c10::BFloat16*>(y.data_ptr());
  std::vector<uint16_t> gu(rows * 2 * inter);  // both products, blocks interleaved
  // Pairs of blocks (gate j, up j), at least 4 a thread; each thread applies the activation
  // to the pairs it computed.
  at::parallel_for(0, blocks / 2, 4, [&](int64_t d0, int64_t d1) {
    gemv_rows(x2.data(), rows, pairs, w, gu.data(), 2 * inter, 2 * d0, 2 * d1);
    for (int64_t r = 0; r < rows; ++r) {
      const auto* g = reinterpret_cast<const c10::BFloat16*>(gu.data() + r * 2 * inter);
      for (int64_t j = d0; j < d1; ++j)
        store16(yp + r * inter + j * 16, silu_mul16(load16(g + 32 * j), load16(g + 32 * j + 16)));
    }
  });
  return y;
#else
  TORCH_CHECK(false, "bf16_gate_up_silu: built without AVX-512");
#endif
}

// A gated MLP's activation: gu [rows, 2 * inter] (gate, then up) -> silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "silu_mul: gu must be [rows, 2 * inter], contiguous");
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  auto out = at::empty({rows, inter}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gu.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// Rotary position embedding in place: the first `rotated` heads of x [rows, new, heads, dim]
// (queries, then keys), with cos / sin [rows, new, dim] of each column's position.
void rope(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t rotated) {
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && x.is_contiguous() && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "rope: x [rows, new, heads, dim] and cos / sin [rows, new, dim], contiguous");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(1) &&
                  cos.size(2) == x.size(3) && x.size(3) % 2 == 0 && rotated >= 0 &&
                  rotated <= x.size(2),
              "rope: shapes do not match");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(),
              "rope: x, cos and sin must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rope", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                        x.size(0) * x.size(1), x.size(2), rotated, x.size(3));
  });
}

// ---- Int8 products of float32 rows (`--quantize int8` for encoders) ----
//
// torch's oneDNN int8 product (`onednn::qlinear_pointwise`) takes uint8 activations with one
// scale for the whole tensor. lenbatch quantizes each row (token) by its own absolute maximum
// instead: a packed batch mixes many requests, and a per-tensor scale would make one text's
// vector depend on its batchmates and cost accuracy (MiniLM, 388 real texts: min cosine 0.962
// per tensor against 0.993 per row). `quantize_rows` writes the row as symmetric levels
// around `zero` (q = round(x / s) + zero, s = max |x| / levels) with its scale; the product
// then runs on x / s, and `scale_rows` multiplies each output row back by s and adds the bias,
// one pass each where torch took five elementwise ops.

// q [rows, in] uint8 and s [rows]: q = round(x / s) + levels + 1, s = max |x| / levels (1 for
// an all-zero row).
std::vector<at::Tensor> quantize_rows(const at::Tensor& x, int64_t levels) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "quantize_rows: x must be [rows, in] float32, contiguous");
  TORCH_CHECK(levels > 0 && levels <= 127, "quantize_rows: levels must be in 1..127");
  const int64_t rows = x.size(0), in = x.size(1);
  auto q = at::empty({rows, in}, x.options().dtype(at::kByte));
  auto s = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = s.data_ptr<float>();
  const float lv = static_cast<float>(levels), zero = lv + 1.f;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * in;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t i = 0; i < in; ++i) amax = std::max(amax, std::fabs(row[i]));
      const float scale = amax > 0.f ? amax / lv : 1.f;
      const float inv = 1.f / scale;
      uint8_t* out = qp + r * in;
#pragma omp simd
      for (int64_t i = 0; i < in; ++i) {
        // |x| * inv <= levels, so the sum stays in 1..2 * levels + 1
        out[i] = static_cast<uint8_t>(std::nearbyint(row[i] * inv) + zero);
      }
      sp[r] = scale;
    }
  });
  return {q, s};
}

// Exact GELU, x * (1 + erf(x / sqrt 2)) / 2, with erf from Abramowitz and Stegun 7.1.26
// (absolute error below 1.5e-7, float32's own rounding near 1): a polynomial and one exp,
// which vectorise, where std::erf is a scalar call per element. |x| / sqrt 2 is capped at 4.5,
// where erf is 1 in float32 already (1 - 2e-10): past ~9.3, exp(-z * z) is subnormal, and
// subnormals made the pass ~2.5x slower on an AMD EPYC family 25 model 1 for inputs that large.
inline float gelu_erf(float x) {
  const float z = std::fmin(std::fabs(x) * 0.70710678f, 4.5f);
  const float t = 1.f / (1.f + 0.3275911f * z);
  const float poly =
      t * (0.254829592f +
           t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  const float e = 1.f - poly * std::exp(-z * z);  // erf(|x| / sqrt 2)
  return 0.5f * x * (1.f + (x < 0.f ? -e : e));
}

// y [rows, out] float32 in place: y[r][c] = act(y[r][c] * s[r] + bias[c]) (no bias: undefined;
// act: exact GELU with `gelu`, else none).
void scale_rows(at::Tensor y, const at::Tensor& s, const c10::optional<at::Tensor>& bias,
                bool gelu) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat,
              "scale_rows: y must be [rows, out] float32, contiguous");
  TORCH_CHECK(s.dim() == 1 && s.size(0) == y.size(0) && s.is_contiguous() &&
                  s.scalar_type() == at::kFloat,
              "scale_rows: s must be [rows] float32");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == y.size(1) && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "scale_rows: bias must be [out] float32");
  const int64_t rows = y.size(0), out = y.size(1);
  float* yp = y.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  std::vector<float> zeros(has_bias ? 0 : out, 0.f);
  const float* bp = has_bias ? bias->data_ptr<float>() : zeros.data();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = yp + r * out;
      const float k = sp[r];
      if (gelu) {
#pragma omp simd
        for (int64_t c = 0; c < out; ++c) row[c] = gelu_erf(row[c] * k + bp[c]);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < out; ++c) row[c] = row[c] * k + bp[c];
      }
    }
  });
}

// The residual add and the next RMSNorm of a decoder layer in one pass over the rows:
// `h += delta` in place, returns rms_norm(h) * weight. h, delta [rows, hidden] contiguous.
at::Tensor add_rms_norm(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(h.is_contiguous() && delta.is_contiguous() && weight.is_contiguous(),
              "add_rms_norm: tensors must be contiguous");
  TORCH_CHECK(h.sizes() == delta.sizes() && weight.dim() == 1 && weight.size(0) == h.size(-1),
              "add_rms_norm: shapes do not match");
  TORCH_CHECK(h.scalar_type() == delta.scalar_type() && h.scalar_type() == weight.scalar_type(),
              "add_rms_norm: h, delta and weight must share a dtype");
  auto out = at::empty_like(h);
  const int64_t hidden = h.size(-1), rows = h.numel() / std::max<int64_t>(hidden, 1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), "add_rms_norm", [&] {
    add_rms_rows<scalar_t>(h.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                           weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, hidden,
                           static_cast<float>(eps));
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.dim() == 4 && mask.dim() == 2,
              "decode_attention: q [rows, heads, dim], keys/values [rows, kv, width, dim], "
              "mask [rows, width]");
  TORCH_CHECK(q.is_contiguous(), "decode_attention: q must be contiguous");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1,
              "decode_attention: keys and values need a contiguous last dimension");
  TORCH_CHECK(keys.sizes() == values.sizes(), "decode_attention: keys and values differ in shape");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "decode_attention: mask must be bool");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "decode_attention: q, keys and values must share a dtype");
  TORCH_CHECK(q.size(0) == keys.size(0) && mask.size(0) == keys.size(0) &&
                  mask.size(1) == keys.size(2) && q.size(2) == keys.size(3) &&
                  q.size(1) % keys.size(1) == 0,
              "decode_attention: shapes do not match");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    attend_rows<scalar_t>(q, keys, values, mask, scale, out);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// A packed encoder batch's self-attention (bidirectional), straight from the fused Q/K/V
// product: each sequence's tokens attend to that sequence's tokens only, so nothing is padded,
// scattered into a grid, masked or gathered back. Torch's CPU attention took 12-14 ms per
// MiniLM layer for 32 rows x <= 112 tokens in bfloat16 on one thread (Intel Xeon family 6
// model 167), plus 3-4 ms to lay the packed rows out as a padded grid and back.
//
// qkv     [tokens, (heads + 2 kv_heads) * head_dim]  (contiguous: Q | K | V per token, heads
//                                          inside each; kv_heads = heads for an encoder)
// offsets [sequences + 1] int64           (sequence s is tokens offsets[s] .. offsets[s+1]-1)
// out     [tokens, heads * head_dim]      (qkv's dtype)
//
// On AMX tiles (bfloat16), and in an AVX2 build (float32), it also runs a causal LM's prompt:
// grouped-query heads (query head h reads key/value head h / (heads / kv_heads)) and `causal`
// (token i attends to 0..i).
//
// Per (sequence, head): K is laid out transposed as float32 [head_dim, n rounded to 16] and V
// as float32 [n, head_dim]; then for each query 16 scores at a time (the query's elements
// broadcast against 16 keys), softmax in float32, and the weighted sum of V rows.

namespace {

#if defined(__AVX512F__)
// NV = head_dim / 16 vectors per row, a compile-time constant so that every accumulator below
// lives in a register (with a run-time count they lived on the stack, and each multiply-add
// waited on the one before: a third of the speed). QB queries go together: each key or value
// vector loaded once feeds QB independent multiply-add chains.
template <typename T, int NV>
void packed_head(const T* base, int64_t stride, int64_t hidden, int64_t h, int64_t n, float scale,
                 std::vector<float>& kt, std::vector<float>& vf, std::vector<float>& sc,
                 std::vector<float>& qf, T* out) {
  constexpr int64_t D = 16 * NV;
  constexpr int64_t QB = NV <= 2 ? 8 : 16 / NV;
  const int64_t n16 = (n + 15) / 16 * 16;
  kt.assign(D * n16, 0.f);
  vf.resize(n * D);
  sc.resize(QB * n16);
  qf.resize(QB * D);
  alignas(64) float lane[16];
  for (int64_t j = 0; j < n; ++j) {
    const T* k = base + j * stride + hidden + h * D;
    const T* v = base + j * stride + 2 * hidden + h * D;
    for (int64_t c = 0; c < NV; ++c) {
      _mm512_store_ps(lane, load16(k + 16 * c));
      for (int i = 0; i < 16; ++i) kt[(16 * c + i) * n16 + j] = lane[i];
      _mm512_storeu_ps(vf.data() + j * D + 16 * c, load16(v + 16 * c));
    }
  }
  // bfloat16 in, bfloat16 out: the scale takes log2(e) in, so that the softmax's powers are
  // 2^x to bfloat16's precision (a third fewer operations per score); float32 keeps e^x exact.
  constexpr bool coarse = std::is_same_v<T, c10::BFloat16>;
  const __m512 vscale = _mm512_set1_ps(coarse ? scale * 1.44269504088896341f : scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t tail = n - (n16 - 16);  // real keys in the last block of 16 (1..16)
  const __mmask16 keep = static_cast<__mmask16>(tail == 16 ? 0xFFFF : (1u << tail) - 1);
  float* qp = qf.data();
  const float* ktp = kt.data();
  const float* vp = vf.data();
  for (int64_t i0 = 0; i0 < n; i0 += QB) {
    const int64_t m = std::min(QB, n - i0);
    for (int64_t r = 0; r < QB; ++r) {  // a short last block repeats its last query
      const T* q = base + (i0 + std::min(r, m - 1)) * stride + h * D;
      for (int64_t c = 0; c < NV; ++c)
        _mm512_storeu_ps(qp + r * D + 16 * c, _mm512_mul_ps(load16(q + 16 * c), vscale));
    }
    __m512 top[QB];
    for (int64_t r = 0; r < QB; ++r) top[r] = ninf;
    for (int64_t jb = 0; jb < n16; jb += 16) {
      __m512 a[QB];
      for (int64_t r = 0; r < QB; ++r) a[r] = _mm512_setzero_ps();
      const float* kcol = ktp + jb;
      for (int64_t d = 0; d < D; ++d) {
        const __m512 kv = _mm512_loadu_ps(kcol + d * n16);
        for (int64_t r = 0; r < QB; ++r)
          a[r] = _mm512_fmadd_ps(_mm512_set1_ps(qp[r * D + d]), kv, a[r]);
      }
      const bool last = jb + 16 == n16;
      for (int64_t r = 0; r < QB; ++r) {
        if (last) a[r] = _mm512_mask_blend_ps(keep, ninf, a[r]);
        _mm512_storeu_ps(sc.data() + r * n16 + jb, a[r]);
        top[r] = _mm512_max_ps(top[r], a[r]);
      }
    }
    float inv[QB];
    for (int64_t r = 0; r < QB; ++r) {
      float* srow = sc.data() + r * n16;
      const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top[r]));
      __m512 total = _mm512_setzero_ps();
      for (int64_t jb = 0; jb < n16; jb += 16) {
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(srow + jb), vtop);
        __m512 e = coarse ? exp2_coarse16(x) : exp16(x);
        if (jb + 16 == n16) e = _mm512_maskz_mov_ps(keep, e);  // padding keys weigh nothing
        _mm512_storeu_ps(srow + jb, e);
        total = _mm512_add_ps(total, e);
      }
      inv[r] = 1.f / _mm512_reduce_add_ps(total);
    }
    __m512 acc[QB][NV];
    for (int64_t r = 0; r < QB; ++r)
      for (int64_t c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
    const float* sp = sc.data();
    for (int64_t j = 0; j < n; ++j) {
      __m512 vv[NV];
      for (int64_t c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(vp + j * D + 16 * c);
      for (int64_t r = 0; r < QB; ++r) {
        const __m512 p = _mm512_set1_ps(sp[r * n16 + j]);
        for (int64_t c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
      }
    }
    for (int64_t r = 0; r < m; ++r) {
      T* o = out + (i0 + r) * hidden + h * D;
      const __m512 scale_r = _mm512_set1_ps(inv[r]);
      for (int64_t c = 0; c < NV; ++c) store16(o + 16 * c, _mm512_mul_ps(acc[r][c], scale_r));
    }
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The float32 encoder attention of one (sequence, head) on AVX2 (a Zen 3), from its laid-out
// operands: kt [D][n8] the keys transposed (columns past n any finite value), vf [n][D] the
// values, qs [n][D] the queries already scaled. The AVX-512 loop's order with 8 lanes. Scores:
// QB = 8 queries against 8 keys at a time (8 accumulators); the weighted sum: 2 queries x 32
// columns at a time (8 accumulators), so that a 128-wide head fits the 16 registers too.
// Wider tiles (4 x 16, 4 x 24, 3 x 32 keys; 3 queries in the sum) measured 0.8-0.95x this.
//
// C (causal, a causal LM's prompt): query i reads keys 0..i only. A block of 8 queries starting
// at i0 scores the key blocks up to its own (i0 / 8 + 1 blocks, not n8 / 8: half the work of a
// long prompt), masks the keys above each query in that diagonal block (-inf, then weight 0), and
// sums values up to its last query.
template <int D, bool C = false>
void packed_head_avx2(int64_t n, const float* ktp, int64_t n8, const float* vp, const float* qs,
                      std::vector<float>& sc, float* out, int64_t hidden) {
  constexpr int64_t QB = 8;
  sc.resize(QB * n8);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t tail = n - (n8 - 8);  // real keys in the last block of 8 (1..8)
  const __m256 keep = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(tail)),
                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  for (int64_t i0 = 0; i0 < n; i0 += QB) {
    const int64_t m = std::min(QB, n - i0);
    const float* qrow[QB];  // a short last block repeats its last query
    for (int64_t r = 0; r < QB; ++r) qrow[r] = qs + (i0 + std::min(r, m - 1)) * D;
    __m256 top[QB];
    for (int64_t r = 0; r < QB; ++r) top[r] = ninf;
    // Keys this block reads (a multiple of 8), and the mask of its last key block per query:
    // the real keys (bidirectional), or those up to the query (causal).
    const int64_t nb = C ? i0 + 8 : n8;
    __m256 last_keep[QB];
    for (int64_t r = 0; r < QB; ++r)
      last_keep[r] = C ? _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                             _mm256_set1_epi32(static_cast<int>(r + 1)),
                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))
                       : keep;
    for (int64_t jb = 0; jb < nb; jb += 8) {
      __m256 a[QB];
      for (int64_t r = 0; r < QB; ++r) a[r] = _mm256_setzero_ps();
      const float* kcol = ktp + jb;
      for (int64_t d = 0; d < D; ++d) {
        const __m256 kv = _mm256_loadu_ps(kcol + d * n8);
        for (int64_t r = 0; r < QB; ++r)
          a[r] = _mm256_fmadd_ps(_mm256_set1_ps(qrow[r][d]), kv, a[r]);
      }
      const bool last = jb + 8 == nb;
      for (int64_t r = 0; r < QB; ++r) {
        if (last) a[r] = _mm256_blendv_ps(ninf, a[r], last_keep[r]);
        _mm256_storeu_ps(sc.data() + r * n8 + jb, a[r]);
        top[r] = _mm256_max_ps(top[r], a[r]);
      }
    }
    float inv[QB];
    for (int64_t r = 0; r < QB; ++r) {
      float* srow = sc.data() + r * n8;
      const __m256 vtop = _mm256_set1_ps(hmax8(top[r]));
      __m256 total = _mm256_setzero_ps();
      for (int64_t jb = 0; jb < nb; jb += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(srow + jb), vtop));
        if (jb + 8 == nb) e = _mm256_and_ps(e, last_keep[r]);  // masked keys weigh nothing
        _mm256_storeu_ps(srow + jb, e);
        total = _mm256_add_ps(total, e);
      }
      inv[r] = 1.f / hsum8(total);
    }
    const float* sp = sc.data();
    for (int64_t r0 = 0; r0 < m; r0 += 2) {
      const int64_t rows = std::min<int64_t>(2, m - r0);
      // keys the pair reads: all, or (causal) up to its later query (the earlier's weights
      // past its own column are zero)
      const int64_t nj = C ? i0 + r0 + rows : n;
      for (int64_t c0 = 0; c0 < D; c0 += 32) {
        __m256 acc[2][4];
        for (auto& row : acc)
          for (auto& x : row) x = _mm256_setzero_ps();
        for (int64_t j = 0; j < nj; ++j) {
          __m256 vv[4];
          for (int c = 0; c < 4; ++c) vv[c] = _mm256_loadu_ps(vp + j * D + c0 + 8 * c);
          for (int64_t r = 0; r < 2; ++r) {
            const __m256 p = _mm256_set1_ps(sp[(r0 + r) * n8 + j]);
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(p, vv[c], acc[r][c]);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* o = out + (i0 + r0 + r) * hidden + c0;
          const __m256 scale_r = _mm256_set1_ps(inv[r0 + r]);
          for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(acc[r][c], scale_r));
        }
      }
    }
  }
}

// G heads of one sequence (heads h0..h0+G-1) on AVX2: one sweep over the sequence's rows lays
// out their keys transposed (8 x 8 blocks), values and scaled queries, then each head runs.
// Why: laid out one head at a time, the gathers of 32 floats from rows 4.6 KB apart and the
// scalar transpose took ~a fifth of the op at 200 tokens and half at 33 (MiniLM, an AMD EPYC
// family 25 model 1, one thread); G x D = 128 floats a row keeps a 256-token group in L2.
// Grouped and transposed by blocks, the op ran 1.06-1.17x faster at 200-256 tokens and
// 1.36x / 1.54x at 64 / 33 (the same batches, alternated, one sitting).
//
// kcol, vcol: the columns of a row where head h0's keys and values start (2 x hidden apart for
// an encoder; a causal LM's grouped-query heads read key/value head h0 / (heads / kv_heads),
// one query head a call). C: causal (`packed_head_avx2`).
template <int D, int G, bool C = false>
void packed_heads_avx2(const float* base, int64_t stride, int64_t hidden, int64_t h0,
                       int64_t kcol, int64_t vcol, int64_t n, float scale,
                       std::vector<float>& kt, std::vector<float>& vf, std::vector<float>& sc,
                       std::vector<float>& qf, float* out) {
  const int64_t n8 = (n + 7) / 8 * 8, full = n / 8 * 8;
  kt.resize(G * D * n8);
  vf.resize(G * n * D);
  qf.resize(G * n * D);
  for (int64_t c = 0; c < G * D; ++c)  // the last block's padding columns: finite, masked later
    for (int64_t j = full; j < n8; ++j) kt[c * n8 + j] = 0.f;
  for (int64_t j0 = 0; j0 < full; j0 += 8)
    for (int64_t c0 = 0; c0 < G * D; c0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = _mm256_loadu_ps(base + (j0 + i) * stride + kcol + c0);
      transpose8x8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt.data() + (c0 + i) * n8 + j0, r[i]);
    }
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < n; ++j) {
    const float* row = base + j * stride;
    for (int64_t c = 0; c < G * D; ++c)
      if (j >= full) kt[c * n8 + j] = row[kcol + c];
    for (int g = 0; g < G; ++g) {
      const float* q = row + (h0 + g) * D;
      const float* v = row + vcol + g * D;
      float* vd = vf.data() + (g * n + j) * D;
      float* qd = qf.data() + (g * n + j) * D;
      for (int64_t d = 0; d < D; d += 8) {
        _mm256_storeu_ps(vd + d, _mm256_loadu_ps(v + d));
        _mm256_storeu_ps(qd + d, _mm256_mul_ps(_mm256_loadu_ps(q + d), vscale));
      }
    }
  }
  for (int g = 0; g < G; ++g)
    packed_head_avx2<D, C>(n, kt.data() + g * D * n8, n8, vf.data() + g * n * D,
                           qf.data() + g * n * D, sc, out + (h0 + g) * D, hidden);
}
#endif

#if defined(LENBATCH_AMX)
bool amx_ready();
#endif
}  // namespace

bool has_amx() {
#if defined(LENBATCH_AMX)
  return amx_ready();
#else
  return false;
#endif
}

// Whether `packed_attention` runs a causal LM's float32 prompt (grouped-query heads, causal) in
// this build: the AVX2 loop does; the AVX-512 one runs float32 encoders only.
bool causal_float32() {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

namespace {
#if defined(LENBATCH_AMX)
// The same attention on the AMX tile unit, for bfloat16 (a Sapphire Rapids class Xeon; the
// AVX-512 loop above stays for float32 and for CPUs without AMX, a Zen 4 among them). One
// tile product multiplies 16 x 32 by 32 x 16 bfloat16 into float32 at once: the scores of 16
// queries against 16 keys (one 32-wide slice of head_dim), or 16 queries' weighted sums over
// 32 keys (16 columns of head_dim). Measured on an Intel Xeon family 6 model 167, 1 thread:
// <see bench/results/packed_attention.md>. The probabilities enter the second product
// rounded to bfloat16, as other bfloat16 flash-attention kernels do; the sums stay float32.
//
// Linux hands out the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM);
// `amx_ready` asks once per process and the op falls back to AVX-512 where it is refused.
bool amx_ready() {
  static const bool ready = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile used here is 16 rows of 64 bytes.
void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// `bf16_linear` on tiles for blocks [b0, b1) of 16 outputs: two blocks (B tiles 6, 7) by two
// 16-row tiles of x (A tiles 4, 5) into four float32 accumulators (tiles 0-3) per pass over
// the columns, 32 columns at a time. Row tiles are read in place from x (rows `in` apart),
// but for a last partial tile, `xlast` (16 rows, zero past the end; null when rows fill whole
// tiles). Needs in % 32 == 0.
// - A pair of blocks' weights (in x 64 bytes) is reused from cache by every pair of row tiles.
//   The next pair's weights are prefetched into L2 while this pair runs, spread over its
//   steps: tile loads alone leave the first pair of row tiles waiting on memory.
// - The four accumulators are stored before any is rounded out, so the stores overlap; x is
//   not copied (it was, whole, to pad it).
// - A stored set is rounded out while the tile unit computes the next set, a few rows a step,
//   not between the two.
// SmolLM2's 120 layer products on an Intel Xeon family 6 model 207, 2 threads, at 32 / 64 /
// 160 / 400 rows: 8.5 / 11.5 / 19.2 / 44.4 ms, against 10.1 / 16.0 / 26.9 / 56.4 for this
// loop without those three and 13.6 / 15.8 / 23.3 / 57.4 for oneDNN prepacked. By shape it
// wins most on narrow outputs (576 x 576 at 400 rows: 18.5 against 37.0 ms), least on wide
// ones (3072 x 576: loses from 128-256 rows), so `measure_gemv` probes each shape.
// `Gated` (`bf16_gate_up_silu`): each pair of blocks is a gate block and its up block, and the
// pair's four tiles go out as silu(gate) * up into output block b / 2 (`out` is then inter).
template <bool Gated>
void amx_linear_blocks(const uint16_t* x, const uint16_t* xlast, int64_t mtiles, int64_t in,
                       const uint16_t* wp, int64_t pairs, uint16_t* y, int64_t rows, int64_t out,
                       int64_t b0, int64_t b1) {
  amx_configure();
  // Two sets of four accumulators as stored: while the tiles compute into one set, the other
  // set's rows are rounded out, a few per step (see `emit`).
  alignas(64) float c[2][4][16 * 16];
  const int64_t chunks = in / 32, block = pairs * 32, xs = in * 2;
  auto tile = [&](int64_t m) { return xlast && m == mtiles - 1 ? xlast : x + m * 16 * in; };
  // A stored set of accumulators whose rows are not all out yet: row tiles m (and m + 1 where
  // `mtwo`) by blocks b (and b + 1 where `two`); rows [0, done) of its work are out.
  // Work of a set: 16 rows of each accumulator (64), or with `Gated` 16 rows of each row tile
  // (32), every row being a pair of accumulators (gate, up) into one output block.
  constexpr int64_t kWork = Gated ? 32 : 64;
  struct Pending {
    const float (*c)[16 * 16] = nullptr;
    int64_t m = 0, b = 0, done = kWork;  // (none at first)
    bool mtwo = false, two = false;
  } pend;
  // Rows [pend.done, upto) of the pending set out: rounded to bfloat16 (with `Gated`, each
  // product rounded, then silu(gate) * up rounded, as `bf16_linear` then `silu_mul` round).
  auto emit = [&](int64_t upto) {
    for (; pend.done < upto; ++pend.done) {
      const int64_t t = pend.done / 16, r = pend.done % 16;
      const int64_t mt = pend.m + (t & 1);  // accumulators 0, 2: tile m; 1, 3: tile m + 1
      if (((t & 1) && !pend.mtwo) || (t >= 2 && !pend.two) || mt * 16 + r >= rows) continue;
      if constexpr (Gated) {
        const __m512 g = widen16(round16(_mm512_load_ps(pend.c[t] + 16 * r)));
        const __m512 u = widen16(round16(_mm512_load_ps(pend.c[t + 2] + 16 * r)));
        uint16_t* dst = y + (mt * 16 + r) * out + pend.b / 2 * 16;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), round16(silu_mul16(g, u)));
      } else {
        const int64_t b = pend.b + (t >> 1);
        const int64_t n = std::min<int64_t>(16, out - b * 16);
        store16_masked(y + (mt * 16 + r) * out + b * 16, _mm512_load_ps(pend.c[t] + 16 * r),
                       (__mmask16)((1U << n) - 1));
      }
    }
  };
  const int64_t per_emit = (kWork + chunks - 1) / chunks;  // rows out per step
  int set = 0;
  const int64_t steps = (mtiles + 1) / 2 * chunks;
  const int64_t per_step = (2 * block * 2 / 64 + steps - 1) / steps;  // lines to prefetch
  for (int64_t b = b0; b < b1; b += 2) {
    const bool two = b + 1 < b1;
    const uint16_t* w0 = wp + b * block;
    const uint16_t* w1 = two ? w0 + block : w0;  // (a lone block's second products are unused)
    const char* next = reinterpret_cast<const char*>(wp + (b + 2) * block);
    const int64_t fetch = std::clamp<int64_t>(b1 - b - 2, 0, 2) * block * 2 / 64;  // its lines
    int64_t line = 0;
    for (int64_t m = 0; m < mtiles; m += 2) {
      const bool mtwo = m + 1 < mtiles;
      const uint16_t* x0 = tile(m);
      const uint16_t* x1 = mtwo ? tile(m + 1) : nullptr;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < chunks; ++k) {
        for (const int64_t stop = std::min(fetch, line + per_step); line < stop; ++line)
          _mm_prefetch(next + line * 64, _MM_HINT_T1);
        _tile_loadd(4, x0 + k * 32, xs);
        _tile_loadd(6, w0 + k * 512, 64);
        _tile_loadd(7, w1 + k * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        if (mtwo) {  // (a lone last row tile does half the products)
          _tile_loadd(5, x1 + k * 32, xs);
          _tile_dpbf16ps(1, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        // The vector unit rounds the last set out while the tile unit computes this one.
        emit(std::min(kWork, pend.done + per_emit));
      }
      emit(kWork);
      _tile_stored(0, c[set][0], 64);
      _tile_stored(2, c[set][2], 64);
      if (mtwo) {
        _tile_stored(1, c[set][1], 64);
        _tile_stored(3, c[set][3], 64);
      }
      pend = Pending{c[set], m, b, 0, mtwo, two};
      set ^= 1;
    }
  }
  emit(kWork);
  _tile_release();
}

// Buffers a thread reuses across its blocks of queries.
struct AmxScratch {
  std::vector<float> s;     // scores of 16 queries [16][n16]
  std::vector<uint16_t> p;  // probabilities, bfloat16 [16][n32]
  std::vector<uint16_t> q;  // 16 queries [16][D], zero rows past the sequence
  alignas(64) float o[16 * 16];        // one output tile
  alignas(64) float sums[16 * 16];     // each row's sum of probabilities, in column 0
  alignas(64) uint32_t ones[16 * 16];  // a B tile whose column 0 is all ones (bfloat16 pairs)
  AmxScratch() {
    std::memset(ones, 0, sizeof(ones));
    for (int r = 0; r < 16; ++r) ones[16 * r] = 0x3F803F80u;  // (1.0, 1.0) in bfloat16
  }
};

// Keys [j0, j1) (j0 a multiple of 32) of one (sequence, key/value head), key j's K at
// kraw + j * kstep and its V at vraw + j * vstep (rows of fused Q/K/V, or a cache's columns),
// packed as B tiles (`k` and `v` zeroed before: the padding keys past the sequence stay zero).
// K: tile (block b of 16 keys, slice s of 32 elements) row r holds, for each of the block's
// keys, the pair of elements (2r, 2r + 1): a 16 x 16 transpose of 32-bit pairs. V: tile (block
// b of 32 keys, d block c of 16) row r holds, for each of the 16 columns, the pair (key 2r,
// key 2r + 1) of that column.
template <int D>
void pack_kv_amx(const uint16_t* kraw, int64_t kstep, const uint16_t* vraw, int64_t vstep,
                 int64_t j0, int64_t j1, uint32_t* k, uint32_t* v) {
  constexpr int DS = D / 32, DB = D / 16;
  for (int64_t j = j0; j < j1; ++j) {
    const auto* krow = reinterpret_cast<const uint32_t*>(kraw + j * kstep);
    if (j + 8 < j1) fetch_row(kraw + (j + 8) * kstep, 2 * D);
    uint32_t* dst = k + (j / 16) * DS * 256 + (j % 16);
    for (int s = 0; s < DS; ++s)
      for (int r = 0; r < 16; ++r) dst[s * 256 + r * 16] = krow[s * 16 + r];
  }
  alignas(64) static constexpr uint16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                   37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                   11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(kLo);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j = j0; j < j1; j += 2) {
    const uint16_t* a = vraw + j * vstep;
    const uint16_t* b = a + vstep;
    const bool pair = j + 1 < j1;
    if (j + 8 < j1) fetch_row(a + 8 * vstep, 2 * D);
    if (j + 9 < j1) fetch_row(a + 9 * vstep, 2 * D);
    uint32_t* dst = v + (j / 32) * DB * 256 + ((j % 32) / 2) * 16;
    for (int c2 = 0; c2 < DS; ++c2) {  // 32 columns at a time: two d blocks
      const __m512i va = _mm512_loadu_si512(a + 32 * c2);
      const __m512i vb = pair ? _mm512_loadu_si512(b + 32 * c2) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + (2 * c2) * 256, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(dst + (2 * c2 + 1) * 256, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// The queries of keys i0 .. i0 + 15 of one (sequence of n keys, query head), against its
// key/value head's packed K and V (`pack_kv_amx`). The sequence's queries are its keys from
// `past` on (0 for a whole prompt or an encoder's sequence; the cached columns' count for a
// prompt's later chunk): the query of key t is at q + (t - past) * q_step, its output at
// out + (t - past) * out_step; rows of the block before `past` are left out. `causal`: the
// query of key t sees keys 0..t only, and the block reads no key past its last query. Tile 7
// holds `w.ones`.
template <int D>
void attend_block_amx(const uint16_t* q, int64_t q_step, const uint32_t* k, const uint32_t* v,
                      int64_t n, int64_t past, int64_t i0, float scale, bool causal,
                      AmxScratch& w, c10::BFloat16* out, int64_t out_step) {
  constexpr int DS = D / 32;  // 32-wide slices of head_dim (A tiles of Q, B tiles of K)
  constexpr int DB = D / 16;  // 16-wide blocks of head_dim (output tiles)
  const int64_t m = std::min<int64_t>(16, n - i0);
  const int64_t r0 = std::max<int64_t>(0, past - i0);  // the block's first row with a query
  // Keys this block reads: all, or (causal) up to its last query.
  const int64_t nk = causal ? std::min(n, i0 + 16) : n;
  const int64_t nk16 = (nk + 15) / 16 * 16, nk32 = (nk + 31) / 32 * 32;
  float* const scores = at64(w.s, 16 * nk16);
  uint16_t* const probs = at64(w.p, 16 * nk32);
  uint16_t* const queries = at64(w.q, 16 * D);
  const float base2 = scale * 1.44269504088896341f;  // e^(scale x) = 2^(base2 x)
  const __m512 vbase2 = _mm512_set1_ps(base2);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t tail = nk - (nk16 - 16);
  const __mmask16 keep = static_cast<__mmask16>(tail == 16 ? 0xFFFF : (1u << tail) - 1);
  for (int64_t r = std::max<int64_t>(16, r0); r < 32 && i0 + r < n; ++r)  // the next block's
    fetch_row(q + (i0 + r - past) * q_step, 2 * D);                        // queries, ahead
  for (int64_t r = 0; r < 16; ++r) {
    uint16_t* qd = queries + r * D;
    if (r >= r0 && r < m) std::memcpy(qd, q + (i0 + r - past) * q_step, D * sizeof(uint16_t));
    else std::memset(qd, 0, D * sizeof(uint16_t));
  }
  // Scores: tile 0 accumulates, tile 1 holds K's slice, tiles 2.. hold Q's slices.
  _tile_loadd(2, queries, D * 2);  // tile registers are immediates: no loop
  if constexpr (DS > 1) _tile_loadd(3, queries + 32, D * 2);
  if constexpr (DS > 2) _tile_loadd(4, queries + 64, D * 2);
  if constexpr (DS > 3) _tile_loadd(5, queries + 96, D * 2);
  for (int64_t b = 0; b < nk16 / 16; ++b) {
    _tile_zero(0);
    for (int s = 0; s < DS; ++s) {
      _tile_loadd(1, k + (b * DS + s) * 256, 64);
      switch (s) {  // the tile register is an immediate
        case 0: _tile_dpbf16ps(0, 2, 1); break;
        case 1: _tile_dpbf16ps(0, 3, 1); break;
        case 2: _tile_dpbf16ps(0, 4, 1); break;
        default: _tile_dpbf16ps(0, 5, 1); break;
      }
    }
    _tile_stored(0, scores + b * 16, nk16 * 4);
  }
  // Softmax per query in float32, the scale folded into a base-2 exponent (one multiply-add
  // per score); the probabilities are rounded to bfloat16 for the second product, so 2^f
  // needs only a degree-4 polynomial (relative error < 5e-5, a hundredth of bfloat16's step).
  for (int64_t r = 0; r < r0; ++r)  // rows before the first query weigh nothing
    std::memset(probs + r * nk32, 0, nk32 * sizeof(uint16_t));
  for (int64_t r = r0; r < m; ++r) {
    const float* srow = scores + r * nk16;
    __m512 top = ninf;
    // The last block's real keys: those before nk, or (causal) up to this query.
    const __mmask16 last = causal ? static_cast<__mmask16>((1u << (r + 1)) - 1) : keep;
    for (int64_t jb = 0; jb + 16 < nk16; jb += 16)
      top = _mm512_max_ps(top, _mm512_loadu_ps(srow + jb));
    top = _mm512_mask_max_ps(top, last, top, _mm512_loadu_ps(srow + nk16 - 16));
    const __m512 shift = _mm512_set1_ps(-_mm512_reduce_max_ps(top) * base2);
    uint16_t* prow = probs + r * nk32;
    for (int64_t jb = 0; jb < nk16; jb += 16) {
      __m512 e = exp2_coarse16(_mm512_fmadd_ps(_mm512_loadu_ps(srow + jb), vbase2, shift));
      if (jb + 16 == nk16) e = _mm512_maskz_mov_ps(last, e);  // masked keys weigh nothing
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + jb), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (nk16 < nk32) std::memset(prow + nk16, 0, 16 * sizeof(uint16_t));
  }
  for (int64_t r = m; r < 16; ++r)  // rows past the sequence weigh nothing
    std::memset(probs + r * nk32, 0, nk32 * sizeof(uint16_t));
  // Weighted sums, one d block at a time: tile 0 accumulates, 1 holds P, 2 holds V. Beside
  // the first block, tile 6 sums each row's probabilities (P times a column of ones in tile
  // 7): the normaliser is the sum of the very bfloat16 values multiplied, at no vector cost.
  _tile_zero(6);
  for (int c = 0; c < DB; ++c) {
    _tile_zero(0);
    for (int64_t b = 0; b < nk32 / 32; ++b) {
      _tile_loadd(1, probs + b * 32, nk32 * 2);
      _tile_loadd(2, v + (b * DB + c) * 256, 64);
      _tile_dpbf16ps(0, 1, 2);
      if (c == 0) _tile_dpbf16ps(6, 1, 7);
    }
    if (c == 0) _tile_stored(6, w.sums, 64);
    _tile_stored(0, w.o, 64);
    for (int64_t r = r0; r < m; ++r)
      store16(out + (i0 + r - past) * out_step + 16 * c,
              _mm512_mul_ps(_mm512_loadu_ps(w.o + 16 * r), _mm512_set1_ps(1.f / w.sums[16 * r])));
  }
}

// One sequence of a grouped-query attention on tiles: where its keys, values and queries lie.
// Key j of key/value head h: K at k + h * k_head + j * k_step, V likewise; the query of key t
// (t >= past) for query head h at q + h * D + (t - past) * q_step, its output at
// out + h * D + (t - past) * out_step.
struct SeqView {
  const uint16_t* k;
  const uint16_t* v;
  int64_t k_step, v_step, k_head, v_head;
  const uint16_t* q;
  int64_t q_step;
  c10::BFloat16* out;
  int64_t out_step;
  int64_t n, past;  // keys, and the keys before the first query
};

// Grouped-query attention of every (sequence, query head) on tiles, in two passes: each
// (sequence, key/value head)'s K and V packed once, in chunks of 32 keys, for all the query
// heads that share it; then every block of 16 queries, tasks ordered by sequence and head so
// that the threads' halves hold equal shares of a causal prompt (whose later blocks read more
// keys). A task per (sequence, query head) had packed its own K and V (three times over for
// SmolLM2's groups of three), and the threads' shares followed the sequences: SmolLM2's 30
// layers for prompts of 400, 130 and 17 tokens took 22.7-26.5 ms that way, 12.3-13.4 in two
// passes; one 400-token prompt 11.4 / 11.5 against 10.7 / 11.3 (Intel Xeon family 6 model
// 207, 2 threads, best of 9).
template <int D>
void grouped_attention_amx(const std::vector<SeqView>& seqs, int64_t heads, int64_t kv_heads,
                           float scale, bool causal) {
  constexpr int DS = D / 32, DB = D / 16;
  constexpr int64_t kChunk = 2 * DS * 256, vChunk = DB * 256;
  const int64_t sequences = static_cast<int64_t>(seqs.size()), group = heads / kv_heads;
  // Per sequence: its first chunk of 32 keys, and its first block of 16 queries (blocks before
  // `past` hold no query), counted over all.
  std::vector<int64_t> chunk0(sequences + 1, 0), block0(sequences + 1, 0);
  for (int64_t s = 0; s < sequences; ++s) {
    const int64_t n = seqs[s].n;
    chunk0[s + 1] = chunk0[s] + (n + 31) / 32;
    block0[s + 1] = block0[s] + (n + 15) / 16 - seqs[s].past / 16;
  }
  // A chunk's K tiles (two blocks of 16 keys) and V tiles (one block of 32), per kv head.
  const int64_t chunks = chunk0[sequences];
  std::vector<uint32_t> kstore, vstore;
  uint32_t* kbuf = zeroed64(kstore, chunks * kv_heads * kChunk);
  uint32_t* vbuf = zeroed64(vstore, chunks * kv_heads * vChunk);
  // K and V of (sequence s, kv head h): from chunk (chunk0[s] * kv_heads + h * its chunks).
  auto kv_at = [&](int64_t s, int64_t h) {
    return chunk0[s] * kv_heads + h * (chunk0[s + 1] - chunk0[s]);
  };
  at::parallel_for(0, chunks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / kv_heads, h = t % kv_heads;
      const int64_t s = std::upper_bound(chunk0.begin(), chunk0.end(), g) - chunk0.begin() - 1;
      const SeqView& e = seqs[s];
      const int64_t j0 = (g - chunk0[s]) * 32, at = kv_at(s, h);
      pack_kv_amx<D>(e.k + h * e.k_head, e.k_step, e.v + h * e.v_head, e.v_step, j0,
                     std::min(e.n, j0 + 32), kbuf + at * kChunk, vbuf + at * vChunk);
    }
  });
  const int64_t tasks = block0[sequences] * heads;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    AmxScratch w;
    amx_configure();
    _tile_loadd(7, w.ones, 64);
    for (int64_t t = begin; t < end; ++t) {
      // task t: sequence s, then head h, then block b (b fastest)
      const int64_t g = t / heads;  // t's sequence is the one holding block g of the count
      const int64_t s = std::upper_bound(block0.begin(), block0.end(), g) - block0.begin() - 1;
      const SeqView& e = seqs[s];
      const int64_t blocks = block0[s + 1] - block0[s], r = t - block0[s] * heads;
      const int64_t h = r / blocks, b = r % blocks + e.past / 16;
      const int64_t at = kv_at(s, h / group);
      attend_block_amx<D>(e.q + h * D, e.q_step, kbuf + at * kChunk, vbuf + at * vChunk, e.n,
                          e.past, 16 * b, scale, causal, w, e.out + h * D, e.out_step);
    }
    _tile_release();
  });
}

// The attention of every (sequence, query head) of a packed batch on tiles, each sequence's
// tokens attending to its own (see `packed_attention`).
template <int D>
void packed_attention_amx(const c10::BFloat16* qkv, const int64_t* o, int64_t sequences,
                          int64_t heads, int64_t kv_heads, int64_t stride, float scale,
                          bool causal, c10::BFloat16* dst) {
  constexpr int DS = D / 32, DB = D / 16;
  constexpr int64_t kChunk = 2 * DS * 256, vChunk = DB * 256;
  const int64_t hidden = heads * D, group = heads / kv_heads;
  const auto* raw = reinterpret_cast<const uint16_t*>(qkv);
  if (group == 1) {
    // One query head per key/value head (an encoder's batch: many short sequences): a task
    // per (sequence, head) packs its K and V on the thread that reads them, where they stay
    // in cache (two passes took 20 against 12 ms for MiniLM's shapes, 32 x 40 tokens).
    at::parallel_for(0, sequences * heads, 1, [&](int64_t begin, int64_t end) {
      AmxScratch w;
      std::vector<uint32_t> k, v;
      amx_configure();
      _tile_loadd(7, w.ones, 64);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t s = t / heads, h = t % heads, n = o[s + 1] - o[s], chunks = (n + 31) / 32;
        const uint16_t* base = raw + o[s] * stride;
        uint32_t* kp = zeroed64(k, chunks * kChunk);
        uint32_t* vp = zeroed64(v, chunks * vChunk);
        pack_kv_amx<D>(base + hidden + h * D, stride, base + 2 * hidden + h * D, stride, 0, n,
                       kp, vp);
        for (int64_t i0 = 0; i0 < n; i0 += 16)
          attend_block_amx<D>(base + h * D, stride, kp, vp, n, 0, i0, scale, causal, w,
                              dst + o[s] * hidden + h * D, hidden);
      }
      _tile_release();
    });
    return;
  }
  std::vector<SeqView> seqs(sequences);
  for (int64_t s = 0; s < sequences; ++s) {
    const uint16_t* base = raw + o[s] * stride;
    seqs[s] = SeqView{base + hidden, base + hidden + kv_heads * D, stride, stride, D, D,
                      base, stride, dst + o[s] * hidden, hidden, o[s + 1] - o[s], 0};
  }
  grouped_attention_amx<D>(seqs, heads, kv_heads, scale, causal);
}
#endif

}  // namespace

at::Tensor packed_attention(const at::Tensor& qkv, const at::Tensor& offsets, int64_t heads,
                            double scale, bool use_amx, int64_t kv_heads, bool causal) {
  if (kv_heads <= 0) kv_heads = heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(),
              "packed_attention: qkv must be a contiguous [tokens, (heads + 2 kv_heads) x dim]");
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == at::kLong && offsets.numel() >= 2,
              "packed_attention: offsets must be int64 [sequences + 1]");
  TORCH_CHECK(heads > 0 && heads % kv_heads == 0,
              "packed_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "packed_attention: qkv's width is not (heads + 2 kv_heads) x head_dim");
  const int64_t head_dim = qkv.size(1) / (heads + 2 * kv_heads), hidden = heads * head_dim;
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128,
              "packed_attention: head_dim must be 32, 64 or 128");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "packed_attention: qkv must be float32 or bfloat16");
  const auto off = offsets.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const int64_t sequences = off.numel() - 1;
  TORCH_CHECK(o[0] == 0 && o[sequences] == qkv.size(0),
              "packed_attention: offsets must run from 0 to the token count");
  for (int64_t s = 0; s < sequences; ++s)
    TORCH_CHECK(o[s + 1] > o[s], "packed_attention: offsets must increase (no empty sequence)");
  auto out = at::empty({qkv.size(0), hidden}, qkv.options());
#if defined(__AVX512F__)
  const float fscale = static_cast<float>(scale);
  const int64_t stride = qkv.size(1);
#if defined(LENBATCH_AMX)
  if (use_amx && qkv.scalar_type() == at::kBFloat16 && amx_ready()) {
    const auto* q = qkv.data_ptr<c10::BFloat16>();
    auto* dst = out.data_ptr<c10::BFloat16>();
    if (head_dim == 32)
      packed_attention_amx<32>(q, o, sequences, heads, kv_heads, stride, fscale, causal, dst);
    else if (head_dim == 64)
      packed_attention_amx<64>(q, o, sequences, heads, kv_heads, stride, fscale, causal, dst);
    else
      packed_attention_amx<128>(q, o, sequences, heads, kv_heads, stride, fscale, causal, dst);
    return out;
  }
#endif
  // The AVX-512 loop: bidirectional, one key/value head per query head (encoders).
  TORCH_CHECK(!causal && kv_heads == heads,
              "packed_attention: causal or grouped-query attention runs only on AMX tiles in "
              "bfloat16 (use torch's attention elsewhere)");
  auto run = [&](auto tag, auto nv) {
    using T = decltype(tag);
    constexpr int NV = decltype(nv)::value;
    const T* q = qkv.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, sequences * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> kt, vf, sc, qf;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / heads, h = task % heads, start = o[s];
        packed_head<T, NV>(q + start * stride, stride, hidden, h, o[s + 1] - start, fscale, kt,
                           vf, sc, qf, dst + start * hidden);
      }
    });
  };
  auto by_dim = [&](auto tag) {
    switch (head_dim) {
      case 32: run(tag, std::integral_constant<int, 2>{}); break;
      case 64: run(tag, std::integral_constant<int, 4>{}); break;
      case 128: run(tag, std::integral_constant<int, 8>{}); break;
      default: TORCH_CHECK(false, "packed_attention: head_dim must be 32, 64 or 128");
    }
  };
  if (qkv.scalar_type() == at::kBFloat16) by_dim(c10::BFloat16{});
  else by_dim(float{});
#elif defined(__AVX2__) && defined(__FMA__)
  // The AVX2 loop: float32; an encoder (bidirectional, one key/value head per query head) or a
  // causal LM's whole prompt (causal, grouped-query heads).
  TORCH_CHECK(qkv.scalar_type() == at::kFloat,
              "packed_attention: an AVX2 build runs float32 only (use torch's attention "
              "elsewhere)");
  const float fscale = static_cast<float>(scale);
  const int64_t stride = qkv.size(1);
  const float* q = qkv.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  if (causal || kv_heads != heads) {
    TORCH_CHECK(causal, "packed_attention: grouped-query heads need causal (a causal LM)");
    // One task per (sequence, query head): a 2-core machine splits a prompt's 9 heads 5 / 4,
    // where tasks per key/value head (3) would split 2 / 1. Each lays out its key/value head
    // itself (a few % of the scores' work at 100+ tokens).
    const int64_t group = heads / kv_heads, kv_hidden = kv_heads * head_dim;
    auto run = [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      at::parallel_for(0, sequences * heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> kt, vf, sc, qf;
        for (int64_t task = begin; task < end; ++task) {
          const int64_t s = task / heads, h = task % heads, start = o[s], g = h / group;
          packed_heads_avx2<D, 1, true>(q + start * stride, stride, hidden, h,
                                        hidden + g * D, hidden + kv_hidden + g * D,
                                        o[s + 1] - start, fscale, kt, vf, sc, qf,
                                        dst + start * hidden);
        }
      });
    };
    if (head_dim == 32) run(std::integral_constant<int, 32>{});
    else if (head_dim == 64) run(std::integral_constant<int, 64>{});
    else run(std::integral_constant<int, 128>{});
    return out;
  }
  // Tasks of G heads of one sequence, G x head_dim up to 128 floats where G divides heads.
  auto run = [&](auto dim, auto group) {
    constexpr int D = decltype(dim)::value, G = decltype(group)::value;
    const int64_t groups = heads / G;
    at::parallel_for(0, sequences * groups, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> kt, vf, sc, qf;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / groups, g = task % groups, start = o[s];
        packed_heads_avx2<D, G>(q + start * stride, stride, hidden, g * G,
                                hidden + g * G * D, 2 * hidden + g * G * D, o[s + 1] - start,
                                fscale, kt, vf, sc, qf, dst + start * hidden);
      }
    });
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  if (head_dim == 32 && heads % 4 == 0) run(std::integral_constant<int, 32>{}, I4{});
  else if (head_dim == 32 && heads % 2 == 0) run(std::integral_constant<int, 32>{}, I2{});
  else if (head_dim == 32) run(std::integral_constant<int, 32>{}, I1{});
  else if (head_dim == 64 && heads % 2 == 0) run(std::integral_constant<int, 64>{}, I2{});
  else if (head_dim == 64) run(std::integral_constant<int, 64>{}, I1{});
  else run(std::integral_constant<int, 128>{}, I1{});
#else
  TORCH_CHECK(false, "packed_attention: built without AVX-512 or AVX2");
#endif
  return out;
}

// A causal LM's prompt chunk attending over its cached columns and its own, on AMX tiles in
// bfloat16: the later chunks of a prompt prefilled in pieces, and a job's left-padded rows.
// Each row is one sequence of its real columns, so nothing padded is read; query blocks start
// at the 16-key block holding the row's first query, so the causal mask stays per block.
// Why: torch's SDPA with a boolean mask over every column took 9-12 ms more per forward past
// saturation than the tile attention of whole prompts (SmolLM2, 27 decode rows + a chunk).
//
// qkv    [rows * new, (heads + 2 kv_heads) * D]  the chunk's fused Q/K/V rows (Q rotated),
//                                                contiguous; only Q is read
// keys   [rows, kv_heads, width, D]              the layer's keys so far, the chunk's last
//                                                (head_dim contiguous, any other strides)
// values [rows, kv_heads, width, D]              the same for values
// starts [rows] int64                            row r's real columns are starts[r]..width-1
// out    [rows * new, heads * D]                 zero for the chunk's padding columns
at::Tensor chunk_attention(const at::Tensor& qkv, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& starts, int64_t heads, double scale) {
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.sizes() == values.sizes(),
              "chunk_attention: keys and values must be [rows, kv_heads, width, head_dim]");
  const int64_t rows = keys.size(0), kv_heads = keys.size(1), width = keys.size(2),
                head_dim = keys.size(3);
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128,
              "chunk_attention: head_dim must be 32, 64 or 128");
  TORCH_CHECK(heads > 0 && heads % kv_heads == 0,
              "chunk_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() &&
                  qkv.size(1) == (heads + 2 * kv_heads) * head_dim && rows > 0 &&
                  qkv.size(0) % rows == 0 && qkv.size(0) / rows <= width,
              "chunk_attention: qkv must be a contiguous [rows x new, (heads + 2 kv_heads) x "
              "head_dim], new at most the keys' width");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1,
              "chunk_attention: keys and values need a contiguous last dimension");
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16,
              "chunk_attention: qkv, keys and values must be bfloat16");
  TORCH_CHECK(starts.dim() == 1 && starts.numel() == rows && starts.scalar_type() == at::kLong,
              "chunk_attention: starts must be int64 [rows]");
  const int64_t fresh = qkv.size(0) / rows, lo = width - fresh, hidden = heads * head_dim;
  auto out = at::zeros({qkv.size(0), hidden}, qkv.options());
#if defined(LENBATCH_AMX)
  TORCH_CHECK(amx_ready(), "chunk_attention: needs the AMX tile unit");
  const auto st = starts.contiguous();
  const int64_t* first = st.data_ptr<int64_t>();
  const auto* q = reinterpret_cast<const uint16_t*>(qkv.data_ptr<c10::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(keys.data_ptr<c10::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(values.data_ptr<c10::BFloat16>());
  auto* dst = out.data_ptr<c10::BFloat16>();
  const int64_t stride = qkv.size(1);
  std::vector<SeqView> seqs;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s0 = first[r];
    TORCH_CHECK(s0 >= 0 && s0 <= width, "chunk_attention: starts must lie in 0..width");
    if (s0 == width) continue;  // a row with no real column yet: its output stays zero
    const int64_t c0 = std::max(lo, s0), at = r * fresh + c0 - lo;
    seqs.push_back(SeqView{kp + r * keys.stride(0) + s0 * keys.stride(2),
                           vp + r * values.stride(0) + s0 * values.stride(2), keys.stride(2),
                           values.stride(2), keys.stride(1), values.stride(1), q + at * stride,
                           stride, dst + at * hidden, hidden, width - s0, c0 - s0});
  }
  const float fscale = static_cast<float>(scale);
  if (head_dim == 32) grouped_attention_amx<32>(seqs, heads, kv_heads, fscale, true);
  else if (head_dim == 64) grouped_attention_amx<64>(seqs, heads, kv_heads, fscale, true);
  else grouped_attention_amx<128>(seqs, heads, kv_heads, fscale, true);
#else
  TORCH_CHECK(false, "chunk_attention: built without AMX");
#endif
  return out;
}

// One decode step's decoder layers on the lean Llama path, in one call: the ops
// `LeanLlama.forward_segments` calls one at a time from Python (the same ops, the same order,
// so the same bits). Why: at one row a layer's eight op calls and their Python glue (slicing
// the fused product, the cache write, views) took ~2 ms of a ~12 ms step (SmolLM2, 30 layers,
// Intel Xeon family 6 model 207), and each call released and took back the GIL, where a
// server's event loop could hold it.
//
// `products` runs the four products of layer l: qkv(x, l), o(a, l), act(x, l) (the gated
// MLP's silu(gate) * up) and down(act, l). `decode_layers` runs them with the few-row
// bfloat16 op, `decode_layers_groups` with the float32 group loop (GGUF blocks).
//
// h, x     [rows, hidden]: the residual stream and its first RMSNorm (h is updated in place)
// ln1, ln2 one per layer (ln1[0] is already applied in x)
// kbufs, vbufs  one per layer, [row_capacity, kv_heads, col_capacity, head_dim]: rows
//          [0, rows) and columns [start, end) hold the cache; this step's keys and values
//          are written at column `end` (the caller has made room)
// cos, sin [rows, 1, head_dim]: each row's position;  mask [rows, end - start + 1] bool
// Returns h after the last layer (before the final norm).
template <typename Products>
at::Tensor run_decode_layers(const char* name, const Products& products, at::ScalarType dtype,
                             at::Tensor h, at::Tensor x, const std::vector<at::Tensor>& ln1,
                             const std::vector<at::Tensor>& ln2,
                             const std::vector<at::Tensor>& kbufs,
                             const std::vector<at::Tensor>& vbufs, int64_t start, int64_t end,
                             const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                             int64_t heads, int64_t kv_heads, double scale, double eps) {
  const int64_t layers = static_cast<int64_t>(ln1.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(ln2.size()) == layers &&
                  static_cast<int64_t>(kbufs.size()) == layers &&
                  static_cast<int64_t>(vbufs.size()) == layers,
              name, ": one ln1, ln2, key and value buffer per layer");
  TORCH_CHECK(h.dim() == 2 && h.sizes() == x.sizes() && h.is_contiguous() && x.is_contiguous() &&
                  h.scalar_type() == dtype && x.scalar_type() == dtype,
              name, ": h and x must be ", dtype, " [rows, hidden], contiguous");
  const int64_t rows = h.size(0), head_dim = kbufs[0].size(3);
  const int64_t width = end - start + 1;
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
              name, ": heads must be a multiple of kv_heads");
  TORCH_CHECK(start >= 0 && end >= start && mask.dim() == 2 && mask.size(0) == rows &&
                  mask.size(1) == width && mask.scalar_type() == at::kBool,
              name, ": mask must be bool [rows, end - start + 1]");
  for (int64_t l = 0; l < layers; ++l) {
    for (const at::Tensor* buf : {&kbufs[l], &vbufs[l]}) {
      TORCH_CHECK(buf->dim() == 4 && buf->scalar_type() == dtype && buf->size(0) >= rows &&
                      buf->size(1) == kv_heads && buf->size(2) > end &&
                      buf->size(3) == head_dim && buf->stride(3) == 1,
                  name, ": key/value buffers must be ", dtype,
                  " [>= rows, kv_heads, > end, head_dim] with room for column end");
    }
  }
  const int64_t fused = heads + 2 * kv_heads;
  for (int64_t l = 0; l < layers; ++l) {
    auto qkv = products.qkv(x, l);
    rope(qkv.view({rows, 1, fused, head_dim}), cos, sin, heads + kv_heads);
    auto heads_of = qkv.view({rows, fused, head_dim});
    auto keys = kbufs[l].slice(0, 0, rows);
    auto values = vbufs[l].slice(0, 0, rows);
    keys.select(2, end).copy_(heads_of.slice(1, heads, heads + kv_heads));
    values.select(2, end).copy_(heads_of.slice(1, heads + kv_heads, fused));
    auto a = decode_attention(heads_of.slice(1, 0, heads).contiguous(),
                              keys.slice(2, start, end + 1), values.slice(2, start, end + 1),
                              mask, scale);
    auto o = products.o(a.view({rows, heads * head_dim}), l);
    x = add_rms_norm(h, o, ln2[l], eps);
    auto down = products.down(products.act(x, l), l);
    if (l + 1 < layers) {
      x = add_rms_norm(h, down, ln1[l + 1], eps);
    } else {
      h.add_(down);
    }
  }
  return h;
}

// The few-row bfloat16 products: `weights` four per layer, packed as `bf16_linear` reads them
// (Q/K/V, O, gate/up interleaved as `bf16_gate_up_silu` reads it, down).
struct Bf16Products {
  const std::vector<at::Tensor>& w;
  int64_t qkv_out, hidden, inter;
  at::Tensor qkv(const at::Tensor& x, int64_t l) const {
    return bf16_linear(x, w[4 * l], qkv_out, true);
  }
  at::Tensor o(const at::Tensor& a, int64_t l) const {
    return bf16_linear(a, w[4 * l + 1], hidden, true);
  }
  at::Tensor act(const at::Tensor& x, int64_t l) const {
    return bf16_gate_up_silu(x, w[4 * l + 2], inter, true);
  }
  at::Tensor down(const at::Tensor& act, int64_t l) const {
    return bf16_linear(act, w[4 * l + 3], hidden, true);
  }
};

at::Tensor decode_layers(at::Tensor h, at::Tensor x, const std::vector<at::Tensor>& ln1,
                         const std::vector<at::Tensor>& ln2,
                         const std::vector<at::Tensor>& weights,
                         const std::vector<at::Tensor>& kbufs,
                         const std::vector<at::Tensor>& vbufs, int64_t start, int64_t end,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask,
                         int64_t heads, int64_t kv_heads, int64_t inter, double scale,
                         double eps) {
  TORCH_CHECK(weights.size() == 4 * ln1.size(), "decode_layers: four weights per layer");
  TORCH_CHECK(!kbufs.empty(), "decode_layers: no layers");
  const int64_t qkv_out = (heads + 2 * kv_heads) * kbufs[0].size(3);
  const Bf16Products products{weights, qkv_out, h.size(-1), inter};
  return run_decode_layers("decode_layers", products, at::kBFloat16, h, x, ln1, ln2, kbufs,
                           vbufs, start, end, cos, sin, mask, heads, kv_heads, scale, eps);
}

// The float32 group loop's products (`group_linear`): `groups` three tensors (q, scale, lo)
// for each of a layer's four products (Q/K/V, O, gate/up, down), twelve per layer; the
// gate/up product is followed by `silu_mul`.
struct GroupProducts {
  const std::vector<at::Tensor>& g;
  at::Tensor product(const at::Tensor& x, int64_t l, int64_t k) const {
    const int64_t i = 12 * l + 3 * k;
    return group_linear(x, g[i], g[i + 1], g[i + 2]);
  }
  at::Tensor qkv(const at::Tensor& x, int64_t l) const { return product(x, l, 0); }
  at::Tensor o(const at::Tensor& a, int64_t l) const { return product(a, l, 1); }
  at::Tensor act(const at::Tensor& x, int64_t l) const { return silu_mul(product(x, l, 2)); }
  at::Tensor down(const at::Tensor& act, int64_t l) const { return product(act, l, 3); }
};

at::Tensor decode_layers_groups(at::Tensor h, at::Tensor x, const std::vector<at::Tensor>& ln1,
                                const std::vector<at::Tensor>& ln2,
                                const std::vector<at::Tensor>& groups,
                                const std::vector<at::Tensor>& kbufs,
                                const std::vector<at::Tensor>& vbufs, int64_t start,
                                int64_t end, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& mask, int64_t heads, int64_t kv_heads,
                                double scale, double eps) {
  TORCH_CHECK(groups.size() == 12 * ln1.size(),
              "decode_layers_groups: q, scale and lo of four products per layer");
  const GroupProducts products{groups};
  return run_decode_layers("decode_layers_groups", products, at::kFloat, h, x, ln1, ln2, kbufs,
                           vbufs, start, end, cos, sin, mask, heads, kv_heads, scale, eps);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every op runs without the GIL, as torch's own ops do: held, a batch's attention on one
  // runner thread stopped the other runner thread and the event loop for its whole run (the
  // server's throughput fell 16 % with the packed attention op, though the op alone was faster).
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("silu_mul", &silu_mul, nogil(), "gu [rows, 2 * inter] -> silu(gate) * up");
  m.def("rope", &rope, nogil(),
        "rotary embedding in place on the first heads of x [rows, new, heads, dim]");
  m.def("add_rms_norm", &add_rms_norm, nogil(),
        "h += delta in place; returns rms_norm(h) * weight (float32 inside)");
  m.def("has_amx", &has_amx, "Whether this build and this process can use the AMX tile unit");
  m.def("causal_float32", &causal_float32,
        "Whether packed_attention runs a causal LM's float32 prompt in this build");
  m.def("quantize_rows", &quantize_rows, nogil(),
        "x [rows, in] float32 -> (q uint8 = round(x / s) + levels + 1, s [rows] = max |x| / "
        "levels): symmetric levels per row");
  m.def("scale_rows", &scale_rows, nogil(),
        "y [rows, out] float32 in place: y * s[row] + bias, then exact GELU with gelu",
        py::arg("y"), py::arg("s"), py::arg("bias") = py::none(), py::arg("gelu") = false);
  m.def("decode_attention", &decode_attention, nogil(),
        "Decode-step attention over each row's real columns (q [rows, heads, dim])");
#if defined(LENBATCH_GROUP_LOOP)
  m.def("group_linear", &group_linear, nogil(),
        "x @ W.T for weights in groups of 32: 4-bit (q uint8, scale, lo) or 8-bit (q int8, "
        "scale), float32 activations");
  m.def("decode_layers_groups", &decode_layers_groups, nogil(),
        "One decode step's decoder layers (float32, group-loop products) in one call; writes "
        "each layer's keys and values at column end and returns the residual stream");
#endif
  // Packed attention: every build (AVX2: float32 only).
  m.def("packed_attention", &packed_attention, nogil(),
        "Packed self-attention from qkv [tokens, (heads + 2 kv_heads) x dim] and offsets "
        "(bfloat16 on the AMX tile unit where the CPU has one and use_amx is true; causal and "
        "grouped-query heads there and in an AVX2 build, which runs float32 only)",
        py::arg("qkv"), py::arg("offsets"), py::arg("heads"), py::arg("scale"),
        py::arg("use_amx") = true, py::arg("kv_heads") = 0, py::arg("causal") = false);
  // The bfloat16 products and attention paths: AVX-512 builds only (the Python side
  // looks for each op by name and runs torch where it is missing).
#if defined(__AVX512F__)
  m.def("bf16_linear", &bf16_linear, nogil(),
        "x @ W.T for bfloat16 x [rows, in] and W reordered into blocks of 16 outputs x column "
        "pairs (few rows: the weights streamed once, float32 sums)",
        py::arg("x"), py::arg("wp"), py::arg("out"), py::arg("use_amx") = true);
  m.def("bf16_gate_up_silu", &bf16_gate_up_silu, nogil(),
        "silu(x @ G.T) * (x @ U.T) for bfloat16 x [rows, in], G and U interleaved by blocks of "
        "16 outputs and reordered as for bf16_linear (each product rounded to bfloat16 first)",
        py::arg("x"), py::arg("wp"), py::arg("inter"), py::arg("use_amx") = true);
  m.def("chunk_attention", &chunk_attention, nogil(),
        "A prompt chunk's causal attention over its real cached columns and its own, on AMX "
        "tiles in bfloat16 (qkv [rows x new, ...], keys/values [rows, kv, width, dim], starts "
        "[rows] = each row's first real column)",
        py::arg("qkv"), py::arg("keys"), py::arg("values"), py::arg("starts"), py::arg("heads"),
        py::arg("scale"));
  m.def("decode_layers", &decode_layers, nogil(),
        "One decode step's decoder layers (bfloat16, few-row products) in one call; writes "
        "each layer's keys and values at column end and returns the residual stream");
#endif
}
