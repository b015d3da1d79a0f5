"""Tiny Hugging Face model folders and an independent reference forward, for tests.

make_folder writes a folder laid out as transformers' save_pretrained writes it (config.json,
model.safetensors or shards with model.safetensors.index.json, tensors under Hugging Face names)
for GPT-2, Llama (2, 3.1, 3.2), Mistral, Qwen2, Mixtral, Qwen3, Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, gpt-oss
(its experts in bfloat16's layout, or in MXFP4 as OpenAI released them), Gemma 3 (its language model, and its
multimodal model with a vision tower beside it), OLMo 2 and OLMo 3.
reference_logits reads such a folder and computes its logits with a plain float64 functional forward
following the semantics of transformers' modeling code. Nothing from the repository is imported here on purpose: these
functions check the repository's own name/layout mapping, so they must not share it.
"""
import json
import math
import os
import re

import torch
from safetensors.torch import load_file, save_file

ARCHITECTURES = ("gpt2", "llama", "llama3.1", "llama3.2", "mistral", "mistral_window", "qwen2", "qwen2_window",
                 "mixtral", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v3_q_proj", "gpt_oss",
                 "gpt_oss_mxfp4", "gemma3_text", "gemma3", "olmo2", "olmo3")

_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
              max_position_embeddings=64, initializer_range=0.02, rms_norm_eps=1e-6,
              rope_theta=10000.0, rope_scaling=None, attention_dropout=0.0,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, use_cache=True)
# Llama 3 scaling on a tiny model: at head_dim 8 and theta 5e5 the wavelengths are about
# 6.3, 167, 4443, 118000; with these values the first is kept, the second smoothed
# (smooth ~0.53) and the last two divided by factor (see _rope_inv_freq).
_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0625,
                   "high_freq_factor": 0.125, "original_max_position_embeddings": 16}


def tiny_config(arch: str, transformers: int = 4) -> dict:
    """A tiny config.json dict for arch, as transformers 4 (or 5) writes it."""
    if transformers == 5:
        return _as_transformers5(tiny_config(arch))
    if arch == "gpt2":
        return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=61,
                    n_positions=32, n_embd=32, n_layer=4, n_head=4, n_inner=None,
                    activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1,
                    attn_pdrop=0.1, layer_norm_epsilon=1e-5, initializer_range=0.02,
                    summary_type="cls_index", summary_use_proj=True, summary_activation=None,
                    summary_proj_to_labels=True, summary_first_dropout=0.1,
                    scale_attn_weights=True, use_cache=True, bos_token_id=50256,
                    eos_token_id=50256, scale_attn_by_inverse_layer_idx=False,
                    reorder_and_upcast_attn=False, tie_word_embeddings=True,
                    torch_dtype="float32", transformers_version="4.46.0")
    base = dict(_LLAMA, head_dim=8, attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if arch in ("llama3.1", "llama3.2"):
        base.update(rope_theta=500000.0, rope_scaling=dict(_LLAMA3_SCALING), rms_norm_eps=1e-5,
                    tie_word_embeddings=arch == "llama3.2")
    if arch in ("llama", "llama3.1", "llama3.2"):
        return dict(model_type="llama", architectures=["LlamaForCausalLM"], **base,
                    torch_dtype="float32", transformers_version="4.46.0")
    mistral = dict(_LLAMA, head_dim=8, rope_theta=1000000.0, sliding_window=None,
                   rms_norm_eps=1e-5)
    del mistral["rope_scaling"]
    if arch in ("mistral", "mistral_window"):  # Mistral 7B v0.1's window on every layer, of 6 tokens here
        mistral.update(sliding_window=6 if arch == "mistral_window" else None)
        return dict(model_type="mistral", architectures=["MistralForCausalLM"], **mistral,
                    torch_dtype="float32", transformers_version="4.46.0")
    if arch == "mixtral":
        return dict(model_type="mixtral", architectures=["MixtralForCausalLM"], **mistral,
                    num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                    output_router_logits=False, router_jitter_noise=0.0,
                    torch_dtype="float32", transformers_version="4.46.0")
    if arch in ("qwen2", "qwen2_window"):  # qwen2_window: a window of 6 on the layers from max_window_layers on
        windowed = arch == "qwen2_window"
        qwen = dict(_LLAMA, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=windowed,
                    sliding_window=6 if windowed else None, max_window_layers=2 if windowed else 4)
        return dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], **qwen,
                    torch_dtype="float32", transformers_version="4.46.0")
    if arch in _QWEN_MOE or arch == "qwen3":
        return _qwen_config(arch)
    if arch in _DEEPSEEK:
        return dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], **_DEEPSEEK[arch],
                    torch_dtype="float32", transformers_version="4.57.0")
    if arch in ("gpt_oss", "gpt_oss_mxfp4"):
        quantized = dict(quantization_config=_MXFP4) if arch == "gpt_oss_mxfp4" else {}
        return dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], **_GPT_OSS, **quantized,
                    torch_dtype="bfloat16", transformers_version="4.55.0")
    if arch in _GEMMA_OLMO:
        return dict(model_type=arch, architectures=[_GEMMA_OLMO_CLASSES[arch]], **_GEMMA_OLMO[arch],
                    torch_dtype="float32", transformers_version="4.57.0")
    if arch == "gemma3":
        return dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"], **_GEMMA3,
                    torch_dtype="bfloat16", transformers_version="4.50.0.dev0")
    raise ValueError(f"unknown architecture {arch!r}")


_S, _F = "sliding_attention", "full_attention"
# Gemma 3's language model (configuration_gemma3.py's Gemma3TextConfig, 4.57: every setting, each layer's kind
# listed), tiny: heads of 16 on a width of 32 (4 query heads, 2 key/value heads), scores scaled by 24^-1/2
# (query_pre_attn_scalar, as Gemma 3 27B's 168 beside heads of 128), windows of 5 tokens on layers 0, 1 and 3, which
# turn by a base of 100 of their own (rope_local_base_freq), the full layer by 10,000 slowed 4 times (linear
# scaling: Gemma 3 4B and larger's global layers' by 8), a tied output layer.
# OLMo 2 (configuration_olmo2.py, 4.57; allenai/OLMo-2-1124-7B's settings, tiny): rotary base 500,000, norm
# epsilon 1e-6, grouped-query attention (k_norm 16 wide, q_norm 32), untied. OLMo 3 (configuration_olmo3.py, 4.57;
# allenai/Olmo-3-7B-Instruct's settings): OLMo 2's with windows of 5 tokens on three layers of four (Olmo3Config's
# pattern), YaRN on the full layer from 16 to 128 positions with the attention_factor its files state, 0.1 ln 8 + 1
# (the sliding ones turn unscaled; at head size 8 and base 500,000 YaRN keeps pair 0 and slows the others 8 times).
_OLMO2 = dict(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, hidden_act="silu", max_position_embeddings=64, initializer_range=0.02,
              use_cache=True, pad_token_id=1, bos_token_id=None, eos_token_id=2, tie_word_embeddings=False,
              rope_theta=500000.0, rope_scaling=None, attention_bias=False, attention_dropout=0.0, rms_norm_eps=1e-6)
_GEMMA_OLMO = {
    "gemma3_text": dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=64, initializer_range=0.02,
                        rms_norm_eps=1e-6, use_cache=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                        tie_word_embeddings=True, rope_theta=10000.0, attention_bias=False, attention_dropout=0.0,
                        query_pre_attn_scalar=24, sliding_window=5,
                        layer_types=[_S, _S, _F, _S], final_logit_softcapping=None, attn_logit_softcapping=None,
                        rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_local_base_freq=100.0,
                        use_bidirectional_attention=False),
    "olmo2": _OLMO2,
    "olmo3": dict(_OLMO2, sliding_window=5, layer_types=[_S, _S, _S, _F], max_position_embeddings=128,
                  rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16, beta_fast=32,
                                    beta_slow=1, attention_factor=0.1 * math.log(8.0) + 1)),
}
_GEMMA_OLMO_CLASSES = {"gemma3_text": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM"}
# Gemma 3's multimodal model (Gemma3Config) as google/gemma-3-4b-it's config.json has it (transformers 4.50): a
# text_config of the few settings that differ from Gemma3TextConfig's defaults (windows of 5 on every layer but each
# sliding_window_pattern-th: layers 0, 1 and 3; linear scaling by 8 on the full ones; the defaults' bases, 1e6 and
# 1e4, query_pre_attn_scalar 256, rms_norm_eps 1e-6 and tied output layer), a tiny SigLIP vision_config, and the
# image tokens' settings.
_GEMMA3 = dict(text_config=dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=48,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=64, sliding_window=5, sliding_window_pattern=3,
                                rope_scaling={"factor": 8.0, "rope_type": "linear"}),
               vision_config=dict(model_type="siglip_vision_model", hidden_size=8, intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8,
                                  vision_use_head=False),
               mm_tokens_per_image=4, boi_token_index=60, eoi_token_index=61, image_token_index=62,
               initializer_range=0.02, eos_token_id=[1, 3])
