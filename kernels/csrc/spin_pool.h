// The CPU ops' thread pool: parallel_for with at::parallel_for's chunking, run on threads
// that spin for a while after each call before they sleep.
//
// A decode step at batch 1 is ~150 parallel regions of 10-100 us each. torch's OpenMP threads
// sleep between regions (OMP_WAIT_POLICY passive), and waking them costs 50-70 us a region:
// most of the step. OMP_WAIT_POLICY=active spins forever, burning a core while the worker
// idles. These threads spin only `spin_us` (SKIFF_CPU_SPIN_US, default 200) after their last
// work, which covers the gaps inside a step and between the layers of one, and then sleep on
// a condition variable until the next call.
#pragma once

#include <cstdint>
#include <functional>

namespace skiff_cpu {

// fn(b, e) over [begin, end) cut like at::parallel_for: min(threads, ceil(range / grain))
// contiguous chunks, one per thread, the calling thread taking the first. Runs inline when one
// chunk covers the range, when called from inside a chunk, or while another thread's call holds
// the pool (then through at::parallel_for). Exceptions of a chunk reach the caller.
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);

}  // namespace skiff_cpu
