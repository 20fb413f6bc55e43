// Loading tokenizer.json into a TokenizerImpl: the model (BPE), the added tokens, and the
// normalizer, pre-tokenizer, post-processor and decoder, each checked as it is read. A malformed
// file is an InvalidArgumentError naming the file, the JSON path of the field and what was
// expected; a valid feature kvwire does not implement is an UnimplementedError that names it and
// says what is supported.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/tokenizer/bpe.h"
#include "common/tokenizer/pretokenize.h"
#include "common/tokenizer/tokenizer_impl.h"
#include "common/tokenizer/utf8.h"

namespace kvwire::tokenizer_internal {
namespace {

using Json = nlohmann::json;

// Ids at or beyond this are a corrupt file rather than a vocabulary (and would make the
// id -> token table absurdly large).
constexpr int64_t kMaxId = int64_t{1} << 24;

// A JSON value for an error message: its text, cut short.
std::string Describe(const Json& j) {
  std::string s = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 60) {
    size_t cut = 57;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // whole chars
    s = s.substr(0, cut) + "...";
  }
  return s;
}

std::string Quote(std::string_view s) {
  return Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

class Loader {
 public:
  explicit Loader(std::string source) : source_(std::move(source)) {}

  absl::Status Invalid(const std::string& path, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", path, ": ", what));
  }
  absl::Status Expected(const std::string& path, const std::string& expected,
                        const Json& got) const {
    return Invalid(path, absl::StrCat("expected ", expected, ", got ", Describe(got)));
  }
  absl::Status Unsupported(const std::string& path, const std::string& what,
                           const std::string& supported) const {
    return absl::UnimplementedError(
        absl::StrCat(source_, ": ", path, ": ", what,
                     " is not supported by kvwire (supported: ", supported, ")"));
  }

  // `obj[key]`, or nullptr when absent or null.
  static const Json* Member(const Json& obj, const char* key) {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return nullptr;
    return &*it;
  }
  absl::StatusOr<const Json*> Object(const Json& j, const std::string& path) const {
    if (!j.is_object()) return Expected(path, "an object", j);
    return &j;
  }
  absl::StatusOr<std::string> String(const Json& obj, const char* key, const std::string& path,
                                     std::optional<std::string> fallback = std::nullopt) const {
    const Json* v = Member(obj, key);
    const std::string p = absl::StrCat(path, ".", key);
    if (v == nullptr) {
      if (fallback) return *fallback;
      return Invalid(p, "missing; expected a string");
    }
    if (!v->is_string()) return Expected(p, "a string", *v);
    return v->get<std::string>();
  }
  absl::StatusOr<const Json*> Array(const Json& obj, const char* key,
                                    const std::string& path) const {
    const Json* v = Member(obj, key);
    const std::string p = absl::StrCat(path, ".", key);
    if (v == nullptr) return Invalid(p, "missing; expected an array");
    if (!v->is_array()) return Expected(p, "an array", *v);
    return v;
  }
  absl::StatusOr<bool> Bool(const Json& obj, const char* key, const std::string& path,
                            bool fallback) const {
    const Json* v = Member(obj, key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) return Expected(absl::StrCat(path, ".", key), "true or false", *v);
    return v->get<bool>();
  }
  absl::StatusOr<int64_t> Int(const Json& v, const std::string& path, int64_t lo,
                              int64_t hi) const {
    if (!v.is_number_integer()) return Expected(path, "an integer", v);
    if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(hi)
                               : (v.get<int64_t>() < lo || v.get<int64_t>() > hi)) {
      return Invalid(
          path, absl::StrCat("expected an integer in [", lo, ", ", hi, "], got ", Describe(v)));
    }
    return v.get<int64_t>();
  }
  // A single character (the Metaspace replacement, the Strip content).
  absl::StatusOr<char32_t> Char(const Json& obj, const char* key, const std::string& path,
                                std::optional<char32_t> fallback) const {
    const Json* v = Member(obj, key);
    const std::string p = absl::StrCat(path, ".", key);
    if (v == nullptr) {
      if (fallback) return *fallback;
      return Invalid(p, "missing; expected a one-character string");
    }
    if (v->is_string()) {
      const std::string s = v->get<std::string>();
      const std::u32string cps = ToCodePoints(s);
      if (cps.size() == 1) return cps[0];
    }
    return Expected(p, "a one-character string", *v);
  }
  // {"String": "..."} (or {"Regex": "..."} when regexes are allowed).
  absl::Status Pattern(const Json& obj, const std::string& path, bool* is_regex,
                       std::string* text) const {
    const Json* v = Member(obj, "pattern");
    const std::string p = absl::StrCat(path, ".pattern");
    if (v == nullptr) return Invalid(p, "missing; expected {\"String\": ...} or {\"Regex\": ...}");
    if (v->is_object() && v->size() == 1) {
      const auto it = v->begin();
      if (it.value().is_string() && (it.key() == "String" || it.key() == "Regex")) {
        *is_regex = it.key() == "Regex";
        *text = it.value().get<std::string>();
        if (text->empty()) return Invalid(p, "the pattern is empty");
        return absl::OkStatus();
      }
    }
    return Expected(p, "{\"String\": \"...\"} or {\"Regex\": \"...\"}", *v);
  }
  absl::StatusOr<PrependScheme> Scheme(const Json& obj, const std::string& path) const {
    // As the library reads it: prepend_scheme (default "always"), or the older
    // add_prefix_space, where false means "never".
    PrependScheme scheme = PrependScheme::kAlways;
    if (const Json* v = Member(obj, "prepend_scheme")) {
      const std::string s = v->is_string() ? v->get<std::string>() : "";
      if (s == "always") {
        scheme = PrependScheme::kAlways;
      } else if (s == "never") {
        scheme = PrependScheme::kNever;
      } else if (s == "first") {
        scheme = PrependScheme::kFirst;
      } else {
        return Expected(absl::StrCat(path, ".prepend_scheme"), "\"always\", \"never\" or \"first\"",
                        *v);
      }
    }
    ASSIGN_OR_RETURN(bool add_prefix_space, Bool(obj, "add_prefix_space", path, true));
    if (!add_prefix_space) {
      if (Member(obj, "prepend_scheme") != nullptr && scheme != PrependScheme::kNever) {
        return Invalid(path, "add_prefix_space false contradicts prepend_scheme");
      }
      scheme = PrependScheme::kNever;
    }
    return scheme;
  }

  absl::Status LoadModel(const Json& root, TokenizerImpl* impl);
  absl::Status LoadAddedTokens(const Json& root, TokenizerImpl* impl);
  absl::Status LoadNormalizer(const Json& j, const std::string& path, TokenizerImpl* impl);
  absl::Status LoadPreTokenizer(const Json& j, const std::string& path, TokenizerImpl* impl);
  absl::Status LoadPostProcessor(const Json& j, const std::string& path, TokenizerImpl* impl);
  absl::Status LoadDecoder(const Json& j, const std::string& path, TokenizerImpl* impl);

  // The id of a token named in the post-processor (checked against the vocabulary).
  absl::StatusOr<int32_t> ProcessorToken(const Json& j, const std::string& path,
                                         const TokenizerImpl& impl) const;

 private:
  std::string source_;
};

absl::StatusOr<std::string> TypeOf(const Loader& loader, const Json& j, const std::string& path) {
  ASSIGN_OR_RETURN(const Json* obj, loader.Object(j, path));
  return loader.String(*obj, "type", path);
}

absl::Status Loader::LoadModel(const Json& root, TokenizerImpl* impl) {
  const Json* model = Member(root, "model");
  if (model == nullptr) return Invalid("model", "missing; expected the model object");
  ASSIGN_OR_RETURN(model, Object(*model, "model"));
  std::string type;
  if (Member(*model, "type") == nullptr && Member(*model, "merges") != nullptr) {
    type = "BPE";  // the library infers it when the tag is absent
  } else {
    ASSIGN_OR_RETURN(type, String(*model, "type", "model"));
  }
  if (type != "BPE") return Unsupported("model.type", Quote(type), "BPE");

  BpeModel& bpe = impl->model;
  const Json* vocab = Member(*model, "vocab");
  if (vocab == nullptr) return Invalid("model.vocab", "missing; expected an object token -> id");
  if (!vocab->is_object()) return Expected("model.vocab", "an object token -> id", *vocab);
  std::unordered_map<int32_t, std::string> by_id;
  by_id.reserve(vocab->size());
  bpe.vocab.reserve(vocab->size());
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    const std::string path = absl::StrCat("model.vocab[", Quote(it.key()), "]");
    if (!it.value().is_number_integer()) return Expected(path, "an integer id", it.value());
    ASSIGN_OR_RETURN(int64_t id, Int(it.value(), path, 0, kMaxId - 1));
    auto [other, inserted] = by_id.emplace(static_cast<int32_t>(id), it.key());
    if (!inserted) {
      return Invalid(path, absl::StrCat("id ", id, " is also the id of ", Quote(other->second),
                                        "; expected distinct ids"));
    }
    bpe.vocab.emplace(it.key(), static_cast<int32_t>(id));
  }

