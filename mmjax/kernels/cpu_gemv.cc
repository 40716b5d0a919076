// CPU matmuls y[M, N] = x[M, K] @ W[K, N] (mmjax/kernels/cpu_gemv.py builds and registers this
// file through the XLA FFI): few rows (M <= 16) of a weight stored [K, N], read as stored at
// memory bandwidth, and any M over a weight packed at load into 64-column panels.
//
//   mmjax_gemv_f32:  x f32 [M, K], W f32 [K, N] -> f32 [M, N], the f32 dot up to summation order.
//   mmjax_gemv_bf16: x bf16 [M, K], W bf16 [K, N] -> f32 [M, N]. Products of two bf16 are exact
//     in f32, so the result is the f32 dot up to summation order.
//   mmjax_gemv_s8:   x int8 [M, G * Kg], W int8 [G * Kg, N] -> int32 [M, G, N]: one exact
//     integer dot per group of Kg weight rows (s8 x s8 -> s32, wrapping like XLA's s32 dot).
//   mmjax_matmul_f32p, mmjax_matmul_bf16p, mmjax_qmatmul_s8p: any M, over a weight packed at load
//     into 64-column panels (f32, bf16; int8 with the whole W8A8 product): see their sections
//     below. Their last operand, rows (s32 scalar), is how many leading rows of x hold data:
//     only those are multiplied, the later rows of y are zeros (LeadingRows).
//
// Layout of the work: the K weight rows are split into contiguous blocks, one per thread (the
// caller and tasks on XLA's intra-op thread pool), whose partial sums are added at the end (see
// `Tile`). A thread's block is done in chunks of C columns whose f32 / s32 accumulators (M x C,
// up to 128 KiB) stay in cache. A chunk is swept by blocks of a few weight rows (8 f32 / 8 bf16
// / 12 int8 rows for up to 4 activation rows: few concurrent streams for the prefetchers; more
// for more activation rows); within a block, one column group (32 f32 / 32 bf16 / 64 int8
// columns) at a time keeps the accumulators of up to 8 (f32, bf16) / 4 (int8) activation rows in
// registers across the block's rows, more rows taking more passes over the same (cached) weight
// lines.
//   bf16: two rows' 32 columns are interleaved into (row k, row k+1) pairs; one AVX512-BF16
//     vdpbf16ps per activation row adds both products (exact in f32) per column.
//   int8: four rows' 64 columns are interleaved into quads; one AVX512-VNNI vpdpbusd per
//     activation row adds four products per column into int32. vpdpbusd multiplies unsigned by
//     signed bytes: the weight is made unsigned (w + 128, the sign bit flipped) and the
//     activation is the signed operand; the 128 * sum(x) this adds is taken off at the store.
//   The interleave permutes columns inside 128-bit lanes; accumulators are kept in that order
//   and put back in order once per chunk.
// CPUs with AVX2 + FMA but not those instructions take the packed kernels' AVX2 section below
// (16-column f32 / bf16 panels; int8 exact as on AVX-512); the plain C++ loops (same results:
// exact for int8, up to summation order for f32 / bf16) run only in the tests, which compare
// every path the CPU has (mmjax/kernels/cpu_library.py calls no kernel without a SIMD path).
#include <atomic>
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include <memory>
#include <thread>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_amx.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;
using mmjax_cpu::HasAvx512;
using mmjax_cpu::ParallelFor;

namespace {

constexpr int kMaxRows = 16;               // M handled per call (cpu_gemv.MAX_ROWS)
constexpr int kAccBytes = 128 * 1024;      // accumulator budget per chunk (in L2)
constexpr int64_t kKBlockRows = 128;       // the packed f32 / bf16 kernels' step blocks up to this many rows

// Tuning (picked on the 2-core box, [1..16, 1024..2048] x [.., 8192..32000]; mmjax_gemv_tune
// sets them for benchmark sweeps): the widest chunk in columns; rows per block in bf16 pairs /
// int8 quads (0: by M: one row streams best with few concurrent rows, more rows are bound by the
// dot instructions and gain from fewer accumulator loads / stores); threads (0: XLA's pool's);
// column ranges per thread; the narrowest range in bytes of a weight row.
int g_max_cols = 16384, g_block_pairs = 0, g_block_quads = 0, g_threads = 0, g_parts_per_thread = 2,
    g_min_part_bytes = 4096, g_f32_prefetch = 32, g_bf16_prefetch = 64, g_packed_prefetch = 4096, g_panel_mode = 1,
    g_kblock_steps = 64, g_kblock_ahead = 32768;

// Part i of `parts` equal shares of `lines` 64-byte lines from pf (what several passes over one
// block prefetch between them): its first line and its count (0 past the end).
struct Lines {
  const char* pf;
  int64_t n;
};
inline Lines ShareOf(const char* pf, int64_t lines, int64_t parts, int64_t i) {
  const int64_t share = (lines + parts - 1) / parts;
  return {pf + 64 * i * share, std::max<int64_t>(0, std::min(share, lines - i * share))};
}

int BlockPairs(int M) { return g_block_pairs ? g_block_pairs : M <= 4 ? 4 : M <= 8 ? 8 : 16; }
// int8 quads re-swept in the ninth session (a chain through 8 layers of the bench model's int8
// weights, 2-core Zen 4, interleaved): 4 quads beat 3 by 10-15% at 1, 2 and 4 rows (1 row: 28.6
// vs 24.9 GB/s best; 5 and 8 quads were slower), 16 beat 6 at 8 rows (21.1 vs 18.4) and 8 at
// 16 rows (13.9 vs 12.6). The int32 sums are exact, so the block size never changes a result.
int BlockQuads(int M) { return g_block_quads ? g_block_quads : M <= 4 ? 4 : 16; }


// ---------------------------------------------------------------------------------------------
// Plain C++ (any CPU)

float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void GenericBf16(const uint16_t* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m) {
    float* yr = y + m * N;
    for (int64_t n = n0; n < n1; ++n) yr[n] = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = Bf16ToF32(x[m * K + k]);
      const uint16_t* wr = w + k * N;
      for (int64_t n = n0; n < n1; ++n) yr[n] += xv * Bf16ToF32(wr[n]);
    }
  }
}

void GenericF32(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m) {
    float* yr = y + m * N;
    for (int64_t n = n0; n < n1; ++n) yr[n] = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[m * K + k];
      const float* wr = w + k * N;
      for (int64_t n = n0; n < n1; ++n) yr[n] += xv * wr[n];
    }
  }
}

void GenericS8(const int8_t* x, const int8_t* w, int32_t* y, int64_t M, int64_t G, int64_t Kg, int64_t N,
               int64_t n0, int64_t n1) {
  const int64_t K = G * Kg;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      int32_t* yr = y + (m * G + g) * N;
      for (int64_t n = n0; n < n1; ++n) {
        uint32_t acc = 0;   // unsigned: wraps like the s32 dot instead of overflowing
        for (int64_t k = g * Kg; k < (g + 1) * Kg; ++k)
          acc += static_cast<uint32_t>(static_cast<int32_t>(x[m * K + k]) * static_cast<int32_t>(w[k * N + n]));
        yr[n] = static_cast<int32_t>(acc);
      }
    }
  }
}

// panels [pa, pb) of the packed f32 / bf16 product (layout: PackedRange; PW columns a panel), each column one
// sequential sum; the R values of a step: f32 one value, bf16 a pair word's low then high half
inline float Part(float x, int) { return x; }
inline float Part(uint32_t x, int r) { return Bf16ToF32(static_cast<uint16_t>(x >> (16 * r))); }
inline float Part(float w) { return w; }
inline float Part(uint16_t w) { return Bf16ToF32(w); }
template <typename X, typename W>
void GenericPacked(const X* x, const W* w, float* y, int64_t M, int64_t Kp, int64_t N, int64_t PW, int64_t pa,
                   int64_t pb) {
  constexpr int R = sizeof(X) / sizeof(W);
  for (int64_t p = pa; p < pb; ++p) {
    const W* panel = w + p * Kp * PW * R;
    const int64_t cols = std::min<int64_t>(PW, N - PW * p);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < cols; ++j) {
        float s = 0.f;
        for (int64_t k = 0; k < Kp; ++k)
          for (int r = 0; r < R; ++r) s += Part(x[m * Kp + k], r) * Part(panel[(k * PW + j) * R + r]);
        y[m * N + PW * p + j] = s;
      }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512

#if defined(__x86_64__)
#define MMJAX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))

inline __mmask64 Mask64(int64_t cols) { return cols >= 64 ? ~__mmask64(0) : (__mmask64(1) << cols) - 1; }
inline __mmask32 Mask32(int64_t cols) { return cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1; }
inline __mmask16 Mask16(int64_t cols) {
  return cols >= 16 ? __mmask16(0xFFFF) : cols <= 0 ? __mmask16(0) : __mmask16((1u << cols) - 1);
}

// bf16: one column group = 32 columns, two rows per step. The rows' 32 bf16 are interleaved into
// (row k, row k+1) pairs: lo = columns 8j..8j+3 of each 128-bit lane j, hi = 8j+4..8j+7; one
// vdpbf16ps per activation row and half adds both products. Accumulators: [m][lo 16 | hi 16].
// From 5 activation rows on, both rows' next column group is prefetched (g_bf16_prefetch = 64
// elements, one 128-byte line ahead): the bench model's 16 layers + LM head as one chain
// (eleventh session, interleaved) took 26.1 -> 19.6 ms at 8 rows and 35.5 -> 23.1 at 16.
template <int MG>
MMJAX_AVX512 void Bf16Group(const uint32_t* xw, int64_t P, int64_t p0, int64_t p1, const uint16_t* w, int64_t N,
                            int64_t K, int64_t c, __mmask32 mask, float* acc, bool first) {
  __m512 a[MG][2];
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
    a[m][0] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + 32 * m);
    a[m][1] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + 32 * m + 16);
  }
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* r0 = w + 2 * p * N + c;
    const __mmask32 m1 = 2 * p + 1 < K ? mask : 0;
    if (g_bf16_prefetch && MG > 4) {
      _mm_prefetch(reinterpret_cast<const char*>(r0 + g_bf16_prefetch), _MM_HINT_T0);
      if (m1) _mm_prefetch(reinterpret_cast<const char*>(r0 + N + g_bf16_prefetch), _MM_HINT_T0);
    }
    const __m512i r = _mm512_maskz_loadu_epi16(mask, r0), s = _mm512_maskz_loadu_epi16(m1, r0 + N);
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(r, s), hi = (__m512bh)_mm512_unpackhi_epi16(r, s);
    _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xw[m * P + p]));
      a[m][0] = _mm512_dpbf16_ps(a[m][0], lo, xb);
      a[m][1] = _mm512_dpbf16_ps(a[m][1], hi, xb);
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
    _mm512_store_ps(acc + 32 * m, a[m][0]);
    _mm512_store_ps(acc + 32 * m + 16, a[m][1]);
  }
}

// acc of one bf16 column group (M rows) -> out[m * ldo + c .. + cols)
MMJAX_AVX512 void Bf16Store(const float* acc, int M, float* out, int64_t ldo, int64_t c, int64_t cols) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int m = 0; m < M; ++m) {
    const __m512 lo = _mm512_load_ps(acc + 32 * m), hi = _mm512_load_ps(acc + 32 * m + 16);
    _mm512_mask_storeu_ps(out + m * ldo + c, Mask16(cols), _mm512_permutex2var_ps(lo, i0, hi));
    _mm512_mask_storeu_ps(out + m * ldo + c + 16, Mask16(cols - 16), _mm512_permutex2var_ps(lo, i1, hi));
  }
}

