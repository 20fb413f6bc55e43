#include "kernels/coded_rows.h"

#include <cstring>
#include <vector>

namespace kvwire::kernels {

void CodedKeyRow(const void* k, const KvLayout& layout, const KvCoding& coding, DType dtype, int d,
                 int len, int c, int t, float* out) {
  const int resid = coding.ResidBegin(len);
  if (t >= resid) {
    ToFloat(dtype,
            static_cast<const uint8_t*>(coding.k_resid) + ResidAt(coding, dtype, d, c, t - resid),
            out, d);
    return;
  }
  const int kc = static_cast<int>(KvKeyCodeBytes(coding.format, dtype, d));
  const int g = KvGroups{coding.kept}.Of(t);
  DecodeKeyRow(coding.format, d, static_cast<const uint8_t*>(k) + layout.Row(c, t, kc),
               coding.k_params + KeyParamsAt(coding, d, c, g), out);
}

void CodedValueRow(const void* v, const KvCoding& coding, DType dtype, int d, int len, int c, int t,
                   float* out) {
  const int resid = coding.ResidBegin(len);
  if (t >= resid) {
    ToFloat(dtype,
            static_cast<const uint8_t*>(coding.v_resid) + ResidAt(coding, dtype, d, c, t - resid),
            out, d);
    return;
  }
  const int vc = static_cast<int>(KvValueRowBytes(coding.format, dtype, d));
  const int g = KvGroups{coding.kept}.Of(t);
  const uint8_t scale =
      coding.format == KvFormat::kFP8 ? coding.v_scales[int64_t{c} * coding.max_groups + g] : 0;
  DecodeValueRow(coding.format, d, static_cast<const uint8_t*>(v) + coding.v_layout.Row(c, t, vc),
                 scale, out);
}

void AppendCodedRow(void* k, void* v, const KvLayout& layout, const KvCoding& coding, DType dtype,
                    int d, int c, int t, const float* k_row, const float* v_row) {
  const int first = coding.ResidBegin(t);  // the residual's first token
  auto* k_resid = static_cast<uint8_t*>(coding.k_resid);
  auto* v_resid = static_cast<uint8_t*>(coding.v_resid);
  FromFloat(dtype, k_row, k_resid + ResidAt(coding, dtype, d, c, t - first), d);
  FromFloat(dtype, v_row, v_resid + ResidAt(coding, dtype, d, c, t - first), d);
  if (t + 1 - first < kKeyGroupTokens) return;
  // The residual is a whole group: coded into its rows, and emptied.
  const int g = KvGroups{coding.kept}.Of(first);
  const int n = kKeyGroupTokens;
  const size_t kc = KvKeyCodeBytes(coding.format, dtype, d);
  const size_t vc = KvValueRowBytes(coding.format, dtype, d);
  std::vector<uint8_t> codes(n * std::max(kc, vc));
  EncodeKeyGroup(coding.format, dtype, d, n, k_resid + ResidAt(coding, dtype, d, c, 0),
                 codes.data(), coding.k_params + KeyParamsAt(coding, d, c, g));
  for (int i = 0; i < n; ++i) {
    std::memcpy(static_cast<uint8_t*>(k) + layout.Row(c, first + i, static_cast<int>(kc)),
                codes.data() + i * kc, kc);
  }
  uint8_t* scale = coding.format == KvFormat::kFP8
                       ? coding.v_scales + int64_t{c} * coding.max_groups + g
                       : nullptr;
  EncodeValueGroup(coding.format, dtype, d, n, v_resid + ResidAt(coding, dtype, d, c, 0),
                   codes.data(), scale);
  for (int i = 0; i < n; ++i) {
    std::memcpy(static_cast<uint8_t*>(v) + coding.v_layout.Row(c, first + i, static_cast<int>(vc)),
                codes.data() + i * vc, vc);
  }
}

}  // namespace kvwire::kernels
