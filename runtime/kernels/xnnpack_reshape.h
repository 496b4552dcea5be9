// Reshaping an XNNPACK runtime only when its input shapes change (xnnpack_reshape.cpp).
#pragma once

#include <cstdint>

namespace llmcore {

struct XnnpackReshapeCounts {
  uint64_t done = 0;     // calls passed to XNNPACK's xnn_reshape_runtime
  uint64_t skipped = 0;  // calls answered here: no input shape had changed since the last
  bool always = false;   // LLMCORE_XNNPACK_RESHAPE=always: every call passed on
};

// What the interposed xnn_reshape_runtime has done so far in this process (the runner's
// --verbose line; llmcore_xnnpack_reshape_counts for a Python process).
XnnpackReshapeCounts xnnpack_reshape_counts();

}  // namespace llmcore
