// DecoderRunner (see decoder.h): each decoder step as a streaming stage. A stage that sees whole
// tokens (before any Fuse or ByteLevel) works token by token; one after them sees the single
// fused token in chunks and holds back what a later chunk could change, releasing it in Flush.
#include "common/tokenizer/decoder.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/tokenizer/pretokenize.h"
#include "common/tokenizer/utf8.h"

namespace kvwire::tokenizer_internal {
namespace {

bool ParseByteToken(std::string_view token, unsigned char* byte) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return false;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(token[3]), lo = hex(token[4]);
  if (hi < 0 || lo < 0) return false;
  *byte = static_cast<unsigned char>(hi * 16 + lo);
  return true;
}

// Replace over a stream of chunks: everything up to a possible start of the pattern.
std::string ReplaceStreaming(const DecoderStep& step, std::string* buffer) {
  std::string out;
  const std::string& p = step.pattern;
  size_t i = 0;
  while (i < buffer->size()) {
    const size_t left = buffer->size() - i;
    if (left >= p.size() && buffer->compare(i, p.size(), p) == 0) {
      out += step.content;
      i += p.size();
    } else if (left < p.size() && p.compare(0, left, *buffer, i, left) == 0) {
      break;  // may become the pattern once more text arrives
    } else {
      out.push_back((*buffer)[i++]);
    }
  }
  buffer->erase(0, i);
  return out;
}

// Strip of one whole token: up to `start` leading and `stop` trailing strip characters.
std::string StripToken(const DecoderStep& step, const std::string& token) {
  const std::u32string cps = ToCodePoints(token);
  size_t begin = 0;
  while (begin < cps.size() && begin < static_cast<size_t>(step.strip_start) &&
         cps[begin] == step.strip_char) {
    ++begin;
  }
  size_t end = cps.size();
  for (int i = 0; i < step.strip_stop && end > 0 && cps[end - 1] == step.strip_char; ++i) --end;
  std::string out;
  for (size_t i = begin; i < end; ++i) AppendUtf8(cps[i], &out);
  return out;
}

// Strip of the one fused token, chunk by chunk: trailing strip characters wait for Flush.
std::string StripStreaming(const DecoderStep& step, StageState* st, const std::string& chunk) {
  std::string out;
  ForEachChar(chunk, [&](char32_t c, size_t offset, size_t len) {
    if (!st->leading_done) {
      if (st->tokens < step.strip_start && c == step.strip_char) {
        ++st->tokens;
        return;
      }
      st->leading_done = true;
    }
    if (step.strip_stop > 0 && c == step.strip_char) {
      if (st->held < step.strip_stop) {
        ++st->held;
      } else {
        AppendUtf8(c, &out);  // the oldest held one can no longer be trailing
      }
      return;
    }
    for (; st->held > 0; --st->held) AppendUtf8(step.strip_char, &out);
    out.append(chunk, offset, len);
  });
  return out;
}

// The bytes a byte-level token stands for; a token with a character outside the map (an
// added token like "<|x y|>") stands for its own UTF-8, as in the library.
std::string ByteLevelBytes(const std::string& token) {
  const ByteLevelMap& map = GetByteLevelMap();
  std::string bytes;
  bytes.reserve(token.size());
  bool mapped = true;
  ForEachChar(token, [&](char32_t c, size_t, size_t) {
    if (!mapped) return;
    if (c < map.char_to_byte.size() && map.char_to_byte[c] >= 0) {
      bytes.push_back(static_cast<char>(map.char_to_byte[c]));
    } else {
      mapped = false;
    }
  });
  return mapped ? bytes : token;
}

std::string ByteTokenBytes(const std::string& token) {
  unsigned char b;
  return ParseByteToken(token, &b) ? std::string(1, static_cast<char>(b)) : token;
}

}  // namespace