// f32: one column group = 32 columns (two vectors), one weight row per step, one FMA per
// activation row and vector. Accumulators: [m][32]. From 5 activation rows on, each weight row's
// next column group (g_f32_prefetch = 32 floats, one 128-byte line ahead) is prefetched: a chain
// through the bench model's 16 layers + LM head (eleventh session, interleaved) took 66.7 -> 43.6
// ms at 16 rows, 60.2 -> 41.5 at 12, 36.7 -> 33.5 at 8, level at 6; 2 and 3 lines ahead gained
// less. At 1-4 rows the hardware prefetchers stream better alone (sixth and ninth sessions).
template <int MG>
MMJAX_AVX512 void F32Group(const float* x, int64_t K, int64_t k0, int64_t k1, const float* w, int64_t N,
                           int64_t c, __mmask16 mask0, __mmask16 mask1, float* acc, bool first) {
  __m512 a[MG][2];
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
    a[m][0] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + 32 * m);
    a[m][1] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + 32 * m + 16);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* r = w + k * N + c;
    if (g_f32_prefetch && MG > 4) {
      _mm_prefetch(reinterpret_cast<const char*>(r + g_f32_prefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(r + g_f32_prefetch + 16), _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_maskz_loadu_ps(mask0, r), w1 = _mm512_maskz_loadu_ps(mask1, r + 16);
    _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * K + k]);
      a[m][0] = _mm512_fmadd_ps(xb, w0, a[m][0]);
      a[m][1] = _mm512_fmadd_ps(xb, w1, a[m][1]);
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
    _mm512_store_ps(acc + 32 * m, a[m][0]);
    _mm512_store_ps(acc + 32 * m + 16, a[m][1]);
  }
}

// columns [n0, n1) of the sums over weight rows [ka, kb) of y = x @ W (f32): as Bf16Range, one
// weight row per step
MMJAX_AVX512 void F32Range(const float* x, int M, int64_t K, int64_t N, const float* w, float* y,
                           int64_t n0, int64_t n1, int64_t ka, int64_t kb) {
  alignas(64) static thread_local float acc[kAccBytes / 4];
  const int64_t C = std::min<int64_t>(kAccBytes / (4 * 32 * M) * 32, g_max_cols);
  const int64_t rows = 2 * BlockPairs(M);
  for (int64_t c0 = n0; c0 < n1; c0 += C) {
    const int64_t cols = std::min(C, n1 - c0);
    for (int64_t k0 = ka; k0 < kb; k0 += rows) {
      const int64_t k1 = std::min(kb, k0 + rows);
      for (int64_t c = 0; c < cols; c += 32) {
        float* ag = acc + c * M;
        const __mmask16 mask0 = Mask16(cols - c), mask1 = Mask16(cols - c - 16);
        for (int m = 0; m < M; m += 8) {
          const float* xm = x + m * K;
          float* am = ag + 32 * m;
          switch (std::min(8, M - m)) {
            case 1: F32Group<1>(xm, K, k0, k1, w, N, c0 + c, mask0, mask1, am, k0 == ka); break;
            case 2: F32Group<2>(xm, K, k0, k1, w, N, c0 + c, mask0, mask1, am, k0 == ka); break;
            case 3: F32Group<3>(xm, K, k0, k1, w, N, c0 + c, mask0, mask1, am, k0 == ka); break;
            case 4: F32Group<4>(xm, K, k0, k1, w, N, c0 + c, mask0, mask1, am, k0 == ka); break;
            case 5: F32Group<5>(xm, K, k0, k1, w, N, c0 + c, mask0, mask1, am, k0 == ka); break;
            case 6: F32Group<6>(xm, K, k0, k1, w, N, c0 + c, mask0, mask1, am, k0 == ka); break;
            case 7: F32Group<7>(xm, K, k0, k1, w, N, c0 + c, mask0, mask1, am, k0 == ka); break;
            default: F32Group<8>(xm, K, k0, k1, w, N, c0 + c, mask0, mask1, am, k0 == ka); break;
          }
        }
      }
    }
    for (int64_t c = 0; c < cols; c += 32)
      for (int m = 0; m < M; ++m) {
        _mm512_mask_storeu_ps(y + m * N + c0 + c, Mask16(cols - c), _mm512_load_ps(acc + c * M + 32 * m));
        _mm512_mask_storeu_ps(y + m * N + c0 + c + 16, Mask16(cols - c - 16), _mm512_load_ps(acc + c * M + 32 * m + 16));
      }
  }
}

// int8: one column group = 64 columns, four rows per step (AVX512-VNNI vpdpbusd: u8 x s8, four
// products per int32 lane). The weight is made unsigned (w + 128, an xor of the sign bit) and the
// activation is the signed operand; the 128 * sum(x) this adds is taken off at the store. The four
// rows are interleaved into quads: q[i] holds columns 16j + 4i .. 16j + 4i + 3 of lane j.
// Accumulators: [m][q0 | q1 | q2 | q3], 16 int32 each. Software prefetch only where more than one
// register pass reads the block (M > 4): at one to four rows the hardware prefetchers stream
// better alone (one thread over the bench model's int8 weights: 12.0 -> 15.1 GB/s without it),
// at 8 rows the prefetch is worth 20% of the matmul time. (The f32 and bf16 groups prefetch
// one line ahead from 5 rows on, measured in the eleventh session; at 1 row neither gains.)
template <int MG>
MMJAX_AVX512 void S8Group(const uint32_t* xw, int64_t Q, int64_t q0, int64_t q1, const int8_t* w, int64_t N,
                          int64_t rows_left0, int64_t c, __mmask64 mask, int32_t* acc, bool first,
                          bool prefetch) {
  __m512i a[MG][4];
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m)
    _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i) a[m][i] = first ? _mm512_setzero_si512() : _mm512_load_si512(acc + 64 * m + 16 * i);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t q = q0; q < q1; ++q) {
    const int8_t* r0 = w + 4 * q * N + c;
    const int64_t left = rows_left0 - 4 * q;      // rows of this weight that exist from row 4q on
    __m512i r[4];
    _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i) {
      const __mmask64 mi = i < left ? mask : 0;
      if (prefetch && mi) _mm_prefetch(reinterpret_cast<const char*>(r0 + i * N + 512), _MM_HINT_T0);   // 8 groups ahead

      r[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mi, r0 + i * N), sign);
    }
    const __m512i t01l = _mm512_unpacklo_epi8(r[0], r[1]), t01h = _mm512_unpackhi_epi8(r[0], r[1]);
    const __m512i t23l = _mm512_unpacklo_epi8(r[2], r[3]), t23h = _mm512_unpackhi_epi8(r[2], r[3]);
    const __m512i v[4] = {_mm512_unpacklo_epi16(t01l, t23l), _mm512_unpackhi_epi16(t01l, t23l),
                          _mm512_unpacklo_epi16(t01h, t23h), _mm512_unpackhi_epi16(t01h, t23h)};
    _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(xw[m * Q + q]));
      _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i) a[m][i] = _mm512_dpbusd_epi32(a[m][i], v[i], xb);
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m)
    _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i) _mm512_store_si512(acc + 64 * m + 16 * i, a[m][i]);
}

// acc of one int8 column group (M rows) minus 128 * xsum[m] -> out[m * ldo + c .. + cols)
MMJAX_AVX512 void S8Store(const int32_t* acc, int M, const int32_t* xsum, int32_t* out, int64_t ldo, int64_t c,
                          int64_t cols) {
  for (int m = 0; m < M; ++m) {
    const __m512i off = _mm512_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(xsum[m]) * 128u));
    __m512i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm512_sub_epi32(_mm512_load_si512(acc + 64 * m + 16 * i), off);
    // 4 x 4 transpose of 128-bit lanes: q[i] lane j = columns 16j + 4i .. + 3
    const __m512i t0 = _mm512_shuffle_i32x4(q[0], q[1], 0x44), t1 = _mm512_shuffle_i32x4(q[2], q[3], 0x44);
    const __m512i t2 = _mm512_shuffle_i32x4(q[0], q[1], 0xEE), t3 = _mm512_shuffle_i32x4(q[2], q[3], 0xEE);
    const __m512i o[4] = {_mm512_shuffle_i32x4(t0, t1, 0x88), _mm512_shuffle_i32x4(t0, t1, 0xDD),
                          _mm512_shuffle_i32x4(t2, t3, 0x88), _mm512_shuffle_i32x4(t2, t3, 0xDD)};
    for (int i = 0; i < 4; ++i) _mm512_mask_storeu_epi32(out + m * ldo + c + 16 * i, Mask16(cols - 16 * i), o[i]);
  }
}

// columns [n0, n1) of the sums over row pairs [pa, pb) of y = x @ W (bf16): chunks of columns,
// row blocks of BlockPairs pairs swept across the chunk, activation rows in register passes of <= 8
MMJAX_AVX512 void Bf16Range(const uint32_t* xw, int M, int64_t K, int64_t N, const uint16_t* w, float* y,
                            int64_t n0, int64_t n1, int64_t pa, int64_t pb) {
  alignas(64) static thread_local float acc[kAccBytes / 4];
  const int64_t P = (K + 1) / 2;
  const int64_t C = std::min<int64_t>(kAccBytes / (4 * 32 * M) * 32, g_max_cols);
  for (int64_t c0 = n0; c0 < n1; c0 += C) {
    const int64_t cols = std::min(C, n1 - c0);
    for (int64_t p0 = pa; p0 < pb; p0 += BlockPairs(M)) {
      const int64_t p1 = std::min(pb, p0 + BlockPairs(M));
      for (int64_t c = 0; c < cols; c += 32) {
        float* ag = acc + c * M;
        const __mmask32 mask = Mask32(cols - c);
        for (int m = 0; m < M; m += 8) {
          const uint32_t* xm = xw + m * P;
          float* am = ag + 32 * m;
          switch (std::min(8, M - m)) {
            case 1: Bf16Group<1>(xm, P, p0, p1, w, N, K, c0 + c, mask, am, p0 == pa); break;
            case 2: Bf16Group<2>(xm, P, p0, p1, w, N, K, c0 + c, mask, am, p0 == pa); break;
            case 3: Bf16Group<3>(xm, P, p0, p1, w, N, K, c0 + c, mask, am, p0 == pa); break;
            case 4: Bf16Group<4>(xm, P, p0, p1, w, N, K, c0 + c, mask, am, p0 == pa); break;
            case 5: Bf16Group<5>(xm, P, p0, p1, w, N, K, c0 + c, mask, am, p0 == pa); break;
            case 6: Bf16Group<6>(xm, P, p0, p1, w, N, K, c0 + c, mask, am, p0 == pa); break;
            case 7: Bf16Group<7>(xm, P, p0, p1, w, N, K, c0 + c, mask, am, p0 == pa); break;
            default: Bf16Group<8>(xm, P, p0, p1, w, N, K, c0 + c, mask, am, p0 == pa); break;
          }
        }
      }
    }
    for (int64_t c = 0; c < cols; c += 32) Bf16Store(acc + c * M, M, y, N, c0 + c, cols - c);
  }
}

