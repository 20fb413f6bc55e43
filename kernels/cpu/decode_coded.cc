// GCC 12 takes the _mm512_undefined_* placeholders inside its AVX-512 intrinsics for
// uninitialised reads once they are inlined here (a false -Wmaybe-uninitialized); the pragma
// must precede the headers, where the warning is placed.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "kernels/cpu/decode_coded.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/coded_rows.h"
#include "kernels/simd.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvwire::kernels::cpu {
namespace {

float F16At(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction, where F16ToFloat is a dozen (exact either way)
#else
  return F16ToFloat(h);
#endif
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

// A key group's parameters folded into the group's query heads: qb = q ∘ b and qa = q·a, so
// that a key of the group scores qa + qb·codes.
void FoldGroup(const uint8_t* params, const float* q, int group, int d, float* qb, float* qa) {
  for (int g = 0; g < group; ++g) {
    float dot = 0.f;
    for (int i = 0; i < d; ++i) {
      qb[g * d + i] = q[g * d + i] * F16At(params + 4 * i + 2);
      dot += q[g * d + i] * F16At(params + 4 * i);
    }
    qa[g] = dot;
  }
}

// The scores of each query head made its softmax, written to its probabilities if asked for,
// and its output cleared.
void Normalise(const DecodeSequence& seq, int c, int group, int d, const int32_t* idx, int count,
               float* s, float* out) {
  for (int h = 0; h < group; ++h) {
    float* sh = s + int64_t{h} * count;
    const float mx = simd::Max(sh, count);
    const float inv = 1.f / simd::ExpShiftSum(sh, count, mx);
    for (int x = 0; x < count; ++x) sh[x] *= inv;
    std::fill(out + h * d, out + (h + 1) * d, 0.f);
    if (seq.probs) {
      float* probs = seq.probs + (int64_t{c} * group + h) * seq.len;
      std::fill(probs, probs + seq.len, 0.f);
      for (int x = 0; x < count; ++x) probs[idx ? idx[x] : x] = sh[x];
    }
  }
}

#if KVWIRE_AVX2
// The hardware prefetcher alone does not run far enough ahead of a stream of short rows with
// work between (as in the dtype kernel): each pass asks for the row kAhead tokens on.
constexpr int kAhead = 16;
inline void Prefetch(const uint8_t* row, int bytes) {
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
  __builtin_prefetch(row + bytes - 1, 0, 3);
}

// Eight (or, with AVX-512, sixteen) codes from `row` at channel i (a multiple of the width),
// as floats: E4M3 values (fp8, by the bit arithmetic of E4M3Bits), the integers (int8 keys'
// unsigned codes, int4's nibbles in channel order), or int8 values' signed codes. The kernel
// below is written once over these two widths.
struct Vec8 {
  using T = __m256;
  static constexpr int N = 8;
  static T Zero() { return _mm256_setzero_ps(); }
  static T Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T Set1(float x) { return _mm256_set1_ps(x); }
  static T Fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float Sum(T v) { return simd::HorizontalSum(v); }
  template <KvFormat F, bool kSigned = false>
  static T Codes(const uint8_t* row, int i) {
    if constexpr (F == KvFormat::kInt4) {
      int32_t four;
      std::memcpy(&four, row + i / 2, 4);
      const __m128i b = _mm_cvtsi32_si128(four);
      const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
    } else {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i));
      if constexpr (F == KvFormat::kInt8) {
        return _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
      } else {
        const __m256i x = _mm256_cvtepu8_epi32(b);
        const __m256i em = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
        const __m256i normal =
            _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23));
        const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0x1p-9f));
        const __m256 is_normal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(em, _mm256_set1_epi32(7)));
        __m256 v = _mm256_blendv_ps(sub, _mm256_castsi256_ps(normal), is_normal);
        const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7f)));
        v = _mm256_blendv_ps(v, _mm256_set1_ps(NAN), is_nan);
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
        return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
      }
    }
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Vec16 {
  using T = __m512;
  static constexpr int N = 16;
  static T Zero() { return _mm512_setzero_ps(); }
  static T Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T Set1(float x) { return _mm512_set1_ps(x); }
  static T Fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float Sum(T v) { return _mm512_reduce_add_ps(v); }
  template <KvFormat F, bool kSigned = false>
  static T Codes(const uint8_t* row, int i) {
    if constexpr (F == KvFormat::kInt4) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i / 2));
      const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
    } else {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
      if constexpr (F == KvFormat::kInt8) {
        return _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
      } else {
        const __m512i x = _mm512_cvtepu8_epi32(b);
        const __m512i em = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
        const __m512i normal =
            _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23));
        const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(0x1p-9f));
        __m512 v = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(em, _mm512_set1_epi32(7)), sub,
                                        _mm512_castsi512_ps(normal));
        v = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7f)), v,
                                 _mm512_set1_ps(NAN));
        const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
        return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
      }
    }
  }
};
#endif

