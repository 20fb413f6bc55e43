#include "common/base/kv_format.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvwire {
namespace {

float AbsMax(const float* x, int n) {
  float m = 0;
  for (int i = 0; i < n; ++i) m = std::fmax(m, std::fabs(x[i]));
  return m;
}

// One key group: the n rows of x ([n][d] floats), codes into code rows of `row` bytes,
// per channel parameters into `params` (KvKeyGroupBytes: {a, b} per channel, f16).
void CodeKeyGroup(KvFormat f, int d, const float* x, int n, uint8_t* codes, size_t row,
                  uint8_t* params) {
  for (int c = 0; c < d; ++c) {
    CodeKeyChannel(
        f, c, n, [&](int t) { return x[static_cast<size_t>(t) * d + c]; },
        [&](int t) { return codes + static_cast<size_t>(t) * row; }, params);
  }
}

// Every E4M3 code's value, so that decoding is a lookup (E4M3ToFloat is the definition).
const float* E4M3Table() {
  static const auto* const kTable = [] {
    auto* t = new float[256];
    for (int c = 0; c < 256; ++c) t[c] = E4M3ToFloat(static_cast<uint8_t>(c));
    return t;
  }();
  return kTable;
}

// One key row of a group whose per-channel parameters a, b are decoded already.
void KeyRowFromParams(KvFormat f, int d, const uint8_t* code_row, const float* a, const float* b,
                      float* x) {
  switch (f) {
    case KvFormat::kFP8: {
      const float* e4m3 = E4M3Table();
      for (int c = 0; c < d; ++c) x[c] = a[c] + e4m3[code_row[c]] * b[c];
      return;
    }
    case KvFormat::kInt8:
      for (int c = 0; c < d; ++c) x[c] = a[c] + static_cast<float>(code_row[c]) * b[c];
      return;
    default:
      for (int c = 0; c < d; ++c) x[c] = a[c] + static_cast<float>(GetNibble(code_row, c)) * b[c];
      return;
  }
}

// One value row (float) back: int8 and int4 (fp8 rows share their group's scale).
void IntValueRowToFloat(KvFormat f, int d, const uint8_t* in, float* x) {
  switch (f) {
    case KvFormat::kInt8: {
      const float scale = Bf16ToFloat(GetU16(in + d));
      for (int i = 0; i < d; ++i) x[i] = static_cast<float>(static_cast<int8_t>(in[i])) * scale;
      return;
    }
    default: {
      const int g = std::min(kInt4ValueGroup, d);
      const uint8_t* p = in + (d + 1) / 2;
      for (int first = 0; first < d; first += g, p += 4) {
        const float step = F16ToFloat(GetU16(p)), min = F16ToFloat(GetU16(p + 2));
        for (int i = first; i < std::min(d, first + g); ++i) {
          x[i] = static_cast<float>(GetNibble(in, i)) * step + min;
        }
      }
      return;
    }
  }
}

// Raw formats: the rows as they are (auto), or converted to bf16.
DType RawType(KvFormat f, DType dtype) { return f == KvFormat::kAuto ? dtype : DType::kBF16; }

void ConvertRows(DType from, DType to, size_t values, const void* in, void* out) {
  if (from == to) {
    std::memcpy(out, in, values * DTypeSize(from));
    return;
  }
  std::vector<float> x(values);
  ToFloat(from, in, x.data(), values);
  FromFloat(to, x.data(), out, values);
}

}  // namespace

absl::string_view KvFormatName(KvFormat f) {
  switch (f) {
    case KvFormat::kAuto:
      return "auto";
    case KvFormat::kBF16:
      return "bf16";
    case KvFormat::kFP8:
      return "fp8";
    case KvFormat::kInt8:
      return "int8";
    case KvFormat::kInt4:
      return "int4";
  }
  return "?";
}

const char* KvFormatNames() { return "auto, bf16, fp8, int8, int4"; }

absl::StatusOr<KvFormat> ParseKvFormat(absl::string_view name) {
  for (KvFormat f : kAllKvFormats) {
    if (name == KvFormatName(f)) return f;
  }
  if (name == "fp8_e4m3") return KvFormat::kFP8;
  return absl::InvalidArgumentError(
      absl::StrCat("must be one of ", KvFormatNames(), "; got '", name, "'"));
}

absl::Status CheckKvFormat(KvFormat format, int head_dim) {
  if (format == KvFormat::kInt4 && head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_format int4 packs two values per byte and needs an even head_dim; the model's is ",
        head_dim));
  }
  return absl::OkStatus();
}

size_t KvKeyCodeBytes(KvFormat format, DType dtype, int head_dim) {
  if (KvCoded(format)) return static_cast<size_t>(CodedKeyRowBytes(format, head_dim));
  return static_cast<size_t>(head_dim) * (format == KvFormat::kBF16 ? 2 : DTypeSize(dtype));
}

