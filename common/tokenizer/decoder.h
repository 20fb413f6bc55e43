// The decoder chain as streaming stages: DecoderRunner feeds token strings through the
// TokenizerImpl's decoder steps, each stage holding back only what a later token could still
// change (an unfinished run of byte tokens, a possible start of a Replace pattern, trailing
// characters a Strip may remove), in a DecodeState that outlives the runner. Tokenizer::Decode
// is "push every id, then flush" and StreamingDecoder keeps the state between ids, so the two
// agree by construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/tokenizer/tokenizer_impl.h"

namespace kvwire::tokenizer_internal {

struct StageState {
  std::string buffer;         // text or bytes held back
  bool invalid_run = false;   // ByteFallback: the pending byte run is already ill-formed
  size_t checked = 0;         // ByteFallback: the well-formed prefix of the pending run
  bool passthrough = false;   // ByteFallback (fused): the token is too long to be a byte token
  int64_t tokens = 0;         // tokens seen (Metaspace, Join); leading chars stripped (Strip)
  bool leading_done = false;  // Strip (fused)
  int held = 0;               // Strip (fused): trailing strip characters held back
};

struct DecodeState {
  std::vector<StageState> stages;
  explicit DecodeState(size_t n) : stages(n) {}
};

// A pass of tokens through the decoder chain; the text that leaves the last stage is appended to
// `out`. Cheap to make: one per Decode call or StreamingDecoder::Push.
class DecoderRunner {
 public:
  DecoderRunner(const TokenizerImpl& impl, DecodeState* state, std::string* out)
      : steps_(impl.decoders), state_(state), out_(out) {}

  // Feeds `piece` to `stage` (0: the first; a token's text enters there).
  void Push(size_t stage, std::string piece);

  // Releases what every stage holds, first to last, and resets the state.
  void Flush();

 private:
  void PushByteFallback(size_t stage, const DecoderStep& step, StageState* st, std::string piece);
  void FinishByteRun(size_t stage, StageState* st);

  const std::vector<DecoderStep>& steps_;
  DecodeState* state_;
  std::string* out_;
};

}  // namespace kvwire::tokenizer_internal
