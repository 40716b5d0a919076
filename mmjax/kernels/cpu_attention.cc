// Decode attention on the CPU: one new token per row over that row's own cached keys, read in
// place from the engine's segmented KV cache, one call per layer (mmjax/kernels/cpu_attention.py);
// and prefill attention (mmjax_prefill_attention_*, below): several new tokens per row, each
// query over its own causal / windowed range.
//
//   mmjax_decode_attention_f32 / _bf16: q f32 [B, KVH, N, HD] (N: the queries of one KV head,
//     a GQA group), lo, hi s32 [B] (row b sees cache indexes [lo_b, hi_b)), then S K^T segments
//     [slots, KVH, HD, L_i] and S V segments [slots, KVH, L_i, HD] (f32 / bf16, slots >= B, the
//     segments covering indexes [0, sum L_i) in order); attribute scale
//     -> out f32 [B, KVH, N, HD] = softmax(scale * q K^T) V over the visible keys (zeros where no
//     key is visible).
//   mmjax_decode_attention_write_*: the same after writing each row's new token (K, V [B, KVH,
//     HD] of the cache's dtype, an int8 / fp8 cache's scales [B, KVH]) at its cache index pos_b,
//     in place (the segments are results aliased to their operands): the decode step's cache
//     update without XLA's scatter into every segment of every layer.
//   Paged caches (all three): a page table s32 [rows, max_pages] just before the segments, then
//     one K^T pool [num_pages, KVH, HD, page_size] and one V pool [num_pages, KVH, page_size, HD]
//     (, their scale pools): row b's cache index i is at page table[b, i / page_size], offset
//     i % page_size (CacheView); each page is one of the task's segments.
//   mmjax_dense_attention_f32: a vision tower's full attention (no cache), below.
//   mmjax_kv_write: a prefill's new K / V into the cache in place, any cache dtype, below.
//
// Why: XLA computes decode attention segment by segment, each behind a lax.cond on the batch's
// longest row, as 6-10 small fusions per segment and layer (~25 us each on the 2-core box): at
// batch 1 and 235 cached tokens, 1.9 ms of a 14 ms int8 decode step for 7.7 MB of cache. Here
// one task per (row, KV head) streams only that row's keys: K^T a whole row of up to 256 keys
// per head dim at a time, online softmax over those blocks (running max, rescaled sums), V rows
// accumulated into the group's outputs. All arithmetic in f32 (bf16 is widened on load).
//
// Code paths (mmjax_cpu::ActiveIsa, cpu_parallel.h): AVX-512 (Task512, PrefillTask512; Zen 4,
// Sapphire Rapids), AVX2 + FMA (Task8, PrefillTask8: the same algorithm 8 lanes wide, its block
// shapes re-chosen for 16 vector registers; Haswell, Zen 1-3), and plain C++ loops (GenericTask:
// what the tests compare against; mmjax/kernels/cpu_library.py uses the kernels only where a SIMD
// path runs).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"

namespace ffi = xla::ffi;
using mmjax_cpu::HasAvx2;
using mmjax_cpu::HasAvx512;
using mmjax_cpu::ParallelFor;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Decode tasks prefetch their cache ahead of use (Task512: K^T 4 head-dim rows ahead, then the
// block's first V rows, V 8 rows ahead): each task reads only ~2 x 64 KiB, too short for the
// hardware prefetchers to ramp up. 16 layers of the bench model's attention, f32, distinct caches,
// interleaved medians on the 2-core SPR-class VM (eighteenth session): 16 x 300 keys 22.6 -> 20.2
// ms, 8 x 300 10.7 -> 10.3, 1 x 300 1.35 -> 1.24, 16 x 1000 70.8 -> 65.2 (8 / 16 rows ahead gained
// less). 0: off (mmjax_attention_prefetch, benchmark A/B only). The score pass takes 4 head dims
// at a time for up to 4 queries (2 for 8), a score's chain in a register over them (nineteenth
// session, same bits, processes alternated 3 times: 16 x 1000 keys 55-60 -> 49-52 ms, 16 x 300
// 19.3-21.2 -> 18.9-19.7).
int g_attn_prefetch = 1;
int g_prefill_lanes = 1;       // f32 prefill on the lanes kernel (mmjax_prefill_lanes, benchmark A/B only)

// Dense attention (mmjax_dense_attention_f32): queries a task (on the vector lanes: two 16-lane
// vectors) and keys a softmax chunk (scores [chunk, 32] in L1).
constexpr int kDenseQ = 32, kDenseChunk = 256;

// One task's view of the cache: the segments' K^T [HD, L] and V [L, HD] blocks of its (row, head),
// and for an int8 cache the per-key K and V scales [L] (bf16; null otherwise).
template <typename T>
struct Segment {
  const T* kt;
  const T* v;
  int64_t len;
  const uint16_t* ks = nullptr;
  const uint16_t* vs = nullptr;
};

// An fp8 cache element (float8_e4m3fn: sign, 4 exponent bits of bias 7, 3 mantissa bits; no
// infinities, S.1111.111 is NaN). Zen 4 has no fp8 conversion instruction: the bits are moved
// into an f32 with integer ops (ToF32 / Load16).
struct F8E4M3 {
  uint8_t bits;
};

inline float ToF32(float x) { return x; }
inline float ToF32(int8_t x) { return static_cast<float>(x); }
inline float ToF32(F8E4M3 x) {
  const uint32_t em = x.bits & 0x7Fu;
  float f;
  if (em == 0x7Fu) {
    f = std::numeric_limits<float>::quiet_NaN();
  } else if (em < 8u) {
    f = static_cast<float>(em) * (1.0f / 512);          // subnormal: m x 2^-9
  } else {
    const uint32_t u = (em << 20) + (120u << 23);        // exponent bias 7 -> 127
    std::memcpy(&f, &u, 4);
  }
  return (x.bits & 0x80u) ? -f : f;
}
inline float ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---------------------------------------------------------------------------------------------
// Plain C++ (any CPU): all visible scores of the task, their softmax, then the weighted V rows.

template <typename T>
void GenericTask(const float* q, int N, int HD, const std::vector<Segment<T>>& segs, int64_t lo, int64_t hi,
                 float scale, float* out) {
  std::fill(out, out + int64_t(N) * HD, 0.f);
  const int64_t total = std::max<int64_t>(0, hi - lo);
  if (total == 0) return;
  std::vector<float> s(N * total);
  int64_t start = 0, col = 0;
  for (const auto& seg : segs) {
    const int64_t a = std::max(lo, start) - start, e = std::min(hi, start + seg.len) - start;
    for (int64_t j = a; j < e; ++j, ++col)
      for (int n = 0; n < N; ++n) {
        float acc = 0.f;
        for (int d = 0; d < HD; ++d) acc += q[n * HD + d] * ToF32(seg.kt[d * seg.len + j]);
        s[n * total + col] = acc * scale * (seg.ks ? ToF32(seg.ks[j]) : 1.f);
      }
    start += seg.len;
  }
  for (int n = 0; n < N; ++n) {
    float* sn = s.data() + n * total;
    const float top = *std::max_element(sn, sn + col);
    float sum = 0.f;
    for (int64_t j = 0; j < col; ++j) sum += (sn[j] = std::exp(sn[j] - top));
    for (int64_t j = 0; j < col; ++j) sn[j] /= sum;
  }
  start = 0, col = 0;
  for (const auto& seg : segs) {
    const int64_t a = std::max(lo, start) - start, e = std::min(hi, start + seg.len) - start;
    for (int64_t j = a; j < e; ++j, ++col)
      for (int n = 0; n < N; ++n) {
        const float w = s[n * total + col] * (seg.vs ? ToF32(seg.vs[j]) : 1.f);
        for (int d = 0; d < HD; ++d) out[n * HD + d] += w * ToF32(seg.v[j * HD + d]);
      }
    start += seg.len;
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512

#if defined(__x86_64__)
#define MMJAX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))

MMJAX_AVX512 inline __mmask16 Mask16(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

MMJAX_AVX512 inline __m512 Load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
MMJAX_AVX512 inline __m512 Load16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
MMJAX_AVX512 inline __m512 Load16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
MMJAX_AVX512 inline __m512 Load16(const F8E4M3* p, __mmask16 m) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
  const __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  __m512 f = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
  f = _mm512_mask_mov_ps(f, _mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8)),
                         _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / 512)));
  f = _mm512_mask_mov_ps(f, _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7F)),
                         _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}

// exp(x) for x <= 0 (Cephes' expf: x = n ln2 + r, a degree-7 polynomial of r, times 2^n)
MMJAX_AVX512 inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

// After a key block: query's running max m and exp-sum l move to the block's max mx (the block's
// exp-weights, taken against mx, sum to block_sum) and its accumulator row [HDp] is rescaled.
MMJAX_AVX512 inline void Rescale(float& m, float& l, float mx, float block_sum, float* acc_row, int HDp) {
  const float alpha = m == kNegInf ? 0.f : std::exp(m - mx);
  l = l * alpha + block_sum;
  m = mx;
  if (alpha != 1.f) {
    const __m512 va = _mm512_set1_ps(alpha);
    for (int c = 0; c < HDp; c += 16) _mm512_store_ps(acc_row + c, _mm512_mul_ps(va, _mm512_load_ps(acc_row + c)));
  }
}

// acc[i] += sum_jj p[i * pstride + jj] V[jj] for a block's cnt V rows [cnt, HD] (read in order),
// CC 16-dim chunks at a time (Q * CC accumulators in registers); acc [Q, HDp].
template <int Q, typename T>
MMJAX_AVX512 void AccumulateV(const T* v, int cnt, int HD, const float* p, int pstride, float* acc, bool pf = false) {
  constexpr int CC = Q <= 4 ? 4 : 16 / Q;
  const int HDp = (HD + 15) / 16 * 16;
  for (int c0 = 0; c0 < HDp; c0 += 16 * CC) {
    __mmask16 cm[CC];
    __m512 o[Q][CC];
    for (int c = 0; c < CC; ++c) cm[c] = Mask16(HD - c0 - 16 * c);
    for (int i = 0; i < Q; ++i)
      for (int c = 0; c < CC; ++c) o[i][c] = cm[c] ? _mm512_load_ps(acc + i * HDp + c0 + 16 * c) : _mm512_setzero_ps();
    for (int jj = 0; jj < cnt; ++jj) {
      if (pf && c0 == 0) {          // the row 8 ahead (a 64-dim f32 row: 4 lines)
        const char* r = reinterpret_cast<const char*>(v + (jj + 8) * HD);
        for (int64_t b = 0; b < int64_t(HD * sizeof(T)); b += 64) _mm_prefetch(r + b, _MM_HINT_T0);
      }
      __m512 vv[CC];
      for (int c = 0; c < CC; ++c) vv[c] = Load16(v + jj * HD + c0 + 16 * c, cm[c]);
      for (int i = 0; i < Q; ++i) {
        const __m512 pi = _mm512_set1_ps(p[i * pstride + jj]);
        for (int c = 0; c < CC; ++c) o[i][c] = _mm512_fmadd_ps(pi, vv[c], o[i][c]);
      }
    }
    for (int i = 0; i < Q; ++i)
      for (int c = 0; c < CC; ++c)
        if (cm[c]) _mm512_store_ps(acc + i * HDp + c0 + 16 * c, o[i][c]);
  }
}

// Q queries (a group padded to 1, 2, 4, 8 or 16) of one (row, head) over its visible keys, in
// blocks of up to kRowBlock keys within a segment: the block's scores [Q, kRowBlock] in an L1
// buffer (sbuf), accumulated head dim by head dim, so each head dim's K^T row of the block is
// read whole and a segment's K^T streams in address order (blocks of 16 * W keys with the scores
// in registers read every row in pieces, 64 interleaved streams for head_dim 64: 16 rows x 300
// f32 keys, 16 layers, 16.0 -> 14.3 ms; 4 rows 4.3 -> 3.4; one query per KV head 17.3 -> 13.0);
// then the online-softmax update and the V rows in order into the group's accumulators.
// q [Q, HD] (padding rows zero); acc [Q, HDp] scratch (HDp = HD rounded up to 16); out [nq, HD]
// (the group's real queries only).
constexpr int kRowBlock = 256;

