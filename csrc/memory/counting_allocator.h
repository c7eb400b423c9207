// A counting CPU allocator (docs/design.md §9): wraps c10's CPU allocator through
// c10::SetCPUAllocator and keeps current and peak live bytes, like
// torch.cuda.memory_allocated / max_memory_allocated. Blocks allocated before install() are
// invisible to it (their frees too), so install it before the model is built.
#pragma once

#include <cstdint>

namespace zrw::memory {

void install();
bool installed();
int64_t current_bytes();
int64_t peak_bytes();
void reset_peak();
// Fault injection (tests): of the allocations of >= min_bytes, the next `skip` succeed and the
// `count` after them raise OutOfMemoryError.
void fail_next(int64_t min_bytes, int64_t skip, int64_t count);
int64_t pending_failures();

}  // namespace zrw::memory
