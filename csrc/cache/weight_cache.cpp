// The native weight cache: one process-wide table of MXFP8 copies of weights, and the release /
// restore of their BF16 storage (DESIGN.md §5).
//
// An entry is keyed by the weight's TensorImpl and holds it weakly: the weak reference keeps the
// TensorImpl's memory block (so the key cannot be reused by another tensor) but not the tensor,
// and a lookup or a sweep drops the entry of a weight that died, with its FP8 tensors.
//
// Release frees the storage's memory and poisons it with c10's data-pointer error, so that any
// read or write of the released weight raises a Python error that names it and says how to get
// it back; restore clears the error and re-allocates the original number of bytes. The storage
// object itself stays, so every tensor and autograd node that refers to it stays valid, and
// gradients (which only need shape metadata) still accumulate into the released leaf.
//
// The kernels are registered for CompositeExplicitAutograd: quantization is called through the
// dispatcher, so the cache works for any device that has the zrw quantization kernels.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../common/checks.h"

namespace zrw::cache {
namespace {

enum class Recipe { MXFP8, MXFP8_32x32 };

Recipe parse_recipe(const char* op, const std::string& r) {
  if (r == "mxfp8") return Recipe::MXFP8;
  if (r == "mxfp8-32x32") return Recipe::MXFP8_32x32;
  TORCH_CHECK_VALUE(false, op, ": recipe must be \"mxfp8\" or \"mxfp8-32x32\", got \"", r, "\"");
}

enum class Fill { Empty, Zeros, Dequant };

Fill parse_fill(const char* op, const std::string& f) {
  if (f == "empty") return Fill::Empty;
  if (f == "zeros") return Fill::Zeros;
  if (f == "dequant") return Fill::Dequant;
  TORCH_CHECK_VALUE(false, op, ": fill must be \"empty\", \"zeros\" or \"dequant\" (\"master\" is "
                    "handled by zrw.ops.restore with MasterWeights), got \"", f, "\"");
}

// Why a weight was not released; each reason has its own counter in cache_stats().
constexpr const char* kReleased = "released";
constexpr const char* kSkipReleaseFalse = "release_false";
constexpr const char* kSkipNoGrad = "no_grad";
constexpr const char* kSkipNonLeaf = "non_leaf";
constexpr const char* kSkipFrozen = "frozen";
constexpr const char* kSkipFlatBuffer = "flat_buffer";
constexpr const char* kSkipAliased = "aliased";
constexpr const char* kSkipReasons[] = {kSkipReleaseFalse, kSkipNoGrad,      kSkipNonLeaf,
                                        kSkipFrozen,       kSkipFlatBuffer, kSkipAliased};

using WeakWeight = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Entry {
  explicit Entry(WeakWeight w) : weight(std::move(w)) {}
  WeakWeight weight;
  std::string name;
  Recipe recipe;
  at::ScalarType elem_dtype;
  std::string scale_mode;
  // mxfp8: {data_fwd, scale_fwd, data_bwd, scale_bwd};
  // mxfp8-32x32: {data, scale_fwd, data, scale_bwd, block_scale} (one data tensor, twice).
  std::vector<at::Tensor> tensors;
  int64_t storage_nbytes = 0;  // the storage's bytes before release
  const char* status = kReleased;  // kReleased or a skip reason
  bool released = false;
  bool frozen = false;  // released with release_frozen: FP8 only for good, survives step ends
  uint32_t version = 0;
  int64_t step = 0;
  int64_t hits = 0;
  int64_t misses = 0;
};

int64_t fp8_bytes(const Entry& e) {
  int64_t n = 0;
  const void* seen_data = nullptr;
  for (const auto& t : e.tensors) {
    if (t.const_data_ptr() == seen_data) continue;  // the 32x32 data tensor is listed twice
    if (t.scalar_type() != at::kFloat8_e8m0fnu) seen_data = t.const_data_ptr();
    n += t.nbytes();
  }
  return n;
}

class WeightCache {
 public:
  static WeightCache& get() {
    static WeightCache* cache = new WeightCache();  // never destroyed: outlives Python's exit
    return *cache;
  }