  ASSIGN_OR_RETURN(bpe.unk_token, String(*model, "unk_token", "model", std::string()));
  if (!bpe.unk_token.empty()) {
    auto it = bpe.vocab.find(bpe.unk_token);
    if (it == bpe.vocab.end()) {
      return Invalid("model.unk_token",
                     absl::StrCat(Quote(bpe.unk_token), " is not in model.vocab"));
    }
    bpe.unk_id = it->second;
  }
  ASSIGN_OR_RETURN(bpe.fuse_unk, Bool(*model, "fuse_unk", "model", false));
  ASSIGN_OR_RETURN(bpe.byte_fallback, Bool(*model, "byte_fallback", "model", false));
  ASSIGN_OR_RETURN(bpe.ignore_merges, Bool(*model, "ignore_merges", "model", false));
  ASSIGN_OR_RETURN(bpe.continuing_subword_prefix,
                   String(*model, "continuing_subword_prefix", "model", std::string()));
  ASSIGN_OR_RETURN(bpe.end_of_word_suffix,
                   String(*model, "end_of_word_suffix", "model", std::string()));
  if (const Json* dropout = Member(*model, "dropout")) {
    if (!dropout->is_number()) return Expected("model.dropout", "a number or null", *dropout);
    if (dropout->get<double>() != 0.0) {
      return Unsupported("model.dropout", Describe(*dropout), "null or 0: encoding is exact");
    }
  }
  bpe.byte_ids.fill(-1);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = bpe.vocab.find(std::string_view(name));
    if (it != bpe.vocab.end()) bpe.byte_ids[b] = it->second;
  }

  const Json* merges = Member(*model, "merges");
  if (merges != nullptr) {
    if (!merges->is_array()) return Expected("model.merges", "an array", *merges);
    bpe.merges.reserve(merges->size());
    const std::string& prefix = bpe.continuing_subword_prefix;
    for (size_t i = 0; i < merges->size(); ++i) {
      const Json& m = (*merges)[i];
      const std::string path = absl::StrCat("model.merges[", i, "]");
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
          return Expected(path, "\"a b\" or [\"a\",\"b\"]", m);
        }
        a = s.substr(0, space);
        b = s.substr(space + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else {
        return Expected(path, "\"a b\" or [\"a\",\"b\"]", m);
      }
      auto ia = bpe.vocab.find(a);
      if (ia == bpe.vocab.end()) {
        return Invalid(path, absl::StrCat("token ", Quote(a), " is not in model.vocab"));
      }
      auto ib = bpe.vocab.find(b);
      if (ib == bpe.vocab.end()) {
        return Invalid(path, absl::StrCat("token ", Quote(b), " is not in model.vocab"));
      }
      // The merged token drops the right part's continuing-subword prefix.
      std::string merged = a;
      merged.append(!prefix.empty() && b.compare(0, prefix.size(), prefix) == 0
                        ? b.substr(prefix.size())
                        : b);
      auto im = bpe.vocab.find(merged);
      if (im == bpe.vocab.end()) {
        return Invalid(path,
                       absl::StrCat("the merged token ", Quote(merged), " is not in model.vocab"));
      }
      // A repeated pair takes its last rank, as the library's map insertion does.
      bpe.merges[PairKey(ia->second, ib->second)] = {static_cast<int32_t>(i), im->second};
    }
  }

  int64_t max_id = -1;
  for (const auto& [id, token] : by_id) max_id = std::max<int64_t>(max_id, id);
  impl->vocab_size = static_cast<int32_t>(max_id + 1);
  impl->id_to_token.assign(impl->vocab_size, std::string());
  impl->has_token.assign(impl->vocab_size, 0);
  for (auto& [id, token] : by_id) {
    impl->id_to_token[id] = std::move(token);
    impl->has_token[id] = 1;
  }
  return absl::OkStatus();
}

