#!/usr/bin/env python3
"""Builds the tokenizer fixtures for tests/common/tokenizer_test.cc.

The PyPI `tokenizers` package (Hugging Face's Rust implementation) is the independent oracle:
this script trains small tokenizers with it in the styles kvwire must read (Llama 3, Qwen2 and
GPT-2 byte-level BPE, SentencePiece-style BPE with byte fallback), hand-builds a few tiny ones
that exercise rarer options, and records in cases.jsonl what the oracle's encode() and decode()
return for a list of awkward strings and id sequences.

Usage:  pip install tokenizers && python3 make_fixtures.py [--out DIR]
Everything is deterministic: a fixed seed, and the corpus is generated here, not downloaded.
"""

import argparse
import json
import os
import random

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# ---------------------------------------------------------------------------------------------
# Corpus: English-like sentences with punctuation, contractions, numbers, odd whitespace, and
# words from other scripts, so that merges exist for all of them.

WORDS = ("the a an little girl boy dog cat fox tree house park ball sun day night big small red "
         "blue happy sad run jump play see look find give take want like love went said was "
         "were is are had has have friend mom dad water sky bird fish cake toy box door road "
         "window garden river mountain secret number answer question tokenizer model").split()
CONTRACTIONS = ["don't", "can't", "I'm", "it's", "we'll", "they've", "she'd", "you're", "DON'T",
                "I'M", "He's", "WE'LL", "isn't", "won't"]
FOREIGN = ["café", "naïve", "résumé", "über", "señor", "Ångström", "façade", "crème", "brûlée",
           "αβγ", "καλημέρα", "λόγος", "Ωμέγα", "Привет", "мир", "спасибо", "Москва", "你好",
           "世界", "中文", "日本語", "テキスト", "한국어", "안녕하세요", "😀", "🎉", "👍", "🚀",
           "❤️", "€", "£", "¥", "©", "—", "…", "«", "»", "“", "”"]
PUNCT = [",", ".", "!", "?", ";", ":", "...", "!!", "?!", " -", " (", ")", "\"", "'"]


def make_corpus(seed=20240601, lines=3000):
  rng = random.Random(seed)
  out = []
  for _ in range(lines):
    parts = []
    for _ in range(rng.randint(3, 18)):
      r = rng.random()
      if r < 0.55:
        w = rng.choice(WORDS)
        if rng.random() < 0.15:
          w = w.capitalize()
        if rng.random() < 0.03:
          w = w.upper()
      elif r < 0.65:
        w = rng.choice(CONTRACTIONS)
      elif r < 0.78:
        w = str(rng.randint(0, 10**rng.randint(1, 9)))
      elif r < 0.92:
        w = rng.choice(FOREIGN)
      else:
        w = rng.choice(PUNCT)
      parts.append(w)
      if rng.random() < 0.2:
        parts.append(rng.choice(PUNCT))
    sep = rng.choice([" "] * 12 + ["  ", "\t", "   "])
    line = sep.join(parts)
    if rng.random() < 0.2:
      line += rng.choice(["\n", "\n\n", "\r\n", " \n", "\t\n"])
    if rng.random() < 0.1:
      line = "    " + line
    out.append(line)
  return out


# ---------------------------------------------------------------------------------------------
# Trained tokenizers.

def train_byte_level(corpus, pre_tok, vocab_size, special, ignore_merges=False):
  tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
  tok.pre_tokenizer = pre_tok
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(corpus, trainer)
  tok.decoder = decoders.ByteLevel()
  return tok


def llama3_style(corpus):
  special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eot_id|>"]
  tok = train_byte_level(
      corpus,
      pre_tokenizers.Sequence([
          pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
          pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
      ]), 1000, special, ignore_merges=True)
  bos = tok.token_to_id("<|begin_of_text|>")
  tok.post_processor = processors.Sequence([
      processors.ByteLevel(trim_offsets=False),
      processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                    pair="<|begin_of_text|> $A:0 <|begin_of_text|> $B:1",
                                    special_tokens=[("<|begin_of_text|>", bos)]),
  ])
  return tok


def qwen2_style(corpus):
  tok = train_byte_level(
      corpus,
      pre_tokenizers.Sequence([
          pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
          pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
      ]), 900, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  tok.normalizer = normalizers.NFC()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  return tok


def gpt2_style(corpus):
  tok = train_byte_level(corpus, pre_tokenizers.ByteLevel(add_prefix_space=False), 800,
                         ["<|endoftext|>"])
  tok.post_processor = processors.ByteLevel(trim_offsets=True)
  # Added tokens with the rarer options, so their matching rules are checked too.
  tok.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=False, special=True)])
  tok.add_tokens([
      AddedToken("[sep]", rstrip=True, normalized=False, special=False),
      AddedToken("yo", single_word=True, normalized=False, special=False),
      AddedToken("hello world", normalized=True, special=False),
  ])
  return tok


