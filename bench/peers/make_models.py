#!/usr/bin/env python3
"""The peer benchmark's models, each written twice with the same bits: as a Hugging Face folder
for kvwire (config.json, model.safetensors, tokenizer.json) and as a GGUF file for llama.cpp.

  random_llama_1b   a Llama of the 1B class with random weights scaled like a trained model's
  stories           ../shared/models/stories260K-hf (f32) converted to GGUF, its tokenizer too

GGUF's `llama` architecture wants the rows of Q and K in the order llama.cpp's RoPE reads them:
Hugging Face's rotate-half layout pairs row i of a head with row i + d/2, llama.cpp pairs rows
2i and 2i+1, so within each head (n_heads for Q, n_kv_heads for K) the rows are interleaved
(as llama.cpp's convert_hf_to_gguf.py does). Nothing else changes: tensors are renamed, their
numpy [out, in] shape is GGUF's [in, out], and 1-D norms are stored as f32 in GGUF.

Needs numpy and the `gguf` package (bench/peers/run.sh installs both into build/peers/venv).
"""
import argparse
import json
import os
import struct

import numpy as np

# Tensor names: Hugging Face (per layer, after "model.layers.N.") -> GGUF ("blk.N.").
LAYER_TENSORS = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
]

# The 1B shape of the issue: Llama, 16 layers, hidden 2048, 32 query / 8 KV heads x 64,
# ffn 8192, vocab 32000, BF16, tied embeddings (as Llama 3.2 1B ties them).
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def to_bf16_bits(x):
  """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
  u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
  return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_bits_to_f32(b):
  return (b.astype(np.uint32) << 16).view(np.float32)


def interleave_rope_rows(w, n_heads):
  """Rows of each head from rotate-half order (i pairs with i + d/2) to llama.cpp's (2i, 2i+1).

  Row 2i of a head is row i of the Hugging Face head, row 2i+1 is row i + d/2."""
  rows = w.shape[0]
  d = rows // n_heads
  assert d * n_heads == rows and d % 2 == 0, (w.shape, n_heads)
  return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- safetensors, read and written without torch --------------------------------------------

ST_DTYPES = {"F32": (np.float32, 4), "BF16": (np.uint16, 2), "F16": (np.float16, 2)}


def read_safetensors(path):
  """{name: (dtype string, numpy array)}; BF16 comes back as its uint16 bits."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    base = 8 + n
  data = np.memmap(path, dtype=np.uint8, mode="r")
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    np_dtype, _ = ST_DTYPES[info["dtype"]]
    b, e = info["data_offsets"]
    out[name] = (info["dtype"], data[base + b:base + e].view(np_dtype).reshape(info["shape"]))
  return out


class SafetensorsWriter:
  """Writes tensors one at a time after a header that lists them all (in that order)."""

  def __init__(self, path, specs):
    """specs: [(name, dtype string, shape)]."""
    header, offset = {}, 0
    for name, dtype, shape in specs:
      nbytes = int(np.prod(shape)) * ST_DTYPES[dtype][1]
      header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
      offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # tensors start 8-byte aligned
    self.f = open(path, "wb")
    self.f.write(struct.pack("<Q", len(text)) + text)
    self.expected = [(name, shape) for name, _, shape in specs]

  def write(self, name, array):
    want_name, want_shape = self.expected.pop(0)
    assert (name, tuple(want_shape)) == (want_name, array.shape), (name, array.shape)
    np.ascontiguousarray(array).tofile(self.f)

  def close(self):
    assert not self.expected, self.expected
    self.f.close()


# --- GGUF ------------------------------------------------------------------------------------


