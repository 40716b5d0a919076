// f32 matmuls on AMX-BF16 at f32 accuracy, and bf16 ones as they are (cpu_amx.cc; the packed
// products in cpu_gemv.cc call it for the rows they give to AMX). See cpu_amx.cc for the method
// and its error.
#pragma once

#include <atomic>
#include <cstdint>

namespace mmjax_amx {

// 1: the packed f32 kernel may use AMX where the CPU and the OS allow it; 0: never (tests and
// A/Bs set it through mmjax_cpu_set_amx)
inline std::atomic<int> g_amx_cap{1};

// Has this CPU AMX-BF16 with the OS's leave to use it (the process's XTILEDATA permission is
// asked for once, here)?
bool Supported();
// Supported(), the AVX-512 path active (cpu_parallel.h) and not capped off
bool Active();
// The calling thread's tile-dot rate in bf16 FLOP/s over `iterations` x 4 dots on registers (0
// without AMX): the unit's limit, for the benchmarks' roofline.
double TileFlopsPerSecond(long iterations);

// Columns a panel group takes: what one work part of the AMX product covers.
constexpr int64_t kGroupPanels = 4;

// The activations' three bf16 parts, laid out as AMX's A tiles, each 1 KiB in a row: [part 3]
// [Mpad / 16 row blocks][Kpad / 32 steps][16 rows][32 bf16], Mpad = rows rounded up to 16, Kpad
// = K rounded up to 32; zeros past M and K.
struct SplitRows {
  const uint16_t* data = nullptr;
  int64_t rows = 0, padded_rows = 0, padded_k = 0;
  int parts = 3;              // 3: an f32 x split; 1: a bf16 x as it is
};

// element (part i, row m, column k) of a SplitRows layout
inline int64_t AOffsetOf(const SplitRows& s, int i, int64_t m, int64_t k) {
  return ((i * (s.padded_rows / 16) + m / 16) * (s.padded_k / 32) + k / 32) * 512 + (m % 16) * 32 + k % 32;
}

// x f32 rows [m0, m1) of [M, K] (row-major) into the split buffer's three parts (the parallel
// part of filling a PrepareRows(M, K, 3) buffer)
void SplitInto(const float* x, int64_t K, int64_t m0, int64_t m1, const SplitRows& s);
// x bf16 rows [m0, m1) of [M, K] into a PrepareRows(M, K, 1) buffer, as they are
void CopyInto(const uint16_t* x, int64_t K, int64_t m0, int64_t m1, const SplitRows& s);
// The A-tile buffer for M rows of K in `parts` parts (the caller's thread-local scratch, zeroed
// where padded); fill it with SplitInto / CopyInto over [0, M).
SplitRows PrepareRows(int64_t M, int64_t K, int parts);

// y[m, 64 p0 + c] for m < s.rows and the columns of panels [p0, p1) (p1 - p0 <= kGroupPanels)
// of a packed f32 weight w [P, K, 64] (N columns in all): y = x @ W at f32 accuracy (s: 3 parts).
void GroupProduct(const SplitRows& s, const float* w, int64_t K, int64_t N, int64_t p0, int64_t p1, float* y);
// The same for a packed bf16 weight w [P, ceil(K / 2), 64, 2] (s: 1 part, x bf16): f32 sums of
// the exact bf16 products, one tile dot each (no split).
void GroupProductBf16(const SplitRows& s, const uint16_t* w, int64_t K, int64_t N, int64_t p0, int64_t p1, float* y);

}  // namespace mmjax_amx
