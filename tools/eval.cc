#include "tools/eval.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/base/ranking.h"
#include "common/base/status.h"

namespace kvwire::tools {
namespace {

// Records the decode-time attention over the first `prompt_len` cache slots.
class AttentionRecorder : public DecodeObserver {
 public:
  AttentionRecorder(int layers, int heads, int prompt_len)
      : heads_(heads),
        prompt_len_(prompt_len),
        step_(static_cast<size_t>(layers) * heads * prompt_len) {}
  void OnAttention(int /*seq*/, int layer, const float* probs, int len) override {
    for (int h = 0; h < heads_; ++h) {
      std::copy(probs + int64_t{h} * len, probs + int64_t{h} * len + prompt_len_,
                step_.begin() + (static_cast<size_t>(layer) * heads_ + h) * prompt_len_);
    }
  }
  std::vector<float>& step() { return step_; }

 private:
  int heads_, prompt_len_;
  std::vector<float> step_;  // [layer, head, prompt position]
};

// Wraps a sequence's selector and records, per layer, the prompt positions each cache
// head attended at the last step (all of its cache for dense attention).
class RecordingSelector : public WrappingSelector {
 public:
  RecordingSelector(DecodeSelector* inner, int layers, int prompt_len)
      : WrappingSelector(inner), prompt_len_(prompt_len), masks_(layers) {}
  void Done(int layer, const float* q, const LayerCache& lc, const int32_t* indices,
            int num) override {
    WrappingSelector::Done(layer, q, lc, indices, num);
    auto& m = masks_[layer];
    m.assign(lc.n_heads, std::vector<char>(prompt_len_, 0));
    for (int c = 0; c < lc.n_heads; ++c) {
      const int n = indices ? num : lc.len;
      for (int x = 0; x < n; ++x) {
        const int slot = indices ? indices[static_cast<size_t>(c) * num + x] : x;
        const int32_t pos = lc.position(c, slot);
        if (pos >= 0 && pos < prompt_len_) m[c][pos] = 1;
      }
    }
  }
  const std::vector<char>& mask(int layer, int head) const { return masks_[layer][head]; }

