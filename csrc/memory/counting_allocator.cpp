#include "counting_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace zrw::memory {
namespace {

// Data pointers stay "simple" (context == data), as c10's CPU allocator's are: torch code such as
// oneDNN's raw_allocate asserts it. So the size of each live block is kept in a table keyed by
// its address, and the free looks it up.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    maybe_inject_failure(n);
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    if (data == nullptr) return inner;  // zero-byte allocations carry nothing to count
    TORCH_CHECK(inner.get_context() == data,
                "zrw.memory: the CPU allocator being wrapped returns non-simple data pointers; "
                "the counting allocator cannot wrap it");
    c10::DeleterFnPtr base_deleter = inner.get_deleter();
    inner.release_context();  // ownership moves to this allocator's table
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_[data] = Block{n, base_deleter};
    }
    const int64_t now = current_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &free_block, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t current() const { return current_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(current_.load()); }

  // Fault injection for tests: of the allocations of at least `min_bytes`, the next `skip`
  // succeed and the `count` after them fail with an OutOfMemoryError, as a real out-of-memory
  // would.
  void fail_next(int64_t min_bytes, int64_t skip, int64_t count) {
    std::lock_guard<std::mutex> lock(fail_mu_);
    fail_min_bytes_ = min_bytes;
    fail_skip_ = skip;
    fail_count_.store(count);
  }

  int64_t pending_failures() const { return fail_count_.load(); }

  static void free_block(void* ptr);

 private:
  struct Block {
    size_t nbytes;
    c10::DeleterFnPtr base_deleter;
  };

  // Compiled only into a test build (ZRW_TEST_OPS=ON, the default for a build from a clone, which
  // defines ZRW_FAULT_INJECTION); a packaged build has no fault injection on its allocation path.
  void maybe_inject_failure(size_t n) {
#ifndef ZRW_FAULT_INJECTION
    (void)n;
  }
#else
    if (fail_count_.load() <= 0) return;  // the common case: one atomic load
    {
      std::lock_guard<std::mutex> lock(fail_mu_);
      if (fail_count_.load() <= 0 || static_cast<int64_t>(n) < fail_min_bytes_) return;
      if (fail_skip_ > 0) {
        --fail_skip_;
        return;
      }
      fail_count_.fetch_sub(1);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, "zrw.testing: injected allocation failure (", n,
                     " bytes; zrw.testing.fail_allocations)");
  }
#endif

  c10::Allocator* base_;
  std::mutex fail_mu_;
  int64_t fail_min_bytes_ = 0;
  int64_t fail_skip_ = 0;
  std::atomic<int64_t> fail_count_{0};
  std::mutex mu_;
  std::unordered_map<void*, Block> live_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

std::mutex g_mu;
CountingAllocator* g_allocator = nullptr;  // never destroyed: blocks may outlive everything

void CountingAllocator::free_block(void* ptr) {
  if (ptr == nullptr) return;
  CountingAllocator* self = g_allocator;
  Block block{};
  {
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->live_.find(ptr);
    TORCH_INTERNAL_ASSERT(it != self->live_.end(), "zrw.memory: freeing an unknown block");
    block = it->second;
    self->live_.erase(it);
  }
  self->current_.fetch_sub(static_cast<int64_t>(block.nbytes));
  block.base_deleter(ptr);
}

}  // namespace

void install() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_allocator != nullptr) return;
  g_allocator = new CountingAllocator(c10::GetCPUAllocator());
  // Highest priority, so that a later default registration cannot displace it.
  c10::SetCPUAllocator(g_allocator, /*priority=*/255);
}

bool installed() { return g_allocator != nullptr; }
int64_t current_bytes() { return g_allocator ? g_allocator->current() : 0; }
int64_t peak_bytes() { return g_allocator ? g_allocator->peak() : 0; }
void reset_peak() {
  if (g_allocator) g_allocator->reset_peak();
}
void fail_next(int64_t min_bytes, int64_t skip, int64_t count) {
  TORCH_CHECK(g_allocator != nullptr, "zrw.memory: install() the counting allocator first");
  g_allocator->fail_next(min_bytes, skip, count);
}
int64_t pending_failures() { return g_allocator ? g_allocator->pending_failures() : 0; }

}  // namespace zrw::memory
