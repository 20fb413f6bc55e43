// Memory management shared by the backends that compute on host memory.
#pragma once

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"

namespace kvwire::kernels {

class HostMemoryBackend : public KernelBackend {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    // 64-byte alignment for AVX loads and to keep threads off each other's cache lines.
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
    }
    return p;
  }
  void Free(void* ptr) override { std::free(ptr); }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
};

}  // namespace kvwire::kernels