class GgufModelWriter:
  """A llama-architecture GGUF written tensor by tensor (the header is written first)."""

  def __init__(self, path, config, name, tokens, scores, types, specs):
    """specs: [(gguf name, "BF16" or "F32", numpy shape)]."""
    import gguf  # pylint: disable=import-outside-toplevel
    self.gguf = gguf
    c = config
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    all_bf16 = all(dt == "BF16" for _, dt, shape in specs if len(shape) == 2)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if all_bf16 else gguf.LlamaFileType.ALL_F32)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-5)))
    w.add_vocab_size(c["vocab_size"])
    w.add_tokenizer_model("llama")  # SentencePiece-style, byte fallback
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(c.get("bos_token_id", 1))
    w.add_eos_token_id(c.get("eos_token_id", 2))
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    for gname, dtype, shape in specs:
      if dtype == "BF16":
        w.add_tensor_info(gname, shape, np.dtype(np.uint16), int(np.prod(shape)) * 2,
                          raw_dtype=gguf.GGMLQuantizationType.BF16)
      else:
        w.add_tensor_info(gname, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    self.w = w

  def write(self, array):
    self.w.write_tensor_data(np.ascontiguousarray(array))

  def close(self):
    self.w.close()


def tensor_plan(config):
  """[(hf name, gguf name, shape, kind)] in file order; kind is "embed", "norm", "q", "k",
  "o_down" (residual-stream outputs), or "linear"."""
  c = config
  h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
  d = c.get("head_dim", h // c["num_attention_heads"])
  q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
  shapes = {
      "input_layernorm.weight": ((h,), "norm"),
      "self_attn.q_proj.weight": ((q, h), "q"),
      "self_attn.k_proj.weight": ((kv, h), "k"),
      "self_attn.v_proj.weight": ((kv, h), "linear"),
      "self_attn.o_proj.weight": ((h, q), "o_down"),
      "post_attention_layernorm.weight": ((h,), "norm"),
      "mlp.gate_proj.weight": ((f, h), "linear"),
      "mlp.up_proj.weight": ((f, h), "linear"),
      "mlp.down_proj.weight": ((h, f), "o_down"),
  }
  plan = [("model.embed_tokens.weight", "token_embd.weight", (v, h), "embed")]
  for i in range(c["num_hidden_layers"]):
    for hf, gg in LAYER_TENSORS:
      shape, kind = shapes[hf]
      plan.append((f"model.layers.{i}.{hf}", f"blk.{i}.{gg}", shape, kind))
  plan.append(("model.norm.weight", "output_norm.weight", (h,), "norm"))
  if not c.get("tie_word_embeddings", False):
    plan.append(("lm_head.weight", "output.weight", (v, h), "linear"))
  return plan


def to_gguf_layout(array, kind, config):
  if kind == "q":
    return interleave_rope_rows(array, config["num_attention_heads"])
  if kind == "k":
    return interleave_rope_rows(array, config["num_key_value_heads"])
  return array


# --- tokenizers ------------------------------------------------------------------------------


def synthetic_vocab(vocab_size, seed):
  """A SentencePiece-style byte-fallback BPE vocabulary of `vocab_size` tokens, Llama 2's
  layout: <unk>, <s>, </s>, the 256 byte tokens, single characters, then pieces made by
  merging two earlier tokens (random pairs, fixed seed). Returns (tokens, merges)."""
  rng = np.random.default_rng(seed)
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
  chars = ["\u2581"] + [chr(c) for c in range(33, 127)]
  tokens += chars
  pieces = list(chars)  # what merges may combine
  seen = set(tokens)
  merges = []
  while len(tokens) < vocab_size:
    a = pieces[int(rng.integers(len(pieces)))]
    b = pieces[int(rng.integers(len(pieces)))]
    if a + b in seen or len(a + b) > 16:
      continue
    seen.add(a + b)
    tokens.append(a + b)
    pieces.append(a + b)
    merges.append(f"{a} {b}")
  return tokens, merges


def spm_tokenizer_json(tokens, merges):
  """tokenizer.json (Hugging Face `tokenizers`) for an SPM-style BPE vocabulary: BOS added,
  spaces as U+2581, byte fallback; the layout of Llama 2's and stories260K's."""
  specials = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
               "rstrip": False, "normalized": False, "special": True} for i in range(3)]
  return {
      "version": "1.0",
      "truncation": None,
      "padding": None,
      "added_tokens": specials,
      "normalizer": {"type": "Sequence", "normalizers": [
          {"type": "Prepend", "prepend": "\u2581"},
          {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
      "pre_tokenizer": None,
      "post_processor": {
          "type": "TemplateProcessing",
          "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}}],
          "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "<s>", "type_id": 1}},
                   {"Sequence": {"id": "B", "type_id": 1}}],
          "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
      "decoder": {"type": "Sequence", "decoders": [
          {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
          {"type": "ByteFallback"}, {"type": "Fuse"},
          {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
      "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                "continuing_subword_prefix": None, "end_of_word_suffix": None,
                "fuse_unk": True, "byte_fallback": True,
                "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
  }


def gguf_vocab(tokens, merges, special_names):
  """GGUF's token list, scores and types for an SPM-style vocabulary. Specials (ids 0-2) are
  named as Llama's; a piece made by merge r scores -r (earlier merges first, as SentencePiece
  orders them), single characters and bytes score 0 (neither engine tokenizes here)."""
  rank = {m.replace(" ", ""): r for r, m in enumerate(merges)}
  out_tokens, scores, types = [], [], []
  for i, t in enumerate(tokens):
    if i < 3:
      out_tokens.append(special_names[i])
      scores.append(0.0)
      types.append(UNKNOWN if i == 0 else CONTROL)
    elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
      out_tokens.append(t)
      scores.append(0.0)
      types.append(BYTE)
    else:
      out_tokens.append(t)
      scores.append(-float(rank.get(t, -1) + 1))
      types.append(NORMAL)
  return out_tokens, scores, types


# --- the models ------------------------------------------------------------------------------


def random_weights(kind, shape, rng, config):
  """Scaled like a trained Llama's: normal with std 0.02; the projections that write into the
  residual stream (o_proj, down_proj) divided by sqrt(2 * layers) as GPT-2 initialises them;
  RMSNorm weights near 1. Rounded to bf16."""
  if kind == "norm":
    x = 1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)
  else:
    std = 0.02
    if kind == "o_down":
      std /= np.sqrt(2.0 * config["num_hidden_layers"])
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
  return to_bf16_bits(x)


def make_random_llama(out_dir, gguf_path, seed=1234, config=None):
  """The random 1B model: out_dir (Hugging Face folder, bf16) and gguf_path (the same bits)."""
  c = dict(config or LLAMA_1B)
  os.makedirs(out_dir, exist_ok=True)
  tokens, merges = synthetic_vocab(c["vocab_size"], seed)
  with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(c, f, indent=2)
  with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
    json.dump(spm_tokenizer_json(tokens, merges), f, ensure_ascii=False)
  plan = tensor_plan(c)
  st = SafetensorsWriter(os.path.join(out_dir, "model.safetensors"),
                         [(hf, "BF16", shape) for hf, _, shape, _ in plan])
  g_tokens, scores, types = gguf_vocab(tokens, merges, ["<unk>", "<s>", "</s>"])
  gw = GgufModelWriter(gguf_path, c, "random-llama-1b", g_tokens, scores, types,
                       [(gg, "F32" if kind == "norm" else "BF16", shape)
                        for _, gg, shape, kind in plan])
  for index, (hf, _, shape, kind) in enumerate(plan):
    rng = np.random.default_rng([seed, index])
    bits = random_weights(kind, shape, rng, c)
    st.write(hf, bits)
    if kind == "norm":
      gw.write(bf16_bits_to_f32(bits))  # the same values, as f32
    else:
      gw.write(to_gguf_layout(bits, kind, c))
  st.close()
  gw.close()


def convert_hf_folder(hf_dir, gguf_path, name, interleave=True):
  """A Hugging Face Llama folder (F32 or BF16 safetensors, SPM-style tokenizer.json) to GGUF.
  interleave=False skips the Q/K row order that llama.cpp needs: a deliberately wrong file, for
  checking that the greedy comparison notices a layout error."""
  with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
    c = json.load(f)
  with open(os.path.join(hf_dir, "tokenizer.json"), encoding="utf-8") as f:
    tok = json.load(f)
  by_id = {i: t for t, i in tok["model"]["vocab"].items()}
  tokens = [by_id.get(i, f"<unused{i}>") for i in range(c["vocab_size"])]
  specials = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
  merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
  g_tokens, scores, types = gguf_vocab(
      tokens, merges, [specials.get(i, ["<unk>", "<s>", "</s>"][i]) for i in range(3)])
  weights = read_safetensors(os.path.join(hf_dir, "model.safetensors"))
  plan = tensor_plan(c)
  specs = []
  for hf, gg, shape, _ in plan:
    dtype, array = weights[hf]
    assert tuple(array.shape) == shape, (hf, array.shape, shape)
    specs.append((gg, "F32" if len(shape) == 1 or dtype == "F32" else dtype, shape))
  gw = GgufModelWriter(gguf_path, c, name, g_tokens, scores, types, specs)
  for hf, _, _, kind in plan:
    dtype, array = weights[hf]
    if len(array.shape) == 1 and dtype == "BF16":
      array = bf16_bits_to_f32(array)
    gw.write(to_gguf_layout(np.asarray(array), kind, c) if interleave else np.asarray(array))
  gw.close()


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="what", required=True)
  r = sub.add_parser("random", help="the random 1B model")
  r.add_argument("--out", required=True, help="Hugging Face folder to write")
  r.add_argument("--gguf", required=True)
  r.add_argument("--seed", type=int, default=1234)
  h = sub.add_parser("convert", help="a Hugging Face Llama folder to GGUF")
  h.add_argument("--model", required=True)
  h.add_argument("--gguf", required=True)
  a = p.parse_args()
  if a.what == "random":
    make_random_llama(a.out, a.gguf, a.seed)
  else:
    convert_hf_folder(a.model, a.gguf, os.path.basename(os.path.normpath(a.model)))


if __name__ == "__main__":
  main()