// columns [n0, n1) of the per-group int32 dots (int8) over each group's quads [qa, qb): xw holds,
// per row m and group g, Q quads; xsum is the per (row, group) correction (nullptr: none, for a
// partial sum that is added to one which has it)
MMJAX_AVX512 void S8Range(const uint32_t* xw, const int32_t* xsum, int M, int64_t G, int64_t Kg, int64_t N,
                          const int8_t* w, int32_t* y, int64_t n0, int64_t n1, int64_t qa, int64_t qb) {
  alignas(64) static thread_local int32_t acc[kAccBytes / 4];
  const int64_t Q = (Kg + 3) / 4, K = G * Kg;
  const int64_t C = std::min<int64_t>(kAccBytes / (4 * 64 * M) * 64, g_max_cols);
  for (int64_t c0 = n0; c0 < n1; c0 += C) {
    const int64_t cols = std::min(C, n1 - c0);
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* wg = w + g * Kg * N;
      const int64_t rows_left = K - g * Kg;
      for (int64_t q0 = qa; q0 < qb; q0 += BlockQuads(M)) {
        const int64_t q1 = std::min(qb, q0 + BlockQuads(M));
        for (int64_t c = 0; c < cols; c += 64) {
          int32_t* ag = acc + c * M;
          const __mmask64 mask = Mask64(cols - c);
          for (int m = 0; m < M; m += 4) {
            const uint32_t* xm = xw + (m * G + g) * Q;
            int32_t* am = ag + 64 * m;
            switch (std::min(4, M - m)) {
              case 1: S8Group<1>(xm, G * Q, q0, q1, wg, N, rows_left, c0 + c, mask, am, q0 == qa, M > 4); break;
              case 2: S8Group<2>(xm, G * Q, q0, q1, wg, N, rows_left, c0 + c, mask, am, q0 == qa, M > 4); break;
              case 3: S8Group<3>(xm, G * Q, q0, q1, wg, N, rows_left, c0 + c, mask, am, q0 == qa, M > 4); break;
              default: S8Group<4>(xm, G * Q, q0, q1, wg, N, rows_left, c0 + c, mask, am, q0 == qa, M > 4); break;
            }
          }
        }
      }
      int32_t xs[kMaxRows];
      for (int m = 0; m < M; ++m) xs[m] = xsum ? xsum[m * G + g] : 0;
      for (int64_t c = 0; c < cols; c += 64) S8Store(acc + c * M, M, xs, y + g * N, G * N, c0 + c, cols - c);
    }
  }
}

// Packed int8 (mmjax_qmatmul_s8p): the weight re-laid at load as u8 [P, Q, 64, 4]: panel p holds
// columns 64p .. 64p + 63, quad q rows 4q .. 4q + 3, each column's four bytes adjacent, stored
// as w ^ 0x80 (w + 128, unsigned for vpdpbusd). One panel is one contiguous run of 64 * K bytes,
// so a thread streams its panels front to back (no short rows, no interleaving shuffles), and
// the four 64-byte vectors of a quad are the four vpdpbusd operands as they are: lane j of
// vector i is column 16i + j. Rows in register passes of up to 6 (24 accumulators), every pass
// over a 64-quad block of the panel before the next block (S8PRange), so the later passes read it
// from L1. The store rescales in f32 exactly as
// mmjax.quant.qmatmul does: y (+)= (float(acc) * x_scale) * w_scale, groups in order.

// One row group's pass over quads [k0, k1) of a panel, its int32 sums carried in acc [MG][64]
// (L1) between the passes of consecutive quad blocks of one quant group (zero: start from 0);
// the group's last block (last) rescales them into out: y = (float(sum - 128 xsum) * x_scale) *
// w_scale, stored (first: the first quant group) or added. pf: `lines` lines prefetched into
// L2, spread evenly over the pass's quads.
template <int MG>
MMJAX_AVX512 void S8PKBlock(const uint32_t* xw, int64_t ldx, int64_t k0, int64_t k1, const uint8_t* panel,
                            int32_t* acc, bool zero, bool last, const int32_t* xsum, const float* xscale,
                            const float* wscale, float* out, int64_t ldo, int64_t cols, bool first, const char* pf,
                            int64_t lines) {
  __m512i a[MG][4];
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m)
    _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i)
      a[m][i] = zero ? _mm512_setzero_si512() : _mm512_load_si512(acc + 64 * m + 16 * i);
  const uint8_t* r = panel + k0 * 256;
  const int64_t steps = k1 - k0;
  int64_t due = 0;
  for (int64_t q = k0; q < k1; ++q, r += 256) {
    for (due += lines; due >= steps; due -= steps, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    const __m512i w0 = _mm512_loadu_si512(r), w1 = _mm512_loadu_si512(r + 64);
    const __m512i w2 = _mm512_loadu_si512(r + 128), w3 = _mm512_loadu_si512(r + 192);
    _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(xw[m * ldx + q]));
      a[m][0] = _mm512_dpbusd_epi32(a[m][0], w0, xb);
      a[m][1] = _mm512_dpbusd_epi32(a[m][1], w1, xb);
      a[m][2] = _mm512_dpbusd_epi32(a[m][2], w2, xb);
      a[m][3] = _mm512_dpbusd_epi32(a[m][3], w3, xb);
    }
  }
  if (!last) {
    _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m)
      _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i) _mm512_store_si512(acc + 64 * m + 16 * i, a[m][i]);
    return;
  }
  __m512 ws[4];
  _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i) ws[i] = _mm512_maskz_loadu_ps(Mask16(cols - 16 * i), wscale + 16 * i);
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
    const __m512i off = _mm512_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(xsum[m]) * 128u));
    const __m512 xs = _mm512_set1_ps(xscale[m]);
    _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i) {
      const __mmask16 k = Mask16(cols - 16 * i);
      float* o = out + m * ldo + 16 * i;
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[m][i], off)), xs), ws[i]);
      if (!first) v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, o), v);
      _mm512_mask_storeu_ps(o, k, v);
    }
  }
}

// panels [pa, pb) of y[M, N] (int8 packed): xw [M, G * Qg] quads of the quantized x, xsum and
// xscale [M, G], wscale [G, N]
MMJAX_AVX512 void S8PRange(const uint32_t* xw, const int32_t* xsum, const float* xscale, const float* wscale,
                           int64_t M, int64_t G, int64_t Qg, int64_t N, const uint8_t* w, float* y, int64_t pa,
                           int64_t pb) {
  // Quad blocks of a panel's quant group with every row group over each in turn, the int32 sums
  // carried in L1 between blocks (exact: any blocking gives the same results) and a share of the
  // lines g_kblock_ahead bytes on prefetched by every pass, as PackedRange. Four products an
  // instruction made the panel's L2 reads, not only memory, the limit of whole-group passes
  // without prefetch (g_kblock_steps 0: a block is the whole group, nothing prefetched). The
  // bench model's 16 layers + LM head as one int8 chain (twenty-first session, in-process,
  // interleaved; the whole-group loop this replaced -> blocks): 1 / 2 / 4 / 6 / 8 / 16 / 32 / 64
  // / 128 / 240 / 512 / 1024 rows 9.7 / 10.4 / 12.3 / 14.9 / 16.4 / 23.0-23.8 / 34.7 / 55.8 /
  // 107.8 / 201 / 402 / 790 -> 9.4 / 8.9 / 9.5 / 10.2 / 11.4 / 13.3-14.3 / 18.2 / 28.3 / 56.5 /
  // 120 / 257 / 525 ms.
  const int64_t Q = G * Qg, groups = (M + 5) / 6, kb = g_kblock_steps ? g_kblock_steps : Qg;
  thread_local std::vector<int32_t> sums;
  sums.resize(groups * 6 * 64 + 16);
  int32_t* acc = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(sums.data()) + 63) & ~uintptr_t(63));
  int32_t xsb[6];          // a row group's correction and scale in quant group g: [(m + i) * G + g]
  float xsc[6];
  for (int64_t p = pa; p < pb; ++p) {
    const uint8_t* panel = w + p * Q * 256;
    const int64_t cols = std::min<int64_t>(64, N - 64 * p);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t k0 = g * Qg; k0 < (g + 1) * Qg; k0 += kb) {
        const int64_t k1 = std::min((g + 1) * Qg, k0 + kb), lines = g_kblock_steps ? 4 * (k1 - k0) : 0;
        const char* pf = reinterpret_cast<const char*>(panel + k0 * 256) + g_kblock_ahead;
        const bool zero = k0 == g * Qg, last = k1 == (g + 1) * Qg;
        for (int64_t rg = 0; rg < groups; ++rg) {
          const int64_t m = 6 * rg;
          const int mg = static_cast<int>(std::min<int64_t>(6, M - m));
          if (last)
            for (int i = 0; i < mg; ++i) xsb[i] = xsum[(m + i) * G + g], xsc[i] = xscale[(m + i) * G + g];
          const uint32_t* xm = xw + m * Q;
          const float* ws = wscale + g * N + 64 * p;
          float* om = y + m * N + 64 * p;
          int32_t* a = acc + 64 * m;
          const Lines l = ShareOf(pf, lines, groups, rg);
          switch (mg) {
            case 1: S8PKBlock<1>(xm, Q, k0, k1, panel, a, zero, last, xsb, xsc, ws, om, N, cols, g == 0, l.pf, l.n); break;
            case 2: S8PKBlock<2>(xm, Q, k0, k1, panel, a, zero, last, xsb, xsc, ws, om, N, cols, g == 0, l.pf, l.n); break;
            case 3: S8PKBlock<3>(xm, Q, k0, k1, panel, a, zero, last, xsb, xsc, ws, om, N, cols, g == 0, l.pf, l.n); break;
            case 4: S8PKBlock<4>(xm, Q, k0, k1, panel, a, zero, last, xsb, xsc, ws, om, N, cols, g == 0, l.pf, l.n); break;
            case 5: S8PKBlock<5>(xm, Q, k0, k1, panel, a, zero, last, xsb, xsc, ws, om, N, cols, g == 0, l.pf, l.n); break;
            default: S8PKBlock<6>(xm, Q, k0, k1, panel, a, zero, last, xsb, xsc, ws, om, N, cols, g == 0, l.pf, l.n); break;
          }
        }
      }
  }
}

// Packed f32 / bf16 (mmjax_matmul_f32p / mmjax_matmul_bf16p): the weight re-laid at load as
// [P, Kp, 64, R] (R = 1 for f32, 2 for bf16; Kp = ceil(K / R)): panel p holds columns 64p ..
// 64p + 63, step k rows Rk .. Rk + R - 1, each column's R values adjacent. A step of a panel is
// 256 bytes, four vectors, each the FMA's / vdpbf16ps's weight operand as it lies (lane j of
// vector i: column 16i + j); x's row-major values are the other operand (bf16: its (2k, 2k + 1)
// pair as one 32-bit word). A panel is one contiguous run: a thread streams its panels front to
// back (no short rows, no interleaving shuffles). Rows in register passes of up to 6 (24
// accumulators); 7 to kKBlockRows rows all over each 64-step block of a panel in turn, 129 to 384
// rows all over each panel in turn (PackedRange), more rows in blocks of kPackedRows whose
// activations stay in L2 while each panel is read once per block. Against
// XLA's dots on the 2-core Zen 4 (twelfth session, 256 rows of the bench model's layers): f32
// 213-223 vs 197-201 GFLOP/s, bf16 335-390 vs 297-342; one row streams as fast as the row-major
// kernels, 8 rows 1.25-1.3x faster.
// From two rows on (past 6 rows: where the step blocks do not run), a block's first pass (the one
// that reads the panel from memory) prefetches
// g_packed_prefetch = 4096 bytes ahead into L2: its FMAs keep the core from running far enough
// ahead for the hardware prefetchers alone, so compute and the memory stream add up instead of
// overlapping. On a 2-core Sapphire-Rapids-class VM (eighteenth session, interleaved, weights
// from memory): 1024 x 5632 at 4 / 8 / 16 rows 19.5 / 14.8 / 12.4 -> 23.5 / 19.4 / 15.4 GB/s,
// bf16 at 8 rows 11.0 -> 14.4, prefill shapes (240 rows) +5%; 1024 to 16384 bytes ahead gained
// alike from 4096 on, a prefetch of the next panel spread over every pass gained less, and one
// row streams best without it (25.6 vs 24.4 GB/s).
constexpr int64_t kPackedRows = 192;

