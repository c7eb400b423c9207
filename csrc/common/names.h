// The names zrw's ops accept as strings, once: the C++ checks parse them from here and
// zrw._C exports them to Python (zrw.ops.SCALE_MODES, zrw.cache.FILLS, zrw.cache.RECIPES), so
// a name added here is known everywhere.
#pragma once

namespace zrw::names {

// MX scale rules (docs/design.md §3), in the order of mx::ScaleMode.
inline constexpr const char* kScaleModes[] = {"floor", "rceil"};

// The native cache's weight layouts: two 1x32 planes, or one copy with 32x32 tiles.
inline constexpr const char* kCacheRecipes[] = {"mxfp8", "mxfp8-32x32"};

// How a restore fills a released weight's new bytes (docs/design.md §5).
inline constexpr const char* kFills[] = {"empty", "zeros", "dequant", "master"};

}  // namespace zrw::names
