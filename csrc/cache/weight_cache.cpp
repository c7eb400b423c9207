// The native weight cache: one process-wide table of MXFP8 copies of weights, and the release /
// restore of their BF16 storage (docs/design.md §5).
//
// An entry is keyed by the weight's TensorImpl and holds it weakly: the weak reference keeps the
// TensorImpl's memory block (so the key cannot be reused by another tensor) but not the tensor,
// and a lookup or a sweep drops the entry of a weight that died, with its FP8 tensors.
//
// Release frees the storage's memory and poisons it with c10's data-pointer error, so that any
// read or write of the released weight raises a Python error that names it and says how to get
// it back. The storage object itself stays, so every tensor and autograd node that refers to it
// stays valid, and gradients (which only need shape metadata) still accumulate into the
// released leaf.
//
// Restore is the one path that writes a released weight back, and it keeps these invariants
// (docs/design.md §5, "Safety invariants"), whatever fails on the way:
//  - it writes only into the storage the weight was released with (the entry keeps it), with
//    the dtype and geometry recorded at release, after checking that the weight still holds
//    that storage with that layout; a mismatch raises and changes nothing;
//  - it allocates the bytes and fills them (zeros, dequantized FP8, the FP32 master) before it
//    installs them and clears the poison: a failed allocation or fill leaves the weight exactly
//    as it was, released, with its entry and FP8 copy;
//  - batch restores are all-or-nothing per weight: every weight that could not be restored
//    keeps its entry, and the error raised after the loop names each one;
//  - all of it runs under the cache's lock, fills included, so concurrent quant_and_release,
//    restore and assign calls on the same weights are serialized.
//
// The kernels are registered for CompositeExplicitAutograd: quantization is called through the
// dispatcher, so the cache works for any device that has the zrw quantization kernels.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../common/checks.h"
#include "../common/digest.h"
#include "../common/names.h"
#include "../mx/mx_block_scale.h"