template <int Q, typename T>
MMJAX_AVX512 void Task512(const float* q, int nq, int HD, const std::vector<Segment<T>>& segs, int64_t lo,
                          int64_t hi, float scale, float* acc, float* sbuf, float* out) {
  constexpr int DP = Q <= 4 ? 4 : Q <= 8 ? 2 : 1;     // head dims a pass (registers: DP x Q queries)
  const int HDp = (HD + 15) / 16 * 16;
  std::fill(acc, acc + Q * HDp, 0.f);
  float m[Q], l[Q];
  for (int i = 0; i < Q; ++i) m[i] = kNegInf, l[i] = 0.f;
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(kNegInf);
  int64_t start = 0;
  for (const auto& seg : segs) {
    const int64_t L = seg.len;
    const int64_t a = std::max(lo, start) - start, e = std::min(hi, start + L) - start;
    start += L;
    for (int64_t j0 = a; j0 < e; j0 += kRowBlock) {
      const int cnt = static_cast<int>(std::min<int64_t>(kRowBlock, e - j0));
      const int nv = (cnt + 15) / 16;
      for (int i = 0; i < Q; ++i)
        for (int w = 0; w < nv; ++w) _mm512_store_ps(sbuf + i * kRowBlock + 16 * w, _mm512_setzero_ps());
      const T* kt = seg.kt + j0;
      const int64_t row_bytes = cnt * int64_t(sizeof(T));
      // DP head dims a pass over the scores: each score's FMA chain over d in order (the same
      // bits as one dim a pass), kept in a register for DP steps between its load and store
      for (int d0 = 0; d0 < HD; d0 += DP) {
        const int dn = std::min(DP, HD - d0);
        __m512 qd[DP][Q];
        for (int dd = 0; dd < dn; ++dd)
          for (int i = 0; i < Q; ++i) qd[dd][i] = _mm512_set1_ps(q[i * HD + d0 + dd]);
        if (g_attn_prefetch)        // K^T 4 head dims ahead, then the block's V rows
          for (int dd = 0; dd < dn; ++dd) {
            const int d = d0 + dd;
            const char* r = d + 4 < HD ? reinterpret_cast<const char*>(kt + (d + 4) * L)
                                       : reinterpret_cast<const char*>(seg.v + (j0 + (d + 4 - HD) * 2) * HD);
            const int64_t n = d + 4 < HD ? row_bytes : int64_t(2 * HD * sizeof(T));
            for (int64_t b = 0; b < n; b += 64) _mm_prefetch(r + b, _MM_HINT_T0);
          }
        const T* row = kt + d0 * L;
        for (int w = 0; w < nv; ++w) {
          const __mmask16 km = Mask16(cnt - 16 * w);
          __m512 k[DP];
          for (int dd = 0; dd < dn; ++dd) k[dd] = Load16(row + dd * L + 16 * w, km);
          for (int i = 0; i < Q; ++i) {
            float* sp = sbuf + i * kRowBlock + 16 * w;
            __m512 acc = _mm512_load_ps(sp);
            for (int dd = 0; dd < dn; ++dd) acc = _mm512_fmadd_ps(qd[dd][i], k[dd], acc);
            _mm512_store_ps(sp, acc);
          }
        }
      }
      for (int i = 0; i < Q; ++i) {
        float* si = sbuf + i * kRowBlock;
        __m512 top = ninf;
        for (int w = 0; w < nv; ++w) {
          const __mmask16 km = Mask16(cnt - 16 * w);
          const __m512 ks = seg.ks ? _mm512_mul_ps(vscale, Load16(seg.ks + j0 + 16 * w, km)) : vscale;
          const __m512 sw = _mm512_mask_mov_ps(ninf, km, _mm512_mul_ps(_mm512_load_ps(si + 16 * w), ks));
          _mm512_store_ps(si + 16 * w, sw);
          top = _mm512_max_ps(top, sw);
        }
        const float mx = std::max(m[i], _mm512_reduce_max_ps(top));
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        for (int w = 0; w < nv; ++w) {
          const __mmask16 km = Mask16(cnt - 16 * w);
          __m512 pw = _mm512_maskz_mov_ps(km, Exp(_mm512_sub_ps(_mm512_load_ps(si + 16 * w), vmx)));
          sum = _mm512_add_ps(sum, pw);
          if (seg.vs) pw = _mm512_mul_ps(pw, Load16(seg.vs + j0 + 16 * w, km));
          _mm512_store_ps(si + 16 * w, pw);
        }
        Rescale(m[i], l[i], mx, _mm512_reduce_add_ps(sum), acc + i * HDp, HDp);
      }
      AccumulateV<Q, T>(seg.v + j0 * HD, cnt, HD, sbuf, kRowBlock, acc, g_attn_prefetch != 0);
    }
  }
  for (int i = 0; i < nq; ++i) {
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    for (int d = 0; d < HD; ++d) out[i * HD + d] = acc[i * HDp + d] * inv;
  }
}

// Prefill: Q queries of one (row, head) (consecutive tokens' GQA groups; padding rows zero with
// an empty range), each over its own visible keys [lo_i, hi_i) (causal, a sliding window), in
// blocks of 16 * W keys over the union of the ranges: the Q x 16W scores in registers (the K^T
// block is re-read by every query block of the prompt, from L2), each query's keys outside its
// range masked, online softmax per query, then the block's V rows into the Q queries'
// accumulators, CC 16-dim chunks at a time.
template <int Q, int W, typename T>
MMJAX_AVX512 void PrefillTask512(const float* q, int nq, int HD, const std::vector<Segment<T>>& segs,
                                 const int64_t* lo, const int64_t* hi, float scale, float* acc, float* out) {
  constexpr int kKeys = 16 * W;
  const int HDp = (HD + 15) / 16 * 16;
  std::fill(acc, acc + Q * HDp, 0.f);
  float m[Q], l[Q];
  alignas(64) float p[Q][kKeys] = {};
  int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
  for (int i = 0; i < Q; ++i) {
    m[i] = kNegInf, l[i] = 0.f;
    if (i < nq && lo[i] < hi[i]) first = std::min(first, lo[i]), last = std::max(last, hi[i]);
  }
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(kNegInf);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t start = 0;
  for (const auto& seg : segs) {
    const int64_t L = seg.len, base = start;
    const int64_t a = std::max(first, base) - base, e = std::min(last, base + L) - base;
    start += L;
    for (int64_t j0 = a; j0 < e; j0 += kKeys) {
      const int cnt = static_cast<int>(std::min<int64_t>(kKeys, e - j0));
      __mmask16 km[W];
      for (int w = 0; w < W; ++w) km[w] = Mask16(cnt - 16 * w);
      __m512 s[Q][W];
      for (int i = 0; i < Q; ++i)
        for (int w = 0; w < W; ++w) s[i][w] = _mm512_setzero_ps();
      const T* kt = seg.kt + j0;
      for (int d = 0; d < HD; ++d) {
        __m512 k[W];
        for (int w = 0; w < W; ++w) k[w] = Load16(kt + d * L + 16 * w, km[w]);
        for (int i = 0; i < Q; ++i) {
          const __m512 qi = _mm512_set1_ps(q[i * HD + d]);
          for (int w = 0; w < W; ++w) s[i][w] = _mm512_fmadd_ps(qi, k[w], s[i][w]);
        }
      }
      __m512 kscale[W], vfactor[W];
      __m512i kidx[W];
      for (int w = 0; w < W; ++w) {
        kscale[w] = seg.ks ? _mm512_mul_ps(vscale, Load16(seg.ks + j0 + 16 * w, km[w])) : vscale;
        vfactor[w] = seg.vs ? Load16(seg.vs + j0 + 16 * w, km[w]) : _mm512_set1_ps(1.f);
        kidx[w] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(base + j0 + 16 * w)), iota);
      }
      for (int i = 0; i < nq; ++i) {
        const __m512i qlo = _mm512_set1_epi32(static_cast<int32_t>(lo[i])), qhi = _mm512_set1_epi32(static_cast<int32_t>(hi[i]));
        __mmask16 valid[W];
        bool any = false;
        __m512 top = ninf;
        for (int w = 0; w < W; ++w) {
          valid[w] = km[w] & _mm512_cmpge_epi32_mask(kidx[w], qlo) & _mm512_cmplt_epi32_mask(kidx[w], qhi);
          any |= valid[w] != 0;
          s[i][w] = _mm512_mask_mov_ps(ninf, valid[w], _mm512_mul_ps(s[i][w], kscale[w]));
          top = _mm512_max_ps(top, s[i][w]);
        }
        if (!any) {
          for (int w = 0; w < W; ++w) _mm512_store_ps(p[i] + 16 * w, _mm512_setzero_ps());
          continue;
        }
        const float mx = std::max(m[i], _mm512_reduce_max_ps(top));
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        for (int w = 0; w < W; ++w) {
          const __m512 pw = _mm512_maskz_mov_ps(valid[w], Exp(_mm512_sub_ps(s[i][w], vmx)));
          sum = _mm512_add_ps(sum, pw);
          _mm512_store_ps(p[i] + 16 * w, _mm512_mul_ps(pw, vfactor[w]));
        }
        Rescale(m[i], l[i], mx, _mm512_reduce_add_ps(sum), acc + i * HDp, HDp);
      }
      AccumulateV<Q, T>(seg.v + j0 * HD, cnt, HD, &p[0][0], kKeys, acc);
    }
  }
  for (int i = 0; i < nq; ++i) {
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    for (int d = 0; d < HD; ++d) out[i * HD + d] = acc[i * HDp + d] * inv;
  }
}

// Queries on the lanes (mmjax_dense_attention_f32, and f32-cache prefill; Lanes8 below for AVX2):
// up to 32 queries of one (row, head) on the vector lanes (QV = 2 vectors; 1 for a last block of
// at most 16), so a key's scores for all of them are QV vectors and the softmax over keys is
// elementwise: no horizontal max / sum and no accumulator rescale per key block, the online
// softmax's bookkeeping once per chunk of up to kDenseChunk keys. A chunk: its scores [cnt, 32]
// into an L1 buffer, tiles of 8 keys x the queries over the head dims (each K element broadcast
// where it lies: k[j * kj + d * kd], rows of a vision tower's K or columns of the cache's K^T),
// then P V, tiles of 8 head dims x the queries into O^T [D, 32] (V rows broadcast as they lie).
// kMasked: lane i's scores of keys outside [lo_i, hi_i) (key t's index: idx + t) become -inf;
// mx: the lanes' running max over the tile's scores
template <int KT, int QV, bool kMasked>
MMJAX_AVX512 inline void LaneScores(const float* qt, const float* k, int64_t kj, int64_t kd, int D, float* s,
                                    __m512* mx, const __m512i* lo, const __m512i* hi, int32_t idx) {
  __m512 a[KT][QV];
  for (int t = 0; t < KT; ++t)
    for (int u = 0; u < QV; ++u) a[t][u] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m512 qv[QV];
    for (int u = 0; u < QV; ++u) qv[u] = _mm512_load_ps(qt + d * kDenseQ + 16 * u);
    const float* kr = k + d * kd;
    for (int t = 0; t < KT; ++t) {
      const __m512 kb = _mm512_set1_ps(kr[t * kj]);
      for (int u = 0; u < QV; ++u) a[t][u] = _mm512_fmadd_ps(kb, qv[u], a[t][u]);
    }
  }
  for (int t = 0; t < KT; ++t)
    for (int u = 0; u < QV; ++u) {
      __m512 x = a[t][u];
      if (kMasked) {
        const __m512i i = _mm512_set1_epi32(idx + t);
        x = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf),
                               _mm512_cmple_epi32_mask(lo[u], i) & _mm512_cmplt_epi32_mask(i, hi[u]), x);
      }
      _mm512_store_ps(s + t * kDenseQ + 16 * u, x);
      mx[u] = _mm512_max_ps(mx[u], x);
    }
}

template <int DT, int QV>
MMJAX_AVX512 inline void LaneValues(const float* s, int cnt, const float* v, int64_t vstride, float* ot) {
  __m512 o[DT][QV];
  for (int t = 0; t < DT; ++t)
    for (int u = 0; u < QV; ++u) o[t][u] = _mm512_load_ps(ot + t * kDenseQ + 16 * u);
  for (int j = 0; j < cnt; ++j) {
    __m512 p[QV];
    for (int u = 0; u < QV; ++u) p[u] = _mm512_load_ps(s + j * kDenseQ + 16 * u);
    const float* vr = v + j * vstride;
    for (int t = 0; t < DT; ++t) {
      const __m512 vb = _mm512_set1_ps(vr[t]);
      for (int u = 0; u < QV; ++u) o[t][u] = _mm512_fmadd_ps(vb, p[u], o[t][u]);
    }
  }
  for (int t = 0; t < DT; ++t)
    for (int u = 0; u < QV; ++u) _mm512_store_ps(ot + t * kDenseQ + 16 * u, o[t][u]);
}

// the last < 8 keys (or head dims) of a chunk in one tile
template <int QV, bool kMasked>
MMJAX_AVX512 void LaneScoresTail(int n, const float* qt, const float* k, int64_t kj, int64_t kd, int D, float* s,
                                 __m512* mx, const __m512i* lo, const __m512i* hi, int32_t idx) {
  switch (n) {
    case 1: return LaneScores<1, QV, kMasked>(qt, k, kj, kd, D, s, mx, lo, hi, idx);
    case 2: return LaneScores<2, QV, kMasked>(qt, k, kj, kd, D, s, mx, lo, hi, idx);
    case 3: return LaneScores<3, QV, kMasked>(qt, k, kj, kd, D, s, mx, lo, hi, idx);
    case 4: return LaneScores<4, QV, kMasked>(qt, k, kj, kd, D, s, mx, lo, hi, idx);
    case 5: return LaneScores<5, QV, kMasked>(qt, k, kj, kd, D, s, mx, lo, hi, idx);
    case 6: return LaneScores<6, QV, kMasked>(qt, k, kj, kd, D, s, mx, lo, hi, idx);
    default: return LaneScores<7, QV, kMasked>(qt, k, kj, kd, D, s, mx, lo, hi, idx);
  }
}
template <int QV>
MMJAX_AVX512 void LaneValuesTail(int n, const float* s, int cnt, const float* v, int64_t vstride, float* ot) {
  switch (n) {
    case 1: return LaneValues<1, QV>(s, cnt, v, vstride, ot);
    case 2: return LaneValues<2, QV>(s, cnt, v, vstride, ot);
    case 3: return LaneValues<3, QV>(s, cnt, v, vstride, ot);
    case 4: return LaneValues<4, QV>(s, cnt, v, vstride, ot);
    case 5: return LaneValues<5, QV>(s, cnt, v, vstride, ot);
    case 6: return LaneValues<6, QV>(s, cnt, v, vstride, ot);
    default: return LaneValues<7, QV>(s, cnt, v, vstride, ot);
  }
}

