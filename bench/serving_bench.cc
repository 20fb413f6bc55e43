// Load against a running kvwire deployment (through the router, or a decode node):
// N concurrent clients send Generate requests and the run reports, per compression
// setting, requests/s, time-to-first-token and inter-token latency percentiles (as the
// clients see them), and full-cache bytes against wire bytes (as the responses report
// them). The settings run one after another in the same process against the same nodes,
// so their figures compare side by side.
//
//   serving_bench --target 127.0.0.1:8080 --concurrency 8 --requests 64
//       --data ../shared/data/stories/dev.jsonl --settings full,snapkv:64,snapkv_pp:64@int4
//
// --ttft-prompt N instead sends N-token prompts one at a time and compares the client's
// time to first token with the prefill node's own forward time (from the response's
// figures): with layer-wise streaming the KV is on the wire while later layers compute,
// so TTFT should stay within a few percent of the forward pass. transfer_ms is the decode node's
// time from the first KV byte to the trailer. With --ttft-questions Q > 1 each prompt is a
// document asked Q questions in a row (the document, then 16 tokens of its own per question): a
// prefill node with a prefix cache computes only the later questions' new tokens, and the run
// reports each later question's TTFT against the document's first.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/base/flags.h"
#include "kvwire/v1/generation.grpc.pb.h"

namespace kvwire {
namespace {

using Clock = std::chrono::steady_clock;

struct Sample {
  bool ok = false;
  double ttft_ms = 0;
  std::vector<double> itl_ms;
  int tokens = 0;
  int64_t full_bytes = 0, wire_bytes = 0;
  double server_ttft_ms = 0, prefill_ms = 0, transfer_ms = 0;
  int cached_tokens = 0;
  std::vector<int32_t> ids;
  std::string error;
};

Sample Run(v1::Generation::Stub& stub, const v1::GenerateRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
  Sample s;
  const auto t0 = Clock::now();
  auto last = t0;
  auto reader = stub.Generate(&ctx, req);
  v1::GenerateResponse r;
  while (reader->Read(&r)) {
    const auto now = Clock::now();
    if (r.token_ids_size() > 0) {
      if (s.tokens == 0) {
        s.ttft_ms = std::chrono::duration<double, std::milli>(now - t0).count();
      } else {
        s.itl_ms.push_back(std::chrono::duration<double, std::milli>(now - last).count());
      }
      s.tokens += r.token_ids_size();
      s.ids.insert(s.ids.end(), r.token_ids().begin(), r.token_ids().end());
      last = now;
    }
    if (r.has_final()) {
      s.full_bytes = r.final().stats().full_cache_bytes();
      s.wire_bytes = r.final().stats().wire_bytes();
      s.server_ttft_ms = r.final().stats().ttft_ms();
      s.prefill_ms = r.final().stats().prefill_ms();
      s.transfer_ms = r.final().stats().transfer_ms();
      s.cached_tokens = r.final().stats().cached_tokens();
    }
  }
  const grpc::Status st = reader->Finish();
  s.ok = st.ok();
  if (!st.ok()) s.error = st.error_message();
  return s;
}

double Pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * (v.size() - 1) + 0.5))];
}

// "full", "snapkv:64", "snapkv_pp:64", "chunkkv:128"..., each optionally "@format" for the KV
// format the kept rows travel in ("snapkv:128@int4", "full@fp8").
void ApplySetting(const std::string& setting, v1::GenerateRequest* req) {
  const std::vector<std::string> at = absl::StrSplit(setting, absl::MaxSplits('@', 1));
  if (at.size() > 1) req->mutable_compression()->set_kv_format(at[1]);
  std::vector<std::string> parts = absl::StrSplit(at[0], ':');
  req->mutable_compression()->set_policy(parts[0]);
  int budget = 0;
  if (parts.size() > 1 && absl::SimpleAtoi(parts[1], &budget)) {
    req->mutable_compression()->set_budget(budget);
  }
}

}  // namespace
}  // namespace kvwire

