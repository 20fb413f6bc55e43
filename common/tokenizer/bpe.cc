// BpeModel::Tokenize (see bpe.h): a word is split into characters (or byte tokens, or <unk>),
// then the pair of lowest merge rank is merged first, leftmost on ties, until no pair merges,
// as models/bpe/word.rs merge_all does; a priority queue with lazily discarded stale entries
// keeps it O(n log n) in the word's length.
#include "common/tokenizer/bpe.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <queue>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/tokenizer/utf8.h"

namespace kvwire::tokenizer_internal {
namespace {

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  int32_t len;  // bytes; 0 once merged into its left neighbour
};

}  // namespace

void BpeModel::Tokenize(std::string_view word, std::vector<int32_t>* out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    auto it = vocab.find(word);
    if (it != vocab.end()) {
      out->push_back(it->second);
      return;
    }
  }
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add = [&symbols](int32_t id, size_t len) {
    const int32_t n = static_cast<int32_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back({id, n - 1, -1, static_cast<int32_t>(len)});
  };
  int32_t pending_unk_len = 0;  // a pending <unk> of this many bytes (fuse_unk grows it)
  const bool decorate = !continuing_subword_prefix.empty() || !end_of_word_suffix.empty();
  std::string decorated;
  ForEachChar(word, [&](char32_t, size_t offset, size_t len) {
    std::string_view s = word.substr(offset, len);
    if (decorate) {
      decorated.clear();
      if (offset > 0) decorated += continuing_subword_prefix;
      decorated.append(s);
      if (offset + len == word.size()) decorated += end_of_word_suffix;
      s = decorated;
    }
    auto it = vocab.find(s);
    if (it != vocab.end()) {
      if (pending_unk_len > 0) {
        add(unk_id, pending_unk_len);
        pending_unk_len = 0;
      }
      add(it->second, len);
      return;
    }
    if (byte_fallback) {
      bool all = true;
      for (unsigned char b : s) all = all && byte_ids[b] >= 0;
      if (all) {
        // Like the library, a pending <unk> is not flushed first (it lands after these).
        for (unsigned char b : s) add(byte_ids[b], 1);
        return;
      }
    }
    if (unk_id >= 0) {
      if (pending_unk_len > 0 && !fuse_unk) {
        add(unk_id, pending_unk_len);
        pending_unk_len = 0;
      }
      pending_unk_len += static_cast<int32_t>(len);
    }
    // Without an unk token the character is dropped, as in the library.
  });
  if (pending_unk_len > 0) add(unk_id, pending_unk_len);

  // Merge the pair of lowest rank first (leftmost on ties) until none is left. Queue entries
  // go stale when a neighbour changes; they are recognised by re-checking the pair.
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator<(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;  // std::priority_queue is a max-heap
    }
  };
  std::vector<Candidate> storage;
  storage.reserve(symbols.size());
  std::priority_queue<Candidate> queue(std::less<Candidate>(), std::move(storage));
  auto find_merge = [this](int32_t a, int32_t b) -> const MergeInfo* {
    auto it = merges.find(PairKey(a, b));
    return it == merges.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const MergeInfo* m = find_merge(symbols[i].id, symbols[i + 1].id)) {
      queue.push({m->rank, static_cast<int32_t>(i), m->new_id});
    }
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& cur = symbols[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const int32_t next_pos = cur.next;
    const Symbol right = symbols[next_pos];
    const MergeInfo* m = find_merge(cur.id, right.id);
    if (m == nullptr || m->new_id != top.new_id) continue;
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    symbols[next_pos].len = 0;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (cur.prev >= 0) {
      if (const MergeInfo* pm = find_merge(symbols[cur.prev].id, cur.id)) {
        queue.push({pm->rank, cur.prev, pm->new_id});
      }
    }
    if (cur.next >= 0) {
      if (const MergeInfo* nm = find_merge(cur.id, symbols[cur.next].id)) {
        queue.push({nm->rank, top.pos, nm->new_id});
      }
    }
  }
  for (const Symbol& s : symbols) {
    if (s.len != 0) out->push_back(s.id);
  }
}

}  // namespace kvwire::tokenizer_internal