// The running softmax of up to 32 lane queries: Q^T [D, 32] (scaled), O^T [D, 32] (unnormalized
// outputs) and the scores buffer [kDenseChunk, 32] in `scratch` (64-byte aligned, (2 D +
// kDenseChunk) * 32 floats); per lane the running max m and exp-sum l, and with kMasked each
// lane's visible key indexes [lo, hi).
template <int QV, bool kMasked>
struct Lanes {
  int D;
  float *qt, *ot, *s;
  __m512 m[QV], l[QV];
  __m512i lo[QV], hi[QV];

  // queries q (row i at q + i * qstride, nq <= 16 QV of them); with kMasked their ranges
  MMJAX_AVX512 Lanes(const float* q, int nq, int64_t qstride, int D_, float scale, float* scratch,
                     const int64_t* qlo = nullptr, const int64_t* qhi = nullptr)
      : D(D_), qt(scratch), ot(scratch + D_ * kDenseQ), s(scratch + 2 * D_ * kDenseQ) {
    for (int d = 0; d < D; ++d)
      for (int i = 0; i < 16 * QV; ++i) qt[d * kDenseQ + i] = i < nq ? q[i * qstride + d] * scale : 0.f;
    std::fill(ot, ot + D * kDenseQ, 0.f);
    for (int u = 0; u < QV; ++u) m[u] = _mm512_set1_ps(kNegInf), l[u] = _mm512_setzero_ps();
    if (kMasked) {
      alignas(64) int32_t a[kDenseQ] = {}, e[kDenseQ] = {};   // padding lanes: empty
      for (int i = 0; i < nq; ++i) a[i] = static_cast<int32_t>(qlo[i]), e[i] = static_cast<int32_t>(qhi[i]);
      for (int u = 0; u < QV; ++u)
        lo[u] = _mm512_load_si512(a + 16 * u), hi[u] = _mm512_load_si512(e + 16 * u);
    }
  }

  // cnt (<= kDenseChunk) keys: key j's head dim d at k[j * kj + d * kd], its V row at
  // v + j * vstride, its index key0 + j (kMasked: a lane's keys outside its range weigh 0)
  MMJAX_AVX512 void Chunk(const float* k, int64_t kj, int64_t kd, const float* v, int64_t vstride, int cnt,
                          int64_t key0) {
    const __m512 ninf = _mm512_set1_ps(kNegInf);
    __m512 c[QV], sum[QV];
    for (int u = 0; u < QV; ++u) c[u] = m[u], sum[u] = _mm512_setzero_ps();
    const int32_t idx = static_cast<int32_t>(key0);
    int j = 0;
    for (; j + 8 <= cnt; j += 8)
      LaneScores<8, QV, kMasked>(qt, k + j * kj, kj, kd, D, s + j * kDenseQ, c, lo, hi, idx + j);
    if (j < cnt) LaneScoresTail<QV, kMasked>(cnt - j, qt, k + j * kj, kj, kd, D, s + j * kDenseQ, c, lo, hi, idx + j);
    for (int jj = 0; jj < cnt; ++jj)
      for (int u = 0; u < QV; ++u) {
        float* sj = s + jj * kDenseQ + 16 * u;
        const __m512 x = _mm512_load_ps(sj);
        __m512 p = Exp(_mm512_sub_ps(x, c[u]));
        if (kMasked) p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ), p);   // masked keys: 0
        _mm512_store_ps(sj, p);
        sum[u] = _mm512_add_ps(sum[u], p);
      }
    for (int u = 0; u < QV; ++u) {
      // earlier keys' sums and outputs shrink by exp(m - c); a lane with none so far: 0 (not NaN)
      const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m[u], ninf, _CMP_NEQ_OQ), Exp(_mm512_sub_ps(m[u], c[u])));
      l[u] = _mm512_fmadd_ps(l[u], alpha, sum[u]);
      for (int d = 0; d < D; ++d) {
        float* od = ot + d * kDenseQ + 16 * u;
        _mm512_store_ps(od, _mm512_mul_ps(alpha, _mm512_load_ps(od)));
      }
      m[u] = c[u];
    }
    int d = 0;
    for (; d + 8 <= D; d += 8) LaneValues<8, QV>(s, cnt, v + d, vstride, ot + d * kDenseQ);
    if (d < D) LaneValuesTail<QV>(D - d, s, cnt, v + d, vstride, ot + d * kDenseQ);
  }

  // out row i (i < nq) at out + i * ostride: O / l (zeros for a lane that saw no key)
  MMJAX_AVX512 void Store(int nq, float* out, int64_t ostride) const {
    alignas(64) float inv[kDenseQ];
    for (int u = 0; u < QV; ++u)
      _mm512_store_ps(inv + 16 * u, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(l[u], _mm512_setzero_ps(), _CMP_GT_OQ),
                                                        _mm512_set1_ps(1.f), l[u]));
    for (int i = 0; i < nq; ++i)
      for (int d = 0; d < D; ++d) out[i * ostride + d] = ot[d * kDenseQ + i] * inv[i];
  }
};

#endif  // __x86_64__

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA (Haswell, Zen 1-3): the AVX-512 path's algorithm 8 lanes wide, in 16 vector
// registers instead of 32 and without mask registers: lane masks are comparison results (blends,
// ANDs), a partial f32 vector is a _mm256_maskload_ps and a partial vector of the 1- and 2-byte
// dtypes a small copy into a local buffer, so no load reads past a block's last key (nor past
// a segment's end). The same f32 arithmetic as the AVX-512 path; only the order of the sums
// differs (8 lanes, other blockings). The block shapes were re-chosen for 16 registers: the
// timings in the comments below are ms on one thread of the 2-core Zen 3 (the best of 60-80
// interleaved rounds), at the bench model's shape: 8 KV heads x 2 queries, head_dim 64.

#if defined(__x86_64__)
#define MMJAX_AVX2 __attribute__((target("avx2,fma")))

// all ones in lanes [0, n)
MMJAX_AVX2 inline __m256i Mask8(int64_t n) {
  const int k = n >= 8 ? 8 : n <= 0 ? 0 : static_cast<int>(n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 elements widened to f32, bit for bit as ToF32
MMJAX_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
MMJAX_AVX2 inline __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
MMJAX_AVX2 inline __m256 Load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
MMJAX_AVX2 inline __m256 Load8(const F8E4M3* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  __m256 f = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
  f = _mm256_blendv_ps(f, _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512)),
                       _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em)));
  f = _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                       _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F))));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sign));
}
// the first n elements (n < 8: zeros after them; nothing at or past p + n is read)
MMJAX_AVX2 inline __m256 Load8(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, Mask8(n));
}
template <typename T>
MMJAX_AVX2 inline __m256 Load8(const T* p, int64_t n) {
  if (n >= 8) return Load8(p);
  T buf[8] = {};
  if (n > 0) std::memcpy(buf, p, sizeof(T) * n);
  return Load8(buf);
}

MMJAX_AVX2 inline float ReduceMax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
MMJAX_AVX2 inline float ReduceAdd8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// exp(x) for x <= 0, the AVX-512 Exp's polynomial; 2^n from n's bits (x >= -87.3: n >= -126,
// a normal exponent)
MMJAX_AVX2 inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Rescale, 8 lanes wide (acc_row [HDp], HDp a multiple of 8, 32-byte aligned)
MMJAX_AVX2 inline void Rescale8(float& m, float& l, float mx, float block_sum, float* acc_row, int HDp) {
  const float alpha = m == kNegInf ? 0.f : std::exp(m - mx);
  l = l * alpha + block_sum;
  m = mx;
  if (alpha != 1.f) {
    const __m256 va = _mm256_set1_ps(alpha);
    for (int c = 0; c < HDp; c += 8) _mm256_store_ps(acc_row + c, _mm256_mul_ps(va, _mm256_load_ps(acc_row + c)));
  }
}

// AccumulateV's 8-lane pass over NC chunks of 8 dims from dim c0, the last chunk `tail` dims
// wide (8: whole): Q x NC accumulators in registers
template <int Q, int NC, typename T>
MMJAX_AVX2 inline void AccumulateChunks8(const T* v, int cnt, int HD, const float* p, int pstride, float* acc, int HDp,
                                         int c0, int tail) {
  __m256 o[Q][NC];
  for (int i = 0; i < Q; ++i)
    for (int c = 0; c < NC; ++c) o[i][c] = _mm256_load_ps(acc + i * HDp + c0 + 8 * c);
  const T* vr = v + c0;
  if (tail == 8) {
    for (int jj = 0; jj < cnt; ++jj, vr += HD) {
      __m256 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = Load8(vr + 8 * c);
      for (int i = 0; i < Q; ++i) {
        const __m256 pi = _mm256_broadcast_ss(p + i * pstride + jj);
        for (int c = 0; c < NC; ++c) o[i][c] = _mm256_fmadd_ps(pi, vv[c], o[i][c]);
      }
    }
  } else {
    for (int jj = 0; jj < cnt; ++jj, vr += HD) {
      __m256 vv[NC];
      for (int c = 0; c + 1 < NC; ++c) vv[c] = Load8(vr + 8 * c);
      vv[NC - 1] = Load8(vr + 8 * (NC - 1), tail);
      for (int i = 0; i < Q; ++i) {
        const __m256 pi = _mm256_broadcast_ss(p + i * pstride + jj);
        for (int c = 0; c < NC; ++c) o[i][c] = _mm256_fmadd_ps(pi, vv[c], o[i][c]);
      }
    }
  }
  for (int i = 0; i < Q; ++i)
    for (int c = 0; c < NC; ++c) _mm256_store_ps(acc + i * HDp + c0 + 8 * c, o[i][c]);
}

// Software prefetch of `rows` byte ranges [p + r * stride, + bytes), some cache lines per Step.
// Task8 fetches a block's V rows while it computes the block's scores, and the next block's K^T
// rows while it accumulates V: with the hardware prefetchers alone one core read a cache in DRAM
// at ~8 GB/s (f32, 2 queries, 128-key segments) where a plain sum reads 16-18. 16 layers of
// decode (benchmarks/cpu_attention_paths.py shapes), 2 threads, ms without -> with prefetch: 1
// row x 300 keys f32 2.33 -> 1.99, int8 1.51 -> 1.35; 16 rows x 300 f32 26.1 -> 24.4, int8 12.7
// -> 10.3; 16 x 2000 f32 150 -> 151, int8 58.6 -> 53.3. (A cache that stays in L2 / L3 pays for
// the prefetch instructions: 8-15% at 8 heads x 300 keys on one thread.)
struct Prefetch8 {
  const char* at = nullptr;     // the next line
  const char* end = nullptr;    // the end of the current range
  const char* next = nullptr;   // the next range
  int64_t bytes = 0, stride = 0, rows = 0, lines = 0;   // (rows: ranges after the current one)
  Prefetch8() = default;
  Prefetch8(const void* p, int64_t bytes_, int64_t stride_, int64_t rows_) {
    if (bytes_ <= 0 || rows_ <= 0) return;
    if (stride_ == bytes_) bytes_ *= rows_, rows_ = 1;     // adjacent ranges as one
    const char* c = static_cast<const char*>(p);
    bytes = bytes_, stride = stride_, rows = rows_ - 1, lines = rows_ * ((bytes_ + 126) / 64);
    at = Line(c), end = c + bytes, next = c + stride;
  }
  static const char* Line(const char* c) {
    return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(c) & ~uintptr_t(63));
  }
  int64_t Lines() const { return lines; }   // (at most)
  void Step(int64_t n) {
    for (;;) {
      for (; at < end && n > 0; at += 64, --n) _mm_prefetch(at, _MM_HINT_T0);
      if (n == 0 || rows == 0) return;
      --rows, at = Line(next), end = next + bytes, next += stride;
    }
  }
};

// a pass of nc (1..CC) chunks
template <int Q, typename T, int CC>
MMJAX_AVX2 inline void AccumulatePass8(int nc, const T* v, int cnt, int HD, const float* p, int pstride, float* acc,
                                       int HDp, int c0, int tail) {
  if constexpr (CC > 1)
    if (nc < CC) return AccumulatePass8<Q, T, CC - 1>(nc, v, cnt, HD, p, pstride, acc, HDp, c0, tail);
  AccumulateChunks8<Q, CC, T>(v, cnt, HD, p, pstride, acc, HDp, c0, tail);
}