 private:
  int prompt_len_;
  std::vector<std::vector<std::vector<char>>> masks_;  // [layer][cache head][position]
};

std::vector<double> LogSoftmax(const float* logits, int n) {
  const float mx = *std::max_element(logits, logits + n);
  double z = 0;
  for (int i = 0; i < n; ++i) z += std::exp(static_cast<double>(logits[i]) - mx);
  const double lz = std::log(z) + mx;
  std::vector<double> out(n);
  for (int i = 0; i < n; ++i) out[i] = logits[i] - lz;
  return out;
}

struct Accumulator {
  int64_t agree = 0, predictions = 0;
  double kl = 0;
  double recall = 0;
  int64_t recall_n = 0;
  int64_t hit = 0, important = 0;
  int prompts = 0;
};

// Adds one step's recall and hit-rate terms for a kept mask per (layer, cache head).
void AddAttention(const std::vector<float>& attn, int layers, int heads, int len, int prefix,
                  double theta, const std::function<const std::vector<char>&(int, int)>& mask,
                  Accumulator* acc) {
  for (int l = 0; l < layers; ++l) {
    for (int h = 0; h < heads; ++h) {
      const float* a = attn.data() + (static_cast<size_t>(l) * heads + h) * len;
      const std::vector<char>& m = mask(l, h);
      double total = 0, kept = 0;
      for (int j = 0; j < len; ++j) {
        total += a[j];
        if (m[j]) kept += a[j];
        if (j < prefix && a[j] > theta) {
          ++acc->important;
          if (m[j]) ++acc->hit;
        }
      }
      if (total > 0) {
        acc->recall += kept / total;
        ++acc->recall_n;
      }
    }
  }
}

double Nan() { return std::numeric_limits<double>::quiet_NaN(); }

}  // namespace

absl::Status ForEachJsonLine(
    const std::string& path,
    const std::function<absl::Status(const nlohmann::json&, int, const std::string&)>& each) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = absl::StrCat(path, ":", lineno);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": not valid JSON: ", e.what()));
    }
    RETURN_IF_ERROR(each(j, lineno, where));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<EvalPrompt>> ReadPrompts(const std::string& path, const Tokenizer& tok,
                                                    bool need_answer) {
  std::vector<EvalPrompt> out;
  RETURN_IF_ERROR(ForEachJsonLine(
      path, [&](const nlohmann::json& j, int lineno, const std::string& where) -> absl::Status {
        EvalPrompt p;
        p.id = j.contains("id") && j["id"].is_string() ? j["id"].get<std::string>()
                                                       : absl::StrCat("line", lineno);
        if (j.contains("task")) {
          if (!j["task"].is_string() || j["task"].get<std::string>().empty()) {
            return absl::InvalidArgumentError(
                absl::StrCat(where, ": \"task\" must be a non-empty string"));
          }
          p.task = j["task"].get<std::string>();
        }
        auto ids_of = [&](const char* key, std::vector<int32_t>* ids) -> absl::Status {
          if (!j[key].is_array()) {
            return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" is not a list"));
          }
          for (const auto& x : j[key]) {
            if (!x.is_number_integer() || x.get<int64_t>() < 0) {
              return absl::InvalidArgumentError(
                  absl::StrCat(where, ": \"", key, "\" must hold non-negative token ids"));
            }
            ids->push_back(x.get<int32_t>());
          }
          return absl::OkStatus();
        };
        if (j.contains("prompt_ids")) {
          RETURN_IF_ERROR(ids_of("prompt_ids", &p.ids));
        } else if (j.contains("prompt") && j["prompt"].is_string()) {
          ASSIGN_OR_RETURN(p.ids, tok.Encode(j["prompt"].get<std::string>()));
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": expected \"prompt_ids\" or \"prompt\""));
        }
        if (p.ids.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": empty prompt"));
        if (need_answer) {
          if (!j.contains("answer_ids")) {
            return absl::InvalidArgumentError(absl::StrCat(where, ": expected \"answer_ids\""));
          }
          RETURN_IF_ERROR(ids_of("answer_ids", &p.answer));
          if (p.answer.empty())
            return absl::InvalidArgumentError(absl::StrCat(where, ": empty answer"));
        }
        for (int32_t id : p.ids) {
          if (id >= tok.vocab_size()) {
            return absl::InvalidArgumentError(absl::StrCat(where, ": token id ", id,
                                                           " is outside the model's vocabulary of ",
                                                           tok.vocab_size()));
          }
        }
        out.push_back(std::move(p));
        return absl::OkStatus();
      }));
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no prompts"));
  return out;
}

std::vector<EvalMethod> InFormats(const std::vector<EvalMethod>& methods,
                                  const std::vector<KvFormat>& formats) {
  std::vector<EvalMethod> out;
  for (const EvalMethod& m : methods) {
    for (KvFormat f : formats) {
      EvalMethod e = m;
      e.kv_format = f;
      e.compression = [inner = m.compression, f](int budget) {
        CompressionConfig c = inner(budget);
        c.kv_format = f;
        return c;
      };
      out.push_back(std::move(e));
    }
  }
  return out;
}

absl::StatusOr<ResolvedMethod> ResolveMethod(const EvalMethod& method, int budget, int len,
                                             int max_new, const ModelConfig& model) {
  DecodeAttentionConfig attention =
      method.attention ? method.attention(budget) : DecodeAttentionConfig{};
  absl::StatusOr<ResolvedMethod> m =
      Resolve(method.compression(budget), attention, len, max_new, model);
  if (!m.ok()) return Annotate(m.status(), method.name);
  RETURN_IF_ERROR(Annotate(CheckKvFormat(m->compression.kv_format, model.head_dim), method.name));
  return m;
}

absl::StatusOr<int> CaptureWindow(const std::vector<EvalMethod>& methods,
                                  const std::vector<int>& budgets, int len, int max_new,
                                  int at_least, const ModelConfig& model) {
  int rows = std::min(at_least, len);
  for (const EvalMethod& method : methods) {
    for (int budget : budgets) {
      ASSIGN_OR_RETURN(ResolvedMethod m, ResolveMethod(method, budget, len, max_new, model));
      rows = std::max(rows, ScoreRows(m.compression, len));
    }
  }
  return rows;
}