namespace zrw::cache {
namespace {

enum class Recipe { MXFP8, MXFP8_32x32 };

Recipe parse_recipe(const char* op, const std::string& r) {
  if (r == names::kCacheRecipes[0]) return Recipe::MXFP8;
  if (r == names::kCacheRecipes[1]) return Recipe::MXFP8_32x32;
  TORCH_CHECK_VALUE(false, op, ": recipe must be \"", names::kCacheRecipes[0], "\" or \"",
                    names::kCacheRecipes[1], "\", got \"", r, "\"");
}

// names::kFills, in order.
enum class Fill { Empty, Zeros, Dequant, Master };

Fill parse_fill(const char* op, const std::string& f) {
  for (int i = 0; i < 4; ++i) {
    if (f == names::kFills[i]) return static_cast<Fill>(i);
  }
  TORCH_CHECK_VALUE(false, op,
                    ": fill must be one of \"empty\", \"zeros\", \"dequant\", "
                    "\"master\", got \"",
                    f, "\"");
}

// A weight's state (docs/design.md §5, "The states"): names::kStates, in order; cache_state
// returns its index. An entry is never None: a weight without an entry is None.
enum class State { None, Cached, Released, ReleasedForGood, Pending };
static_assert(static_cast<size_t>(State::Pending) + 1 == std::size(names::kStates),
              "State must list names::kStates, in order");

// Whether the weight's storage is freed: RELEASED, RELEASED_FOR_GOOD or PENDING.
constexpr bool is_released(State s) {
  return s == State::Released || s == State::ReleasedForGood || s == State::Pending;
}

// Why a weight was not released; each reason has its own counter in cache_stats().
constexpr const char* kReleased = "released";
constexpr const char* kSkipReleaseFalse = "release_false";
constexpr const char* kSkipNoGrad = "no_grad";
constexpr const char* kSkipNonLeaf = "non_leaf";
constexpr const char* kSkipFrozen = "frozen";
constexpr const char* kSkipFlatBuffer = "flat_buffer";
constexpr const char* kSkipAliased = "aliased";
constexpr const char* kSkipReasons[] = {kSkipReleaseFalse, kSkipNoGrad,     kSkipNonLeaf,
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
  // Empty while PENDING.
  std::vector<at::Tensor> tensors;
  // The BF16-free optimizer step (assign_weights with keep_released): the FP32 master whose
  // rounding to `dtype` is the released weight's value. Its next first use quantizes straight
  // from it (mx_quantize_*_from_master: the same bytes as quantizing the BF16 weight), and a
  // restore reads it exactly. Held strongly: while the weight is released it is the only
  // full-precision record of its value, even if the optimizer that owns it is gone.
  at::Tensor master;
  int64_t storage_nbytes = 0;  // the storage's bytes before release
  // What the weight was released as: the storage (kept: it holds no bytes while released, and
  // a restore writes into it and nowhere else), the dtype and the geometry of the bytes.
  c10::intrusive_ptr<c10::StorageImpl> storage;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  const char* status = kReleased;  // kReleased or a skip reason
  // CACHED: the storage is kept. RELEASED: freed until the boundary, `tensors` is its FP8 copy.
  // RELEASED_FOR_GOOD: a frozen weight released with release_frozen, FP8 only, survives step
  // ends. PENDING: released after a keep_released write-back, `tensors` empty; its next use
  // quantizes from `master` (-> RELEASED).
  State state = State::Cached;
  uint32_t version = 0;
  // The storage and bytes an unreleased copy was made from: `w.data = t` swaps them without a
  // version bump, and the copy is stale from then on.
  const void* storage_impl = nullptr;
  const void* data = nullptr;
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

// Whether `w` still holds what `e` released: the same storage, dtype and geometry. Returns ""
// or what differs.
std::string layout_mismatch(const at::Tensor& w, const Entry& e) {
  if (!w.has_storage() || w.storage().unsafeGetStorageImpl() != e.storage.get()) {
    return "it no longer holds the storage it was released with (its data was replaced after "
           "the release, e.g. by `w.data = t`)";
  }
  if (w.scalar_type() != e.dtype || w.storage_offset() != 0 || !w.sizes().equals(e.sizes) ||
      !w.strides().equals(e.strides)) {
    std::ostringstream os;
    os << "it was released as " << e.dtype << " of shape " << at::IntArrayRef(e.sizes)
       << " but is now " << w.scalar_type() << " of shape " << w.sizes() << " at offset "
       << w.storage_offset();
    return os.str();
  }
  return "";
}

// A batch of restores that keeps going past a failing weight, then raises one error that names
// every weight it could not restore (an OutOfMemoryError if every failure was one).
class Failures {
 public:
  // `what`: what happened to the weights that failed ("restored", "written").
  explicit Failures(const char* op, const char* what = "restored") : op_(op), what_(what) {}

  template <typename F>
  bool attempt(const std::string& name, F&& f) {
    try {
      f();
      return true;
    } catch (const c10::OutOfMemoryError& ex) {
      add(name, ex.what_without_backtrace(), true);
    } catch (const c10::Error& ex) {
      add(name, ex.what_without_backtrace(), false);
    } catch (const std::bad_alloc& ex) {
      add(name, ex.what(), true);
    }
    return false;
  }

  void raise_if_any() const {
    if (lines_.empty()) return;
    std::ostringstream os;
    os << op_ << ": " << lines_.size() << " weight" << (lines_.size() == 1 ? "" : "s")
       << " could not be " << what_
       << "; each is left as it was (a released one stays "
          "released with its cache entry and FP8 copy), and can be "
       << what_ << " again once the cause is fixed:";
    for (const auto& l : lines_) os << "\n  - " << l;
    if (all_oom_) TORCH_CHECK_WITH(OutOfMemoryError, false, os.str());
    TORCH_CHECK(false, os.str());
  }

 private:
  void add(const std::string& name, const std::string& why, bool oom) {
    lines_.push_back("'" + name + "': " + why);
    all_oom_ = all_oom_ && oom;
  }
  const char* op_;
  const char* what_;
  std::vector<std::string> lines_;
  bool all_oom_ = true;
};

class WeightCache {
 public:
  static WeightCache& get() {
    static WeightCache* cache = new WeightCache();  // never destroyed: outlives Python's exit
    return *cache;
  }

  std::vector<at::Tensor> quant_and_release(const at::Tensor& w, const std::string& recipe_str,
                                            bool release, bool release_frozen,
                                            at::ScalarType elem_dtype,
                                            const std::string& scale_mode, const std::string& name,
                                            bool trainable) {
    constexpr const char* op = "zrw.quant_and_release";
    const Recipe recipe = parse_recipe(op, recipe_str);
    checks::check_elem_dtype(op, "elem_dtype", elem_dtype);
    checks::parse_scale_mode(op, scale_mode);
    checks::check_weight_rank(op, w);
    std::lock_guard<std::mutex> lock(mu_);
    sweep_locked();
    c10::TensorImpl* key = w.unsafeGetTensorImpl();
    auto it = table_.find(key);
    if (c10::InferenceMode::is_enabled()) {
      // Tensors made under torch.inference_mode() can never be saved for backward, so an
      // inference pass files nothing and releases nothing: it reads a current entry, or
      // quantizes the weight (a released one: its master) for this call only.
      return inference_copy_locked(w, it == table_.end() ? nullptr : &it->second, recipe,
                                   elem_dtype, scale_mode);
    }
    if (it != table_.end()) {
      Entry& e = it->second;
      const bool same_recipe =
          e.recipe == recipe && e.elem_dtype == elem_dtype && e.scale_mode == scale_mode;
      // A released weight cannot have changed (every write to it raises), so its copy stays
      // valid until it is restored, across steps too; unless its data was replaced. A copy
      // filed under no_grad (an eval pass, a reentrant checkpoint's forward) serves the
      // training recompute of this step, but never another no_grad call: eval never reaches a
      // step boundary, and a write through `.data` bumps no version, so each eval pass
      // quantizes the current values.
      const bool released = is_released(e.state);
      const bool replaced = released && !layout_mismatch(w, e).empty();
      if (e.state == State::Pending && !replaced) {
        // Released with its master after the optimizer step: quantize from the master, in the
        // requested recipe; the weight stays released (no BF16 bytes are allocated).
        TORCH_CHECK(e.master.defined(), op, ": weight '", e.name,
                    "' is released without an "
                    "FP8 copy or a master (internal error)");
        e.tensors = quantize_from_master(e.master, e.dtype, recipe, elem_dtype, scale_mode);
        e.state = State::Released;
        e.recipe = recipe;
        e.elem_dtype = elem_dtype;
        e.scale_mode = scale_mode;
        e.step = step_;
        ++e.misses;
        ++misses_;
        return e.tensors;
      }
      const bool eval_copy = e.state == State::Cached && e.status == kSkipNoGrad;
      // An unreleased weight is readable, so it may have been written through `.data` (which
      // bumps no version: PEFT's merge_and_unload, a hand-written update) since its copy was
      // made: a no_grad call (an eval, generate) never reads such a copy, it quantizes the
      // current values; only the training uses of the step share it.
      const bool fresh = released ? !replaced
                                  : e.step == step_ &&
                                        e.version == key->version_counter().current_version() &&
                                        same_bytes(w, e) && c10::GradMode::is_enabled();
      if (same_recipe && fresh) {
        ++e.hits;
        ++hits_;
        // Filed under no_grad (a reentrant checkpoint's forward) and now used for training (its
        // recompute): release now. release=False stays an explicit choice for the step.
        if (eval_copy && release &&
            release_guard(w, trainable, release, release_frozen) == kReleased) {
          e.status = kReleased;
          release_storage_locked(w, e, trainable);
        }
        return e.tensors;
      }
      TORCH_CHECK(!released || replaced || same_recipe, op, ": weight '", e.name,
                  "' is released with recipe ", recipe_name(e.recipe), ", element dtype ",
                  e.elem_dtype, " and scale mode \"", e.scale_mode, "\" but was asked for \"",
                  recipe_str, "\", ", elem_dtype, ", \"", scale_mode,
                  "\"; restore it first (zrw.cache.restore or the optimizer boundary)");
      // Stale (quantized in an earlier step, written since, or its data replaced: the
      // released storage is nobody's now).
      table_.erase(it);
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
    e.storage_impl = w.storage().unsafeGetStorageImpl();
    e.data = w.const_data_ptr();
    e.storage_nbytes = static_cast<int64_t>(w.storage().nbytes());
    e.status = release_guard(w, trainable, release, release_frozen);
    if (e.status == kReleased) {
      release_storage_locked(w, e, trainable);
    } else {
      e.state = State::Cached;
      ++skips_[e.status];
      if (!trainable || !owns_storage(w)) {
        // A frozen weight that keeps its storage is quantized at each use and never filed: no
        // optimizer boundary marks when it changes, and a write through `.data` (PEFT's
        // merge_and_unload, a hand-written update) bumps no version, so a kept copy could go
        // stale; it also costs no FP8 bytes between uses. So is a weight that shares its
        // storage (a view of a flat buffer, an alias): a write through the buffer or the other
        // tensor bumps another version counter than the weight's.
        return e.tensors;
      }
    }
    auto out = e.tensors;
    table_.emplace(key, std::move(e));
    return out;
  }

  std::vector<at::Tensor> inference_copy_locked(const at::Tensor& w, Entry* e, Recipe recipe,
                                                at::ScalarType elem_dtype,
                                                const std::string& scale_mode) {
    const bool same_recipe = e != nullptr && e->recipe == recipe && e->elem_dtype == elem_dtype &&
                             e->scale_mode == scale_mode;
    if (e != nullptr && is_released(e->state) && layout_mismatch(w, *e).empty()) {
      if (e->state != State::Pending && same_recipe) return e->tensors;
      if (e->state != State::Pending) {
        TORCH_CHECK(false, "zrw.quant_and_release: weight '", e->name,
                    "' is released with "
                    "recipe ",
                    recipe_name(e->recipe),
                    " but was asked for another recipe; "
                    "restore it first (zrw.cache.restore or the optimizer boundary)");
      }
      TORCH_CHECK(e->master.defined(), "zrw.quant_and_release: weight '", e->name,
                  "' is released without an FP8 copy or a master (internal error)");
      return quantize_from_master(e->master, e->dtype, recipe, elem_dtype, scale_mode);
    }
    if (e != nullptr && e->state == State::Cached && same_recipe && e->step == step_ &&
        e->version == w.unsafeGetTensorImpl()->version_counter().current_version() &&
        same_bytes(w, *e) && e->status != kSkipNoGrad) {
      return e->tensors;
    }
    return quantize(w, recipe, elem_dtype, scale_mode);
  }

  // Restores one released weight (docs/design.md §8: a weight that is not released is an error).
  void restore(const at::Tensor& w, const std::string& fill_str,
               const std::optional<at::Tensor>& source) {
    constexpr const char* op = "zrw.restore";
    const Fill fill = parse_fill(op, fill_str);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(w.unsafeGetTensorImpl());
    TORCH_CHECK_VALUE(it != table_.end(), op, ": this weight (", w.scalar_type(), ", shape ",
                      w.sizes(),
                      ") was never released: it has no cache entry, so there is "
                      "nothing to restore");
    Entry& e = it->second;
    TORCH_CHECK_VALUE(is_released(e.state), op, ": weight '", e.name,
                      "' is not released (it is cached, "
                      "and kept its storage: ",
                      e.status, "), so there is nothing to restore");
    check_restorable(op, w, e);
    fill_and_install_locked(op, e, fill, source);
    table_.erase(it);
  }

  // The boundary of one optimizer: exactly these weights. Released ones are restored, the
  // entries of the others dropped; frozen entries stay. Returns the number restored.
  int64_t restore_weights(const std::vector<at::Tensor>& ws, const std::string& fill_str,
                          const std::vector<std::optional<at::Tensor>>& sources) {
    constexpr const char* op = "zrw.restore_weights";
    const Fill fill = parse_fill(op, fill_str);
    TORCH_CHECK_VALUE(sources.empty() || sources.size() == ws.size(), op,
                      ": sources must be empty or have one entry per weight (", ws.size(),
                      "), got ", sources.size());
    std::lock_guard<std::mutex> lock(mu_);
    sweep_locked();
    Failures failures(op);
    int64_t n = 0;
    for (size_t i = 0; i < ws.size(); ++i) {
      auto it = table_.find(ws[i].unsafeGetTensorImpl());
      if (it == table_.end() || it->second.state == State::ReleasedForGood) continue;
      Entry& e = it->second;
      if (!is_released(e.state)) {
        table_.erase(it);
        continue;
      }
      const auto& src = sources.empty() ? std::optional<at::Tensor>() : sources[i];
      if (failures.attempt(e.name, [&] {
            check_restorable(op, ws[i], e);
            fill_and_install_locked(op, e, fill, src);
          })) {
        table_.erase(it);
        ++n;
      }
    }
    failures.raise_if_any();
    return n;
  }

  // Every weight gets its source's values (w.copy_(source): rounded to w's dtype). A released
  // one is restored from the source into fresh bytes; any other is written in place. Their
  // entries are dropped; frozen released entries stay. Returns the number restored.
  //
  // keep_released (the BF16-free step): a released weight stays released; its FP8 copy is
  // dropped and the entry keeps the source (which must be FP32, the master) for its next
  // quantization and for any restore. Returns the number kept released then.
  //
  // digests (int64, (len(weights), 2)): row i gets (1, the digest of weight i's bytes after the
  // write, common/digest.h) for a weight written in place (a contiguous CPU tensor), taken right
  // after the write while its bytes are still in cache, else (0, 0).
  int64_t assign_weights(const std::vector<at::Tensor>& ws, const std::vector<at::Tensor>& srcs,
                         bool keep_released, const std::optional<at::Tensor>& digests) {
    constexpr const char* op = "zrw.assign_weights";
    TORCH_CHECK_VALUE(ws.size() == srcs.size(), op,
                      ": weights and sources must have the same "
                      "length, got ",
                      ws.size(), " and ", srcs.size());
    int64_t* digest_rows = nullptr;
    if (digests.has_value()) {
      const at::Tensor& d = *digests;
      TORCH_CHECK_VALUE(d.device().is_cpu() && d.scalar_type() == at::kLong && d.dim() == 2 &&
                            d.size(0) == static_cast<int64_t>(ws.size()) && d.size(1) == 2 &&
                            d.is_contiguous(),
                        op, ": digests must be a contiguous CPU int64 tensor of shape (", ws.size(),
                        ", 2), got ", d.scalar_type(), " of shape ", d.sizes(), " on ", d.device());
      digest_rows = d.data_ptr<int64_t>();
      std::fill(digest_rows, digest_rows + 2 * ws.size(), int64_t{0});
    }
    std::lock_guard<std::mutex> lock(mu_);
    sweep_locked();
    Failures failures(op, "written");
    int64_t n = 0;
    for (size_t i = 0; i < ws.size(); ++i) {
      const at::Tensor& w = ws[i];
      auto it = table_.find(w.unsafeGetTensorImpl());
      Entry* e = it == table_.end() ? nullptr : &it->second;
      if (e != nullptr && e->state == State::ReleasedForGood) continue;
      const std::string name = e != nullptr ? e->name : "<weight " + std::to_string(i) + ">";
      bool restored = false;
      const bool ok = failures.attempt(name, [&] {
        TORCH_CHECK_VALUE(srcs[i].sizes() == w.sizes(), op, ": source ", i,
                          " must have the "
                          "weight's shape ",
                          w.sizes(), ", got ", srcs[i].sizes());
        if (e != nullptr && is_released(e->state) && layout_mismatch(w, *e).empty()) {
          if (keep_released) {
            TORCH_CHECK_VALUE(srcs[i].scalar_type() == at::kFloat, op, ": source ", i,
                              " of released weight '", e->name,
                              "' must be its float32 master "
                              "(keep_released quantizes from it), got ",
                              srcs[i].scalar_type());
            TORCH_CHECK_VALUE(srcs[i].device() == w.device(), op, ": source ", i, " of weight '",
                              e->name, "' must be on the weight's device ", w.device(), ", got ",
                              srcs[i].device());
          } else {
            fill_and_install_locked(op, *e, Fill::Master, srcs[i]);
          }
          restored = true;
        } else {
          // Not released, or its data was replaced after the release: w holds live bytes.
          at::NoGradGuard no_grad;
          if (digest_rows != nullptr && w.device().is_cpu() && w.is_contiguous()) {
            digest_rows[2 * i + 1] = static_cast<int64_t>(copy_and_digest(w.detach(), srcs[i]));
            digest_rows[2 * i] = 1;
          } else {
            w.detach().copy_(srcs[i]);
          }
        }
      });
      if (ok) {
        if (keep_released && restored) {
          e->tensors.clear();  // the master is the copy now: no FP8 bytes through the step
          e->master = srcs[i];
          e->state = State::Pending;
        } else if (e != nullptr) {
          table_.erase(it);
        }
        n += restored;
      }
    }
    failures.raise_if_any();
    return n;
  }

  // dst.copy_(src) for a contiguous CPU dst, then the digest of dst's bytes (common/digest.h),
  // read while they are still in cache (a parameter up to a few MiB): one pass over memory
  // instead of a copy and a later second read. (Copying and digesting in chunks inside one
  // parallel region measured slower than torch's own parallel copy followed by this.)
  static uint64_t copy_and_digest(const at::Tensor& dst, const at::Tensor& src) {
    dst.copy_(src);
    return digest::of(static_cast<const unsigned char*>(dst.const_data_ptr()),
                      dst.numel() * dst.element_size());
  }

  // The master a released weight's entry holds (keep_released), or nothing.
  std::optional<at::Tensor> master(const at::Tensor& w) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(w.unsafeGetTensorImpl());
    if (it == table_.end() || !is_released(it->second.state) || !it->second.master.defined()) {
      return std::nullopt;
    }
    return it->second.master;
  }

  // Every trainable weight but those in `skip`: drop the FP8 entries, restore the released
  // storages. Frozen (release_frozen) entries survive. Returns the number restored.
  int64_t restore_all(const std::string& fill_str, const std::vector<at::Tensor>& skip) {
    constexpr const char* op = "zrw.restore_all";
    const Fill fill = parse_fill(op, fill_str);
    TORCH_CHECK_VALUE(fill != Fill::Master, op,
                      ": fill \"master\" needs each weight's FP32 "
                      "master: call zrw.cache.restore_all(\"master\"), which passes them");
    std::unordered_set<const c10::TensorImpl*> skipped;
    for (const auto& w : skip) skipped.insert(w.unsafeGetTensorImpl());
    std::lock_guard<std::mutex> lock(mu_);
    sweep_locked();
    Failures failures(op);
    int64_t n = 0;
    for (auto it = table_.begin(); it != table_.end();) {
      Entry& e = it->second;
      if (e.state == State::ReleasedForGood || skipped.count(it->first)) {
        ++it;
        continue;
      }
      bool drop = true;
      if (is_released(e.state)) {
        auto strong = e.weight.lock();
        if (strong) {
          const at::Tensor w(std::move(strong));
          drop = failures.attempt(e.name, [&] {
            check_restorable(op, w, e);
            fill_and_install_locked(op, e, fill, std::nullopt);
          });
          n += drop;
        }
      }
      it = drop ? table_.erase(it) : std::next(it);
    }
    failures.raise_if_any();
    return n;
  }

  // Drops one entry. A released weight is restored first (with `fill`; default "dequant", the
  // only source left for a frozen weight), so the only copy is never dropped. A weight whose
  // data was replaced after its release keeps the new data; the stale entry just goes.
  bool invalidate(const at::Tensor& w, const std::string& fill_str) {
    constexpr const char* op = "zrw.cache_invalidate";
    const Fill fill = parse_fill(op, fill_str);
    TORCH_CHECK_VALUE(fill != Fill::Master, op,
                      ": fill \"master\" is handled by "
                      "zrw.cache.cache_invalidate, which passes the master");
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(w.unsafeGetTensorImpl());
    if (it == table_.end()) return false;
    Entry& e = it->second;
    if (is_released(e.state) && w.has_storage() &&
        w.storage().unsafeGetStorageImpl() == e.storage.get()) {
      fill_and_install_locked(op, e, fill, std::nullopt);  // the recorded layout, not w's view
    }
    table_.erase(it);
    return true;
  }

  void clear(const std::string& fill_str) {
    constexpr const char* op = "zrw.cache_clear";
    const Fill fill = parse_fill(op, fill_str);
    TORCH_CHECK_VALUE(fill != Fill::Master, op,
                      ": fill \"master\" is handled by "
                      "zrw.cache.cache_clear, which passes the masters");
    std::lock_guard<std::mutex> lock(mu_);
    Failures failures(op);
    for (auto it = table_.begin(); it != table_.end();) {
      Entry& e = it->second;
      bool drop = true;
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> strong;
      if (is_released(e.state)) strong = e.weight.lock();
      if (strong && strong->has_storage() &&
          strong->storage().unsafeGetStorageImpl() == e.storage.get()) {
        drop =
            failures.attempt(e.name, [&] { fill_and_install_locked(op, e, fill, std::nullopt); });
      }
      it = drop ? table_.erase(it) : std::next(it);
    }
    hits_ = misses_ = restored_ = restored_bytes_ = 0;
    skips_.clear();
    failures.raise_if_any();
  }

  void next_step() {
    std::lock_guard<std::mutex> lock(mu_);
    ++step_;
  }

  std::tuple<std::vector<std::string>, std::vector<int64_t>> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    sweep_locked();
    int64_t fp8 = 0, released_bytes = 0, released = 0, frozen = 0, pending = 0;
    for (const auto& [key, e] : table_) {
      fp8 += fp8_bytes(e);
      if (is_released(e.state)) {
        ++released;
        released_bytes += e.storage_nbytes;
      }
      pending += e.state == State::Pending;
      frozen += e.state == State::ReleasedForGood;
    }
    std::vector<std::string> names = {"entries", "fp8_bytes", "released", "released_bytes",
                                      "frozen",  "pending",   "restored", "restored_bytes",
                                      "hits",    "misses",    "step"};
    std::vector<int64_t> values = {static_cast<int64_t>(table_.size()),
                                   fp8,
                                   released,
                                   released_bytes,
                                   frozen,
                                   pending,
                                   restored_,
                                   restored_bytes_,
                                   hits_,
                                   misses_,
                                   step_};
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

  // The index of w's state in names::kStates.
  int64_t state(const at::Tensor& w) {
    std::lock_guard<std::mutex> lock(mu_);
    return state_locked(w);
  }

  std::vector<int64_t> states(const std::vector<at::Tensor>& ws) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int64_t> out;
    out.reserve(ws.size());
    for (const auto& w : ws) out.push_back(state_locked(w));
    return out;
  }

 private:
  static const char* recipe_name(Recipe r) {
    return r == Recipe::MXFP8 ? "\"mxfp8\"" : "\"mxfp8-32x32\"";
  }

  int64_t state_locked(const at::Tensor& w) const {
    auto it = table_.find(w.unsafeGetTensorImpl());
    return static_cast<int64_t>(it == table_.end() ? State::None : it->second.state);
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
    return block_entry(data, block);
  }

  // The "mxfp8-32x32" entry tensors: the per-axis scales the GEMMs read are expanded once here
  // instead of on every hit.
  static std::vector<at::Tensor> block_entry(const at::Tensor& data, const at::Tensor& block) {
    const int64_t N = data.size(-2), K = data.size(-1);
    return {data, mx::mx_expand_block_scale(block, N, K, -1), data,
            mx::mx_expand_block_scale(block, N, K, -2), block};
  }

  // The copy of a released weight whose value is master.to(dtype): the fused ops round each
  // FP32 element to the weight's dtype and quantize it in one read (bytes equal to quantizing
  // the BF16 weight); an FP32 weight is its master.
  static std::vector<at::Tensor> quantize_from_master(const at::Tensor& master,
                                                      at::ScalarType dtype, Recipe recipe,
                                                      at::ScalarType elem_dtype,
                                                      const std::string& scale_mode) {
    if (dtype == at::kFloat) return quantize(master, recipe, elem_dtype, scale_mode);
    at::AutoDispatchBelowADInplaceOrView guard;
    if (recipe == Recipe::MXFP8) {
      static auto op =
          c10::Dispatcher::singleton()
              .findSchemaOrThrow("zrw::mx_quantize_dual_from_master", "")
              .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                  const at::Tensor&, at::ScalarType, at::ScalarType, c10::string_view)>();
      auto [df, sf, db, sb] = op.call(master, dtype, elem_dtype, scale_mode);
      return {df, sf, db, sb};
    }
    static auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("zrw::mx_quantize_block_from_master", "")
            .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::ScalarType,
                                                      at::ScalarType, c10::string_view)>();
    auto [data, block] = op.call(master, dtype, elem_dtype, scale_mode);
    return block_entry(data, block);
  }