  std::vector<at::Tensor> quant_and_release(const at::Tensor& w, const std::string& recipe_str,
                                            bool release, bool release_frozen,
                                            at::ScalarType elem_dtype,
                                            const std::string& scale_mode,
                                            const std::string& name) {
    constexpr const char* op = "zrw.quant_and_release";
    const Recipe recipe = parse_recipe(op, recipe_str);
    checks::check_elem_dtype(op, "elem_dtype", elem_dtype);
    checks::parse_scale_mode(op, scale_mode);
    checks::check_weight_rank(op, w);
    std::lock_guard<std::mutex> lock(mu_);
    sweep_locked();
    c10::TensorImpl* key = w.unsafeGetTensorImpl();
    auto it = table_.find(key);
    if (it != table_.end()) {
      Entry& e = it->second;
      const bool same_recipe = e.recipe == recipe && e.elem_dtype == elem_dtype &&
                               e.scale_mode == scale_mode;
      const bool fresh = e.frozen || (e.step == step_ && (e.released || e.version ==
                                                          w.unsafeGetTensorImpl()
                                                              ->version_counter()
                                                              .current_version()));
      if (same_recipe && fresh) {
        ++e.hits;
        ++hits_;
        // Cached under no_grad (a reentrant checkpoint's forward) and now used for training
        // (its recompute): release now. release=False stays an explicit choice for the step.
        if (!e.released && release && e.status == kSkipNoGrad) {
          const char* status = release_guard(w, release, release_frozen);
          if (status == kReleased) {
            release_storage(w, e.name);
            e.released = true;
            e.frozen = !w.requires_grad();
            e.status = kReleased;
          }
        }
        return e.tensors;
      }
      TORCH_CHECK(!e.released || same_recipe, op, ": weight '", e.name,
                  "' is released with recipe ", recipe_name(e.recipe), ", element dtype ",
                  e.elem_dtype, " and scale mode \"", e.scale_mode, "\" but was asked for \"",
                  recipe_str, "\", ", elem_dtype, ", \"", scale_mode,
                  "\"; restore it first (zrw.ops.restore or the optimizer boundary)");
      TORCH_CHECK(!e.released, op, ": weight '", e.name, "' was released in step ", e.step,
                  " and never restored, but the cache is at step ", step_,
                  ": next_step() ran without the optimizer boundary's restore_all() (use "
                  "zrw.optim.attach, or call zrw.ops.restore_all() before next_step())");
      table_.erase(it);  // stale: quantized in an earlier step or written since
    }

    Entry e{WeakWeight(w.getIntrusivePtr())};
    e.name = name.empty() ? "<unnamed weight>" : name;
    e.recipe = recipe;
    e.elem_dtype = elem_dtype;
    e.scale_mode = scale_mode;
    e.step = step_;
    e.misses = 1;
    ++misses_;
    e.tensors = quantize(w, recipe, elem_dtype, scale_mode);
    e.version = key->version_counter().current_version();
    e.storage_nbytes = static_cast<int64_t>(w.storage().nbytes());
    e.status = release_guard(w, release, release_frozen);
    if (e.status == kReleased) {
      release_storage(w, e.name);
      e.released = true;
      e.frozen = !w.requires_grad();
    } else {
      ++skips_[e.status];
    }
    auto out = e.tensors;
    table_.emplace(key, std::move(e));
    return out;
  }

  // Restores one weight; returns false if it was not released (a documented no-op).
  bool restore(const at::Tensor& w, const std::string& fill_str) {
    const Fill fill = parse_fill("zrw.restore", fill_str);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(w.unsafeGetTensorImpl());
    if (it == table_.end() || !it->second.released) return false;
    restore_entry_locked(w, it->second, fill);
    table_.erase(it);
    return true;
  }