// AccumulateV, 8 lanes wide: acc[i] += sum_jj p[i * pstride + jj] V[jj] for cnt V rows [cnt, HD],
// acc [Q, HDp] (HDp = HD rounded up to 8), CC 8-dim chunks a pass; more than 12 queries as two
// halves. CC: Q x CC <= 12 accumulators fit, but fewer ran as fast or faster (the V rows come
// from L2 / L3 either way). Decode, 300 keys, f32 / int8 cache, ms per 20 x 8 heads: 1 query CC
// 4 0.52 / 0.45, CC 8 0.48 / 0.52; 2 queries CC 2 0.75 / 0.66, CC 4 0.79 / 0.78, CC 6 0.75 /
// 0.80 (DR 4); 4 queries CC 2 1.36 / 1.35, CC 3 1.73 / 1.78 (DR 1); 8 queries CC 1 2.83 / 2.84,
// CC 2 (16 accumulators) 2.99 / 3.01 (DR 2). Prefill (below), 6 queries: CC 2 2.29 / 2.69, CC 1
// 3.43 / 3.73.
template <int Q> constexpr int kChunks8 = Q == 1 ? 4 : Q <= 6 ? 2 : 1;

// (pf: prefetched a piece before each pass; none by default)
template <int Q, typename T, int CC = kChunks8<Q>>
MMJAX_AVX2 void AccumulateV8(const T* v, int cnt, int HD, const float* p, int pstride, float* acc,
                             Prefetch8* pf = nullptr) {
  const int HDp = (HD + 7) / 8 * 8;
  if constexpr (Q > 12) {
    if (pf) pf->Step(pf->Lines() / 2 + 1);
    AccumulateV8<Q / 2, T>(v, cnt, HD, p, pstride, acc);
    if (pf) pf->Step(pf->Lines());
    AccumulateV8<Q - Q / 2, T>(v, cnt, HD, p + Q / 2 * pstride, pstride, acc + Q / 2 * HDp);
  } else {
    const int chunks = HDp / 8, tail = HD - 8 * (chunks - 1);
    const int64_t step = pf ? pf->Lines() / ((chunks + CC - 1) / CC) + 1 : 0;
    for (int c = 0; c < chunks; c += CC) {
      if (pf) pf->Step(step);
      const int nc = std::min(CC, chunks - c);
      AccumulatePass8<Q, T, CC>(nc, v, cnt, HD, p, pstride, acc, HDp, 8 * c, c + nc == chunks ? tail : 8);
    }
  }
}

// sbuf[i][j] += sum_d q[i][d] K^T[d][j] for the cnt keys of a block (K^T rows L apart), DR rows
// of K^T at a time (DR interleaved row streams, not 64): each score vector loaded and stored once
// per DR rows (the same sums, in the same order, as one row at a time). One row at a time, as
// Task512 does, the score loads and stores bound the loop: decode, 300 keys, f32 / int8, ms per
// 20 x 8 heads, DR 1 -> 2 -> 4: 2 queries (CC 4) 0.97 / 1.01 -> 0.80 / 0.78 -> 0.79 / 0.78; 4
// queries 1.75 / 1.77 -> 1.46 / 1.47 -> 1.36 / 1.39; 8 queries 3.40 / 3.42 -> 2.74 / 2.83 -> 2.59
// / 2.62; 16 queries 7.1 / 7.2 -> 5.5 / 5.6 -> 5.35 / 5.38.
template <int Q, int DR, typename T>
MMJAX_AVX2 inline void ScoreRows8(const float* q, int HD, int d, const T* kt, int64_t L, int cnt, float* sbuf) {
  __m256 qd[Q][DR];
  for (int i = 0; i < Q; ++i)
    for (int r = 0; r < DR; ++r) qd[i][r] = _mm256_set1_ps(q[i * HD + d + r]);
  const T* rows = kt + d * L;
  const int nfull = cnt / 8;
  for (int w = 0; w < nfull; ++w) {
    __m256 k[DR];
    for (int r = 0; r < DR; ++r) k[r] = Load8(rows + r * L + 8 * w);
    for (int i = 0; i < Q; ++i) {
      float* sp = sbuf + i * kRowBlock + 8 * w;
      __m256 s = _mm256_load_ps(sp);
      for (int r = 0; r < DR; ++r) s = _mm256_fmadd_ps(qd[i][r], k[r], s);
      _mm256_store_ps(sp, s);
    }
  }
  if (8 * nfull < cnt) {
    __m256 k[DR];
    for (int r = 0; r < DR; ++r) k[r] = Load8(rows + r * L + 8 * nfull, cnt - 8 * nfull);
    for (int i = 0; i < Q; ++i) {
      float* sp = sbuf + i * kRowBlock + 8 * nfull;
      __m256 s = _mm256_load_ps(sp);
      for (int r = 0; r < DR; ++r) s = _mm256_fmadd_ps(qd[i][r], k[r], s);
      _mm256_store_ps(sp, s);
    }
  }
}

template <int Q, int DR, typename T>
MMJAX_AVX2 __attribute__((noinline)) void Scores8(const float* q, int HD, const T* kt, int64_t L, int cnt, float* sbuf,
                                                  Prefetch8& pf) {
  const int64_t step = pf.Lines() / ((HD + DR - 1) / DR) + 1;
  int d = 0;
  for (; d + DR <= HD; d += DR) {
    pf.Step(step);
    ScoreRows8<Q, DR, T>(q, HD, d, kt, L, cnt, sbuf);
  }
  for (; d < HD; ++d) ScoreRows8<Q, 1, T>(q, HD, d, kt, L, cnt, sbuf);
}

// AccumulateV8 as a call of its own (decode: once per kRowBlock keys): inlined into Task8, GCC 12
// kept some of the accumulators on the stack. (Not in PrefillTask8: a call per 16-key block,
// with the vzeroupper at its return, took 2.3 -> 3.5 ms.)
template <int Q, typename T, int CC>
MMJAX_AVX2 __attribute__((noinline)) void AccumulateBlock8(const T* v, int cnt, int HD, const float* p, int pstride,
                                                           float* acc, Prefetch8& pf) {
  AccumulateV8<Q, T, CC>(v, cnt, HD, p, pstride, acc, &pf);
}

// Task512, 8 lanes wide (the same kRowBlock-key blocks, scores in sbuf [Q, kRowBlock], 32-byte
// aligned); acc [Q, HDp], HDp = HD rounded up to 8, 32-byte aligned
constexpr int kRows8 = 4;

template <int Q, typename T, int CC = kChunks8<Q>, int DR = kRows8>
MMJAX_AVX2 void Task8(const float* q, int nq, int HD, const std::vector<Segment<T>>& segs, int64_t lo, int64_t hi,
                      float scale, float* acc, float* sbuf, float* out) {
  const int HDp = (HD + 7) / 8 * 8;
  std::fill(acc, acc + Q * HDp, 0.f);
  float m[Q], l[Q];
  for (int i = 0; i < Q; ++i) m[i] = kNegInf, l[i] = 0.f;
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(kNegInf);
  int64_t start = 0;
  for (size_t sn = 0; sn < segs.size(); ++sn) {
    const auto& seg = segs[sn];
    const int64_t L = seg.len;
    const int64_t a = std::max(lo, start) - start, e = std::min(hi, start + L) - start;
    start += L;
    for (int64_t j0 = a; j0 < e; j0 += kRowBlock) {
      const int cnt = static_cast<int>(std::min<int64_t>(kRowBlock, e - j0));
      const int nv = (cnt + 7) / 8;
      for (int i = 0; i < Q; ++i)
        for (int w = 0; w < nv; ++w) _mm256_store_ps(sbuf + i * kRowBlock + 8 * w, _mm256_setzero_ps());
      Prefetch8 pv(seg.v + j0 * HD, int64_t{sizeof(T)} * cnt * HD, 0, 1);   // the block's V rows
      Scores8<Q, DR, T>(q, HD, seg.kt + j0, L, cnt, sbuf, pv);
      for (int i = 0; i < nq; ++i) {     // (padding rows: never read out)
        float* si = sbuf + i * kRowBlock;
        __m256 top = ninf;
        for (int w = 0; w < nv; ++w) {
          const __m256 km = _mm256_castsi256_ps(Mask8(cnt - 8 * w));
          const __m256 ks = seg.ks ? _mm256_mul_ps(vscale, Load8(seg.ks + j0 + 8 * w, cnt - 8 * w)) : vscale;
          const __m256 sw = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_load_ps(si + 8 * w), ks), km);
          _mm256_store_ps(si + 8 * w, sw);
          top = _mm256_max_ps(top, sw);
        }
        const float mx = std::max(m[i], ReduceMax8(top));
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 sum = _mm256_setzero_ps();
        for (int w = 0; w < nv; ++w) {
          const __m256 km = _mm256_castsi256_ps(Mask8(cnt - 8 * w));
          __m256 pw = _mm256_and_ps(km, Exp8(_mm256_sub_ps(_mm256_load_ps(si + 8 * w), vmx)));
          sum = _mm256_add_ps(sum, pw);
          if (seg.vs) pw = _mm256_mul_ps(pw, Load8(seg.vs + j0 + 8 * w, cnt - 8 * w));
          _mm256_store_ps(si + 8 * w, pw);
        }
        Rescale8(m[i], l[i], mx, ReduceAdd8(sum), acc + i * HDp, HDp);
      }
      // the next block's K^T rows (HD rows of up to kRowBlock keys), prefetched during this
      // block's V rows
      Prefetch8 pk;
      constexpr int64_t kSize = sizeof(T);
      if (j0 + kRowBlock < e) {
        const int64_t n = std::min<int64_t>(kRowBlock, e - j0 - kRowBlock);
        pk = Prefetch8(seg.kt + j0 + kRowBlock, kSize * n, kSize * L, HD);
      } else {
        int64_t next = start;          // (start: segment sn + 1's first index)
        for (size_t s2 = sn + 1; s2 < segs.size(); next += segs[s2].len, ++s2) {
          const int64_t a2 = std::max(lo, next) - next, e2 = std::min(hi, next + segs[s2].len) - next;
          if (a2 < e2) {
            pk = Prefetch8(segs[s2].kt + a2, kSize * std::min<int64_t>(kRowBlock, e2 - a2), kSize * segs[s2].len, HD);
            break;
          }
        }
      }
      AccumulateBlock8<Q, T, CC>(seg.v + j0 * HD, cnt, HD, sbuf, kRowBlock, acc, pk);
    }
  }
  for (int i = 0; i < nq; ++i) {
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    for (int d = 0; d < HD; ++d) out[i * HD + d] = acc[i * HDp + d] * inv;
  }
}