  // The release guard (docs/design.md §5). Returns kReleased or the reason to keep the storage.
  // `trainable`: whether the optimizer steps w (w.requires_grad(), unless the caller says
  // otherwise: a DTensor's local shard never requires grad itself, its DTensor does).
  // Whether an unreleased weight still holds the storage and bytes its copy was made from.
  static bool same_bytes(const at::Tensor& w, const Entry& e) {
    return w.has_storage() && w.storage().unsafeGetStorageImpl() == e.storage_impl &&
           w.const_data_ptr() == e.data;
  }

  static const char* release_guard(const at::Tensor& w, bool trainable, bool release,
                                   bool release_frozen) {
    // A copy filed under no_grad is an eval copy whatever the release flag: it serves the
    // training recompute of its step, never another no_grad call.
    if (!c10::GradMode::is_enabled()) return kSkipNoGrad;
    if (!release) return kSkipReleaseFalse;
    if (!w.is_leaf()) return kSkipNonLeaf;
    if (!trainable && !release_frozen) return kSkipFrozen;
    return storage_skip(w);
  }

  // kReleased if `w` alone owns its storage and fills it exactly, else why not.
  static const char* storage_skip(const at::Tensor& w) {
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

  static bool owns_storage(const at::Tensor& w) { return storage_skip(w) == kReleased; }

  static void release_storage_locked(const at::Tensor& w, Entry& e, bool trainable) {
    c10::StorageImpl* s = w.storage().unsafeGetStorageImpl();
    e.storage = c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s);
    e.dtype = w.scalar_type();
    e.sizes = w.sizes().vec();
    e.strides = w.strides().vec();
    e.state = trainable ? State::Released : State::ReleasedForGood;
    s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));  // frees the bytes
    // nbytes keeps the logical size on purpose: with 0, creating any view of the weight (print,
    // F.linear's transpose) fails on a storage-size check before the data pointer is touched,
    // with a message that says nothing about zrw. The bytes are gone all the same: zrw.memory
    // and cache_stats()["released_bytes"] account for them.
    if (e.state == State::ReleasedForGood) {
      s->release_data_and_set_meta_custom_data_ptr_error_msg_(
          "zrw: the BF16 storage of weight '" + e.name +
          "' is released (zero-redundancy "
          "weights: a frozen weight released for good with release_frozen=True, whose MXFP8 "
          "copy alone holds its values). It holds no data now. "
          "model.state_dict() gives its dequantized FP8 values (see zrw.checkpoint."
          "frozen_values). A write through the parameter itself (`.data`, an in-place op, "
          "PEFT's merge_and_unload) fills it from its FP8 copy first, with a warning; to read "
          "its bytes or write through another view, first bring it back from its FP8 copy "
          "(lossy: the only value left) with zrw.cache.restore_frozen(model) or "
          "zrw.cache.cache_invalidate(w); its next use then quantizes the written values. "
          "(zrw.cache.restore_all skips frozen weights.)");
      return;
    }
    s->release_data_and_set_meta_custom_data_ptr_error_msg_(
        "zrw: the BF16 storage of weight '" + e.name +
        "' is released (zero-redundancy weights: only its MXFP8 copy, or with "
        "zrw.optim.MasterWeights its FP32 master, holds its values). It holds no data now. To "
        "get the values: model.state_dict() (exact, materialized from the master one tensor at "
        "a time), zrw.cache.restore(w, fill=\"master\") (exact, with MasterWeights) or "
        "fill=\"dequant\" (lossy), or zrw.cache.restore_all(\"master\") for every weight; "
        "the optimizer boundary restores it with zrw.optim.attach(opt, fill=\"dequant\") or "
        "MasterWeights(..., keep_released=False); code that must see BF16 weights can run "
        "under zrw.no_release()");
  }

  static void check_restorable(const char* op, const at::Tensor& w, const Entry& e) {
    const std::string why = layout_mismatch(w, e);
    TORCH_CHECK(why.empty(), op, ": weight '", e.name, "' cannot be restored: ", why,
                ". zrw writes a released weight back only into the storage and layout it was "
                "released with; nothing was written. The weight stays released with its FP8 "
                "copy; zrw.cache.cache_invalidate(w) drops that copy (restoring the released "
                "bytes by dequantization if the weight still holds its storage)");
  }

  // Allocates the released bytes, fills them, and only then installs them and clears the
  // poison: an exception anywhere before the last two lines changes nothing (the DataPtr frees
  // the new bytes). The fill uses the geometry recorded at release, never the weight's view.
  //
  // The entry's own master (keep_released) serves fill "master" when no source is passed, and
  // "dequant" too: it is exact, and a weight waiting for its quantization has no FP8 copy.
  void fill_and_install_locked(const char* op, const Entry& e, Fill fill,
                               std::optional<at::Tensor> source) {
    if ((fill == Fill::Master || fill == Fill::Dequant) && e.master.defined() &&
        !(source.has_value() && source->defined())) {
      fill = Fill::Master;
      source = e.master;
    }
    TORCH_CHECK_VALUE(fill != Fill::Master || (source.has_value() && source->defined()), op,
                      ": fill \"master\" needs the FP32 master of weight '", e.name,
                      "', but it "
                      "has none: wrap the optimizer in zrw.optim.MasterWeights, or use "
                      "fill=\"dequant\" (lossy)");
    c10::StorageImpl* s = e.storage.get();
    c10::Allocator* alloc = s->allocator();
    if (alloc == nullptr) alloc = c10::GetAllocator(s->device_type());
    at::DataPtr bytes = alloc->allocate(e.storage_nbytes);
    if (fill != Fill::Empty) {
      at::NoGradGuard no_grad;
      at::AutoDispatchBelowADInplaceOrView guard;
      at::Tensor target = at::from_blob(bytes.get(), e.sizes, e.strides,
                                        at::TensorOptions().dtype(e.dtype).device(s->device()));
      if (fill == Fill::Zeros) {
        target.zero_();
      } else if (fill == Fill::Master) {
        TORCH_CHECK_VALUE(source->sizes() == target.sizes(), op, ": the master of weight '", e.name,
                          "' must have its shape ", target.sizes(), ", got ", source->sizes());
        target.copy_(*source);
      } else {
        TORCH_CHECK(!e.tensors.empty(), op, ": cannot restore weight '", e.name,
                    "' by dequantization: its FP8 copy is gone");
        static auto deq =
            c10::Dispatcher::singleton()
                .findSchemaOrThrow("zrw::mx_dequantize", "")
                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, at::ScalarType)>();
        target.copy_(deq.call(e.tensors[0], e.tensors[1], -1, e.dtype));
      }
    }
    s->set_data_ptr_noswap(std::move(bytes));
    s->clear_data_ptr_access_error_msg_();
    ++restored_;
    restored_bytes_ += e.storage_nbytes;
  }

  std::mutex mu_;
  std::unordered_map<c10::TensorImpl*, Entry> table_;
  std::map<std::string, int64_t> skips_;
  int64_t hits_ = 0, misses_ = 0, step_ = 0;
  // Released storages given bytes again (every fill_and_install_locked), since cache_clear.
  int64_t restored_ = 0, restored_bytes_ = 0;
};

