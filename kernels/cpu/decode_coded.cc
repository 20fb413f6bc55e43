#include "kernels/cpu/decode_coded.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/coded_rows.h"
#include "kernels/simd.h"

namespace kvwire::kernels::cpu {
namespace {

float F16At(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToFloat(h);
}

// E4M3ToFloat by bit arithmetic, so that a row's loop vectorises: a normal code's exponent and
// mantissa bits shifted into a float's, the exponent rebased (+120), a subnormal m · 2^-9.
inline float E4M3Bits(uint8_t x) {
  const uint32_t em = x & 0x7fu;
  float v;
  if (em >= 8) {
    const uint32_t bits = (em << 20) + (120u << 23);
    std::memcpy(&v, &bits, 4);
  } else {
    v = static_cast<float>(em) * 0x1p-9f;
  }
  if (em == 0x7fu) v = NAN;
  return (x & 0x80u) ? -v : v;
}

// A row's codes as floats: the key codes (fp8 as E4M3 values, the integers as themselves), or
// a value row dequantised (fp8 before its group's scale).
void KeyCodes(KvFormat f, int d, const uint8_t* row, float* out) {
  switch (f) {
    case KvFormat::kFP8:
      for (int i = 0; i < d; ++i) out[i] = E4M3Bits(row[i]);
      return;
    case KvFormat::kInt8:
      for (int i = 0; i < d; ++i) out[i] = static_cast<float>(row[i]);
      return;
    default:
      for (int i = 0; i < d / 2; ++i) {
        out[2 * i] = static_cast<float>(row[i] & 0x0f);
        out[2 * i + 1] = static_cast<float>(row[i] >> 4);
      }
      return;
  }
}

void ValueRow(KvFormat f, int d, const uint8_t* row, float* out) {
  switch (f) {
    case KvFormat::kFP8:
      for (int i = 0; i < d; ++i) out[i] = E4M3Bits(row[i]);
      return;
    case KvFormat::kInt8: {
      uint16_t s;
      std::memcpy(&s, row + d, 2);
      const float scale = Bf16ToFloat(s);
      for (int i = 0; i < d; ++i) out[i] = static_cast<float>(static_cast<int8_t>(row[i])) * scale;
      return;
    }
    default: {
      const int g = std::min(kInt4ValueGroup, d);
      const uint8_t* params = row + d / 2;
      for (int first = 0; first < d; first += g, params += 4) {
        const float step = F16At(params), min = F16At(params + 2);
        for (int i = first / 2; i < std::min(d, first + g) / 2; ++i) {
          out[2 * i] = static_cast<float>(row[i] & 0x0f) * step + min;
          out[2 * i + 1] = static_cast<float>(row[i] >> 4) * step + min;
        }
      }
      return;
    }
  }
}

}  // namespace

// Keys: a key is a + code · b per channel over its group, so a query's score is
// q·a + (q ∘ b)·code: q ∘ b and q·a are formed once per group, and each row costs its codes
// widened and one dot per query head, as a row in the cache dtype does. Values: each row
// dequantised once and added to every head's output.
void DecodeHeadCoded(const DecodeSequence& seq, int c, int group, int d, DType dtype, float scale,
                     float* s) {
  const KvCoding& coding = seq.coding;
  const KvFormat f = coding.format;
  const int count = seq.indices ? seq.num_indices : seq.len;
  const int32_t* idx = seq.indices ? seq.indices + int64_t{c} * seq.num_indices : nullptr;
  const int resid = coding.ResidBegin(seq.len);
  const KvGroups groups{coding.kept};
  const int kc = static_cast<int>(KvKeyCodeBytes(f, dtype, d));
  const int vc = static_cast<int>(KvValueRowBytes(f, dtype, d));
  const auto* k = static_cast<const uint8_t*>(seq.k);
  const auto* v = static_cast<const uint8_t*>(seq.v);
  const float* q = seq.q + int64_t{c} * group * d;
  float* out = seq.out + int64_t{c} * group * d;
  thread_local std::vector<float> qb, qa, row;
  qb.resize(static_cast<size_t>(group) * d);
  qa.resize(group);
  row.resize(d);
  int current = -1;
  for (int x = 0; x < count; ++x) {
    const int tok = idx ? idx[x] : x;
    if (tok >= resid) {
      ToFloat(
          dtype,
          static_cast<const uint8_t*>(coding.k_resid) + ResidAt(coding, dtype, d, c, tok - resid),
          row.data(), d);
      for (int g = 0; g < group; ++g) {
        s[int64_t{g} * count + x] = simd::Dot(q + g * d, row.data(), DType::kF32, d) * scale;
      }
      continue;
    }
    const int gi = groups.Of(tok);
    if (gi != current) {
      const uint8_t* params = coding.k_params + KeyParamsAt(coding, d, c, gi);
      for (int g = 0; g < group; ++g) {
        float dot = 0.f;
        for (int i = 0; i < d; ++i) {
          qb[g * d + i] = q[g * d + i] * F16At(params + 4 * i + 2);
          dot += q[g * d + i] * F16At(params + 4 * i);
        }
        qa[g] = dot;
      }
      current = gi;
    }
    KeyCodes(f, d, k + seq.layout.Row(c, tok, kc), row.data());
    for (int g = 0; g < group; ++g) {
      s[int64_t{g} * count + x] =
          (simd::Dot(qb.data() + g * d, row.data(), DType::kF32, d) + qa[g]) * scale;
    }
  }
  for (int g = 0; g < group; ++g) {
    float* sh = s + int64_t{g} * count;
    const float mx = simd::Max(sh, count);
    const float inv = 1.f / simd::ExpShiftSum(sh, count, mx);
    for (int x = 0; x < count; ++x) sh[x] *= inv;
    std::fill(out + g * d, out + (g + 1) * d, 0.f);
    if (seq.probs) {
      float* probs = seq.probs + (int64_t{c} * group + g) * seq.len;
      std::fill(probs, probs + seq.len, 0.f);
      for (int x = 0; x < count; ++x) probs[idx ? idx[x] : x] = sh[x];
    }
  }
  int value_group = -1;
  float group_scale = 1.f;
  for (int x = 0; x < count; ++x) {
    const int tok = idx ? idx[x] : x;
    float row_scale = 1.f;
    if (tok >= resid) {
      ToFloat(
          dtype,
          static_cast<const uint8_t*>(coding.v_resid) + ResidAt(coding, dtype, d, c, tok - resid),
          row.data(), d);
    } else {
      ValueRow(f, d, v + coding.v_layout.Row(c, tok, vc), row.data());
      if (f == KvFormat::kFP8) {
        const int gi = groups.Of(tok);
        if (gi != value_group) {
          group_scale = E8M0ToFloat(coding.v_scales[int64_t{c} * coding.max_groups + gi]);
          value_group = gi;
        }
        row_scale = group_scale;
      }
    }
    for (int g = 0; g < group; ++g) {
      simd::Axpy(s[int64_t{g} * count + x] * row_scale, row.data(), DType::kF32, out + g * d, d);
    }
  }
}

}  // namespace kvwire::kernels::cpu