// PrefillTask512, 8 lanes wide: Q queries x 8W keys a block, the Q x W scores in registers (with
// the W K^T vectors and a query broadcast, at most 16). 240 causal tokens x 2 queries, f32 / bf16
// / int8 cache, ms per 8 heads: 6 queries x 16 keys 2.29 / 2.72 / 2.69; 4 x 24 2.25 / 2.73 /
// 2.78; 4 x 16 2.27 / 2.82 / 2.87; 3 x 24 2.34 / 3.61 / 3.70; 8 x 16 (16 score registers:
// spilled) 3.87 / 3.87 / 3.90; 8 x 8 5.08 / 5.05 / 5.07; 2 x 32 3.77 / 3.80 / 4.75; 12 x 8 5.12 /
// 5.20 / 5.17. PrefillAttention takes 6 x 16: with 4 x 24 the fastest, a register to spare, and a
// third fewer passes over each K^T block than with 4 queries.
template <int Q, int W, typename T, int CC = kChunks8<Q>>
MMJAX_AVX2 void PrefillTask8(const float* q, int nq, int HD, const std::vector<Segment<T>>& segs, const int64_t* lo,
                             const int64_t* hi, float scale, float* acc, float* out) {
  constexpr int kKeys = 8 * W;
  const int HDp = (HD + 7) / 8 * 8;
  std::fill(acc, acc + Q * HDp, 0.f);
  float m[Q], l[Q];
  alignas(32) float p[Q][kKeys] = {};
  int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
  for (int i = 0; i < Q; ++i) {
    m[i] = kNegInf, l[i] = 0.f;
    if (i < nq && lo[i] < hi[i]) first = std::min(first, lo[i]), last = std::max(last, hi[i]);
  }
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(kNegInf);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t start = 0;
  for (const auto& seg : segs) {
    const int64_t L = seg.len, base = start;
    const int64_t a = std::max(first, base) - base, e = std::min(last, base + L) - base;
    start += L;
    for (int64_t j0 = a; j0 < e; j0 += kKeys) {
      const int cnt = static_cast<int>(std::min<int64_t>(kKeys, e - j0));
      __m256 s[Q][W];
      for (int i = 0; i < Q; ++i)
        for (int w = 0; w < W; ++w) s[i][w] = _mm256_setzero_ps();
      const T* kt = seg.kt + j0;
      // (whole blocks without the partial loads' branches: those kept the scores in memory)
      if (cnt == kKeys) {
        for (int d = 0; d < HD; ++d) {
          __m256 k[W];
          for (int w = 0; w < W; ++w) k[w] = Load8(kt + d * L + 8 * w);
          for (int i = 0; i < Q; ++i) {
            const __m256 qi = _mm256_broadcast_ss(q + i * HD + d);
            for (int w = 0; w < W; ++w) s[i][w] = _mm256_fmadd_ps(qi, k[w], s[i][w]);
          }
        }
      } else {
        for (int d = 0; d < HD; ++d) {
          __m256 k[W];
          for (int w = 0; w < W; ++w) k[w] = Load8(kt + d * L + 8 * w, cnt - 8 * w);
          for (int i = 0; i < Q; ++i) {
            const __m256 qi = _mm256_broadcast_ss(q + i * HD + d);
            for (int w = 0; w < W; ++w) s[i][w] = _mm256_fmadd_ps(qi, k[w], s[i][w]);
          }
        }
      }
      // the scores to p (indexing s by the runtime query below kept s in memory in the loops
      // above); padding rows keep their zeros
      for (int i = 0; i < Q; ++i)
        for (int w = 0; w < W; ++w)
          if (i < nq) _mm256_store_ps(p[i] + 8 * w, s[i][w]);
      __m256 kscale[W], vfactor[W];
      __m256i km[W], kidx[W];
      for (int w = 0; w < W; ++w) {
        km[w] = Mask8(cnt - 8 * w);
        kscale[w] = seg.ks ? _mm256_mul_ps(vscale, Load8(seg.ks + j0 + 8 * w, cnt - 8 * w)) : vscale;
        vfactor[w] = seg.vs ? Load8(seg.vs + j0 + 8 * w, cnt - 8 * w) : _mm256_set1_ps(1.f);
        kidx[w] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(base + j0 + 8 * w)), iota);
      }
      for (int i = 0; i < nq; ++i) {
        const __m256i qlo = _mm256_set1_epi32(static_cast<int32_t>(lo[i]));
        const __m256i qhi = _mm256_set1_epi32(static_cast<int32_t>(hi[i]));
        __m256 valid[W], si[W];
        bool any = false;
        __m256 top = ninf;
        for (int w = 0; w < W; ++w) {
          // key index in [lo, hi) and inside the block
          valid[w] = _mm256_castsi256_ps(_mm256_and_si256(
              km[w], _mm256_andnot_si256(_mm256_cmpgt_epi32(qlo, kidx[w]), _mm256_cmpgt_epi32(qhi, kidx[w]))));
          any |= _mm256_movemask_ps(valid[w]) != 0;
          si[w] = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_load_ps(p[i] + 8 * w), kscale[w]), valid[w]);
          top = _mm256_max_ps(top, si[w]);
        }
        if (!any) {
          for (int w = 0; w < W; ++w) _mm256_store_ps(p[i] + 8 * w, _mm256_setzero_ps());
          continue;
        }
        const float mx = std::max(m[i], ReduceMax8(top));
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 sum = _mm256_setzero_ps();
        for (int w = 0; w < W; ++w) {
          const __m256 pw = _mm256_and_ps(valid[w], Exp8(_mm256_sub_ps(si[w], vmx)));
          sum = _mm256_add_ps(sum, pw);
          _mm256_store_ps(p[i] + 8 * w, _mm256_mul_ps(pw, vfactor[w]));
        }
        Rescale8(m[i], l[i], mx, ReduceAdd8(sum), acc + i * HDp, HDp);
      }
      AccumulateV8<Q, T, CC>(seg.v + j0 * HD, cnt, HD, &p[0][0], kKeys, acc);
    }
  }
  for (int i = 0; i < nq; ++i) {
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    for (int d = 0; d < HD; ++d) out[i * HD + d] = acc[i * HDp + d] * inv;
  }
}
// Queries on the lanes, 8 lanes wide (AVX2 + FMA): Lanes' algorithm for 16 vector registers, 16
// queries a task (two 8-lane vectors), score tiles of 6 keys and P V tiles of 6 head dims (12
// accumulators); lane masks are comparison results (blends). Scratch strides stay kDenseQ.
constexpr int kLanes8 = 16;

template <int KT, bool kMasked>
MMJAX_AVX2 inline void LaneScores8(const float* qt, const float* k, int64_t kj, int64_t kd, int D, float* s, __m256* mx,
                                   const __m256i* lo, const __m256i* hi, int32_t idx) {
  __m256 a[KT][2];
  for (int t = 0; t < KT; ++t) a[t][0] = a[t][1] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m256 q0 = _mm256_load_ps(qt + d * kDenseQ), q1 = _mm256_load_ps(qt + d * kDenseQ + 8);
    const float* kr = k + d * kd;
    for (int t = 0; t < KT; ++t) {
      const __m256 kb = _mm256_broadcast_ss(kr + t * kj);
      a[t][0] = _mm256_fmadd_ps(kb, q0, a[t][0]);
      a[t][1] = _mm256_fmadd_ps(kb, q1, a[t][1]);
    }
  }
  for (int t = 0; t < KT; ++t)
    for (int u = 0; u < 2; ++u) {
      __m256 x = a[t][u];
      if (kMasked) {      // lo <= idx + t < hi
        const __m256i i = _mm256_set1_epi32(idx + t);
        const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(lo[u], i), _mm256_cmpgt_epi32(hi[u], i));
        x = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), x, _mm256_castsi256_ps(in));
      }
      _mm256_store_ps(s + t * kDenseQ + 8 * u, x);
      mx[u] = _mm256_max_ps(mx[u], x);
    }
}

template <int DT>
MMJAX_AVX2 inline void LaneValues8(const float* s, int cnt, const float* v, int64_t vstride, float* ot) {
  __m256 o[DT][2];
  for (int t = 0; t < DT; ++t) o[t][0] = _mm256_load_ps(ot + t * kDenseQ), o[t][1] = _mm256_load_ps(ot + t * kDenseQ + 8);
  for (int j = 0; j < cnt; ++j) {
    const __m256 p0 = _mm256_load_ps(s + j * kDenseQ), p1 = _mm256_load_ps(s + j * kDenseQ + 8);
    const float* vr = v + j * vstride;
    for (int t = 0; t < DT; ++t) {
      const __m256 vb = _mm256_broadcast_ss(vr + t);
      o[t][0] = _mm256_fmadd_ps(vb, p0, o[t][0]);
      o[t][1] = _mm256_fmadd_ps(vb, p1, o[t][1]);
    }
  }
  for (int t = 0; t < DT; ++t) _mm256_store_ps(ot + t * kDenseQ, o[t][0]), _mm256_store_ps(ot + t * kDenseQ + 8, o[t][1]);
}

template <bool kMasked>
struct Lanes8 {
  int D;
  float *qt, *ot, *s;
  __m256 m[2], l[2];
  __m256i lo[2], hi[2];

  MMJAX_AVX2 Lanes8(const float* q, int nq, int64_t qstride, int D_, float scale, float* scratch,
                    const int64_t* qlo = nullptr, const int64_t* qhi = nullptr)
      : D(D_), qt(scratch), ot(scratch + D_ * kDenseQ), s(scratch + 2 * D_ * kDenseQ) {
    for (int d = 0; d < D; ++d)
      for (int i = 0; i < kLanes8; ++i) qt[d * kDenseQ + i] = i < nq ? q[i * qstride + d] * scale : 0.f;
    for (int d = 0; d < D; ++d) std::fill(ot + d * kDenseQ, ot + d * kDenseQ + kLanes8, 0.f);
    for (int u = 0; u < 2; ++u) m[u] = _mm256_set1_ps(kNegInf), l[u] = _mm256_setzero_ps();
    if (kMasked) {
      alignas(32) int32_t a[kLanes8] = {}, e[kLanes8] = {};     // padding lanes: empty
      for (int i = 0; i < nq; ++i) a[i] = static_cast<int32_t>(qlo[i]), e[i] = static_cast<int32_t>(qhi[i]);
      for (int u = 0; u < 2; ++u)
        lo[u] = _mm256_load_si256(reinterpret_cast<const __m256i*>(a + 8 * u)),
        hi[u] = _mm256_load_si256(reinterpret_cast<const __m256i*>(e + 8 * u));
    }
  }

  MMJAX_AVX2 void Chunk(const float* k, int64_t kj, int64_t kd, const float* v, int64_t vstride, int cnt, int64_t key0) {
    const __m256 ninf = _mm256_set1_ps(kNegInf);
    __m256 c[2] = {m[0], m[1]}, sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const int32_t idx = static_cast<int32_t>(key0);
    int j = 0;
    for (; j + 6 <= cnt; j += 6) LaneScores8<6, kMasked>(qt, k + j * kj, kj, kd, D, s + j * kDenseQ, c, lo, hi, idx + j);
    for (; j < cnt; ++j) LaneScores8<1, kMasked>(qt, k + j * kj, kj, kd, D, s + j * kDenseQ, c, lo, hi, idx + j);
    for (int jj = 0; jj < cnt; ++jj)
      for (int u = 0; u < 2; ++u) {
        float* sj = s + jj * kDenseQ + 8 * u;
        const __m256 x = _mm256_load_ps(sj);
        __m256 p = Exp8(_mm256_sub_ps(x, c[u]));
        if (kMasked) p = _mm256_and_ps(p, _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));   // masked keys: 0
        _mm256_store_ps(sj, p);
        sum[u] = _mm256_add_ps(sum[u], p);
      }
    for (int u = 0; u < 2; ++u) {
      const __m256 alpha = _mm256_and_ps(Exp8(_mm256_sub_ps(m[u], c[u])), _mm256_cmp_ps(m[u], ninf, _CMP_NEQ_OQ));
      l[u] = _mm256_fmadd_ps(l[u], alpha, sum[u]);
      for (int d = 0; d < D; ++d) {
        float* od = ot + d * kDenseQ + 8 * u;
        _mm256_store_ps(od, _mm256_mul_ps(alpha, _mm256_load_ps(od)));
      }
      m[u] = c[u];
    }
    int d = 0;
    for (; d + 6 <= D; d += 6) LaneValues8<6>(s, cnt, v + d, vstride, ot + d * kDenseQ);
    for (; d < D; ++d) LaneValues8<1>(s, cnt, v + d, vstride, ot + d * kDenseQ);
  }

  MMJAX_AVX2 void Store(int nq, float* out, int64_t ostride) const {
    alignas(32) float inv[kLanes8];
    for (int u = 0; u < 2; ++u) {
      const __m256 pos = _mm256_cmp_ps(l[u], _mm256_setzero_ps(), _CMP_GT_OQ);
      _mm256_store_ps(inv + 8 * u, _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.f), l[u]), pos));
    }
    for (int i = 0; i < nq; ++i)
      for (int d = 0; d < D; ++d) out[i * ostride + d] = ot[d * kDenseQ + i] * inv[i];
  }
};

// The lanes kernels' drivers, for either path's state (Lanes<QV, kMasked>, Lanes8<kMasked>), and
// a thread's scratch for them ((2 D + kDenseChunk) x kDenseQ floats, 64-byte aligned).
inline float* LaneScratch(int64_t D) {
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(2 * D + kDenseChunk) * kDenseQ + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
}

// dense: the lanes' queries over nk >= 1 keys / values k, v (key j's row at j * kstride)
template <class LanesT>
void DenseLanes(LanesT& lanes, int nq, const float* k, const float* v, int64_t kstride, int64_t nk, float* out,
                int64_t ostride) {
  for (int64_t j0 = 0; j0 < nk; j0 += kDenseChunk)
    lanes.Chunk(k + j0 * kstride, kstride, 1, v + j0 * kstride, kstride,
                static_cast<int>(std::min<int64_t>(kDenseChunk, nk - j0)), j0);
  lanes.Store(nq, out, ostride);
}

// prefill over an f32 cache: the lanes' queries (rows of [N, HD]), each over its cache range
// [lo_i, hi_i), the keys of the union of the ranges in chunks within each segment (K^T [HD, L]:
// key j's dim d at kt[j + d L])
template <class LanesT>
void PrefillLanes(LanesT& lanes, int nq, int HD, const std::vector<Segment<float>>& segs, const int64_t* lo,
                  const int64_t* hi, float* out) {
  int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
  for (int i = 0; i < nq; ++i)
    if (lo[i] < hi[i]) first = std::min(first, lo[i]), last = std::max(last, hi[i]);
  int64_t start = 0;
  for (const auto& seg : segs) {
    const int64_t L = seg.len, base = start;
    const int64_t a = std::max(first, base) - base, e = std::min(last, base + L) - base;
    start += L;
    for (int64_t j0 = a; j0 < e; j0 += kDenseChunk)
      lanes.Chunk(seg.kt + j0, 1, L, seg.v + j0 * HD, HD, static_cast<int>(std::min<int64_t>(kDenseChunk, e - j0)),
                  base + j0);
  }
  lanes.Store(nq, out, HD);
}

#endif  // __x86_64__

// ---------------------------------------------------------------------------------------------

template <ffi::DataType DT>
using CacheT = std::conditional_t<
    DT == ffi::DataType::F32, float,
    std::conditional_t<DT == ffi::DataType::S8, int8_t,
                       std::conditional_t<DT == ffi::DataType::F8E4M3FN, F8E4M3, uint16_t>>>;

