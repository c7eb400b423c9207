// The names zrw's ops accept or report as strings, once: the C++ code reads them from here and
// zrw._C exports them to Python (zrw.ops.SCALE_MODES, zrw.cache.FILLS, zrw.cache.RECIPES,
// zrw.cache.CacheState), so a name added here is known everywhere.
#pragma once

namespace zrw::names {

// MX scale rules (docs/design.md §3), in the order of mx::ScaleMode.
inline constexpr const char* kScaleModes[] = {"floor", "rceil"};

// The native cache's weight layouts: two 1x32 planes, or one copy with 32x32 tiles.
inline constexpr const char* kCacheRecipes[] = {"mxfp8", "mxfp8-32x32"};

// How a restore fills a released weight's new bytes (docs/design.md §5).
inline constexpr const char* kFills[] = {"empty", "zeros", "dequant", "master"};

// What the native cache holds for a weight (docs/design.md §5, "The states"); the index is the
// code cache_state returns. PENDING (released, its FP8 copy not made yet: the next use quantizes
// from the master its entry keeps) comes last, so the first four codes keep their meaning.
inline constexpr const char* kStates[] = {"none", "cached", "released", "released_for_good",
                                          "pending"};

}  // namespace zrw::names
