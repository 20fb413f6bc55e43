// Pool1d on the CPU (kernels/selection.h). Max pooling with SnapKV++'s kernels (63, 511) over
// long prompts would cost kernel comparisons per column; van Herk / Gil-Werman's running
// maxima over blocks of `kernel` columns cost three, with the same result (a max is exact).
// Average pooling keeps the reference's order of additions, column by column.
#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/cpu/selection.h"

namespace kvwire::kernels::cpu {
namespace {

// y[j] = max of x over [j - half, j + half] clipped to [0, n).
void MaxPoolRow(const float* x, float* y, int n, int kernel) {
  const int half = kernel / 2;
  // The row padded with -inf to a whole number of blocks of `kernel`, each block's running
  // maximum from its start (g) and from its end (h): a window of `kernel` columns covers the
  // end of one block and the start of the next.
  thread_local std::vector<float> g, h;
  const int padded = ((n + 2 * half) + kernel - 1) / kernel * kernel;
  g.resize(padded);
  h.resize(padded);
  const float lowest = -std::numeric_limits<float>::infinity();
  auto at = [&](int i) { return i >= half && i - half < n ? x[i - half] : lowest; };
  for (int b = 0; b < padded; b += kernel) {
    float m = lowest;
    for (int i = b; i < b + kernel; ++i) g[i] = m = std::max(m, at(i));
    m = lowest;
    for (int i = b + kernel - 1; i >= b; --i) h[i] = m = std::max(m, at(i));
  }
  // Padded column i is x's column i - half: output j's window is padded [j, j + kernel).
  for (int j = 0; j < n; ++j) {
    const int lo = j, hi = j + kernel - 1;
    y[j] = lo % kernel == 0 ? g[hi] : std::max(h[lo], g[hi]);
  }
}

}  // namespace

void Pool1d(const Pool1dParams& p, const ParallelFn& parallel) {
  parallel(p.rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = p.x + r * p.n;
      float* y = p.y + r * p.n;
      if (p.kernel == 1) {
        std::copy(x, x + p.n, y);
      } else if (p.kind == PoolKind::kMax) {
        MaxPoolRow(x, y, p.n, p.kernel);
      } else {
        const int half = p.kernel / 2;
        for (int j = 0; j < p.n; ++j) {
          const int lo = std::max(0, j - half), hi = std::min(p.n - 1, j + half);
          float s = 0.f;
          for (int i = lo; i <= hi; ++i) s += x[i];
          y[j] = s / static_cast<float>(p.kernel);
        }
      }
    }
  });
}

}  // namespace kvwire::kernels::cpu
