#include "tools/passkey.h"

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"

namespace kvwire::tools {
namespace {

double Nan() { return std::numeric_limits<double>::quiet_NaN(); }

// Where the needle is and which head reads it, from the full prefill's window scores.
struct Needle {
  std::vector<int32_t> positions;  // empty: the answer does not occur in the prompt
  int layer = -1, kv_head = -1;
  double share = 0;
  std::vector<double> mass;  // the share on each needle position
};

// The answer's last occurrence in the prompt.
std::vector<int32_t> FindNeedle(const std::vector<int32_t>& prompt,
                                const std::vector<int32_t>& answer) {
  const int n = static_cast<int>(prompt.size()), m = static_cast<int>(answer.size());
  for (int start = n - m; start >= 0; --start) {
    if (std::equal(answer.begin(), answer.end(), prompt.begin() + start)) {
      std::vector<int32_t> out(m);
      for (int i = 0; i < m; ++i) out[i] = start + i;
      return out;
    }
  }
  return {};
}

// The (layer, KV head) whose last `window` window queries, summed over the query heads of
// the group, put the largest share of their attention on the needle.
Needle LocateNeedle(const CapturedPrefill& cap, const EvalPrompt& prompt, int window,
                    const ModelConfig& mc) {
  Needle needle;
  needle.positions = FindNeedle(prompt.ids, prompt.answer);
  const int rows = cap.captured_window(), len = cap.len();
  if (needle.positions.empty() || rows == 0) return needle;
  const int group = mc.num_heads / mc.num_kv_heads, use = std::min(window, rows);
  for (int l = 0; l < cap.num_layers(); ++l) {
    const std::vector<float>& s = cap.scores(l);
    if (s.empty()) continue;
    for (int g = 0; g < mc.num_kv_heads; ++g) {
      double total = 0;
      std::vector<double> on(needle.positions.size(), 0.0);
      for (int h = g * group; h < (g + 1) * group; ++h) {
        for (int r = rows - use; r < rows; ++r) {
          const float* row = s.data() + (static_cast<size_t>(h) * rows + r) * len;
          for (int j = 0; j < len; ++j) total += row[j];
          for (size_t i = 0; i < on.size(); ++i) on[i] += row[needle.positions[i]];
        }
      }
      double share = 0;
      for (double& x : on) {
        x = total > 0 ? x / total : 0;
        share += x;
      }
      if (share > needle.share) {
        needle.share = share;
        needle.mass = on;
        needle.layer = l;
        needle.kv_head = g;
      }
    }
  }
  return needle;
}

// Fills the answer's needle fields from the compressed cache: the needle is kept when
// every cache head that serves the retrieval KV head holds all of its positions.
void CheckNeedle(const Needle& needle, const KvCache& cache, const ModelConfig& mc,
                 PasskeyAnswer* a) {
  if (needle.positions.empty() || needle.layer < 0) return;
  a->retrieval_layer = needle.layer;
  a->retrieval_kv_head = needle.kv_head;
  a->needle_share = needle.share;
  a->needle_mass = needle.mass;
  a->needle_start = needle.positions[0];
  const LayerCache& lc = cache.layer(needle.layer);
  const int per_kv = lc.n_heads / mc.num_kv_heads;  // 1, or the group for per query head
  std::set<int> lost;
  for (int c = needle.kv_head * per_kv; c < (needle.kv_head + 1) * per_kv; ++c) {
    std::set<int32_t> held;
    for (int t = 0; t < lc.len; ++t) held.insert(lc.position(c, t));
    for (size_t i = 0; i < needle.positions.size(); ++i) {
      if (held.count(needle.positions[i]) == 0) lost.insert(static_cast<int>(i));
    }
  }
  a->needle_lost.assign(lost.begin(), lost.end());
  a->needle_kept = lost.empty() ? 1 : 0;
}

// Passes each step through to the method's selector (none: dense) and checks that the
// retrieval head's cache heads attend the needle token the step is about to copy.
class NeedleReader final : public WrappingSelector {
 public:
  NeedleReader(DecodeSelector* inner, int layer, int first_head, int heads)
      : WrappingSelector(inner), layer_(layer), first_(first_head), heads_(heads) {}
  // The prompt position the next step should read (-1: none).
  void Expect(int32_t position) { target_ = position; }
  bool read_all() const { return read_all_; }