std::vector<at::Tensor> quant_and_release(const at::Tensor& w, c10::string_view recipe,
                                          bool release, bool release_frozen,
                                          at::ScalarType elem_dtype, c10::string_view scale_mode,
                                          c10::string_view name, std::optional<bool> trainable) {
  return WeightCache::get().quant_and_release(
      w, std::string(recipe), release, release_frozen, elem_dtype, std::string(scale_mode),
      std::string(name), trainable.value_or(w.requires_grad()));
}

void restore(const at::Tensor& w, c10::string_view fill, const std::optional<at::Tensor>& source) {
  WeightCache::get().restore(w, std::string(fill), source);
}

int64_t restore_weights(at::TensorList weights, c10::string_view fill,
                        const c10::List<std::optional<at::Tensor>>& sources) {
  std::vector<std::optional<at::Tensor>> srcs(sources.begin(), sources.end());
  return WeightCache::get().restore_weights(weights.vec(), std::string(fill), srcs);
}

int64_t assign_weights(at::TensorList weights, at::TensorList sources, bool keep_released,
                       const std::optional<at::Tensor>& digests) {
  return WeightCache::get().assign_weights(weights.vec(), sources.vec(), keep_released, digests);
}

std::optional<at::Tensor> cache_master(const at::Tensor& w) { return WeightCache::get().master(w); }