MMJAX_AVX512 inline void Load4(const float* r, __m512* w) {
  for (int i = 0; i < 4; ++i) w[i] = _mm512_loadu_ps(r + 16 * i);
}
MMJAX_AVX512 inline void Load4(const uint16_t* r, __m512* w) {
  for (int i = 0; i < 4; ++i) w[i] = _mm512_castsi512_ps(_mm512_loadu_si512(r + 32 * i));
}
MMJAX_AVX512 inline __m512 Madd(__m512 a, __m512 w, float x) { return _mm512_fmadd_ps(_mm512_set1_ps(x), w, a); }
MMJAX_AVX512 inline __m512 Madd(__m512 a, __m512 w, uint32_t x) {
  return _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)_mm512_set1_epi32(static_cast<int>(x)));
}

// One row group's pass over steps [k0, k1) of a panel, its sums carried in acc [MG][64] (L1)
// between the passes of consecutive step blocks (zero: start from 0); with out, the sums are
// written there instead (the panel's last block). pf: where to prefetch into L2, `lines` 64-byte
// lines spread evenly over the pass's steps (0: none; 4 per step: the 256 bytes of a step).
template <int MG, typename X, typename W>
MMJAX_AVX512 void PackedKBlock(const X* x, int64_t Kp, int64_t k0, int64_t k1, const W* panel, float* acc, bool zero,
                               float* out, int64_t ldo, int64_t cols, const char* pf, int64_t lines) {
  __m512 a[MG][4];
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m)
    _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i)
      a[m][i] = zero ? _mm512_setzero_ps() : _mm512_load_ps(acc + 64 * m + 16 * i);
  const W* r = panel + k0 * (256 / sizeof(W));
  const int64_t steps = k1 - k0;
  int64_t due = 0;
  for (int64_t k = k0; k < k1; ++k, r += 256 / sizeof(W)) {
    for (due += lines; due >= steps; due -= steps, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    __m512 w[4];
    Load4(r, w);
    _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
      const X xv = x[m * Kp + k];
      _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i) a[m][i] = Madd(a[m][i], w[i], xv);
    }
  }
  if (out) {
    _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m)
      _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i)
        _mm512_mask_storeu_ps(out + m * ldo + 16 * i, Mask16(cols - 16 * i), a[m][i]);
  } else {
    _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m)
      _Pragma("GCC unroll 16") for (int i = 0; i < 4; ++i) _mm512_store_ps(acc + 64 * m + 16 * i, a[m][i]);
  }
}

// one row group over all of a panel, written to out
template <int MG, typename X, typename W>
MMJAX_AVX512 void PackedBlock(const X* x, int64_t Kp, const W* panel, float* out, int64_t ldo, int64_t cols,
                              const char* pf, int64_t lines) {
  PackedKBlock<MG>(x, Kp, 0, Kp, panel, nullptr, true, out, ldo, cols, pf, lines);
}

// panels [pa, pb) of y[M, N] = x @ W (packed); x [M, Kp] f32 values / bf16 pair words
template <typename X, typename W>
MMJAX_AVX512 void PackedRange(const X* x, int64_t M, int64_t Kp, int64_t N, const W* w, float* y, int64_t pa,
                              int64_t pb) {
  constexpr int64_t kStep = 256 / sizeof(W);           // a panel step (256 bytes), in W
  const int64_t panel_lines = 4 * Kp;
  const auto block = [&](int64_t m, int64_t rows, const W* panel, int64_t p, const char* pf, int64_t lines) {
    const X* xm = x + m * Kp;
    float* om = y + m * N + 64 * p;
    const int64_t cols = std::min<int64_t>(64, N - 64 * p);
    switch (rows) {
      case 1: return PackedBlock<1>(xm, Kp, panel, om, N, cols, pf, lines);
      case 2: return PackedBlock<2>(xm, Kp, panel, om, N, cols, pf, lines);
      case 3: return PackedBlock<3>(xm, Kp, panel, om, N, cols, pf, lines);
      case 4: return PackedBlock<4>(xm, Kp, panel, om, N, cols, pf, lines);
      case 5: return PackedBlock<5>(xm, Kp, panel, om, N, cols, pf, lines);
      default: return PackedBlock<6>(xm, Kp, panel, om, N, cols, pf, lines);
    }
  };
  const int64_t groups = (M + 5) / 6;
  if (g_kblock_steps && M > 6 && M <= kKBlockRows) {
    // 7 to 128 rows (decode, short prefill chunks): blocks of g_kblock_steps panel steps (16 KiB),
    // every row group over a block in turn, so the later groups read it from L1, while all of them
    // prefetch into L2, in equal shares, the lines g_kblock_ahead bytes on. The sums are carried
    // in L1 between blocks: each output is the same FMA chain over k, the same bits. The whole
    // panel's first pass reading memory and the later passes only L2 (the sweep below) took the
    // memory time plus the FMA time; here every pass streams a share while it computes. 2-core
    // SPR-class VM (twenty-first session, in-process, interleaved): the bench model's 16 layers
    // + LM head as one chain, f32, 8 / 12 / 16 / 24 / 32 / 64 / 128 rows 42.6 / 47.7 / 53.3 /
    // 60.1 / 68.4 / 101.8 / 190.3 -> 36.6-37.1 / 37.3-38.1 / 41.0-41.3 / 47.3-48.9 / 55.3-56.0 /
    // 91.5 / 175.1 ms, bf16 16 rows 47.0 -> 36.6; the engine's 16-row decode step 65.0 -> 53.3
    // ms at kv_len 128. At 1-6 rows (one pass) level; from 192 rows level or slower (240: 378 vs
    // 377 ms, 256: 405 vs 421, 384: 597 vs 640: the sums no longer stay in L1).
    alignas(64) float acc[(kKBlockRows + 5) / 6 * 6 * 64];
    const int64_t kb = g_kblock_steps;
    for (int64_t p = pa; p < pb; ++p) {
      const W* panel = w + p * Kp * kStep;
      const int64_t cols = std::min<int64_t>(64, N - 64 * p);
      for (int64_t k0 = 0; k0 < Kp; k0 += kb) {
        const int64_t k1 = std::min(Kp, k0 + kb);
        const char* pf = reinterpret_cast<const char*>(panel + k0 * kStep) + g_kblock_ahead;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t m = 6 * g, rows = std::min<int64_t>(6, M - m);
          const X* xm = x + m * Kp;
          float* a = acc + 64 * m;
          float* om = k1 == Kp ? y + m * N + 64 * p : nullptr;
          const Lines l = ShareOf(pf, 4 * (k1 - k0), groups, g);
          switch (rows) {
            case 1: PackedKBlock<1>(xm, Kp, k0, k1, panel, a, k0 == 0, om, N, cols, l.pf, l.n); break;
            case 2: PackedKBlock<2>(xm, Kp, k0, k1, panel, a, k0 == 0, om, N, cols, l.pf, l.n); break;
            case 3: PackedKBlock<3>(xm, Kp, k0, k1, panel, a, k0 == 0, om, N, cols, l.pf, l.n); break;
            case 4: PackedKBlock<4>(xm, Kp, k0, k1, panel, a, k0 == 0, om, N, cols, l.pf, l.n); break;
            case 5: PackedKBlock<5>(xm, Kp, k0, k1, panel, a, k0 == 0, om, N, cols, l.pf, l.n); break;
            default: PackedKBlock<6>(xm, Kp, k0, k1, panel, a, k0 == 0, om, N, cols, l.pf, l.n); break;
          }
        }
      }
    }
    return;
  }
  if (g_panel_mode && groups >= 4 && M <= 2 * kPackedRows) {
    // 24 to 384 rows (prefill chunks): each panel once from memory, all rows over it from L2,
    // while the row groups prefetch the next panel into L2 in equal shares, so no group waits on
    // memory (but the first group on a thread's first panel). On the 2-core SPR-class VM
    // (eighteenth session, interleaved, weights from memory): 240 x 1024 x 5632 267 -> 282
    // GFLOP/s, 240 x 2816 x 1024 257 -> 269, 32 x 1024 x 5632 163 -> 197; at 514 rows and more
    // x no longer stays in L2 over a panel and 192-row blocks that re-read each panel are faster
    // (514 x 1024 x 3072: 282 vs 271; 2056 x 1024 x 4096: 274 vs 266). (The hot-weight rate, the
    // weight in L3: 312-344 GFLOP/s at 240 rows.)
    for (int64_t p = pa; p < pb; ++p) {
      const W* panel = w + p * Kp * kStep;
      const char* next = reinterpret_cast<const char*>(panel + Kp * kStep);
      for (int64_t g = 0; g < groups; ++g) {
        const Lines l = ShareOf(next, p + 1 < pb ? panel_lines : 0, groups, g);
        block(6 * g, std::min<int64_t>(6, M - 6 * g), panel, p, l.pf, l.n);
      }
    }
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kPackedRows) {
    const int64_t m1 = std::min<int64_t>(M, m0 + kPackedRows);
    for (int64_t p = pa; p < pb; ++p) {
      const W* panel = w + p * Kp * kStep;
      for (int64_t m = m0; m < m1; m += 6) {
        const bool first = m == m0 && M > 1 && g_packed_prefetch;
        block(m, std::min<int64_t>(6, m1 - m), panel, p,
              first ? reinterpret_cast<const char*>(panel) + g_packed_prefetch : nullptr, first ? panel_lines : 0);
      }
    }
  }
}

