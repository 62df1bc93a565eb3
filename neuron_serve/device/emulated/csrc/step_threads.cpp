// Emulated backend: the threads of a decode step, and the weights they fetch ahead.
//
// A one-sequence decode step streams every weight once (its matmuls), between stretches of
// work on one thread: the small kernels and attention between a layer's matmuls, and the
// host's work between steps (scheduler, sampler, runner). Under OpenMP the other cores wait
// through those stretches, and the memory idles. In decode mode (set by the emulated device
// before each step, Device.before_step) our kernels split their work across threads of our own:
// the calling thread and a helper per other core. A helper with no task fetches the weights
// the step will stream next into the caches, up to kAhead bytes past the matmul that runs,
// so the memory keeps busy while the step works on one thread. The weights' order is
// learned from the matmuls' calls: a decode step calls the same weights in the same order
// every time.
//
// OpenMP runs on one thread in decode mode: its workers, spinning after a parallel region,
// would hold the cores the helpers use. Outside decode mode (mixed steps, whose GEMMs and
// inductor kernels run on OpenMP) the helpers sleep and kernels split on at::parallel_for.

#include "step_threads.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace neuron_serve {
namespace {

// How far the helpers fetch ahead of the running matmul. Part of a 32 MB L3 (Zen 4): the
// weights fetched must still be cached when the matmul reaches them, past the lines the
// matmuls stream meanwhile. 8 MB ran faster than 16 or 24 (benchmarks/README.md, "Design
// measurements").
constexpr int64_t kAhead = int64_t{8} << 20;
constexpr int64_t kFetchChunk = 2048;  // bytes fetched between checks for a task
constexpr auto kIdleSleep = std::chrono::milliseconds(20);  // a helper without work sleeps

// A decode step's weights in the order its matmuls stream them.
struct Ring {
  std::vector<const char*> data;
  std::vector<int64_t> start{0};  // offset of each within the step; back(): the step's bytes
  std::unordered_map<const void*, int64_t> index;

  void add(const void* weights, int64_t bytes) {
    index.emplace(weights, static_cast<int64_t>(data.size()));
    data.push_back(static_cast<const char*>(weights));
    start.push_back(start.back() + bytes);
  }
  int64_t bytes() const { return start.back(); }
  int64_t find(const void* weights) const {
    const auto found = index.find(weights);
    return found == index.end() ? -1 : found->second;
  }
};

// A ticket packs a parallel_for's id, its task count and the next task to claim, so a
// claim never pairs one call's count with another's tasks.
constexpr int kTaskBits = 20;
constexpr uint64_t kTaskMask = (uint64_t{1} << kTaskBits) - 1;
constexpr uint64_t kCallMask = (uint64_t{1} << (64 - 2 * kTaskBits)) - 1;
constexpr uint64_t ticket(uint64_t call, uint64_t tasks, uint64_t next) {
  return call << (2 * kTaskBits) | tasks << kTaskBits | next;
}

class StepThreads {
 public:
  int64_t count() const { return decoding_here ? threads_ : at::get_num_threads(); }

  void set_decode(bool on) {
    if (on == decoding_here) return;
    if (on) {
      const int n = at::get_num_threads();
      if (n < 2) return;  // one core: nothing to share
      start_helpers(n - 1);
      omp_threads_ = n, threads_ = n;
      at::set_num_threads(1);
      decoding_here = true;
      decoding_.store(true);
      wake();
    } else {
      decoding_.store(false);
      decoding_here = false;
      at::set_num_threads(omp_threads_);
    }
  }

  void parallel_for(int64_t n, StepTask f) {
    if (!decoding_here) return at::parallel_for(0, n, 1, f);
    if (n <= 1) {  // as at::parallel_for: one task runs inline
      if (n == 1) f(0, 1);
      return;
    }
    const int64_t ways = std::min(threads_, n), chunk = (n + ways - 1) / ways;
    const int64_t tasks = (n + chunk - 1) / chunk;  // at most threads_
    f_ = &f, n_ = n, chunk_ = chunk;
    done_.store(0, std::memory_order_relaxed);
    call_ = (call_ + 1) & kCallMask;
    ticket_.store(ticket(call_, tasks, 0), std::memory_order_release);
    wake();
    run_tasks(call_, /*helper=*/false);
    while (done_.load(std::memory_order_acquire) < tasks) _mm_pause();  // the helpers' tasks
    std::exception_ptr error;
    std::swap(error, error_);
    if (error) std::rethrow_exception(error);
  }

  void note_weight(const void* weights, int64_t bytes) {
    if (!decoding_here) return;
    if (learning_ && learning_->index.count(weights)) {  // the step came round: ring known
      rings_.push_back(std::move(learning_));
      ring_here_ = rings_.back().get(), lap_ = 0, last_ = -1;
      ring_.store(ring_here_, std::memory_order_release);
    }
    if (learning_) return learning_->add(weights, bytes);
    const int64_t i = ring_here_ ? ring_here_->find(weights) : -1;
    if (i < 0) {  // weights not in the ring: learn a new one
      ring_.store(nullptr, std::memory_order_release);
      ring_here_ = nullptr;
      learning_ = std::make_unique<Ring>();
      return learning_->add(weights, bytes);
    }
    if (i <= last_) ++lap_;
    last_ = i;
    head_.store(lap_ * ring_here_->bytes() + ring_here_->start[i + 1], std::memory_order_release);
    wake();
  }

  std::vector<int64_t> stats() const {
    return {helper_tasks_.load(), fetched_.load(),
            ring_here_ ? static_cast<int64_t>(ring_here_->data.size()) : 0};
  }

