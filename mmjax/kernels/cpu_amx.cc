// f32 matmuls on AMX-BF16 at f32 accuracy ("bf16x6", the method XLA's TPU backend uses for
// precision=HIGHEST): each f32 operand is split into three bf16 parts, a = a1 + a2 + a3 exactly
// (a1 = bf16(a) rounded to nearest, a2 = bf16(a - a1), a3 = a - a1 - a2, which fits a bf16), and
// the six products whose size can reach f32's last bits are summed in f32 by TDPBF16PS:
// a1 b1 + a1 b2 + a2 b1 + a1 b3 + a2 b2 + a3 b1. The three left out are each below 2^-24 |a b|
// (|a2| <= 2^-8 |a|, |a3| <= 2^-16 |a|), a bf16 product is exact in f32, so the error is that of
// an f32 dot with another summation order (tests: against float64 beside the FMA kernel's).
// Why: AMX's tile dot runs ~3.3 TFLOP/s a core here against ~200 GFLOP/s for AVX-512 FMAs, so six
// of them are still ~2.5x the FMA rate for the compute-bound products (prefill, encode).
// Limits: AMX reads bf16 denormals as zero (parts of values below ~1e-33 are lost) and an
// infinite operand gives NaN where an f32 dot gives +-inf.
//
// Blocking (a BLIS-style loop over tiles): a work part is a group of up to 4 weight panels (256
// columns). For blocks of kKc weight rows its panels are converted into the three parts' B tiles
// (VNNI pairs, 192 KiB a block, double-buffered in L2: the next block is converted between the
// tile dots of this one); then each 32-row x 32-column block of the output keeps four 16 x 16 C
// tiles over the block's rows (six products per 32 columns of k: 24 tile dots), carried between
// weight blocks in an L2 buffer. Every output is the same sequence of tile dots over k whatever the
// number of rows, so a row's result does not depend on the rows beside it.
#include "cpu_amx.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_parallel.h"

namespace mmjax_amx {

#if defined(__x86_64__)

namespace {

constexpr int64_t kKc = 128;              // weight rows a converted block holds
constexpr int64_t kMc = 512;              // output rows the C buffer carries between weight blocks
constexpr int64_t kGroupCols = 64 * kGroupPanels;
constexpr int64_t kLdc = kGroupCols + 16;  // C buffer row (floats), off a 4 KiB multiple

bool Detect() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx = (d >> 22 & 1) && (d >> 24 & 1);   // AMX-BF16, AMX-TILE
  if (!amx || !__builtin_cpu_supports("avx512dq")) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return false;   // OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo >> 17 & 3) != 3) return false;    // XTILECFG and XTILEDATA enabled by the OS
  // Linux hands out the 8 KiB tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM)
  constexpr long kReqPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#define MMJAX_AMX __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// every tile 16 rows of 64 bytes: C 0-3 (16 x 16 f32), A 4-5 (16 rows x 32 bf16), B 6-7 (16
// pairs x 16 columns)
MMJAX_AMX void ConfigureTiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // (not _tile_loadconfig: GCC 12's intrinsic tells the compiler it reads 8 bytes, which lets it
  // drop the stores above once this is inlined, and the first tile instruction then faults)
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

// 16 f32 -> 16 bf16, rounded to nearest even; and back to f32 (exact)
MMJAX_AMX inline __m256i ToBf16(__m512 a) { return (__m256i)_mm512_cvtneps_pbh(a); }
MMJAX_AMX inline __m512 Widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// a = p1 + p2 + p3, each part an f32 holding a bf16 value (low 16 bits zero); an infinite a gives
// (a, 0, 0) rather than inf - inf
MMJAX_AMX inline void Split(__m512 a, __m512& p1, __m512& p2, __m512& p3) {
  p1 = Widen(ToBf16(a));
  const __m512 r1 = _mm512_maskz_sub_ps(static_cast<__mmask16>(~_mm512_fpclass_ps_mask(a, 0x18)), a, p1);
  p2 = Widen(ToBf16(r1));
  p3 = _mm512_sub_ps(r1, p2);
}

// a (k even) and b (k + 1) of 16 columns -> the 16 VNNI words (a's bf16 low, b's high)
MMJAX_AMX inline __m512i Pair(__m512 a, __m512 b) {
  return _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(b), _mm512_set1_epi32(int(0xFFFF0000u))),
                         _mm512_srli_epi32(_mm512_castps_si512(a), 16));
}

