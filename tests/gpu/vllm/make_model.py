#!/usr/bin/env python3
"""Writes a local HF model directory without any hub access: config.json shaped like OPT-125M or
Qwen3-8B (or `tiny`, an OPT-shaped toy for GPU-free dry runs), a tokenizer trained here with the
`tokenizers` library, and seeded random weights as safetensors (tensor names = HF checkpoint
names, the same manifest as tests/gpu/gpu_fixtures.h). Two seeds give two checkpoints with an
identical manifest.
  make_model.py --shape opt125m --out DIR [--seed 1] [--weights-file PATH] [--no-weights]
                [--tokenizer-from DIR]
  make_model.py --shape S --out BAD_DIR --corrupt-from GOOD_DIR --corrupt-mode half|link
A corrupt directory is a checkpoint whose loading fails midway on vLLM: two shards that vLLM
reads in sorted order, model-00001-of-00002 (`half`: the first half of GOOD_DIR's tensors, cut
at a layer boundary; `link`: a symlink to GOOD_DIR's whole file, nothing rewritten) and
model-00002-of-00002 holding one tensor under a name the model does not have (vLLM's
AutoWeightsLoader raises "There is no module or parameter named ..." once shard 1 is loaded).
"""
import argparse, json, os, re, shutil

OPT = dict(architectures=["OPTForCausalLM"], model_type="opt", hidden_size=768, ffn_dim=3072,
           num_hidden_layers=12, num_attention_heads=12, vocab_size=50272, max_position_embeddings=2048,
           word_embed_proj_dim=768, do_layer_norm_before=True, activation_function="relu",
           enable_bias=True, layer_norm_elementwise_affine=True, dropout=0.0, attention_dropout=0.0,
           bos_token_id=0, eos_token_id=2, pad_token_id=1, tie_word_embeddings=True,
           torch_dtype="bfloat16", dtype="bfloat16")
TINY = dict(OPT, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=2048, word_embed_proj_dim=64)
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
             intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
             rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", attention_bias=False,
             attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
             torch_dtype="bfloat16", dtype="bfloat16", use_sliding_window=False)


CONFIGS = {"opt125m": OPT, "tiny": TINY, "qwen3-8b": QWEN3}
# A name neither model has: the last shard of a corrupt directory holds one tensor under it.
BOGUS = {"opt125m": "model.decoder.rc_not_a_parameter.weight", "tiny": "model.decoder.rc_not_a_parameter.weight",
         "qwen3-8b": "model.rc_not_a_parameter.weight"}


def opt_manifest(c):
    h, f, v = c["hidden_size"], c["ffn_dim"], c["vocab_size"]
    t = [("model.decoder.embed_tokens.weight", (v, h)),
         ("model.decoder.embed_positions.weight", (c["max_position_embeddings"] + 2, h))]
    for l in range(c["num_hidden_layers"]):
        p = f"model.decoder.layers.{l}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            t += [(p + f"self_attn.{proj}.weight", (h, h)), (p + f"self_attn.{proj}.bias", (h,))]
        t += [(p + "self_attn_layer_norm.weight", (h,)), (p + "self_attn_layer_norm.bias", (h,)),
              (p + "fc1.weight", (f, h)), (p + "fc1.bias", (f,)), (p + "fc2.weight", (h, f)),
              (p + "fc2.bias", (h,)), (p + "final_layer_norm.weight", (h,)), (p + "final_layer_norm.bias", (h,))]
    return t + [("model.decoder.final_layer_norm.weight", (h,)), ("model.decoder.final_layer_norm.bias", (h,))]


def manifest(shape):
    t = []
    if shape in ("opt125m", "tiny"):
        return opt_manifest(CONFIGS[shape])
    else:
        t += [("model.embed_tokens.weight", (151936, 4096))]
        for l in range(36):
            p = f"model.layers.{l}."
            t += [(p + "self_attn.q_proj.weight", (4096, 4096)), (p + "self_attn.k_proj.weight", (1024, 4096)),
                  (p + "self_attn.v_proj.weight", (1024, 4096)), (p + "self_attn.o_proj.weight", (4096, 4096)),
                  (p + "self_attn.q_norm.weight", (128,)), (p + "self_attn.k_norm.weight", (128,)),
                  (p + "mlp.gate_proj.weight", (12288, 4096)), (p + "mlp.up_proj.weight", (12288, 4096)),
                  (p + "mlp.down_proj.weight", (4096, 12288)), (p + "input_layernorm.weight", (4096,)),
                  (p + "post_attention_layernorm.weight", (4096,))]
        t += [("model.norm.weight", (4096,)), ("lm_head.weight", (151936, 4096))]
    return t


