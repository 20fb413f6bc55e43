// The reference backend: the specification of every op. Plain loops, float32
// accumulation, no threads, no tricks. Optimised backends are tested against it.
#include "kernels/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/crc32c.h"
#include "common/base/status.h"
#include "kernels/coded_rows.h"
#include "kernels/host_memory.h"
#include "kernels/reference_selection.h"
#include "kernels/validate.h"

namespace kvwire::kernels {
namespace {

float LoadElement(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.f;
}

class ReferenceBackend final : public HostMemoryBackend {
 public:
  BackendKind kind() const override { return BackendKind::kReference; }

  absl::Status MatMul(const MatMulParams& p) override {
    RETURN_IF_ERROR(ValidateMatMul(p));
    const int64_t xs = p.x_stride ? p.x_stride : p.k;
    const int64_t ys = p.y_stride ? p.y_stride : p.n;
    for (int i = 0; i < p.m; ++i) {
      for (int j = 0; j < p.n; ++j) {
        float acc = 0.f;
        for (int t = 0; t < p.k; ++t) {
          float x = p.x[i * xs + t];
          if (p.w_dtype == DType::kBF16) x = Bf16ToFloat(FloatToBf16(x));  // backend.h
          acc += x * LoadElement(p.w, p.w_dtype, static_cast<int64_t>(j) * p.k + t);
        }
        if (p.bias) acc += p.bias[j];
        p.y[i * ys + j] = acc;
      }
    }
    return absl::OkStatus();
  }

  absl::Status RmsNorm(const RmsNormParams& p) override {
    RETURN_IF_ERROR(ValidateRmsNorm(p));
    for (int r = 0; r < p.rows; ++r) {
      const float* x = p.x + static_cast<int64_t>(r) * p.dim;
      float* y = p.y + static_cast<int64_t>(r) * p.dim;
      if (p.residual) {  // the add, then the norm of the sum
        float* res = p.residual + static_cast<int64_t>(r) * p.dim;
        for (int i = 0; i < p.dim; ++i) res[i] += x[i];
        x = res;
      }
      float ss = 0.f;
      for (int i = 0; i < p.dim; ++i) ss += x[i] * x[i];
      const float inv = 1.f / std::sqrt(ss / p.dim + p.eps);
      for (int i = 0; i < p.dim; ++i) y[i] = x[i] * inv * p.weight[i];
    }
    return absl::OkStatus();
  }