// B tiles of a converted block: [part][16-column block][kc / 2 pairs][16 columns] words, so a
// tile (16 pairs of one 16-column block) is 1 KiB in a row
inline int64_t BWords(int64_t kc) { return 4 * kGroupPanels * (kc / 2) * 16; }

// A block of weight rows [k0, k0 + kc) (kc a multiple of 32; rows past K are zeros) of panels
// [p0, p0 + np) to convert into b (BWords layout), in units of one row pair of one panel (np *
// kc / 2 units), so that the conversion of the next block can run between the tile dots of this
// one (the vector units idle while AMX works).
struct Block {
  const float* w = nullptr;        // an f32 weight [P, K, 64]: split into three parts
  const uint32_t* wb = nullptr;    // or a bf16 one [P, ceil(K / 2), 64] pair words: copied as it is
  int64_t K = 0, p0 = 0, np = 0, k0 = 0, kc = 0;
  uint32_t* b = nullptr;
  int64_t units() const { return np * (kc / 2); }
};

// bf16: a unit is one pair row of a panel, its 64 pair words copied to the B layout (zeros past
// the weight's rows); the packed bf16 layout already holds VNNI pairs
MMJAX_AMX void CopyPairs(const Block& blk, int64_t u0, int64_t u1) {
  const int64_t pairs = blk.kc / 2, kp = (blk.K + 1) / 2;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t q = u / pairs, t = u % pairs, k = blk.k0 / 2 + t;
    const uint32_t* row = blk.wb + ((blk.p0 + q) * kp + k) * 64;
    if (k + 16 < kp) _mm_prefetch(reinterpret_cast<const char*>(row + 16 * 64), _MM_HINT_T0);
    for (int c = 0; c < 4; ++c)
      _mm512_store_si512(blk.b + ((4 * q + c) * pairs + t) * 16,
                         k < kp ? _mm512_loadu_si512(row + 16 * c) : _mm512_setzero_si512());
  }
}

// units [u0, u1) of a block; each prefetches the unit 8 ahead (4 KiB of the panel on)
MMJAX_AMX void Convert(const Block& blk, int64_t u0, int64_t u1) {
  if (blk.wb) return CopyPairs(blk, u0, u1);
  const int64_t pairs = blk.kc / 2, part = BWords(blk.kc);
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t q = u / pairs, t = u % pairs, k = blk.k0 + 2 * t;
    const float* panel = blk.w + (blk.p0 + q) * blk.K * 64;
    if (k + 16 < blk.K) {
      const char* pf = reinterpret_cast<const char*>(panel + (k + 16) * 64);
      for (int l = 0; l < 8; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
    }
    for (int c = 0; c < 4; ++c) {
      const __m512 a = k < blk.K ? _mm512_loadu_ps(panel + k * 64 + 16 * c) : _mm512_setzero_ps();
      const __m512 bb = k + 1 < blk.K ? _mm512_loadu_ps(panel + (k + 1) * 64 + 16 * c) : _mm512_setzero_ps();
      __m512 a1, a2, a3, b1, b2, b3;
      Split(a, a1, a2, a3);
      Split(bb, b1, b2, b3);
      uint32_t* out = blk.b + ((4 * q + c) * pairs + t) * 16;
      _mm512_store_si512(out, Pair(a1, b1));
      _mm512_store_si512(out + part, Pair(a2, b2));
      _mm512_store_si512(out + 2 * part, Pair(a3, b3));
    }
  }
}