def tokenizer(out):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    words = ["alpha", "beta", "gamma", "delta", "policy", "weight", "update", "drain", "cache", "token",
             "reward", "rollout", "engine", "trainer", "version", "label", "prefix", "resume", "pause"]
    corpus = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) + f" {i}" for i in range(2000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(out, "tokenizer.json"))
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 2048, "add_bos_token": False},
              open(os.path.join(out, "tokenizer_config.json"), "w"), indent=1)
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
              open(os.path.join(out, "special_tokens_map.json"), "w"), indent=1)


def weights(shape, seed, path):
    import torch
    from safetensors.torch import save_file
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    ts = {}
    for name, s in manifest(shape):
        x = torch.randn(s, generator=g, device=dev, dtype=torch.float32) * 0.02
        if name.endswith("norm.weight"):
            x += 1.0
        ts[name] = x.to(torch.bfloat16).cpu()
    save_file(ts, path, metadata={"format": "pt", "seed": str(seed), "shape": shape})


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def layer_of(name):
    """The unit a cut may not split: the decoder layer of a tensor, else the tensor itself (vLLM
    reloads layer by layer and finishes a layer only once all of its tensors arrived)."""
    m = re.match(r"(.*\.layers\.\d+)\.", name)
    return m.group(1) if m else name


def first_half(names):
    """The names up to the layer boundary nearest the middle (file order)."""
    cut = len(names) // 2
    while 0 < cut < len(names) and layer_of(names[cut]) == layer_of(names[cut - 1]):
        cut += 1
    return names[:cut]


def corrupt(shape, good_dir, out, mode):
    """Writes OUT as a checkpoint that fails on vLLM after shard 1 was loaded (module doc)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    good = os.path.join(good_dir, "model.safetensors")
    shard1 = os.path.join(out, "model-00001-of-00002.safetensors")
    shard2 = os.path.join(out, "model-00002-of-00002.safetensors")
    for p in (shard1, shard2):
        if os.path.lexists(p):
            os.remove(p)
    if mode == "link":
        os.symlink(os.path.abspath(good), shard1)
        kept = None
    else:
        with safe_open(good, "pt") as f:
            kept = first_half(list(f.keys()))
            save_file({n: f.get_tensor(n) for n in kept}, shard1, metadata={"format": "pt", "corrupt": "shard1"})
    save_file({BOGUS[shape]: torch.zeros(4, dtype=torch.bfloat16)}, shard2,
              metadata={"format": "pt", "corrupt": "shard2"})
    print(json.dumps({"corrupt_dir": out, "mode": mode, "shard1_tensors": len(kept) if kept else "all (symlink)",
                      "shard1_last": kept[-1] if kept else None, "bogus_tensor": BOGUS[shape]}))


def copy_tokenizer(src, out):
    for f in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(src, f), os.path.join(out, f))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--weights-file", default=None, help="default: OUT/model.safetensors")
    ap.add_argument("--no-weights", action="store_true")
    ap.add_argument("--tokenizer-from", default=None, help="copy the tokenizer files of this model directory")
    ap.add_argument("--corrupt-from", default=None, help="write OUT as a corrupt checkpoint made from this directory")
    ap.add_argument("--corrupt-mode", choices=["half", "link"], default="half")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    json.dump(dict(CONFIGS[a.shape]), open(os.path.join(a.out, "config.json"), "w"), indent=1)
    tok_src = a.tokenizer_from or a.corrupt_from
    if tok_src:
        copy_tokenizer(tok_src, a.out)
    elif not os.path.exists(os.path.join(a.out, "tokenizer.json")):
        tokenizer(a.out)
    if a.corrupt_from:
        corrupt(a.shape, a.corrupt_from, a.out, a.corrupt_mode)
    elif not a.no_weights:
        weights(a.shape, a.seed, a.weights_file or os.path.join(a.out, "model.safetensors"))