// DecodeHeadCoded for G query heads and a head_dim that is a multiple of kBlock, in vectors V:
// each key row's codes widened once for the G dot products; values in blocks of kBlock channels
// whose G outputs stay in registers while a tile of tokens is added (as the dtype kernel does),
// a row's scale folded into its weight, and int4's per-row minimum summed apart.
template <int G, KvFormat F, typename V>
void DecodeHeadCodedVec(const DecodeSequence& seq, int c, int d, DType dtype, float scale,
                        float* s) {
  const KvCoding& coding = seq.coding;
  const int count = seq.indices ? seq.num_indices : seq.len;
  const int32_t* idx = seq.indices ? seq.indices + int64_t{c} * seq.num_indices : nullptr;
  const int resid = coding.ResidBegin(seq.len);
  const KvGroups groups{coding.kept};
  const int kc = static_cast<int>(KvKeyCodeBytes(F, dtype, d));
  const int vc = static_cast<int>(KvValueRowBytes(F, dtype, d));
  const auto* k = static_cast<const uint8_t*>(seq.k);
  const auto* v = static_cast<const uint8_t*>(seq.v);
  const float* q = seq.q + int64_t{c} * G * d;
  float* out = seq.out + int64_t{c} * G * d;
  thread_local std::vector<float> qb, row, weight, minimum;
  qb.resize(static_cast<size_t>(G) * d);
  row.resize(d);
  float qa[G] = {};
  int current = -1;
  for (int x = 0; x < count; ++x) {
    const int tok = idx ? idx[x] : x;
    if (tok >= resid) {
      const void* r =
          static_cast<const uint8_t*>(coding.k_resid) + ResidAt(coding, dtype, d, c, tok - resid);
      for (int g = 0; g < G; ++g)
        s[int64_t{g} * count + x] = simd::Dot(q + g * d, r, dtype, d) * scale;
      continue;
    }
    const int gi = groups.Of(tok);
    if (gi != current) {
      FoldGroup(coding.k_params + KeyParamsAt(coding, d, c, gi), q, G, d, qb.data(), qa);
      current = gi;
    }
    if (x + kAhead < count) {
      const int next = idx ? idx[x + kAhead] : x + kAhead;
      if (next < resid) Prefetch(k + seq.layout.Row(c, next, kc), kc);
    }
    const uint8_t* codes = k + seq.layout.Row(c, tok, kc);
    typename V::T acc[G];
    for (int g = 0; g < G; ++g) acc[g] = V::Zero();
    for (int i = 0; i < d; i += V::N) {
      const typename V::T cv = V::template Codes<F>(codes, i);
      for (int g = 0; g < G; ++g) acc[g] = V::Fmadd(V::Load(qb.data() + g * d + i), cv, acc[g]);
    }
    for (int g = 0; g < G; ++g) s[int64_t{g} * count + x] = (V::Sum(acc[g]) + qa[g]) * scale;
  }
  Normalise(seq, c, G, d, idx, count, s, out);
  // Values in tiles of tokens that stay in L1 while each block of 32 channels reads them: first
  // each token's weight for head g folded with its row's scale (int8: its bf16 scale; fp8: its
  // group's power of two; int4: per channel group its step, its minimum summed apart), then the
  // blocks. (The weights of all tokens first would stream the rows from memory twice.)
  const int channel_groups = F == KvFormat::kInt4 ? (d + kInt4ValueGroup - 1) / kInt4ValueGroup : 1;
  constexpr bool kSigned = F == KvFormat::kInt8;
  constexpr int kTile = 64;
  constexpr int kVecs = G <= 4 ? 4 : 2, kBlock = kVecs * V::N;
  weight.resize(static_cast<size_t>(G) * kTile * channel_groups);
  minimum.assign(static_cast<size_t>(G) * channel_groups, 0.f);
  int value_group = -1;
  float group_scale = 1.f;
  for (int x0 = 0; x0 < count; x0 += kTile) {
    const int x1 = std::min(count, x0 + kTile);
    for (int x = x0; x < x1; ++x) {
      const int tok = idx ? idx[x] : x;
      if (tok >= resid) continue;
      if (x + kAhead < count) {
        const int next = idx ? idx[x + kAhead] : x + kAhead;
        if (next < resid) Prefetch(v + coding.v_layout.Row(c, next, vc), vc);
      }
      const uint8_t* r = v + coding.v_layout.Row(c, tok, vc);
      for (int cg = 0; cg < channel_groups; ++cg) {
        float row_scale = 1.f, row_min = 0.f;
        if constexpr (F == KvFormat::kInt8) {
          uint16_t b;
          std::memcpy(&b, r + d, 2);
          row_scale = Bf16ToFloat(b);
        } else if constexpr (F == KvFormat::kInt4) {
          row_scale = F16At(r + d / 2 + 4 * cg);
          row_min = F16At(r + d / 2 + 4 * cg + 2);
        } else {
          const int gi = groups.Of(tok);
          if (gi != value_group) {
            group_scale = E8M0ToFloat(coding.v_scales[int64_t{c} * coding.max_groups + gi]);
            value_group = gi;
          }
          row_scale = group_scale;
        }
        for (int g = 0; g < G; ++g) {
          const float w = s[int64_t{g} * count + x];
          weight[(static_cast<size_t>(g) * channel_groups + cg) * kTile + (x - x0)] = w * row_scale;
          minimum[g * channel_groups + cg] += w * row_min;
        }
      }
    }
    for (int i0 = 0; i0 < d; i0 += kBlock) {
      const int cg = F == KvFormat::kInt4 ? i0 / kInt4ValueGroup : 0;
      typename V::T acc[G][kVecs];
      for (int g = 0; g < G; ++g) {
        for (int u = 0; u < kVecs; ++u) acc[g][u] = V::Load(out + g * d + i0 + V::N * u);
      }
      for (int x = x0; x < x1; ++x) {
        const int tok = idx ? idx[x] : x;
        if (tok >= resid) continue;
        const uint8_t* r = v + coding.v_layout.Row(c, tok, vc);
        typename V::T cv[kVecs];
        for (int u = 0; u < kVecs; ++u) cv[u] = V::template Codes<F, kSigned>(r, i0 + V::N * u);
        for (int g = 0; g < G; ++g) {
          const typename V::T w =
              V::Set1(weight[(static_cast<size_t>(g) * channel_groups + cg) * kTile + (x - x0)]);
          for (int u = 0; u < kVecs; ++u) acc[g][u] = V::Fmadd(w, cv[u], acc[g][u]);
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int u = 0; u < kVecs; ++u) V::Store(out + g * d + i0 + V::N * u, acc[g][u]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {  // int4's minimums, each over its channel group
    for (int cg = 0; cg < channel_groups; ++cg) {
      const int end = std::min(d, (cg + 1) * kInt4ValueGroup);
      const float m = minimum[g * channel_groups + cg];
      for (int i = cg * kInt4ValueGroup; i < end; ++i) out[g * d + i] += m;
    }
  }
  // The residual's rows, in the dtype.
  for (int x = 0; x < count; ++x) {
    const int tok = idx ? idx[x] : x;
    if (tok < resid) continue;
    const void* r =
        static_cast<const uint8_t*>(coding.v_resid) + ResidAt(coding, dtype, d, c, tok - resid);
    for (int g = 0; g < G; ++g) simd::Axpy(s[int64_t{g} * count + x], r, dtype, out + g * d, d);
  }
}

template <int G, typename V>
bool DecodeHeadCodedAnyFormat(const DecodeSequence& seq, int c, int d, DType dtype, float scale,
                              float* s) {
  switch (seq.coding.format) {
    case KvFormat::kFP8:
      DecodeHeadCodedVec<G, KvFormat::kFP8, V>(seq, c, d, dtype, scale, s);
      return true;
    case KvFormat::kInt8:
      DecodeHeadCodedVec<G, KvFormat::kInt8, V>(seq, c, d, dtype, scale, s);
      return true;
    case KvFormat::kInt4:
      DecodeHeadCodedVec<G, KvFormat::kInt4, V>(seq, c, d, dtype, scale, s);
      return true;
    default:
      return false;
  }
}

// A value block's width: 4 vectors per query head for groups of up to 4, else 2.
template <typename V>
bool Fits(int group, int d) {
  return d % ((group <= 4 ? 4 : 2) * V::N) == 0;
}

template <typename V>
bool DecodeHeadCodedIn(const DecodeSequence& seq, int c, int group, int d, DType dtype, float scale,
                       float* s) {
  if (!Fits<V>(group, d)) return false;
  switch (group) {
    case 1:
      return DecodeHeadCodedAnyFormat<1, V>(seq, c, d, dtype, scale, s);
    case 2:
      return DecodeHeadCodedAnyFormat<2, V>(seq, c, d, dtype, scale, s);
    case 4:
      return DecodeHeadCodedAnyFormat<4, V>(seq, c, d, dtype, scale, s);
    case 8:
      return DecodeHeadCodedAnyFormat<8, V>(seq, c, d, dtype, scale, s);
  }
  return false;
}
#endif

// The vector kernel where it applies: AVX-512 or AVX2, a head_dim of whole value blocks, groups
// of 1, 2, 4 or 8.
bool DecodeHeadCodedFast(const DecodeSequence& seq, int c, int group, int d, DType dtype,
                         float scale, float* s) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (DecodeHeadCodedIn<Vec16>(seq, c, group, d, dtype, scale, s)) return true;
#endif
#if KVWIRE_AVX2
  return DecodeHeadCodedIn<Vec8>(seq, c, group, d, dtype, scale, s);
#else
  return false;
#endif
}

}  // namespace

// Keys: a key is a + code · b per channel over its group, so a query's score is
// q·a + (q ∘ b)·code: q ∘ b and q·a are formed once per group, and each row costs its codes
// widened and one dot per query head, as a row in the cache dtype does. Values: each row
// dequantised once and added to every head's output.
void DecodeHeadCoded(const DecodeSequence& seq, int c, int group, int d, DType dtype, float scale,
                     float* s) {
  if (DecodeHeadCodedFast(seq, c, group, d, dtype, scale, s)) return;
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
      FoldGroup(coding.k_params + KeyParamsAt(coding, d, c, gi), q, group, d, qb.data(), qa.data());
      current = gi;
    }
    KeyCodes(f, d, k + seq.layout.Row(c, tok, kc), row.data());
    for (int g = 0; g < group; ++g) {
      s[int64_t{g} * count + x] =
          (simd::Dot(qb.data() + g * d, row.data(), DType::kF32, d) + qa[g]) * scale;
    }
  }
  Normalise(seq, c, group, d, idx, count, s, out);
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