MMJAX_AMX void SplitRange(const float* x, int64_t K, int64_t m0, int64_t m1, const SplitRows& s) {
  auto* d = const_cast<uint16_t*>(s.data);
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t k = 0; k < s.padded_k; k += 16) {
      const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : K <= k ? __mmask16(0) : __mmask16((1u << (K - k)) - 1);
      const __m512 a = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      __m512 p1, p2, p3;
      Split(a, p1, p2, p3);
      _mm256_store_si256(reinterpret_cast<__m256i*>(d + AOffsetOf(s, 0, m, k)), ToBf16(p1));
      _mm256_store_si256(reinterpret_cast<__m256i*>(d + AOffsetOf(s, 1, m, k)), ToBf16(p2));
      _mm256_store_si256(reinterpret_cast<__m256i*>(d + AOffsetOf(s, 2, m, k)), ToBf16(p3));
    }
  }
}

MMJAX_AMX void CopyRange(const uint16_t* x, int64_t K, int64_t m0, int64_t m1, const SplitRows& s) {
  auto* d = const_cast<uint16_t*>(s.data);
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t k = 0; k < s.padded_k; k += 32) {
      const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : K <= k ? __mmask32(0) : (__mmask32(1) << (K - k)) - 1;
      _mm512_store_si512(d + AOffsetOf(s, 0, m, k), _mm512_maskz_loadu_epi16(mask, x + m * K + k));
    }
}

// C tiles 0 .. kTiles - 1 (2: one 16-row block, 4: two) over a 32-column block of the C buffer:
// zeroed (the first weight block) or the sums so far; and stored back
template <int kTiles>
MMJAX_AMX inline void LoadC(const float* c, bool zero) {
  if (zero) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (kTiles == 4) {
      _tile_zero(2);
      _tile_zero(3);
    }
    return;
  }
  _tile_loadd(0, c, kLdc * 4);
  _tile_loadd(1, c + 16, kLdc * 4);
  if constexpr (kTiles == 4) {
    _tile_loadd(2, c + 16 * kLdc, kLdc * 4);
    _tile_loadd(3, c + 16 * kLdc + 16, kLdc * 4);
  }
}
template <int kTiles>
MMJAX_AMX inline void StoreC(float* c) {
  _tile_stored(0, c, kLdc * 4);
  _tile_stored(1, c + 16, kLdc * 4);
  if constexpr (kTiles == 4) {
    _tile_stored(2, c + 16 * kLdc, kLdc * 4);
    _tile_stored(3, c + 16 * kLdc + 16, kLdc * 4);
  }
}

// step st's share of units [u0, u1) of the next block's conversion, while the tile dots run
MMJAX_AMX inline void ConvertShare(const Block& next, int64_t u0, int64_t u1, int64_t st, int64_t steps) {
  const int64_t c0 = u0 + (u1 - u0) * st / steps, c1 = u0 + (u1 - u0) * (st + 1) / steps;
  if (c1 > c0) Convert(next, c0, c1);
}

// The four dots of one product (A in registers 4 / 5, B in 6 / 7, C tiles 0-3), with the next
// product's operand loaded into each register right after the last dot that reads it: AMX does
// not rename tiles, so a load issued before those dots would wait for them, and the dots after
// it for the load. Then-B: the next B (its two column tiles bnext words apart); then-A: the next
// A (its two row tiles anext elements apart); then-AB: both (none where an is null).
MMJAX_AMX inline void DotsThenB(const uint32_t* bn, int64_t bnext) {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(2, 5, 6);
  _tile_loadd(6, bn, 64);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(3, 5, 7);
  _tile_loadd(7, bn + bnext, 64);
}
MMJAX_AMX inline void DotsThenA(const uint16_t* an, int64_t anext) {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(4, an, 64);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
  _tile_loadd(5, an + anext, 64);
}
MMJAX_AMX inline void DotsThenAB(const uint16_t* an, int64_t anext, const uint32_t* bn, int64_t bnext) {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if (an) _tile_loadd(4, an, 64);
  _tile_dpbf16ps(2, 5, 6);
  if (an) _tile_loadd(6, bn, 64);
  _tile_dpbf16ps(3, 5, 7);
  if (an) {
    _tile_loadd(5, an + anext, 64);
    _tile_loadd(7, bn + bnext, 64);
  }
}

