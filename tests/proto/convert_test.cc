// The translation between kvwire/v1 messages and domain types: what the decode node sends
// the prefill node rebuilds exactly the same compression (every parameter, exact ratios, any
// 64-bit seed), and request fields are refused by their names.
#include "proto/convert.h"

#include <gtest/gtest.h>

#include <functional>

namespace kvwire {
namespace {

CompressionConfig Config(const std::string& policy, const ParamValues& params) {
  CompressionConfig c;
  c.policy = *MakePolicy(policy, params);
  return c;
}

TEST(CompressionParams, EveryPolicyRoundTripsExactly) {
  std::vector<CompressionConfig> configs;
  for (const PolicyInfo* info : Policies()) {
    CompressionConfig c = Config(info->name, {});
    if (c.policy->evicts()) {
      c.budget = 48;
      c.window = 8;
      c.skip_layers = 1;
    }
    configs.push_back(c);
  }
  CompressionConfig ratio = Config("snapkv", {{"gqa", "per_query_head"}, {"kernel", "9"}});
  ratio.ratio = 1.0 / 3;  // not exact in 6 digits
  configs.push_back(ratio);
  CompressionConfig seeded = Config("random", {{"seed", "18446744073709551615"}});
  seeded.budget = 32;
  configs.push_back(seeded);
  CompressionConfig hbw = Config("hbw", {{"groups", "1,2,4"}, {"block", "3"}, {"gqa", "max"}});
  hbw.budget = 96;
  configs.push_back(hbw);
  for (const CompressionConfig& want : configs) {
    SCOPED_TRACE(want.Describe());
    CompressionConfig got;
    ASSERT_TRUE(ApplyCompressionParams(ToProto(want), &got).ok());
    EXPECT_EQ(got.policy_name(), want.policy_name());
    EXPECT_EQ(got.policy->params(), want.policy->params());
    EXPECT_EQ(got.budget, want.budget);
    EXPECT_EQ(got.ratio, want.ratio);  // bit for bit
    EXPECT_EQ(got.window, want.window);
    EXPECT_EQ(got.skip_layers, want.skip_layers);
    if (want.policy->selects()) {
      EXPECT_EQ(got.KeptTokens(1, 81000), want.KeptTokens(1, 81000));
    }
  }
}

TEST(CompressionParams, FieldsAreRefusedByName) {
  struct Case {
    std::function<void(v1::CompressionParams*)> edit;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[](auto* p) {
         p->set_policy("snapkv_pp");
         p->set_budget(32);
         p->set_kernel(7);
       },
       "compression.kernel does not apply to snapkv_pp (it takes compression.kernel_small, "
       "compression.kernel_large, compression.kernel_threshold)"},
      {[](auto* p) {
         p->set_policy("snapkv");
         p->set_budget(32);
         p->set_pool("min");
       },
       "compression.pool must be one of max, avg"},
      {[](auto* p) {
         p->set_policy("full");
         p->set_window(16);
       },
       "compression.window does not apply to full"},
      {[](auto* p) {
         p->set_policy("snapkv");
         p->set_ratio(2);
       },
       "compression.ratio must be in"},
      {[](auto* p) { p->set_policy("h2o"); }, "compression.policy must be one of"},
      {[](auto* p) {
         p->set_policy("chunkkv");
         p->set_budget(32);
         (*p->mutable_params())["colour"] = "red";
       },
       "compression.colour does not apply to chunkkv"},
      // Found with prefill_request_fuzz's inputs: a parameter with a field of its own, also
      // given by name, silently overrode the field (and the policy).
      {[](auto* p) {
         p->set_policy("snapkv");
         p->set_budget(32);
         p->set_window(8);
         (*p->mutable_params())["window"] = std::string("2");
       },
       "compression.params: 'window' has a field of its own, compression.window"},
      {[](auto* p) {
         p->set_policy("snapkv");
         p->set_budget(32);
         (*p->mutable_params())["policy"] = "full";
       },
       "compression.params: 'policy' has a field of its own"},
  };
  for (const Case& c : cases) {
    v1::CompressionParams p;
    c.edit(&p);
    CompressionConfig config;
    const absl::Status st = ApplyCompressionParams(p, &config);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_NE(std::string(st.message()).find(c.expect), std::string::npos)
        << "'" << c.expect << "' not in: " << st.message();
  }
}

}  // namespace
}  // namespace kvwire