  void Done(int layer, const float* q, const LayerCache& lc, const int32_t* indices,
            int num) override {
    WrappingSelector::Done(layer, q, lc, indices, num);
    if (layer != layer_ || target_ < 0) return;
    for (int c = first_; c < first_ + heads_; ++c) {
      const int n = indices ? num : lc.len;
      bool found = false;
      for (int x = 0; x < n && !found; ++x) {
        const int slot = indices ? indices[static_cast<size_t>(c) * num + x] : x;
        found = lc.position(c, slot) == target_;
      }
      read_all_ &= found;
    }
  }

 private:
  int layer_, first_, heads_;
  int32_t target_ = -1;
  bool read_all_ = true;
};

}  // namespace

int LengthBucket(int tokens) { return (tokens + 511) / 512 * 512; }

absl::StatusOr<PasskeyRun> EvalPasskey(LlamaModel& model, const std::vector<EvalPrompt>& prompts,
                                       const std::vector<EvalMethod>& methods,
                                       const std::vector<int>& budgets, int window,
                                       const std::function<void(int, int)>& progress) {
  const ModelConfig& mc = model.config();
  const int vocab = mc.vocab_size;
  PasskeyRun run;
  int done = 0;
  std::vector<float> logits(vocab);
  for (const EvalPrompt& prompt : prompts) {
    const int len = static_cast<int>(prompt.ids.size());
    const int n_ans = static_cast<int>(prompt.answer.size());
    if (len + n_ans > mc.context_limit()) {
      run.skipped.push_back(prompt.id);
      if (progress) progress(++done, static_cast<int>(prompts.size()));
      continue;
    }
    const int w = std::min(window, len);
    ASSIGN_OR_RETURN(const int rows, CaptureWindow(methods, budgets, len, n_ans, w, mc));
    CapturedPrefill cap(rows, mc);
    ASSIGN_OR_RETURN(PrefillResult pre, model.Prefill(prompt.ids, &cap));
    const Needle needle = LocateNeedle(cap, prompt, w, mc);
    for (const EvalMethod& method : methods) {
      for (int budget : budgets) {
        ASSIGN_OR_RETURN(ResolvedMethod m, ResolveMethod(method, budget, len, n_ans, mc));
        ASSIGN_OR_RETURN(ReplayedCache replayed, ReplayInto(model, cap, m.compression, n_ans));
        KvCache* cache = replayed.cache.get();
        ASSIGN_OR_RETURN(auto selector,
                         MakeDecodeSelector(m.attention, mc, cache->shape(), HeapKvAllocator()));
        PasskeyAnswer a;
        a.id = prompt.id;
        a.task = prompt.task;
        a.method = method.name;
        a.kv_format = std::string(KvFormatName(method.kv_format));
        a.budget = budget;
        a.prompt_tokens = len;
        a.expected = prompt.answer;
        a.full_cache_bytes = replayed.full_cache_bytes;
        a.full_bf16_bytes = replayed.full_bf16_bytes;
        a.kv_payload_bytes = replayed.kv_payload_bytes;
        CheckNeedle(needle, *cache, mc, &a);
        const int per_kv = cache->shape().n_heads / mc.num_kv_heads;
        NeedleReader reader(selector.get(), std::max(needle.layer, 0),
                            std::max(needle.kv_head, 0) * per_kv, per_kv);
        a.tokens = {Argmax(pre.logits.data(), vocab)};
        for (int t = 1; t < n_ans; ++t) {
          // The step that produces answer token t should read the needle's token t.
          reader.Expect(needle.positions.empty() ? -1 : needle.positions[t]);
          DecodeInput in{a.tokens.back(), len + t - 1, cache, &reader};
          RETURN_IF_ERROR(model.DecodeStep({&in, 1}, logits.data()));
          a.tokens.push_back(Argmax(logits.data(), vocab));
        }
        if (a.needle_kept >= 0) a.needle_read = reader.read_all() ? 1 : 0;
        run.answers.push_back(std::move(a));
      }
    }
    if (progress) progress(++done, static_cast<int>(prompts.size()));
  }
  return run;
}

double PasskeyRow::accuracy() const { return n ? static_cast<double>(correct) / n : Nan(); }
double PasskeyRow::needle_kept_share() const {
  return needle_n ? static_cast<double>(needle_kept) / needle_n : Nan();
}
double PasskeyRow::needle_read_share() const {
  return needle_n ? static_cast<double>(needle_read) / needle_n : Nan();
}
double PasskeyRow::ratio() const {
  return kv_payload_bytes > 0 ? static_cast<double>(full_cache_bytes) / kv_payload_bytes : Nan();
}
double PasskeyRow::ratio_bf16() const {
  return kv_payload_bytes > 0 ? static_cast<double>(full_bf16_bytes) / kv_payload_bytes : Nan();
}
double PasskeyRow::wire_ratio() const {
  return wire_bytes > 0 ? static_cast<double>(full_cache_bytes) / wire_bytes : Nan();
}

std::vector<PasskeyRow> SummarizePasskey(const std::vector<PasskeyAnswer>& answers) {
  // Rows keyed by (method, format, budget, task, length), in the order they are first met.
  using Method = std::tuple<std::string, std::string, int>;
  using Key = std::tuple<std::string, std::string, int, std::string, int>;
  std::vector<Method> order;
  std::set<Method> seen;
  std::set<std::string> tasks;
  std::set<int> lengths;
  std::map<Key, PasskeyRow> rows;
  auto add = [&](const PasskeyAnswer& a, const std::string& task, int length) {
    PasskeyRow& r = rows[{a.method, a.kv_format, a.budget, task, length}];
    if (r.n == 0) {
      r.method = a.method;
      r.kv_format = a.kv_format;
      r.budget = a.budget;
      r.task = task;
      r.length = length;
      r.wire_bytes = 0;
    }
    ++r.n;
    r.correct += a.correct();
    if (a.needle_kept >= 0) {
      ++r.needle_n;
      r.needle_kept += a.needle_kept;
      r.needle_read += std::max(a.needle_read, 0);
    }
    r.full_cache_bytes += a.full_cache_bytes;
    r.full_bf16_bytes += a.full_bf16_bytes;
    r.kv_payload_bytes += a.kv_payload_bytes;
    r.wire_bytes = r.wire_bytes < 0 || a.wire_bytes < 0 ? -1 : r.wire_bytes + a.wire_bytes;
  };
  for (const PasskeyAnswer& a : answers) {
    if (seen.insert({a.method, a.kv_format, a.budget}).second) {
      order.push_back({a.method, a.kv_format, a.budget});
    }
    add(a, "all", 0);
    if (!a.task.empty()) {
      tasks.insert(a.task);
      add(a, a.task, 0);
    }
    lengths.insert(LengthBucket(a.prompt_tokens));
    add(a, "all", LengthBucket(a.prompt_tokens));
  }
  std::vector<PasskeyRow> out;
  for (const auto& [method, format, budget] : order) {
    out.push_back(rows[{method, format, budget, "all", 0}]);
    for (const std::string& task : tasks) {
      auto it = rows.find({method, format, budget, task, 0});
      if (it != rows.end()) out.push_back(it->second);
    }
    for (int length : lengths) {
      auto it = rows.find({method, format, budget, "all", length});
      if (it != rows.end()) out.push_back(it->second);
    }
  }
  return out;
}

namespace {
nlohmann::json Num(double x) { return std::isnan(x) ? nlohmann::json(nullptr) : nlohmann::json(x); }
}  // namespace

nlohmann::json ToJson(const PasskeyRow& r) {
  nlohmann::json j = {{"policy", r.method},
                      {"kv_format", r.kv_format},
                      {"budget", r.budget},
                      {"task", r.task},
                      {"length", r.length == 0 ? nlohmann::json("all") : nlohmann::json(r.length)},
                      {"accuracy", Num(r.accuracy())},
                      {"n", r.n},
                      {"correct", r.correct},
                      {"needle_kept", Num(r.needle_kept_share())},
                      {"needle_read", Num(r.needle_read_share())},
                      {"needle_n", r.needle_n},
                      {"full_cache_bytes", r.full_cache_bytes},
                      {"kv_payload_bytes", r.kv_payload_bytes},
                      {"ratio", Num(r.ratio())}};
  if (r.full_bf16_bytes > 0) {
    j["full_bf16_bytes"] = r.full_bf16_bytes;
    j["ratio_bf16"] = Num(r.ratio_bf16());
  }
  if (r.wire_bytes >= 0) {
    j["wire_bytes"] = r.wire_bytes;
    j["wire_ratio"] = Num(r.wire_ratio());
  }
  return j;
}

nlohmann::json ToJson(const PasskeyAnswer& a) {
  nlohmann::json j = {{"id", a.id},
                      {"task", a.task},
                      {"policy", a.method},
                      {"kv_format", a.kv_format},
                      {"budget", a.budget},
                      {"prompt_tokens", a.prompt_tokens},
                      {"length", LengthBucket(a.prompt_tokens)},
                      {"expected", a.expected},
                      {"tokens", a.tokens},
                      {"correct", a.correct()},
                      {"full_cache_bytes", a.full_cache_bytes},
                      {"kv_payload_bytes", a.kv_payload_bytes}};
  if (a.needle_kept >= 0) {
    j["needle_kept"] = a.needle_kept == 1;
    j["needle_read"] = a.needle_read == 1;
    j["needle_lost"] = a.needle_lost;
    j["retrieval_head"] = {a.retrieval_layer, a.retrieval_kv_head};
    j["needle_start"] = a.needle_start;
    j["needle_share"] = a.needle_share;
    j["needle_mass"] = a.needle_mass;
  }
  if (a.wire_bytes >= 0) j["wire_bytes"] = a.wire_bytes;
  if (a.ttft_ms >= 0) j["ttft_ms"] = a.ttft_ms;
  if (a.cached_tokens >= 0) j["cached_tokens"] = a.cached_tokens;
  if (a.warm_ttft_ms >= 0) {
    j["warm_ttft_ms"] = a.warm_ttft_ms;
    j["warm_cached_tokens"] = a.warm_cached_tokens;
    j["warm_tokens"] = a.warm_tokens;
  }
  return j;
}

absl::StatusOr<std::vector<std::string>> ComparePasskey(const std::vector<PasskeyAnswer>& run,
                                                        const std::string& reference_path) {
  struct Ref {
    std::vector<int32_t> tokens;
    int64_t kv_payload_bytes;
  };
  std::map<std::tuple<std::string, std::string, std::string, int>, Ref> refs;
  RETURN_IF_ERROR(ForEachJsonLine(
      reference_path, [&](const nlohmann::json& j, int, const std::string& where) -> absl::Status {
        try {
          refs[{j.at("id").get<std::string>(), j.at("policy").get<std::string>(),
                j.value("kv_format", std::string("auto")), j.at("budget").get<int>()}] = {
              j.at("tokens").get<std::vector<int32_t>>(), j.at("kv_payload_bytes").get<int64_t>()};
        } catch (const nlohmann::json::exception& e) {
          return absl::InvalidArgumentError(absl::StrCat(
              where, ": not a passkey answer record (kvwire eval passkey --answers): ", e.what()));
        }
        return absl::OkStatus();
      }));
  std::vector<std::string> diffs;
  for (const PasskeyAnswer& a : run) {
    const std::string what =
        absl::StrCat(a.id, " ", a.method, " in ", a.kv_format, " at ", a.budget);
    auto it = refs.find({a.id, a.method, a.kv_format, a.budget});
    if (it == refs.end()) {
      diffs.push_back(absl::StrCat(what, ": not in ", reference_path));
      continue;
    }
    if (it->second.tokens != a.tokens) {
      diffs.push_back(absl::StrCat(what, ": answered [", absl::StrJoin(a.tokens, " "),
                                   "], the reference [", absl::StrJoin(it->second.tokens, " "),
                                   "]"));
    }
    if (it->second.kv_payload_bytes != a.kv_payload_bytes) {
      diffs.push_back(absl::StrCat(what, ": ", a.kv_payload_bytes,
                                   " KV payload bytes, the reference ",
                                   it->second.kv_payload_bytes));
    }
  }
  return diffs;
}

}  // namespace kvwire::tools