// bf16 (one part): rows [m0, m0 + 32) x the 32 columns of block cb, as TileBlock with one product
// (four tile dots and four loads a step)
MMJAX_AMX void TileBlock1(const SplitRows& s, int64_t m0, int64_t k0, int64_t kc, const uint32_t* b, int64_t cb,
                          float* c, bool zero, const Block& next, int64_t u0, int64_t u1) {
  const int64_t pairs = kc / 2, steps = kc / 32, anext = s.padded_k / 32 * 512, bnext = pairs * 16;
  LoadC<4>(c, zero);
  const auto a_at = [&](int64_t st) { return s.data + AOffsetOf(s, 0, m0, k0 + 32 * st); };
  const auto b_at = [&](int64_t st) { return b + (2 * cb * pairs + 16 * st) * 16; };
  _tile_loadd(4, a_at(0), 64);
  _tile_loadd(5, a_at(0) + anext, 64);
  _tile_loadd(6, b_at(0), 64);
  _tile_loadd(7, b_at(0) + bnext, 64);
  for (int64_t st = 0; st < steps; ++st) {
    const bool more = st + 1 < steps;
    DotsThenAB(more ? a_at(st + 1) : nullptr, anext, b_at(st + 1), bnext);
    ConvertShare(next, u0, u1, st, steps);
  }
  StoreC<4>(c);
}

// bf16, the last 16 rows of a row block
MMJAX_AMX void TileBlockHalf1(const SplitRows& s, int64_t m0, int64_t k0, int64_t kc, const uint32_t* b, int64_t cb,
                              float* c, bool zero, const Block& next, int64_t u0, int64_t u1) {
  const int64_t pairs = kc / 2, steps = kc / 32, bnext = pairs * 16;
  LoadC<2>(c, zero);
  for (int64_t st = 0; st < steps; ++st) {
    const uint32_t* bt = b + (2 * cb * pairs + 16 * st) * 16;
    _tile_loadd(4, s.data + AOffsetOf(s, 0, m0, k0 + 32 * st), 64);
    _tile_loadd(6, bt, 64);
    _tile_loadd(7, bt + bnext, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    ConvertShare(next, u0, u1, st, steps);
  }
  StoreC<2>(c);
}

// Output rows [m0, m0 + 32) x the 32 columns of block cb over the converted rows [k0, k0 + kc):
// four C tiles, loaded from / stored to c (zero: start from 0); the six products in a fixed
// order, 14 tile loads a step. Meanwhile units [u0, u1) of the next block are converted.
MMJAX_AMX void TileBlock(const SplitRows& s, int64_t m0, int64_t k0, int64_t kc, const uint32_t* b, int64_t cb,
                         float* c, bool zero, const Block& next, int64_t u0, int64_t u1) {
  const int64_t pairs = kc / 2, part = BWords(kc), steps = kc / 32;
  const int64_t anext = s.padded_k / 32 * 512, bnext = pairs * 16;   // the second row / column block's tile
  LoadC<4>(c, zero);
  const auto a_at = [&](int i, int64_t st) { return s.data + AOffsetOf(s, i, m0, k0 + 32 * st); };
  const auto b_at = [&](int j, int64_t st) { return b + j * part + (2 * cb * pairs + 16 * st) * 16; };
  _tile_loadd(4, a_at(0, 0), 64);
  _tile_loadd(5, a_at(0, 0) + anext, 64);
  _tile_loadd(6, b_at(2, 0), 64);
  _tile_loadd(7, b_at(2, 0) + bnext, 64);
  for (int64_t st = 0; st < steps; ++st) {
    // the products a step in this order, each loading the next one's changed operand
    DotsThenB(b_at(0, st), bnext);                                       // a1 b3
    DotsThenB(b_at(1, st), bnext);                                       // a1 b1
    DotsThenA(a_at(1, st), anext);                                       // a1 b2
    DotsThenB(b_at(0, st), bnext);                                       // a2 b2
    DotsThenA(a_at(2, st), anext);                                       // a2 b1
    DotsThenAB(st + 1 < steps ? a_at(0, st + 1) : nullptr, anext, b_at(2, st + 1), bnext);   // a3 b1
    ConvertShare(next, u0, u1, st, steps);
  }
  StoreC<4>(c);
}

// As TileBlock for the last 16 rows of a row block (a row count that is 16 past a multiple of
// 32): C tiles 0 and 1 only, one A register, the same products in the same order.
MMJAX_AMX void TileBlockHalf(const SplitRows& s, int64_t m0, int64_t k0, int64_t kc, const uint32_t* b, int64_t cb,
                             float* c, bool zero, const Block& next, int64_t u0, int64_t u1) {
  const int64_t pairs = kc / 2, part = BWords(kc), steps = kc / 32, bnext = pairs * 16;
  LoadC<2>(c, zero);
  const auto a_at = [&](int i, int64_t st) { return s.data + AOffsetOf(s, i, m0, k0 + 32 * st); };
  const auto b_at = [&](int j, int64_t st) { return b + j * part + (2 * cb * pairs + 16 * st) * 16; };
  for (int64_t st = 0; st < steps; ++st) {
    // a1 b3, a1 b1, a1 b2, a2 b2, a2 b1, a3 b1 (A in register 4 or 5, B in 6 and 7 turn about)
    _tile_loadd(4, a_at(0, st), 64);
    _tile_loadd(6, b_at(2, st), 64);
    _tile_loadd(7, b_at(2, st) + bnext, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, b_at(0, st), 64);
    _tile_loadd(7, b_at(0, st) + bnext, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a_at(1, st), 64);
    _tile_loadd(6, b_at(1, st), 64);
    _tile_loadd(7, b_at(1, st) + bnext, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 5, 7);
    _tile_loadd(6, b_at(0, st), 64);
    _tile_loadd(7, b_at(0, st) + bnext, 64);
    _tile_loadd(4, a_at(2, st), 64);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 5, 7);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    ConvertShare(next, u0, u1, st, steps);
  }
  StoreC<2>(c);
}