// x [K] f32 -> int8 per group of Kg as mmjax.quant._quantize_acts: s = amax * f32(1 / 127) (1
// where amax is 0), q = clip(round_half_even(x * (1 / s)), -127, 127); xsum = the group's sum of q
constexpr float kInv127 = static_cast<float>(1.0 / 127.0);
MMJAX_AVX512 void QuantizeRowAvx512(const float* x, int64_t G, int64_t Kg, int8_t* q, float* scale, int32_t* xsum) {
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = x + g * Kg;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < Kg; k += 16)
      amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(Mask16(Kg - k), xg + k)));
    const float a = _mm512_reduce_max_ps(amax);
    const float s = a > 0.f ? a * kInv127 : 1.f;
    const __m512 rv = _mm512_set1_ps(1.f / s);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < Kg; k += 16) {
      const __mmask16 m = Mask16(Kg - k);
      __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xg + k), rv),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i iv = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi));
      sum = _mm512_add_epi32(sum, iv);
      _mm_mask_storeu_epi8(q + g * Kg + k, m, _mm512_cvtepi32_epi8(iv));
    }
    scale[g] = s;
    xsum[g] = _mm512_reduce_add_epi32(sum);
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA (CPUs without AVX-512: Haswell to Alder Lake, Zen 1-3): the packed kernels only (a
// CPU runner's weights are all packed; the row-major kernels stay AVX-512-only, XLA's dots
// elsewhere). The same panels as the AVX-512 path, for 16 ymm registers instead of 32 zmm.
//
// f32 / bf16: the weight packed in panels of PW = 16 columns (`pack_panels`' width where AVX-512
// is not there): a panel step is one 64-byte line, two vectors, so every register tile reads its
// panel as one contiguous stream. (On the 64-column AVX-512 panels a tile of 16 columns read a
// quarter of each 256-byte step: 4 KiB-aliased strided lines, half of XLA's GEMM rate at 240
// rows.) A tile is MG rows x CW vectors of 8 columns (MG * CW <= 12 accumulators): 6 x 2 for f32
// (the classic AVX2 GEMM tile) and 4 x 2 for bf16 (each of its weight vectors is two, the pair
// word's rows widened), fewer rows at the end; one and two rows take 8 and 4 vectors across
// adjacent panels; 64-column panels (packed for AVX-512) take tiles of 8, 4 or 2 vectors of one
// panel. A tile runs over all of K, so every output is one sequential FMA chain over k in
// order: the same bits whatever M or the tile (a row decodes the same tokens alone and in a
// batch). x is read as f32 rows (bf16 widened once per call); the product of two bf16 is exact
// in f32, the even row's FMA comes before the odd row's.
#define MMJAX_AVX2 __attribute__((target("avx2,fma")))

// vectors (of 8 columns) an AVX2 register tile spans for a group of `rows` rows: one row 8, two
// rows 4 (8 FMA chains either way, the weight read as whole 64-byte lines), more rows 2
constexpr int Avx2TileVectors(int64_t rows) { return rows == 1 ? 8 : rows == 2 ? 4 : 2; }

// One register tile: MG rows x CW vectors over `steps` panel steps, VP vectors a panel (CW / VP
// adjacent panels, pstride units apart: one or two rows on 16-column panels take 4 or 2 panels
// at a time, for 8 independent FMA chains); the sums written to c (row m at m * ldc, the next
// panel astride floats on).
template <int MG, int CW, int VP, bool kBf16>
MMJAX_AVX2 void PackedTile2(const float* x, int64_t ldx, const uint32_t* r, int64_t PW, int64_t pstride,
                            int64_t steps, float* c, int64_t ldc, int64_t astride, bool add, const char* pf,
                            int64_t lines) {
  const auto wat = [&](int i) { return (i / VP) * pstride + 8 * (i % VP); };
  const auto cat = [&](int m, int i) { return (i / VP) * astride + m * ldc + 8 * (i % VP); };
  __m256 a[MG][CW];
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m)
    _Pragma("GCC unroll 16") for (int i = 0; i < CW; ++i) a[m][i] = add ? _mm256_loadu_ps(c + cat(m, i)) : _mm256_setzero_ps();
  int64_t due = 0;
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  // the step's weight vectors first, then one broadcast of x per row (loading a weight vector per
  // (vector, row) pair made the compiler broadcast each x CW times: 40 -> 70 GFLOP/s on one core)
  for (int64_t k = 0; k < steps; ++k, r += PW) {
    for (due += lines; due >= steps; due -= steps, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    if constexpr (kBf16) {
      __m256 we[CW], wo[CW];
      _Pragma("GCC unroll 16") for (int i = 0; i < CW; ++i) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + wat(i)));
        we[i] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        wo[i] = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
      }
      _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
        const __m256 xe = _mm256_broadcast_ss(x + m * ldx + 2 * k), xo = _mm256_broadcast_ss(x + m * ldx + 2 * k + 1);
        _Pragma("GCC unroll 16") for (int i = 0; i < CW; ++i) {
          a[m][i] = _mm256_fmadd_ps(xe, we[i], a[m][i]);
          a[m][i] = _mm256_fmadd_ps(xo, wo[i], a[m][i]);
        }
      }
    } else {
      __m256 w[CW];
      _Pragma("GCC unroll 16") for (int i = 0; i < CW; ++i) w[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(r + wat(i)));
      _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
        _Pragma("GCC unroll 16") for (int i = 0; i < CW; ++i) a[m][i] = _mm256_fmadd_ps(xb, w[i], a[m][i]);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m)
    _Pragma("GCC unroll 16") for (int i = 0; i < CW; ++i) _mm256_storeu_ps(c + cat(m, i), a[m][i]);
}

// rows [m0, m1) of one tile column: register tiles of up to MG rows (1 .. 6). add: continue the
// sums already in c (a block of steps after the first); pf, lines >= 0: the lines to prefetch,
// in equal shares over the row groups (else the first group pulls the next 16-column panel, one
// line a step)
template <int CW, int VP, bool kBf16>
MMJAX_AVX2 void PackedRows2(int64_t m0, int64_t m1, int64_t MG, const float* x, int64_t ldx, const uint32_t* r,
                            int64_t PW, int64_t pstride, int64_t steps, float* c, int64_t ldc, int64_t astride,
                            bool add = false, const char* pf = nullptr, int64_t lines = -1) {
  // the rows in as few groups of at most MG as cover them, of sizes differing by one at most (8
  // rows as 4 + 4, not 6 + 2: a 2-row tile has 4 FMA chains, too few to fill the FMA pipes)
  const int64_t groups = (m1 - m0 + MG - 1) / MG, base = (m1 - m0) / groups, extra = (m1 - m0) % groups;
  for (int64_t g = 0, m = m0; g < groups; ++g) {
    const int64_t rows = base + (g < extra);
    const float* xm = x + m * ldx;
    float* cm = c + m * ldc;
    // the first row group's tile pulls the next panel into L2, one line a step (16-column panels:
    // a step is a line), so that reading the weight from memory overlaps the FMAs instead of
    // preceding them (6 and 16 rows took the memory time plus the compute time)
    Lines l = {nullptr, 0};
    if (lines >= 0)
      l = ShareOf(pf, lines, groups, g);
    else if (g == 0 && PW == 16 && CW == 2)
      l = {reinterpret_cast<const char*>(r + pstride), steps};
    m += rows;
    switch (rows) {
      case 1: PackedTile2<1, CW, VP, kBf16>(xm, ldx, r, PW, pstride, steps, cm, ldc, astride, add, l.pf, l.n); break;
      case 2: if constexpr (CW <= 4) PackedTile2<2, CW, VP, kBf16>(xm, ldx, r, PW, pstride, steps, cm, ldc, astride, add, l.pf, l.n); break;
      case 3: if constexpr (CW <= 2) PackedTile2<3, CW, VP, kBf16>(xm, ldx, r, PW, pstride, steps, cm, ldc, astride, add, l.pf, l.n); break;
      case 4: if constexpr (CW <= 2) PackedTile2<4, CW, VP, kBf16>(xm, ldx, r, PW, pstride, steps, cm, ldc, astride, add, l.pf, l.n); break;
      case 5: if constexpr (CW <= 2) PackedTile2<5, CW, VP, kBf16>(xm, ldx, r, PW, pstride, steps, cm, ldc, astride, add, l.pf, l.n); break;
      default: if constexpr (CW <= 2) PackedTile2<6, CW, VP, kBf16>(xm, ldx, r, PW, pstride, steps, cm, ldc, astride, add, l.pf, l.n); break;
    }
  }
}

// panels [pa, pb) of y[M, N] = x @ W (packed, PW = 16 or 64 columns a panel): x f32 [M, ldx]
// (bf16: widened, ldx = 2 Kp), the panels as 32-bit units (an f32 value / a bf16 pair word);
// tail [M, PW]: the sums of a last panel that N cuts (copied into y by the caller). Each tile
// runs over all of K with its sums in registers (written once): a panel (K x 64 bytes) from L2
// while the row groups sweep it. Blocking K (256-1024 steps, the sums in y or a scratch between
// blocks) and rows (192) ran 5-20% slower on one core of the Zen 3 at CLIP's and the bench
// model's shapes (the hardware prefetchers stream the panel and x's rows well enough). Tiles: one
// row 8 vectors, two rows 4, more rows 2 (rows in groups of 6 for f32, 4 for bf16), over one
// 64-column panel or 4 / 2 / 1 adjacent 16-column ones.
template <bool kBf16>
MMJAX_AVX2 void PackedRange2(const float* x, int64_t ldx, int64_t M, int64_t Kp, int64_t N, const uint32_t* w,
                             int64_t PW, float* y, float* tail, int64_t pa, int64_t pb) {
  const int64_t pstride = Kp * PW, full = std::min<int64_t>(pb, N / PW);   // panels [pa, full) whole in y
  const int CW = Avx2TileVectors(M);
  const int64_t MG = M <= 2 ? M : kBf16 ? 4 : 6;
  if (PW == 64) {                    // (AVX-512's panels) CW vectors of one panel at a time
    for (int64_t p = pa; p < pb; ++p) {
      float* c = p < full ? y + PW * p : tail;
      const int64_t ldc = p < full ? N : PW;
      for (int64_t col = 0; col < 64; col += 8 * CW) {
        const uint32_t* r = w + p * pstride + col;
        if (CW == 8) PackedRows2<8, 8, kBf16>(0, M, MG, x, ldx, r, PW, pstride, Kp, c + col, ldc, PW);
        else if (CW == 4) PackedRows2<4, 4, kBf16>(0, M, MG, x, ldx, r, PW, pstride, Kp, c + col, ldc, PW);
        else PackedRows2<2, 2, kBf16>(0, M, MG, x, ldx, r, PW, pstride, Kp, c + col, ldc, PW);
      }
    }
    return;
  }
  if (CW == 2 && g_kblock_steps && M > MG && M <= kKBlockRows) {
    // several row groups (decode): blocks of 16 KiB of a panel, every group over each in turn, the
    // sums carried in y (the same FMA chains, the same bits) and the lines g_kblock_ahead bytes
    // on prefetched in shares, as on the AVX-512 path. The bench model's chain on this path (AVX2
    // capped on the 2-core SPR-class VM, twenty-first session, interleaved): f32 8 / 16 / 64 / 128
    // rows 52.8 / 70.9 / 180.6 / 329.2 -> 42.9 / 52.9 / 161.8 / 307.2 ms, bf16 8 / 16 rows 35.5 /
    // 56.8 -> 28.6 / 45.6 ms; 4 rows (one group) level.
    const int64_t kb = 4 * g_kblock_steps;
    for (int64_t p = pa; p < pb; ++p) {
      const uint32_t* panel = w + p * pstride;
      float* c = p < full ? y + PW * p : tail;
      const int64_t ldc = p < full ? N : PW;
      for (int64_t k0 = 0; k0 < Kp; k0 += kb) {
        const int64_t k1 = std::min(Kp, k0 + kb);
        const char* pf = reinterpret_cast<const char*>(panel + k0 * PW) + g_kblock_ahead;
        PackedRows2<2, 2, kBf16>(0, M, MG, x + (kBf16 ? 2 : 1) * k0, ldx, panel + k0 * PW, PW, pstride, k1 - k0, c,
                                 ldc, PW, k0 > 0, pf, (k1 - k0) * PW * 4 / 64);
      }
    }
    return;
  }
  int64_t p = pa;                    // 16-column panels: CW / 2 whole ones at a time, then singles
  for (; CW == 8 && p + 4 <= full; p += 4)
    PackedRows2<8, 2, kBf16>(0, M, MG, x, ldx, w + p * pstride, PW, pstride, Kp, y + PW * p, N, PW);
  for (; CW == 4 && p + 2 <= full; p += 2)
    PackedRows2<4, 2, kBf16>(0, M, MG, x, ldx, w + p * pstride, PW, pstride, Kp, y + PW * p, N, PW);
  for (; p < pb; ++p)
    PackedRows2<2, 2, kBf16>(0, M, MG, x, ldx, w + p * pstride, PW, pstride, Kp, p < full ? y + PW * p : tail,
                             p < full ? N : PW, PW);
}

// int8 (mmjax_qmatmul_s8p): AVX2 has no vpdpbusd. A quad's four products per column come from
// vpmaddubsw (u8 x s8 -> pairs summed into s16) and vpmaddwd against ones (-> s32): the weight
// back to signed (the packed byte ^ 0x80), the signs of x moved onto it (vpsignb) and |x| the
// unsigned operand. Exact where |x|, |w| <= 127, what quantization makes (a pair is at most 2 x
// 127 x 127 = 32258, no s16 saturation): the same s32 sums as the AVX-512 path, so the same bits
// after the same f32 rescale. Tiles of MG rows x CW vectors (8 CW columns) over a group's quads.
// init: sums to continue (row m's at init + 64 m + c; null: zeros); pf: `lines` lines prefetched
// into L2, spread evenly over the quads
template <int MG, int CW>
MMJAX_AVX2 void S8PTile2(const uint32_t* xw, const uint32_t* xa, int64_t ldx, int64_t q0, int64_t q1,
                         const uint8_t* panel, int64_t c, __m256i (*out)[8], const int32_t* init = nullptr,
                         const char* pf = nullptr, int64_t lines = 0) {
  __m256i a[MG][CW];
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m)
    _Pragma("GCC unroll 16") for (int i = 0; i < CW; ++i)
      a[m][i] = init ? _mm256_load_si256(reinterpret_cast<const __m256i*>(init + 64 * m + c + 8 * i))
                     : _mm256_setzero_si256();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const uint8_t* r = panel + q0 * 256 + 4 * c;
  int64_t due = 0;
  for (int64_t q = q0; q < q1; ++q, r += 256) {
    for (due += lines; due >= q1 - q0; due -= q1 - q0, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    __m256i w[CW];
    _Pragma("GCC unroll 16") for (int i = 0; i < CW; ++i)
      w[i] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 32 * i)), flip);
    _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m) {
      const __m256i xs = _mm256_set1_epi32(static_cast<int>(xw[m * ldx + q]));
      const __m256i xu = _mm256_set1_epi32(static_cast<int>(xa[m * ldx + q]));
      _Pragma("GCC unroll 16") for (int i = 0; i < CW; ++i)
        a[m][i] = _mm256_add_epi32(a[m][i], _mm256_madd_epi16(_mm256_maddubs_epi16(xu, _mm256_sign_epi8(w[i], xs)), ones));
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < MG; ++m)
    _Pragma("GCC unroll 16") for (int i = 0; i < CW; ++i) out[m][i] = a[m][i];
}

