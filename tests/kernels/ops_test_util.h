// What the backend op tests share: tolerance checks, random inputs, buffers in a backend's
// memory, and the fixture that runs a test on one backend beside the reference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/reference.h"

namespace kvwire::kernels {

struct Tolerance {
  float atol = 1e-5f;
  float rtol = 1e-4f;
};

// Compares and describes the first few mismatches.
inline ::testing::AssertionResult AllClose(const std::vector<float>& got,
                                           const std::vector<float>& want, Tolerance tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  }
  int bad = 0;
  std::string first;
  for (size_t i = 0; i < got.size(); ++i) {
    const float a = got[i], r = want[i];
    const bool ok =
        std::fabs(a - r) <= tol.atol + tol.rtol * std::fabs(r) || (std::isnan(a) && std::isnan(r));
    if (!ok) {
      if (bad < 5) absl::StrAppend(&first, "\n  [", i, "] got ", a, " want ", r);
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " mismatch:" << first;
}

inline std::vector<float> Random(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

inline std::vector<uint8_t> Encode(const std::vector<float>& v, DType t) {
  std::vector<uint8_t> out(v.size() * DTypeSize(t));
  FromFloat(t, v.data(), out.data(), v.size());
  return out;
}

// Buffers in one backend's memory, freed at scope end.
class Arena {
 public:
  explicit Arena(KernelBackend& b) : b_(b) {}
  ~Arena() {
    for (void* p : ptrs_) b_.Free(p);
  }
  template <typename T>
  T* Upload(const std::vector<T>& v) {
    void* p = Alloc(v.size() * sizeof(T));
    EXPECT_TRUE(b_.CopyToDevice(p, v.data(), v.size() * sizeof(T)).ok());
    return static_cast<T*>(p);
  }
  float* Zeros(size_t n) { return Upload(std::vector<float>(n, 0.f)); }
  std::vector<float> Download(const float* p, size_t n) { return DownloadAs<float>(p, n); }
  template <typename T>
  std::vector<T> DownloadAs(const T* p, size_t n) {
    std::vector<T> v(n);
    EXPECT_TRUE(b_.CopyToHost(v.data(), p, n * sizeof(T)).ok());
    return v;
  }
  // n bytes of backend memory holding `fill`.
  template <typename T>
  T* Filled(size_t n, T fill) {
    return Upload(std::vector<T>(n, fill));
  }
  std::vector<uint8_t> DownloadBytes(const void* p, size_t n) {
    std::vector<uint8_t> v(n);
    EXPECT_TRUE(b_.CopyToHost(v.data(), p, n).ok());
    return v;
  }

 private:
  void* Alloc(size_t bytes) {
    auto p = b_.Allocate(bytes);
    EXPECT_TRUE(p.ok()) << p.status();
    ptrs_.push_back(*p);
    return *p;
  }
  KernelBackend& b_;
  std::vector<void*> ptrs_;
};

class BackendOpsTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    if (GetParam() == BackendKind::kCuda && !CudaAvailable()) {
      GTEST_SKIP() << "no GPU: the CUDA backend is tested where one is present";
    }
    auto b = MakeBackend(GetParam(), 2);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
    reference_ = MakeReferenceBackend();
  }
  KernelBackendPtr backend_;
  KernelBackendPtr reference_;
};

}  // namespace kvwire::kernels