  // The optimizer boundary: drop every FP8 entry of a trainable weight, restoring released
  // storages. With "empty"/"zeros" the FP8 copies are freed before the BF16 bytes are
  // allocated, so the boundary's peak is the smaller of the two; "dequant" needs each copy until
  // its weight is filled. Frozen (release_frozen) entries survive. Returns the number restored.
  int64_t restore_all(const std::string& fill_str) {
    const Fill fill = parse_fill("zrw.restore_all", fill_str);
    std::lock_guard<std::mutex> lock(mu_);
    sweep_locked();
    std::vector<std::pair<at::Tensor, Entry>> to_restore;
    for (auto it = table_.begin(); it != table_.end();) {
      Entry& e = it->second;
      if (e.frozen) {
        ++it;
        continue;
      }
      if (e.released) {
        auto strong = e.weight.lock();
        if (strong) to_restore.emplace_back(at::Tensor(std::move(strong)), std::move(e));
      }
      it = table_.erase(it);
    }
    if (fill != Fill::Dequant) {
      for (auto& [w, e] : to_restore) e.tensors.clear();
    }
    for (auto& [w, e] : to_restore) {
      restore_entry_locked(w, e, fill);
      e.tensors.clear();
    }
    return static_cast<int64_t>(to_restore.size());
  }

  // Drops one entry. A released weight is restored first (with `fill`; default "dequant", the
  // only source left for a frozen weight), so the only copy is never dropped.
  bool invalidate(const at::Tensor& w, const std::string& fill_str) {
    const Fill fill = parse_fill("zrw.cache_invalidate", fill_str);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(w.unsafeGetTensorImpl());
    if (it == table_.end()) return false;
    if (it->second.released) restore_entry_locked(w, it->second, fill);
    table_.erase(it);
    return true;
  }

  void clear(const std::string& fill_str) {
    const Fill fill = parse_fill("zrw.cache_clear", fill_str);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, e] : table_) {
      if (!e.released) continue;
      auto strong = e.weight.lock();
      if (strong) restore_entry_locked(at::Tensor(std::move(strong)), e, fill);
    }
    table_.clear();
    hits_ = misses_ = 0;
    skips_.clear();
  }

  void next_step() {
    std::lock_guard<std::mutex> lock(mu_);
    ++step_;
  }

