#include "kernels/validate.h"

#include <concepts>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire::kernels {
namespace {

absl::Status Require(bool ok, absl::string_view op, absl::string_view what) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

// A message with values in it, formatted only on failure: the checks run on every call, and
// decode attention is called per cache head on a host backend.
template <std::invocable Message>
absl::Status Require(bool ok, absl::string_view op, const Message& what) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what()));
}

// A cache layout for `n_heads` heads of `len` tokens: one region big enough, or pages.
absl::Status ValidateKvLayout(const KvLayout& l, int n_heads, int len, int head_dim,
                              absl::string_view op, int item) {
  if (l.pages == nullptr) {
    return Require(l.head_stride >= int64_t{len} * head_dim, op, [&] {
      return absl::StrCat("item ", item, ": ", len, " tokens do not fit a head_stride of ",
                          l.head_stride, " elements");
    });
  }
  return Require(l.page_tokens > 0 && l.heads_per_page > 0 && l.n_heads >= n_heads &&
                     l.n_heads % l.heads_per_page == 0 &&
                     l.page_stride >= int64_t{l.heads_per_page} * l.page_tokens * head_dim,
                 op, [&] {
                   return absl::StrCat("item ", item,
                                       ": a paged layout needs page_tokens, heads_per_page > 0, "
                                       "n_heads a multiple of heads_per_page and a page_stride "
                                       "of at least heads_per_page · page_tokens · head_dim");
                 });
}

// The rows of `len` tokens per head: in the cache dtype at `l`, or a coded cache's (KvCoding).
absl::Status ValidateKvRows(const KvLayout& l, const KvCoding& c, int n_heads, int len,
                            int head_dim, DType dtype, absl::string_view op, int item) {
  if (c.format == KvFormat::kAuto) return ValidateKvLayout(l, n_heads, len, head_dim, op, item);
  RETURN_IF_ERROR(Require(c.coded() && CheckKvFormat(c.format, head_dim).ok(), op, [&] {
    return absl::StrCat("item ", item, ": a cache coded in ", KvFormatName(c.format),
                        " cannot hold heads of ", head_dim);
  }));
  const int coded = c.ResidBegin(len);
  const KvGroups groups{c.kept};
  RETURN_IF_ERROR(Require(
      c.kept >= 0 && c.kept <= len && c.k_params && (c.format != KvFormat::kFP8 || c.v_scales) &&
          (len == 0 || groups.Of(len - 1) < c.max_groups),
      op, [&] {
        return absl::StrCat("item ", item, ": a coded cache of ", len, " tokens keeping ", c.kept,
                            " needs its group parameters (", c.max_groups, " groups per head)");
      }));
  RETURN_IF_ERROR(
      Require(len == coded || (c.k_resid && c.v_resid && len - coded <= c.resid_tokens), op, [&] {
        return absl::StrCat("item ", item, ": ", len - coded,
                            " appended tokens do not fit a residual of ", c.resid_tokens);
      }));
  RETURN_IF_ERROR(ValidateKvLayout(
      l, n_heads, coded, static_cast<int>(KvKeyCodeBytes(c.format, dtype, head_dim)), op, item));
  return ValidateKvLayout(c.v_layout, n_heads, coded,
                          static_cast<int>(KvValueRowBytes(c.format, dtype, head_dim)), op, item);
}

}  // namespace

absl::Status ValidateMatMul(const MatMulParams& p) {
  RETURN_IF_ERROR(Require(p.x && p.w && p.y, "MatMul", "x, w and y must be set"));
  RETURN_IF_ERROR(Require(p.m > 0 && p.n > 0 && p.k > 0, "MatMul", [&] {
    return absl::StrCat("sizes must be positive, got m=", p.m, " n=", p.n, " k=", p.k);
  }));
  RETURN_IF_ERROR(Require(p.x_stride == 0 || p.x_stride >= p.k, "MatMul", "x_stride < k"));
  RETURN_IF_ERROR(Require(p.y_stride == 0 || p.y_stride >= p.n, "MatMul", "y_stride < n"));
  return absl::OkStatus();
}

