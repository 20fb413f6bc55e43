#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target into fuzz/corpus/<target>/ (committed; rerun
to regenerate): small hand-made config.json and safetensors files, tokenizer.json files
taken from the test fixtures (tests/data/tokenizers, the small ones whole and the larger
ones cut to a few dozen tokens), texts and ids from the fixtures' oracle cases, and, given
--build-dir of a KVWIRE_FUZZ build, valid KV streams written by its kv_stream_seeds and
serialized requests written by its request_seeds.

  python3 fuzz/make_seeds.py [--build-dir build-fuzz]
"""
import argparse
import json
import os
import struct
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(REPO, "fuzz", "corpus")
FIXTURES = os.path.join(REPO, "tests", "data", "tokenizers")
# tokenizer_encode_fuzz's tokenizer order (bits 0-3 of its control byte).
ENCODE_TOKENIZERS = ["gpt2_bpe.json", "llama3_bpe.json", "qwen2_bpe.json", "sp_llama2.json",
                     "sp_metaspace.json", "stories260K"]


def write(target, name, data):
  d = os.path.join(CORPUS, target)
  os.makedirs(d, exist_ok=True)
  if isinstance(data, str):
    data = data.encode("utf-8")
  with open(os.path.join(d, name), "wb") as f:
    f.write(data)


def model_configs():
  llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8,
           "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
           "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "float32"}
  yield "llama", llama
  yield "llama3", dict(llama, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192},
                       eos_token_id=[2, 3], torch_dtype="bfloat16", head_dim=16,
                       attention_bias=False, mlp_bias=False, max_position_embeddings=131072)
  yield "linear_rope", dict(llama, rope_scaling={"type": "linear", "factor": 2.0},
                            tie_word_embeddings=False, torch_dtype="float16")
  yield "mistral", {"architectures": ["MistralForCausalLM"], "hidden_size": 32,
                    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 1, "vocab_size": 300, "sliding_window": 64,
                    "max_position_embeddings": 256, "rope_scaling": None}
  yield "qwen2", {"model_type": "qwen2", "hidden_size": 48, "intermediate_size": 96,
                  "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
                  "vocab_size": 1000, "use_sliding_window": False, "sliding_window": 32,
                  "rope_theta": 1000000.0, "attention_bias": True, "bos_token_id": None,
                  "eos_token_id": [7], "rope_scaling": {"type": "default"}}
  yield "bad_heads", dict(llama, num_key_value_heads=3)
  yield "bad_act", dict(llama, hidden_act="gelu")


def safetensors_file(tensors, metadata=None, pad=True):
  """tensors: [(name, dtype, shape, data bytes)]"""
  header, data = {}, b""
  if metadata is not None:
    header["__metadata__"] = metadata
  for name, dtype, shape, payload in tensors:
    header[name] = {"dtype": dtype, "shape": shape,
                    "data_offsets": [len(data), len(data) + len(payload)]}
    data += payload
  text = json.dumps(header, separators=(",", ":")).encode()
  if pad:
    text += b" " * ((8 - len(text) % 8) % 8)
  return struct.pack("<Q", len(text)) + text + data


def safetensors_seeds():
  f32 = struct.pack("<6f", 1, 2, 3, 4, 5, 6)
  yield "one_f32", safetensors_file([("w", "F32", [2, 3], f32)])
  yield "mixed", safetensors_file(
      [("model.embed_tokens.weight", "BF16", [4, 2], bytes(range(16))),
       ("model.norm.weight", "F16", [2], b"\x00\x3c\x00\x40"),
       ("ids", "I64", [1], struct.pack("<q", -5)),
       ("empty", "F32", [0, 4], b""),
       ("flag", "BOOL", [], b"\x01")],
      metadata={"format": "pt", "note": "seed"})
  yield "unpadded", safetensors_file([("x", "U8", [3], b"abc"), ("y", "I32", [1], b"\1\0\0\0")],
                                     pad=False)
  yield "metadata_only", safetensors_file([], metadata={"a": "b"})
  overlap = (b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
             b'"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}')
  yield "overlap", struct.pack("<Q", len(overlap)) + overlap + b"012345"
  yield "short", b"\x02\x00\x00\x00\x00\x00\x00\x00{}"


def shrink_tokenizer(j, keep):
  """The tokenizer with its vocabulary cut to the `keep` lowest ids (added tokens kept) and
  the merges among them: its pipeline whole, its tables small."""
  vocab = {t: i for t, i in j["model"]["vocab"].items() if i < keep}
  next_id = keep
  for a in j.get("added_tokens") or []:
    if a["id"] >= keep:  # renumbered past the cut vocabulary
      a["id"] = next_id
      next_id += 1
    if a["content"] in j["model"]["vocab"]:
      vocab[a["content"]] = a["id"]
  merges = []
  for m in j["model"].get("merges", []):
    a, b = m.split(" ", 1) if isinstance(m, str) else m
    if a in vocab and b in vocab and a + b in vocab:
      merges.append(m)
  j["model"]["vocab"] = vocab
  j["model"]["merges"] = merges
  return j


def tokenizer_load_seeds():
  for name in sorted(os.listdir(FIXTURES)):
    if not name.endswith(".json"):
      continue
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
      text = f.read()
    if len(text) <= 4096:
      yield name, text
    else:
      j = shrink_tokenizer(json.loads(text), 300 if "bpe" in name else 80)
      yield "small_" + name, json.dumps(j, ensure_ascii=False, separators=(",", ":"))
  # What the fixtures do not show: other post-processors, added-token flags, suffixes.
  j = json.load(open(os.path.join(FIXTURES, "tiny_unk.json"), encoding="utf-8"))
  j["added_tokens"] += [
      {"id": 16, "content": "<cls>", "single_word": False, "lstrip": True, "rstrip": True,
       "normalized": False, "special": True},
      {"id": 17, "content": "<sep>", "single_word": True, "lstrip": False, "rstrip": False,
       "normalized": True, "special": False}]
  j["post_processor"] = {"type": "BertProcessing", "sep": ["<sep>", 17], "cls": ["<cls>", 16]}
  yield "bert_processing.json", json.dumps(j, ensure_ascii=False)
  j["post_processor"] = {"type": "RobertaProcessing", "sep": ["<sep>", 17], "cls": ["<cls>", 16],
                         "trim_offsets": True, "add_prefix_space": False}
  j["model"]["continuing_subword_prefix"] = "##"
  j["model"]["end_of_word_suffix"] = "</w>"
  j["model"]["ignore_merges"] = True
  yield "roberta_processing.json", json.dumps(j, ensure_ascii=False)


def tokenizer_encode_seeds():
  per_tokenizer = {}
  with open(os.path.join(FIXTURES, "cases.jsonl"), encoding="utf-8") as f:
    for line in f:
      case = json.loads(line)
      name = case.get("tokenizer")
      if name not in ENCODE_TOKENIZERS:
        continue
      per_tokenizer.setdefault(name, []).append(case)
  n = 0
  for name, cases in sorted(per_tokenizer.items()):
    index = ENCODE_TOKENIZERS.index(name)
    texts = [c for c in cases if "text" in c and 0 < len(c["text"].encode()) <= 160]
    ids = [c for c in cases if "decode_ids" in c]
    for k, case in enumerate(texts[::6][:12]):
      control = index | (0x10 if k % 2 else 0) | (0x20 if k % 3 == 0 else 0)
      yield "text%03d" % n, bytes([control]) + case["text"].encode("utf-8")
      n += 1
    for case in ids[::5][:3]:
      payload = b"".join(struct.pack("<H", i) for i in case["decode_ids"][:64])
      yield "ids%03d" % n, bytes([index | 0x40]) + payload
      n += 1
  stories = ENCODE_TOKENIZERS.index("stories260K")
  for k, text in enumerate(["Once upon a time, there was a little girl named Lily.",
                            "She said, \"Hi!\"\n\nThe end. <s> </s>", "  ünïcödé\t€ 😀 日本"]):
    yield "stories%d" % k, bytes([stories | (0x10 * (k % 2))]) + text.encode("utf-8")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--build-dir",
                 help="a KVWIRE_FUZZ build with fuzz/kv_stream_seeds and fuzz/request_seeds")
  args = p.parse_args()
  for name, config in model_configs():
    write("model_config_fuzz", name + ".json", json.dumps(config, indent=1))
  write("model_config_fuzz", "not_an_object.json", "[1, 2]")
  for name, data in safetensors_seeds():
    write("safetensors_fuzz", name + ".safetensors", data)
  for name, data in tokenizer_load_seeds():
    write("tokenizer_load_fuzz", name, data)
  for name, data in tokenizer_encode_seeds():
    write("tokenizer_encode_fuzz", name, data)
  if args.build_dir:
    out = os.path.join(CORPUS, "kv_stream_fuzz")
    os.makedirs(out, exist_ok=True)
    subprocess.run([os.path.join(args.build_dir, "fuzz", "kv_stream_seeds"), out], check=True)
    subprocess.run([os.path.join(args.build_dir, "fuzz", "request_seeds"), CORPUS], check=True)


if __name__ == "__main__":
  main()
