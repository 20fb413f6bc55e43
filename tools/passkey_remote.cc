#include "tools/passkey_remote.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "kvwire/v1/generation.grpc.pb.h"
#include "proto/convert.h"

namespace kvwire::tools {
namespace {

v1::DecodeAttentionParams ToProto(const DecodeAttentionConfig& a) {
  v1::DecodeAttentionParams p;
  p.set_mode(std::string(AttentionModeName(a.mode)));
  if (a.token_budget > 0) p.set_token_budget(a.token_budget);
  if (a.top_k > 0) p.set_top_k(a.top_k);
  if (a.top_r > 0) p.set_top_r(a.top_r);
  if (a.page_size > 0) p.set_page_size(a.page_size);
  return p;
}

v1::GenerateRequest Request(const EvalPrompt& prompt, const EvalMethod& method, int budget) {
  v1::GenerateRequest req;
  req.set_request_id(absl::StrCat("passkey-", prompt.id, "-", method.name, "-",
                                  KvFormatName(method.kv_format), "-", budget));
  for (int32_t id : prompt.ids) req.mutable_prompt_ids()->add_ids(id);
  v1::SamplingParams* s = req.mutable_sampling();
  s->set_max_tokens(static_cast<int>(prompt.answer.size()));
  s->set_temperature(0);
  s->set_ignore_eos(true);
  *req.mutable_compression() = kvwire::ToProto(method.compression(budget));
  if (method.attention) *req.mutable_attention() = ToProto(method.attention(budget));
  return req;
}

// Sends one request and reads its stream to the end.
absl::Status Call(v1::Generation::Stub& stub, const v1::GenerateRequest& req, int timeout_ms,
                  PasskeyAnswer* a) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse r;
  bool final_seen = false;
  while (reader->Read(&r)) {
    for (int32_t id : r.token_ids()) a->tokens.push_back(id);
    if (r.has_final()) {
      final_seen = true;
      const v1::RequestStats& s = r.final().stats();
      a->full_cache_bytes = s.full_cache_bytes();
      a->kv_payload_bytes = s.kv_payload_bytes();
      a->wire_bytes = s.wire_bytes();
      a->ttft_ms = s.ttft_ms();
      a->cached_tokens = s.cached_tokens();
    }
  }
  RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  if (!final_seen)
    return absl::DataLossError("the response stream ended without its final message");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PasskeyRun> EvalPasskeyRemote(const RemoteOptions& options,
                                             const std::vector<EvalPrompt>& prompts,
                                             const std::vector<EvalMethod>& methods,
                                             const std::vector<int>& budgets,
                                             const std::function<void(int, int)>& progress) {
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> creds,
                   MakeChannelCredentials(options.tls));
  grpc::ChannelArguments args;
  if (!options.tls.server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls.server_name);
  }
  auto channel = grpc::CreateCustomChannel(options.target, creds, args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() +
                                 std::chrono::milliseconds(options.connect_timeout_ms))) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ", options.target, " within ",
                                               options.connect_timeout_ms / 1000.0,
                                               " s (is the router or decode node running?)"));
  }
  auto stub = v1::Generation::NewStub(channel);

  const size_t per_prompt = methods.size() * budgets.size();
  const size_t total = prompts.size() * per_prompt;
  std::vector<PasskeyAnswer> answers(total);
  std::vector<int> remaining(prompts.size(), static_cast<int>(per_prompt));
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  absl::Status error;
  int done = 0;
  auto worker = [&] {
    for (size_t i = next++; i < total && !failed; i = next++) {
      const size_t p = i / per_prompt, mb = i % per_prompt;
      const EvalPrompt& prompt = prompts[p];
      const EvalMethod& method = methods[mb / budgets.size()];
      const int budget = budgets[mb % budgets.size()];
      PasskeyAnswer& a = answers[i];
      a.id = prompt.id;
      a.task = prompt.task;
      a.method = method.name;
      a.kv_format = std::string(KvFormatName(method.kv_format));
      a.budget = budget;
      a.prompt_tokens = static_cast<int>(prompt.ids.size());
      a.expected = prompt.answer;
      absl::Status st = Call(*stub, Request(prompt, method, budget), options.timeout_ms, &a);
      if (st.ok() && options.warm_pass) {
        PasskeyAnswer warm;
        v1::GenerateRequest again = Request(prompt, method, budget);
        again.set_request_id(again.request_id() + "-warm");
        st = Call(*stub, again, options.timeout_ms, &warm);
        a.warm_tokens = warm.tokens;
        a.warm_ttft_ms = warm.ttft_ms;
        a.warm_cached_tokens = warm.cached_tokens;
      }
      std::lock_guard<std::mutex> lock(mu);
      if (!st.ok()) {
        if (!failed.exchange(true)) {
          error = Annotate(st, absl::StrCat("prompt ", prompt.id, ", ", method.name, " at ", budget,
                                            ", via ", options.target));
        }
        return;
      }
      if (--remaining[p] == 0 && progress) progress(++done, static_cast<int>(prompts.size()));
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < std::max(1, options.concurrency); ++t) threads.emplace_back(worker);
  for (std::thread& t : threads) t.join();
  if (failed) return error;
  return PasskeyRun{std::move(answers), {}};
}

}  // namespace kvwire::tools
