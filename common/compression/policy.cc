#include "common/compression/policy.h"

#include <algorithm>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"

namespace kvwire {

std::string ExactDecimal(double x) { return absl::StrFormat("%.17g", x); }

namespace {

constexpr absl::string_view kParamPayload = "type.kvwire.dev/param";
constexpr absl::string_view kPolicyPayload = "type.kvwire.dev/policy-not-taking";

std::string NotTakenMessage(absl::string_view param, absl::string_view policy,
                            const std::function<std::string(absl::string_view)>& name) {
  const PolicyInfo* info = FindPolicy(policy);
  std::vector<std::string> takes;
  if (info != nullptr) {
    for (const ParamInfo& p : info->params) takes.push_back(name(p.name));
  }
  std::vector<std::string> others;
  for (const PolicyInfo* p : Policies()) {
    for (const ParamInfo& q : p->params) {
      if (param == q.name) others.push_back(p->name);
    }
  }
  return absl::StrCat(name(param), " does not apply to ", policy, " (",
                      takes.empty() ? std::string("it takes no parameters")
                                    : absl::StrCat("it takes ", absl::StrJoin(takes, ", ")),
                      ")",
                      others.empty() ? std::string("; no policy takes it")
                                     : absl::StrCat("; ", name(param), " applies to ",
                                                    absl::StrJoin(others, ", ")));
}

std::string AsIs(absl::string_view s) { return std::string(s); }

}  // namespace

absl::Status AboutParam(absl::Status status, absl::string_view param) {
  status.SetPayload(kParamPayload, absl::Cord(param));
  return status;
}

absl::Status ParamError(absl::string_view param, absl::string_view what) {
  return AboutParam(absl::InvalidArgumentError(absl::StrCat(param, " ", what)), param);
}

absl::Status NotTakenError(absl::string_view param, absl::string_view policy) {
  absl::Status st = absl::InvalidArgumentError(NotTakenMessage(param, policy, AsIs));
  st.SetPayload(kParamPayload, absl::Cord(param));
  st.SetPayload(kPolicyPayload, absl::Cord(policy));
  return st;
}

absl::Status RenameParams(const absl::Status& status,
                          const std::function<std::string(absl::string_view)>& name) {
  const auto param = status.GetPayload(kParamPayload);
  if (status.ok() || !param) return status;
  const std::string p(*param);
  if (const auto policy = status.GetPayload(kPolicyPayload)) {
    return AboutField(absl::Status(status.code(), NotTakenMessage(p, std::string(*policy), name)),
                      name(p));
  }
  // "<param> <what>", maybe after a "compression: " context.
  std::string message(status.message());
  const size_t at = message.find(p);
  if (at != std::string::npos) message.replace(at, p.size(), name(p));
  const std::string context = "compression: ";
  if (message.rfind(context, 0) == 0) message = message.substr(context.size());
  return AboutField(absl::Status(status.code(), message), name(p));
}

absl::StatusOr<KeptRows> CompressionPolicy::SelectPrefix(const LayerInput&, PromptState*) const {
  return absl::UnimplementedError(
      absl::StrCat(name(), " selects with the backend's ops, not on the host"));
}

absl::StatusOr<const int32_t*> CompressionPolicy::Select(const LayerInput& in,
                                                         const SelectionOps& ops,
                                                         PromptState* state) const {
  ASSIGN_OR_RETURN(KeptRows rows, SelectPrefix(in, state));
  const int budget = in.prefix_budget + in.window;
  std::vector<int32_t> flat;
  flat.reserve(static_cast<size_t>(in.cache_heads) * budget);
  if (static_cast<int>(rows.size()) != in.cache_heads) {
    return absl::InternalError(
        absl::StrCat(name(), " chose ", rows.size(), " rows for ", in.cache_heads, " cache heads"));
  }
  for (const std::vector<int32_t>& row : rows) {
    if (static_cast<int>(row.size()) != in.prefix_budget ||
        (!row.empty() && (row.front() < 0 || row.back() >= in.prefix))) {
      return absl::InternalError(absl::StrCat(name(), " chose a row of ", row.size(),
                                              " positions where ", in.prefix_budget,
                                              " of the prefix were due"));
    }
    flat.insert(flat.end(), row.begin(), row.end());
    for (int32_t j = in.prefix; j < in.len; ++j) flat.push_back(j);  // the window
  }
  RETURN_IF_ERROR(ops.backend->CopyToDevice(ops.kept, flat.data(), flat.size() * sizeof(int32_t)));
  return ops.kept;
}

std::string CompressionPolicy::DescribeBudget(int budget, double ratio) const {
  return budget > 0 ? absl::StrCat("budget=", budget) : absl::StrCat("ratio=", ratio);
}

std::string CompressionPolicy::DescribeParams(int window) const {
  std::string s = absl::StrCat(", window=", window);
  const ParamValues values = params();
  for (const ParamInfo& p : info().params) {
    auto it = values.find(p.name);
    if (it != values.end()) absl::StrAppend(&s, ", ", p.name, "=", it->second);
  }
  return s;
}

absl::Status CompressionPolicy::CheckBudget(int budget, int window) const {
  if (budget > 0 && budget <= window) {
    return absl::InvalidArgumentError(absl::StrCat("budget (", budget,
                                                   ") must exceed the observation window (", window,
                                                   "), which is always kept"));
  }
  return absl::OkStatus();
}

const std::string* ParamReader::Take(const char* name) {
  auto it = values_.find(name);
  if (it == values_.end()) return nullptr;
  read_.push_back(name);
  return &it->second;
}

absl::Status ParamReader::Int(const char* name, int min, int max, int* out) {
  const std::string* v = Take(name);
  if (v == nullptr) return absl::OkStatus();
  int64_t x = 0;
  if (!absl::SimpleAtoi(*v, &x)) {
    return ParamError(name, absl::StrCat("must be an integer, got '", *v, "'"));
  }
  // Upper bounds keep every sum below int overflow and every buffer sane.
  if (x > max) {
    return ParamError(name, absl::StrCat("must be <= ",
                                         max == (1 << 20) ? std::string("2^20") : absl::StrCat(max),
                                         ", got ", x));
  }
  if (x < min) return ParamError(name, absl::StrCat("must be >= ", min, ", got ", x));
  *out = static_cast<int>(x);
  return absl::OkStatus();
}

absl::Status ParamReader::Uint64(const char* name, uint64_t* out) {
  const std::string* v = Take(name);
  if (v == nullptr) return absl::OkStatus();
  if (!absl::SimpleAtoi(*v, out)) {
    return ParamError(name, absl::StrCat("must be a non-negative integer, got '", *v, "'"));
  }
  return absl::OkStatus();
}

absl::Status ParamReader::IntList(const char* name, int min, int max, size_t max_items,
                                  std::vector<int>* out) {
  const std::string* v = Take(name);
  if (v == nullptr) return absl::OkStatus();
  std::vector<int> list;
  for (absl::string_view item : absl::StrSplit(*v, ',', absl::SkipWhitespace())) {
    int x = 0;
    if (!absl::SimpleAtoi(item, &x)) {
      return ParamError(name,
                        absl::StrCat("must be a comma-separated list of integers, got '", *v, "'"));
    }
    if (x < min) return ParamError(name, absl::StrCat("must be >= ", min, ", got ", x));
    if (x > max) {
      return ParamError(
          name,
          absl::StrCat("must be <= ", max == (1 << 20) ? std::string("2^20") : absl::StrCat(max),
                       ", got ", x));
    }
    list.push_back(x);
  }
  if (list.empty()) return ParamError(name, "must list at least one value");
  if (list.size() > max_items) {
    return AboutParam(absl::InvalidArgumentError(
                          absl::StrCat("at most ", max_items, " ", name, ", got ", list.size())),
                      name);
  }
  *out = std::move(list);
  return absl::OkStatus();
}

absl::Status ParamReader::Choice(const char* name, const std::vector<absl::string_view>& names,
                                 int* out) {
  const std::string* v = Take(name);
  if (v == nullptr) return absl::OkStatus();
  for (size_t i = 0; i < names.size(); ++i) {
    if (*v == names[i]) {
      *out = static_cast<int>(i);
      return absl::OkStatus();
    }
  }
  return ParamError(
      name, absl::StrCat("must be one of ", absl::StrJoin(names, ", "), "; got '", *v, "'"));
}

absl::Status ParamReader::Finish() const {
  for (const auto& [name, value] : values_) {
    if (std::find(read_.begin(), read_.end(), name) == read_.end()) {
      return NotTakenError(name, info_.name);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvwire
