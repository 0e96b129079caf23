// The spinning thread pool of spin_pool.h.
#include "spin_pool.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace skiff_cpu {
namespace {

using Clock = std::chrono::steady_clock;

thread_local bool in_chunk = false;  // this thread runs a chunk: nested calls run inline

std::chrono::microseconds spin_time() {
  const char* env = std::getenv("SKIFF_CPU_SPIN_US");
  return std::chrono::microseconds(env ? std::atoll(env) : 200);
}

// `size` - 1 worker threads and the caller; job(i) runs on thread i of [0, size) per call.
class SpinPool {
 public:
  explicit SpinPool(int size) : size_(size), spin_(spin_time()) {
    for (int i = 1; i < size; ++i) workers_.emplace_back([this, i] { work(i); });
  }

  ~SpinPool() {
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stop_ = true;
      epoch_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  int size() const { return size_; }

  // job(i) on every thread i (the caller is 0); returns once all are done.
  void run(const std::function<void(int)>& job) {
    job_ = &job;
    error_ = nullptr;
    pending_.store(size_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);  // a worker going to sleep sees it
      epoch_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run_job(0);
    while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
    if (error_) std::rethrow_exception(error_);
  }

  std::mutex caller;  // one call at a time

 private:
  void run_job(int i) {
    in_chunk = true;
    try {
      (*job_)(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    in_chunk = false;
  }

  // Spin for the next epoch until spin_ has passed since the last job, then sleep.
  void work(int i) {
    uint64_t seen = 0;
    while (true) {
      const auto until = Clock::now() + spin_;
      for (int n = 1; epoch_.load(std::memory_order_acquire) == seen; ++n) {
        _mm_pause();
        if (n % 256 != 0) continue;
        if (Clock::now() < until) {
          std::this_thread::yield();  // another thread runnable on this core goes first
          continue;
        }
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        wake_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
      }
      seen = epoch_.load(std::memory_order_acquire);
      if (stop_) return;
      run_job(i);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  const int size_;
  const std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int)>* job_ = nullptr;
  std::exception_ptr error_;
  std::mutex error_mutex_;
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
};

// The pool of torch's thread count, made again when it changes (the old one ends with its
// last call) or after a fork (the workers do not survive one: the old pool is leaked).
std::shared_ptr<SpinPool> pool(int size) {
  static std::mutex mutex;
  static std::shared_ptr<SpinPool> current;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (owner != getpid()) {
    new std::shared_ptr<SpinPool>(std::move(current));
    owner = getpid();
  }
  if (!current || current->size() != size) current = std::make_shared<SpinPool>(size);
  return current;
}

}  // namespace

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  const int64_t threads = at::get_num_threads();
  if (in_chunk || at::in_parallel_region() || threads == 1 || range <= grain) {
    fn(begin, end);
    return;
  }
  const auto p = pool(static_cast<int>(threads));
  std::unique_lock<std::mutex> lock(p->caller, std::try_to_lock);
  if (!lock.owns_lock()) {
    at::parallel_for(begin, end, grain, fn);
    return;
  }
  const int64_t chunks = std::min<int64_t>(threads, (range + grain - 1) / grain);
  const int64_t chunk = (range + chunks - 1) / chunks;
  p->run([&](int i) {
    const int64_t b = begin + i * chunk;
    if (i < chunks && b < end) fn(b, std::min(end, b + chunk));
  });
}

}  // namespace skiff_cpu