  absl::Status Rope(const RopeParams& p) override {
    RETURN_IF_ERROR(ValidateRope(p));
    const int half = p.head_dim / 2;
    for (int r = 0; r < p.rows; ++r) {
      for (int h = 0; h < p.heads; ++h) {
        float* x = p.x + r * p.row_stride + static_cast<int64_t>(h) * p.head_dim;
        for (int i = 0; i < half; ++i) {
          // float32 angle, as Hugging Face computes it, so positions round the same way.
          const float angle = static_cast<float>(p.positions[r]) * p.inv_freq[i];
          const float c = std::cos(angle);
          const float s = std::sin(angle);
          const float a = x[i], b = x[i + half];
          x[i] = a * c - b * s;
          x[i + half] = b * c + a * s;
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status SwiGlu(const SwiGluParams& p) override {
    RETURN_IF_ERROR(ValidateSwiGlu(p));
    for (int r = 0; r < p.rows; ++r) {
      const float* g = p.gate_up + static_cast<int64_t>(r) * 2 * p.ffn;
      const float* u = g + p.ffn;
      float* o = p.out + static_cast<int64_t>(r) * p.ffn;
      for (int i = 0; i < p.ffn; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
    return absl::OkStatus();
  }

  // Row by row: scores of query i over keys 0..i, softmax, weighted sum of values.
  // O(L) scratch per row, so even the reference never holds L × L.
  absl::Status PrefillAttention(const PrefillAttentionParams& p) override {
    RETURN_IF_ERROR(ValidatePrefillAttention(p));
    const int group = p.n_heads / p.n_kv_heads;
    std::vector<float> s(p.len);
    for (int h = 0; h < p.n_heads; ++h) {
      const int g = h / group;
      for (int i = p.q_begin; i < p.len; ++i) {
        const float* q = p.q + i * p.q_stride + static_cast<int64_t>(h) * p.head_dim;
        float mx = -std::numeric_limits<float>::infinity();
        for (int j = 0; j <= i; ++j) {
          const float* k = p.k + j * p.kv_stride + static_cast<int64_t>(g) * p.head_dim;
          float dot = 0.f;
          for (int d = 0; d < p.head_dim; ++d) dot += q[d] * k[d];
          s[j] = dot * p.scale;
          mx = std::max(mx, s[j]);
        }
        float sum = 0.f;
        for (int j = 0; j <= i; ++j) {
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        float* o = p.out + i * p.out_stride + static_cast<int64_t>(h) * p.head_dim;
        for (int d = 0; d < p.head_dim; ++d) o[d] = 0.f;
        for (int j = 0; j <= i; ++j) {
          const float* v = p.v + j * p.kv_stride + static_cast<int64_t>(g) * p.head_dim;
          const float w = s[j] / sum;
          for (int d = 0; d < p.head_dim; ++d) o[d] += w * v[d];
        }
        const int wrow = i - (p.len - p.window);
        if (p.window > 0 && wrow >= 0) {
          float* ws = p.window_scores + (static_cast<int64_t>(h) * p.window + wrow) * p.len;
          for (int j = 0; j < p.len; ++j) ws[j] = j <= i ? s[j] / sum : 0.f;
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status DecodeAttention(const DecodeAttentionParams& p) override {
    RETURN_IF_ERROR(ValidateDecodeAttention(p));
    const int group = p.n_heads / p.n_cache_heads;
    for (int b = 0; b < p.batch; ++b) {
      const DecodeSequence& seq = p.seqs[b];
      for (int h = 0; h < p.n_heads; ++h) {
        const int c = h / group;
        const int count = seq.indices ? seq.num_indices : seq.len;
        const int32_t* idx =
            seq.indices ? seq.indices + static_cast<int64_t>(c) * seq.num_indices : nullptr;
        const float* q = seq.q + static_cast<int64_t>(h) * p.head_dim;
        std::vector<float> s(count), row(p.head_dim);
        float mx = -std::numeric_limits<float>::infinity();
        for (int t = 0; t < count; ++t) {
          const int64_t tok = idx ? idx[t] : t;
          // Every row as float32 first (a coded cache's dequantised), then one dot product.
          if (seq.coding.coded()) {
            CodedKeyRow(seq.k, seq.layout, seq.coding, p.kv_dtype, p.head_dim, seq.len, c,
                        static_cast<int>(tok), row.data());
          } else {
            const int64_t base = seq.layout.Row(c, static_cast<int>(tok), p.head_dim);
            for (int d = 0; d < p.head_dim; ++d) row[d] = LoadElement(seq.k, p.kv_dtype, base + d);
          }
          float dot = 0.f;
          for (int d = 0; d < p.head_dim; ++d) dot += q[d] * row[d];
          s[t] = dot * p.scale;
          mx = std::max(mx, s[t]);
        }
        float sum = 0.f;
        for (int t = 0; t < count; ++t) {
          s[t] = std::exp(s[t] - mx);
          sum += s[t];
        }
        float* o = seq.out + static_cast<int64_t>(h) * p.head_dim;
        for (int d = 0; d < p.head_dim; ++d) o[d] = 0.f;
        float* probs = seq.probs ? seq.probs + static_cast<int64_t>(h) * seq.len : nullptr;
        if (probs) std::fill(probs, probs + seq.len, 0.f);
        for (int t = 0; t < count; ++t) {
          const int64_t tok = idx ? idx[t] : t;
          const float w = s[t] / sum;
          if (seq.coding.coded()) {
            CodedValueRow(seq.v, seq.coding, p.kv_dtype, p.head_dim, seq.len, c,
                          static_cast<int>(tok), row.data());
          } else {
            const int64_t base = seq.layout.Row(c, static_cast<int>(tok), p.head_dim);
            for (int d = 0; d < p.head_dim; ++d) row[d] = LoadElement(seq.v, p.kv_dtype, base + d);
          }
          for (int d = 0; d < p.head_dim; ++d) o[d] += w * row[d];
          if (probs) probs[tok] = w;
        }
      }
    }
    return absl::OkStatus();
  }

  // Selection compute: reference_selection.cc.
  absl::Status WindowVotes(const WindowVotesParams& p) override {
    RETURN_IF_ERROR(ValidateWindowVotes(p));
    reference::WindowVotes(p);
    return absl::OkStatus();
  }
  absl::Status Pool1d(const Pool1dParams& p) override {
    RETURN_IF_ERROR(ValidatePool1d(p));
    reference::Pool1d(p);
    return absl::OkStatus();
  }
  absl::Status RunMeans(const RunMeansParams& p) override {
    RETURN_IF_ERROR(ValidateRunMeans(p));
    reference::RunMeans(p);
    return absl::OkStatus();
  }
  absl::Status TopK(const TopKParams& p) override {
    RETURN_IF_ERROR(ValidateTopK(p));
    reference::TopK(p);
    return absl::OkStatus();
  }
  absl::Status HbwSelect(const HbwSelectParams& p) override {
    RETURN_IF_ERROR(ValidateHbwSelect(p));
    reference::HbwSelect(p);
    return absl::OkStatus();
  }
  absl::Status GatherKv(const GatherKvParams& p) override {
    RETURN_IF_ERROR(ValidateGatherKv(p));
    reference::GatherKv(p);
    return absl::OkStatus();
  }
  absl::Status UpdateSummaries(const UpdateSummariesParams& p) override {
    RETURN_IF_ERROR(ValidateUpdateSummaries(p));
    reference::UpdateSummaries(p);
    return absl::OkStatus();
  }
  absl::Status PageScores(const PageScoresParams& p) override {
    RETURN_IF_ERROR(ValidatePageScores(p));
    reference::PageScores(p);
    return absl::OkStatus();
  }
  absl::Status Sample(const SampleParams& p) override {
    RETURN_IF_ERROR(ValidateSample(p));
    reference::Sample(p);
    return absl::OkStatus();
  }
  // The specification: each span a bit at a time.
  absl::Status ChecksumSpans(const ChecksumSpansParams& p) override {
    RETURN_IF_ERROR(ValidateChecksumSpans(p));
    for (int i = 0; i < p.n; ++i) p.out[i] = Crc32cBitwise(p.spans[i].data, p.spans[i].bytes);
    return absl::OkStatus();
  }
  // The specification: each span a byte at a time, in order.
  absl::Status PackSpans(const PackSpansParams& p) override {
    RETURN_IF_ERROR(ValidatePackSpans(p));
    int64_t at = 0;
    for (int i = 0; i < p.n; ++i) {
      auto* span = const_cast<uint8_t*>(p.spans[i].data);
      for (int64_t j = 0; j < p.spans[i].bytes; ++j, ++at) {
        if (p.unpack) {
          span[j] = p.packed[at];
        } else {
          p.packed[at] = span[j];
        }
      }
    }
    return absl::OkStatus();
  }
};

}  // namespace

KernelBackendPtr MakeReferenceBackend() { return std::make_unique<ReferenceBackend>(); }

}  // namespace kvwire::kernels
