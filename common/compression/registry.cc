// The registry: every compression policy by name. Each policy's file defines its
// PolicyInfo; adding a policy adds its line here.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/compression/policy.h"

namespace kvwire {

const PolicyInfo& FullPolicyInfo();       // full.cc
const PolicyInfo& StreamingPolicyInfo();  // streaming.cc
const PolicyInfo& RandomPolicyInfo();     // random.cc
const PolicyInfo& SnapKVPolicyInfo();     // snapkv.cc
const PolicyInfo& SnapKVppPolicyInfo();   // snapkv_pp.cc
const PolicyInfo& ChunkKVPolicyInfo();    // chunkkv.cc
const PolicyInfo& HbwPolicyInfo();        // hbw.cc
const PolicyInfo& RocketKVPolicyInfo();   // snapkv_pp.cc: stage 1 of RocketKV

const std::vector<const PolicyInfo*>& Policies() {
  static const auto* const kPolicies = new std::vector<const PolicyInfo*>{
      &FullPolicyInfo(),     &StreamingPolicyInfo(), &RandomPolicyInfo(), &SnapKVPolicyInfo(),
      &SnapKVppPolicyInfo(), &ChunkKVPolicyInfo(),   &HbwPolicyInfo(),    &RocketKVPolicyInfo(),
  };
  return *kPolicies;
}

const PolicyInfo* FindPolicy(absl::string_view name) {
  for (const PolicyInfo* p : Policies()) {
    if (name == p->name) return p;
  }
  return nullptr;
}

std::string PolicyNames() {
  return absl::StrJoin(Policies(), ", ",
                       [](std::string* out, const PolicyInfo* p) { out->append(p->name); });
}

std::string PoliciesTaking(absl::string_view param) {
  std::vector<std::string> names;
  for (const PolicyInfo* p : Policies()) {
    for (const ParamInfo& q : p->params) {
      if (param == q.name) names.push_back(p->name);
    }
  }
  return absl::StrJoin(names, ", ");
}

absl::StatusOr<PolicyPtr> MakePolicy(absl::string_view name, const ParamValues& params) {
  const PolicyInfo* info = FindPolicy(name);
  if (info == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown compression policy '", name, "'; expected one of ", PolicyNames()));
  }
  return info->make(params);
}

PolicyPtr FullPolicy() {
  static const PolicyPtr* const kFull = new PolicyPtr(*FullPolicyInfo().make({}));
  return *kFull;
}

}  // namespace kvwire