// panels [pa, pb) of y[M, N] (int8 packed): xw / xa [M, G * Qg] quads of the quantized x and of
// |x|, xscale [M, G], wscale [G, N]; y (+)= (float(dot) * x_scale) * w_scale, groups in order
MMJAX_AVX2 void S8PRange2(const uint32_t* xw, const uint32_t* xa, const float* xscale, const float* wscale, int64_t M,
                          int64_t G, int64_t Qg, int64_t N, const uint8_t* w, float* y, int64_t pa, int64_t pb) {
  constexpr int MG = 4;
  const int64_t Q = G * Qg;
  alignas(32) float ws[64];
  // from 2 rows (several tiles a panel): 64-quad blocks of a group, every tile over each in turn
  // with its sums carried in L1 (exact: the same results) and a share of the lines ahead
  // prefetched, as on the AVX-512 path; one row: its tile over the whole group. The bench
  // model's int8 chain on this path (AVX2 capped on the 2-core SPR-class VM, twenty-first
  // session, interleaved): 2 / 4 / 8 / 16 / 64 rows 21.0 / 29.6 / 38.4 / 53.8 / 129 -> 14.6 /
  // 13.5 / 17.1 / 32.1 / 109 ms; 1 and 240 rows level.
  const bool blocks = g_kblock_steps && M > 1;
  const int64_t tiles = blocks ? (M + MG - 1) / MG * (64 / 16) : 1;
  thread_local std::vector<int32_t> sums;
  sums.resize(blocks ? (M + MG) * 64 + 16 : 0);
  int32_t* acc = reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(sums.data()) + 63) & ~uintptr_t(63));
  for (int64_t p = pa; p < pb; ++p) {
    const uint8_t* panel = w + p * Q * 256;
    const int64_t cols = std::min<int64_t>(64, N - 64 * p);
    for (int64_t g = 0; g < G; ++g) {
      std::fill(ws, ws + 64, 0.f);
      std::memcpy(ws, wscale + g * N + 64 * p, sizeof(float) * cols);
      const int64_t kb = blocks ? g_kblock_steps : Qg;
      for (int64_t k0 = g * Qg; k0 < (g + 1) * Qg; k0 += kb) {
        const int64_t k1 = std::min((g + 1) * Qg, k0 + kb), lines = blocks ? 4 * (k1 - k0) : 0;
        const bool zero = k0 == g * Qg, last = k1 == (g + 1) * Qg;
        const char* pf = reinterpret_cast<const char*>(panel + k0 * 256) + g_kblock_ahead;
        int64_t tile = 0;
        for (int64_t m = 0; m < M; m += MG) {
          const int mg = static_cast<int>(std::min<int64_t>(MG, M - m));
          // one row takes the whole 64-column step (256 contiguous bytes, 8 chains), two rows half
          // of it: 16 columns a tile read a line of every four, 4 passes over the panel, and left
          // one row at ~12 GB/s from memory
          const int cw = Avx2TileVectors(mg);
          for (int64_t c = 0; c < 64; c += 8 * cw, ++tile) {
            __m256i dots[MG][8];
            const uint32_t *xm = xw + m * Q, *am = xa + m * Q;
            const int32_t* init = blocks && !zero ? acc + 64 * m : nullptr;
            const Lines l = ShareOf(pf, lines, tiles, tile);
            switch (mg) {
              case 1: S8PTile2<1, 8>(xm, am, Q, k0, k1, panel, c, dots, init, l.pf, l.n); break;
              case 2: S8PTile2<2, 4>(xm, am, Q, k0, k1, panel, c, dots, init, l.pf, l.n); break;
              case 3: S8PTile2<3, 2>(xm, am, Q, k0, k1, panel, c, dots, init, l.pf, l.n); break;
              default: S8PTile2<4, 2>(xm, am, Q, k0, k1, panel, c, dots, init, l.pf, l.n); break;
            }
            if (!last) {
              for (int i = 0; i < mg; ++i)
                for (int h = 0; h < cw; ++h)
                  _mm256_store_si256(reinterpret_cast<__m256i*>(acc + 64 * (m + i) + c + 8 * h), dots[i][h]);
              continue;
            }
            for (int i = 0; i < mg; ++i) {
              const __m256 xs = _mm256_set1_ps(xscale[(m + i) * G + g]);
              for (int h = 0; h < cw && c + 8 * h < cols; ++h) {
                alignas(32) float v[8];
                _mm256_store_ps(v, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dots[i][h]), xs),
                                                 _mm256_load_ps(ws + c + 8 * h)));
                float* o = y + (m + i) * N + 64 * p + c + 8 * h;
                const int64_t n = std::min<int64_t>(8, cols - c - 8 * h);
                for (int64_t j = 0; j < n; ++j) o[j] = g == 0 ? v[j] : o[j] + v[j];
              }
            }
          }
        }
      }
    }
  }
}

// QuantizeRow (bit for bit) on 8 values at a time, and the |x| quads S8PRange2 reads
MMJAX_AVX2 void QuantizeRowAvx2(const float* x, int64_t G, int64_t Kg, int8_t* q, float* scale, int32_t* xsum) {
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = x + g * Kg;
    int8_t* qg = q + g * Kg;
    const int64_t K8 = Kg / 8 * 8;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = 0; k < K8; k += 8) amax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xg + k), absmask), amax);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    float a = 0.f;
    for (int j = 0; j < 8; ++j) a = std::max(a, lanes[j]);
    for (int64_t k = K8; k < Kg; ++k) a = std::max(a, std::fabs(xg[k]));
    const float s = a > 0.f ? a * kInv127 : 1.f, r = 1.f / s;
    const __m256 rv = _mm256_set1_ps(r);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t k = 0; k < K8; k += 8) {
      const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xg + k), rv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i iv = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
      sum = _mm256_add_epi32(sum, iv);
      const __m256i b = _mm256_shuffle_epi8(iv, bytes);
      const uint32_t b0 = static_cast<uint32_t>(_mm256_extract_epi32(b, 0)), b1 = static_cast<uint32_t>(_mm256_extract_epi32(b, 4));
      std::memcpy(qg + k, &b0, 4);
      std::memcpy(qg + k + 4, &b1, 4);
    }
    alignas(32) int32_t s8[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(s8), sum);
    int32_t total = 0;
    for (int j = 0; j < 8; ++j) total += s8[j];
    for (int64_t k = K8; k < Kg; ++k) {
      const float v = std::min(std::max(std::nearbyint(xg[k] * r), -127.f), 127.f);
      qg[k] = static_cast<int8_t>(v);
      total += static_cast<int32_t>(v);
    }
    scale[g] = s;
    xsum[g] = total;
  }
}

#endif  // __x86_64__

int Threads(ffi::ThreadPool& pool) {
  const int64_t threads = g_threads ? g_threads : pool.num_threads();
  return threads < 1 ? 1 : static_cast<int>(std::min<int64_t>(threads, 256));
}

// column ranges: a few per thread, none narrower than g_min_part_bytes of a weight row (short
// row segments stream worse, and tiny matmuls are not worth a task)
int Parts(int threads, int64_t N, int64_t elem_bytes) {
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(int64_t(g_parts_per_thread) * threads, N * elem_bytes / g_min_part_bytes)));
}

// The work of one call as kparts x nparts tiles. The weight's rows are split over the threads
// (each streams one contiguous block of the weight) and the partial sums added at the end:
// measured on the bench model's matmuls, a chain of [1024|2816, 1024..5632] int8 weights at one
// row took 9.3 ms as column ranges and 7.1-7.4 ms as row blocks, and f32 weights at 8 rows
// stream at 25 GB/s (column ranges of a 1024-wide weight left one thread idle). The split
// depends on K and the thread count only, never on M, so a row's result does not depend on
// the rows beside it (a request decodes the same tokens alone and in a batch). The plain C++
// loops (no AVX-512) take column ranges: each column one sequential sum, also independent of M.
struct Tiling {
  int kparts = 1, nparts = 1;
  int parts() const { return kparts * nparts; }
};

Tiling Tile(int threads, int64_t units, int64_t N, int64_t elem_bytes, bool simd) {
  Tiling t;
  if (simd) t.kparts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, units / 16)));
  if (t.kparts == 1) t.nparts = Parts(threads, N, elem_bytes);
  return t;
}

// [a, b) of `units` for k-part kp of kparts
void KBounds(int64_t units, int kparts, int kp, int64_t* a, int64_t* b) {
  *a = units * kp / kparts;
  *b = units * (kp + 1) / kparts;
}

// contiguous column ranges of about equal size, aligned to 64 columns
void Bounds(int64_t N, int parts, int p, int64_t* n0, int64_t* n1) {
  const int64_t per = ((N + parts - 1) / parts + 63) / 64 * 64;
  *n0 = per * p < N ? per * p : N;
  *n1 = per * (p + 1) < N ? per * (p + 1) : N;
}

// Runs range(out, n0, n1, ua, ub) over the tiles of one call: columns [n0, n1) summed over the
// weight units [ua, ub) (rows, bf16 row pairs or int8 row quads), into y for the first k-part and
// into a scratch copy for the others, which are then added to y (int32 as unsigned: the sums
// wrap like the s32 dot's). size = the elements of y.
void AddInto(float* y, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += src[i];
}
void AddInto(int32_t* y, const int32_t* src, int64_t n) {
  auto* yu = reinterpret_cast<uint32_t*>(y);
  const auto* su = reinterpret_cast<const uint32_t*>(src);
  for (int64_t i = 0; i < n; ++i) yu[i] += su[i];
}

template <typename T, typename Range>
void RunTiles(ffi::ThreadPool& pool, bool simd, int64_t units, int64_t N, int64_t elem_bytes, T* y,
              int64_t size, Range&& range) {
  const int threads = Threads(pool);
  const Tiling t = Tile(threads, units, N, elem_bytes, simd);
  std::vector<T> partial((t.kparts - 1) * size);
  ParallelFor(pool, threads, t.parts(), [&](int p) {
    const int kp = p % t.kparts;
    int64_t n0, n1, ua, ub;
    Bounds(N, t.nparts, p / t.kparts, &n0, &n1);
    KBounds(units, t.kparts, kp, &ua, &ub);
    if (n0 < n1) range(kp ? partial.data() + (kp - 1) * size : y, n0, n1, ua, ub);
  });
  for (int kp = 1; kp < t.kparts; ++kp) AddInto(y, partial.data() + (kp - 1) * size, size);
}


// A product with nothing to write (M * N == 0) or nothing to sum (K == 0, y all zeros): done
// before any packing of x or work split.
template <typename T>
bool Trivial(T* y, int64_t outputs, int64_t K, int64_t size) {
  if (outputs == 0) return true;
  if (K == 0) std::fill(y, y + size, T(0));
  return K == 0;
}

