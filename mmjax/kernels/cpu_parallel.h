// Shared by mmjax's CPU kernels (cpu_gemv.cc, cpu_attention.cc; built into one library by
// mmjax/kernels/cpu_library.py): the CPU feature check and the work split over XLA's intra-op
// thread pool.
#pragma once

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

// 0: choose at run time, 1: force the plain C++ loops (tests), set through mmjax_gemv_set_generic.
inline std::atomic<int> g_force_generic{0};

// AVX-512 F/BW/VL/VNNI/BF16 (Zen 4, Sapphire Rapids and later), unless the plain loops are forced.
inline bool HasAvx512() {
#if defined(__x86_64__)
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16");
  return ok && g_force_generic.load(std::memory_order_relaxed) == 0;
#else
  return false;
#endif
}

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