// The new token of each row b (one per KV head: K and V [B, KVH, HD], an int8 / fp8 cache's
// scales [B, KVH]) written at cache index pos_b (none where pos_b is outside the segments), as
// the unfused step's scatter does: the decode step's cache update inside the attention call.
template <typename T>
struct NewKV {
  const int32_t* pos = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  const uint16_t* ks = nullptr;
  const uint16_t* vs = nullptr;
};

// The cache operands of one layer: S K^T segments, S V segments (, S K scale, S V scale segments
// for an int8 / fp8 cache), each segment's length and base pointers. The paged layout: a page
// table s32 [rows, max_pages] ahead of them and one segment, the page pool (its slots are pages
// of L_0 = page_size positions): cache row r's index i lives at offset i % page_size of page
// table[r, i / page_size] (an entry outside the pool, an unused one, is read as the pool's last
// page, as XLA's gather with mode="clip": only masked positions map there; a write to it is
// dropped).
template <ffi::DataType DT>
struct CacheView {
  using T = CacheT<DT>;
  static constexpr bool kScaled = DT == ffi::DataType::S8 || DT == ffi::DataType::F8E4M3FN;
  size_t S = 0;
  int64_t slots = 0;
  std::vector<int64_t> lens;
  std::vector<T*> kbase, vbase;
  std::vector<uint16_t*> ksbase, vsbase;
  const int32_t* table = nullptr;          // paged: [table_rows, max_pages]
  int64_t table_rows = 0, max_pages = 0;

  // cache rows a caller may name: the page table's rows, or the segments' slots
  int64_t Rows() const { return table ? table_rows : slots; }

  // checks the page table (if any) and every segment against KVH / HD (and one slot count) -> an
  // error message, or null
  const char* Parse(const std::vector<ffi::AnyBuffer>& operands, int64_t KVH, int64_t HD) {
    constexpr size_t kGroups = kScaled ? 4 : 2;
    std::vector<ffi::AnyBuffer> cache = operands;
    if (!cache.empty() && cache[0].element_type() == ffi::DataType::S32) {
      const auto td = cache[0].dimensions();
      if (td.size() != 2 || cache.size() != kGroups + 1)
        return "a page table s32 [rows, max_pages], then one K^T and one V pool (int8 / fp8: and their scales)";
      table = static_cast<const int32_t*>(cache[0].untyped_data());
      table_rows = td[0], max_pages = td[1];
      cache.erase(cache.begin());
    }
    if (cache.empty() || cache.size() % kGroups) return "K^T and V segments (int8 / fp8: and their scales) expected";
    S = cache.size() / kGroups;
    lens.assign(S, 0), kbase.assign(S, nullptr), vbase.assign(S, nullptr);
    ksbase.assign(S, nullptr), vsbase.assign(S, nullptr);
    for (size_t i = 0; i < S; ++i) {
      const ffi::AnyBuffer &kt = cache[i], &v = cache[S + i];
      const auto kd = kt.dimensions(), vd = v.dimensions();
      if (kt.element_type() != DT || v.element_type() != DT || kd.size() != 4 || vd.size() != 4 ||
          vd[0] != kd[0] || kd[1] != KVH || vd[1] != KVH || kd[2] != HD || vd[3] != HD || vd[2] != kd[3] ||
          (i && kd[0] != slots) || (table && kd[0] == 0))
        return "segment i is K^T [slots, KVH, HD, L_i] and V [slots, KVH, L_i, HD] of the kernel's dtype";
      slots = kd[0];
      lens[i] = kd[3];
      kbase[i] = static_cast<T*>(kt.untyped_data());
      vbase[i] = static_cast<T*>(v.untyped_data());
      if (kScaled) {
        const ffi::AnyBuffer &ks = cache[2 * S + i], &vs = cache[3 * S + i];
        const auto sd = ks.dimensions(), td = vs.dimensions();
        if (ks.element_type() != ffi::DataType::BF16 || vs.element_type() != ffi::DataType::BF16 || sd.size() != 3 ||
            td.size() != 3 || sd[0] != kd[0] || sd[1] != KVH || sd[2] != kd[3] || td[0] != kd[0] || td[1] != KVH ||
            td[2] != kd[3])
          return "scale segment i is bf16 [slots, KVH, L_i], as its K^T / V segment";
        ksbase[i] = static_cast<uint16_t*>(ks.untyped_data());
        vsbase[i] = static_cast<uint16_t*>(vs.untyped_data());
      }
    }
    return nullptr;
  }

  // the segment (slot, head) block of segment i as a task's Segment
  Segment<T> Block(size_t i, int64_t slot, int64_t h, int64_t KVH, int64_t HD) const {
    Segment<T> seg{kbase[i] + (slot * KVH + h) * HD * lens[i], vbase[i] + (slot * KVH + h) * lens[i] * HD, lens[i]};
    if (kScaled) {
      seg.ks = ksbase[i] + (slot * KVH + h) * lens[i];
      seg.vs = vsbase[i] + (slot * KVH + h) * lens[i];
    }
    return seg;
  }

  // cache row `row`, KV head h as one task's segments, covering at least cache indexes [0, hi)
  // (paged: the row's pages up to the one holding index hi - 1, each a segment)
  std::vector<Segment<T>> Row(int64_t row, int64_t h, int64_t KVH, int64_t HD, int64_t hi) const {
    std::vector<Segment<T>> segs;
    if (!table) {
      for (size_t i = 0; i < S; ++i) segs.push_back(Block(i, row, h, KVH, HD));
      return segs;
    }
    const int64_t P = lens[0], n = std::min(max_pages, std::max<int64_t>(0, (hi + P - 1) / P));
    const int32_t* pages = table + row * max_pages;
    segs.reserve(n);
    for (int64_t p = 0; p < n; ++p)
      segs.push_back(Block(0, std::min<int64_t>(std::max<int32_t>(pages[p], 0), slots - 1), h, KVH, HD));
    return segs;
  }

  // where cache index `pos` of cache row `row` is stored: (segment, slot, offset) -> false if
  // nowhere (outside the segments, past the row's pages, an unused page table entry)
  bool Locate(int64_t row, int64_t pos, size_t* seg, int64_t* slot, int64_t* j) const {
    if (pos < 0) return false;
    if (table) {
      const int64_t P = lens[0], p = pos / P;
      if (p >= max_pages) return false;
      const int64_t page = table[row * max_pages + p];
      if (page < 0 || page >= slots) return false;
      *seg = 0, *slot = page, *j = pos % P;
      return true;
    }
    for (size_t i = 0; i < S; pos -= lens[i], ++i)
      if (pos < lens[i]) {
        *seg = i, *slot = row, *j = pos;
        return true;
      }
    return false;
  }
};

// segs: the cache as one (row, head)'s segments; `cache`: K^T, V (, K scale, V scale) segment
// buffers in groups of S, read (and with `nw.pos`, first written) in place
template <ffi::DataType DT>
ffi::Error Attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::S32>& lo, ffi::Buffer<ffi::S32>& hi,
                  const std::vector<ffi::AnyBuffer>& cache, const NewKV<CacheT<DT>>& nw, float* op, float scale) {
  constexpr bool kScaled = CacheView<DT>::kScaled;
  using T = CacheT<DT>;
  const auto qd = q.dimensions();
  if (qd.size() != 4 || lo.element_count() != qd[0] || hi.element_count() != qd[0])
    return ffi::Error::InvalidArgument("mmjax_decode_attention: q [B, KVH, N, HD], lo / hi [B] expected");
  const int64_t B = qd[0], KVH = qd[1], N = qd[2], HD = qd[3];
  CacheView<DT> cv;
  if (const char* err = cv.Parse(cache, KVH, HD))
    return ffi::Error::InvalidArgument(std::string("mmjax_decode_attention: ") + err);
  if (cv.Rows() < B) return ffi::Error::InvalidArgument("mmjax_decode_attention: a cache row per row of q expected");
  const auto& lens = cv.lens;
  const auto &kbase = cv.kbase, &vbase = cv.vbase;
  const auto &ksbase = cv.ksbase, &vsbase = cv.vsbase;
  const float* qp = q.typed_data();
  const int32_t* lop = lo.typed_data();
  const int32_t* hip = hi.typed_data();
  const bool simd = HasAvx512(), avx2 = HasAvx2();
  constexpr int kGroup = 16;    // queries per pass (registers: 16 score accumulators)
  const int64_t groups = (N + kGroup - 1) / kGroup;
  const int64_t tasks = B * KVH * groups;
  // row b, head h's new token into its segment (a task per (row, head) writes its own, before
  // it reads; with several query groups per head, every write comes first)
  auto write = [&](int64_t b, int64_t h) {
    size_t i;
    int64_t slot, j;
    if (!cv.Locate(b, nw.pos[b], &i, &slot, &j)) return;
    const int64_t L = lens[i], sh = slot * KVH + h, bh = b * KVH + h;
    T* kt = kbase[i] + sh * HD * L;
    T* v = vbase[i] + (sh * L + j) * HD;
    for (int64_t d = 0; d < HD; ++d) kt[d * L + j] = nw.k[bh * HD + d];
    std::memcpy(v, nw.v + bh * HD, sizeof(T) * HD);
    if (kScaled) {
      ksbase[i][sh * L + j] = nw.ks[bh];
      vsbase[i][sh * L + j] = nw.vs[bh];
    }
  };
  if (nw.pos && groups > 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < KVH; ++h) write(b, h);
  const int threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 256));
  ParallelFor(pool, threads, static_cast<int>(tasks), [&](int t) {
    const int64_t bh = t / groups, g = t % groups, b = bh / KVH, h = bh % KVH;
    if (nw.pos && groups == 1) write(b, h);
    const int n0 = static_cast<int>(g * kGroup), nq = static_cast<int>(std::min<int64_t>(kGroup, N - n0));
    const float* qh = qp + (bh * N + n0) * HD;
    float* oh = op + (bh * N + n0) * HD;
    const int64_t a = std::max<int64_t>(0, lop[b]), e = hip[b];
    const std::vector<Segment<T>> segs = cv.Row(b, h, KVH, HD, e);
#if defined(__x86_64__)
    if (simd) {
      const int Q = nq <= 1 ? 1 : nq <= 2 ? 2 : nq <= 4 ? 4 : nq <= 8 ? 8 : 16;
      const int HDp = static_cast<int>((HD + 15) / 16 * 16);
      thread_local std::vector<float> scratch;
      scratch.assign(static_cast<size_t>(Q) * (HD + HDp + kRowBlock) + 32, 0.f);
      float* qpad = scratch.data();                                    // [Q, HD], zero padding rows
      float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(qpad + Q * HD) + 63) & ~uintptr_t(63));
      float* sbuf = acc + Q * HDp;                                     // [Q, kRowBlock] scores
      std::memcpy(qpad, qh, sizeof(float) * nq * HD);
      switch (Q) {
        case 1: return Task512<1, T>(qpad, nq, HD, segs, a, e, scale, acc, sbuf, oh);
        case 2: return Task512<2, T>(qpad, nq, HD, segs, a, e, scale, acc, sbuf, oh);
        case 4: return Task512<4, T>(qpad, nq, HD, segs, a, e, scale, acc, sbuf, oh);
        case 8: return Task512<8, T>(qpad, nq, HD, segs, a, e, scale, acc, sbuf, oh);
        default: return Task512<16, T>(qpad, nq, HD, segs, a, e, scale, acc, sbuf, oh);
      }
    }
    if (avx2) {
      const int Q = nq <= 1 ? 1 : nq <= 2 ? 2 : nq <= 4 ? 4 : nq <= 8 ? 8 : 16;
      const int HDp = static_cast<int>((HD + 7) / 8 * 8);
      thread_local std::vector<float> scratch;
      scratch.assign(static_cast<size_t>(Q) * (HD + HDp + kRowBlock) + 16, 0.f);
      float* qpad = scratch.data();                                    // [Q, HD], zero padding rows
      float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(qpad + Q * HD) + 31) & ~uintptr_t(31));
      float* sbuf = acc + Q * HDp;                                     // [Q, kRowBlock] scores
      std::memcpy(qpad, qh, sizeof(float) * nq * HD);
      switch (Q) {
        case 1: return Task8<1, T>(qpad, nq, HD, segs, a, e, scale, acc, sbuf, oh);
        case 2: return Task8<2, T>(qpad, nq, HD, segs, a, e, scale, acc, sbuf, oh);
        case 4: return Task8<4, T>(qpad, nq, HD, segs, a, e, scale, acc, sbuf, oh);
        case 8: return Task8<8, T>(qpad, nq, HD, segs, a, e, scale, acc, sbuf, oh);
        default: return Task8<16, T>(qpad, nq, HD, segs, a, e, scale, acc, sbuf, oh);
      }
    }
#endif
    GenericTask<T>(qh, nq, static_cast<int>(HD), segs, a, e, scale, oh);
  });
  return ffi::Error::Success();
}

// The remaining operands of a call as buffers (false: one could not be read).
inline bool Buffers(const ffi::RemainingArgs& args, std::vector<ffi::AnyBuffer>* out) {
  for (size_t i = 0; i < args.size(); ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    if (!x.has_value()) return false;
    out->push_back(*x);
  }
  return true;
}