absl::Status Loader::LoadAddedTokens(const Json& root, TokenizerImpl* impl) {
  impl->is_special.assign(impl->vocab_size, 0);
  const Json* list = Member(root, "added_tokens");
  if (list == nullptr) return absl::OkStatus();
  if (!list->is_array()) return Expected("added_tokens", "an array", *list);
  // The library numbers added tokens that the model lacks after the model's vocabulary, so a
  // valid id is below (model ids + added tokens).
  const int64_t id_limit = static_cast<int64_t>(impl->vocab_size) + list->size();
  std::unordered_map<int32_t, std::string> owner_of_id;
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string path = absl::StrCat("added_tokens[", i, "]");
    ASSIGN_OR_RETURN(const Json* obj, Object((*list)[i], path));
    AddedToken t;
    const Json* id = Member(*obj, "id");
    if (id == nullptr) return Invalid(path + ".id", "missing; expected an integer id");
    if (!id->is_number_integer()) return Expected(path + ".id", "an integer id", *id);
    ASSIGN_OR_RETURN(int64_t id_value, Int(*id, path + ".id", 0, kMaxId - 1));
    if (id_value >= id_limit) {
      return Invalid(path + ".id", absl::StrCat(id_value, " is out of range: expected an id below ",
                                                id_limit, " (", impl->vocab_size, " model ids + ",
                                                list->size(), " added tokens)"));
    }
    t.id = static_cast<int32_t>(id_value);
    ASSIGN_OR_RETURN(t.content, String(*obj, "content", path));
    if (t.content.empty()) return Invalid(path + ".content", "expected a non-empty string");
    if (FirstInvalidUtf8(t.content) != std::string::npos) {
      return Invalid(path + ".content", "not valid UTF-8");
    }
    ASSIGN_OR_RETURN(t.special, Bool(*obj, "special", path, false));
    ASSIGN_OR_RETURN(t.single_word, Bool(*obj, "single_word", path, false));
    ASSIGN_OR_RETURN(t.lstrip, Bool(*obj, "lstrip", path, false));
    ASSIGN_OR_RETURN(t.rstrip, Bool(*obj, "rstrip", path, false));
    ASSIGN_OR_RETURN(t.normalized, Bool(*obj, "normalized", path, !t.special));

    auto in_vocab = impl->model.vocab.find(t.content);
    if (in_vocab != impl->model.vocab.end() && in_vocab->second != t.id) {
      return Invalid(path, absl::StrCat(Quote(t.content), " has id ", t.id,
                                        " but model.vocab gives it id ", in_vocab->second));
    }
    // An added token may take over the id of a different model token: llama2.c conversions
    // (stories260K) have "\n<s>\n" at id 1 in the vocabulary and "<s>" as added token 1. The
    // library would give "<s>" a new id past the model's embeddings; the file means id 1.
    auto [prev, inserted] = impl->added_by_content.emplace(t.content, t.id);
    if (!inserted) {
      if (prev->second != t.id) {
        return Invalid(path, absl::StrCat(Quote(t.content), " is listed twice, with ids ",
                                          prev->second, " and ", t.id));
      }
      continue;
    }
    auto [owner, fresh] = owner_of_id.emplace(t.id, t.content);
    if (!fresh) {
      return Invalid(path, absl::StrCat("id ", t.id, " is given to both ", Quote(owner->second),
                                        " and ", Quote(t.content)));
    }
    impl->added.push_back(std::move(t));
  }
  // Ids of added tokens beyond the model vocabulary extend the id space.
  for (const AddedToken& t : impl->added) {
    if (t.id >= impl->vocab_size) {
      impl->vocab_size = t.id + 1;
      impl->id_to_token.resize(impl->vocab_size);
      impl->has_token.resize(impl->vocab_size, 0);
    }
  }
  impl->is_special.resize(impl->vocab_size, 0);
  for (const AddedToken& t : impl->added) {
    impl->id_to_token[t.id] = t.content;  // decoding shows the added token's text
    impl->has_token[t.id] = 1;
    if (t.special) impl->is_special[t.id] = 1;
  }
  return absl::OkStatus();
}

