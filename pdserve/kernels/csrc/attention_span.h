// The keys an attention query sees besides causality, as the kernels take their `window`
// argument (`AttnLayer.span` in Python): W > 0 the last W positions (a sliding window), -C the
// query's own chunk of C positions (C * floor(pos / C) .. pos: Llama 4's local layers), 0 every
// earlier key. The first visible key never decreases with the query's position, so a block of a
// request's rows starts reading at its first row's.
#pragma once

#include <cstdint>

inline int64_t first_visible_key(int64_t pos, int64_t window) {
  if (window > 0) return pos - window + 1 > 0 ? pos - window + 1 : 0;
  if (window < 0) return pos / -window * -window;
  return 0;
}