namespace {

// What one prompt's full-cache decode saw: the greedy tokens (the first from the prefill),
// each step's next-token log-probabilities and attention over the prompt.
struct Reference {
  std::vector<int32_t> tokens;
  std::vector<std::vector<double>> logp;
  std::vector<std::vector<float>> attention;  // per step: [layer, head, prompt position]
};

absl::StatusOr<Reference> DecodeFull(LlamaModel& model, const CapturedPrefill& cap,
                                     const std::vector<float>& prefill_logits, int len, int gen) {
  const ModelConfig& mc = model.config();
  ASSIGN_OR_RETURN(ReplayedCache full, ReplayInto(model, cap, CompressionConfig{}, gen));
  Reference ref;
  ref.tokens = {Argmax(prefill_logits.data(), mc.vocab_size)};
  std::vector<float> logits(mc.vocab_size);
  AttentionRecorder recorder(mc.num_layers, mc.num_heads, len);
  for (int t = 0; t < gen; ++t) {
    DecodeInput in{ref.tokens[t], len + t, full.cache.get(), nullptr};
    RETURN_IF_ERROR(model.DecodeStep({&in, 1}, logits.data(), &recorder));
    ref.logp.push_back(LogSoftmax(logits.data(), mc.vocab_size));
    ref.attention.push_back(recorder.step());
    ref.tokens.push_back(Argmax(logits.data(), mc.vocab_size));
  }
  return ref;
}

// Replays the prompt's prefill through one method at one budget, then the reference's
// tokens teacher-forced over the compressed cache, adding agreement, KL, recall and hit
// rate to `acc`.
absl::Status ScoreMethod(LlamaModel& model, const CapturedPrefill& cap, const Reference& ref,
                         const EvalMethod& method, int budget, int len, int window,
                         const FidelityOptions& options, Accumulator* acc) {
  const ModelConfig& mc = model.config();
  const int gen = options.gen, vocab = mc.vocab_size;
  ASSIGN_OR_RETURN(ResolvedMethod m, ResolveMethod(method, budget, len, gen + 1, mc));
  ASSIGN_OR_RETURN(ReplayedCache replayed, ReplayInto(model, cap, m.compression, gen));
  KvCache* cache = replayed.cache.get();
  ASSIGN_OR_RETURN(auto selector,
                   MakeDecodeSelector(m.attention, mc, cache->shape(), HeapKvAllocator()));
  RecordingSelector recorder(selector.get(), mc.num_layers, len);
  const int cache_group = mc.num_heads / cache->shape().n_heads;
  std::vector<float> logits(vocab);
  for (int t = 0; t < gen; ++t) {
    DecodeInput in{ref.tokens[t], len + t, cache, &recorder};
    RETURN_IF_ERROR(model.DecodeStep({&in, 1}, logits.data()));
    const std::vector<double> lp = LogSoftmax(logits.data(), vocab);
    acc->agree += Argmax(logits.data(), vocab) == ref.tokens[t + 1];
    double kl = 0;
    for (int v = 0; v < vocab; ++v) kl += std::exp(ref.logp[t][v]) * (ref.logp[t][v] - lp[v]);
    acc->kl += kl;
    ++acc->predictions;
    AddAttention(
        ref.attention[t], mc.num_layers, mc.num_heads, len, len - window, options.theta,
        [&](int l, int h) -> const std::vector<char>& { return recorder.mask(l, h / cache_group); },
        acc);
  }
  ++acc->prompts;
  return absl::OkStatus();
}

// The exact top-k oracle: per step, layer and KV head, the `budget` prompt positions
// holding the most attention of the group.
void ScoreOracle(const ModelConfig& mc, const Reference& ref, int budget, int len, int window,
                 const FidelityOptions& options, Accumulator* acc) {
  const int layers = mc.num_layers, heads = mc.num_heads, group = mc.num_heads / mc.num_kv_heads;
  const int k = std::min(budget, len);
  for (int t = 0; t < options.gen; ++t) {
    std::vector<std::vector<std::vector<char>>> masks(
        layers, std::vector<std::vector<char>>(mc.num_kv_heads, std::vector<char>(len, 0)));
    for (int l = 0; l < layers; ++l) {
      for (int g = 0; g < mc.num_kv_heads; ++g) {
        std::vector<float> s(len, 0.f);
        for (int x = 0; x < group; ++x) {
          const float* row =
              ref.attention[t].data() + (static_cast<size_t>(l) * heads + g * group + x) * len;
          for (int j = 0; j < len; ++j) s[j] += row[j];
        }
        for (int32_t j : TopKAscending(s, k)) masks[l][g][j] = 1;
      }
    }
    AddAttention(
        ref.attention[t], layers, heads, len, len - window, options.theta,
        [&](int l, int h) -> const std::vector<char>& { return masks[l][h / group]; }, acc);
  }
  ++acc->prompts;
}

FidelityRecord Record(const std::string& name, KvFormat format, int budget, const Accumulator& a,
                      bool decoded) {
  FidelityRecord r;
  r.policy = name;
  r.kv_format = std::string(KvFormatName(format));
  r.budget = budget;
  r.agreement = decoded && a.predictions ? static_cast<double>(a.agree) / a.predictions : Nan();
  r.kl = decoded && a.predictions ? a.kl / a.predictions : Nan();
  r.recall = a.recall_n ? a.recall / a.recall_n : Nan();
  r.hit_rate = a.important ? static_cast<double>(a.hit) / a.important : Nan();
  r.n = a.prompts;
  r.predictions = a.predictions;
  return r;
}

}  // namespace