absl::Status Loader::LoadNormalizer(const Json& j, const std::string& path, TokenizerImpl* impl) {
  ASSIGN_OR_RETURN(const std::string type, TypeOf(*this, j, path));
  NormalizerStep step;
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, Array(j, "normalizers", path));
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(
          LoadNormalizer((*list)[i], absl::StrCat(path, ".normalizers[", i, "]"), impl));
    }
    return absl::OkStatus();
  } else if (type == "Prepend") {
    step.kind = NormalizerStep::Kind::kPrepend;
    ASSIGN_OR_RETURN(step.content, String(j, "prepend", path));
  } else if (type == "Replace") {
    step.kind = NormalizerStep::Kind::kReplace;
    bool is_regex = false;
    RETURN_IF_ERROR(Pattern(j, path, &is_regex, &step.pattern));
    if (is_regex) {
      return Unsupported(path + ".pattern", absl::StrCat("the regex ", Quote(step.pattern)),
                         "String patterns");
    }
    ASSIGN_OR_RETURN(step.content, String(j, "content", path));
  } else if (type == "Strip") {
    step.kind = NormalizerStep::Kind::kStrip;
    ASSIGN_OR_RETURN(step.strip_left, Bool(j, "strip_left", path, true));
    ASSIGN_OR_RETURN(step.strip_right, Bool(j, "strip_right", path, true));
  } else if (type == "NFC") {
    step.kind = NormalizerStep::Kind::kNfc;
  } else if (type == "NFD") {
    step.kind = NormalizerStep::Kind::kNfd;
  } else {
    return Unsupported(path + ".type", Quote(type), "Sequence, Prepend, Replace, Strip, NFC, NFD");
  }
  impl->normalizers.push_back(std::move(step));
  return absl::OkStatus();
}