 private:
  static thread_local bool decoding_here;  // decode mode is the calling thread's

  void start_helpers(int64_t wanted) {
    if (owner_ != getpid()) helpers_ = 0, owner_ = getpid();  // a forked child has none
    for (; helpers_ < wanted; ++helpers_) std::thread([this] { helper(); }).detach();
  }

  // Claims and runs tasks of parallel_for `call` until none is left.
  void run_tasks(uint64_t call, bool helper) {
    uint64_t now = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t tasks = (now >> kTaskBits) & kTaskMask, next = now & kTaskMask;
      if (now >> (2 * kTaskBits) != call || next >= tasks) return;
      if (!ticket_.compare_exchange_weak(now, now + 1, std::memory_order_acq_rel)) continue;
      const int64_t begin = static_cast<int64_t>(next) * chunk_;
      try {
        (*f_)(begin, std::min(n_, begin + chunk_));
      } catch (...) {
        keep_error(std::current_exception());  // the caller rethrows it once all are done
      }
      if (helper) helper_tasks_.fetch_add(1, std::memory_order_relaxed);
      done_.fetch_add(1, std::memory_order_release);
      now = ticket_.load(std::memory_order_acquire);
    }
  }

  void helper() {
    uint64_t seen = ticket_.load() >> (2 * kTaskBits);
    const Ring* ring = nullptr;
    int64_t cursor = 0;
    auto busy = std::chrono::steady_clock::now();
    for (int64_t spins = 0;; ++spins) {
      if (!decoding_.load(std::memory_order_relaxed)) {
        sleep();
        continue;
      }
      const uint64_t call = ticket_.load(std::memory_order_acquire) >> (2 * kTaskBits);
      if (call != seen) {
        seen = call;
        run_tasks(call, /*helper=*/true);
        busy = std::chrono::steady_clock::now();
        continue;
      }
      if (fetch_ahead(ring, cursor)) continue;
      _mm_pause();
      if (spins % 1024 == 0 && std::chrono::steady_clock::now() - busy > kIdleSleep) {
        sleep();
        busy = std::chrono::steady_clock::now();
      }
    }
  }

  // Fetches the next kFetchChunk bytes of the ring within kAhead of the matmuls' position;
  // false if there is nothing to fetch.
  bool fetch_ahead(const Ring*& ring, int64_t& cursor) {
    const Ring* now = ring_.load(std::memory_order_acquire);
    if (now == nullptr) return false;
    if (now != ring) ring = now, cursor = 0;
    const int64_t head = head_.load(std::memory_order_acquire);
    cursor = std::max(cursor, head);
    if (cursor >= head + std::min(kAhead, ring->bytes())) return false;
    const int64_t at = cursor % ring->bytes();
    const int64_t i = std::upper_bound(ring->start.begin(), ring->start.end(), at) -
                      ring->start.begin() - 1;
    const int64_t bytes = std::min(kFetchChunk, ring->start[i + 1] - at);
    const char* p = ring->data[i] + (at - ring->start[i]);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    cursor += bytes;
    fetched_.fetch_add(bytes, std::memory_order_relaxed);
    return true;
  }

  void keep_error(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = error;
  }

  // Until the caller has news (a task, a matmul's position, decode mode set again).
  void sleep() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t seen = news_.load();
    sleepers_.fetch_add(1);
    wake_.wait(lock, [&] { return news_.load() != seen; });
    sleepers_.fetch_sub(1);
  }

  void wake() {
    news_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
  }

  // The calling thread's state (one thread runs a process's steps).
  int64_t threads_ = 1;
  int omp_threads_ = 1;
  const StepTask* f_ = nullptr;  // the running parallel_for's, on its caller's stack
  int64_t n_ = 0, chunk_ = 1;
  uint64_t call_ = 0;
  std::unique_ptr<Ring> learning_;
  std::vector<std::unique_ptr<Ring>> rings_;  // kept: a helper may still read an old one
  const Ring* ring_here_ = nullptr;
  int64_t lap_ = 0, last_ = -1;
  int64_t helpers_ = 0;
  pid_t owner_ = 0;
  // Shared with the helpers.
  std::atomic<bool> decoding_{false};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<const Ring*> ring_{nullptr};
  std::atomic<int64_t> head_{0};  // how far into the endless repeat of the ring the matmuls are
  std::atomic<int64_t> helper_tasks_{0}, fetched_{0};  // for tests
  std::mutex mutex_;
  std::exception_ptr error_;  // a task's, first of a call (under mutex_)
  std::condition_variable wake_;
  std::atomic<uint64_t> news_{0};
  std::atomic<int> sleepers_{0};
};

thread_local bool StepThreads::decoding_here = false;

// Never destroyed: helpers run until the process exits.
StepThreads& state() {
  static auto* threads = new StepThreads();
  return *threads;
}

void set_decode_mode(bool on) { state().set_decode(on); }
std::vector<int64_t> decode_thread_stats() { return state().stats(); }

}  // namespace

int64_t step_thread_count() { return state().count(); }

void step_parallel_for(int64_t n, StepTask f) {
  state().parallel_for(n, f);
}

void note_weight_stream(const void* weights, int64_t bytes) { state().note_weight(weights, bytes); }

}  // namespace neuron_serve

TORCH_LIBRARY_FRAGMENT(neuron_serve, m) {
  m.def("set_decode_mode(bool on) -> ()", &neuron_serve::set_decode_mode);
  m.def("decode_thread_stats() -> int[]", &neuron_serve::decode_thread_stats);
}
