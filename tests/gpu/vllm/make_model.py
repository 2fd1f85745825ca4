#!/usr/bin/env python3
"""Writes a local HF model directory without any hub access: config.json shaped like OPT-125M or
Qwen3-8B, a tokenizer trained here with the `tokenizers` library, and seeded random weights as
safetensors (tensor names = HF checkpoint names, the same manifest as tests/gpu/gpu_fixtures.h).
Two seeds give two checkpoints with an identical manifest.
  make_model.py --shape opt125m --out DIR [--seed 1] [--weights-file PATH] [--no-weights]
"""
import argparse, json, os

OPT = dict(architectures=["OPTForCausalLM"], model_type="opt", hidden_size=768, ffn_dim=3072,
           num_hidden_layers=12, num_attention_heads=12, vocab_size=50272, max_position_embeddings=2048,
           word_embed_proj_dim=768, do_layer_norm_before=True, activation_function="relu",
           enable_bias=True, layer_norm_elementwise_affine=True, dropout=0.0, attention_dropout=0.0,
           bos_token_id=0, eos_token_id=2, pad_token_id=1, tie_word_embeddings=True,
           torch_dtype="bfloat16", dtype="bfloat16")
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
             intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
             rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", attention_bias=False,
             attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
             torch_dtype="bfloat16", dtype="bfloat16", use_sliding_window=False)


def manifest(shape):
    t = []
    if shape == "opt125m":
        t += [("model.decoder.embed_tokens.weight", (50272, 768)), ("model.decoder.embed_positions.weight", (2050, 768))]
        for l in range(12):
            p = f"model.decoder.layers.{l}."
            for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
                t += [(p + f"self_attn.{proj}.weight", (768, 768)), (p + f"self_attn.{proj}.bias", (768,))]
            t += [(p + "self_attn_layer_norm.weight", (768,)), (p + "self_attn_layer_norm.bias", (768,)),
                  (p + "fc1.weight", (3072, 768)), (p + "fc1.bias", (3072,)), (p + "fc2.weight", (768, 3072)),
                  (p + "fc2.bias", (768,)), (p + "final_layer_norm.weight", (768,)), (p + "final_layer_norm.bias", (768,))]
        t += [("model.decoder.final_layer_norm.weight", (768,)), ("model.decoder.final_layer_norm.bias", (768,))]
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["opt125m", "qwen3-8b"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--weights-file", default=None, help="default: OUT/model.safetensors")
    ap.add_argument("--no-weights", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cfg = dict(OPT if a.shape == "opt125m" else QWEN3)
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=1)
    if not os.path.exists(os.path.join(a.out, "tokenizer.json")):
        tokenizer(a.out)
    if not a.no_weights:
        weights(a.shape, a.seed, a.weights_file or os.path.join(a.out, "model.safetensors"))