int64_t restore_all(c10::string_view fill, at::TensorList skip) {
  return WeightCache::get().restore_all(std::string(fill), skip.vec());
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

std::vector<int64_t> cache_states(at::TensorList weights) {
  return WeightCache::get().states(weights.vec());
}

}  // namespace

// Tensor ops dispatch on their weight. They are registered for Autograd too, so that autograd
// attaches no history to the FP8 outputs (they are not differentiable; the training layers own
// the gradient formulas). The table-wide ops take no tensor.
#define ZRW_CACHE_TENSOR_OPS(m)                    \
  m.impl("quant_and_release", &quant_and_release); \
  m.impl("restore", &restore);                     \
  m.impl("restore_weights", &restore_weights);     \
  m.impl("assign_weights", &assign_weights);       \
  m.impl("cache_invalidate", &cache_invalidate);   \
  m.impl("cache_state", &cache_state);             \
  m.impl("cache_states", &cache_states);           \
  m.impl("cache_master", &cache_master);           \
  m.impl("restore_all", &restore_all)

TORCH_LIBRARY_IMPL(zrw, CompositeExplicitAutograd, m) { ZRW_CACHE_TENSOR_OPS(m); }

TORCH_LIBRARY_IMPL(zrw, Autograd, m) { ZRW_CACHE_TENSOR_OPS(m); }

TORCH_LIBRARY_IMPL(zrw, CompositeExplicitAutograd, m) {
  m.impl("cache_clear", &cache_clear);
  m.impl("next_step", &next_step);
  m.impl("cache_stats", &cache_stats);
  m.impl("cache_entries", &cache_entries);
}

}  // namespace zrw::cache