absl::Status Loader::LoadPreTokenizer(const Json& j, const std::string& path, TokenizerImpl* impl) {
  ASSIGN_OR_RETURN(const std::string type, TypeOf(*this, j, path));
  PreTokenizerStep step;
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, Array(j, "pretokenizers", path));
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(
          LoadPreTokenizer((*list)[i], absl::StrCat(path, ".pretokenizers[", i, "]"), impl));
    }
    return absl::OkStatus();
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::Kind::kSplit;
    std::string pattern;
    RETURN_IF_ERROR(Pattern(j, path, &step.is_regex, &pattern));
    if (step.is_regex) {
      bool known = false;
      for (const KnownRegexEntry& e : kKnownRegexes) {
        if (pattern == e.pattern) {
          step.regex = e.kind;
          known = true;
        }
      }
      if (!known) {
        return absl::UnimplementedError(absl::StrCat(
            source_, ": ", path, ".pattern: the regex ", Quote(pattern),
            " is not one kvwire knows (it matches the GPT-2, Llama 3 and Qwen2 patterns "
            "with hand-written code)"));
      }
    } else {
      step.literal = pattern;
    }
    const std::string behavior_path = path + ".behavior";
    ASSIGN_OR_RETURN(const std::string behavior, String(j, "behavior", path));
    static const std::pair<const char*, SplitBehavior> kBehaviors[] = {
        {"Removed", SplitBehavior::kRemoved},
        {"Isolated", SplitBehavior::kIsolated},
        {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
        {"MergedWithNext", SplitBehavior::kMergedWithNext},
        {"Contiguous", SplitBehavior::kContiguous},
    };
    bool found = false;
    for (const auto& [name, value] : kBehaviors) {
      if (behavior == name) step.behavior = value, found = true;
    }
    if (!found) {
      return Expected(behavior_path,
                      "Removed, Isolated, MergedWithPrevious, MergedWithNext or Contiguous",
                      j["behavior"]);
    }
    ASSIGN_OR_RETURN(step.invert, Bool(j, "invert", path, false));
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    ASSIGN_OR_RETURN(step.add_prefix_space, Bool(j, "add_prefix_space", path, true));
    ASSIGN_OR_RETURN(step.use_regex, Bool(j, "use_regex", path, true));
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.replacement, Char(j, "replacement", path, std::nullopt));
    AppendUtf8(step.replacement, &step.replacement_utf8);
    ASSIGN_OR_RETURN(step.prepend_scheme, Scheme(j, path));
    ASSIGN_OR_RETURN(step.split, Bool(j, "split", path, true));
  } else {
    return Unsupported(path + ".type", Quote(type), "Sequence, Split, ByteLevel, Metaspace");
  }
  impl->pre_tokenizers.push_back(std::move(step));
  return absl::OkStatus();
}