# Gemma3TextConfig's defaults (4.57 and 5), for what a config.json leaves out.
_GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                             hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
                             tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                             final_logit_softcapping=None, attn_logit_softcapping=None)


# DeepSeek-V3 (configuration_deepseek_v3.py, 4.57): its 671B model's shape, tiny. Latent attention with a query
# bottleneck (q_lora_rank 24), keys and values from a latent of 16, heads of 8 unrotated + 4 rotated features
# and values of 6; the first layer dense (first_k_dense_replace), the others 8 experts of 16 in 4 groups, a
# token's 2 from its 2 best groups, one shared expert; YaRN from 1,024 to 4,096 positions with DeepSeek-V3's
# mscale and mscale_all_dim (at rotated width 4, theta 1e4 and that original context, pair 0 is kept and pair 1
# blended halfway: the ramp runs from pair 0 to pair 2), in interleaved pairs (rope_interleave, the default);
# DeepSeek-V3's own settings that transformers keeps as they are (topk_method, scoring_func), and one multi-token-
# prediction layer (num_nextn_predict_layers: its tensors are model.layers.4.*, which nothing loads).
# DeepseekV3Config saves head_dim (= qk_rope_head_dim) and qk_head_dim beside the others.
_DEEPSEEK_YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
_DEEPSEEK_V3 = dict(vocab_size=64, hidden_size=32, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                    routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=6,
                    qk_nope_head_dim=8, qk_head_dim=12, head_dim=4, n_group=4, topk_group=2, num_experts_per_tok=2,
                    first_k_dense_replace=1, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096,
                    initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, pad_token_id=None, bos_token_id=0,
                    eos_token_id=1, pretraining_tp=1, tie_word_embeddings=False, rope_theta=10000.0,
                    rope_scaling=_DEEPSEEK_YARN, rope_interleave=True, attention_bias=False, attention_dropout=0.0,
                    num_nextn_predict_layers=1, topk_method="noaux_tc", scoring_func="sigmoid")
# Its variant without a query bottleneck (q_lora_rank null: DeepSeek-V2-Lite's q_proj), rotated in half-split
# pairs (rope_interleave false), every layer sparse without groups, two shared experts' width, gates left
# unnormalised, a tied output layer, and an mscale of its own (the rotary gain mscale / mscale_all_dim is not 1).
_DEEPSEEK = {
    "deepseek_v3": _DEEPSEEK_V3,
    "deepseek_v3_q_proj": dict(_DEEPSEEK_V3, q_lora_rank=None, rope_interleave=False, first_k_dense_replace=0,
                               n_group=1, topk_group=1, n_shared_experts=2, norm_topk_prob=False,
                               tie_word_embeddings=True, rope_scaling=dict(_DEEPSEEK_YARN, mscale_all_dim=0.5),
                               num_nextn_predict_layers=0),
}


# gpt-oss (configuration_gpt_oss.py, 4.55; openai/gpt-oss-20b's config.json), tiny: heads of 16 on a width of
# 32 (q is 64 wide), 4 experts of 32 (a multiple of MXFP4's 32-value groups), top 2, every second layer a window
# of 6 tokens from the first (layer_types), gpt-oss's own rotary settings (theta 150,000, YaRN x32 over 4,096
# positions, truncate false: at head size 16 the ramp runs from pair 2.02 to 4.35, where rounding would make it
# 2 to 5), and the released config's settings transformers reads past (experts_per_token, initial_context_length).
_GPT_OSS = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, experts_per_token=2,
                sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2, attention_bias=True,
                attention_dropout=0.0, hidden_act="silu", swiglu_limit=7.0, rms_norm_eps=1e-5,
                max_position_embeddings=131072, initial_context_length=4096, rope_theta=150000.0,
                rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                  original_max_position_embeddings=4096),
                router_aux_loss_coef=0.9, output_router_logits=False, tie_word_embeddings=False, use_cache=True,
                initializer_range=0.02, eos_token_id=2, pad_token_id=3)
# The released folders' quantization_config: the experts' matrices in MXFP4, everything else as it is.
_MXFP4 = dict(quant_method="mxfp4", modules_to_not_convert=["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"])


# Qwen3 (configuration_qwen3.py of 4.51 to 4.57): heads of 16 on a width of 32 (q is 64 wide, as Qwen3-0.6B's
# 16 heads of 128 on 1024), tied embeddings (the small Qwen3s), QK-norm in every attention (no setting: always).
_QWEN3 = dict(_LLAMA, head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False,
              use_sliding_window=False, sliding_window=None, max_window_layers=4)
# The MoEs' own settings (configuration_qwen3_moe.py, configuration_qwen2_moe.py): 4 experts of 24, top 2;
# Qwen3-MoE's first layer dense (mlp_only_layers) and its gates renormalised (Qwen3-30B-A3B's norm_topk_prob);
# Qwen2-MoE sparse every second layer (decoder_sparse_step 2: layers 1 and 3), its gates left as softmax gave
# them (Qwen1.5-MoE's norm_topk_prob false), and a shared expert of 48 behind its sigmoid gate.
_QWEN_MOE = {
    "qwen3_moe": dict(_QWEN3, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
                      router_aux_loss_coef=0.001, output_router_logits=False),
    "qwen2_moe": dict(_LLAMA, rope_theta=1000000.0, use_sliding_window=False, sliding_window=4096,
                      max_window_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=2,
                      mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False),
}
_QWEN_CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def _qwen_config(arch):
    fields = _QWEN_MOE.get(arch, _QWEN3)
    return dict(model_type=arch, architectures=[_QWEN_CLASSES[arch]], **fields, torch_dtype="float32",
                transformers_version="4.57.0")


def as_transformers_5_24(cfg: dict) -> dict:
    """A Qwen3-MoE config.json as transformers 5.24 writes it: the expert count as num_local_experts, the key
    Mixtral's config uses, with no num_experts."""
    out = {k: v for k, v in cfg.items() if k != "num_experts"}
    return out | dict(num_local_experts=cfg["num_experts"], transformers_version="5.24.0")


