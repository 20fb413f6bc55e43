// kvwire select: one layer's policy decision from raw tensors, for checking a policy
// against another implementation. Reads `q` [n_heads, L, head_dim] (all prompt queries,
// after RoPE) and `k` [n_kv_heads, L, head_dim] (float32) from a safetensors file, scores
// the observation window (softmax over all keys, causal, scale 1/sqrt(head_dim)) and
// prints {"kept": [[...], ...]}: one sorted row per cache head.
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/model/safetensors.h"
#include "kernels/reference.h"
#include "tools/commands.h"

namespace kvwire::tools {
namespace {

absl::StatusOr<std::vector<float>> ReadF32(const SafetensorsFile& f, const char* name,
                                           std::vector<int64_t>* shape) {
  const TensorView* t = f.Find(name);
  if (t == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(f.path(), ": no tensor '", name, "'"));
  }
  if (t->dtype != "F32" || t->shape.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(f.path(), ": '", name,
                                                   "' must be F32 of rank 3, got ", t->dtype,
                                                   " of rank ", t->shape.size()));
  }
  *shape = t->shape;
  std::vector<float> v(t->numel());
  std::memcpy(v.data(), t->data, t->bytes);
  return v;
}

absl::StatusOr<nlohmann::json> Select(const Flags& flags) {
  ASSIGN_OR_RETURN(CompressionConfig config, CompressionFromFlags(flags));
  const std::string path = flags.GetString("tensors");
  if (path.empty()) return absl::InvalidArgumentError("--tensors is required");
  ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  std::vector<int64_t> qs, ks;
  ASSIGN_OR_RETURN(std::vector<float> q, ReadF32(*file, "q", &qs));
  ASSIGN_OR_RETURN(std::vector<float> k, ReadF32(*file, "k", &ks));
  const int n_heads = static_cast<int>(qs[0]), len = static_cast<int>(qs[1]);
  const int d = static_cast<int>(qs[2]), n_kv = static_cast<int>(ks[0]);
  if (ks[1] != len || ks[2] != d || n_kv == 0 || n_heads % n_kv != 0 || len == 0 || d == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": q is [", qs[0], ", ", qs[1], ", ", qs[2], "] and k is [", ks[0], ", ",
                     ks[1], ", ", ks[2],
                     "]; expected [n_heads, L, d] and [n_kv_heads, L, d] with n_heads a "
                     "multiple of n_kv_heads"));
  }
  // To the kernels' token-major layout [L, heads, d].
  std::vector<float> qt(q.size()), kt(k.size());
  for (int h = 0; h < n_heads; ++h)
    for (int t = 0; t < len; ++t)
      std::memcpy(&qt[(int64_t{t} * n_heads + h) * d], &q[(int64_t{h} * len + t) * d], d * 4);
  for (int h = 0; h < n_kv; ++h)
    for (int t = 0; t < len; ++t)
      std::memcpy(&kt[(int64_t{t} * n_kv + h) * d], &k[(int64_t{h} * len + t) * d], d * 4);

  const int window = config.NeedsScores() ? std::min(config.window, len) : 0;
  std::vector<float> out(qt.size()), scores(static_cast<size_t>(n_heads) * window * len);
  kernels::PrefillAttentionParams p;
  p.q = qt.data();
  p.k = kt.data();
  p.v = kt.data();  // the outputs are not needed, only the window scores
  p.out = out.data();
  p.q_stride = p.out_stride = int64_t{n_heads} * d;
  p.kv_stride = int64_t{n_kv} * d;
  p.len = len;
  p.n_heads = n_heads;
  p.n_kv_heads = n_kv;
  p.head_dim = d;
  p.scale = 1.f / std::sqrt(static_cast<float>(d));
  p.window = window;
  p.window_scores = window ? scores.data() : nullptr;
  RETURN_IF_ERROR(kernels::MakeReferenceBackend()->PrefillAttention(p));

  LayerSelector selector(config, n_heads, n_kv);
  const WindowScores ws{scores.data(), n_heads, window, len};
  ASSIGN_OR_RETURN(auto kept, selector.Select(0, len, window ? &ws : nullptr));
  return nlohmann::json{{"kept", kept}};
}

}  // namespace

int RunSelect(int argc, char** argv) {
  Flags flags;
  DefineCompressionFlags(flags);
  flags.Define("tensors", "", "safetensors file with q [n_heads, L, d] and k [n_kv_heads, L, d]");
  const char* usage = "kvwire select --tensors FILE.safetensors --policy NAME --budget N [...]";
  if (int rc = ParseFlagsOrExit(flags, "kvwire select", usage, argc, argv, 0); rc >= 0) return rc;
  auto result = Select(flags);
  if (!result.ok()) return Fail("select", result.status());
  std::printf("%s\n", result->dump().c_str());
  return 0;
}

}  // namespace kvwire::tools