absl::StatusOr<int32_t> Loader::ProcessorToken(const Json& j, const std::string& path,
                                               const TokenizerImpl& impl) const {
  ASSIGN_OR_RETURN(int64_t id, Int(j, path, 0, kMaxId - 1));
  if (id >= impl.vocab_size) {
    return Invalid(path, absl::StrCat("id ", id, " is out of range: the vocabulary has ",
                                      impl.vocab_size, " ids"));
  }
  return static_cast<int32_t>(id);
}

absl::Status Loader::LoadPostProcessor(const Json& j, const std::string& path,
                                       TokenizerImpl* impl) {
  ASSIGN_OR_RETURN(const std::string type, TypeOf(*this, j, path));
  // A processor wraps the text in `prefix` ... `suffix`; in a Sequence each wraps the result
  // of the one before.
  std::vector<int32_t> prefix, suffix;
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, Array(j, "processors", path));
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(
          LoadPostProcessor((*list)[i], absl::StrCat(path, ".processors[", i, "]"), impl));
    }
    return absl::OkStatus();
  } else if (type == "ByteLevel") {
    return absl::OkStatus();  // only offsets change
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    for (const char* key : {"cls", "sep"}) {
      const Json* v = Member(j, key);
      const std::string p = absl::StrCat(path, ".", key);
      if (v == nullptr || !v->is_array() || v->size() != 2 || !(*v)[0].is_string()) {
        return Expected(p, "[\"token\", id]", v ? *v : Json());
      }
      ASSIGN_OR_RETURN(int32_t id, ProcessorToken((*v)[1], p + "[1]", *impl));
      (std::strcmp(key, "cls") == 0 ? prefix : suffix).push_back(id);
    }
  } else if (type == "TemplateProcessing") {
    ASSIGN_OR_RETURN(const Json* single, Array(j, "single", path));
    const Json* specials = Member(j, "special_tokens");
    if (specials != nullptr && !specials->is_object()) {
      return Expected(path + ".special_tokens", "an object", *specials);
    }
    bool seen_sequence = false;
    for (size_t i = 0; i < single->size(); ++i) {
      const Json& piece = (*single)[i];
      const std::string p = absl::StrCat(path, ".single[", i, "]");
      if (piece.is_object() && piece.contains("Sequence")) {
        if (seen_sequence) return Invalid(p, "a second sequence in the single template");
        seen_sequence = true;
        continue;
      }
      if (!piece.is_object() || !piece.contains("SpecialToken") ||
          !piece["SpecialToken"].is_object() || !piece["SpecialToken"].contains("id") ||
          !piece["SpecialToken"]["id"].is_string()) {
        return Expected(p, "{\"SpecialToken\": {\"id\": ...}} or {\"Sequence\": ...}", piece);
      }
      const std::string name = piece["SpecialToken"]["id"].get<std::string>();
      if (specials == nullptr || !specials->contains(name)) {
        return Invalid(
            p, absl::StrCat("special token ", Quote(name), " is not in ", path, ".special_tokens"));
      }
      const Json& entry = (*specials)[name];
      const std::string ep = absl::StrCat(path, ".special_tokens[", Quote(name), "]");
      if (!entry.is_object() || !entry.contains("ids") || !entry["ids"].is_array()) {
        return Expected(ep, "{\"ids\": [...]}", entry);
      }
      for (size_t k = 0; k < entry["ids"].size(); ++k) {
        ASSIGN_OR_RETURN(int32_t id,
                         ProcessorToken(entry["ids"][k], absl::StrCat(ep, ".ids[", k, "]"), *impl));
        (seen_sequence ? suffix : prefix).push_back(id);
      }
    }
    if (!seen_sequence) return Invalid(path + ".single", "no {\"Sequence\": ...} for the text");
  } else {
    return Unsupported(path + ".type", Quote(type),
                       "TemplateProcessing, RobertaProcessing, BertProcessing, ByteLevel, "
                       "Sequence");
  }
  impl->prefix_ids.insert(impl->prefix_ids.begin(), prefix.begin(), prefix.end());
  impl->suffix_ids.insert(impl->suffix_ids.end(), suffix.begin(), suffix.end());
  return absl::OkStatus();
}

