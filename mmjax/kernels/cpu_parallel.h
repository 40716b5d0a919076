// Shared by mmjax's CPU kernels (cpu_gemv.cc, cpu_attention.cc; built into one library by
// mmjax/kernels/cpu_library.py): the CPU feature check and the work split over XLA's intra-op
// thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace mmjax_cpu {

namespace ffi = xla::ffi;

// The kernels' code paths, lowest first: plain C++ loops (any CPU), AVX2 + FMA (Haswell, Zen 1-3
// and later), AVX-512 F/BW/VL/VNNI/BF16 (Zen 4, Sapphire Rapids and later). mmjax/kernels/
// cpu_library.py uses the kernels only where one of the SIMD paths runs (the plain loops are
// slower than XLA's own ops, there to test against and for nothing else).
enum Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

// the highest path allowed (tests lower it to run a lower path), set through mmjax_cpu_set_isa
inline std::atomic<int> g_isa_cap{kAvx512};

inline int DetectedIsa() {
#if defined(__x86_64__)
  static const int isa = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                                 __builtin_cpu_supports("avx512bf16")
                             ? kAvx512
                         : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? kAvx2
                                                                                            : kGeneric;
  return isa;
#else
  return kGeneric;
#endif
}

// the path the kernels take now: the CPU's best, at most the cap
inline int ActiveIsa() { return std::min(DetectedIsa(), g_isa_cap.load(std::memory_order_relaxed)); }
inline bool HasAvx512() { return ActiveIsa() == kAvx512; }
inline bool HasAvx2() { return ActiveIsa() == kAvx2; }

// ---------------------------------------------------------------------------------------------
// Threads: `parts` tiles claimed from a shared counter by the caller and by up to `threads - 1`
// tasks on XLA's intra-op pool. The caller waits only for tiles someone has claimed (those are
// running), so a pool that runs tasks late, or never in parallel, cannot deadlock it; the shared
// state outlives tasks that start after the call has returned. (Own helper threads that spin
// between calls were tried: no faster matmuls, and a decode step 3.5 ms slower in its host
// part, which the spinning thread took a core from.)

struct Job {
  std::atomic<int> next{0};
  std::atomic<int> done{0};
  int parts = 1;
  void* fn = nullptr;              // the caller's callable (alive until done == parts)
  void (*call)(void*, int) = nullptr;
  void Work() {
    for (int p; (p = next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      call(fn, p);
      done.fetch_add(1, std::memory_order_release);
    }
  }
  void WaitClaimed() {
    for (int spins = 0; done.load(std::memory_order_acquire) < parts; ++spins) {
      if (spins < 4096) {
#if defined(__x86_64__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }
};

template <typename F>
inline void ParallelFor(ffi::ThreadPool& pool, int threads, int parts, F&& f) {
  if (parts <= 1 || threads <= 1) {
    for (int p = 0; p < parts; ++p) f(p);
    return;
  }
  auto job = std::make_shared<Job>();
  job->parts = parts;
  using Fn = std::remove_reference_t<F>;
  job->fn = const_cast<void*>(static_cast<const void*>(&f));
  job->call = [](void* fn, int p) { (*static_cast<Fn*>(fn))(p); };
  for (int i = 1; i < threads && i < parts; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  job->WaitClaimed();
}

}  // namespace mmjax_cpu
