// Chat templates rendered by jinja2 in an embedded Python interpreter, through
// openai_front/chat_template.py (which tests/openai/chat_template_test.py checks against
// transformers' apply_chat_template). Hugging Face templates are Jinja programs written for
// jinja2's semantics (its sandbox, filters, whitespace control and loop controls); no C++
// library renders them exactly, so the one renderer the templates are written for does, and
// only chat requests pay for it (tens of microseconds under the interpreter's lock).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvwire::openai {

class ChatTemplate {
 public:
  // Starts the interpreter (once per process; it installs no signal handlers and reads no
  // PYTHON* variables), imports chat_template.py from `python_dir` and loads the template of
  // the model folder `model_dir` (tokenizer_config.json's chat_template, or the plain
  // fallback; empty: no folder), or the Jinja file `override_file` when one is given.
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> Load(const std::string& python_dir,
                                                            const std::string& model_dir,
                                                            const std::string& override_file);
  ~ChatTemplate();

  // The prompt of `messages_json` (the checked messages as JSON text), less a leading
  // bos_token. InvalidArgument when the template fails on them (raise_exception, a Jinja
  // error, any exception of its expressions); safe from any thread.
  absl::StatusOr<std::string> Render(const std::string& messages_json,
                                     bool add_generation_prompt) const;
  // Where the template came from: tokenizer_config.json's path, the override, or "plain
  // fallback ...".
  const std::string& origin() const { return origin_; }

 private:
  ChatTemplate() = default;
  void* template_ = nullptr;  // PyObject*: chat_template.ChatTemplate
  void* render_ = nullptr;    // PyObject*: chat_template.render_prompt
  void* error_ = nullptr;     // PyObject*: chat_template.TemplateError
  std::string origin_;
};

}  // namespace kvwire::openai