size_t KvValueRowBytes(KvFormat format, DType dtype, int head_dim) {
  if (KvCoded(format)) return static_cast<size_t>(CodedValueRowBytes(format, head_dim));
  return KvKeyCodeBytes(format, dtype, head_dim);
}

size_t KvKeyGroupBytes(KvFormat format, int head_dim) {
  if (!KvCoded(format)) return 0;
  return static_cast<size_t>(head_dim) * 4;
}

int KvBlockGroups(KvFormat format, int kept, int first, int n) {
  if (!KvCoded(format) || n <= 0) return 0;
  const KvGroups g{kept};
  return g.Of(first + n - 1) - g.Of(first) + 1;
}

size_t KvKeyBlockBytes(KvFormat format, DType dtype, int head_dim, int kept, int first, int n) {
  return static_cast<size_t>(n) * KvKeyCodeBytes(format, dtype, head_dim) +
         static_cast<size_t>(KvBlockGroups(format, kept, first, n)) *
             KvKeyGroupBytes(format, head_dim);
}

size_t KvValueBlockBytes(KvFormat format, DType dtype, int head_dim, int kept, int first, int n) {
  return static_cast<size_t>(n) * KvValueRowBytes(format, dtype, head_dim) +
         (format == KvFormat::kFP8 ? KvBlockGroups(format, kept, first, n) : 0);
}

void EncodeKeyGroup(KvFormat format, DType dtype, int d, int n, const void* rows, uint8_t* codes,
                    uint8_t* params) {
  std::vector<float> x(static_cast<size_t>(n) * d);
  ToFloat(dtype, rows, x.data(), x.size());
  CodeKeyGroup(format, d, x.data(), n, codes, KvKeyCodeBytes(format, dtype, d), params);
}

void EncodeValueGroup(KvFormat format, DType dtype, int d, int n, const void* rows, uint8_t* codes,
                      uint8_t* fp8_scale) {
  std::vector<float> x(static_cast<size_t>(n) * d);
  ToFloat(dtype, rows, x.data(), x.size());
  if (format == KvFormat::kFP8) {
    // E4M3's floating point spans 2^17 within one scale, so the rows of a group share one, a
    // power of two (an E8M0 byte), rather than each row carrying its own.
    const float amax = AbsMax(x.data(), static_cast<int>(x.size()));
    *fp8_scale = E8M0Up(amax, kE4M3Max);
    // A power of two: multiplying by its inverse is the division, exactly.
    const float inverse = 1.0f / E8M0ToFloat(*fp8_scale);
    for (size_t i = 0; i < x.size(); ++i) codes[i] = amax > 0 ? FloatToE4M3(x[i] * inverse) : 0;
    return;
  }
  const size_t row = KvValueRowBytes(format, dtype, d);
  for (int r = 0; r < n; ++r)
    CodeIntValueRow(
        format, d, [&](int i) { return x[static_cast<size_t>(r) * d + i]; }, codes + r * row);
}

namespace {

// A key group's parameters as floats: a and b per channel.
void GroupParams(int d, const uint8_t* params, float* a, float* b) {
  for (int c = 0; c < d; ++c) {
    a[c] = F16ToFloat(GetU16(params + 4 * c));
    b[c] = F16ToFloat(GetU16(params + 4 * c + 2));
  }
}

}  // namespace

void DecodeKeyRow(KvFormat format, int d, const uint8_t* codes, const uint8_t* params, float* out) {
  // Called per row (a coded cache's summaries and exact scores read every key): no allocation.
  thread_local std::vector<float> a, b;
  a.resize(d);
  b.resize(d);
  GroupParams(d, params, a.data(), b.data());
  KeyRowFromParams(format, d, codes, a.data(), b.data(), out);
}

void DecodeValueRow(KvFormat format, int d, const uint8_t* row, uint8_t fp8_scale, float* out) {
  if (format == KvFormat::kFP8) {
    const float* e4m3 = E4M3Table();
    const float scale = E8M0ToFloat(fp8_scale);
    for (int i = 0; i < d; ++i) out[i] = e4m3[row[i]] * scale;
    return;
  }
  IntValueRowToFloat(format, d, row, out);
}

void EncodeKvKeys(KvFormat format, DType dtype, int d, int kept, int first, int n, const void* head,
                  void* out) {
  const size_t in_row = static_cast<size_t>(d) * DTypeSize(dtype);
  const auto* rows = static_cast<const uint8_t*>(head);
  if (!KvCoded(format)) {
    ConvertRows(dtype, RawType(format, dtype), static_cast<size_t>(n) * d, rows + first * in_row,
                out);
    return;
  }
  const KvGroups groups{kept};
  const size_t row = KvKeyCodeBytes(format, dtype, d);
  auto* codes = static_cast<uint8_t*>(out);
  uint8_t* params = codes + static_cast<size_t>(n) * row;
  std::vector<uint8_t> group_codes;
  for (int g = groups.Of(first); n > 0 && g <= groups.Of(first + n - 1); ++g) {
    // The whole group's parameters; this block's rows of its codes.
    const int b = groups.Begin(g), e = groups.End(g);
    group_codes.resize(static_cast<size_t>(e - b) * row);
    EncodeKeyGroup(format, dtype, d, e - b, rows + b * in_row, group_codes.data(), params);
    params += KvKeyGroupBytes(format, d);
    const int lo = std::max(b, first), hi = std::min(e, first + n);
    std::memcpy(codes + (lo - first) * row, group_codes.data() + (lo - b) * row, (hi - lo) * row);
  }
}

