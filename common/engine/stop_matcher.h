// Stop strings over streamed text: text is released only once it cannot be the start of
// a stop string, and generation ends before the first stop string (which is not sent).
#pragma once

#include <string>
#include <vector>

namespace kvwire {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

  // Adds generated text; returns what may be sent now. Sets stopped() when a stop string
  // appeared (the returned text then ends just before it).
  std::string Push(const std::string& text);
  // The held-back tail, at the end of generation.
  std::string Flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace kvwire