absl::StatusOr<std::vector<FidelityRecord>> EvalFidelity(
    LlamaModel& model, const std::vector<EvalPrompt>& prompts,
    const std::vector<EvalMethod>& methods, const std::vector<int>& budgets,
    const FidelityOptions& options, const std::function<void(int, int)>& progress) {
  const ModelConfig& mc = model.config();
  std::vector<Accumulator> acc(methods.size() * budgets.size()), oracle(budgets.size());
  int done = 0;
  for (const EvalPrompt& prompt : prompts) {
    const int len = static_cast<int>(prompt.ids.size());
    if (len + options.gen + 1 > mc.context_limit()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt ", prompt.id, " (", len, " tokens) + ", options.gen + 1,
                       " generated exceeds the model's context of ", mc.context_limit()));
    }
    const int window = std::min(options.window, len);
    ASSIGN_OR_RETURN(const int rows,
                     CaptureWindow(methods, budgets, len, options.gen + 1, window, mc));
    CapturedPrefill cap(rows, mc);
    ASSIGN_OR_RETURN(PrefillResult pre, model.Prefill(prompt.ids, &cap));
    ASSIGN_OR_RETURN(Reference ref, DecodeFull(model, cap, pre.logits, len, options.gen));
    for (size_t m = 0; m < methods.size(); ++m) {
      for (size_t b = 0; b < budgets.size(); ++b) {
        RETURN_IF_ERROR(ScoreMethod(model, cap, ref, methods[m], budgets[b], len, window, options,
                                    &acc[m * budgets.size() + b]));
      }
    }
    for (size_t b = 0; b < budgets.size(); ++b) {
      ScoreOracle(mc, ref, budgets[b], len, window, options, &oracle[b]);
    }
    if (progress) progress(++done, static_cast<int>(prompts.size()));
  }
  std::vector<FidelityRecord> out;
  for (size_t m = 0; m < methods.size(); ++m) {
    for (size_t b = 0; b < budgets.size(); ++b) {
      out.push_back(Record(methods[m].name, methods[m].kv_format, budgets[b],
                           acc[m * budgets.size() + b], true));
    }
  }
  for (size_t b = 0; b < budgets.size(); ++b)
    out.push_back(Record("oracle", KvFormat::kAuto, budgets[b], oracle[b], false));
  return out;
}

}  // namespace kvwire::tools