MMJAX_AMX void Group(const SplitRows& s, const float* w, const uint32_t* wb, int64_t K, int64_t N, int64_t p0,
                     int64_t p1, float* y) {
  thread_local std::vector<uint32_t> bbuf;
  thread_local std::vector<float> cbuf;
  const bool bf16 = wb != nullptr;
  const auto full = bf16 ? TileBlock1 : TileBlock, half = bf16 ? TileBlockHalf1 : TileBlockHalf;
  const int64_t bwords = (bf16 ? 1 : 3) * BWords(kKc);
  bbuf.resize(2 * bwords + 16);
  cbuf.resize(kMc * kLdc + 16);
  uint32_t* b0 = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(bbuf.data()) + 63) & ~uintptr_t(63));
  float* c = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(cbuf.data()) + 63) & ~uintptr_t(63));
  const int64_t np = p1 - p0, blocks = 2 * np, col0 = 64 * p0, cols = std::min<int64_t>(64 * np, N - col0);
  // row blocks of at most kMc rows, as even as 32-row steps allow (the last may end 16 rows past
  // a multiple of 32: a half tile block); the weight blocks of each in
  // turn, block i converted into buffer i % 2 while block i - 1's tile dots run
  const int64_t mblocks = (s.padded_rows + kMc - 1) / kMc, step = ((s.padded_rows + 31) / 32 + mblocks - 1) / mblocks * 32;
  const int64_t kblocks = (s.padded_k + kKc - 1) / kKc, total = mblocks * kblocks;
  const auto block = [&](int64_t i) {
    Block blk;
    if (i >= total) return blk;
    blk.w = w, blk.wb = wb, blk.K = K, blk.p0 = p0, blk.np = np, blk.k0 = (i % kblocks) * kKc;
    blk.kc = std::min<int64_t>(kKc, s.padded_k - blk.k0);
    blk.b = b0 + (i % 2) * bwords;
    return blk;
  };
  ConfigureTiles();
  Block cur = block(0);
  Convert(cur, 0, cur.units());
  for (int64_t i = 0; i < total; ++i) {
    const Block next = block(i + 1);
    const int64_t mo = (i / kblocks) * step, mrows = std::min<int64_t>(step, s.padded_rows - mo);
    const int64_t tiles = blocks * ((mrows + 31) / 32), units = next.units();
    int64_t t = 0;
    for (int64_t cb = 0; cb < blocks; ++cb)
      for (int64_t m = 0; m < mrows; m += 32, ++t)
        (mrows - m == 16 ? half : full)(s, mo + m, cur.k0, cur.kc, cur.b, cb, c + m * kLdc + 32 * cb, cur.k0 == 0,
                                        next, units * t / tiles, units * (t + 1) / tiles);
    if (cur.k0 + cur.kc == s.padded_k) {
      const int64_t last = std::min<int64_t>(s.rows - mo, mrows);
      for (int64_t m = 0; m < last; ++m) std::memcpy(y + (mo + m) * N + col0, c + m * kLdc, sizeof(float) * cols);
    }
    cur = next;
  }
  _tile_release();
}

