// kvwire-openai: the OpenAI-compatible HTTP front. Flags, the chat template, the server, wait
// for SIGTERM, drain.
//
//   kvwire-openai --target localhost:8080 --model ../shared/models/stories260K-hf
//       --listen 127.0.0.1:8000
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "common/base/flags.h"
#include "common/base/status.h"
#include "common/server/server_main.h"
#include "openai_front/front.h"

#ifndef KVWIRE_OPENAI_PYTHON_DIR
#define KVWIRE_OPENAI_PYTHON_DIR ""
#endif

namespace kvwire::openai {
namespace {

namespace fs = std::filesystem;

// The folder of chat_template.py: --python-dir, else beside the executable (an installed
// front), else the source tree this binary was built from.
std::string PythonDir(const std::string& flag) {
  if (!flag.empty()) return flag;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && fs::exists(exe.parent_path() / "chat_template.py")) return exe.parent_path();
  return KVWIRE_OPENAI_PYTHON_DIR;
}

absl::StatusOr<std::chrono::milliseconds> Seconds(const Flags& f, const std::string& name,
                                                  double min, double max) {
  ASSIGN_OR_RETURN(double s, f.GetDouble(name, min, max));
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

absl::StatusOr<FrontOptions> OptionsFromFlags(const Flags& f) {
  FrontOptions o;
  ASSIGN_OR_RETURN(ListenAddress listen, ParseListenAddress("listen", f.GetString("listen")));
  if (listen.host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen: expected HOST:PORT with a host, got '", f.GetString("listen"), "'"));
  }
  o.host = listen.host;
  o.port = listen.port;
  o.target = f.GetString("target");
  if (o.target.empty())
    return absl::InvalidArgumentError("--target: the router or a decode node is required");
  o.tls_ca = f.GetString("tls-ca");
  const std::string model = f.GetString("model");
  o.model_id = f.GetString("model-name");
  if (o.model_id.empty()) {
    fs::path p = fs::path(model).lexically_normal();
    if (!p.has_filename()) p = p.parent_path();  // "dir/" names dir
    o.model_id = model.empty()                       ? "kvwire"
                 : model.rfind("synthetic:", 0) == 0 ? model
                                                     : p.filename().string();
  }
  ASSIGN_OR_RETURN(o.timeout, Seconds(f, "timeout-s", 0.001, 7 * 86400));
  ASSIGN_OR_RETURN(o.send_timeout, Seconds(f, "send-timeout-s", 0.001, 3600));
  ASSIGN_OR_RETURN(o.health_timeout, Seconds(f, "health-timeout-s", 0.001, 3600));
  ASSIGN_OR_RETURN(o.disconnect_poll, Seconds(f, "disconnect-poll-s", 0.001, 60));
  ASSIGN_OR_RETURN(int64_t inflight, f.GetInt("max-inflight", 1, 1 << 16));
  ASSIGN_OR_RETURN(int64_t threads, f.GetInt("threads", 0, 1 << 16));
  ASSIGN_OR_RETURN(int64_t body, f.GetInt("max-body-bytes", 1024, int64_t{1} << 30));
  o.max_body_bytes = static_cast<size_t>(body);
  o.max_inflight = static_cast<int>(inflight);
  o.threads = static_cast<int>(threads);
  o.access_log = f.GetBool("access-log");
  return o;
}

}  // namespace
}  // namespace kvwire::openai

int main(int argc, char** argv) {
  using namespace kvwire;
  using namespace kvwire::openai;
  BlockTerminationSignals();
  LimitProtobufLogs();

  Flags flags;
  flags.Define("listen", "127.0.0.1:8000",
               "HOST:PORT of the HTTP listener (port 0: a free port, printed)");
  flags.Define("target", "localhost:8080",
               "gRPC target of Generate: the router, a decode node, or ipv4:HOST:PORT,HOST:PORT");
  flags.Define("model", "",
               "the model folder the decode nodes serve (its tokenizer_config.json gives the chat "
               "template), or synthetic:NAME");
  flags.Define("model-name", "", "the model id clients name (default: the folder's name)");
  flags.Define("chat-template", "", "a Jinja file replacing the model's chat template");
  flags.Define("python-dir", "",
               "the folder of chat_template.py (default: beside this executable, else the source "
               "tree it was built from)");
  flags.Define("timeout-s", "300", "deadline of each Generate call, whole generation included");
  flags.Define("send-timeout-s", "30", "longest wait for a client to take one write");
  flags.Define("health-timeout-s", "2", "deadline of /health's check of the target");
  flags.Define("disconnect-poll-s", "0.2",
               "how often the requests' connections are checked for hang-ups");
  flags.Define("max-inflight", "256", "requests in flight beyond which the front answers 429");
  flags.Define("threads", "0",
               "HTTP worker threads, one per open connection (0: max-inflight + 32)");
  flags.Define("max-body-bytes", "4194304", "largest request body accepted (413 beyond)");
  flags.Define("grace-s", "20", "SIGTERM: how long requests in flight may finish");
  flags.Define("tls-ca", "", "CA certificate of the target (enables TLS)");
  flags.DefineBool("access-log", "one line per request on stderr");
  flags.DefineBool("dry-run", "check the flags and the chat template, start nothing");
  if (int rc = ParseFlagsOrExit(flags, "kvwire-openai",
                                "kvwire-openai --target ROUTER --model DIR [flags]", argc, argv);
      rc >= 0) {
    return rc;
  }
  auto fail = [](const absl::Status& st) { return FailExit("kvwire-openai", st); };
  auto options = OptionsFromFlags(flags);
  if (!options.ok()) return fail(options.status());
  auto grace = Seconds(flags, "grace-s", 0, 3600);
  if (!grace.ok()) return fail(grace.status());
  const std::string model = flags.GetString("model");
  const std::string model_dir = std::filesystem::is_directory(model) ? model : "";
  if (!model.empty() && model_dir.empty() && model.rfind("synthetic:", 0) != 0) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--model: '", model, "' is neither a model folder nor synthetic:NAME")));
  }
  auto chat_template = ChatTemplate::Load(PythonDir(flags.GetString("python-dir")), model_dir,
                                          flags.GetString("chat-template"));
  if (!chat_template.ok()) return fail(chat_template.status());
  if (flags.GetBool("dry-run")) {
    std::printf("kvwire-openai: flags OK (listen %s:%d, target %s, model %s, chat template: %s)\n",
                options->host.c_str(), options->port, options->target.c_str(),
                options->model_id.c_str(), (*chat_template)->origin().c_str());
    return 0;
  }
  const std::string origin = (*chat_template)->origin();
  auto front = Front::Start(*options, *std::move(chat_template));
  if (!front.ok()) return fail(front.status());
  std::fprintf(
      stderr, "kvwire-openai: listening on http://%s:%d (model %s, target %s, chat template: %s)\n",
      options->host.c_str(), (*front)->port(), options->model_id.c_str(), options->target.c_str(),
      origin.c_str());
  WaitForTermination([&] {
    std::fprintf(stderr, "kvwire-openai: stopping: requests in flight get %.0f s\n",
                 grace->count() / 1000.0);
    (*front)->Shutdown(*grace);
  });
  return 0;
}