template <ffi::DataType DT>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> lo,
                           ffi::Buffer<ffi::S32> hi, ffi::RemainingArgs cache, ffi::ResultBuffer<ffi::F32> out,
                           float scale) {
  std::vector<ffi::AnyBuffer> segs;
  if (!Buffers(cache, &segs)) return ffi::Error::InvalidArgument("mmjax_decode_attention: bad operand");
  return Attend<DT>(pool, q, lo, hi, segs, NewKV<CacheT<DT>>{}, out->typed_data(), scale);
}

// mmjax_decode_attention_write_*: the same attention, after writing each row's new token into
// the cache in place. Operands: q, lo, hi, pos [B] s32, then the new K, V [B, KVH, HD] (cache
// dtype) (, K and V scales [B, KVH] bf16), then the segments as above; results: out, then every
// segment (aliased to its operand: the caller's input_output_aliases).
template <ffi::DataType DT>
ffi::Error DecodeAttentionWrite(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> lo,
                                ffi::Buffer<ffi::S32> hi, ffi::Buffer<ffi::S32> pos, ffi::RemainingArgs args,
                                ffi::RemainingRets rets, float scale) {
  constexpr bool kScaled = DT == ffi::DataType::S8 || DT == ffi::DataType::F8E4M3FN;
  constexpr size_t kNew = kScaled ? 4 : 2;
  using T = CacheT<DT>;
  const auto qd = q.dimensions();
  // a paged cache: its page table (s32) between the new K / V and the pool, not a result
  auto first = args.get<ffi::AnyBuffer>(kNew);
  const size_t paged = first.has_value() && first->element_type() == ffi::DataType::S32 ? 1 : 0;
  if (qd.size() != 4 || pos.element_count() != qd[0] || args.size() < kNew + paged ||
      rets.size() != args.size() - kNew - paged + 1)
    return ffi::Error::InvalidArgument(
        "mmjax_decode_attention_write: q, lo, hi, pos [B], the new K, V (, scales), (the page table,) the segments; "
        "results: out, the segments");
  const int64_t B = qd[0], KVH = qd[1], HD = qd[3];
  std::vector<ffi::AnyBuffer> news;
  for (size_t i = 0; i < kNew; ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    if (!x.has_value()) return ffi::Error::InvalidArgument("mmjax_decode_attention_write: bad operand");
    const int64_t want = i < 2 ? B * KVH * HD : B * KVH;
    if (x->element_count() != want || x->element_type() != (i < 2 ? DT : ffi::DataType::BF16))
      return ffi::Error::InvalidArgument(
          "mmjax_decode_attention_write: new K, V [B, KVH, HD] of the cache's dtype, scales bf16 [B, KVH]");
    news.push_back(*x);
  }
  auto o = rets.get<ffi::AnyBuffer>(0);
  if (!o.has_value() || (*o)->element_type() != ffi::DataType::F32 || (*o)->element_count() != q.element_count())
    return ffi::Error::InvalidArgument("mmjax_decode_attention_write: out f32 [B, KVH, N, HD]");
  std::vector<ffi::AnyBuffer> segs;
  if (paged) segs.push_back(*first);
  for (size_t i = 1; i < rets.size(); ++i) {
    auto x = rets.get<ffi::AnyBuffer>(i);
    auto a = args.get<ffi::AnyBuffer>(kNew + paged + i - 1);
    if (!x.has_value() || !a.has_value() || (*x)->element_count() != a->element_count())
      return ffi::Error::InvalidArgument("mmjax_decode_attention_write: result i is segment i");
    // aliased: the same buffer; were it not, the result starts as the operand's copy
    if ((*x)->untyped_data() != a->untyped_data())
      std::memcpy((*x)->untyped_data(), a->untyped_data(), a->size_bytes());
    segs.push_back(**x);
  }
  NewKV<T> nw;
  nw.pos = pos.typed_data();
  nw.k = static_cast<const T*>(news[0].untyped_data());
  nw.v = static_cast<const T*>(news[1].untyped_data());
  if (kScaled) {
    nw.ks = static_cast<const uint16_t*>(news[2].untyped_data());
    nw.vs = static_cast<const uint16_t*>(news[3].untyped_data());
  }
  return Attend<DT>(pool, q, lo, hi, segs, nw, static_cast<float*>((*o)->untyped_data()), scale);
}


// mmjax_prefill_attention_*: several new tokens per row, each query over its own visible keys.
// Operands: q f32 [B, KVH, N, HD] (N = T * G: query n is token n / G's), lo, hi s32 [B, T]
// (token t of row b sees cache indexes [lo, hi) of cache row slots_b), slots s32 [B] (a row whose
// slot is outside the cache, or the page table, gets zeros), then the segments (or the page
// table and the pools) as above; attribute scale
// -> out f32 [B, KVH, N, HD]. One task per (row, KV head, 8 queries; AVX2: 6 queries).
template <ffi::DataType DT>
ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> lo,
                            ffi::Buffer<ffi::S32> hi, ffi::Buffer<ffi::S32> slots, ffi::RemainingArgs args,
                            ffi::ResultBuffer<ffi::F32> out, float scale) {
  using T = CacheT<DT>;
  const auto qd = q.dimensions(), ld = lo.dimensions();
  if (qd.size() != 4 || ld.size() != 2 || ld[0] != qd[0] || hi.element_count() != lo.element_count() ||
      slots.element_count() != qd[0] || ld[1] == 0 || qd[2] % ld[1])
    return ffi::Error::InvalidArgument(
        "mmjax_prefill_attention: q [B, KVH, T * G, HD], lo / hi [B, T], slots [B] expected");
  const int64_t B = qd[0], KVH = qd[1], N = qd[2], HD = qd[3], tokens = ld[1], G = N / tokens;
  std::vector<ffi::AnyBuffer> cache;
  if (!Buffers(args, &cache)) return ffi::Error::InvalidArgument("mmjax_prefill_attention: bad operand");
  CacheView<DT> cv;
  if (const char* err = cv.Parse(cache, KVH, HD))
    return ffi::Error::InvalidArgument(std::string("mmjax_prefill_attention: ") + err);
  const float* qp = q.typed_data();
  const int32_t *lop = lo.typed_data(), *hip = hi.typed_data(), *slotp = slots.typed_data();
  float* op = out->typed_data();
  // 8 queries x 32 keys per block: 8 x 2 score registers (16 x 16 and 4 x 64 ran 10-25% slower
  // at 240 causal tokens, head_dim 64)
  constexpr int kBlock = 8;
  // AVX2: 6 queries x 16 keys per block (see PrefillTask8)
  constexpr int kBlock8 = 6, kKeyVectors8 = 2;
  const bool simd = HasAvx512(), avx2 = HasAvx2();
  // an f32 cache: queries on the lanes (PrefillLanes: 32 a task; 16 on AVX2). 16 layers of the
  // bench model's causal prefill attention, interleaved in one process (nineteenth session, the
  // SPR-class VM; g_prefill_lanes 0 / 1): 240 tokens 20.1 -> 15.5 and 22.5 -> 16.9 ms, 1000 tokens
  // 262 -> 169 and 278 -> 186 ms.
  constexpr bool kF32 = std::is_same_v<T, float>;
  const bool lanes = (simd || avx2) && kF32 && g_prefill_lanes;
  const int block = lanes ? (simd ? kDenseQ : kLanes8) : avx2 ? kBlock8 : kBlock;
  const int64_t blocks = (N + block - 1) / block, tasks = B * KVH * blocks;
  const int threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 256));
  ParallelFor(pool, threads, static_cast<int>(tasks), [&](int t) {
    const int64_t bh = t / blocks, b = bh / KVH, h = bh % KVH, n0 = t % blocks * block;
    const int nq = static_cast<int>(std::min<int64_t>(block, N - n0));
    const float* qh = qp + (bh * N + n0) * HD;
    float* oh = op + (bh * N + n0) * HD;
    const int64_t slot = slotp[b];
    if (slot < 0 || slot >= cv.Rows()) {
      std::fill(oh, oh + int64_t(nq) * HD, 0.f);
      return;
    }
    int64_t qlo[kDenseQ], qhi[kDenseQ], last = 0;
    for (int i = 0; i < nq; ++i) {
      const int64_t tok = b * tokens + (n0 + i) / G;
      qlo[i] = std::max<int64_t>(0, lop[tok]), qhi[i] = hip[tok], last = std::max(last, qhi[i]);
    }
    const std::vector<Segment<T>> segs = cv.Row(slot, h, KVH, HD, last);
#if defined(__x86_64__)
    if constexpr (kF32) {
      if (lanes) {
        float* sc = LaneScratch(HD);
        const int hd = static_cast<int>(HD);
        if (!simd) {
          Lanes8<true> l(qh, nq, HD, hd, scale, sc, qlo, qhi);
          return PrefillLanes(l, nq, hd, segs, qlo, qhi, oh);
        }
        if (nq <= 16) {
          Lanes<1, true> l(qh, nq, HD, hd, scale, sc, qlo, qhi);
          return PrefillLanes(l, nq, hd, segs, qlo, qhi, oh);
        }
        Lanes<2, true> l(qh, nq, HD, hd, scale, sc, qlo, qhi);
        return PrefillLanes(l, nq, hd, segs, qlo, qhi, oh);
      }
    }
    if (simd) {
      const int HDp = static_cast<int>((HD + 15) / 16 * 16);
      thread_local std::vector<float> scratch;
      scratch.assign(static_cast<size_t>(kBlock) * (HD + HDp) + 16, 0.f);
      float* qpad = scratch.data();                                    // [Q, HD], zero padding rows
      float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(qpad + kBlock * HD) + 63) & ~uintptr_t(63));
      std::memcpy(qpad, qh, sizeof(float) * nq * HD);
      return PrefillTask512<kBlock, 2, T>(qpad, nq, static_cast<int>(HD), segs, qlo, qhi, scale, acc, oh);
    }
    if (avx2) {
      const int HDp = static_cast<int>((HD + 7) / 8 * 8);
      thread_local std::vector<float> scratch;
      scratch.assign(static_cast<size_t>(kBlock8) * (HD + HDp) + 8, 0.f);
      float* qpad = scratch.data();                                    // [Q, HD], zero padding rows
      float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(qpad + kBlock8 * HD) + 31) & ~uintptr_t(31));
      std::memcpy(qpad, qh, sizeof(float) * nq * HD);
      return PrefillTask8<kBlock8, kKeyVectors8, T>(qpad, nq, static_cast<int>(HD), segs, qlo, qhi, scale, acc, oh);
    }
#endif
    for (int i = 0; i < nq; ++i)
      GenericTask<T>(qh + i * HD, 1, static_cast<int>(HD), segs, qlo[i], qhi[i], scale, oh + i * HD);
  });
  return ffi::Error::Success();
}

// mmjax_dense_attention_f32: full (bidirectional) attention as the vision towers take it, operands
// as they lie: q f32 [B, Sq, H, D], k, v f32 [B, Sk, Hkv, D] (H % Hkv == 0; query head h reads kv
// head h / (H / Hkv)), lengths s32 [B] (row b's queries see keys [0, lengths_b), clipped to
// [0, Sk]); attribute scale -> out f32 [B, Sq, H, D] (zeros for a row that sees no key). One task
// per (row, head, 32 queries; 16 on AVX2): DenseLanes, or without a SIMD path the plain
// loops below (the same chunks and online softmax, one query at a time).
void GenericDense(const float* q, int nq, int64_t qstride, const float* k, const float* v, int64_t kstride,
                  int64_t nk, int D, float scale, float* out, int64_t ostride) {
  std::vector<float> sc(static_cast<size_t>(std::min<int64_t>(nk, kDenseChunk))), acc(D);
  for (int i = 0; i < nq; ++i) {
    const float* qi = q + i * qstride;
    float m = kNegInf, l = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j0 = 0; j0 < nk; j0 += kDenseChunk) {
      const int64_t cnt = std::min<int64_t>(kDenseChunk, nk - j0);
      float mx = m;
      for (int64_t j = 0; j < cnt; ++j) {
        const float* kj = k + (j0 + j) * kstride;
        float dot = 0.f;
        for (int d = 0; d < D; ++d) dot += qi[d] * scale * kj[d];
        sc[j] = dot;
        mx = std::max(mx, dot);
      }
      const float alpha = m == kNegInf ? 0.f : std::exp(m - mx);
      float sum = 0.f;
      for (int64_t j = 0; j < cnt; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
      l = l * alpha + sum;
      m = mx;
      for (int d = 0; d < D; ++d) {
        float o = acc[d] * alpha;
        for (int64_t j = 0; j < cnt; ++j) o += sc[j] * v[(j0 + j) * kstride + d];
        acc[d] = o;
      }
    }
    for (int d = 0; d < D; ++d) out[i * ostride + d] = acc[d] / l;
  }
}

