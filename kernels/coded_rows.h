// Rows of a coded cache (KvCoding) in host memory, read and appended one at a time: the
// specification of what decode reads from and writes to a cache kept in the wire's format,
// built on common/base/kv_format.h's coders. The reference backend reads every row through
// these; the optimised kernels are tested against it.
#pragma once

#include <cstdint>

#include "common/base/dtype.h"
#include "kernels/selection.h"

namespace kvwire::kernels {

// Token t of cache head c, as float32: from its codes and its group's parameters, or from the
// residual when t ≥ coding.ResidBegin(len).
void CodedKeyRow(const void* k, const KvLayout& layout, const KvCoding& coding, DType dtype,
                 int head_dim, int len, int c, int t, float* out);
void CodedValueRow(const void* v, const KvCoding& coding, DType dtype, int head_dim, int len, int c,
                   int t, float* out);

// Token t (≥ coding.kept) of cache head c, from float32 rows: into the residual, and when it
// completes a group, the residual coded into the group's rows and parameters.
void AppendCodedRow(void* k, void* v, const KvLayout& layout, const KvCoding& coding, DType dtype,
                    int head_dim, int c, int t, const float* k_row, const float* v_row);

// The byte offset of head c's group g parameters, and of its residual slot i.
KVWIRE_HOST_DEVICE inline int64_t KeyParamsAt(const KvCoding& coding, int head_dim, int c, int g) {
  return (int64_t{c} * coding.max_groups + g) * int64_t{4} * head_dim;
}
KVWIRE_HOST_DEVICE inline int64_t ResidAt(const KvCoding& coding, DType dtype, int head_dim, int c,
                                          int i) {
  return (int64_t{c} * coding.resid_tokens + i) * head_dim * static_cast<int64_t>(DTypeSize(dtype));
}

}  // namespace kvwire::kernels