// The packed products' `rows` operand (s32 scalar): how many leading rows of x hold data (a
// prefill's tokens before its bucket's padding). Only those are multiplied, y's later rows are
// zeros: a 230-token prompt in the 240-row bucket skips the 10 rows' FMAs (3% of its matmuls).
int64_t LeadingRows(ffi::Buffer<ffi::S32> rows, int64_t M) {
  return rows.element_count() >= 1 ? std::clamp<int64_t>(rows.typed_data()[0], 0, M) : M;
}

// The packed f32 / bf16 products' rows operand may hold a second value (s32 [2]: rows, amx): the
// leading rows [0, amx) go to the AMX product (cpu_amx.cc) where it runs, the others to the FMA /
// vdpbf16ps kernel.
// Which rows take which path is the caller's choice (mmjax.packed_weights): a prefill gives its
// prompt rows to AMX and its riding decode rows to the FMAs, so that a decode row's bits are the
// decode step's whatever it rides in.
int64_t AmxRows(ffi::Buffer<ffi::S32> rows, int64_t M) {
  if (rows.element_count() < 2 || !mmjax_amx::Active()) return 0;
  return std::clamp<int64_t>(rows.typed_data()[1], 0, M);
}

// x bf16 [M, K] as (row 2k, row 2k + 1) pairs, one 32-bit word per pair [M, ceil(K / 2)]: x itself
// for even K, else a copy into `odd` with each row's last pair completed by a zero
const uint32_t* PairWords(const uint16_t* x, int64_t M, int64_t K, std::vector<uint32_t>& odd) {
  if (K % 2 == 0) return reinterpret_cast<const uint32_t*>(x);
  const int64_t P = (K + 1) / 2;
  odd.resize(M * P);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < P; ++p)
      odd[m * P + p] = x[m * K + 2 * p] | (2 * p + 1 < K ? uint32_t(x[m * K + 2 * p + 1]) << 16 : 0u);
  return odd.data();
}

ffi::Error GemvBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("mmjax_gemv_bf16: x [M, K] and w [K, N] expected");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  if (M > kMaxRows) return ffi::Error::InvalidArgument("mmjax_gemv_bf16: at most 16 rows");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  float* yp = y->typed_data();
  if (Trivial(yp, M * N, K, M * N)) return ffi::Error::Success();
  const bool simd = HasAvx512();
  const int64_t P = (K + 1) / 2;
  std::vector<uint32_t> odd;
  const uint32_t* xw = PairWords(xp, M, K, odd);
  RunTiles(pool, simd, P, N, 2, yp, M * N, [&](float* out, int64_t n0, int64_t n1, int64_t pa, int64_t pb) {
#if defined(__x86_64__)
    if (simd) return Bf16Range(xw, static_cast<int>(M), K, N, wp, out, n0, n1, pa, pb);
#endif
    GenericBf16(xp, wp, out, M, K, N, n0, n1);
  });
  return ffi::Error::Success();
}

ffi::Error GemvF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("mmjax_gemv_f32: x [M, K] and w [K, N] expected");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  if (M > kMaxRows) return ffi::Error::InvalidArgument("mmjax_gemv_f32: at most 16 rows");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  if (Trivial(yp, M * N, K, M * N)) return ffi::Error::Success();
  const bool simd = HasAvx512();
  RunTiles(pool, simd, K, N, 4, yp, M * N, [&](float* out, int64_t n0, int64_t n1, int64_t ka, int64_t kb) {
#if defined(__x86_64__)
    if (simd) return F32Range(xp, static_cast<int>(M), K, N, wp, out, n0, n1, ka, kb);
#endif
    GenericF32(xp, wp, out, M, K, N, n0, n1);
  });
  return ffi::Error::Success();
}

ffi::Error GemvS8(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                  ffi::ResultBuffer<ffi::S32> y, int64_t groups) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || groups < 1 || xd[1] % groups)
    return ffi::Error::InvalidArgument("mmjax_gemv_s8: x [M, K], w [K, N], groups dividing K expected");
  const int64_t M = xd[0], K = xd[1], N = wd[1], G = groups, Kg = K / groups;
  if (M > kMaxRows) return ffi::Error::InvalidArgument("mmjax_gemv_s8: at most 16 rows");
  const int8_t* xp = x.typed_data();
  const int8_t* wp = w.typed_data();
  int32_t* yp = y->typed_data();
  if (Trivial(yp, M * N, Kg, M * G * N)) return ffi::Error::Success();
  const bool simd = HasAvx512();
  // x per (row, group) as quads of 4 consecutive int8 in one 32-bit word (0 past the group's
  // end), and each (row, group)'s sum (the unsigned-weight correction)
  const int64_t Q = (Kg + 3) / 4;
  std::vector<uint32_t> xw(simd ? M * G * Q : 0);
  std::vector<int32_t> xsum(simd ? M * G : 0);
  for (int64_t m = 0; m < M && simd; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* xr = xp + m * K + g * Kg;
      int32_t sum = 0;
      for (int64_t q = 0; q < Q; ++q) {
        uint32_t word = 0;
        for (int64_t i = 0; i < 4 && 4 * q + i < Kg; ++i) {
          word |= uint32_t(uint8_t(xr[4 * q + i])) << (8 * i);
          sum += xr[4 * q + i];
        }
        xw[(m * G + g) * Q + q] = word;
      }
      xsum[m * G + g] = sum;
    }
  RunTiles(pool, simd, Q, N, 1, yp, M * G * N, [&](int32_t* out, int64_t n0, int64_t n1, int64_t qa, int64_t qb) {
#if defined(__x86_64__)
    // the 128 * sum(x) correction once, in the part that writes y
    if (simd) return S8Range(xw.data(), out == yp ? xsum.data() : nullptr, static_cast<int>(M), G, Kg, N, wp, out,
                             n0, n1, qa, qb);
#endif
    GenericS8(xp, wp, out, M, G, Kg, N, n0, n1);
  });
  return ffi::Error::Success();
}

void QuantizeRow(const float* x, int64_t G, int64_t Kg, int8_t* q, float* scale, int32_t* xsum) {
  for (int64_t g = 0; g < G; ++g) {
    float a = 0.f;
    for (int64_t k = 0; k < Kg; ++k) a = std::max(a, std::fabs(x[g * Kg + k]));
    const float s = a > 0.f ? a * kInv127 : 1.f, r = 1.f / s;
    int32_t sum = 0;
    for (int64_t k = 0; k < Kg; ++k) {
      const float v = std::min(std::max(std::nearbyint(x[g * Kg + k] * r), -127.f), 127.f);
      q[g * Kg + k] = static_cast<int8_t>(v);
      sum += static_cast<int32_t>(v);
    }
    scale[g] = s;
    xsum[g] = sum;
  }
}

// Plain C++ over the packed layout (any CPU): y[m, n] = sum over groups g in order of
// (float(sum over the group's rows of xq * w) * xscale) * wscale, as the AVX-512 path.
void GenericS8P(const int8_t* xq, const float* xscale, const float* wscale, const uint8_t* w, float* y, int64_t M,
                int64_t G, int64_t Kg, int64_t N, int64_t pa, int64_t pb) {
  const int64_t K = G * Kg, Q = K / 4;
  for (int64_t p = pa; p < pb; ++p)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < 64 && 64 * p + c < N; ++c) {
        float out = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          uint32_t acc = 0;   // unsigned: wraps like the s32 dot instead of overflowing
          for (int64_t k = g * Kg; k < (g + 1) * Kg; ++k) {
            const int8_t wv = static_cast<int8_t>(w[((p * Q + k / 4) * 64 + c) * 4 + k % 4] ^ 0x80u);
            acc += static_cast<uint32_t>(static_cast<int32_t>(xq[m * K + k]) * static_cast<int32_t>(wv));
          }
          const float part = static_cast<float>(static_cast<int32_t>(acc)) * xscale[m * G + g] * wscale[g * N + 64 * p + c];
          out = g == 0 ? part : out + part;
        }
        y[m * N + 64 * p + c] = out;
      }
}

// x f32 [M, K] @ the packed int8 weight w, scales wscale f32 [G, N] -> y f32 [M, N]: mmjax.quant's
// W8A8 qmatmul in one call (x quantized per row and group, the s32 dots, the f32 rescale), any M.
ffi::Error QmatmulS8P(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::Buffer<ffi::F32> wscale, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = wscale.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || sd.size() != 2 || yd.size() != 2 || wd[2] != 64 || wd[3] != 4 ||
      sd[0] < 1 || xd[1] != 4 * wd[1] || xd[1] % (4 * sd[0]) || yd[0] != xd[0] || yd[1] != sd[1] ||
      (yd[1] + 63) / 64 != wd[0])
    return ffi::Error::InvalidArgument(
        "mmjax_qmatmul_s8p: x [M, K], w [ceil(N / 64), K / 4, 64, 4], scale [G, N] (4 * G dividing K), y [M, N] expected");
  const int64_t K = xd[1], N = yd[1], G = sd[0], Kg = K / G, P = wd[0], M = LeadingRows(rows, xd[0]);
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  const float* sp = wscale.typed_data();
  float* yp = y->typed_data();
  std::fill(yp + M * N, yp + xd[0] * N, 0.f);
  if (Trivial(yp, M * N, K, M * N)) return ffi::Error::Success();
  const int isa = mmjax_cpu::ActiveIsa();
  const int threads = Threads(pool);
  std::vector<int8_t> xq(M * K), xabs(isa == mmjax_cpu::kAvx2 ? M * K : 0);
  std::vector<float> xscale(M * G);
  std::vector<int32_t> xsum(M * G);
  auto quantize = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
#if defined(__x86_64__)
      if (isa == mmjax_cpu::kAvx512) {
        QuantizeRowAvx512(xp + m * K, G, Kg, xq.data() + m * K, xscale.data() + m * G, xsum.data() + m * G);
        continue;
      }
      if (isa == mmjax_cpu::kAvx2) {
        QuantizeRowAvx2(xp + m * K, G, Kg, xq.data() + m * K, xscale.data() + m * G, xsum.data() + m * G);
        for (int64_t k = 0; k < K; ++k) xabs[m * K + k] = static_cast<int8_t>(std::abs(int(xq[m * K + k])));
        continue;
      }
#endif
      QuantizeRow(xp + m * K, G, Kg, xq.data() + m * K, xscale.data() + m * G, xsum.data() + m * G);
    }
  };
  if (M * K >= (1 << 16)) {   // prefill / encode sizes: rows split over the threads
    const int parts = static_cast<int>(std::min<int64_t>(M, 2 * threads));
    ParallelFor(pool, threads, parts, [&](int part) { quantize(M * part / parts, M * (part + 1) / parts); });
  } else {
    quantize(0, M);
  }
  // panel ranges: a few per thread, each a contiguous run of the weight
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(int64_t(g_parts_per_thread) * threads, P)));
  ParallelFor(pool, threads, parts, [&](int part) {
    const int64_t pa = P * part / parts, pb = P * (part + 1) / parts;
    const auto* xw = reinterpret_cast<const uint32_t*>(xq.data());
#if defined(__x86_64__)
    if (isa == mmjax_cpu::kAvx512)
      return S8PRange(xw, xsum.data(), xscale.data(), sp, M, G, Kg / 4, N, wp, yp, pa, pb);
    if (isa == mmjax_cpu::kAvx2)
      return S8PRange2(xw, reinterpret_cast<const uint32_t*>(xabs.data()), xscale.data(), sp, M, G, Kg / 4, N, wp, yp,
                       pa, pb);
#endif
    GenericS8P(xq.data(), xscale.data(), sp, wp, yp, M, G, Kg, N, pa, pb);
  });
  return ffi::Error::Success();
}