  std::tuple<std::vector<std::string>, std::vector<int64_t>> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    sweep_locked();
    int64_t fp8 = 0, released_bytes = 0, released = 0, frozen = 0;
    for (const auto& [key, e] : table_) {
      fp8 += fp8_bytes(e);
      if (e.released) {
        ++released;
        released_bytes += e.storage_nbytes;
      }
      frozen += e.frozen;
    }
    std::vector<std::string> names = {"entries", "fp8_bytes",       "released",
                                      "released_bytes", "frozen", "hits",
                                      "misses",  "step"};
    std::vector<int64_t> values = {static_cast<int64_t>(table_.size()), fp8, released,
                                   released_bytes, frozen, hits_, misses_, step_};
    for (const char* reason : kSkipReasons) {
      names.push_back(std::string("skip_") + reason);
      auto s = skips_.find(reason);
      values.push_back(s == skips_.end() ? 0 : s->second);
    }
    return {names, values};
  }

  // Per-entry view for debugging and tests: (name, status, hits, misses, storage bytes).
  std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<int64_t>,
             std::vector<int64_t>, std::vector<int64_t>>
  entries() {
    std::lock_guard<std::mutex> lock(mu_);
    sweep_locked();
    std::vector<std::string> names, status;
    std::vector<int64_t> hits, misses, nbytes;
    for (const auto& [key, e] : table_) {
      names.push_back(e.name);
      status.push_back(e.status);
      hits.push_back(e.hits);
      misses.push_back(e.misses);
      nbytes.push_back(e.storage_nbytes);
    }
    return {names, status, hits, misses, nbytes};
  }

  // 0: never seen, 1: cached, 2: cached and released, 3: released for good (frozen).
  int64_t state(const at::Tensor& w) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(w.unsafeGetTensorImpl());
    if (it == table_.end()) return 0;
    if (!it->second.released) return 1;
    return it->second.frozen ? 3 : 2;
  }

 private:
  static const char* recipe_name(Recipe r) {
    return r == Recipe::MXFP8 ? "\"mxfp8\"" : "\"mxfp8-32x32\"";
  }

  // Drops entries whose weight died (the weak reference expired); their FP8 tensors go too.
  void sweep_locked() {
    for (auto it = table_.begin(); it != table_.end();) {
      if (it->second.weight.expired()) {
        it = table_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // A block scale (.., NB, KB) -> the per-axis scale (.., N, KB) (along_rows: each tile row
  // repeated 32 times, cut to n rows) or (.., NB, K) (columns, cut to n).
  static at::Tensor expand_tiles(const at::Tensor& b8, bool along_rows, int64_t n) {
    const int64_t d = b8.dim();
    auto e = b8.unsqueeze(along_rows ? d - 1 : d);
    auto sizes = e.sizes().vec();
    sizes[along_rows ? d - 1 : d] = 32;
    auto flat = b8.sizes().vec();
    flat[along_rows ? d - 2 : d - 1] *= 32;
    return e.expand(sizes).reshape(flat).narrow(along_rows ? d - 2 : d - 1, 0, n).clone(
        at::MemoryFormat::Contiguous);
  }

  static std::vector<at::Tensor> quantize(const at::Tensor& w, Recipe recipe,
                                          at::ScalarType elem_dtype,
                                          const std::string& scale_mode) {
    // FP8 outputs carry no autograd history: quantize below the autograd keys.
    at::AutoDispatchBelowADInplaceOrView guard;
    if (recipe == Recipe::MXFP8) {
      static auto op = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("zrw::mx_quantize_dual", "")
                           .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                               const at::Tensor&, at::ScalarType, c10::string_view)>();
      auto [df, sf, db, sb] = op.call(w, elem_dtype, scale_mode);
      return {df, sf, db, sb};
    }
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("zrw::mx_quantize_block", "")
                         .typed<std::tuple<at::Tensor, at::Tensor>(
                             const at::Tensor&, at::ScalarType, c10::string_view)>();
    auto [data, block] = op.call(w, elem_dtype, scale_mode);
    // The per-axis scales the GEMMs read, expanded once here instead of on every hit.
    const int64_t N = w.size(-2), K = w.size(-1);
    // expand + reshape + clone: one copy each, and the clone (unlike contiguous() of a
    // narrowed row range) never keeps the padding rows of the last tile alive.
    auto b8 = block.view(at::kByte);
    auto scale_fwd = expand_tiles(b8, /*along_rows=*/true, N).view(at::kFloat8_e8m0fnu);
    auto scale_bwd = expand_tiles(b8, /*along_rows=*/false, K).view(at::kFloat8_e8m0fnu);
    return {data, scale_fwd, data, scale_bwd, block};
  }

  // The release guard (DESIGN.md §5). Returns kReleased or the reason to keep the storage.
  static const char* release_guard(const at::Tensor& w, bool release, bool release_frozen) {
    if (!release) return kSkipReleaseFalse;
    if (!c10::GradMode::is_enabled()) return kSkipNoGrad;
    if (!w.is_leaf()) return kSkipNonLeaf;
    if (!w.requires_grad() && !release_frozen) return kSkipFrozen;
    const int64_t tensor_bytes = w.numel() * static_cast<int64_t>(w.element_size());
    // A view into a larger buffer (Megatron-style flat buffers) must keep the whole buffer.
    if (w.storage_offset() != 0 || static_cast<int64_t>(w.storage().nbytes()) > tensor_bytes ||
        !w.is_non_overlapping_and_dense()) {
      return kSkipFlatBuffer;
    }
    // Another tensor shares the storage (e.g. nn.Parameter(t) while t lives): freeing it would
    // pull the data from under that tensor too. The Python storage object, once something has
    // called untyped_storage() (Hugging Face's init does), holds one reference of its own; it is
    // not another tensor, and reading through it after release raises the poison error.
    const c10::StorageImpl* s = w.storage().unsafeGetStorageImpl();
    const size_t python_ref = s->pyobj_slot()->load_pyobj() != nullptr ? 1 : 0;
    if (w.storage().use_count() > 1 + python_ref) return kSkipAliased;
    return kReleased;
  }

  static void release_storage(const at::Tensor& w, const std::string& name) {
    c10::StorageImpl* s = w.storage().unsafeGetStorageImpl();
    s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));  // frees the bytes
    // nbytes keeps the logical size on purpose: with 0, creating any view of the weight (print,
    // F.linear's transpose) fails on a storage-size check before the data pointer is touched,
    // with a message that says nothing about zrw. The bytes are gone all the same: zrw.memory
    // and cache_stats()["released_bytes"] account for them.
    s->release_data_and_set_meta_custom_data_ptr_error_msg_(
        "zrw: the BF16 storage of weight '" + name +
        "' is released (zero-redundancy weights: only its MXFP8 copy lives between the first "
        "forward of a step and the optimizer step). It holds no data now; read it after the "
        "optimizer boundary (zrw.optim.attach) restores it, or restore it explicitly with "
        "zrw.ops.restore(w, fill=\"master\") (exact, with zrw.optim.MasterWeights) or "
        "fill=\"dequant\" (lossy), or run this code under zrw.no_release()");
  }

  static void restore_entry_locked(const at::Tensor& w, const Entry& e, Fill fill) {
    c10::StorageImpl* s = w.storage().unsafeGetStorageImpl();
    s->clear_data_ptr_access_error_msg_();
    c10::Allocator* alloc = s->allocator();
    if (alloc == nullptr) alloc = c10::GetAllocator(s->device_type());
    s->set_data_ptr_noswap(alloc->allocate(e.storage_nbytes));
    if (fill == Fill::Empty) return;
    at::NoGradGuard no_grad;
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor target = w.detach();
    if (fill == Fill::Zeros) {
      target.zero_();
      return;
    }
    TORCH_CHECK(!e.tensors.empty(), "zrw: cannot restore weight '", e.name,
                "' by dequantization: its FP8 copy is gone");
    static auto deq = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("zrw::mx_dequantize", "")
                          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                                            at::ScalarType)>();
    target.copy_(deq.call(e.tensors[0], e.tensors[1], -1, w.scalar_type()));
  }

  std::mutex mu_;
  std::unordered_map<c10::TensorImpl*, Entry> table_;
  std::map<std::string, int64_t> skips_;
  int64_t hits_ = 0, misses_ = 0, step_ = 0;
};