void DecoderRunner::Push(size_t stage, std::string piece) {
  if (stage == steps_.size()) {
    out_->append(piece);
    return;
  }
  const DecoderStep& step = steps_[stage];
  StageState& st = state_->stages[stage];
  const size_t next = stage + 1;
  switch (step.kind) {
    case DecoderStep::Kind::kReplace:
      if (!step.fused_input) {
        Push(next, ReplaceAll(piece, step.pattern, step.content));
      } else {
        st.buffer += piece;
        Push(next, ReplaceStreaming(step, &st.buffer));
      }
      break;
    case DecoderStep::Kind::kByteFallback:
      PushByteFallback(stage, step, &st, std::move(piece));
      break;
    case DecoderStep::Kind::kFuse:
      Push(next, std::move(piece));
      break;
    case DecoderStep::Kind::kStrip:
      if (!step.fused_input) {
        Push(next, StripToken(step, piece));
      } else {
        Push(next, StripStreaming(step, &st, piece));
      }
      break;
    case DecoderStep::Kind::kMetaspace: {
      const bool first = step.fused_input || st.tokens == 0;
      ++st.tokens;
      std::string text;
      text.reserve(piece.size());
      ForEachChar(piece, [&](char32_t c, size_t offset, size_t len) {
        if (c != step.replacement) {
          text.append(piece, offset, len);
        } else if (!(first && step.strip_first)) {
          text.push_back(' ');
        }
      });
      Push(next, std::move(text));
      break;
    }
    case DecoderStep::Kind::kByteLevel:
    case DecoderStep::Kind::kBytes:
      if (step.fused_input) {
        st.buffer += piece;  // one token: whether it maps is known only at its end
      } else {
        st.buffer +=
            step.kind == DecoderStep::Kind::kBytes ? ByteTokenBytes(piece) : ByteLevelBytes(piece);
        std::string text;
        st.buffer.erase(0, AppendLossy(st.buffer, /*final=*/false, &text));
        Push(next, std::move(text));
      }
      break;
    case DecoderStep::Kind::kJoin:
      // insert(0, 1, ' '), not insert(0, " "): GCC 12 gives a false -Wrestrict for that.
      if (st.tokens++ > 0) piece.insert(0, 1, ' ');
      Push(next, std::move(piece));
      break;
  }
}

void DecoderRunner::Flush() {
  for (size_t stage = 0; stage < steps_.size(); ++stage) {
    const DecoderStep& step = steps_[stage];
    StageState& st = state_->stages[stage];
    const size_t next = stage + 1;
    switch (step.kind) {
      case DecoderStep::Kind::kReplace:
        if (!st.buffer.empty()) Push(next, std::move(st.buffer));
        break;
      case DecoderStep::Kind::kByteFallback:
        if (!step.fused_input) {
          FinishByteRun(stage, &st);
        } else if (!st.passthrough) {
          unsigned char b;
          if (ParseByteToken(st.buffer, &b)) {
            Push(next, b < 0x80 ? std::string(1, static_cast<char>(b)) : kReplacementUtf8);
          } else if (!st.buffer.empty()) {
            Push(next, std::move(st.buffer));
          }
        }
        break;
      case DecoderStep::Kind::kByteLevel:
      case DecoderStep::Kind::kBytes: {
        std::string text;
        const std::string bytes = !step.fused_input ? st.buffer
                                  : step.kind == DecoderStep::Kind::kBytes
                                      ? ByteTokenBytes(st.buffer)
                                      : ByteLevelBytes(st.buffer);
        AppendLossy(bytes, /*final=*/true, &text);
        if (!text.empty()) Push(next, std::move(text));
        break;
      }
      default:
        break;  // Strip drops its held trailing characters; the others hold nothing
    }
    st = StageState();
  }
}

void DecoderRunner::PushByteFallback(size_t stage, const DecoderStep& step, StageState* st,
                                     std::string piece) {
  const size_t next = stage + 1;
  if (step.fused_input) {
    if (st->passthrough) {
      Push(next, std::move(piece));
      return;
    }
    st->buffer += piece;
    if (st->buffer.size() > 6) {  // longer than "<0xNN>": never a byte token
      st->passthrough = true;
      Push(next, std::move(st->buffer));
      st->buffer.clear();
    }
    return;
  }
  unsigned char b;
  if (!ParseByteToken(piece, &b)) {
    FinishByteRun(stage, st);
    Push(next, std::move(piece));
    return;
  }
  // The library turns a whole run of byte tokens into its text if the run is valid UTF-8,
  // else into one U+FFFD per byte. A valid run must wait for its end; an ill-formed one can
  // be released at once.
  if (st->invalid_run) {
    Push(next, kReplacementUtf8);
    return;
  }
  st->buffer.push_back(static_cast<char>(b));
  if (HasIllFormedUtf8(st->buffer, &st->checked)) {
    st->invalid_run = true;
    const size_t n = st->buffer.size();
    st->buffer.clear();
    for (size_t i = 0; i < n; ++i) Push(next, kReplacementUtf8);
  }
}

void DecoderRunner::FinishByteRun(size_t stage, StageState* st) {
  if (!st->buffer.empty()) {
    if (FirstInvalidUtf8(st->buffer) == std::string::npos) {
      Push(stage + 1, std::move(st->buffer));
    } else {
      const size_t n = st->buffer.size();
      for (size_t i = 0; i < n; ++i) Push(stage + 1, kReplacementUtf8);
    }
    st->buffer.clear();
  }
  st->invalid_run = false;
  st->checked = 0;
}

}  // namespace kvwire::tokenizer_internal