absl::Status Loader::LoadDecoder(const Json& j, const std::string& path, TokenizerImpl* impl) {
  ASSIGN_OR_RETURN(const std::string type, TypeOf(*this, j, path));
  DecoderStep step;
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, Array(j, "decoders", path));
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(LoadDecoder((*list)[i], absl::StrCat(path, ".decoders[", i, "]"), impl));
    }
    return absl::OkStatus();
  } else if (type == "Replace") {
    step.kind = DecoderStep::Kind::kReplace;
    bool is_regex = false;
    RETURN_IF_ERROR(Pattern(j, path, &is_regex, &step.pattern));
    if (is_regex) {
      return Unsupported(path + ".pattern", absl::StrCat("the regex ", Quote(step.pattern)),
                         "String patterns");
    }
    ASSIGN_OR_RETURN(step.content, String(j, "content", path));
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::kFuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::kStrip;
    ASSIGN_OR_RETURN(step.strip_char, Char(j, "content", path, std::nullopt));
    const Json* start = Member(j, "start");
    const Json* stop = Member(j, "stop");
    ASSIGN_OR_RETURN(int64_t start_value,
                     Int(start ? *start : Json(0), path + ".start", 0, 1 << 20));
    ASSIGN_OR_RETURN(int64_t stop_value, Int(stop ? *stop : Json(0), path + ".stop", 0, 1 << 20));
    step.strip_start = static_cast<int>(start_value);
    step.strip_stop = static_cast<int>(stop_value);
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.replacement, Char(j, "replacement", path, std::nullopt));
    ASSIGN_OR_RETURN(PrependScheme scheme, Scheme(j, path));
    step.strip_first = scheme != PrependScheme::kNever;
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::Kind::kByteLevel;
  } else {
    return Unsupported(path + ".type", Quote(type),
                       "Sequence, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip");
  }
  impl->decoders.push_back(std::move(step));
  return absl::OkStatus();
}

