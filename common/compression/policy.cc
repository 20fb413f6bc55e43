#include "common/compression/policy.h"

#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace kvwire {

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
    return absl::InvalidArgumentError(absl::StrCat(name, " must be an integer, got '", *v, "'"));
  }
  // Upper bounds keep every sum below int overflow and every buffer sane.
  if (x > max) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, " must be <= ", max == (1 << 20) ? std::string("2^20") : absl::StrCat(max), ", got ",
        x));
  }
  if (x < min) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be >= ", min, ", got ", x));
  }
  *out = static_cast<int>(x);
  return absl::OkStatus();
}

absl::Status ParamReader::Uint64(const char* name, uint64_t* out) {
  const std::string* v = Take(name);
  if (v == nullptr) return absl::OkStatus();
  if (!absl::SimpleAtoi(*v, out)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be a non-negative integer, got '", *v, "'"));
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
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be a comma-separated list of integers, got '", *v, "'"));
    }
    if (x < min)
      return absl::InvalidArgumentError(absl::StrCat(name, " must be >= ", min, ", got ", x));
    if (x > max) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " must be <= ", max == (1 << 20) ? std::string("2^20") : absl::StrCat(max),
          ", got ", x));
    }
    list.push_back(x);
  }
  if (list.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must list at least one value"));
  }
  if (list.size() > max_items) {
    return absl::InvalidArgumentError(
        absl::StrCat("at most ", max_items, " ", name, ", got ", list.size()));
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
  return absl::InvalidArgumentError(
      absl::StrCat(name, " must be one of ", absl::StrJoin(names, ", "), "; got '", *v, "'"));
}

absl::Status ParamReader::Finish() const {
  for (const auto& [name, value] : values_) {
    if (std::find(read_.begin(), read_.end(), name) != read_.end()) continue;
    std::vector<std::string> takes;
    for (const ParamInfo& p : info_.params) takes.push_back(p.name);
    const std::string others = PoliciesTaking(name);
    return absl::InvalidArgumentError(
        absl::StrCat(name, " does not apply to ", info_.name, " (",
                     takes.empty() ? std::string("it takes no parameters")
                                   : absl::StrCat("it takes ", absl::StrJoin(takes, ", ")),
                     ")",
                     others.empty() ? std::string("; no policy takes it")
                                    : absl::StrCat("; ", name, " applies to ", others)));
  }
  return absl::OkStatus();
}

}  // namespace kvwire