// x [M, Kp] (f32 values / bf16 pair words) @ a packed weight with P panels of PW columns -> y f32
// [M, N]: 64-column panels (packed for AVX-512) on the AVX-512 path, any panels on the AVX2 one
// where AVX-512 is not running (an AVX-512 CPU runs AVX2 code too: 16-column panels there are a
// test's or a moved checkpoint's), the plain loops below AVX2
template <typename X, typename W>
void RunPacked(ffi::ThreadPool& pool, const X* x, int64_t M, int64_t Kp, int64_t N, int64_t P, int64_t PW, const W* w,
               float* y) {
  const int isa = mmjax_cpu::ActiveIsa();
  const bool avx512 = isa == mmjax_cpu::kAvx512 && PW == 64, avx2 = isa >= mmjax_cpu::kAvx2 && !avx512;
  const int threads = Threads(pool);
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(int64_t(g_parts_per_thread) * threads, P)));
  // x as f32 rows for the AVX2 tiles (bf16 pair words widened), from three rows on copied to
  // rows 16 floats longer: rows 4 KiB apart (K = 1024) put a tile's six broadcast streams in the
  // same L1 sets (one core on 240 x 1024 x 1024: 70 -> 89 GFLOP/s)
  constexpr bool kBf16 = std::is_same_v<X, uint32_t>;
  const int64_t K = kBf16 ? 2 * Kp : Kp;
  const bool copy = avx2 && (kBf16 || M > 2);
  const int64_t ldx = copy ? K + 16 : K;
  std::vector<float> rows(copy ? M * ldx : 0);
  if (copy)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < Kp; ++k) {
        if constexpr (kBf16) {
          const uint32_t lo = x[m * Kp + k] << 16, hi = x[m * Kp + k] & 0xFFFF0000u;
          std::memcpy(&rows[m * ldx + 2 * k], &lo, 4);
          std::memcpy(&rows[m * ldx + 2 * k + 1], &hi, 4);
        } else {
          rows[m * ldx + k] = x[m * Kp + k];
        }
      }
  const float* xf = copy ? rows.data() : reinterpret_cast<const float*>(x);
  std::vector<float> tail(avx2 && N % PW ? M * PW : 0);     // a last panel that N cuts (PackedRange2)
  ParallelFor(pool, threads, parts, [&](int part) {
    const int64_t pa = P * part / parts, pb = P * (part + 1) / parts;
#if defined(__x86_64__)
    if (avx512) return PackedRange(x, M, Kp, N, w, y, pa, pb);
    if (avx2)
      return PackedRange2<kBf16>(xf, ldx, M, Kp, N, reinterpret_cast<const uint32_t*>(w), PW, y, tail.data(), pa, pb);
#endif
    GenericPacked(x, w, y, M, Kp, N, PW, pa, pb);
  });
  for (int64_t m = 0; m < M && !tail.empty(); ++m)
    std::memcpy(y + m * N + PW * (P - 1), tail.data() + m * PW, sizeof(float) * (N - PW * (P - 1)));
}

// x f32 [M, K] @ a packed f32 weight of P 64-column panels -> y [M, N], rows [0, amx) on AMX
// (cpu_amx.cc), rows [amx, M) by the FMA kernel (PackedRange), work parts of a panel group each:
// the FMA rows read the group's weight lines the conversion for AMX has just brought in.
// (bf16: x bf16 [M, K] and its pair words xw [M, ceil(K / 2)] for the FMA rows, w [P, ceil(K /
// 2), 64, 2]; one tile dot a product, no split.)
template <typename X, typename W>
void RunAmx(ffi::ThreadPool& pool, const X* x, const void* xw, int64_t amx, int64_t M, int64_t K, int64_t N,
            int64_t P, const W* w, float* y) {
  constexpr bool kBf16 = std::is_same_v<X, uint16_t>;
  const int threads = Threads(pool);
  const mmjax_amx::SplitRows s = mmjax_amx::PrepareRows(amx, K, kBf16 ? 1 : 3);
  const int row_parts = static_cast<int>(std::min<int64_t>(threads, (amx + 15) / 16));
  ParallelFor(pool, threads, row_parts, [&](int part) {
    const int64_t m0 = amx * part / row_parts, m1 = amx * (part + 1) / row_parts;
    if constexpr (kBf16) mmjax_amx::CopyInto(x, K, m0, m1, s);
    else mmjax_amx::SplitInto(x, K, m0, m1, s);
  });
  // groups of up to 4 panels, fewer where that evens the groups out over the threads (a ViT-B
  // projection's 12 panels: 4 groups of 3, not 3 of 4 on 2 threads)
  int64_t per = mmjax_amx::kGroupPanels;
  while (per > 1 && (P + per - 1) / per % threads && (P + per - 1) / per < 4 * threads) --per;
  const int64_t groups = (P + per - 1) / per;
  ParallelFor(pool, threads, static_cast<int>(groups), [&](int g) {
    const int64_t p0 = g * per, p1 = std::min(P, p0 + per);
#if defined(__x86_64__)
    if constexpr (kBf16) {
      mmjax_amx::GroupProductBf16(s, w, K, N, p0, p1, y);
      const int64_t kp = (K + 1) / 2;
      if (M > amx)
        PackedRange(static_cast<const uint32_t*>(xw) + amx * kp, M - amx, kp, N, w, y + amx * N, p0, p1);
    } else {
      mmjax_amx::GroupProduct(s, w, K, N, p0, p1, y);
      if (M > amx) PackedRange(x + amx * K, M - amx, K, N, w, y + amx * N, p0, p1);
    }
#endif
  });
}

// x [M, K] @ w [ceil(N / PW), ceil(K / R), PW, R] (PW = 64 or 16 columns a panel) -> y f32 [M, N]:
// the shape check
bool PackedShapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, ffi::Span<const int64_t> yd, int R) {
  return xd.size() == 2 && wd.size() == 4 && yd.size() == 2 && (wd[2] == 64 || wd[2] == 16) && wd[3] == R &&
         (xd[1] + R - 1) / R == wd[1] && yd[0] == xd[0] && (yd[1] + wd[2] - 1) / wd[2] == wd[0];
}

// x f32 [M, K] @ the packed f32 weight -> y f32 [M, N], any M (the f32 dot up to summation order)
ffi::Error MatmulF32P(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  if (!PackedShapes(x.dimensions(), w.dimensions(), y->dimensions(), 1))
    return ffi::Error::InvalidArgument("mmjax_matmul_f32p: x [M, K], w [ceil(N / PW), K, PW, 1] (PW 64 or 16), y [M, N] expected");
  const int64_t M = LeadingRows(rows, x.dimensions()[0]), K = x.dimensions()[1], N = y->dimensions()[1];
  float* yp = y->typed_data();
  std::fill(yp + M * N, yp + x.dimensions()[0] * N, 0.f);
  if (Trivial(yp, M * N, K, M * N)) return ffi::Error::Success();
  const int64_t amx = w.dimensions()[2] == 64 ? AmxRows(rows, M) : 0;
  if (amx) {
    RunAmx(pool, x.typed_data(), nullptr, amx, M, K, N, w.dimensions()[0], w.typed_data(), yp);
    return ffi::Error::Success();
  }
  RunPacked(pool, x.typed_data(), M, K, N, w.dimensions()[0], w.dimensions()[2], w.typed_data(), yp);
  return ffi::Error::Success();
}

// x bf16 [M, K] @ the packed bf16 weight -> y f32 [M, N], any M: f32 sums of the exact bf16
// products (a bf16 x bf16 -> f32 dot up to summation order)
ffi::Error MatmulBf16P(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                       ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  if (!PackedShapes(x.dimensions(), w.dimensions(), y->dimensions(), 2))
    return ffi::Error::InvalidArgument(
        "mmjax_matmul_bf16p: x [M, K], w [ceil(N / PW), ceil(K / 2), PW, 2] (PW 64 or 16), y [M, N] expected");
  const int64_t M = LeadingRows(rows, x.dimensions()[0]), K = x.dimensions()[1], N = y->dimensions()[1],
                Kp = (K + 1) / 2;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.typed_data());
  float* yp = y->typed_data();
  std::fill(yp + M * N, yp + x.dimensions()[0] * N, 0.f);
  if (Trivial(yp, M * N, K, M * N)) return ffi::Error::Success();
  std::vector<uint32_t> odd;
  const uint32_t* xw = PairWords(xp, M, K, odd);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.typed_data());
  if (const int64_t amx = w.dimensions()[2] == 64 ? AmxRows(rows, M) : 0) {
    RunAmx(pool, xp, xw, amx, M, K, N, w.dimensions()[0], wp, yp);
    return ffi::Error::Success();
  }
  RunPacked(pool, xw, M, Kp, N, w.dimensions()[0], w.dimensions()[2], wp, yp);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(mmjax_gemv_bf16, GemvBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(mmjax_gemv_f32, GemvF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(mmjax_matmul_bf16p, MatmulBf16P,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(mmjax_matmul_f32p, MatmulF32P,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(mmjax_gemv_s8, GemvS8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("groups"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(mmjax_qmatmul_s8p, QmatmulS8P,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" {
// benchmark sweeps only, like mmjax_gemv_tune: floats ahead the f32 kernel prefetches (0: none)
void mmjax_gemv_f32_prefetch(int floats) { g_f32_prefetch = std::max(0, floats); }
void mmjax_gemv_bf16_prefetch(int elems) { g_bf16_prefetch = std::max(0, elems); }
// the packed kernels' panel-outer sweep for 24 to 384 rows on (1) or off (0)
void mmjax_gemv_panel_mode(int mode) { g_panel_mode = mode; }
// bytes ahead the packed kernels' first pass prefetches at decode rows (0: none)
void mmjax_gemv_packed_prefetch(int bytes) { g_packed_prefetch = std::max(0, bytes); }
// benchmark A/Bs only: the packed kernels' step blocks (steps a block, 0: off) and how far ahead
// they prefetch (bytes; negative: unchanged); returns the steps before the call
int mmjax_gemv_kblock(int steps, int ahead_bytes) {
  const int before = g_kblock_steps;
  g_kblock_steps = std::max(0, steps);
  if (ahead_bytes >= 0) g_kblock_ahead = ahead_bytes;
  return before;
}
// benchmark sweeps only (not thread-safe against running calls): see the tuning globals above
void mmjax_gemv_tune(int cols, int pairs, int quads, int threads, int parts_per_thread, int min_part_bytes) {
  g_parts_per_thread = std::max(1, parts_per_thread);
  g_min_part_bytes = std::max(64, min_part_bytes);
  g_max_cols = std::max(64, cols);
  g_block_pairs = std::max(0, pairs);
  g_block_quads = std::max(0, quads);
  g_threads = std::max(0, threads);
}
// Whether the packed f32 / bf16 products may use AMX (1) or not (0; tests and A/Bs; negative:
// unchanged); returns whether they would now (the cap, the CPU, the OS's leave, the AVX-512 path).
int mmjax_cpu_set_amx(int cap) {
  if (cap >= 0) mmjax_amx::g_amx_cap.store(cap ? 1 : 0);
  return mmjax_amx::Active() ? 1 : 0;
}
// the AMX tile unit's bf16 FLOP/s on the calling thread (benchmarks' machine probe; 0 without AMX)
double mmjax_amx_tile_flops(long iterations) { return mmjax_amx::TileFlopsPerSecond(iterations); }
// The highest code path the kernels may take (mmjax_cpu::Isa: 0 plain C++, 1 AVX2, 2 AVX-512;
// tests lower it; a negative cap leaves it as it is); returns the path in use afterwards.
int mmjax_cpu_set_isa(int cap) {
  if (cap >= 0) mmjax_cpu::g_isa_cap.store(cap);
  return mmjax_cpu::ActiveIsa();
}
// the CPU's best path (mmjax_cpu::Isa)
int mmjax_cpu_detected_isa() { return mmjax_cpu::DetectedIsa(); }
}