absl::Status ValidateRmsNorm(const RmsNormParams& p) {
  RETURN_IF_ERROR(Require(p.x && p.weight && p.y, "RmsNorm", "x, weight and y must be set"));
  RETURN_IF_ERROR(Require(p.rows > 0 && p.dim > 0 && p.eps >= 0, "RmsNorm", [&] {
    return absl::StrCat("need rows, dim > 0 and eps >= 0, got rows=", p.rows, " dim=", p.dim,
                        " eps=", p.eps);
  }));
  if (p.residual == nullptr) return absl::OkStatus();
  // The fused add reads x and writes residual, then writes y: a shared row would be read
  // after it was written.
  const int64_t n = int64_t{p.rows} * p.dim;
  auto overlaps = [&](const float* a) { return a < p.residual + n && p.residual < a + n; };
  return Require(!overlaps(p.x) && !overlaps(p.y), "RmsNorm",
                 "residual must overlap neither x nor y");
}

absl::Status ValidateRope(const RopeParams& p) {
  RETURN_IF_ERROR(
      Require(p.x && p.positions && p.inv_freq, "Rope", "x, positions and inv_freq must be set"));
  RETURN_IF_ERROR(Require(p.head_dim > 0 && p.head_dim % 2 == 0, "Rope",
                          [&] { return absl::StrCat("head_dim must be even, got ", p.head_dim); }));
  return Require(p.rows > 0 && p.heads > 0 && p.row_stride >= int64_t{p.heads} * p.head_dim, "Rope",
                 "need rows, heads > 0 and row_stride >= heads * head_dim");
}

absl::Status ValidateSwiGlu(const SwiGluParams& p) {
  RETURN_IF_ERROR(Require(p.gate_up && p.out, "SwiGlu", "gate_up and out must be set"));
  return Require(p.rows > 0 && p.ffn > 0, "SwiGlu", "rows and ffn must be positive");
}

absl::Status ValidatePrefillAttention(const PrefillAttentionParams& p) {
  constexpr absl::string_view kOp = "PrefillAttention";
  RETURN_IF_ERROR(Require(p.q && p.k && p.v && p.out, kOp, "q, k, v and out must be set"));
  RETURN_IF_ERROR(Require(p.len > 0 && p.head_dim > 0 && p.n_kv_heads > 0 &&
                              p.n_heads >= p.n_kv_heads && p.n_heads % p.n_kv_heads == 0,
                          kOp, [&] {
                            return absl::StrCat(
                                "need len, head_dim > 0 and n_heads a multiple of "
                                "n_kv_heads, got len=",
                                p.len, " n_heads=", p.n_heads, " n_kv_heads=", p.n_kv_heads);
                          }));
  RETURN_IF_ERROR(Require(p.q_stride >= int64_t{p.n_heads} * p.head_dim &&
                              p.kv_stride >= int64_t{p.n_kv_heads} * p.head_dim &&
                              p.out_stride >= int64_t{p.n_heads} * p.head_dim,
                          kOp, "a row stride is smaller than its heads · head_dim"));
  RETURN_IF_ERROR(Require(p.q_begin >= 0 && p.q_begin < p.len, kOp, [&] {
    return absl::StrCat("q_begin must be in [0, len=", p.len, "), got ", p.q_begin);
  }));
  RETURN_IF_ERROR(Require(p.window >= 0 && p.window <= p.len - p.q_begin, kOp, [&] {
    return absl::StrCat("window must be in [0, len - q_begin = ", p.len - p.q_begin, "], got ",
                        p.window);
  }));
  RETURN_IF_ERROR(Require(p.precision == DType::kF32 || p.precision == DType::kBF16, kOp, [&] {
    return absl::StrCat("precision must be f32 or bf16, got ", DTypeName(p.precision));
  }));
  return Require(p.window == 0 || p.window_scores, kOp, "window > 0 needs window_scores");
}

