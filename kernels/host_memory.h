// Memory management, and the element-wise ops, shared by the backends that compute on host
// memory (the reference and the CPU backend: plain loops, the same for both).
#pragma once

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/host_alloc.h"
#include "common/base/status.h"
#include "kernels/backend.h"
#include "kernels/coded_rows.h"
#include "kernels/validate.h"

namespace kvwire::kernels {

class HostMemoryBackend : public KernelBackend {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    // Weights and activations: huge pages from 2 MiB (host_alloc.h).
    void* p = AllocateHostBytes(bytes);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
    }
    return p;
  }
  void Free(void* ptr) override { std::free(ptr); }
  absl::Status DoCopyToDevice(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);  // an empty array's data() may be null
    return absl::OkStatus();
  }
  absl::Status DoCopyToHost(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status EmbedRows(const EmbedRowsParams& p) override {
    RETURN_IF_ERROR(ValidateEmbedRows(p));
    const size_t row = static_cast<size_t>(p.hidden) * DTypeSize(p.dtype);
    for (int i = 0; i < p.n; ++i) {
      ToFloat(p.dtype, static_cast<const uint8_t*>(p.table) + p.ids[i] * row,
              p.out + int64_t{i} * p.hidden, p.hidden);
    }
    return absl::OkStatus();
  }
  absl::Status AppendKv(const AppendKvParams& p) override {
    RETURN_IF_ERROR(ValidateAppendKv(p));
    const int per_kv = p.n_cache_heads / p.n_kv_heads;
    const size_t elem = DTypeSize(p.kv_dtype);
    for (int b = 0; b < p.batch; ++b) {
      const KvAppend& s = p.seqs[b];
      for (int c = 0; c < p.n_cache_heads; ++c) {
        const int64_t src = int64_t{c / per_kv} * p.head_dim;
        if (s.coding.coded()) {
          AppendCodedRow(s.k_cache, s.v_cache, s.layout, s.coding, p.kv_dtype, p.head_dim, c, s.t,
                         s.k + src, s.v + src);
          continue;
        }
        const int64_t dst = s.layout.Row(c, s.t, p.head_dim) * static_cast<int64_t>(elem);
        FromFloat(p.kv_dtype, s.k + src, static_cast<uint8_t*>(s.k_cache) + dst, p.head_dim);
        FromFloat(p.kv_dtype, s.v + src, static_cast<uint8_t*>(s.v_cache) + dst, p.head_dim);
      }
    }
    return absl::OkStatus();
  }
};

}  // namespace kvwire::kernels