def _as_transformers5(cfg: dict) -> dict:
    """A transformers 4 config.json as transformers 5 writes the same model (PreTrainedConfig.to_diff_dict of
    5.0 to 5.24). The rotary settings move into one dict, rope_parameters: RotaryEmbeddingConfigMixin's
    convert_rope_params_to_dict takes rope_scaling (or {}) as it, rope_theta into it, and
    standardize_rope_params adds rope_type; no top-level rope_theta or rope_scaling is left to save. Gemma 3's and
    OLMo 3's (5.24) are one such dict per kind of layer (_kind_rope_parameters; Gemma 3's rope_local_base_freq moves
    into the sliding layers'), Gemma 3's multimodal model's in its text_config, which lists its layers' kinds. The
    dtype is saved as dtype, not torch_dtype; Qwen2's, Qwen3's and Qwen2-MoE's configs save their layer_types
    (configuration_qwen2/qwen3/qwen2_moe.py), Qwen3-MoE's none; Qwen3's and Qwen3-MoE's __post_init__ save
    sliding_window None and Qwen2-MoE's 0 when use_sliding_window is false, and Qwen2-MoE's qkv_bias (True)."""
    if cfg["model_type"] == "gemma3":
        text = _as_transformers5(dict(cfg["text_config"], torch_dtype=cfg["torch_dtype"]))
        text = {k: v for k, v in text.items() if k not in ("dtype", "transformers_version")}
        out = {k: v for k, v in cfg.items() if k != "torch_dtype"}
        return out | dict(text_config=text | dict(layer_types=_layer_kinds(_gemma3_text(cfg))),
                          dtype=cfg["torch_dtype"], transformers_version="5.0.0")
    moved = ("rope_theta", "rope_scaling", "torch_dtype", "rope_local_base_freq")
    out = {k: v for k, v in cfg.items() if k not in moved}
    if cfg["model_type"] in _PER_KIND:
        out["rope_parameters"] = {kind: _kind_rope_parameters(cfg, kind) for kind in (_S, _F)}
    elif cfg["model_type"] != "gpt2":
        rope = dict(cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA[cfg["model_type"]]))
        rope.setdefault("rope_type", rope.get("type", "default"))
        out["rope_parameters"] = rope
    if cfg["model_type"] in ("qwen2", "qwen3", "qwen2_moe"):
        out["layer_types"] = ["full_attention" if w is None else "sliding_attention" for w in _layer_windows(cfg)]
    if cfg["model_type"] in ("qwen3", "qwen3_moe", "qwen2_moe"):
        out["sliding_window"] = 0 if cfg["model_type"] == "qwen2_moe" else None
    if cfg["model_type"] == "qwen3_moe":
        out.pop("max_window_layers")
    if cfg["model_type"] == "qwen2_moe":
        out["qkv_bias"] = True
    if cfg["model_type"] == "deepseek_v3":  # DeepseekV3Config.convert_rope_params_to_dict: floats
        out["rope_parameters"] = {k: float(v) if k in ("beta_fast", "beta_slow", "factor") else v
                                  for k, v in out["rope_parameters"].items()}
    return out | dict(dtype=cfg["torch_dtype"], transformers_version="5.0.0")


# ---------------------------------------------------------------- writing a folder

def _gpt2_shapes(cfg):
    """(name, shape, kind) in GPT2LMHeadModel's state_dict order (modeling_gpt2)."""
    e, inner = cfg["n_embd"], cfg.get("n_inner") or 4 * cfg["n_embd"]
    out = [("transformer.wte.weight", (cfg["vocab_size"], e), "w"),
           ("transformer.wpe.weight", (cfg["n_positions"], e), "w")]
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        out += [(p + "ln_1.weight", (e,), "norm"), (p + "ln_1.bias", (e,), "b"),
                (p + "attn.c_attn.weight", (e, 3 * e), "w"), (p + "attn.c_attn.bias", (3 * e,), "b"),
                (p + "attn.c_proj.weight", (e, e), "w"), (p + "attn.c_proj.bias", (e,), "b"),
                (p + "ln_2.weight", (e,), "norm"), (p + "ln_2.bias", (e,), "b"),
                (p + "mlp.c_fc.weight", (e, inner), "w"), (p + "mlp.c_fc.bias", (inner,), "b"),
                (p + "mlp.c_proj.weight", (inner, e), "w"), (p + "mlp.c_proj.bias", (e,), "b")]
    out += [("transformer.ln_f.weight", (e,), "norm"), ("transformer.ln_f.bias", (e,), "b")]
    if not cfg.get("tie_word_embeddings", True):
        out.append(("lm_head.weight", (cfg["vocab_size"], e), "w"))
    return out


def _linear(name, n_out, n_in, bias):
    return [(name + ".weight", (n_out, n_in), "w")] + ([(name + ".bias", (n_out,), "b")] if bias else [])


def _llama_shapes(cfg):
    """(name, shape, kind) in *ForCausalLM's state_dict order (modeling_llama/qwen2/mixtral/qwen3/qwen3_moe/
    qwen2_moe)."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    qkv_bias, o_bias = _attention_biases(cfg)
    out = [("model.embed_tokens.weight", (v, h), "w")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += _linear(p + "self_attn.q_proj", nq, h, qkv_bias)
        out += _linear(p + "self_attn.k_proj", nkv, h, qkv_bias)
        out += _linear(p + "self_attn.v_proj", nkv, h, qkv_bias)
        out += _linear(p + "self_attn.o_proj", h, nq, o_bias)
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            out += [(p + "self_attn.q_norm.weight", (d,), "norm"), (p + "self_attn.k_norm.weight", (d,), "norm")]
        if _is_sparse(cfg, i):
            out += _qwen_moe_shapes(cfg, p + "mlp.")
        elif cfg["model_type"] == "mixtral":
            out.append((p + "block_sparse_moe.gate.weight", (cfg["num_local_experts"], h), "w"))
            for e in range(cfg["num_local_experts"]):
                q = p + f"block_sparse_moe.experts.{e}."
                out += [(q + "w1.weight", (f, h), "w"), (q + "w2.weight", (h, f), "w"),
                        (q + "w3.weight", (f, h), "w")]
        else:
            mb = cfg["model_type"] == "llama" and cfg.get("mlp_bias", False)
            out += _linear(p + "mlp.gate_proj", f, h, mb) + _linear(p + "mlp.up_proj", f, h, mb)
            out += _linear(p + "mlp.down_proj", h, f, mb)
        out += [(p + "input_layernorm.weight", (h,), "norm"),
                (p + "post_attention_layernorm.weight", (h,), "norm")]
    out.append(("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h), "w"))
    return out


def _is_sparse(cfg, i):
    """Layer i of a Qwen MoE is a SparseMoeBlock (Qwen2MoeDecoderLayer, Qwen3MoeDecoderLayer): not listed in
    mlp_only_layers, and i + 1 a multiple of decoder_sparse_step."""
    return cfg["model_type"] in _QWEN_MOE and _experts(cfg) > 0 and i not in cfg.get("mlp_only_layers", []) \
        and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0


def _experts(cfg):
    """A Qwen MoE's expert count: num_experts, or num_local_experts where transformers 5.24 writes it so."""
    return cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]


def _qwen_moe_shapes(cfg, p):
    """Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock: gate, then the experts, then Qwen2-MoE's shared expert
    and its gate (as transformers 4 writes them, and 5 writes them back: save_pretrained's
    revert_weight_conversion splits its fused experts into these names again)."""
    h, f = cfg["hidden_size"], cfg["moe_intermediate_size"]
    out = [(p + "gate.weight", (_experts(cfg), h), "w")]
    for e in range(_experts(cfg)):
        q = p + f"experts.{e}."
        out += [(q + "gate_proj.weight", (f, h), "w"), (q + "up_proj.weight", (f, h), "w"),
                (q + "down_proj.weight", (h, f), "w")]
    if cfg["model_type"] == "qwen2_moe":
        s = cfg["shared_expert_intermediate_size"]
        out += [(p + "shared_expert.gate_proj.weight", (s, h), "w"), (p + "shared_expert.up_proj.weight", (s, h), "w"),
                (p + "shared_expert.down_proj.weight", (h, s), "w"), (p + "shared_expert_gate.weight", (1, h), "w")]
    return out


def _attention_biases(cfg):
    """(q/k/v have a bias, o_proj has one): Qwen2Attention always q/k/v only (modeling_qwen2), as
    Qwen2MoeAttention (modeling_qwen2_moe: transformers 5's config.qkv_bias, True); LlamaAttention all four by
    config.attention_bias (modeling_llama), Qwen3Attention too (modeling_qwen3, _moe); Mistral/Mixtral none."""
    if cfg["model_type"] == "qwen2":
        return True, False
    if cfg["model_type"] == "qwen2_moe":
        return cfg.get("qkv_bias", True), False
    if cfg["model_type"] in ("qwen3", "qwen3_moe"):
        return (bool(cfg.get("attention_bias", False)),) * 2
    b = bool(cfg.get("attention_bias", False)) and cfg["model_type"] == "llama"
    return b, b