void DecodeKvKeys(KvFormat format, DType dtype, int d, int kept, int first, int n, const void* in,
                  void* out) {
  if (!KvCoded(format)) {
    ConvertRows(RawType(format, dtype), dtype, static_cast<size_t>(n) * d, in, out);
    return;
  }
  const KvGroups groups{kept};
  const auto* codes = static_cast<const uint8_t*>(in);
  const size_t row = KvKeyCodeBytes(format, dtype, d);
  const uint8_t* params = codes + static_cast<size_t>(n) * row;
  std::vector<float> x(d), a(d), b(d);
  const size_t out_row = static_cast<size_t>(d) * DTypeSize(dtype);
  for (int g = groups.Of(first); n > 0 && g <= groups.Of(first + n - 1); ++g) {
    GroupParams(d, params, a.data(), b.data());
    params += KvKeyGroupBytes(format, d);
    const int lo = std::max(groups.Begin(g), first), hi = std::min(groups.End(g), first + n);
    for (int t = lo; t < hi; ++t) {
      KeyRowFromParams(format, d, codes + (t - first) * row, a.data(), b.data(), x.data());
      FromFloat(dtype, x.data(), static_cast<uint8_t*>(out) + (t - first) * out_row, d);
    }
  }
}

void EncodeKvValues(KvFormat format, DType dtype, int d, int kept, int first, int n,
                    const void* head, void* out) {
  const size_t in_row = static_cast<size_t>(d) * DTypeSize(dtype);
  const auto* rows = static_cast<const uint8_t*>(head);
  auto* dst = static_cast<uint8_t*>(out);
  if (!KvCoded(format)) {
    ConvertRows(dtype, RawType(format, dtype), static_cast<size_t>(n) * d, rows + first * in_row,
                out);
    return;
  }
  if (format != KvFormat::kFP8) {  // rows of their own
    EncodeValueGroup(format, dtype, d, n, rows + first * in_row, dst, nullptr);
    return;
  }
  const KvGroups groups{kept};
  uint8_t* scales = dst + static_cast<size_t>(n) * d;
  std::vector<uint8_t> group_codes;
  for (int g = groups.Of(first); n > 0 && g <= groups.Of(first + n - 1); ++g, ++scales) {
    const int b = groups.Begin(g), e = groups.End(g);
    group_codes.resize(static_cast<size_t>(e - b) * d);
    EncodeValueGroup(format, dtype, d, e - b, rows + b * in_row, group_codes.data(), scales);
    const int lo = std::max(b, first), hi = std::min(e, first + n);
    std::memcpy(dst + static_cast<size_t>(lo - first) * d,
                group_codes.data() + static_cast<size_t>(lo - b) * d,
                static_cast<size_t>(hi - lo) * d);
  }
}

void DecodeKvValues(KvFormat format, DType dtype, int d, int kept, int first, int n, const void* in,
                    void* out) {
  if (!KvCoded(format)) {
    ConvertRows(RawType(format, dtype), dtype, static_cast<size_t>(n) * d, in, out);
    return;
  }
  const auto* src = static_cast<const uint8_t*>(in);
  const size_t dst_row = static_cast<size_t>(d) * DTypeSize(dtype);
  const size_t src_row = KvValueRowBytes(format, dtype, d);
  std::vector<float> x(d);
  if (format != KvFormat::kFP8) {
    for (int r = 0; r < n; ++r) {
      IntValueRowToFloat(format, d, src + r * src_row, x.data());
      FromFloat(dtype, x.data(), static_cast<uint8_t*>(out) + r * dst_row, d);
    }
    return;
  }
  const KvGroups groups{kept};
  const uint8_t* scales = src + static_cast<size_t>(n) * d;
  for (int g = groups.Of(first); n > 0 && g <= groups.Of(first + n - 1); ++g, ++scales) {
    const int lo = std::max(groups.Begin(g), first), hi = std::min(groups.End(g), first + n);
    for (int t = lo; t < hi; ++t) {
      DecodeValueRow(format, d, src + static_cast<size_t>(t - first) * d, *scales, x.data());
      FromFloat(dtype, x.data(), static_cast<uint8_t*>(out) + (t - first) * dst_row, d);
    }
  }
}

}  // namespace kvwire