absl::Status ValidateDecodeAttention(const DecodeAttentionParams& p) {
  constexpr absl::string_view kOp = "DecodeAttention";
  RETURN_IF_ERROR(Require(p.batch >= 0 && (p.batch == 0 || p.seqs), kOp, "seqs must be set"));
  RETURN_IF_ERROR(Require(p.head_dim > 0 && p.n_cache_heads > 0 && p.n_heads >= p.n_cache_heads &&
                              p.n_heads % p.n_cache_heads == 0,
                          kOp, [&] {
                            return absl::StrCat("n_heads must be a multiple of n_cache_heads, got ",
                                                p.n_heads, " and ", p.n_cache_heads);
                          }));
  for (int b = 0; b < p.batch; ++b) {
    const DecodeSequence& s = p.seqs[b];
    RETURN_IF_ERROR(Require(s.q && s.out && s.k && s.v, kOp, [&] {
      return absl::StrCat("sequence ", b, ": q, out, k and v must be set");
    }));
    RETURN_IF_ERROR(Require(s.len > 0, kOp, [&] {
      return absl::StrCat("sequence ", b, ": need len > 0, got ", s.len);
    }));
    RETURN_IF_ERROR(
        ValidateKvRows(s.layout, s.coding, p.n_cache_heads, s.len, p.head_dim, p.kv_dtype, kOp, b));
    if (s.indices) {
      RETURN_IF_ERROR(Require(s.num_indices > 0 && s.num_indices <= s.len, kOp, [&] {
        return absl::StrCat("sequence ", b, ": num_indices must be in [1, len=", s.len, "], got ",
                            s.num_indices);
      }));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateEmbedRows(const EmbedRowsParams& p) {
  constexpr absl::string_view kOp = "EmbedRows";
  RETURN_IF_ERROR(
      Require(p.n >= 0 && p.vocab > 0 && p.hidden > 0 && (p.n == 0 || (p.table && p.ids && p.out)),
              kOp, "table, ids and out must be set, vocab and hidden > 0, n >= 0"));
  for (int i = 0; i < p.n; ++i) {
    RETURN_IF_ERROR(Require(p.ids[i] >= 0 && p.ids[i] < p.vocab, kOp, [&] {
      return absl::StrCat("ids[", i, "] = ", p.ids[i], " is outside the vocabulary of ", p.vocab);
    }));
  }
  return absl::OkStatus();
}

absl::Status ValidateAppendKv(const AppendKvParams& p) {
  constexpr absl::string_view kOp = "AppendKv";
  RETURN_IF_ERROR(Require(p.batch >= 0 && (p.batch == 0 || p.seqs), kOp, "seqs must be set"));
  RETURN_IF_ERROR(Require(p.head_dim > 0 && p.n_kv_heads > 0 && p.n_cache_heads >= p.n_kv_heads &&
                              p.n_cache_heads % p.n_kv_heads == 0,
                          kOp, [&] {
                            return absl::StrCat(
                                "n_cache_heads must be a multiple of n_kv_heads, got ",
                                p.n_cache_heads, " and ", p.n_kv_heads);
                          }));
  for (int b = 0; b < p.batch; ++b) {
    const KvAppend& s = p.seqs[b];
    RETURN_IF_ERROR(Require(s.k && s.v && s.k_cache && s.v_cache, kOp, [&] {
      return absl::StrCat("sequence ", b, ": k, v, k_cache and v_cache must be set");
    }));
    RETURN_IF_ERROR(Require(s.t >= 0, kOp, [&] {
      return absl::StrCat("sequence ", b, ": token ", s.t, " is negative");
    }));
    RETURN_IF_ERROR(ValidateKvRows(s.layout, s.coding, p.n_cache_heads, s.t + 1, p.head_dim,
                                   p.kv_dtype, kOp, b));
    RETURN_IF_ERROR(Require(!s.coding.coded() || s.t >= s.coding.kept, kOp, [&] {
      return absl::StrCat("sequence ", b, ": token ", s.t, " is among the ", s.coding.kept,
                          " a coded cache holds from the wire");
    }));
    // The token's slot in the residual (a token that completes a group takes its last).
    RETURN_IF_ERROR(Require(
        !s.coding.coded() || (s.t - s.coding.ResidBegin(s.t) < s.coding.resid_tokens &&
                              s.coding.k_resid && s.coding.v_resid),
        kOp, [&] {
          return absl::StrCat("sequence ", b, ": token ", s.t, " does not fit a residual of ",
                              s.coding.resid_tokens, " tokens");
        }));
  }
  return absl::OkStatus();
}

absl::Status ValidateWindowVotes(const WindowVotesParams& p) {
  constexpr absl::string_view kOp = "WindowVotes";
  RETURN_IF_ERROR(Require(p.scores && p.votes, kOp, "scores and votes must be set"));
  RETURN_IF_ERROR(Require(p.n_heads > 0 && p.window > 0 && p.len > 0, kOp, [&] {
    return absl::StrCat("need n_heads, window, len > 0, got ", p.n_heads, ", ", p.window, ", ",
                        p.len);
  }));
  RETURN_IF_ERROR(Require(p.prefix > 0 && p.prefix <= p.len, kOp, [&] {
    return absl::StrCat("prefix must be in [1, len=", p.len, "], got ", p.prefix);
  }));
  return Require(p.group > 0 && p.n_heads % p.group == 0, kOp, [&] {
    return absl::StrCat("group must divide n_heads=", p.n_heads, ", got ", p.group);
  });
}

absl::Status ValidatePool1d(const Pool1dParams& p) {
  RETURN_IF_ERROR(Require(p.x && p.y && p.x != p.y, "Pool1d", "x and y must be set and distinct"));
  return Require(p.rows > 0 && p.n > 0 && p.kernel > 0 && p.kernel % 2 == 1, "Pool1d", [&] {
    return absl::StrCat("need rows, n > 0 and an odd kernel, got rows=", p.rows, " n=", p.n,
                        " kernel=", p.kernel);
  });
}

absl::Status ValidateRunMeans(const RunMeansParams& p) {
  RETURN_IF_ERROR(Require(p.x && p.y, "RunMeans", "x and y must be set"));
  return Require(p.rows > 0 && p.n > 0 && p.run > 0, "RunMeans", [&] {
    return absl::StrCat("need rows, n, run > 0, got rows=", p.rows, " n=", p.n, " run=", p.run);
  });
}

absl::Status ValidateTopK(const TopKParams& p) {
  constexpr absl::string_view kOp = "TopK";
  RETURN_IF_ERROR(Require(p.count >= 0 && (p.count == 0 || p.segs), kOp, "segs must be set"));
  for (int i = 0; i < p.count; ++i) {
    const TopKSegment& s = p.segs[i];
    RETURN_IF_ERROR(Require(s.score && s.out, kOp, [&] {
      return absl::StrCat("segment ", i, ": score and out must be set");
    }));
    RETURN_IF_ERROR(Require(s.n > 0 && s.run > 0 && s.k > 0 && s.k <= s.n, kOp, [&] {
      return absl::StrCat("segment ", i, ": need n, run > 0 and k in [1, n], got n=", s.n,
                          " run=", s.run, " k=", s.k);
    }));
    RETURN_IF_ERROR(Require(s.append >= 0, kOp, [&] {
      return absl::StrCat("segment ", i, ": append must be >= 0, got ", s.append);
    }));
    RETURN_IF_ERROR(Require(s.tie == nullptr || s.run == 1, kOp, [&] {
      return absl::StrCat("segment ", i, ": tie scores apply to runs of 1, got run=", s.run);
    }));
  }
  return absl::OkStatus();
}

absl::Status ValidateHbwSelect(const HbwSelectParams& p) {
  constexpr absl::string_view kOp = "HbwSelect";
  RETURN_IF_ERROR(Require(p.block_scores && p.out, kOp, "block_scores and out must be set"));
  RETURN_IF_ERROR(Require(p.rows > 0 && p.prefix > 0 && p.block > 0, kOp, [&] {
    return absl::StrCat("need rows, prefix, block > 0, got ", p.rows, ", ", p.prefix, ", ",
                        p.block);
  }));
  RETURN_IF_ERROR(Require(p.prefix_budget > 0 && p.prefix_budget <= p.prefix, kOp, [&] {
    return absl::StrCat("prefix_budget must be in [1, prefix=", p.prefix, "], got ",
                        p.prefix_budget);
  }));
  RETURN_IF_ERROR(Require(p.append >= 0, kOp, "append must be >= 0"));
  RETURN_IF_ERROR(Require(p.n_rounds > 0 && p.n_rounds <= kMaxHbwRounds, kOp, [&] {
    return absl::StrCat("need 1 to ", kMaxHbwRounds, " rounds, got ", p.n_rounds);
  }));
  for (int r = 0; r < p.n_rounds; ++r) {
    RETURN_IF_ERROR(Require(p.rounds[r] > 0, kOp, "every round needs a group count > 0"));
  }
  return absl::OkStatus();
}

absl::Status ValidateGatherKv(const GatherKvParams& p) {
  constexpr absl::string_view kOp = "GatherKv";
  RETURN_IF_ERROR(Require(p.k && p.v && p.kept && p.k_out && p.v_out, kOp,
                          "k, v, kept, k_out and v_out must be set"));
  RETURN_IF_ERROR(Require(p.len > 0 && p.count > 0 && p.count <= p.len && p.head_dim > 0, kOp, [&] {
    return absl::StrCat(
        "need len, head_dim > 0 and count in [1, len], "
        "got len=",
        p.len, " count=", p.count);
  }));
  RETURN_IF_ERROR(Require(
      p.n_kv_heads > 0 && p.n_cache_heads >= p.n_kv_heads && p.n_cache_heads % p.n_kv_heads == 0,
      kOp, "n_cache_heads must be a multiple of n_kv_heads"));
  return Require(p.kv_stride >= int64_t{p.n_kv_heads} * p.head_dim, kOp,
                 "kv_stride is smaller than n_kv_heads · head_dim");
}

namespace {

absl::Status ValidateLayout(const SummaryLayout& l, int head_dim, absl::string_view op, int i) {
  return Require(
      l.head_dim > 0 && l.head_dim == head_dim && l.page > 0 && l.tile_pages > 0 && l.max_pages > 0,
      op, [&] {
        return absl::StrCat("segment ", i,
                            ": the summary layout needs page, tile_pages, max_pages > "
                            "0 and head_dim ",
                            head_dim, ", got page=", l.page, " tile_pages=", l.tile_pages,
                            " max_pages=", l.max_pages, " head_dim=", l.head_dim);
      });
}

}  // namespace

absl::Status ValidateUpdateSummaries(const UpdateSummariesParams& p) {
  constexpr absl::string_view kOp = "UpdateSummaries";
  RETURN_IF_ERROR(Require(p.count >= 0 && (p.count == 0 || p.segs), kOp, "segs must be set"));
  for (int i = 0; i < p.count; ++i) {
    const SummaryUpdateSegment& s = p.segs[i];
    RETURN_IF_ERROR(Require(s.k && s.summaries && s.n_heads > 0, kOp, [&] {
      return absl::StrCat("segment ", i, ": k, summaries and n_heads must be set");
    }));
    RETURN_IF_ERROR(ValidateLayout(s.layout, s.layout.head_dim, kOp, i));
    RETURN_IF_ERROR(Require(
        s.first >= 0 && s.first <= s.len && s.layout.pages(s.len) <= s.layout.max_pages, kOp, [&] {
          return absl::StrCat("segment ", i, ": tokens [", s.first, ", ", s.len, ") do not fit ",
                              s.layout.max_pages, " pages of ", s.layout.page);
        }));
    RETURN_IF_ERROR(ValidateKvRows(s.kv, s.coding, s.n_heads, s.len, s.layout.head_dim,
                                   s.layout.dtype, kOp, i));
  }
  return absl::OkStatus();
}

absl::Status ValidatePageScores(const PageScoresParams& p) {
  constexpr absl::string_view kOp = "PageScores";
  RETURN_IF_ERROR(Require(p.count >= 0 && (p.count == 0 || p.segs), kOp, "segs must be set"));
  RETURN_IF_ERROR(Require(p.head_dim > 0, kOp, "head_dim must be positive"));
  for (int i = 0; i < p.count; ++i) {
    const PageScoreSegment& s = p.segs[i];
    RETURN_IF_ERROR(Require(s.q && s.score && s.group > 0 && s.len > 0, kOp, [&] {
      return absl::StrCat("segment ", i, ": q, score, group > 0 and len > 0 must be set");
    }));
    if (s.kind == PageScoreKind::kExact) {
      RETURN_IF_ERROR(Require(s.k != nullptr && s.head >= 0, kOp, [&] {
        return absl::StrCat("segment ", i, ": exact scores need k and a cache head");
      }));
      RETURN_IF_ERROR(
          ValidateKvRows(s.kv, s.coding, s.head + 1, s.len, p.head_dim, p.dtype, kOp, i));
      continue;
    }
    RETURN_IF_ERROR(Require(s.summaries != nullptr, kOp, [&] {
      return absl::StrCat("segment ", i, ": page scores need summaries");
    }));
    RETURN_IF_ERROR(ValidateLayout(s.layout, p.head_dim, kOp, i));
    RETURN_IF_ERROR(Require(s.layout.pages(s.len) <= s.layout.max_pages, kOp, [&] {
      return absl::StrCat("segment ", i, ": ", s.len, " tokens exceed ", s.layout.max_pages,
                          " pages of ", s.layout.page);
    }));
    RETURN_IF_ERROR(Require(
        s.kind != PageScoreKind::kHybrid || (s.top_r > 0 && s.top_r <= p.head_dim), kOp, [&] {
          return absl::StrCat("segment ", i, ": top_r must be in [1, ", p.head_dim, "], got ",
                              s.top_r);
        }));
  }
  return absl::OkStatus();
}

absl::Status ValidateSample(const SampleParams& p) {
  constexpr absl::string_view kOp = "Sample";
  RETURN_IF_ERROR(Require(p.batch >= 0 && (p.batch == 0 || (p.logits && p.rows && p.out)), kOp,
                          "logits, rows and out must be set"));
  RETURN_IF_ERROR(Require(p.vocab > 0 && (p.stride == 0 || p.stride >= p.vocab), kOp, [&] {
    return absl::StrCat("need vocab > 0 and stride 0 or >= vocab, got vocab=", p.vocab,
                        " stride=", p.stride);
  }));
  for (int b = 0; b < p.batch; ++b) {
    const SamplingParams& s = p.rows[b].params;
    RETURN_IF_ERROR(Require(s.temperature >= 0 && s.top_k >= 0 && s.top_p > 0 && s.top_p <= 1 &&
                                p.rows[b].uniform >= 0 && p.rows[b].uniform < 1,
                            kOp, [&] {
                              return absl::StrCat("row ", b,
                                                  ": need temperature >= 0, top_k >= 0, top_p "
                                                  "in (0, 1] and uniform in [0, 1)");
                            }));
  }
  return absl::OkStatus();
}

namespace {

// Each span of n: a size >= 0, and memory where it has bytes.
absl::Status ValidateSpans(absl::string_view op, const ByteSpan* spans, int n) {
  for (int i = 0; i < n; ++i) {
    RETURN_IF_ERROR(Require(spans[i].bytes >= 0 && (spans[i].bytes == 0 || spans[i].data), op, [&] {
      return absl::StrCat("span ", i, " has ", spans[i].bytes,
                          " bytes; need >= 0, and data where > 0");
    }));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateChecksumSpans(const ChecksumSpansParams& p) {
  constexpr absl::string_view kOp = "ChecksumSpans";
  RETURN_IF_ERROR(
      Require(p.n >= 0 && (p.n == 0 || (p.spans && p.out)), kOp, "n >= 0, and spans and out set"));
  return ValidateSpans(kOp, p.spans, p.n);
}

absl::Status ValidatePackSpans(const PackSpansParams& p) {
  constexpr absl::string_view kOp = "PackSpans";
  RETURN_IF_ERROR(Require(p.n >= 0 && (p.n == 0 || (p.spans && p.packed)), kOp,
                          "n >= 0, and spans and packed set"));
  return ValidateSpans(kOp, p.spans, p.n);
}

}  // namespace kvwire::kernels
