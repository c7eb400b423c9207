#include "counting_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>

namespace zrw::memory {
namespace {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    const int64_t now = current_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    // The context owns the base allocation and remembers its size for the free.
    return {data, new Block{std::move(inner), n, this}, &free_block, device};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t current() const { return current_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(current_.load()); }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t nbytes;
    CountingAllocator* owner;
  };

  static void free_block(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    b->owner->current_.fetch_sub(static_cast<int64_t>(b->nbytes));
    delete b;  // frees the base allocation
  }

  c10::Allocator* base_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

std::mutex g_mu;
CountingAllocator* g_allocator = nullptr;  // never destroyed: blocks may outlive everything

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

}  // namespace zrw::memory
