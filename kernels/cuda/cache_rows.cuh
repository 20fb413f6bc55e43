// A decode cache's rows as the CUDA kernels read them: in the cache dtype (DtypeRows), or coded
// as the wire ships them (CodedRows; kernels/coded_rows.h is their specification). A kernel
// templated on the reader serves both: At(c, t) finds token t of cache head c once, then
// key(i) and value(i) give its dimension i in float32, dequantised as it is read.
#pragma once

#include "common/base/kv_format.h"
#include "kernels/coded_rows.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/selection.h"

namespace kvwire::kernels::cuda {

template <typename T>
struct DtypeRows {
  const T* k = nullptr;
  const T* v = nullptr;  // null where only keys are read
  KvLayout layout;
  int d = 0;

  struct Token {
    const T* k;
    const T* v;
    __device__ float key(int i) const { return ToF32(k[i]); }
    __device__ float value(int i) const { return ToF32(v[i]); }
  };
  __device__ Token At(int c, int t) const {
    const int64_t row = layout.Row(c, t, d);
    return {k + row, v ? v + row : nullptr};
  }
};

template <typename T>
struct CodedRows {
  const uint8_t* k = nullptr;  // key code rows at layout (bytes)
  const uint8_t* v = nullptr;  // value rows at coding.v_layout (bytes); null: keys only
  KvLayout layout;
  KvCoding coding;
  int d = 0, len = 0;

  struct Token {
    KvFormat f;
    int d;
    const T* k_resid;  // the token's rows in the residual, or null
    const T* v_resid;
    const uint8_t* k_codes;  // or its code rows and its key group's parameters
    const uint8_t* params;
    const uint8_t* v_row;
    float v_scale;  // fp8: the group's; int8: the row's

    __device__ float key(int i) const {
      if (k_resid) return ToF32(k_resid[i]);
      const float a = F16ToFloat(GetU16(params + 4 * i)),
                  b = F16ToFloat(GetU16(params + 4 * i + 2));
      const float code = f == KvFormat::kFP8    ? E4M3ToFloat(k_codes[i])
                         : f == KvFormat::kInt8 ? static_cast<float>(k_codes[i])
                                                : static_cast<float>(GetNibble(k_codes, i));
      return a + code * b;
    }
    __device__ float value(int i) const {
      if (v_resid) return ToF32(v_resid[i]);
      if (f == KvFormat::kFP8) return E4M3ToFloat(v_row[i]) * v_scale;
      if (f == KvFormat::kInt8) return static_cast<float>(static_cast<int8_t>(v_row[i])) * v_scale;
      const uint8_t* p =
          v_row + (d + 1) / 2 + 4 * (i / (d < kInt4ValueGroup ? d : kInt4ValueGroup));
      return static_cast<float>(GetNibble(v_row, i)) * F16ToFloat(GetU16(p)) +
             F16ToFloat(GetU16(p + 2));
    }
  };
  __device__ Token At(int c, int t) const {
    Token tok{coding.format, d, nullptr, nullptr, nullptr, nullptr, nullptr, 0.f};
    const int resid = coding.ResidBegin(len);
    if (t >= resid) {
      const int64_t at = (int64_t{c} * coding.resid_tokens + (t - resid)) * d;
      tok.k_resid = static_cast<const T*>(coding.k_resid) + at;
      tok.v_resid = static_cast<const T*>(coding.v_resid) + at;
      return tok;
    }
    const int g = KvGroups{coding.kept}.Of(t);
    tok.k_codes = k + layout.Row(c, t, CodedKeyRowBytes(coding.format, d));
    tok.params = coding.k_params + KeyParamsAt(coding, d, c, g);
    if (v == nullptr) return tok;
    tok.v_row = v + coding.v_layout.Row(c, t, CodedValueRowBytes(coding.format, d));
    if (coding.format == KvFormat::kFP8) {
      tok.v_scale = E8M0ToFloat(coding.v_scales[int64_t{c} * coding.max_groups + g]);
    } else if (coding.format == KvFormat::kInt8) {
      tok.v_scale = Bf16ToFloat(GetU16(tok.v_row + d));
    }
    return tok;
  }
};

// Calls f(rows) with the reader of a cache: coded (KvCoding) or in the dtype T. `v` may be null
// where only keys are read.
template <typename T, typename F>
__device__ __forceinline__ void WithRows(const void* k, const void* v, const KvLayout& layout,
                                         const KvCoding& coding, int d, int len, F&& f) {
  if (coding.coded()) {
    f(CodedRows<T>{static_cast<const uint8_t*>(k), static_cast<const uint8_t*>(v), layout, coding,
                   d, len});
  } else {
    f(DtypeRows<T>{static_cast<const T*>(k), static_cast<const T*>(v), layout, d});
  }
}

}  // namespace kvwire::kernels::cuda