def _deepseek_shapes(cfg):
    """(name, shape, kind) in DeepseekV3ForCausalLM's state_dict order (modeling_deepseek_v3), then the layers of
    multi-token prediction that DeepSeek-V3's files hold after the last one (num_nextn_predict_layers of them:
    a whole decoder layer and enorm, hnorm, eh_proj, shared_head; its own embed_tokens too in the released
    files), which DeepseekV3ForCausalLM does not load (its _keys_to_ignore_on_load_unexpected)."""
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    out = [("model.embed_tokens.weight", (v, h), "w")]
    for i in range(layers):
        out += _deepseek_layer(cfg, f"model.layers.{i}.", sparse=i >= cfg["first_k_dense_replace"])
    out.append(("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h), "w"))
    for i in range(layers, layers + cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{i}."
        out += [(p + "embed_tokens.weight", (v, h), "w"), (p + "enorm.weight", (h,), "norm"),
                (p + "hnorm.weight", (h,), "norm"), (p + "eh_proj.weight", (h, 2 * h), "w")]
        out += _deepseek_layer(cfg, p, sparse=True)
        out += [(p + "shared_head.norm.weight", (h,), "norm"), (p + "shared_head.head.weight", (v, h), "w")]
    return out


def _deepseek_layer(cfg, p, sparse):
    """DeepseekV3DecoderLayer: DeepseekV3Attention (q_a_proj, q_a_layernorm, q_b_proj, or q_proj where q_lora_rank
    is null; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), then DeepseekV3MoE (experts, the router
    `gate` with its e_score_correction_bias, shared_experts) or DeepseekV3MLP, then its two norms."""
    h, heads, rank = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, vd, q_rank = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["q_lora_rank"]
    a = p + "self_attn."
    if q_rank is None:
        out = [(a + "q_proj.weight", (heads * (nope + rope), h), "w")]
    else:
        out = [(a + "q_a_proj.weight", (q_rank, h), "w"), (a + "q_a_layernorm.weight", (q_rank,), "norm"),
               (a + "q_b_proj.weight", (heads * (nope + rope), q_rank), "w")]
    out += [(a + "kv_a_proj_with_mqa.weight", (rank + rope, h), "w"), (a + "kv_a_layernorm.weight", (rank,), "norm"),
            (a + "kv_b_proj.weight", (heads * (nope + vd), rank), "w"), (a + "o_proj.weight", (h, heads * vd), "w")]
    if sparse:
        f = cfg["moe_intermediate_size"]
        for e in range(cfg["n_routed_experts"]):
            out += _mlp_shapes(p + f"mlp.experts.{e}.", h, f)
        out += [(p + "mlp.gate.weight", (cfg["n_routed_experts"], h), "w"),
                (p + "mlp.gate.e_score_correction_bias", (cfg["n_routed_experts"],), "routing bias")]
        out += _mlp_shapes(p + "mlp.shared_experts.", h, f * cfg["n_shared_experts"])
    else:
        out += _mlp_shapes(p + "mlp.", h, cfg["intermediate_size"])
    return out + [(p + "input_layernorm.weight", (h,), "norm"), (p + "post_attention_layernorm.weight", (h,), "norm")]


def _mlp_shapes(p, h, f):
    return [(p + "gate_proj.weight", (f, h), "w"), (p + "up_proj.weight", (f, h), "w"),
            (p + "down_proj.weight", (h, f), "w")]


def _gpt_oss_shapes(cfg):
    """(name, shape, kind) of GptOssForCausalLM's tensors (modeling_gpt_oss): its attention with biases and sinks;
    GptOssMLP's router (GptOssTopKRouter, with a bias) and GptOssExperts' four tensors, each expert's slice along
    the first dimension, the matrices (in, out); in a quantised folder the two matrices as MXFP4 pairs, blocks
    (experts, out, in / 32, 16) and scales (experts, out, in / 32), as the released files hold them."""
    h, f, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_local_experts"]
    d = cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h), "embedding")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += _linear(p + "self_attn.q_proj", nq, h, True) + _linear(p + "self_attn.k_proj", nkv, h, True)
        out += _linear(p + "self_attn.v_proj", nkv, h, True)
        out += [(p + "self_attn.o_proj.weight", (h, nq), "w"), (p + "self_attn.o_proj.bias", (h,), "b")]
        out += [(p + "self_attn.sinks", (cfg["num_attention_heads"],), "sink")]
        out += [(p + "mlp.router.weight", (n, h), "w"), (p + "mlp.router.bias", (n,), "routing bias")]
        e = p + "mlp.experts."
        if cfg.get("quantization_config"):
            out += [(e + "gate_up_proj_blocks", (n, 2 * f, h // 32, 16), "mxfp4 blocks"),
                    (e + "gate_up_proj_scales", (n, 2 * f, h // 32), "mxfp4 scales"),
                    (e + "down_proj_blocks", (n, h, f // 32, 16), "mxfp4 blocks"),
                    (e + "down_proj_scales", (n, h, f // 32), "mxfp4 scales")]
        else:
            out += [(e + "gate_up_proj", (n, h, 2 * f), "w"), (e + "down_proj", (n, f, h), "w")]
        clamped = "expert bias" if i == cfg["num_hidden_layers"] - 1 else "b"  # (see _VALUES)
        out += [(e + "gate_up_proj_bias", (n, 2 * f), clamped), (e + "down_proj_bias", (n, h), "b")]
        out += [(p + "input_layernorm.weight", (h,), "norm"), (p + "post_attention_layernorm.weight", (h,), "norm")]
    return out + [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (v, h), "w")]


def _gemma3_text_shapes(cfg, prefix="model.", head="lm_head."):
    """(name, shape, kind) in Gemma3ForCausalLM's state_dict order (modeling_gemma3), its language model's under
    `prefix` and its output layer's under `head`: Gemma3Attention's projections and its q_norm and k_norm of
    head_dim, Gemma3MLP, and the block's four norms, each a weight w of Gemma3RMSNorm's (1 + w)."""
    h, f, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [(prefix + "embed_tokens.weight", (cfg["vocab_size"], h), "w")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (nq, h), "w"), (p + "self_attn.k_proj.weight", (nkv, h), "w"),
                (p + "self_attn.v_proj.weight", (nkv, h), "w"), (p + "self_attn.o_proj.weight", (h, nq), "w"),
                (p + "self_attn.q_norm.weight", (d,), "offset norm"),
                (p + "self_attn.k_norm.weight", (d,), "offset norm")]
        out += _mlp_shapes(p + "mlp.", h, f)
        out += [(p + f"{norm}.weight", (h,), "offset norm") for norm in ("input_layernorm", "post_attention_layernorm",
                                                                          "pre_feedforward_layernorm",
                                                                          "post_feedforward_layernorm")]
    out.append((prefix + "norm.weight", (h,), "offset norm"))
    if not cfg["tie_word_embeddings"]:
        out.append((head + "weight", (cfg["vocab_size"], h), "w"))
    return out


def _gemma3_shapes(cfg):
    """Gemma3ForConditionalGeneration's tensors: its language model's (_gemma3_text_shapes) under language_model.model
    in the released files, under model.language_model as transformers 4.52 and later save them, and a few of its vision
    tower's and projector's (a SigLIP patch embedding and norm, the projection to the text width), which a reader of
    the language model must leave unread."""
    text, vision = _gemma3_text(cfg), cfg["vision_config"]
    new = tuple(int(n) for n in cfg["transformers_version"].split(".")[:2]) >= (4, 52)
    prefix, head, outer = ("model.language_model.", "lm_head.", "model.") if new else (
        "language_model.model.", "language_model.lm_head.", "")
    v, patch = vision["hidden_size"], vision["patch_size"]
    return _gemma3_text_shapes(text, prefix, head) + [
        (outer + "vision_tower.vision_model.embeddings.patch_embedding.weight", (v, 3, patch, patch), "w"),
        (outer + "vision_tower.vision_model.post_layernorm.weight", (v,), "norm"),
        (outer + "multi_modal_projector.mm_input_projection_weight", (v, text["hidden_size"]), "w")]


def _olmo2_shapes(cfg):
    """(name, shape, kind) in Olmo2ForCausalLM's (and Olmo3ForCausalLM's) state_dict order (modeling_olmo2): its
    attention's projections with q_norm and k_norm over each whole projection, the MLP, and the two norms after them."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h), "w")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (nq, h), "w"), (p + "self_attn.k_proj.weight", (nkv, h), "w"),
                (p + "self_attn.v_proj.weight", (nkv, h), "w"), (p + "self_attn.o_proj.weight", (h, nq), "w"),
                (p + "self_attn.q_norm.weight", (nq,), "norm"), (p + "self_attn.k_norm.weight", (nkv,), "norm")]
        out += _mlp_shapes(p + "mlp.", h, f)
        out += [(p + "post_attention_layernorm.weight", (h,), "norm"),
                (p + "post_feedforward_layernorm.weight", (h,), "norm")]
    out.append(("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, h), "w"))
    return out


def _shapes(cfg):
    if cfg["model_type"] == "gpt2":
        return _gpt2_shapes(cfg)
    if cfg["model_type"] == "gpt_oss":
        return _gpt_oss_shapes(cfg)
    if cfg["model_type"] == "gemma3_text":
        return _gemma3_text_shapes(_gemma3_text(cfg))
    if cfg["model_type"] == "gemma3":
        return _gemma3_shapes(cfg)
    if cfg["model_type"] in ("olmo2", "olmo3"):
        return _olmo2_shapes(cfg)
    return _deepseek_shapes(cfg) if cfg["model_type"] == "deepseek_v3" else _llama_shapes(cfg)


# The random values of each kind of tensor: weights, biases, norms' gains, and DeepSeek-V3's routing bias, small
# beside the sigmoid scores (about 0.5 +- 0.03 here) so that it changes some choices but leaves every choice
# score positive (where masking a group with 0.0, as transformers does, or with -inf, as model.py and
# DeepSeek's inference code do, choose alike); gpt-oss's router bias of that size too, beside logits of about
# 0.1 (a larger one would choose the same experts for every token).
# gpt-oss's biases everywhere add the same to every token's residual stream: its embedding is fifty times "w"'s,
# so that the tokens' own part outweighs them and tokens choose experts apart (with "w"'s, the rarest of a layer's
# four experts gets one token in a hundred). Its gate | up biases in the last layer are "b"'s but about one in a
# hundred +-8, beyond the clamps at +-7 (in earlier layers they would add the same large vectors to the tokens
# they route, and route them alike thereafter); its sinks logits of the size of the attention scores'. Gemma's
# norms' weights w scale by (1 + w), so theirs are about 0 where the others' are about 1.
_VALUES = {"w": lambda r: 0.02 * r, "b": lambda r: 0.1 * r, "norm": lambda r: 1 + 0.1 * r,
           "offset norm": lambda r: 0.1 * r,
           "routing bias": lambda r: 0.01 * r, "embedding": lambda r: r,
           "expert bias": lambda r: torch.where(r.abs() > 2.5, 8 * r.sign(), 0.1 * r), "sink": lambda r: r}
# MXFP4's two parts (the format's definition, as in transformers' integrations/mxfp4.py): a byte of blocks is two
# 4-bit e2m1 codes, the first value in its low four bits; a scale is a power of two's exponent biased by 127, here
# 2^-9 to 2^-6 (the values about the size of "w"'s).
_PACKED = {"mxfp4 blocks": lambda shape, g: torch.randint(0, 256, shape, generator=g, dtype=torch.uint8),
           "mxfp4 scales": lambda shape, g: torch.randint(127 - 9, 127 - 5, shape, generator=g).to(torch.uint8)}


def make_folder(path, arch, seed=0, dtype=torch.float64, shards=1, config=None) -> dict:
    """Write config.json and seeded random weights under Hugging Face names into `path`."""
    cfg = dict(config if config is not None else tiny_config(arch))
    cfg["dtype" if "dtype" in cfg else "torch_dtype"] = str(dtype).replace("torch.", "")  # 5's name, or 4's
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape, kind in _shapes(cfg):
        if kind in _PACKED:
            tensors[name] = _PACKED[kind](shape, g)
            continue
        r = torch.randn(shape, generator=g, dtype=torch.float64)
        tensors[name] = _VALUES[kind](r).to(dtype).contiguous()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return cfg
    weight_map, per = {}, math.ceil(len(names) / shards)
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return cfg


# ---------------------------------------------------------------- the reference forward

def _load(path):
    """config dict and {name: float64 tensor}, from model.safetensors or the sharded index."""
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    w = {}
    for f in files:
        w.update(load_file(os.path.join(path, f)))
    return cfg, _dequantized({k: v if v.dtype == torch.uint8 else v.to(torch.float64) for k, v in w.items()})


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _dequantized(w):
    """MXFP4 pairs X_blocks, X_scales as the tensor X transformers' loader makes of them (convert_moe_packed_tensors,
    integrations/mxfp4.py): each byte's low and high codes as consecutive values, times 2^(scale - 127) for each
    group of 32, the rows (experts, out, in) then transposed to GptOssExperts' (experts, in, out)."""
    for name in [k for k in w if k.endswith("_blocks")]:
        base = name[:-len("_blocks")]
        blocks, scales = w.pop(name).long(), w.pop(base + "_scales").long()
        table = torch.tensor(_E2M1, dtype=torch.float64)
        values = torch.stack([table[blocks & 15], table[blocks >> 4]], dim=-1).flatten(-2)  # (..., groups, 32)
        values = values * torch.exp2((scales - 127).double()).unsqueeze(-1)
        w[base] = values.flatten(-2).transpose(1, 2).contiguous()
    return w


# transformers.activations.ACT2FN
_ACT = {"gelu_new": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
        "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
        "relu": torch.relu, "silu": lambda x: x * torch.sigmoid(x)}
_ACT["gelu_pytorch_tanh"], _ACT["swish"] = _ACT["gelu_new"], _ACT["silu"]


def _attend(q, k, v, scale, window=None, sinks=None):
    """Causal softmax attention, written out. q (B, H, T, D); k, v (B, Hkv, T, D): kv head j
    serves query heads j*group..(j+1)*group-1 (repeat_kv in modeling_llama). window: keys with
    q_idx - window < kv_idx only (sliding_window_causal mask of transformers.masking_utils). sinks (H,):
    gpt-oss's (eager_attention_forward of modeling_gpt_oss): each head's logit joins every query's scores
    as one more column of the softmax, dropped after it (it has no value)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    t = q.shape[2]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = (j <= i) if window is None else (j <= i) & (j > i - window)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


def _heads(x, n):
    b, t, _ = x.shape
    return x.view(b, t, n, -1).transpose(1, 2)


def _merge(x):
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def _gpt2_logits(cfg, w, ids):
    """modeling_gpt2.GPT2LMHeadModel: Conv1D is x @ W + b, W stored (in, out)."""
    if "wte.weight" in w:  # the original openai-community/gpt2 files have no "transformer."
        w = {k if k.startswith("lm_head") else "transformer." + k: v for k, v in w.items()}
    e, nh, eps = cfg["n_embd"], cfg["n_head"], cfg.get("layer_norm_epsilon", 1e-5)
    act = _ACT[cfg.get("activation_function", "gelu_new")]

    def ln(x, p):
        return torch.nn.functional.layer_norm(x, (e,), w[p + ".weight"], w[p + ".bias"], eps)

    def conv(x, p):
        return x @ w[p + ".weight"] + w[p + ".bias"]

    x = w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][torch.arange(ids.shape[1])]
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        q, k, v = conv(ln(x, p + "ln_1"), p + "attn.c_attn").split(e, dim=-1)
        scale = 1 / math.sqrt(e // nh) if cfg.get("scale_attn_weights", True) else 1.0
        if cfg.get("scale_attn_by_inverse_layer_idx", False):
            scale /= i + 1
        a = _attend(_heads(q, nh), _heads(k, nh), _heads(v, nh), scale)
        x = x + conv(_merge(a), p + "attn.c_proj")
        x = x + conv(act(conv(ln(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    x = ln(x, "transformer.ln_f")
    head = w["transformer.wte.weight"] if cfg.get("tie_word_embeddings", True) else w["lm_head.weight"]
    return x @ head.T


# rope_theta where config.json states none: the config class's default, the same in transformers 4 and 5
# (configuration_llama/mistral/qwen2.py: 10000.0; configuration_mixtral.py: 1e6, MixtralConfig.default_theta in 5)
_DEFAULT_THETA = {"llama": 10000.0, "mistral": 10000.0, "qwen2": 10000.0, "mixtral": 1e6, "qwen3": 10000.0,
                  "qwen3_moe": 10000.0, "qwen2_moe": 10000.0,  # (configuration_qwen3/qwen3_moe/qwen2_moe.py too)
                  "deepseek_v3": 10000.0,  # (configuration_deepseek_v3.py)
                  "gpt_oss": 150000.0,  # (configuration_gpt_oss.py's default_theta)
                  "gemma3_text": 1e6, "olmo2": 10000.0, "olmo3": 10000.0}  # (configuration_gemma3/olmo2/olmo3.py, 4.57)
_PER_KIND = ("gemma3_text", "olmo3")  # the families whose kinds of layer rotate apart


def _rope_parameters(cfg):
    """The rotary settings as transformers 5 reads any config.json, its own form or transformers 4's
    (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict and standardize_rope_params): a rope_scaling
    dict, else rope_parameters; rope_theta from that dict, else the top-level one, else the class's default;
    rope_type, else type, else default; llama3's original context, else max_position_embeddings."""
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA[cfg["model_type"]]))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return rope


def _kind_rope_parameters(cfg, kind):
    """The rotary settings of one kind of layer of Gemma 3 or OLMo 3, as transformers 5.24's Gemma3TextConfig and
    Olmo3Config read any config.json (convert_rope_params_to_dict) and 4.57's Gemma3TextModel and Olmo3Model read
    transformers 4's form: rope_parameters[kind] where given; rope_scaling on the full layers alone; the base from the
    kind's dict, else the top-level one (Gemma 3's sliding layers': rope_local_base_freq), else the class's default.
    (OLMo 3's sliding layers as 4.57 turns them, by rope_theta: 5.24 turns them by 500,000 in 4's form, the base of
    these folders.)"""
    rope = dict((cfg.get("rope_parameters") or {}).get(kind) or {"rope_type": "default"})
    if kind == _F and cfg.get("rope_scaling"):
        rope.update(cfg["rope_scaling"])
    if cfg["model_type"] == "gemma3_text" and kind == _S:
        rope.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    rope.setdefault("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA[cfg["model_type"]]))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return rope


def _rope_inv_freq(cfg, d):
    return _inv_freq(_rope_parameters(cfg), d)


def _inv_freq(rs, d):
    """modeling_rope_utils: _compute_default_rope_parameters, _compute_linear_scaling_rope_parameters and
    _compute_llama3_parameters, of the rotary settings rs."""
    inv = 1.0 / (rs["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    kind = rs["rope_type"]
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / rs["factor"]
    if kind != "llama3":
        raise NotImplementedError(f"rope_type {kind!r}")
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, smoothed, scaled)


def _rotate(x, cos, sin):
    """apply_rotary_pos_emb with rotate_half(x) = cat(-x2, x1) (modeling_llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rms(x, weight, eps):
    """LlamaRMSNorm / Qwen2RMSNorm / MixtralRMSNorm."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _lin(w, x, name, bias=False):
    """nn.Linear: weight (out, in); the bias read only where the module has one."""
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if bias else y


def _moe(cfg, w, x, p):
    """MixtralSparseMoeBlock: softmax over all experts, top-k, weights renormalised to sum 1."""
    probs = torch.softmax(x @ w[p + "gate.weight"].T, dim=-1)
    top, chosen = probs.topk(cfg["num_experts_per_tok"], dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(cfg["num_local_experts"]):
        q = p + f"experts.{e}."
        y = _lin(w, torch.nn.functional.silu(_lin(w, x, q + "w1")) * _lin(w, x, q + "w3"), q + "w2")
        out = out + y * (top * (chosen == e)).sum(-1, keepdim=True)
    return out


def _qwen_moe(cfg, w, x, p):
    """Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock: softmax over all experts, top-k, weights renormalised
    only with norm_topk_prob; Qwen2-MoE adds sigmoid(shared_expert_gate(x)) * shared_expert(x)."""
    probs = torch.softmax(x @ w[p + "gate.weight"].T, dim=-1)
    top, chosen = probs.topk(cfg["num_experts_per_tok"], dim=-1)
    if cfg.get("norm_topk_prob", False):
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(_experts(cfg)):
        out = out + _swiglu(w, x, p + f"experts.{e}.") * (top * (chosen == e)).sum(-1, keepdim=True)
    if cfg["model_type"] == "qwen2_moe":
        out = out + torch.sigmoid(_lin(w, x, p + "shared_expert_gate")) * _swiglu(w, x, p + "shared_expert.")
    return out


def _swiglu(w, x, p):
    """Qwen2MoeMLP / Qwen3MoeMLP: down(silu(gate(x)) * up(x)), no biases."""
    return _lin(w, torch.nn.functional.silu(_lin(w, x, p + "gate_proj")) * _lin(w, x, p + "up_proj"), p + "down_proj")


def _layer_windows(cfg):
    """Each layer's sliding window (None: full attention), as transformers' configs derive them: Mistral's and
    Mixtral's sliding_window on every layer (MistralAttention); the Qwens' only with use_sliding_window (their
    __init__ or __post_init__ sets sliding_window None otherwise), on the layers layer_types names
    "sliding_attention", which default to those from max_window_layers on (configuration_qwen2.py)."""
    n = cfg["num_hidden_layers"]
    if cfg["model_type"] in ("mistral", "mixtral"):
        return [cfg.get("sliding_window")] * n
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    first = cfg.get("max_window_layers", n)
    types = cfg.get("layer_types") or ["sliding_attention" if window is not None and i >= first else "full_attention"
                                       for i in range(n)]
    return [window if kind == "sliding_attention" else None for kind in types]


def _llama_logits(cfg, w, ids):
    """modeling_llama / modeling_mistral / modeling_qwen2 / modeling_mixtral / modeling_qwen3 /
    modeling_qwen3_moe / modeling_qwen2_moe *ForCausalLM."""
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, eps = cfg.get("head_dim") or h // nh, cfg["rms_norm_eps"]
    qkv_bias, o_bias = _attention_biases(cfg)
    mlp_bias = cfg["model_type"] == "llama" and cfg.get("mlp_bias", False)
    angles = torch.arange(ids.shape[1], dtype=torch.float64)[:, None] * _rope_inv_freq(cfg, d)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    act = _ACT[cfg.get("hidden_act", "silu")]
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _heads(_lin(w, a, p + "self_attn.q_proj", qkv_bias), nh)
        k = _heads(_lin(w, a, p + "self_attn.k_proj", qkv_bias), nkv)
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):  # Qwen3Attention: q_norm, k_norm on each head, then rotary
            q, k = _rms(q, w[p + "self_attn.q_norm.weight"], eps), _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        v = _heads(_lin(w, a, p + "self_attn.v_proj", qkv_bias), nkv)
        o = _merge(_attend(q, k, v, d ** -0.5, _layer_windows(cfg)[i]))
        x = x + _lin(w, o, p + "self_attn.o_proj", o_bias)
        m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if _is_sparse(cfg, i):
            x = x + _qwen_moe(cfg, w, m, p + "mlp.")
        elif cfg["model_type"] == "mixtral":
            x = x + _moe(cfg, w, m, p + "block_sparse_moe.")
        else:
            g = act(_lin(w, m, p + "mlp.gate_proj", mlp_bias)) * _lin(w, m, p + "mlp.up_proj", mlp_bias)
            x = x + _lin(w, g, p + "mlp.down_proj", mlp_bias)
    x = _rms(x, w["model.norm.weight"], eps)
    tied = cfg.get("tie_word_embeddings", False)
    return x @ (w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]).T


def _yarn(cfg, rs, d):
    """(inv_freq, attention_factor) of modeling_rope_utils' _compute_yarn_parameters (4.57) for d rotated
    features: where the dict states original_max_position_embeddings, factor is max_position_embeddings over it."""
    base, factor = rs["rope_theta"], rs["factor"]
    original = rs.get("original_max_position_embeddings")
    if original is not None:
        factor = cfg["max_position_embeddings"] / original
    else:
        original = cfg["max_position_embeddings"]

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                            else get_mscale(factor))

    def correction_dim(rotations):
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction_dim(rs.get("beta_fast") or 32), correction_dim(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):  # (gpt-oss's config says false: the ends stay where they fall)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    extrapolation = 1 - ramp
    inv_freq = 1 / (factor * pos_freqs) * (1 - extrapolation) + 1 / pos_freqs * extrapolation
    return inv_freq, attention_factor


def _deepseek_router(cfg, w, x, p):
    """DeepseekV3TopkRouter (in float64 here: transformers computes it in float32): sigmoid scores; the choice
    among scores + e_score_correction_bias, within the topk_group groups whose two best choice scores sum
    highest (the others' set to 0.0), top num_experts_per_tok; the gates the unbiased scores, renormalised
    (+ 1e-20) with norm_topk_prob, times routed_scaling_factor. Returns (chosen, gates), (tokens, top_k)."""
    n, groups, top_k = cfg["n_routed_experts"], cfg["n_group"], cfg["num_experts_per_tok"]
    scores = torch.sigmoid(x @ w[p + "gate.weight"].T)
    choice = scores + w[p + "gate.e_score_correction_bias"]
    group_scores = choice.view(-1, groups, n // groups).topk(2, dim=-1)[0].sum(-1)
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(cfg["topk_group"], dim=-1)[1], 1)
    allowed = group_mask.unsqueeze(-1).expand(-1, groups, n // groups).reshape(-1, n).bool()
    chosen = choice.masked_fill(~allowed, 0.0).topk(top_k, dim=-1)[1]
    gates = scores.gather(1, chosen)
    if cfg["norm_topk_prob"]:
        gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
    return chosen, gates * cfg["routed_scaling_factor"]


def _deepseek_moe(cfg, w, x, p):
    """DeepseekV3MoE: each token's chosen experts weighted by their gates, plus shared_experts on every token."""
    tokens = x.reshape(-1, x.shape[-1])
    chosen, gates = _deepseek_router(cfg, w, tokens, p)
    out = torch.zeros_like(tokens)
    for e in range(cfg["n_routed_experts"]):
        out = out + _swiglu(w, tokens, p + f"experts.{e}.") * (gates * (chosen == e)).sum(-1, keepdim=True)
    shared = _swiglu(w, x, p + "shared_experts.") if cfg["n_shared_experts"] else 0  # (a width of 0: none)
    return out.view_as(x) + shared


def _deinterleave(x):
    """apply_rotary_pos_emb_interleave's reordering: features viewed as (d/2, 2) pairs and transposed, so that
    rotate_half turns each consecutive pair (0, 1), (2, 3), ..."""
    b, h, t, d = x.shape
    return x.view(b, h, t, d // 2, 2).transpose(4, 3).reshape(b, h, t, d)


def _deepseek_logits(cfg, w, ids):
    """modeling_deepseek_v3.DeepseekV3ForCausalLM. Latent attention: q from q_proj, or q_b_proj(q_a_layernorm(
    q_a_proj(x))); kv_a_proj_with_mqa gives the latent (normed by kv_a_layernorm, then kv_b_proj to each head's
    unrotated key | value) and one rotated key shared by every head; the rotation on qk_rope_head_dim features
    (interleaved pairs with rope_interleave), cos and sin times the YaRN attention_factor; softmax scale
    qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 where the rope dict gives mscale_all_dim. The two
    latent norms are DeepseekV3RMSNorm(rank): epsilon 1e-6, whatever rms_norm_eps says."""
    nh, eps = cfg["num_attention_heads"], cfg["rms_norm_eps"]
    nope, rope, vd, rank = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    rs, t = _rope_parameters(cfg), ids.shape[1]
    if rs["rope_type"] == "yarn":
        inv_freq, attention_factor = _yarn(cfg, rs, rope)
    elif rs["rope_type"] == "default":
        inv_freq = 1.0 / (rs["rope_theta"] ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope))
        attention_factor = 1.0
    else:
        raise NotImplementedError(f"rope_type {rs['rope_type']!r}")
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
    scale = (nope + rope) ** -0.5
    if rs["rope_type"] != "default" and rs.get("mscale_all_dim"):
        scale *= (0.1 * rs["mscale_all_dim"] * math.log(rs["factor"]) + 1.0) ** 2
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms(x, w[p + "input_layernorm.weight"], eps)
        s = p + "self_attn."
        if cfg["q_lora_rank"] is None:
            q = _lin(w, a, s + "q_proj")
        else:
            q = _lin(w, _rms(_lin(w, a, s + "q_a_proj"), w[s + "q_a_layernorm.weight"], 1e-6), s + "q_b_proj")
        q_pass, q_rot = _heads(q, nh).split([nope, rope], dim=-1)
        k_pass, k_rot = _lin(w, a, s + "kv_a_proj_with_mqa").split([rank, rope], dim=-1)
        kv = _heads(_lin(w, _rms(k_pass, w[s + "kv_a_layernorm.weight"], 1e-6), s + "kv_b_proj"), nh)
        k_pass, v = kv.split([nope, vd], dim=-1)
        k_rot = k_rot.view(x.shape[0], 1, t, rope)
        if cfg.get("rope_interleave", True):
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        q_rot, k_rot = _rotate(q_rot, cos, sin), _rotate(k_rot, cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(-1, nh, -1, -1)), dim=-1)
        x = x + _lin(w, _merge(_attend(q, k, v, scale)), s + "o_proj")
        m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        sparse = i >= cfg["first_k_dense_replace"]
        x = x + (_deepseek_moe(cfg, w, m, p + "mlp.") if sparse else _swiglu(w, m, p + "mlp."))
    x = _rms(x, w["model.norm.weight"], eps)
    tied = cfg.get("tie_word_embeddings", False)
    return x @ (w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]).T


def _gpt_oss_experts(cfg, w, x, p):
    """GptOssMLP: the router's logits (x W^T + b), its top num_experts_per_tok softmaxed among themselves
    (GptOssTopKRouter); each expert (GptOssExperts): gate_up = x @ gate_up_proj[e] + its bias, gate its even
    columns clamped above at swiglu_limit, up its odd ones clamped to +-swiglu_limit, (up + 1) * gate *
    sigmoid(1.702 gate) @ down_proj[e] + its bias, weighted by its gate."""
    limit = cfg.get("swiglu_limit", 7.0)
    top, chosen = (x @ w[p + "router.weight"].T + w[p + "router.bias"]).topk(cfg["num_experts_per_tok"], dim=-1)
    top = torch.softmax(top, dim=-1)
    out = torch.zeros_like(x)
    for e in range(cfg["num_local_experts"]):
        gate_up = x @ w[p + "experts.gate_up_proj"][e] + w[p + "experts.gate_up_proj_bias"][e]
        gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(min=-limit, max=limit)
        y = ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ w[p + "experts.down_proj"][e]
        out = out + (y + w[p + "experts.down_proj_bias"][e]) * (top * (chosen == e)).sum(-1, keepdim=True)
    return out


def _gpt_oss_logits(cfg, w, ids):
    """modeling_gpt_oss.GptOssForCausalLM: the Llama block with biases on q, k, v and o and a sink per head,
    windows on its layer_types' "sliding_attention" layers, YaRN's frequencies and attention factor (cos and sin
    times it, GptOssRotaryEmbedding), and GptOssMLP in every layer."""
    nh, nkv, d, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    inv_freq, attention_factor = _yarn(cfg, _rope_parameters(cfg), d)
    angles = torch.arange(ids.shape[1], dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rotate(_heads(_lin(w, a, p + "self_attn.q_proj", True), nh), cos, sin)
        k = _rotate(_heads(_lin(w, a, p + "self_attn.k_proj", True), nkv), cos, sin)
        v = _heads(_lin(w, a, p + "self_attn.v_proj", True), nkv)
        window = cfg["sliding_window"] if cfg["layer_types"][i] == "sliding_attention" else None
        o = _attend(q, k, v, d ** -0.5, window, sinks=w[p + "self_attn.sinks"])
        x = x + _lin(w, _merge(o), p + "self_attn.o_proj", True)
        x = x + _gpt_oss_experts(cfg, w, _rms(x, w[p + "post_attention_layernorm.weight"], eps), p + "mlp.")
    return _rms(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


def _gemma3_text(cfg):
    """The language model's config, with Gemma3TextConfig's defaults where it is silent: a gemma3_text config.json, or
    a multimodal one's text_config (Gemma3Config builds Gemma3TextConfig(**text_config)), of the folder's dtype."""
    if cfg["model_type"] == "gemma3":
        dtype = {k: cfg[k] for k in ("torch_dtype", "dtype") if k in cfg}
        return _GEMMA3_TEXT_DEFAULTS | cfg["text_config"] | dtype | {"model_type": "gemma3_text"}
    return _GEMMA3_TEXT_DEFAULTS | cfg


def _layer_kinds(cfg):
    """Each layer's kind: layer_types, else as Gemma3TextConfig makes them (each sliding_window_pattern-th layer
    full, the others sliding; 6 by default) and Olmo3Config (each fourth full)."""
    if cfg.get("layer_types"):
        return cfg["layer_types"]
    every = cfg.get("sliding_window_pattern", 6) if cfg["model_type"] == "gemma3_text" else 4
    return [_F if (i + 1) % every == 0 else _S for i in range(cfg["num_hidden_layers"])]


def _cos_sin(cfg, rs, d, t):
    """cos and sin of positions 0..t-1 turned by the rotary settings rs, each (t, d), times YaRN's attention factor
    (the rotary embedding's)."""
    inv_freq, gain = _yarn(cfg, rs, d) if rs["rope_type"] == "yarn" else (_inv_freq(rs, d), 1.0)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos() * gain, emb.sin() * gain


def _gemma_rms(x, weight, eps):
    """Gemma3RMSNorm: x / rms(x) * (1 + weight)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def _gemma3_logits(cfg, w, ids):
    """modeling_gemma3.Gemma3ForCausalLM (and Gemma3ForConditionalGeneration's language model on text alone): the
    embedding times sqrt(hidden_size) (Gemma3TextScaledWordEmbedding: the scale a tensor of the weights' dtype); in
    each layer (Gemma3DecoderLayer) Gemma3RMSNorm before and after attention and before and after the MLP; q_norm and
    k_norm of each head before the rotation, the scores scaled by query_pre_attn_scalar^-1/2; the sliding layers'
    window and rotation (rotary_emb_local: rope_local_base_freq, unscaled), the full layers' (rotary_emb: rope_theta,
    rope_scaling); Gemma3MLP's gelu_pytorch_tanh-gated MLP."""
    cfg = _gemma3_text(cfg)
    h, nh, nkv, d, eps = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                           "rms_norm_eps"))
    rotations = {kind: _cos_sin(cfg, _kind_rope_parameters(cfg, kind), d, ids.shape[1]) for kind in (_S, _F)}
    dtype = getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    x = w["model.embed_tokens.weight"][ids] * torch.tensor(h ** 0.5, dtype=dtype).item()
    act = _ACT[cfg["hidden_activation"]]
    for i, kind in enumerate(_layer_kinds(cfg)):
        p = f"model.layers.{i}."
        a = _gemma_rms(x, w[p + "input_layernorm.weight"], eps)
        q = _gemma_rms(_heads(_lin(w, a, p + "self_attn.q_proj"), nh), w[p + "self_attn.q_norm.weight"], eps)
        k = _gemma_rms(_heads(_lin(w, a, p + "self_attn.k_proj"), nkv), w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rotate(q, *rotations[kind]), _rotate(k, *rotations[kind])
        v = _heads(_lin(w, a, p + "self_attn.v_proj"), nkv)
        window = cfg["sliding_window"] if kind == _S else None
        o = _merge(_attend(q, k, v, cfg["query_pre_attn_scalar"] ** -0.5, window))
        x = x + _gemma_rms(_lin(w, o, p + "self_attn.o_proj"), w[p + "post_attention_layernorm.weight"], eps)
        m = _gemma_rms(x, w[p + "pre_feedforward_layernorm.weight"], eps)
        g = act(_lin(w, m, p + "mlp.gate_proj")) * _lin(w, m, p + "mlp.up_proj")
        x = x + _gemma_rms(_lin(w, g, p + "mlp.down_proj"), w[p + "post_feedforward_layernorm.weight"], eps)
    x = _gemma_rms(x, w["model.norm.weight"], eps)
    return x @ (w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]).T


def _olmo2_logits(cfg, w, ids):
    """modeling_olmo2.Olmo2ForCausalLM and modeling_olmo3.Olmo3ForCausalLM: q_norm and k_norm (Olmo2RMSNorm) over each
    whole projection before its heads are cut and rotated; an Olmo2RMSNorm after attention and after the MLP, inside
    the residual branch (Olmo2DecoderLayer), none before; OLMo 3's sliding layers (layer_types) with their window and
    an unscaled rotation (Olmo3Model's rotary_embs["sliding_attention"], rope_type default)."""
    h, nh, nkv, eps = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps"))
    d, t, olmo3 = cfg.get("head_dim") or h // nh, ids.shape[1], cfg["model_type"] == "olmo3"
    kinds = _layer_kinds(cfg) if olmo3 else [_F] * cfg["num_hidden_layers"]
    rotations = ({kind: _cos_sin(cfg, _kind_rope_parameters(cfg, kind), d, t) for kind in (_S, _F)} if olmo3
                 else {_F: _cos_sin(cfg, _rope_parameters(cfg), d, t)})
    x = w["model.embed_tokens.weight"][ids]
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}."
        q = _heads(_rms(_lin(w, x, p + "self_attn.q_proj"), w[p + "self_attn.q_norm.weight"], eps), nh)
        k = _heads(_rms(_lin(w, x, p + "self_attn.k_proj"), w[p + "self_attn.k_norm.weight"], eps), nkv)
        q, k = _rotate(q, *rotations[kind]), _rotate(k, *rotations[kind])
        v = _heads(_lin(w, x, p + "self_attn.v_proj"), nkv)
        o = _merge(_attend(q, k, v, d ** -0.5, cfg["sliding_window"] if kind == _S else None))
        x = x + _rms(_lin(w, o, p + "self_attn.o_proj"), w[p + "post_attention_layernorm.weight"], eps)
        x = x + _rms(_swiglu(w, x, p + "mlp."), w[p + "post_feedforward_layernorm.weight"], eps)
    x = _rms(x, w["model.norm.weight"], eps)
    return x @ (w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings", False) else w["lm_head.weight"]).T


# Gemma 3's multimodal names -> its language model's (the released files' and transformers 4.52's).
_LANGUAGE_MODEL = [(r"^(language_model\.model|model\.language_model)\.", "model."),
                   (r"^(language_model\.)?lm_head\.", "lm_head.")]


def _language_model(w):
    """A multimodal folder's language model's tensors under Gemma3ForCausalLM's names, its vision tower's and
    projector's left out."""
    return {re.sub(pattern, new, name): t for name, t in w.items() for pattern, new in _LANGUAGE_MODEL
            if re.match(pattern, name)}


def reference_logits(path, input_ids) -> torch.Tensor:
    """Logits (batch, seq, vocab_size) in float64 of the model in folder `path` for input_ids
    (batch, seq) at positions 0..seq-1, by a functional forward with Hugging Face's semantics."""
    cfg, w = _load(path)
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if cfg["model_type"] in ("gemma3_text", "gemma3"):
        return _gemma3_logits(cfg, _language_model(w) if cfg["model_type"] == "gemma3" else w, ids)
    if cfg["model_type"] in ("olmo2", "olmo3"):
        return _olmo2_logits(cfg, w, ids)
    if cfg["model_type"] == "gpt2":
        return _gpt2_logits(cfg, w, ids)
    if cfg["model_type"] in ("llama", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe", "qwen2_moe"):
        return _llama_logits(cfg, w, ids)
    if cfg["model_type"] == "deepseek_v3":
        return _deepseek_logits(cfg, w, ids)
    if cfg["model_type"] == "gpt_oss":
        return _gpt_oss_logits(cfg, w, ids)
    raise NotImplementedError(f"model_type {cfg['model_type']!r}")