int main(int argc, char** argv) {
  using namespace kvwire;
  Flags f;
  f.Define("target", "127.0.0.1:8080", "router or decode node");
  f.Define("concurrency", "8", "clients sending at once");
  f.Define("requests", "64", "requests per setting");
  f.Define("max-tokens", "32", "tokens per request");
  f.Define("data", "", "JSONL with prompt_ids (../shared/data/stories/dev.jsonl); else synthetic");
  f.Define("settings", "full,snapkv:64",
           "compression settings compared, policy[:budget][@kv_format] (snapkv:128@int4)");
  f.Define("ttft-prompt", "0", "measure TTFT vs forward time with prompts of this many tokens");
  f.Define("ttft-questions", "1",
           "questions in a row on each --ttft-prompt document (> 1: later TTFT / first)");
  f.Define("ttft-max-tokens", "2",
           "tokens each --ttft-prompt request generates (printed, so runs can be compared)");
  f.Define("vocab", "512", "vocabulary for synthetic prompts");
  f.Define("prompt-tokens", "400", "length of the synthetic prompts (without --data)");
  if (int rc = ParseFlagsOrExit(f, "serving_bench", "serving_bench --target HOST:PORT [flags]",
                                argc, argv);
      rc >= 0) {
    return rc;
  }
  auto fail = [](const std::string& what) {
    std::fprintf(stderr, "serving_bench: %s\n", what.c_str());
    return 2;
  };
  auto concurrency_or = f.GetInt("concurrency", 1, 1024),
       requests_or = f.GetInt("requests", 1, 1 << 20),
       max_tokens_or = f.GetInt("max-tokens", 1, 1 << 16), vocab_or = f.GetInt("vocab", 4, 1 << 24),
       ttft_or = f.GetInt("ttft-prompt", 0, 1 << 20),
       ttft_tokens_or = f.GetInt("ttft-max-tokens", 1, 1 << 16),
       questions_or = f.GetInt("ttft-questions", 1, 1024),
       prompt_tokens_or = f.GetInt("prompt-tokens", 2, 1 << 20);
  for (const auto* v : {&concurrency_or, &requests_or, &max_tokens_or, &vocab_or, &ttft_or,
                        &ttft_tokens_or, &questions_or, &prompt_tokens_or}) {
    if (!v->ok()) return fail(std::string(v->status().message()));
  }
  const int concurrency = static_cast<int>(*concurrency_or);
  const int ttft_tokens = static_cast<int>(*ttft_tokens_or);
  const int requests = static_cast<int>(*requests_or);
  const int max_tokens = static_cast<int>(*max_tokens_or);
  const int vocab = static_cast<int>(*vocab_or);
  const int ttft_prompt = static_cast<int>(*ttft_or);
  const int questions = static_cast<int>(*questions_or);
  if (questions > 1 && ttft_prompt == 0) return fail("--ttft-questions needs --ttft-prompt");
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel(f.GetString("target"), grpc::InsecureChannelCredentials()));

  std::vector<std::vector<int32_t>> prompts;
  if (const std::string data = f.GetString("data"); !data.empty()) {
    std::ifstream in(data);
    if (!in) return fail("cannot open --data " + data);
    int n = 0;
    for (std::string line; std::getline(in, line);) {
      ++n;
      try {
        prompts.push_back(nlohmann::json::parse(line).at("prompt_ids").get<std::vector<int32_t>>());
      } catch (const nlohmann::json::exception& e) {
        return fail(data + ":" + std::to_string(n) + ": expected a JSON object with prompt_ids (" +
                    e.what() + ")");
      }
    }
    if (prompts.empty()) return fail(data + ": no prompts");
  }
  if (prompts.empty() || ttft_prompt > 0) {
    prompts.clear();
    const int len = ttft_prompt > 0 ? ttft_prompt : static_cast<int>(*prompt_tokens_or);
    for (int p = 0; p < 16; ++p) {
      std::vector<int32_t> ids = {1};
      for (int i = 1; i < len; ++i) ids.push_back(3 + (i * 31 + p * 7) % (vocab - 3));
      prompts.push_back(ids);
    }
  }

  if (ttft_prompt > 0) {
    constexpr int kQuestionTokens = 16;
    std::printf("%-18s %8s %3s %7s %12s %12s %12s %12s %8s %s\n", "setting", "prompt", "q",
                "cached", "forward_ms", "transfer_ms", "ttft_ms", "client_ttft", "ratio", "ids");
    const int documents = std::min(requests, 8);
    int setting_index = 0;
    for (const std::string& setting : f.GetList("settings")) {
      std::vector<double> ratios, later;
      // Each setting asks documents of its own, so that its first questions find none cached.
      const int first_document = questions > 1 ? documents * setting_index++ : 0;
      for (int i = 0; i < documents; ++i) {
        double first_ttft = 0;
        for (int q = 0; q < questions; ++q) {
          std::vector<int32_t> ids = prompts[(first_document + i) % prompts.size()];
          if (questions > 1) {
            for (int t = 0; t < kQuestionTokens; ++t) {
              ids.push_back(3 + (t * 13 + q * 101 + i) % (vocab - 3));
            }
          }
          v1::GenerateRequest req;
          for (int32_t id : ids) req.mutable_prompt_ids()->add_ids(id);
          req.mutable_sampling()->set_max_tokens(ttft_tokens);
          ApplySetting(setting, &req);
          const Sample s = Run(*stub, req);
          if (!s.ok) {
            std::fprintf(stderr, "request failed: %s\n", s.error.c_str());
            return 1;
          }
          ratios.push_back(s.server_ttft_ms / s.prefill_ms);
          if (q == 0) first_ttft = s.server_ttft_ms;
          if (q > 0) later.push_back(s.server_ttft_ms / first_ttft);
          std::printf("%-18s %8zu %3d %7d %12.1f %12.1f %12.1f %12.1f %8.3f %s\n", setting.c_str(),
                      ids.size(), q, s.cached_tokens, s.prefill_ms, s.transfer_ms, s.server_ttft_ms,
                      s.ttft_ms, s.server_ttft_ms / s.prefill_ms,
                      absl::StrJoin(s.ids, "-").c_str());
        }
      }
      std::printf("%-18s median TTFT / forward = %.3f\n", setting.c_str(), Pct(ratios, 50));
      if (!later.empty()) {
        std::printf("%-18s median TTFT of later questions / first = %.3f\n", setting.c_str(),
                    Pct(later, 50));
      }
    }
    return 0;
  }

  std::printf("%-18s %6s %8s %9s %9s %9s %9s %9s %9s %13s %13s %7s\n", "setting", "ok", "req/s",
              "ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p90", "itl_p99", "full_bytes",
              "wire_bytes", "ratio");
  for (const std::string& setting : f.GetList("settings")) {
    std::vector<Sample> samples(requests);
    std::atomic<int> next{0};
    const auto t0 = Clock::now();
    std::vector<std::thread> clients;
    for (int c = 0; c < concurrency; ++c) {
      clients.emplace_back([&] {
        for (int i; (i = next++) < requests;) {
          v1::GenerateRequest req;
          for (int32_t id : prompts[i % prompts.size()]) req.mutable_prompt_ids()->add_ids(id);
          req.mutable_sampling()->set_max_tokens(max_tokens);
          req.mutable_sampling()->set_ignore_eos(true);
          ApplySetting(setting, &req);
          samples[i] = Run(*stub, req);
        }
      });
    }
    for (auto& t : clients) t.join();
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    std::vector<double> ttft, itl;
    int ok = 0;
    int64_t full = 0, wire = 0;
    for (const Sample& s : samples) {
      if (!s.ok) {
        std::fprintf(stderr, "%s: %s\n", setting.c_str(), s.error.c_str());
        continue;
      }
      ++ok;
      ttft.push_back(s.ttft_ms);
      itl.insert(itl.end(), s.itl_ms.begin(), s.itl_ms.end());
      full += s.full_bytes;
      wire += s.wire_bytes;
    }
    std::printf("%-18s %6d %8.2f %9.1f %9.1f %9.1f %9.2f %9.2f %9.2f %13lld %13lld %6.1fx\n",
                setting.c_str(), ok, ok / secs, Pct(ttft, 50), Pct(ttft, 90), Pct(ttft, 99),
                Pct(itl, 50), Pct(itl, 90), Pct(itl, 99), static_cast<long long>(full),
                static_cast<long long>(wire), wire ? static_cast<double>(full) / wire : 0.0);
  }
  return 0;
}