std::vector<at::Tensor> quant_and_release(const at::Tensor& w, c10::string_view recipe,
                                          bool release, bool release_frozen,
                                          at::ScalarType elem_dtype, c10::string_view scale_mode,
                                          c10::string_view name) {
  return WeightCache::get().quant_and_release(w, std::string(recipe), release, release_frozen,
                                              elem_dtype, std::string(scale_mode),
                                              std::string(name));
}

bool restore(const at::Tensor& w, c10::string_view fill) {
  return WeightCache::get().restore(w, std::string(fill));
}

int64_t restore_all(c10::string_view fill) {
  return WeightCache::get().restore_all(std::string(fill));
}

bool cache_invalidate(const at::Tensor& w, c10::string_view fill) {
  return WeightCache::get().invalidate(w, std::string(fill));
}

void cache_clear(c10::string_view fill) { WeightCache::get().clear(std::string(fill)); }

void next_step() { WeightCache::get().next_step(); }

std::tuple<std::vector<std::string>, std::vector<int64_t>> cache_stats() {
  return WeightCache::get().stats();
}

std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<int64_t>,
           std::vector<int64_t>, std::vector<int64_t>>
cache_entries() {
  return WeightCache::get().entries();
}

int64_t cache_state(const at::Tensor& w) { return WeightCache::get().state(w); }

}  // namespace

// Tensor ops dispatch on their weight. They are registered for Autograd too, so that autograd
// attaches no history to the FP8 outputs (they are not differentiable; the training layers own
// the gradient formulas). The table-wide ops take no tensor.
TORCH_LIBRARY_IMPL(zrw, CompositeExplicitAutograd, m) {
  m.impl("quant_and_release", &quant_and_release);
  m.impl("restore", &restore);
  m.impl("cache_invalidate", &cache_invalidate);
  m.impl("cache_state", &cache_state);
}

TORCH_LIBRARY_IMPL(zrw, Autograd, m) {
  m.impl("quant_and_release", &quant_and_release);
  m.impl("restore", &restore);
  m.impl("cache_invalidate", &cache_invalidate);
  m.impl("cache_state", &cache_state);
}

TORCH_LIBRARY_IMPL(zrw, CompositeExplicitAutograd, m) {
  m.impl("restore_all", &restore_all);
  m.impl("cache_clear", &cache_clear);
  m.impl("next_step", &next_step);
  m.impl("cache_stats", &cache_stats);
  m.impl("cache_entries", &cache_entries);
}

}  // namespace zrw::cache
