// Work units shared out on torch's threads from one counter (csrc/linear/packed_linear.cpp,
// csrc/linear/packed_quant.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#ifndef _OPENMP
#error "compile with -fopenmp: without it at::parallel_for runs on one thread"
#endif

namespace pdserve {

// f(u) for u in [0, units) on the pool's threads, each taking the next unit from a shared
// counter as it finishes one: a thread the OS or the hypervisor takes away for a while leaves
// its share to the others instead of holding them at the join (a static split makes every
// thread wait for the slowest). Units are claimed in order, so neighbours still share caches.
// An output's bits do not depend on which thread computes it.
template <class F>
void dynamic_for(int64_t units, F&& f) {
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), units);
  if (nt <= 1 || at::in_parallel_region()) {
    for (int64_t u = 0; u < units; ++u) f(u);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) f(u);
  });
}

}  // namespace pdserve