ffi::Error DenseAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths, ffi::ResultBuffer<ffi::F32> out,
                          float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || kd[0] != qd[0] || kd[3] != qd[3] ||
      vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3] || kd[2] == 0 || qd[2] % kd[2] ||
      lengths.element_count() != qd[0])
    return ffi::Error::InvalidArgument(
        "mmjax_dense_attention: q [B, Sq, H, D], k / v [B, Sk, Hkv, D] (H % Hkv == 0), lengths [B] expected");
  const int64_t B = qd[0], Sq = qd[1], H = qd[2], D = qd[3], Sk = kd[1], Hkv = kd[2], G = H / Hkv;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t* lens = lengths.typed_data();
  float* op = out->typed_data();
  // A task: `per` consecutive query blocks of one (row, head), so its K and V come from L2 after
  // the first block (as many blocks as keep ~8 tasks a thread; 11 CLIP-B layers with distinct K /
  // V, 8 images: 71.9 -> 61.3 ms, 1 image level).
  const bool simd = HasAvx512(), avx2 = HasAvx2();
  const int64_t qb = avx2 ? kLanes8 : kDenseQ;        // queries a block (the AVX2 path's: 16)
  const int64_t blocks = (Sq + qb - 1) / qb;
  const int threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 256));
  const int64_t per = std::clamp<int64_t>(B * H * blocks / (8 * threads), 1, blocks);
  const int64_t spans = (blocks + per - 1) / per, tasks = B * H * spans;
  ParallelFor(pool, threads, static_cast<int>(tasks), [&](int t) {
    const int64_t b = t / (H * spans), h = t / spans % H;
    const int64_t nk = std::clamp<int64_t>(lens[b], 0, Sk);
    const float* kh = kp + (b * Sk * Hkv + h / G) * D;
    const float* vh = vp + (b * Sk * Hkv + h / G) * D;
    for (int64_t i0 = t % spans * per * qb; i0 < std::min(Sq, (t % spans + 1) * per * qb); i0 += qb) {
      const int nq = static_cast<int>(std::min<int64_t>(qb, Sq - i0));
      const float* qh = qp + ((b * Sq + i0) * H + h) * D;
      float* oh = op + ((b * Sq + i0) * H + h) * D;
      if (nk == 0) {
        for (int i = 0; i < nq; ++i) std::fill(oh + i * H * D, oh + i * H * D + D, 0.f);
        continue;
      }
#if defined(__x86_64__)
      if (simd || avx2) {
        float* sc = LaneScratch(D);
        const int d = static_cast<int>(D);
        if (avx2) {
          Lanes8<false> l(qh, nq, H * D, d, scale, sc);
          DenseLanes(l, nq, kh, vh, Hkv * D, nk, oh, H * D);
        } else if (nq <= 16) {
          Lanes<1, false> l(qh, nq, H * D, d, scale, sc);
          DenseLanes(l, nq, kh, vh, Hkv * D, nk, oh, H * D);
        } else {
          Lanes<2, false> l(qh, nq, H * D, d, scale, sc);
          DenseLanes(l, nq, kh, vh, Hkv * D, nk, oh, H * D);
        }
        continue;
      }
#endif
      GenericDense(qh, nq, H * D, kh, vh, Hkv * D, nk, static_cast<int>(D), scale, oh, H * D);
    }
  });
  return ffi::Error::Success();
}

// mmjax_kv_write: a prefill's new K / V written into the segmented cache in place, one call per
// layer, whatever the cache's dtype (the bytes are moved as they are). Operands: rows, idx s32
// [B, T] (token (b, t) goes to cache row rows_bt at cache index idx_bt; a row outside the cache or
// an index outside the segments: dropped), K, V [B, T, KVH, HD] (the cache's dtype), for a scaled
// (int8 / fp8) cache their scales [B, T, KVH] (bf16), then the segments: K^T [slots, KVH, HD, L_i]
// x S, V [slots, KVH, L_i, HD] x S (, K scale, V scale [slots, KVH, L_i] x S); attribute nseg = S.
// Results: the segments, aliased to their operands. Why: XLA:CPU's scatter walks every update of
// every segment (dropped ones included) and K^T's update is a strided transpose: 64 scatters and
// their transposes were ~10 ms of a 240-token prefill of the bench model.
ffi::Error KvWrite(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> idx, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, int64_t nseg) {
  const auto rd = rows.dimensions();
  const size_t S = static_cast<size_t>(nseg);
  if (rd.size() != 2 || idx.element_count() != rows.element_count() || S == 0 ||
      (args.size() != 2 + 2 * S && args.size() != 4 + 4 * S) || rets.size() != args.size() - (args.size() == 2 + 2 * S ? 2 : 4))
    return ffi::Error::InvalidArgument(
        "mmjax_kv_write: rows, idx [B, T], K, V (, K / V scales), then nseg K^T, V (, scale) segments; results: the segments");
  const bool scaled = args.size() == 4 + 4 * S;
  const size_t kNew = scaled ? 4 : 2;
  std::vector<ffi::AnyBuffer> news, segs;
  for (size_t i = 0; i < kNew; ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    if (!x.has_value()) return ffi::Error::InvalidArgument("mmjax_kv_write: bad operand");
    news.push_back(*x);
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto x = rets.get<ffi::AnyBuffer>(i);
    auto a = args.get<ffi::AnyBuffer>(kNew + i);
    if (!x.has_value() || !a.has_value() || (*x)->size_bytes() != a->size_bytes())
      return ffi::Error::InvalidArgument("mmjax_kv_write: result i is segment i");
    if ((*x)->untyped_data() != a->untyped_data())      // not aliased: the result starts as the operand
      std::memcpy((*x)->untyped_data(), a->untyped_data(), a->size_bytes());
    segs.push_back(**x);
  }
  const auto kd = news[0].dimensions();
  const auto k0 = segs[0].dimensions();
  if (kd.size() != 4 || k0.size() != 4 || kd[0] != rd[0] || kd[1] != rd[1] || news[1].element_count() != news[0].element_count() ||
      news[0].element_type() != segs[0].element_type() || news[1].element_type() != segs[S].element_type())
    return ffi::Error::InvalidArgument("mmjax_kv_write: K, V [B, T, KVH, HD] of the cache's dtype expected");
  const int64_t B = rd[0], T = rd[1], KVH = kd[2], HD = kd[3], slots = k0[0];
  const size_t es = news[0].size_bytes() / news[0].element_count(), ss = scaled ? 2 : 0;
  if (es != 4 && es != 2 && es != 1) return ffi::Error::InvalidArgument("mmjax_kv_write: 1-, 2- or 4-byte cache elements");
  if (scaled && (news[2].element_type() != ffi::DataType::BF16 || news[3].element_type() != ffi::DataType::BF16 ||
                 segs[2 * S].element_type() != ffi::DataType::BF16 || segs[3 * S].element_type() != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("mmjax_kv_write: K / V scales and their segments bf16");
  std::vector<int64_t> lens(S), starts(S);
  for (size_t i = 0, start = 0; i < S; ++i) {
    const auto kt = segs[i].dimensions(), v = segs[S + i].dimensions();
    if (kt.size() != 4 || v.size() != 4 || kt[0] != slots || kt[1] != KVH || kt[2] != HD || v[0] != slots ||
        v[1] != KVH || v[2] != kt[3] || v[3] != HD || segs[i].size_bytes() != size_t(slots * KVH * HD * kt[3]) * es)
      return ffi::Error::InvalidArgument("mmjax_kv_write: segments K^T [slots, KVH, HD, L_i], V [slots, KVH, L_i, HD]");
    lens[i] = kt[3], starts[i] = static_cast<int64_t>(start), start += kt[3];
  }
  const int32_t *rp = rows.typed_data(), *ip = idx.typed_data();
  const char* kn = static_cast<const char*>(news[0].untyped_data());
  const char* vn = static_cast<const char*>(news[1].untyped_data());
  const int threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), 256));
  // a task per (row of the call, KV head): its tokens' writes, so K^T's strided rows stay with one thread
  ParallelFor(pool, threads, static_cast<int>(B * KVH), [&](int task) {
    const int64_t b = task / KVH, h = task % KVH;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t r = rp[b * T + t], x = ip[b * T + t];
      if (r < 0 || r >= slots) continue;
      size_t i = 0;
      while (i < S && !(x >= starts[i] && x < starts[i] + lens[i])) ++i;
      if (i == S) continue;
      const int64_t L = lens[i], j = x - starts[i], src = ((b * T + t) * KVH + h) * HD;
      char* kt = static_cast<char*>(segs[i].untyped_data()) + ((r * KVH + h) * HD * L + j) * es;
      const auto column = [&](auto word) {     // K's head dims down a K^T column, one element each
        using W = decltype(word);
        const W* from = reinterpret_cast<const W*>(kn) + src;
        W* to = reinterpret_cast<W*>(kt);
        for (int64_t d = 0; d < HD; ++d) to[d * L] = from[d];
      };
      if (es == 4) column(uint32_t{});
      else if (es == 2) column(uint16_t{});
      else column(uint8_t{});
      char* v = static_cast<char*>(segs[S + i].untyped_data()) + ((r * KVH + h) * L + j) * HD * es;
      std::memcpy(v, vn + src * es, HD * es);
      if (scaled) {
        const int64_t so = (b * T + t) * KVH + h, di = (r * KVH + h) * L + j;
        std::memcpy(static_cast<char*>(segs[2 * S + i].untyped_data()) + di * ss,
                    static_cast<const char*>(news[2].untyped_data()) + so * ss, ss);
        std::memcpy(static_cast<char*>(segs[3 * S + i].untyped_data()) + di * ss,
                    static_cast<const char*>(news[3].untyped_data()) + so * ss, ss);
      }
    }
  });
  return ffi::Error::Success();
}
}  // namespace

#define MMJAX_DECODE_ATTENTION(name, dt)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, DecodeAttention<dt>, ffi::Ffi::Bind()           \
                                                               .Ctx<ffi::ThreadPool>() \
                                                               .Arg<ffi::Buffer<ffi::F32>>() \
                                                               .Arg<ffi::Buffer<ffi::S32>>() \
                                                               .Arg<ffi::Buffer<ffi::S32>>() \
                                                               .RemainingArgs()        \
                                                               .Ret<ffi::Buffer<ffi::F32>>() \
                                                               .Attr<float>("scale"));

#define MMJAX_DECODE_ATTENTION_WRITE(name, dt)                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, DecodeAttentionWrite<dt>, ffi::Ffi::Bind()            \
                                                                    .Ctx<ffi::ThreadPool>() \
                                                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                                                    .RemainingArgs()        \
                                                                    .RemainingRets()        \
                                                                    .Attr<float>("scale"));

#define MMJAX_PREFILL_ATTENTION(name, dt)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, PrefillAttention<dt>, ffi::Ffi::Bind()           \
                                                                .Ctx<ffi::ThreadPool>() \
                                                                .Arg<ffi::Buffer<ffi::F32>>() \
                                                                .Arg<ffi::Buffer<ffi::S32>>() \
                                                                .Arg<ffi::Buffer<ffi::S32>>() \
                                                                .Arg<ffi::Buffer<ffi::S32>>() \
                                                                .RemainingArgs()        \
                                                                .Ret<ffi::Buffer<ffi::F32>>() \
                                                                .Attr<float>("scale"));

// each handler for the four cache dtypes: name_f32, _bf16, _s8, _f8e4m3fn
#define MMJAX_EACH_CACHE_DTYPE(define, name)              \
  define(name##_f32, ffi::DataType::F32)                  \
  define(name##_bf16, ffi::DataType::BF16)                \
  define(name##_s8, ffi::DataType::S8)                    \
  define(name##_f8e4m3fn, ffi::DataType::F8E4M3FN)

MMJAX_EACH_CACHE_DTYPE(MMJAX_DECODE_ATTENTION, mmjax_decode_attention)
MMJAX_EACH_CACHE_DTYPE(MMJAX_DECODE_ATTENTION_WRITE, mmjax_decode_attention_write)
MMJAX_EACH_CACHE_DTYPE(MMJAX_PREFILL_ATTENTION, mmjax_prefill_attention)

XLA_FFI_DEFINE_HANDLER_SYMBOL(mmjax_kv_write, KvWrite, ffi::Ffi::Bind()
                                                           .Ctx<ffi::ThreadPool>()
                                                           .Arg<ffi::Buffer<ffi::S32>>()
                                                           .Arg<ffi::Buffer<ffi::S32>>()
                                                           .RemainingArgs()
                                                           .RemainingRets()
                                                           .Attr<int64_t>("nseg"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(mmjax_dense_attention_f32, DenseAttention, ffi::Ffi::Bind()
                                                                         .Ctx<ffi::ThreadPool>()
                                                                         .Arg<ffi::Buffer<ffi::F32>>()
                                                                         .Arg<ffi::Buffer<ffi::F32>>()
                                                                         .Arg<ffi::Buffer<ffi::F32>>()
                                                                         .Arg<ffi::Buffer<ffi::S32>>()
                                                                         .Ret<ffi::Buffer<ffi::F32>>()
                                                                         .Attr<float>("scale"));

extern "C" {
void mmjax_prefill_lanes(int on) { g_prefill_lanes = on; }
// benchmark A/B only: decode attention's software prefetch on (1) or off (0)
void mmjax_attention_prefetch(int on) { g_attn_prefetch = on; }
}