def sentencepiece_style(corpus, vocab_size=900, limit_alphabet=90):
  """Llama-2-like BPE: byte-fallback tokens <0x00>..<0xFF> at ids 3..258, merges within words."""
  trainer_tok = Tokenizer(models.BPE())
  trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always",
                                                      split=True)
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - 259, limit_alphabet=limit_alphabet,
                                show_progress=False)
  trainer_tok.train_from_iterator(corpus, trainer)
  trained = json.loads(trainer_tok.to_str())["model"]
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
  for b in range(256):
    vocab["<0x%02X>" % b] = 3 + b
  for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
    vocab.setdefault(token, len(vocab))
  merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                             byte_fallback=True))
  tok.add_special_tokens(["<unk>", "<s>", "</s>"])
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)])
  return tok


def sp_llama2(corpus):
  tok = sentencepiece_style(corpus)
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                         normalizers.Replace(" ", "▁")])
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  return tok


def sp_metaspace(corpus):
  """The newer conversion: a Metaspace pre-tokenizer with prepend_scheme "first"."""
  tok = sentencepiece_style(corpus, vocab_size=700, limit_alphabet=70)
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                               split=True)
  tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                   decoders.Metaspace(replacement="▁", prepend_scheme="first")])
  return tok


# ---------------------------------------------------------------------------------------------
# Tiny hand-built tokenizers for the rarer options; their vocabularies are a few characters.

def tiny_vocab(chars, extra=()):
  vocab = {}
  for t in list(chars) + list(extra):
    vocab.setdefault(t, len(vocab))
  return vocab


def tiny_unk():
  """No byte fallback: unknown characters become <unk>, fused (fuse_unk) or not."""
  out = {}
  for fuse in (True, False):
    vocab = tiny_vocab(["<unk>"] + list("abcdefgh ▁"), ["ab", "abc", "cd", "▁a"])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "c"), ("c", "d"),
                                                    ("▁", "a")],
                               unk_token="<unk>", fuse_unk=fuse))
    tok.normalizer = normalizers.Sequence([normalizers.Strip(left=True, right=True),
                                           normalizers.Replace(" ", "▁")])
    tok.add_special_tokens(["<unk>"])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # stop > 0 panics in the oracle on ""
    out["tiny_unk_fused.json" if fuse else "tiny_unk.json"] = tok
  return out


def tiny_metaspace_variants():
  out = {}
  vocab = tiny_vocab(["<unk>", "<s>", "</s>"] + list("▁abcdehlorw,!"),
                     ["▁h", "he", "ll", "llo", "▁w", "or", "▁he", "▁hello"])
  merges = [("▁", "h"), ("h", "e"), ("l", "l"), ("ll", "o"), ("▁", "w"), ("o", "r"),
            ("▁", "he"), ("▁he", "llo")]
  for scheme, split in (("always", True), ("never", False), ("first", False)):
    tok = Tokenizer(models.BPE(vocab=dict(vocab), merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme,
                                                 split=split)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme, split=split)
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    out["tiny_metaspace_%s.json" % scheme] = tok
  return out


def tiny_split_variants():
  """Split on a plain string with every behaviour; a BPE with a continuing-subword prefix."""
  out = {}
  vocab = tiny_vocab(["[UNK]"] + list("abcdehlorw-, ") + ["##" + c for c in "abcdehlorw-,"])
  for behavior in ("removed", "isolated", "merged_with_previous", "merged_with_next",
                   "contiguous"):
    for invert in (False, True):
      if invert and behavior != "removed" and behavior != "isolated":
        continue
      tok = Tokenizer(models.BPE(vocab=dict(vocab), merges=[], unk_token="[UNK]",
                                 continuing_subword_prefix="##"))
      tok.pre_tokenizer = pre_tokenizers.Split("-", behavior=behavior, invert=invert)
      tok.normalizer = normalizers.NFD()
      out["tiny_split_%s%s.json" % (behavior, "_inv" if invert else "")] = tok
  return out