void BuildMatchers(TokenizerImpl* impl) {
  std::vector<std::pair<std::string, int>> raw, normalized;
  for (size_t i = 0; i < impl->added.size(); ++i) {
    const AddedToken& t = impl->added[i];
    if (!t.normalized) {
      raw.emplace_back(t.content, static_cast<int>(i));
    } else {
      // Matched in normalized text, so the pattern is the normalized content.
      std::string pattern = impl->Normalize(t.content);
      if (!pattern.empty()) normalized.emplace_back(std::move(pattern), static_cast<int>(i));
    }
  }
  impl->raw_matcher.Build(std::move(raw));
  impl->normalized_matcher.Build(std::move(normalized));
}

std::optional<int32_t> FindNamed(const TokenizerImpl& impl,
                                 std::initializer_list<const char*> names) {
  for (const char* name : names) {
    auto it = impl.added_by_content.find(std::string_view(name));
    if (it != impl.added_by_content.end()) return it->second;
    auto jt = impl.model.vocab.find(std::string_view(name));
    if (jt != impl.model.vocab.end()) return jt->second;
  }
  return std::nullopt;
}

}  // namespace

// After Fuse or ByteLevel the stream is one token arriving in chunks.
void MarkFusedStages(std::vector<DecoderStep>* steps) {
  bool fused = false;
  for (DecoderStep& s : *steps) {
    s.fused_input = fused;
    if (s.kind == DecoderStep::Kind::kFuse || s.kind == DecoderStep::Kind::kByteLevel) {
      fused = true;
    }
  }
}

absl::StatusOr<std::unique_ptr<TokenizerImpl>> Load(std::string_view text,
                                                    const std::string& source) {
  Loader loader(source);
  Json root;
  try {
    root = Json::parse(text.begin(), text.end());
  } catch (const Json::parse_error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not valid JSON (", e.what(), "); expected a tokenizer.json"));
  }
  if (!root.is_object()) return loader.Expected("(top level)", "an object", root);

  auto impl = std::make_unique<TokenizerImpl>();
  impl->source = source;
  RETURN_IF_ERROR(loader.LoadModel(root, impl.get()));
  RETURN_IF_ERROR(loader.LoadAddedTokens(root, impl.get()));
  if (const Json* j = Loader::Member(root, "normalizer")) {
    RETURN_IF_ERROR(loader.LoadNormalizer(*j, "normalizer", impl.get()));
  }
  if (const Json* j = Loader::Member(root, "pre_tokenizer")) {
    RETURN_IF_ERROR(loader.LoadPreTokenizer(*j, "pre_tokenizer", impl.get()));
  }
  if (const Json* j = Loader::Member(root, "post_processor")) {
    RETURN_IF_ERROR(loader.LoadPostProcessor(*j, "post_processor", impl.get()));
  }
  if (const Json* j = Loader::Member(root, "decoder")) {
    RETURN_IF_ERROR(loader.LoadDecoder(*j, "decoder", impl.get()));
  } else {
    // Without a decoder the library joins the tokens with spaces.
    impl->decoders.push_back(DecoderStep::Of(DecoderStep::Kind::kJoin));
  }
  MarkFusedStages(&impl->decoders);
  BuildMatchers(impl.get());

  if (!impl->prefix_ids.empty()) {
    impl->bos = impl->prefix_ids.front();
  } else {
    impl->bos = FindNamed(*impl, {"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"});
  }
  impl->eos = FindNamed(
      *impl, {"</s>", "<|end_of_text|>", "<|endoftext|>", "<|eot_id|>", "<eos>", "<|im_end|>"});
  return impl;
}

}  // namespace kvwire::tokenizer_internal