// The tile unit's own rate: `iterations` x 4 independent tile dots on registers (no memory), in
// bf16 FLOP/s of the calling thread (0 without AMX). The machine probe of the benchmarks' roofline.
MMJAX_AMX double TileFlops(long iterations) {
  ConfigureTiles();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float sink[256];
  _tile_stored(0, sink, 64);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  return sink[0] == 0.f && s > 0 ? 4.0 * 2 * 16 * 16 * 32 * iterations / s : 0.0;
}

}  // namespace

double TileFlopsPerSecond(long iterations) { return Supported() ? TileFlops(iterations) : 0.0; }

bool Supported() {
  static const bool ok = Detect();
  return ok;
}

void SplitInto(const float* x, int64_t K, int64_t m0, int64_t m1, const SplitRows& s) { SplitRange(x, K, m0, m1, s); }
void CopyInto(const uint16_t* x, int64_t K, int64_t m0, int64_t m1, const SplitRows& s) { CopyRange(x, K, m0, m1, s); }

void GroupProduct(const SplitRows& s, const float* w, int64_t K, int64_t N, int64_t p0, int64_t p1, float* y) {
  Group(s, w, nullptr, K, N, p0, p1, y);
}
void GroupProductBf16(const SplitRows& s, const uint16_t* w, int64_t K, int64_t N, int64_t p0, int64_t p1, float* y) {
  Group(s, nullptr, reinterpret_cast<const uint32_t*>(w), K, N, p0, p1, y);
}

#else   // not x86-64: no AMX

bool Supported() { return false; }
double TileFlopsPerSecond(long) { return 0.0; }
void SplitInto(const float*, int64_t, int64_t, int64_t, const SplitRows&) {}
void CopyInto(const uint16_t*, int64_t, int64_t, int64_t, const SplitRows&) {}
void GroupProduct(const SplitRows&, const float*, int64_t, int64_t, int64_t, int64_t, float*) {}
void GroupProductBf16(const SplitRows&, const uint16_t*, int64_t, int64_t, int64_t, int64_t, float*) {}

#endif

bool Active() { return g_amx_cap.load(std::memory_order_relaxed) && mmjax_cpu::HasAvx512() && Supported(); }

SplitRows PrepareRows(int64_t M, int64_t K, int parts) {
  thread_local std::vector<uint16_t> buf;
  SplitRows s;
  s.rows = M;
  s.padded_rows = (M + 15) / 16 * 16;
  s.padded_k = (K + 31) / 32 * 32;
  s.parts = parts;
  const size_t n = size_t(parts) * size_t(s.padded_rows) * size_t(s.padded_k) + 32;
  if (buf.size() < n) buf.resize(n);
  uint16_t* d = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  s.data = d;
  // the rows past M, zeros in each part (SplitInto / CopyInto write the columns past K of rows
  // below M)
  for (int i = 0; i < parts && M < s.padded_rows; ++i)
    for (int64_t k = 0; k < s.padded_k; k += 32)
      for (int64_t m = M; m < s.padded_rows; m += 16 - m % 16) {
        const int64_t o = AOffsetOf(s, i, m, k), rows = std::min<int64_t>(16 - m % 16, s.padded_rows - m);
        std::memset(d + o, 0, sizeof(uint16_t) * 32 * rows);
      }
  return s;
}

}  // namespace mmjax_amx