def tiny_byte_level_prefix():
  """ByteLevel with add_prefix_space, alone (GPT-2 regex) and after a Split (each piece)."""
  out = {}
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  vocab = tiny_vocab(sorted(alphabet), ["Ġh", "Ġhe", "ll", "llo", "Ġhello", "Ġw", "or"])
  merges = [("Ġ", "h"), ("Ġh", "e"), ("l", "l"), ("ll", "o"), ("Ġhe", "llo"), ("Ġ", "w"),
            ("o", "r")]
  for name, pre in (
      ("tiny_bytelevel_prefix.json", pre_tokenizers.ByteLevel(add_prefix_space=True)),
      ("tiny_split_bytelevel_prefix.json", pre_tokenizers.Sequence([
          pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
          pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)]))):
    tok = Tokenizer(models.BPE(vocab=dict(vocab), merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>"])
    out[name] = tok
  return out


# ---------------------------------------------------------------------------------------------
# Test inputs.

TEXTS = [
    "", " ", "   ", "\n", "\n\n\n", "\t", " \t \n ", "\r\n", "hello", " hello", "hello ",
    "  hello  world  ", "Hello, world!", "1234567", "12 345 6789 0", "3.14159", "x = 1000000;",
    "don't", "I'M", "DON'T stop", "we'll they've she'd it's you're", "'s 'S 'ſ 'll", "'",
    "x'ſt 'Ste 'LLama",
    "café", "naïve résumé", "cafe\u0301 e\u0301\u0323", "Ω ω Ωμέγα", "Привет, мир!",
    "你好，世界", "日本語のテキスト", "한국어", "\u1100\u1161\u11a8", "😀", "👍🏽", "👨‍👩‍👧",
    "🇫🇷", "€100 £5 ¥7", "a\u00a0b", "x\u3000y", "line1\r\nline2", "a  b   c",
    "tabs\t\tand\tspaces", "trailing\n", "    \n    \n", " \n", "\n ", "x\n\n y",
    "<|begin_of_text|>hi", "hi<|end_of_text|>", "<|begin_of_text|><|begin_of_text|>",
    "<s>hello</s>", " <s> x", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>",
    "a <mask> b", "yo-yo yoyo yo", "a[sep]  b", "hello world", "hello worlds",
    "!!!???...", "(parenthesis) [brackets] {braces}", "email@example.com",
    "https://example.com/path?q=1&r=2", "\u2581already \u2581\u2581", "\x00\x01\x7f", "\u0085",
    "mixed 123abc ABC123 αβγ123", "hello-world--x", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "The secret number is 65081. Once upon a time, there was a little girl named Lily.\n"
    "She said, \"I'm happy!\"\tThey've 42 friends and 1234 toys.",
]


# The tiny tokenizers know a few letters only: a subset of the inputs is enough for them.
TINY_TEXTS = [
    "", " ", "   ", "\n", "hello", " hello", "hello ", "  hello  world  ", "hello, world!",
    "hello-world--x", "-hello-", "--", "a-b c-d", "abcd abc ab", "cafe\u0301 é", "xyz q",
    "a\tb\nc", "<s>hello</s>", " <s> world", "hello<unk>world", "\u2581hello \u2581", "😀 hi",
    "he said: hello!", "aaaa", "ab\u00a0cd", "hello\n\nworld", "x'ſt 'S", "   ¡hola 123",
]


def decode_only_ids(tok, rng, n=6):
  """Random id sequences, so that decoding of stray bytes and specials is checked too."""
  size = tok.get_vocab_size(with_added_tokens=True)
  return [[rng.randrange(size) for _ in range(rng.randint(1, 12))] for _ in range(n)]


def with_variants(tok, case, ids, ids_plain):
  if ids_plain != ids:
    case["ids_plain"] = ids_plain
  case["decoded"] = tok.decode(ids, skip_special_tokens=True)
  decoded_special = tok.decode(ids, skip_special_tokens=False)
  if decoded_special != case["decoded"]:
    case["decoded_special"] = decoded_special
  return case


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
  parser.add_argument("--cases-only", action="store_true",
                      help="only recompute cases.jsonl (into --out) from the committed "
                           "tokenizer files with the installed library: the live oracle check")
  args = parser.parse_args()
  if args.cases_only:
    here = os.path.dirname(os.path.abspath(__file__))
    toks = {name: Tokenizer.from_file(os.path.join(here, name))
            for name in sorted(os.listdir(here)) if name.endswith(".json")}
    write_cases(toks, here, args.out)
    return
  corpus = make_corpus()
  toks = {
      "llama3_bpe.json": llama3_style(corpus),
      "qwen2_bpe.json": qwen2_style(corpus),
      "gpt2_bpe.json": gpt2_style(corpus),
      "sp_llama2.json": sp_llama2(corpus),
      "sp_metaspace.json": sp_metaspace(corpus),
  }
  toks.update(tiny_unk())
  toks.update(tiny_metaspace_variants())
  toks.update(tiny_split_variants())
  toks.update(tiny_byte_level_prefix())

  for name in sorted(toks):
    with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
      f.write(toks[name].to_str(pretty=False))
      f.write("\n")
  write_cases(toks, args.out, args.out)


def write_cases(toks, tokenizer_dir, out_dir):
  rng = random.Random(7)
  lines = []
  for name in sorted(toks):
    # Reload from the file, so the cases describe exactly what was written.
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, name))
    # To keep the file small, "ids_plain" (add_special_tokens=False) and "decoded_special"
    # (skip_special_tokens=False) are written only where they differ from "ids" and "decoded".
    for text in TINY_TEXTS if name.startswith("tiny_") else TEXTS:
      ids = tok.encode(text, add_special_tokens=True).ids
      case = {"tokenizer": name, "text": text, "ids": ids}
      lines.append(with_variants(tok, case, ids, tok.encode(text, add_special_tokens=False).ids))
    for ids in decode_only_ids(tok, rng):
      lines.append(with_variants(tok, {"tokenizer": name, "decode_ids": ids}, ids, ids))
  with open(os.path.join(out_dir, "cases.jsonl"), "w", encoding="utf-8") as f:
    f.write(json.dumps({"oracle": "tokenizers " + tokenizers.__version__}) + "\n")
    for case in lines:
      f.write(json.dumps(case, ensure_ascii=False, separators=(",", ":")) + "\n")
  print("wrote %d cases for %d tokenizers to %s" % (len(lines), len(toks), out_dir))


if __name__ == "__main__":
  main()
