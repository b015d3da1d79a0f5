"""Hugging Face model folders in and out: continue training a released model, and hand the result back.

    torchrun --nproc_per_node 8 train.py --init-from Llama-3.2-1B --tp 2 --pp 2 ...   # start from its weights
    python -m tools.convert to-hf runs/x/checkpoint-00000100 llama-continued [--dtype bfloat16]  # and back

A Hugging Face model folder holds config.json (the architecture and its shape) and the weights in the
safetensors format: one model.safetensors, or model-0000N-of-0000M.safetensors with
model.safetensors.index.json naming the file of every tensor. This file reads GPT-2, Llama (2, 3, 3.1,
3.2), Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, gpt-oss, Gemma 3 (the language model
alone of its multimodal folders), OLMo 2 and OLMo 3 folders (docs/model-families.md: what each maps and what it
refuses); tools/convert.py writes any run's checkpoint as one, with the same tables.

Three things translate:
- the config (config_from_hf): each setting mapped to model.py's GPTConfig, and one it cannot represent
  refused by name (never approximated). Settings that only shape training (dropout, the router's
  auxiliary-loss coefficient, initialisation) are not the model's: they come from train.py's flags.
- the names (TABLES, one per architecture): each of model.py's tensors is made of Hugging Face tensors
  stacked along its rows (attention's q | k | v, SwiGLU's gate | up), stored transposed in GPT-2's
  Conv1D layers, for the vocabulary tables padded with zero rows past the vocabulary (model.py
  keeps the padding out of every prediction, so the logits are the released model's), and for
  DeepSeek-V3's rotated features and gpt-oss's interleaved gate and up with their rows in another order
  (`row_order`), and gpt-oss's experts a slice each of one tensor per layer. DeepSeek-V3's routing bias is a
  buffer of model.py's (route_bias), read and written like a weight.
- the values: `HuggingFaceValues` gives any elements of any of model.py's tensors, read from the files
  without loading a whole tensor (train.py's Share asks each rank's own elements, so a rank reads only
  what it will hold). gpt-oss's experts as released are MXFP4 (training/mxfp4.py), dequantized as read, an
  expert at a time.
"""
import dataclasses
import math
import os
import re
from dataclasses import dataclass

import torch

from training import mxfp4
from training.integrity import json_object
from training.tensorfile import TORCH_DTYPES, DamagedFile, SafetensorsFile
from model import GPT, GPTConfig, pad_vocabulary, tied_name, yarn_rotary_gain


class UnsupportedModel(ValueError):
    """A Hugging Face config with a setting model.py cannot represent."""


# ---------------------------------------------------------------------------
# Names: model.py's tensor <- the Hugging Face tensors it is made of
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """model.py's tensor is `names` stacked along its rows (dim 0); `transposed`: each is stored as (in,
    out), as GPT-2's Conv1D layers keep their weights, where model.py's nn.Linear keeps (out, in);
    `order`: rows in another order than model.py's, which `row_order` gives: DeepSeek-V3's rotated rows
    ("heads": the last qk_rope_head_dim rows of every head, "last": the tensor's last qk_rope_head_dim rows),
    or gpt-oss's gate and up rows in turn ("interleaved"); `stacked`: each name holds every expert of its
    layer along a first dimension, and model.py's tensor is the slice of its `expert`."""
    names: tuple
    transposed: bool = False
    order: str = ""
    stacked: bool = False
    expert: int = None


def conv1d(name):
    return Source((name,), transposed=True)


def one(name):
    return Source((name,))


GPT2 = {  # transformers' GPT2LMHeadModel
    "tok_emb.weight": one("transformer.wte.weight"),
    "pos_emb.weight": one("transformer.wpe.weight"),
    "blocks.{i}.norm1.weight": one("transformer.h.{i}.ln_1.weight"),
    "blocks.{i}.norm1.bias": one("transformer.h.{i}.ln_1.bias"),
    "blocks.{i}.attn.qkv.weight": conv1d("transformer.h.{i}.attn.c_attn.weight"),  # q | k | v already
    "blocks.{i}.attn.qkv.bias": one("transformer.h.{i}.attn.c_attn.bias"),
    "blocks.{i}.attn.proj.weight": conv1d("transformer.h.{i}.attn.c_proj.weight"),
    "blocks.{i}.attn.proj.bias": one("transformer.h.{i}.attn.c_proj.bias"),
    "blocks.{i}.norm2.weight": one("transformer.h.{i}.ln_2.weight"),
    "blocks.{i}.norm2.bias": one("transformer.h.{i}.ln_2.bias"),
    "blocks.{i}.mlp.fc.weight": conv1d("transformer.h.{i}.mlp.c_fc.weight"),
    "blocks.{i}.mlp.fc.bias": one("transformer.h.{i}.mlp.c_fc.bias"),
    "blocks.{i}.mlp.proj.weight": conv1d("transformer.h.{i}.mlp.c_proj.weight"),
    "blocks.{i}.mlp.proj.bias": one("transformer.h.{i}.mlp.c_proj.bias"),
    "norm.weight": one("transformer.ln_f.weight"),
    "norm.bias": one("transformer.ln_f.bias"),
    "lm_head.weight": one("lm_head.weight"),  # only when not tied (GPT-2's is)
}

LAYER = "model.layers.{i}."
ATTENTION = LAYER + "self_attn."
LLAMA_BLOCK = {  # transformers' LlamaForCausalLM, and Mistral's, Qwen2's, Qwen3's and the MoEs', which name alike
    "tok_emb.weight": one("model.embed_tokens.weight"),
    "blocks.{i}.norm1.weight": one(LAYER + "input_layernorm.weight"),
    "blocks.{i}.attn.qkv.weight": Source(tuple(ATTENTION + f"{x}_proj.weight" for x in "qkv")),
    "blocks.{i}.attn.qkv.bias": Source(tuple(ATTENTION + f"{x}_proj.bias" for x in "qkv")),  # Qwen2
    "blocks.{i}.attn.proj.weight": one(ATTENTION + "o_proj.weight"),
    "blocks.{i}.attn.proj.bias": one(ATTENTION + "o_proj.bias"),  # attention_bias
    "blocks.{i}.norm2.weight": one(LAYER + "post_attention_layernorm.weight"),
    "blocks.{i}.mlp.fc.weight": Source((LAYER + "mlp.gate_proj.weight", LAYER + "mlp.up_proj.weight")),
    "blocks.{i}.mlp.fc.bias": Source((LAYER + "mlp.gate_proj.bias", LAYER + "mlp.up_proj.bias")),  # mlp_bias
    "blocks.{i}.mlp.proj.weight": one(LAYER + "mlp.down_proj.weight"),
    "blocks.{i}.mlp.proj.bias": one(LAYER + "mlp.down_proj.bias"),
    "norm.weight": one("model.norm.weight"),
    "lm_head.weight": one("lm_head.weight"),
}
MIXTRAL_EXPERTS = {  # Mixtral's sparse MLP: the router, and per expert w1 (gate), w3 (up) and w2 (down)
    "blocks.{i}.mlp.router.weight": one(LAYER + "block_sparse_moe.gate.weight"),
    "blocks.{i}.mlp.experts.{e}.fc.weight": Source((LAYER + "block_sparse_moe.experts.{e}.w1.weight",
                                                    LAYER + "block_sparse_moe.experts.{e}.w3.weight")),
    "blocks.{i}.mlp.experts.{e}.proj.weight": one(LAYER + "block_sparse_moe.experts.{e}.w2.weight"),
}
LLAMA = LLAMA_BLOCK | MIXTRAL_EXPERTS
QK_NORM = {  # Qwen3's RMSNorm of each head's q and k (modeling_qwen3's q_norm, k_norm: head_dim weights)
    "blocks.{i}.attn.q_norm.weight": one(ATTENTION + "q_norm.weight"),
    "blocks.{i}.attn.k_norm.weight": one(ATTENTION + "k_norm.weight"),
}
QWEN_EXPERTS = {  # Qwen2-MoE's and Qwen3-MoE's sparse MLP (their SparseMoeBlock): the router is `gate`
    "blocks.{i}.mlp.router.weight": one(LAYER + "mlp.gate.weight"),
    "blocks.{i}.mlp.experts.{e}.fc.weight": Source((LAYER + "mlp.experts.{e}.gate_proj.weight",
                                                    LAYER + "mlp.experts.{e}.up_proj.weight")),
    "blocks.{i}.mlp.experts.{e}.proj.weight": one(LAYER + "mlp.experts.{e}.down_proj.weight"),
}
QWEN_SHARED_EXPERT = {  # Qwen2-MoE's: one MLP every token passes through, scaled by sigmoid(shared_expert_gate(x))
    "blocks.{i}.mlp.shared.fc.weight": Source((LAYER + "mlp.shared_expert.gate_proj.weight",
                                               LAYER + "mlp.shared_expert.up_proj.weight")),
    "blocks.{i}.mlp.shared.proj.weight": one(LAYER + "mlp.shared_expert.down_proj.weight"),
    "blocks.{i}.mlp.shared_gate.weight": one(LAYER + "mlp.shared_expert_gate.weight"),
}

# DeepSeek-V3 (transformers' DeepseekV3ForCausalLM): latent attention (model.py's LatentAttention) under its
# names, Llama's norms and dense MLPs (its first_k_dense_replace layers), and in the MoE layers the experts
# named as Qwen's, the router `gate` with its balancing bias (e_score_correction_bias, model.py's route_bias
# buffer), and shared_experts: one MLP of n_shared_experts experts' width, without a gate.
DEEPSEEK_ATTENTION = {
    "blocks.{i}.attn.q_down.weight": one(ATTENTION + "q_a_proj.weight"),
    "blocks.{i}.attn.q_down_norm.weight": one(ATTENTION + "q_a_layernorm.weight"),
    "blocks.{i}.attn.q_up.weight": Source((ATTENTION + "q_b_proj.weight",), order="heads"),
    "blocks.{i}.attn.kv_down.weight": Source((ATTENTION + "kv_a_proj_with_mqa.weight",), order="last"),
    "blocks.{i}.attn.kv_down_norm.weight": one(ATTENTION + "kv_a_layernorm.weight"),
    "blocks.{i}.attn.kv_up.weight": one(ATTENTION + "kv_b_proj.weight"),
}
DEEPSEEK_QUERIES_WITHOUT_BOTTLENECK = {  # q_lora_rank null (DeepSeek-V2-Lite's shape): one q_proj
    "blocks.{i}.attn.q_up.weight": Source((ATTENTION + "q_proj.weight",), order="heads"),
}
DEEPSEEK_MOE = {
    "blocks.{i}.mlp.route_bias": one(LAYER + "mlp.gate.e_score_correction_bias"),
    "blocks.{i}.mlp.shared.fc.weight": Source((LAYER + "mlp.shared_experts.gate_proj.weight",
                                               LAYER + "mlp.shared_experts.up_proj.weight")),
    "blocks.{i}.mlp.shared.proj.weight": one(LAYER + "mlp.shared_experts.down_proj.weight"),
}
DEEPSEEK_V3 = LLAMA_BLOCK | DEEPSEEK_ATTENTION | QWEN_EXPERTS | DEEPSEEK_MOE

# gpt-oss (transformers' GptOssForCausalLM): Llama's names for the embedding, the norms and attention (biases on
# q, k, v and o), a sink per head, and the MoE: the router with its bias, and every expert of a layer in one
# tensor of each kind (GptOssExperts), stored (in, out) as x @ W computes them: gate_up_proj (experts, in,
# 2 x width) with gate and up in turn along its last dimension (GptOssExperts' gate_up[..., ::2] and
# [..., 1::2]), down_proj (experts, width, in), and their biases (experts, out). model.py's expert e is slice e,
# transposed, its gate | up rows the folder's in half-split order.
GPT_OSS_SINKS_AND_MOE = {
    "blocks.{i}.attn.sinks": one(ATTENTION + "sinks"),
    "blocks.{i}.mlp.router.weight": one(LAYER + "mlp.router.weight"),
    "blocks.{i}.mlp.router.bias": one(LAYER + "mlp.router.bias"),
    "blocks.{i}.mlp.experts.{e}.fc.weight": Source((LAYER + "mlp.experts.gate_up_proj",), transposed=True,
                                                   order="interleaved", stacked=True),
    "blocks.{i}.mlp.experts.{e}.fc.bias": Source((LAYER + "mlp.experts.gate_up_proj_bias",), order="interleaved",
                                                 stacked=True),
    "blocks.{i}.mlp.experts.{e}.proj.weight": Source((LAYER + "mlp.experts.down_proj",), transposed=True,
                                                     stacked=True),
    "blocks.{i}.mlp.experts.{e}.proj.bias": Source((LAYER + "mlp.experts.down_proj_bias",), stacked=True),
}

# Gemma 3's language model (transformers' Gemma3ForCausalLM, model_type gemma3_text): Llama's names, QK-norm's
# q_norm and k_norm of each head, and four norms a block, before and after attention (input_layernorm,
# post_attention_layernorm) and before and after the MLP (pre_feedforward_layernorm, post_feedforward_layernorm).
# Every norm's weight is stored as Gemma's RMSNorm multiplies by (1 + w), and model.py's OffsetRMSNorm holds it so.
GEMMA3_NORMS = {
    "blocks.{i}.norm1.weight": one(LAYER + "input_layernorm.weight"),
    "blocks.{i}.post_norm1.weight": one(LAYER + "post_attention_layernorm.weight"),
    "blocks.{i}.norm2.weight": one(LAYER + "pre_feedforward_layernorm.weight"),
    "blocks.{i}.post_norm2.weight": one(LAYER + "post_feedforward_layernorm.weight"),
}
GEMMA3_TEXT = LLAMA_BLOCK | QK_NORM | GEMMA3_NORMS
# Gemma 3's multimodal model (Gemma3ForConditionalGeneration, model_type gemma3): its language model's tensors
# under model.language_model, as transformers 4.52 and later save them (the released files' names: see
# RELEASED_NAMES), the output layer under lm_head; its vision tower and projector are not model.py's.
GEMMA3 = {name: dataclasses.replace(s, names=tuple(re.sub(r"^model\.", "model.language_model.", n) for n in s.names))
          for name, s in GEMMA3_TEXT.items()}
# OLMo 2 (Olmo2ForCausalLM) and OLMo 3: Llama's names without a norm before either sub-layer; the norms after
# them are post_attention_layernorm (Llama's name for the one before the MLP) and post_feedforward_layernorm;
# q_norm and k_norm each one weight over the whole projection (model.py's ProjectionNorm).
PRE_NORMS = ("blocks.{i}.norm1.weight", "blocks.{i}.norm2.weight")
OLMO2 = {name: s for name, s in LLAMA_BLOCK.items() if name not in PRE_NORMS} | QK_NORM | {
    "blocks.{i}.post_norm1.weight": one(LAYER + "post_attention_layernorm.weight"),
    "blocks.{i}.post_norm2.weight": one(LAYER + "post_feedforward_layernorm.weight"),
}

TABLES = {"gpt2": GPT2, "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "mixtral": LLAMA,
          "qwen3": LLAMA_BLOCK | QK_NORM, "qwen3_moe": LLAMA_BLOCK | QK_NORM | QWEN_EXPERTS,
          "qwen2_moe": LLAMA_BLOCK | QWEN_EXPERTS | QWEN_SHARED_EXPERT, "deepseek_v3": DEEPSEEK_V3,
          "gpt_oss": LLAMA_BLOCK | GPT_OSS_SINKS_AND_MOE, "gemma3_text": GEMMA3_TEXT, "gemma3": GEMMA3,
          "olmo2": OLMO2, "olmo3": OLMO2}
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM"}
INDEXED = re.compile(r"(blocks|experts)\.(\d+)")


def table(model_type, config=None):
    """{model.py's name pattern: Source} of a model_type; config (model.py's GPTConfig): the variant of it
    that model has (DeepSeek-V3's queries without their bottleneck: q_proj; the default is q_b_proj)."""
    if model_type not in TABLES:
        raise UnsupportedModel(f"model_type {model_type!r} is not one of {sorted(TABLES)}")
    if model_type == "deepseek_v3" and config is not None and not config.q_lora_rank:
        return TABLES[model_type] | DEEPSEEK_QUERIES_WITHOUT_BOTTLENECK
    return TABLES[model_type]


def source(model_type, name, config=None):
    """The Hugging Face tensors of model.py's `name` (say blocks.3.attn.qkv.weight) in a model_type folder
    (config: as `table`)."""
    numbers = {"blocks": "i", "experts": "e"}
    pattern = INDEXED.sub(lambda m: f"{m.group(1)}.{{{numbers[m.group(1)]}}}", name)
    indices = {numbers[kind]: int(index) for kind, index in INDEXED.findall(name)}
    entries = table(model_type, config)
    if pattern not in entries:
        raise UnsupportedModel(f"{model_type} has no tensor for model.py's {name}")
    entry = entries[pattern]
    return dataclasses.replace(entry, names=tuple(n.format(**indices) for n in entry.names),
                               expert=indices["e"] if entry.stacked else None)


def has_source(model_type, name, config=None):
    """Whether a model_type folder holds a tensor for model.py's `name` (a parameter or a buffer)."""
    try:
        source(model_type, name, config)
        return True
    except UnsupportedModel:
        return False


def saved_buffers(model, model_type):
    """The names of model's buffers that a model_type folder holds (DeepSeek-V3's routing biases), in order."""
    persistent = model.state_dict(keep_vars=True)
    return [name for name, _ in model.named_buffers()
            if name in persistent and has_source(model_type, name, model.config)]


# DeepSeek-V3's rotated features. transformers' DeepseekV3Attention with rope_interleave (true unless the
# config says otherwise, and DeepSeek-V3's own files are written for it) turns the features of each head's
# rotated part in interleaved pairs (0, 1), (2, 3), ...: apply_rotary_pos_emb_interleave views them as
# (d/2, 2) and transposes that before its rotate_half, as DeepSeek's inference code turns consecutive pairs
# as complex numbers. model.py turns the pairs (i, i + d/2) of the half-split layout (Llama's). The two are
# one computation on the features in another order: model.py's feature j is the interleaved feature
# [0, 2, 4, ..., 1, 3, 5, ...][j], on the queries and on the keys alike, so q . k is unchanged. That order
# is a permutation of the rows that make those features (q_b_proj's, or q_proj's, last qk_rope_head_dim
# rows of every head; kv_a_proj_with_mqa's last qk_rope_head_dim rows): read in it, written back in the
# folder's own, the round trip is bit for bit and model.py has no interleaved rotation of its own.

def half_split_order(d):
    """[0, 2, 4, ..., 1, 3, 5, ...]: the interleaved features of a rotated part, in half-split order."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def row_order(parts, hf_config, config):
    """order (a LongTensor) where model.py's row j of a tensor made of `parts` is the folder's row order[j],
    or None where they are in the same order (no rows in another order, or a folder with rope_interleave
    false). gpt-oss's gate and up in turn are model.py's gate | up halves in the same way as DeepSeek-V3's
    interleaved pairs are its half-split ones."""
    if parts.order == "interleaved":
        return half_split_order(2 * config.d_expert)
    if not parts.order or not hf_config.get("rope_interleave", True):
        return None
    rope, head = config.qk_rope_head_dim, config.qk_nope_head_dim + config.qk_rope_head_dim
    if parts.order == "last":  # kv_down: the latent's rows, then the one shared key's rotated rows
        return torch.cat([torch.arange(config.kv_lora_rank), config.kv_lora_rank + half_split_order(rope)])
    heads = torch.arange(config.n_head * head).view(config.n_head, head)  # q_up: each head's unrotated | rotated
    unrotated, rotated = heads.split([config.qk_nope_head_dim, rope], dim=1)
    return torch.cat([unrotated, rotated[:, half_split_order(rope)]], dim=1).flatten()


# ---------------------------------------------------------------------------
# Configs: Hugging Face's config.json <-> model.py's GPTConfig
# ---------------------------------------------------------------------------

def with_layers(hf_config, n_layer):
    """hf_config (a config.json's dict) of the model model.py holds of it: its first n_layer blocks (train.py
    --layers), and none of DeepSeek-V3's multi-token-prediction layers. Those (num_nextn_predict_layers of
    them, stored as the layers after the last, model.layers.61 in DeepSeek-V3) are a training objective's
    extra modules, which transformers' DeepseekV3ForCausalLM does not load either: they are read past, and
    an export holds none of them, so its config says num_nextn_predict_layers 0 (claiming them without
    their tensors would be a broken folder to whatever reads it for speculative decoding). The model is held
    dequantized (gpt-oss's MXFP4 experts read as numbers of the run's dtype), so it has no quantization_config:
    an export writes its experts as such, which transformers loads as they are. Of Gemma 3's multimodal model
    the language model alone is held: its gemma3_text config (language_model), which an export writes, and
    Gemma3ForCausalLM loads."""
    hf_config = language_model(hf_config)
    key = "n_layer" if hf_config.get("model_type") == "gpt2" else "num_hidden_layers"
    held = {setting: value for setting, value in hf_config.items() if setting != "quantization_config"}
    held[key] = n_layer
    if isinstance(hf_config.get("layer_types"), list):  # (the kinds of the layers kept)
        held["layer_types"] = hf_config["layer_types"][:n_layer]
    if hf_config.get("num_nextn_predict_layers"):
        held["num_nextn_predict_layers"] = 0
    return held


def read_config(folder):
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UnsupportedModel(f"{folder}: not a Hugging Face model folder (no config.json)")
    return json_object(path, UnsupportedModel)


def refuse(hf, setting, why):
    raise UnsupportedModel(f"{hf.get('model_type')} with {setting}={hf.get(setting)!r}: {why}")


# Gemma3TextConfig's defaults (transformers 4.57 and 5 alike), for the settings a config.json leaves out: Gemma 3's
# multimodal releases give their text_config's few that differ (google/gemma-3-4b-it: six). The rotary settings'
# are DEFAULT_THETA's and per_kind_rope_fields', since a rotary setting filled in here would seem to be stated.
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                            hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
                            tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096)
# Defaults of the families' own config classes where the Llama block's reader would take others: Olmo2Config's and
# Olmo3Config's norm epsilon (1e-5, where Llama's reader takes 1e-6 for a config stating none), Olmo3Config's window.
CLASS_DEFAULTS = {"gemma3_text": GEMMA3_TEXT_DEFAULTS, "olmo2": dict(rms_norm_eps=1e-5),
                  "olmo3": dict(rms_norm_eps=1e-5, sliding_window=4096)}


def language_model(hf):
    """The config of the decoder a config.json describes: itself, or of Gemma 3's multimodal model
    (Gemma3ForConditionalGeneration, model_type gemma3) its language model's, text_config, as a gemma3_text config
    (Gemma3ForCausalLM's) with Gemma3TextConfig's defaults written out. Its vision tower and projector
    (vision_config, mm_tokens_per_image and the image tokens) are another model's: model.py holds the language model
    alone, which reads text as the multimodal model does (whose attention is bidirectional among an image's tokens
    alone), and the folder's vision tensors are left unread. transformers 4 ties the output layer by text_config's
    tie_word_embeddings, 5 by the top level's: where the two differ, refused."""
    if hf.get("model_type") != "gemma3":
        return hf
    text = hf.get("text_config") or {}
    if not isinstance(text, dict) or text.get("model_type", "gemma3_text") != "gemma3_text":
        refuse(hf, "text_config", "Gemma 3's language model is a gemma3_text config")
    tied = {setting.get("tie_word_embeddings", True) for setting in (text, hf)}
    if len(tied) > 1:
        refuse(hf, "tie_word_embeddings", "its text_config says otherwise: transformers 4 ties the output layer by "
                                          "text_config's, 5 by this one")
    return GEMMA3_TEXT_DEFAULTS | text | dict(model_type="gemma3_text", tie_word_embeddings=tied.pop())


def config_from_hf(hf, seq_len, **training):
    """model.py's GPTConfig of a Hugging Face config (a dict), for training on sequences of seq_len tokens;
    `training`: the GPTConfig fields that are training choices (the MoE balancing), from the flags."""
    hf = language_model(hf)
    model_type = hf.get("model_type")
    if model_type not in TABLES:
        raise UnsupportedModel(f"model_type {model_type!r} is not one of {sorted(TABLES)}")
    hf = CLASS_DEFAULTS.get(model_type, {}) | hf
    try:
        fields = READERS.get(model_type, llama_fields)(hf)
    except UnsupportedModel:
        raise
    except KeyError as e:
        raise UnsupportedModel(f"{model_type}: its config.json has no {e}") from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:  # a setting of another type than its own
        raise UnsupportedModel(f"{model_type}: a setting of its config.json is not of its type ({e})") from None
    vocab = hf["vocab_size"]
    fields.update(vocab_size=vocab, padded_vocab_size=pad_vocabulary(vocab) if type(vocab) is int else vocab,
                  seq_len=seq_len)
    check_types(model_type, fields)
    try:
        return GPTConfig(**fields, **training)
    except ValueError as e:
        raise UnsupportedModel(f"{model_type}: {e}") from None


SIZES = ("vocab_size", "n_layer", "n_head", "d_model", "max_seq_len")  # of at least 1; the others at least 0


def check_types(model_type, fields):
    """A config.json's settings must be of the types GPTConfig's fields are (a size a whole number, a rate a
    finite number, a switch true or false): a damaged or hand-edited file fails here, in one line, rather
    than as a traceback from deep in the model."""
    for field in dataclasses.fields(GPTConfig):
        if field.name not in fields:
            continue
        value, kind = fields[field.name], type(field.default)
        if kind is int:
            fine = type(value) is int and value >= (1 if field.name in SIZES else 0)
        elif kind is float:
            fine = type(value) in (int, float) and math.isfinite(value)
        elif kind is bool or field.default is None:
            fine = type(value) is bool
        elif field.name in ("moe_layers", "window_layers"):
            fine = all(type(i) is int for i in value)
        else:
            fine = isinstance(value, kind)
        if not fine:
            raise UnsupportedModel(f"{model_type}: its config.json makes model.py's {field.name} {str(value)[:40]!r}, "
                                   f"not {'a positive' if field.name in SIZES else 'a'} {kind.__name__}")


GELU = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def gpt2_fields(hf):
    for setting, allowed, why in [
            ("activation_function", GELU, "model.py has GELU, exact or tanh-approximated"),
            ("scale_attn_weights", (True, None), "model.py scales attention by 1/sqrt(head size)"),
            ("scale_attn_by_inverse_layer_idx", (False, None), "model.py does not scale by the layer index"),
            ("add_cross_attention", (False, None), "model.py is a decoder alone")]:
        if hf.get(setting) not in allowed:
            refuse(hf, setting, why)
    d = hf["n_embd"]
    return dict(n_layer=hf["n_layer"], n_head=hf["n_head"], d_model=d, d_ff=hf.get("n_inner") or 4 * d,
                max_seq_len=hf["n_positions"], position="learned", norm="layer",
                norm_eps=hf.get("layer_norm_epsilon", 1e-5), mlp=GELU[hf.get("activation_function")],
                bias=True, tie_embeddings=hf.get("tie_word_embeddings", True))


def llama_fields(hf):
    model_type, d, heads = hf["model_type"], hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("hidden_act", "silu") != "silu":
        refuse(hf, "hidden_act", "model.py's gated MLP is SwiGLU (silu)")
    bias = hf.get("attention_bias", False)
    if model_type == "llama" and hf.get("mlp_bias", False) != bias:
        refuse(hf, "mlp_bias", "model.py has biases in every linear layer or in none (besides q, k, v)")
    fields = dict(n_layer=hf["num_hidden_layers"], n_head=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
                  head_dim=hf.get("head_dim") or d // heads,  # wider than hidden_size / heads in Mistral NeMo, Qwen3
                  d_model=d, d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
                  position="rope", norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", bias=bias,
                  qkv_bias=True if model_type == "qwen2" else bias,
                  tie_embeddings=hf.get("tie_word_embeddings", False),
                  **(kinds_fields(hf) if model_type in PER_KIND else rope_fields(hf) | window_fields(hf)))
    return fields | FAMILY_FIELDS.get(model_type, lambda hf: {})(hf)


LAYER_TYPES = ("full_attention", "sliding_attention")


def window_fields(hf):
    """model.py's sliding_window and window_layers from a Llama-block config: Mistral's and Mixtral's
    sliding_window on every layer; the Qwens' only with use_sliding_window (their config classes set
    sliding_window to None otherwise), on the layers from max_window_layers on, or where the config lists each
    layer's kind (layer_types, as transformers 5 writes it, and 4.5x reads it), on its "sliding_attention"
    ones. A window of None or 0: none. A window longer than the training sequence changes nothing in training
    but is kept (for generation, and to write it back)."""
    n, qwen = hf["num_hidden_layers"], hf["model_type"].startswith("qwen")
    window = hf.get("sliding_window") if not qwen or hf.get("use_sliding_window", False) else None
    if not window:
        return {}
    kinds = hf.get("layer_types") or default_layer_types(hf)
    if len(kinds) != n or not set(kinds) <= set(LAYER_TYPES):
        refuse(hf, "layer_types", f"model.py's layers are {' or '.join(LAYER_TYPES)}, one each of {n}")
    layers = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    return dict(sliding_window=window, window_layers=() if len(layers) == n else layers) if layers else {}


def default_layer_types(hf):
    """Each layer's kind where a config lists none, as its config class makes them: Mistral's window on every
    layer, the Qwens' from max_window_layers on, gpt-oss's on every second layer from the first, Gemma 3's on
    every layer but each sliding_window_pattern-th (6 by default: Gemma3TextConfig, as its releases before
    transformers 4.53 say it), OLMo 3's on every layer but each fourth (Olmo3Config)."""
    n, model_type = hf["num_hidden_layers"], hf["model_type"]
    if model_type == "gpt_oss":  # (GptOssConfig: sliding and full attention in turn, sliding first)
        return ["full_attention" if i % 2 else "sliding_attention" for i in range(n)]
    if model_type in ("gemma3_text", "olmo3"):
        every = hf.get("sliding_window_pattern", 6) if model_type == "gemma3_text" else 4
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    first = hf.get("max_window_layers", n) if model_type.startswith("qwen") else 0
    return ["full_attention" if i < first else "sliding_attention" for i in range(n)]


def mixtral_fields(hf):
    return dict(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"])


def qwen3_fields(hf):
    """Qwen3 (modeling_qwen3): an RMSNorm of head_dim weights on each head's q and k before the rotation, and
    attention_bias on q, k, v and o alike but never in the MLP."""
    if hf.get("attention_bias", False):
        refuse(hf, "attention_bias", "biases on q, k, v and o but not in the MLP: model.py has biases in every "
                                     "linear layer or in none (besides q, k, v)")
    return dict(qk_norm=True)


def qwen_experts_fields(hf):
    """The sparse MLP of Qwen2-MoE and Qwen3-MoE (their SparseMoeBlock): experts of moe_intermediate_size in the
    layers that are not in mlp_only_layers and whose number + 1 is a multiple of decoder_sparse_step (their
    DecoderLayer's test), dense MLPs of intermediate_size in the others; the top-k gates renormalised only
    with norm_topk_prob (False by default in both config classes)."""
    layers, step, experts = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1), expert_count(hf)
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0] if experts else []
    if not sparse:
        return {}  # every MLP dense: intermediate_size alone
    return dict(n_experts=experts, top_k=hf["num_experts_per_tok"], d_expert=hf["moe_intermediate_size"],
                norm_topk_prob=hf.get("norm_topk_prob", False), moe_layers=() if len(sparse) == layers else sparse)


def expert_count(hf):
    """A Qwen MoE's number of experts, under either of its names: num_experts (as transformers 4 and 5.0
    write it) or num_local_experts (as 5.24 writes Qwen3-MoE's, Mixtral's key); both, differing, refused.
    None: no experts."""
    counts = {hf[key] for key in ("num_experts", "num_local_experts") if hf.get(key) is not None}
    if len(counts) > 1:
        refuse(hf, "num_local_experts", f"it also says num_experts={hf['num_experts']!r}: two expert counts")
    return counts.pop() if counts else None


def qwen2_moe_fields(hf):
    """Qwen2-MoE: Qwen2's biases on q, k, v (transformers 5's qkv_bias, True; 4 always has them), and beside the
    experts one shared expert of shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate(x))."""
    experts = qwen_experts_fields(hf)
    shared = dict(n_shared_experts=1, d_shared=hf["shared_expert_intermediate_size"], shared_expert_gate=True)
    return dict(qkv_bias=hf.get("qkv_bias", True), **experts, **(shared if experts else {}))


def gpt_oss_fields(hf):
    """gpt-oss (transformers' GptOssConfig): the Llama block with biases on q, k, v and o (attention_bias) and
    in its experts and router (always), a sink per head (always), and in every layer num_local_experts experts
    of intermediate_size, clamped SwiGLUs (swiglu_limit, and the sigmoid's gain swiglu_alpha), whose router's
    top num_experts_per_tok logits are softmaxed among themselves: model.py's renormalised softmax, the same
    gates. Its experts as released are MXFP4 (quantization_config: mxfp4), read here dequantized."""
    quantization = hf.get("quantization_config")
    if quantization is not None and (not isinstance(quantization, dict) or quantization.get("quant_method") != "mxfp4"):
        refuse(hf, "quantization_config", "gpt-oss's released experts are MXFP4, which is read here; no other "
                                          "quantisation is")
    for setting, allowed, why in [
            ("attention_bias", (True, None), "gpt-oss's experts and router have biases whatever it says, and "
                                             "model.py has biases in every linear layer or in none"),
            ("swiglu_limit", (7, 7.0, None), "model.py's clamped SwiGLU clamps at 7, gpt-oss's own limit"),
            ("swiglu_alpha", (1.702, None), "model.py's clamped SwiGLU's sigmoid gain is 1.702, gpt-oss's own")]:
        if hf.get(setting) not in allowed:
            refuse(hf, setting, why)
    width = hf["intermediate_size"]
    return dict(bias=True, qkv_bias=True, attention_sinks=True, mlp="clamped_swiglu", router_bias=True,
                n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], d_expert=width, d_ff=width,
                norm_topk_prob=True)


def olmo2_fields(hf):
    """OLMo 2 (transformers' Olmo2ForCausalLM): the Llama block with its RMSNorms after each sub-layer, inside the
    residual branch (post_attention_layernorm, post_feedforward_layernorm), none before, and QK-norm over the whole
    q and k projections before their heads are cut and rotated (q_norm of num_attention_heads x head_dim weights,
    k_norm of num_key_value_heads x head_dim); attention_bias would put biases on q, k, v and o but none in the MLP."""
    if hf.get("attention_bias", False):
        refuse(hf, "attention_bias", "biases on q, k, v and o but not in the MLP: model.py has biases in every "
                                     "linear layer or in none (besides q, k, v)")
    return dict(norm_placement="post", qk_norm=True, qk_norm_scope="projection")


OLMO3_THETA = 500000.0  # OLMo 3's own rotary base, Olmo3Config's default_theta in transformers 5


def olmo3_fields(hf):
    """OLMo 3 (Olmo3ForCausalLM): OLMo 2's block with windows on the layers layer_types names sliding (three of every
    four by default), which turn unscaled where rope_scaling scales the others (transformers 4.57's and 5.24's; 5.0
    turned every layer alike). In transformers 4's form (rope_theta, rope_scaling) transformers 5 turns the sliding
    layers by 500,000 whatever rope_theta says (Olmo3Config.convert_rope_params_to_dict gives rope_theta to the full
    ones alone), 4 by rope_theta: such a file is one model to both with rope_theta 500,000 alone."""
    if hf.get("rope_parameters") is None and hf.get("rope_theta") != OLMO3_THETA:
        refuse(hf, "rope_theta", f"transformers 4 turns OLMo 3's sliding layers by rope_theta, 5 by {OLMO3_THETA:,.0f} "
                                 f"where rope_parameters does not say: two models")
    return olmo2_fields(hf)


def gemma3_fields(hf):
    """Gemma 3's language model (transformers' Gemma3ForCausalLM; Gemma3ForConditionalGeneration's, see
    language_model): Gemma's RMSNorm x / rms(x) * (1 + w) before and after each sub-layer (sandwich), QK-norm of
    each head by it before the rotation, GeGLU (gelu_pytorch_tanh), scores scaled by query_pre_attn_scalar^-1/2, the
    embeddings multiplied by sqrt(hidden_size) (rounded to the weights' dtype), no biases; windows on the layers
    layer_types names sliding, which turn by their own base unscaled (rope_local_base_freq), the others by
    rope_theta, scaled (linear) or not (kinds_fields)."""
    for setting, allowed, why in [
            ("hidden_activation", ("gelu_pytorch_tanh",), "model.py's GeGLU is the tanh-approximated GELU's"),
            ("attn_logit_softcapping", (None,), "model.py does not cap the attention scores (Gemma 2's soft-capping)"),
            ("final_logit_softcapping", (None,), "model.py does not cap the logits (Gemma 2's soft-capping)"),
            ("attention_bias", (False, None), "model.py's Gemma block has no biases"),
            ("use_bidirectional_attention", (False, None), "model.py's attention is causal (EmbeddingGemma's is not)")]:
        if hf.get(setting) not in allowed:
            refuse(hf, setting, why)
    if not hf["query_pre_attn_scalar"] > 0:
        refuse(hf, "query_pre_attn_scalar", "the scores are scaled by its inverse square root: it is positive")
    return dict(n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"],
                n_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"], d_model=hf["hidden_size"],
                d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"], position="rope",
                norm="rms_offset", norm_placement="sandwich", norm_eps=hf["rms_norm_eps"], mlp="geglu", bias=False,
                qkv_bias=False, qk_norm=True, query_scale=hf["query_pre_attn_scalar"], scale_embedding=True,
                tie_embeddings=hf["tie_word_embeddings"], **kinds_fields(hf))


def kinds_fields(hf):
    """The windows and each kind's rotation of a family whose kinds of layer rotate apart (Gemma 3, OLMo 3): its
    sliding layers need a window (transformers builds their mask of it, and rotates them as sliding ones)."""
    fields = window_fields(hf)
    if "sliding_attention" in (hf.get("layer_types") or default_layer_types(hf)) and not hf.get("sliding_window"):
        refuse(hf, "sliding_window", "its sliding layers have no window")
    return fields | per_kind_rope_fields(hf)


FAMILY_FIELDS = {"mixtral": mixtral_fields, "qwen3": qwen3_fields, "qwen2_moe": qwen2_moe_fields,
                 "qwen3_moe": lambda hf: qwen3_fields(hf) | qwen_experts_fields(hf), "gpt_oss": gpt_oss_fields,
                 "olmo2": olmo2_fields, "olmo3": olmo3_fields}


# DeepSeek-V3's settings where its config.json leaves them out: DeepseekV3Config's defaults, the same in
# transformers 4 and 5 (DeepSeek-V3 671B's own values).
DEEPSEEK_DEFAULTS = dict(q_lora_rank=1536, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
                         n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True)


def deepseek_setting(hf, name):
    return hf.get(name, DEEPSEEK_DEFAULTS[name])


def deepseek_fields(hf):
    """DeepSeek-V3 (transformers' DeepseekV3ForCausalLM): Llama's block with multi-head latent attention, its
    first first_k_dense_replace layers dense MLPs of intermediate_size, the others DeepSeek-V3's MoE:
    n_routed_experts of moe_intermediate_size scored by a sigmoid each, chosen within the topk_group best of
    n_group groups, their gates renormalised (norm_topk_prob) and multiplied by routed_scaling_factor, beside
    one shared MLP of n_shared_experts experts' width. Rotary positions on qk_rope_head_dim features of each
    head, YaRN-scaled or not; with rope_interleave in interleaved pairs (see `row_order`).

    The experts outside a token's best groups are masked with -inf by model.py's `best_groups_only` (as
    DeepSeek's inference code does) and with 0.0 by transformers' DeepseekV3TopkRouter. The two choose the
    same experts whenever every choice score (sigmoid + e_score_correction_bias) of the allowed groups is
    positive: with a zero bias always, and with DeepSeek-V3's, small beside the sigmoids, in practice. Only
    an allowed expert whose score plus bias is negative tells them apart: transformers would then prefer an
    expert of a group it had just ruled out."""
    refuse_deepseek_settings(hf)
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    routing = dict(router_scoring="sigmoid", top_k=deepseek_setting(hf, "num_experts_per_tok"),
                   n_group=deepseek_setting(hf, "n_group"), topk_group=deepseek_setting(hf, "topk_group"),
                   norm_topk_prob=deepseek_setting(hf, "norm_topk_prob"),
                   routed_scaling_factor=float(deepseek_setting(hf, "routed_scaling_factor")),
                   n_shared_experts=deepseek_setting(hf, "n_shared_experts") or 0,  # (null: none, DeepSeek's code)
                   d_expert=hf["moe_intermediate_size"])
    latent = dict(kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=deepseek_setting(hf, "q_lora_rank") or 0,
                  qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                  v_head_dim=hf["v_head_dim"])
    return dict(n_layer=layers, n_head=heads, d_model=hf["hidden_size"], d_ff=hf["intermediate_size"],
                max_seq_len=hf["max_position_embeddings"], position="rope", norm="rms",
                norm_eps=deepseek_setting(hf, "rms_norm_eps"), mlp="swiglu", bias=False, qkv_bias=False,
                tie_embeddings=deepseek_setting(hf, "tie_word_embeddings"), **latent, **routing,
                **deepseek_moe_layers(hf), **rope_fields(hf))


READERS = {"gpt2": gpt2_fields, "deepseek_v3": deepseek_fields, "gemma3_text": gemma3_fields}  # (others: llama_fields)


def deepseek_moe_layers(hf):
    """n_experts and moe_layers: DeepseekV3DecoderLayer makes layer i an MoE where i >= first_k_dense_replace
    (every layer: moe_layers empty, as model.py says it; none, where that is every layer: no experts at all)."""
    layers = hf["num_hidden_layers"]
    dense = min(deepseek_setting(hf, "first_k_dense_replace"), layers)
    if dense == layers:
        return dict(n_experts=0)
    return dict(n_experts=deepseek_setting(hf, "n_routed_experts"), moe_layers=tuple(range(dense, layers)) if dense
                else ())


def refuse_deepseek_settings(hf):
    """The DeepSeek-V3 settings model.py cannot represent, or that transformers and DeepSeek's own code read
    differently, refused by name."""
    heads, rope, nope = hf["num_attention_heads"], hf["qk_rope_head_dim"], hf["qk_nope_head_dim"]
    for setting, allowed, why in [
            ("hidden_act", ("silu", None), "model.py's gated MLP is SwiGLU (silu)"),
            ("attention_bias", (False, None), "model.py's latent attention has no biases"),
            ("quantization_config", (None,), "its weights are stored quantised (DeepSeek-V3's own files: float8 "
                                             "blocks with their scales): dequantise the folder (to bfloat16) first"),
            ("topk_method", ("noaux_tc", None), "transformers' DeepseekV3 routes by noaux_tc alone (sigmoid "
                                                "scores, groups, a bias for the choice), whatever this says; "
                                                "DeepSeek-V2's greedy and group_limited_greedy are softmax routers "
                                                "it does not compute, nor does model.py here"),
            ("scoring_func", ("sigmoid", None), "DeepSeek-V3's router scores each expert by a sigmoid "
                                                "(transformers' DeepseekV3TopkRouter has no other)"),
            ("moe_layer_freq", (1, None), "transformers' DeepseekV3 makes every layer from first_k_dense_replace "
                                          "on an MoE"),
            ("num_key_value_heads", (heads, None), "latent attention gives every head its own keys and values"),
            ("head_dim", (rope, None), "DeepseekV3Config's head_dim is qk_rope_head_dim, the rotated features"),
            ("qk_head_dim", (nope + rope, None), "a head's query and key are qk_nope_head_dim + qk_rope_head_dim"),
            ("rope_interleave", (True, False, None), "it is true or false")]:
        if hf.get(setting) not in allowed:
            refuse(hf, setting, why)
    if hf.get("q_lora_rank") == 0:
        refuse(hf, "q_lora_rank", "transformers would build a query bottleneck of no width (null means none)")


# The rotary settings, in the two forms transformers writes them:
# - transformers 4 (models/*/configuration_*.py, up to 4.57): at the top level, `rope_theta`, and for Llama
#   and Qwen2 `rope_scaling`: null, or a dict naming its kind by `rope_type` (or the older `type`) beside the
#   kind's values, Llama 3.1's {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
#   "original_max_position_embeddings"}. Mistral's and Mixtral's configs have no rope_scaling attribute
#   (their rotary embedding still reads one the file has).
# - transformers 5 (modeling_rope_utils.py's RotaryEmbeddingConfigMixin, 5.0 to 5.24): one dict,
#   `rope_parameters`, holding rope_theta and rope_type beside the kind's values (standardize_rope_params
#   fills in both before a save, and original_max_position_embeddings for llama3), and neither top-level key.
#   It reads the first form too (convert_rope_params_to_dict: a rope_scaling replaces rope_parameters, a
#   top-level rope_theta fills in one rope_parameters lacks); transformers 4 reads only the first.
#   rope_parameters nested by attention kind ({"full_attention": {...}, "sliding_attention": {...}}) is for
#   models whose kinds of layer rotate differently (Gemma 3 and OLMo 3, PER_KIND: per_kind_rope_fields): the
#   rotary embedding of Llama, Mistral, Qwen2 and Mixtral reads one flat dict (rope_parameters["rope_type"]), so
#   a nested one is refused for them.
# Both forms in one file (edited by hand, or by a tool that knows one of them): where each states a value,
# they must agree, or the folder is refused by name, since transformers 4 and 5 would each take another one.
ROPE_FORMS = ("rope_scaling", "rope_parameters")  # transformers 4's dict, transformers 5's
LLAMA3 = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
          "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_context"}
# A file that states no rope_theta at all rotates by its config class's default, the same in transformers 4
# and 5: 10000.0 for Llama, Mistral, Qwen2, Qwen3 and the Qwen MoEs (their rope_theta argument in 4,
# RotaryEmbeddingConfigMixin's default_theta in 5), 1e6 for Mixtral (rope_theta=1e6 in 4,
# MixtralConfig.default_theta in 5), 150,000 for gpt-oss (GptOssConfig.default_theta), 1e6 for Gemma 3's full
# layers and 10,000 for its sliding ones (rope_local_base_freq; Gemma3TextConfig.default_theta in 5), 10,000 for
# OLMo 2. Neither version depends on which wrote the file, so the default is taken, not refused. (OLMo 3's is
# 10,000 in 4, 500,000 in 5: a file in 4's form states its own or is refused, olmo3_fields; 5's default stands
# for a rope_parameters without one.)
DEFAULT_THETA = {"llama": 10000.0, "mistral": 10000.0, "qwen2": 10000.0, "mixtral": 1e6, "qwen3": 10000.0,
                 "qwen3_moe": 10000.0, "qwen2_moe": 10000.0, "deepseek_v3": 10000.0, "gpt_oss": 150000.0,
                 "gemma3_text": 1e6, "olmo2": 10000.0, "olmo3": OLMO3_THETA}
GEMMA3_LOCAL_THETA = 10000.0
PER_KIND = ("gemma3_text", "olmo3")  # the families whose kinds of layer rotate apart


def per_kind_rope_fields(hf):
    """GPTConfig's rotary fields of a family whose kinds of layer rotate apart (PER_KIND): the full layers' base and
    scaling (rope_theta and rope_scaling, transformers 5's rope_parameters["full_attention"]), and the sliding
    layers' base (Gemma 3's rope_local_base_freq, OLMo 3's rope_theta; rope_parameters["sliding_attention"]), which
    they turn by unscaled: local_rope_theta, 0 where that is the full layers' own rotation. Each kind is read as one
    flat config by rope_fields (kind_view), both forms compared. Transformers 5 writes rope_parameters per kind for
    these families, and reads a flat one past (its Gemma3TextConfig and Olmo3Config keep the kinds' defaults)."""
    nested = hf.get("rope_parameters")
    if nested is not None and (not isinstance(nested, dict) or not set(nested) <= set(LAYER_TYPES)):
        refuse(hf, "rope_parameters", f"not one dict of rotary settings per kind of layer ({', '.join(LAYER_TYPES)}),"
                                      f" which transformers 5 reads for {hf['model_type']}")
    full, sliding = (kind_rope_fields(hf, kind) for kind in LAYER_TYPES)
    if len(sliding) > 1:
        refuse(hf, "rope_parameters", "its sliding layers' rotation scaled: model.py turns them unscaled, by "
                                      "local_rope_theta")
    local = sliding["rope_theta"]
    return full | dict(local_rope_theta=0.0 if local == full["rope_theta"] and len(full) == 1 else local)


def kind_rope_fields(hf, kind):
    """rope_fields of one kind of layer, read from its settings as one flat config: the top-level base (the
    sliding layers' own for Gemma 3, its default where no form states one), rope_scaling for the full layers
    (transformers 4 scales those alone), and rope_parameters[kind]; a refusal names the kind."""
    local = (hf["model_type"], kind) == ("gemma3_text", "sliding_attention")
    base, nested = "rope_local_base_freq" if local else "rope_theta", (hf.get("rope_parameters") or {}).get(kind)
    view = {key: hf[key] for key in ("model_type", "max_position_embeddings", "partial_rotary_factor") if key in hf}
    if nested is not None:
        view["rope_parameters"] = nested
    if base in hf or (local and not (isinstance(nested, dict) and nested.get("rope_theta") is not None)):
        view["rope_theta"] = hf.get(base, GEMMA3_LOCAL_THETA)
    if kind == "full_attention" and "rope_scaling" in hf:
        view["rope_scaling"] = hf["rope_scaling"]
    try:
        return rope_fields(view)
    except UnsupportedModel as e:
        raise UnsupportedModel(f"{e} (its {kind} layers' rotary settings)") from None


def rope_fields(hf):
    """GPTConfig's rotary fields (rope_theta, and Llama 3.1's scaling) from either form of a config."""
    model_type, forms = hf["model_type"], {name: hf[name] for name in ROPE_FORMS if name in hf}
    for name, form in forms.items():
        if form is not None and not isinstance(form, dict):
            refuse(hf, name, "not a dict of rotary settings")
        if any(isinstance(value, dict) or key.endswith("attention") for key, value in (form or {}).items()):
            refuse(hf, name, f"one set of rotary settings per attention kind: transformers' {model_type} "
                             "reads one flat dict, and model.py rotates every layer alike")
    thetas = {where: value for where, value in [("rope_theta", hf.get("rope_theta"))]
              + [(f"{name}['rope_theta']", (form or {}).get("rope_theta")) for name, form in forms.items()]
              if value is not None}
    disagree(hf, thetas)
    partial = [where for where, value in [("partial_rotary_factor", hf.get("partial_rotary_factor"))]
               + [(name, (form or {}).get("partial_rotary_factor")) for name, form in forms.items()]
               if value not in (None, 1, 1.0)]
    if partial:
        refuse(hf, partial[0], "model.py rotates the whole head (partial_rotary_factor 1)")
    scalings = {name: scaling(hf, name, form or {}) for name, form in forms.items()}
    disagree(hf, scalings, shown=forms)
    fields = dict(rope_theta=float(next(iter(thetas.values()), DEFAULT_THETA[model_type])))
    return fields | next(iter(scalings.values()), {})


def scaling(hf, name, form):
    """model.py's scaling fields of one form's dict (rope_scaling or rope_parameters): {} for none."""
    kinds = {form[key] for key in ("rope_type", "type") if form.get(key) is not None}
    if len(kinds) > 1:
        refuse(hf, name, "its rope_type and type disagree (transformers 4's Llama takes type, 5 takes rope_type)")
    kind = kinds.pop() if kinds else "default"
    if kind == "default":
        return {}
    readers = SCALINGS.get(hf["model_type"], {"llama3": llama3_scaling})
    if kind not in readers:
        refuse(hf, name, f"rope type {kind!r}: model.py reads {hf['model_type']}'s rotary scaling as "
                         f"{' or '.join(readers)} alone")
    return readers[kind](hf, name, form)


def llama3_scaling(hf, name, form):
    """Llama 3.1's (transformers' _compute_llama3_parameters)."""
    missing = [key for key in LLAMA3 if form.get(key) is None]
    if missing:
        refuse(hf, name, f"llama3 scaling without {', '.join(missing)}")
    return {field: form[key] for key, field in LLAMA3.items()}


def yarn_scaling(hf, name, form):
    """YaRN's, as transformers' _compute_yarn_parameters computes it (model.py's yarn_frequencies and
    yarn_gains): beta_fast and beta_slow 32 and 1 where null, mscale and mscale_all_dim 0 (not given) where
    absent, truncate true where absent (gpt-oss's is false: the ramp's ends where they fall), and the original
    context original_max_position_embeddings, else max_position_embeddings.

    Where the file states original_max_position_embeddings, transformers 4 (its later releases) scales by
    max_position_embeddings / original_max_position_embeddings in place of factor, transformers 5 by
    factor: a file where the two differ is two models, and refused (DeepSeek-V3's: 163,840 / 4,096 = 40). An
    attention_factor is read where it is the one transformers would compute without it (OLMo 3's files state it).
    """
    if form.get("factor") is None:
        refuse(hf, name, "yarn scaling without factor")
    if type(form.get("truncate", True)) is not bool:
        refuse(hf, name, "truncate is true (the ramp's ends rounded to whole pairs, the default) or false")
    factor, positions = float(form["factor"]), hf["max_position_embeddings"]
    if form.get("attention_factor") not in (None, yarn_rotary_gain(factor, form.get("mscale"),
                                                                     form.get("mscale_all_dim"))):
        refuse(hf, name, "an attention_factor of its own: model.py's is YaRN's, from mscale and mscale_all_dim")
    context = form.get("original_max_position_embeddings") or positions
    if form.get("original_max_position_embeddings") is not None and positions / context != factor:
        refuse(hf, name, f"factor {factor} is not max_position_embeddings / original_max_position_embeddings "
                         f"({positions} / {context}): transformers 4 scales by the ratio, 5 by factor")
    return dict(rope_type="yarn", rope_factor=factor, rope_original_context=context,
                rope_beta_fast=float(form.get("beta_fast") or 32), rope_beta_slow=float(form.get("beta_slow") or 1),
                rope_mscale=float(form.get("mscale") or 0.0),
                rope_mscale_all_dim=float(form.get("mscale_all_dim") or 0.0), rope_truncate=form.get("truncate", True))


def linear_scaling(hf, name, form):
    """Every frequency `factor` times slower (transformers' _compute_linear_scaling_rope_parameters): Gemma 3's
    global layers' (4B and larger: 8)."""
    if form.get("factor") is None:
        refuse(hf, name, "linear scaling without factor")
    return dict(rope_type="linear", rope_factor=float(form["factor"]))


# The rotary scalings each family reads, and writes (the others any but llama3): DeepSeek-V3's and gpt-oss's YaRN,
# Gemma 3's linear scaling, OLMo 3's YaRN (its long-context releases') or Llama 3.1's.
SCALINGS = {"deepseek_v3": {"yarn": yarn_scaling}, "gpt_oss": {"yarn": yarn_scaling},
            "gemma3_text": {"linear": linear_scaling}, "olmo3": {"llama3": llama3_scaling, "yarn": yarn_scaling}}


def disagree(hf, stated, shown=None):
    """Refuses a config that states one setting in several places ({where: value}) with different values;
    `shown`: what to name for each place, where not the value itself."""
    values = list(stated.values())
    if any(value != values[0] for value in values[1:]):
        shown = shown or stated
        raise UnsupportedModel(f"{hf.get('model_type')} states its rotary settings both as transformers 4 writes "
                               "them (rope_theta, rope_scaling) and as transformers 5 does (rope_parameters), and "
                               "they disagree: " + ", ".join(f"{where}={shown[where]!r}" for where in stated)
                               + " (transformers 4 reads the first form; 5 prefers rope_scaling to rope_parameters"
                               " and rope_parameters' rope_theta to the top-level one): refused, not guessed")


def hf_from_config(config):
    """A Hugging Face config (dict) for a model.py config that did not come from one (a run trained from
    scratch): GPT-2 for the GPT-2 block; for the Llama one Llama, Qwen2 (biases on q, k, v alone), Mixtral,
    Qwen3 (QK-norm), Qwen3-MoE (QK-norm and experts), Qwen2-MoE (a gated shared expert), gpt-oss (the
    clamped SwiGLU, --arch gpt-oss), OLMo 2 (norms after the sub-layers, --arch olmo2) or OLMo 3 (with windows);
    DeepSeek-V3 for latent attention (--arch deepseek); Gemma 3's language model for Gemma's norm (--arch gemma3)."""
    c, common = config, dict(vocab_size=config.vocab_size, tie_word_embeddings=config.tie_embeddings)
    if c.position == "learned" and c.norm == "layer" and c.mlp in ("gelu", "gelu_tanh") and c.bias \
            and c.n_kv_heads == c.n_head and not c.n_experts and not c.qk_norm and c.head_dim * c.n_head == c.d_model \
            and c.norm_placement == "pre" and not c.scale_embedding:
        activation = "gelu_new" if c.mlp == "gelu_tanh" else "gelu"
        return dict(model_type="gpt2", n_layer=c.n_layer, n_head=c.n_head, n_embd=c.d_model, n_inner=c.d_ff,
                    n_positions=c.max_seq_len, activation_function=activation, layer_norm_epsilon=c.norm_eps,
                    **common)
    if not (c.position == "rope" and c.norm in ("rms", "rms_offset") and c.gated):
        raise UnsupportedModel("this model has no Hugging Face architecture here: GPT-2's block, the Llama block, or "
                               "Gemma 3's")
    if c.norm == "rms_offset":
        return gemma3_config(c, common)
    if c.kv_lora_rank:
        return deepseek_config(c, common)
    model_type = llama_family(c)
    fields = dict(model_type=model_type, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                  num_key_value_heads=c.n_kv_heads, hidden_size=c.d_model, head_dim=c.head_dim,
                  intermediate_size=c.d_ff, max_position_embeddings=c.max_seq_len, rope_theta=c.rope_theta,
                  rms_norm_eps=c.norm_eps, hidden_act="silu", **common)
    # transformers 4's form alone (rope_theta, rope_scaling): transformers 4 reads nothing else, and 5 reads it
    # as its own (convert_rope_params_to_dict moves both into rope_parameters), so one form is written once.
    # (YaRN is gpt-oss's; llama_family refuses it for the others.)
    if c.rope_factor != 1:
        fields["rope_scaling"] = rope_scaling_config(c)
    return fields | EXPORTED_FIELDS[model_type](c)


def rope_scaling_config(c):
    """rope_scaling, as transformers reads it, of c's scaling kind (None where it has none)."""
    if c.rope_factor == 1:
        return None
    if c.rope_type == "yarn":
        return yarn_config(c)
    if c.rope_type == "linear":
        return dict(rope_type="linear", factor=c.rope_factor)
    return dict(rope_type="llama3", factor=c.rope_factor, low_freq_factor=c.rope_low_freq_factor,
                high_freq_factor=c.rope_high_freq_factor, original_max_position_embeddings=c.rope_original_context)


def layer_types(c):
    """Each layer's kind, as the configs that list them say it."""
    return ["sliding_attention" if c.window(i) else "full_attention" for i in range(c.n_layer)]


def windows_rotate_apart(c):
    """Whether c's windowed layers turn otherwise than its others (by a base of their own, unscaled)."""
    return bool(c.local_rope_theta and window_layers(c) and (c.local_rope_theta != c.rope_theta or c.rope_factor != 1))


def gemma3_config(c, common):
    """Gemma3TextConfig's config.json (Gemma3ForCausalLM) for a model with Gemma's norm, as transformers 4 writes it
    (5 reads it too), or UnsupportedModel naming what Gemma 3 has not. Every layer's kind is listed; a model without
    windows lists every layer full and keeps the class's window, since transformers builds the sliding layers' mask
    whatever the layers are (and a window of null fails there). The sliding layers turn by rope_local_base_freq,
    unscaled: local_rope_theta, or where that is 0 (they turn as the others do) rope_theta, if it is unscaled."""
    windows = window_layers(c)
    lacks = [(c.norm_placement != "sandwich", f"norms {PLACED[c.norm_placement]} (Gemma 3's are before and after)"),
             (c.mlp != "geglu", f"the {c.mlp} MLP (Gemma 3's is GeGLU)"),
             (not c.qk_norm or c.qk_norm_scope != "head", "attention without QK-norm of each head"),
             (not c.scale_embedding, "an unscaled embedding"), (c.bias or c.qkv_bias, "biases"),
             (c.n_experts, "experts"), (c.attention_sinks, "attention sinks"), (c.kv_lora_rank, "latent attention"),
             (c.rope_factor != 1 and c.rope_type != "linear", f"{c.rope_type} rotary scaling (Gemma 3's is linear)"),
             (windows and not c.local_rope_theta and c.rope_factor != 1,
              "windowed layers whose rotation is scaled (Gemma 3's sliding ones turn unscaled)")]
    missing = [what for has, what in lacks if has]
    if missing:
        raise UnsupportedModel(f"this model has no Hugging Face architecture here: gemma3_text is the nearest, but "
                               f"has not {', '.join(missing)}")
    return dict(model_type="gemma3_text", num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                num_key_value_heads=c.n_kv_heads, hidden_size=c.d_model, head_dim=c.head_dim,
                intermediate_size=c.d_ff, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=c.query_scale or c.head_dim,
                sliding_window=c.sliding_window if windows else GEMMA3_TEXT_DEFAULTS["sliding_window"],
                layer_types=layer_types(c), rope_theta=c.rope_theta,
                rope_local_base_freq=c.local_rope_theta or c.rope_theta, rope_scaling=rope_scaling_config(c),
                attention_bias=False, attn_logit_softcapping=None, final_logit_softcapping=None, **common)


def yarn_config(c):
    """YaRN's rope_scaling as transformers reads it (yarn_scaling, the other way), its optional settings where
    they are not the defaults: mscale and mscale_all_dim where set, truncate where false (gpt-oss's)."""
    gains = dict(mscale=c.rope_mscale, mscale_all_dim=c.rope_mscale_all_dim)
    return dict(rope_type="yarn", factor=c.rope_factor, original_max_position_embeddings=c.rope_original_context,
                beta_fast=c.rope_beta_fast, beta_slow=c.rope_beta_slow, **{k: v for k, v in gains.items() if v},
                **({} if c.rope_truncate else dict(truncate=False)))


def llama_family(c):
    """The model_type of a Llama-block config: the family whose modeling code computes what model.py does, or
    UnsupportedModel naming what none of them has."""
    if c.mlp == "clamped_swiglu":
        family = "gpt_oss"
    elif c.norm_placement == "post":
        family = "olmo3" if c.sliding_window else "olmo2"
    elif c.qk_norm:
        family = "qwen3_moe" if c.n_experts else "qwen3"
    elif c.shared_expert_gate:
        family = "qwen2_moe"
    else:
        family = ("mixtral" if c.n_experts else "qwen2" if c.qkv_bias and not c.bias else
                  "mistral" if c.sliding_window else "llama")
    every_layer = not c.moe_layers or len(c.moe_layers) == c.n_layer
    lacks = {  # (family: [(what model.py has, that the family's modeling code has not)])
        "mixtral": [(c.n_shared_experts, "a shared expert"), (not every_layer, "dense layers beside the MoE ones"),
                    (not c.norm_topk_prob, "top-k gates left unnormalised"),
                    (c.d_expert != c.d_ff, "experts of another width than intermediate_size")],
        "qwen3": [(c.bias or c.qkv_bias, "biases (Qwen3's attention_bias puts them on q, k, v and o alone)")],
        "qwen3_moe": [(c.bias or c.qkv_bias, "biases"), (c.n_shared_experts, "a shared expert")],
        "qwen2_moe": [(c.bias, "biases besides those of q, k, v")],
        "mistral": [(c.bias, "biases")],
        "gpt_oss": gpt_oss_lacks(c, every_layer),
        "olmo2": olmo_lacks(c),
        "olmo3": olmo_lacks(c) + olmo3_rotation_lacks(c),
    }
    lacks[family] = lacks.get(family, []) + block_lacks(c, family)
    if family != "gpt_oss":  # (gpt-oss lists every layer's kind, and its attention always has sinks)
        lacks[family] += window_lacks(c, family) + [
            (c.rope_factor != 1 and c.rope_type not in SCALINGS.get(family, ("llama3",)),
             f"{c.rope_type} rotary scaling")]
    if c.n_experts:  # (the routers here: a softmax over every expert, or over the top k, the same gates)
        lacks[family] = lacks.get(family, []) + [
            (c.router_scoring != "softmax", f"{c.router_scoring} router scores"),
            (c.n_group > 1, "group-limited routing"), (c.routed_scaling_factor != 1, "scaled gates"),
            (c.router_bias and family != "gpt_oss", "a router with a bias")]
    missing = [what for has, what in lacks.get(family, []) if has]
    if missing:
        raise UnsupportedModel(f"this model has no Hugging Face architecture here: {family} is the nearest, "
                               f"but has not {', '.join(missing)}")
    return family


def window_lacks(c, family):
    """Windows and sinks where a family has not: Mistral's and Mixtral's windows are on every layer, the
    Qwens' on the last ones (from max_window_layers), OLMo 3's on any (it lists each layer's kind), and none has
    sinks."""
    windows, every = window_layers(c), family in ("mistral", "mixtral")
    tail = windows == list(range(c.n_layer - len(windows), c.n_layer))
    return [(c.attention_sinks, "attention sinks"),
            (family != "olmo3" and windows and (len(windows) < c.n_layer if every else not tail),
             "a sliding window on these layers" + (" (it has one on every layer)" if every else
                                                   " (the Qwens' are the last ones, from max_window_layers)"))]


PLACED = {"pre": "before each sub-layer", "post": "after each sub-layer", "sandwich": "before and after each sub-layer"}


def block_lacks(c, family):
    """What of Gemma 3's and OLMo 2's blocks a Llama-block family has not: Gemma's MLP, embedding and query scale
    (Gemma's alone), norms placed otherwise than the family's (after each sub-layer in OLMo's, before in the others),
    QK-norm over the whole projection (OLMo's) or of each head (the others'), windowed layers turning by their own
    base (OLMo 3's sliding layers turn as the full ones do, unscaled: olmo3_rotation_lacks)."""
    olmo = family in ("olmo2", "olmo3")
    return [(c.mlp == "geglu", "GeGLU"), (c.scale_embedding, "a scaled embedding"),
            (c.query_scale not in (0, c.head_dim), "a query scale other than the head size"),
            (c.norm_placement != ("post" if olmo else "pre"), f"norms {PLACED[c.norm_placement]}"),
            (c.qk_norm and (c.qk_norm_scope == "projection") != olmo,
             "QK-norm of each head" if olmo else "QK-norm over the whole projection"),
            (family != "olmo3" and windows_rotate_apart(c), "windowed layers turning by a base of their own")]


def olmo_lacks(c):
    """What a model with OLMo 2's norm placement has that Olmo2ForCausalLM has not."""
    return [(not c.qk_norm, "attention without QK-norm"), (c.bias or c.qkv_bias, "biases"), (c.n_experts, "experts")]


def olmo3_rotation_lacks(c):
    """OLMo 3's sliding layers turn by rope_theta unscaled, the others by it scaled or not (YaRN's factor the ratio
    of the contexts, as yarn_scaling reads it); and transformers 5 reads transformers 4's form (which export
    writes) with the sliding layers at 500,000 (olmo3_fields)."""
    return [(c.local_rope_theta not in (0, c.rope_theta), "windowed layers turning by a base of their own"),
            (not c.local_rope_theta and c.rope_factor != 1,
             "windowed layers whose rotation is scaled (OLMo 3's sliding ones turn unscaled)"),
            (c.rope_theta != OLMO3_THETA, f"a rope_theta other than {OLMO3_THETA:,.0f} (transformers 5 turns OLMo 3's "
                                          f"sliding layers by it in transformers 4's form)"), *yarn_ratio_lacks(c)]


def gpt_oss_lacks(c, every_layer):
    """What a model with gpt-oss's clamped SwiGLU has that GptOssForCausalLM has not."""
    return [(not c.n_experts or not every_layer, "dense MLPs (its every layer is a mixture of experts)"),
            (not c.attention_sinks, "attention without sinks"), (not (c.bias and c.qkv_bias), "layers without biases"),
            (not c.router_bias, "a router without a bias"), (c.qk_norm, "QK-norm"),
            (c.n_shared_experts, "a shared expert"), (not c.norm_topk_prob, "top-k gates left unnormalised"),
            (c.d_expert != c.d_ff, "experts of another width than intermediate_size"), *yarn_lacks(c, "gpt-oss")]


def yarn_lacks(c, family):
    """A family whose rotary scaling is YaRN alone (DeepSeek-V3, gpt-oss): another kind is not, nor YaRN whose
    factor is not max_position_embeddings / original_max_position_embeddings (transformers 4 reads the ratio)."""
    return [(c.rope_factor != 1 and c.rope_type != "yarn", f"{c.rope_type} rotary scaling ({family}'s is YaRN)"),
            *yarn_ratio_lacks(c)]


def yarn_ratio_lacks(c):
    """YaRN whose factor is not max_position_embeddings / original_max_position_embeddings (transformers 4 reads
    the ratio)."""
    return [(c.rope_factor != 1 and c.rope_type == "yarn" and c.max_seq_len != c.rope_factor * c.rope_original_context,
             f"YaRN with max_seq_len {c.max_seq_len} other than rope_factor x rope_original_context (transformers 4 "
             f"reads its factor as the ratio of the two)")]


def qwen_experts_config(c):
    """num_experts and the rest, as Qwen2MoeConfig and Qwen3MoeConfig name them: the dense layers listed."""
    dense = [i for i in range(c.n_layer) if not c.is_moe(i)]
    return dict(num_experts=c.n_experts, num_experts_per_tok=c.top_k, moe_intermediate_size=c.d_expert,
                norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=dense)


def deepseek_config(c, common):
    """DeepseekV3Config's config.json for a model with latent attention (a run with --arch deepseek), as
    transformers 4 writes it (5 reads it too), or UnsupportedModel naming what DeepseekV3ForCausalLM has not.
    A model without experts is one whose first_k_dense_replace is every layer (DeepseekV3DecoderLayer then
    builds no MoE), its router settings written as they are so that it reads back as the same config. The
    rotated rows are written interleaved (rope_interleave true, `row_order`), the layout DeepSeek's own files
    and the inference engines that read them expect."""
    moe = [i for i in range(c.n_layer) if c.is_moe(i)]
    dense = c.n_layer - len(moe)
    lacks = [(c.bias or c.qkv_bias, "biases"), (c.qk_norm, "QK-norm"),
             (c.shared_expert_gate, "a gated shared expert"),
             (c.n_experts and c.router_scoring != "sigmoid", "softmax router scores (DeepSeek-V3's are sigmoids)"),
             (c.d_shared != c.n_shared_experts * c.d_expert, "a shared expert of another width than its experts'"),
             (moe != list(range(dense, c.n_layer)), "dense layers after MoE ones (DeepSeek-V3's are the first ones)"),
             *yarn_lacks(c, "DeepSeek-V3"), *block_lacks(c, "deepseek_v3")]
    missing = [what for has, what in lacks if has]
    if missing:
        raise UnsupportedModel(f"this model has no Hugging Face architecture here: deepseek_v3 is the nearest, but "
                               f"has not {', '.join(missing)}")
    rope_scaling = {"type": "yarn", "mscale": c.rope_mscale, "mscale_all_dim": c.rope_mscale_all_dim,
                    **yarn_config(c)} if c.rope_factor != 1 else None  # (transformers 4's older key too)
    return dict(model_type="deepseek_v3", num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                num_key_value_heads=c.n_head, hidden_size=c.d_model, intermediate_size=c.d_ff,
                moe_intermediate_size=c.d_expert, n_routed_experts=c.n_experts, n_shared_experts=c.n_shared_experts,
                num_experts_per_tok=c.top_k, n_group=c.n_group, topk_group=c.topk_group,
                norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor,
                first_k_dense_replace=dense, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank or None,
                qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                qk_head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim, head_dim=c.qk_rope_head_dim,
                max_position_embeddings=c.max_seq_len, rope_theta=c.rope_theta, rope_scaling=rope_scaling,
                rope_interleave=True, rms_norm_eps=c.norm_eps, hidden_act="silu", attention_bias=False, **common)


def window_layers(c):
    """The layers of config c that have its sliding window, listed."""
    return [i for i in range(c.n_layer) if c.window(i)]


def qwen_window_config(c):
    """The Qwens' window settings, if it has one: use_sliding_window, the window and the first windowed layer
    (max_window_layers; transformers 5 makes its layer_types of them)."""
    windows = window_layers(c)
    return dict(use_sliding_window=True, sliding_window=c.sliding_window, max_window_layers=windows[0]) if windows \
        else {}


def window_config(c):
    """Mistral's and Mixtral's window setting, if it has one (on every layer)."""
    return dict(sliding_window=c.sliding_window) if c.sliding_window else {}


def gpt_oss_config(c):
    """GptOssConfig's own settings: its experts, every layer's kind listed."""
    return dict(num_local_experts=c.n_experts, num_experts_per_tok=c.top_k, attention_bias=True, swiglu_limit=7.0,
                sliding_window=c.sliding_window, layer_types=layer_types(c))


EXPORTED_FIELDS = {  # each family's own settings, beside the Llama block's
    "llama": lambda c: dict(attention_bias=c.bias, mlp_bias=c.bias),
    "mistral": window_config,
    "qwen2": qwen_window_config,
    "mixtral": lambda c: dict(num_local_experts=c.n_experts, num_experts_per_tok=c.top_k, **window_config(c)),
    "qwen3": lambda c: dict(attention_bias=False, **qwen_window_config(c)),
    "qwen3_moe": lambda c: dict(attention_bias=False, **qwen_experts_config(c), **qwen_window_config(c)),
    "qwen2_moe": lambda c: dict(qkv_bias=c.qkv_bias, shared_expert_intermediate_size=c.d_shared,
                                **qwen_experts_config(c), **qwen_window_config(c)),
    "gpt_oss": gpt_oss_config,
    "olmo2": lambda c: dict(attention_bias=False),
    "olmo3": lambda c: dict(attention_bias=False, sliding_window=c.sliding_window, layer_types=layer_types(c)),
}


# ---------------------------------------------------------------------------
# Reading: any elements of model.py's tensors, from the folder's files
# ---------------------------------------------------------------------------

class Folder:
    """A Hugging Face model folder's tensors, read a range of elements at a time. Opening it checks every
    file against what it claims (training/tensorfile.py) and the index against the files: a shard it names
    missing, a tensor in no shard or in another than the index says, a tensor in two shards is a DamagedFile.

    An MXFP4 pair, `X_blocks` and `X_scales` (gpt-oss's experts as released), is read as the tensor X it stands
    for, as transformers' loader makes it: dequantized (blocks (experts, rows, groups, 16) to (experts, rows,
    groups x 32)) and transposed to (experts, groups x 32, rows), the layout of gpt-oss's tensors in bfloat16.
    A read dequantizes the experts it touches, one layer's expert at a time for model.py's tensors."""

    def __init__(self, folder):
        self.folder, self.config = folder, read_config(folder)
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = read_weight_map(index)
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(folder, "model.safetensors")):
            weight_map, files = {}, ["model.safetensors"]
        else:
            raise UnsupportedModel(f"{folder}: no model.safetensors nor model.safetensors.index.json")
        self.file_of = {}
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise DamagedFile(f"{index}: names the shard {name}, which is not in the folder")
            file = SafetensorsFile(os.path.join(folder, name))
            for entry in file.header:
                if entry in self.file_of:
                    raise DamagedFile(f"{folder}: tensor {entry!r} is in two shards, "
                                      f"{os.path.basename(self.file_of[entry].path)} and {name}")
                self.file_of[entry] = file
        for entry, name in weight_map.items():
            if entry not in self.file_of or os.path.basename(self.file_of[entry].path) != name:
                raise DamagedFile(f"{index}: tensor {entry!r} is in no shard (the index says {name}, which does "
                                  f"not hold it)")
        self.mxfp4 = self.mxfp4_pairs()

    def mxfp4_pairs(self):
        """{X: (X_blocks, X_scales)} of the folder, each pair's dtypes and shapes checked against the format."""
        pairs = {}
        for entry in self.file_of:
            if entry.endswith(("_blocks", "_scales")):
                base = entry.rsplit("_", 1)[0]
                blocks, scales = base + "_blocks", base + "_scales"
                if blocks not in self.file_of or scales not in self.file_of:
                    raise DamagedFile(f"{self.folder}: {entry!r} without its MXFP4 pair "
                                      f"{blocks if scales == entry else scales!r}")
                headers = [self.file_of[name].header[name] for name in (blocks, scales)]
                empty = [torch.empty(h["shape"], dtype=TORCH_DTYPES.get(h["dtype"], torch.float32), device="meta")
                         for h in headers]
                problem = mxfp4.layout_problem(*empty)
                if problem:
                    raise DamagedFile(f"{self.folder}: {base} (MXFP4): {problem}")
                pairs[base] = (blocks, scales)
        return pairs

    def mxfp4_problem(self, share=(0, 1)):
        """The first damaged MXFP4 scales (e8m0's NaN) of share (i, n) of the pairs: the i-th of every n, in name
        order (the ranks of a node check a folder once between them); None where none."""
        index, count = share
        for base in sorted(self.mxfp4)[index::count]:
            scales = self.mxfp4[base][1]
            problem = mxfp4.scale_problem(self.file_of[scales].read(scales))  # (a 16th of the blocks' bytes)
            if problem:
                return f"{self.folder}: {base} (MXFP4): {problem}"
        return None

    def _entry(self, name):
        """The entry of tensor `name`: under that name, or the one the folder's release gave it (RELEASED_NAMES)."""
        released = [old + name[len(new):] for new, old in RELEASED_NAMES.get(self.config.get("model_type"), ())
                    if name.startswith(new)]
        for entry in (name, *released):
            if entry in self.file_of:
                return entry
        raise UnsupportedModel(f"{self.folder}: no tensor {name}")

    def shape(self, name):
        if name in self.mxfp4:
            experts, rows, groups, _ = self.shape(self.mxfp4[name][0])
            return [experts, groups * 32, rows]
        entry = self._entry(name)
        return self.file_of[entry].header[entry]["shape"]

    def read(self, name, start, end):
        if name in self.mxfp4:
            return self.read_mxfp4(name, start, end)
        entry = self._entry(name)
        return self.file_of[entry].read(entry, start, end)

    def read_mxfp4(self, name, start, end):
        """Elements [start, end) of MXFP4 tensor `name` as shape() gives it, in float64 (exactly its values)."""
        (blocks, scales), (_, columns, rows) = self.mxfp4[name], self.shape(name)
        per_expert = columns * rows
        first, last = start // per_expert, (end - 1) // per_expert + 1
        packed = [self.file_of[n].read(n, first * per_expert // k, last * per_expert // k) for n, k in
                  ((blocks, 2), (scales, 32))]
        try:
            values = mxfp4.dequantized(packed[0].view(-1, rows, columns // 32, 16),
                                       packed[1].view(-1, rows, columns // 32), name, torch.float64)
        except mxfp4.BadMXFP4 as e:
            raise DamagedFile(f"{self.folder}: {e}") from None
        return values.transpose(1, 2).flatten()[start - first * per_expert:end - first * per_expert]


# The names tensors go by in folders as they were released, where transformers now saves others ({model_type:
# [(the name's start as saved now, as released)]}): GPT-2's first files name theirs without "transformer.", Gemma 3's
# multimodal ones (google/gemma-3-4b and larger) keep the language model under language_model.model and its output
# layer under language_model.lm_head, which transformers 4.52 and later save as model.language_model and lm_head
# (Gemma3ForConditionalGeneration's _checkpoint_conversion_mapping).
RELEASED_NAMES = {"gpt2": [("transformer.", "")], "gemma3": [("model.language_model.", "language_model.model."),
                                                              ("lm_head.", "language_model.lm_head.")]}


def read_weight_map(index):
    """model.safetensors.index.json's weight_map {tensor: shard file}, or DamagedFile."""
    weight_map = json_object(index, DamagedFile).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) and os.path.basename(file) == file
                                                   for file in weight_map.values()):
        raise DamagedFile(f"{index}: damaged, no weight_map of tensors and the shard files in the folder")
    return weight_map


VOCABULARY_TABLES = ("tok_emb.weight", "lm_head.weight")  # padded with zero rows past the vocabulary


class HuggingFaceValues:
    """The values of model.py's tensors in a Hugging Face folder, for train.py's Share, as InitialValues
    and SavedValues give them: parameter(name, positions) reads the elements at flat `positions` of the
    full tensor, from the ranges of the files that hold them. check_shapes() first, where the folder's
    config.json may not describe its weights (train.py's check_folder; tools/parity.py reads an export tensor
    by tensor, to name each one that went wrong)."""

    def __init__(self, folder, config):
        self.folder, self.config = Folder(folder), config
        self.model_type = self.folder.config["model_type"]

    def check_shapes(self):
        """Every tensor model.py reads from the folder must be of the shape its config.json gives: a folder
        whose config and weights disagree would otherwise be read in the wrong places, or past a tensor's end."""
        with torch.device("meta"):
            model = GPT(self.config)
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update({name: model.get_buffer(name) for name in saved_buffers(model, self.model_type)})
        for name, tensor in tensors.items():
            parts = source(self.model_type, tied_name(name, self.config), self.config)
            rows = self.config.vocab_size if name in VOCABULARY_TABLES else tensor.shape[0]
            inner, found = list(tensor.shape[1:]), [self.part_shape(n, parts) for n in parts.names]
            part_rows = [shape[-1] if parts.transposed and shape else shape[0] if shape else 0 for shape in found]
            wanted = [inner + [r] if parts.transposed else [r] + inner for r in part_rows]
            if found != wanted or sum(part_rows) != rows:
                what = f"{list(found[0])}" if len(found) == 1 else f"{', '.join(str(list(f)) for f in found)}"
                raise UnsupportedModel(
                    f"{self.folder.folder}: {' | '.join(parts.names)} {'is' if len(found) == 1 else 'are'} {what}, "
                    f"where its config.json makes model.py's {name} {rows} rows of {inner or 'one value'}"
                    f"{' (stored transposed)' if parts.transposed else ''}: its config and its weights disagree")

    def part_shape(self, hf_name, parts):
        """The shape of Hugging Face tensor hf_name, of one expert's slice where it holds every expert's."""
        shape = self.folder.shape(hf_name)
        if not parts.stacked:
            return shape
        if not shape or shape[0] != self.config.n_experts:
            raise UnsupportedModel(f"{self.folder.folder}: {hf_name} is {list(shape)}, where its config.json has "
                                   f"{self.config.n_experts} experts: its config and its weights disagree")
        return shape[1:]

    def parameter(self, name, positions):
        """The elements at flat `positions` of model.py's tensor `name` (a parameter, or a buffer the folder
        holds), in float64."""
        parts, positions = source(self.model_type, tied_name(name, self.config), self.config), positions.cpu()
        shapes = [self.part_shape(n, parts) for n in parts.names]
        offset = parts.expert * math.prod(shapes[0]) if parts.stacked else 0  # (its expert's slice, one part)
        rows = [shape[-1] if parts.transposed else shape[0] for shape in shapes]
        columns = math.prod(shapes[0]) // rows[0]
        row, column = positions // columns, positions % columns
        order = row_order(parts, self.folder.config, self.config)
        if order is not None:  # (one part: the folder's row of each of model.py's)
            row = order[row]
        values = torch.zeros(positions.shape, dtype=torch.float64)  # past the last part: vocabulary padding
        first_row = 0
        for name_k, rows_k in zip(parts.names, rows):
            here = (row >= first_row) & (row < first_row + rows_k)
            if here.any():
                local = row[here] - first_row
                flat = column[here] * rows_k + local if parts.transposed else local * columns + column[here]
                start, end = flat.min().item(), flat.max().item() + 1
                values[here] = self.folder.read(name_k, offset + start, offset + end)[flat - start].to(torch.float64)
            first_row += rows_k
        return values

    def buffer(self, name, empty):
        """A buffer's values: DeepSeek-V3's routing biases from the folder (e_score_correction_bias), the
        others' (and the expert loads) zero, as a run from scratch starts them."""
        if not has_source(self.model_type, name, self.config):
            return torch.zeros_like(empty)
        return self.parameter(name, torch.arange(empty.numel())).view(empty.shape).to(empty.device, empty.dtype)


def load_state_dict(folder, config):
    """model.py's whole state dict (on the CPU, float64) from a Hugging Face folder: for one device and tests."""
    values = HuggingFaceValues(folder, config)
    values.check_shapes()
    with torch.device("meta"):
        model = GPT(config)
    state = {name: values.parameter(name, torch.arange(p.numel())).view(p.shape)
             for name, p in model.named_parameters(remove_duplicate=False)}
    return state | {name: values.buffer(name, torch.zeros(b.shape, dtype=torch.float64))
                    for name, b in model.state_dict().items() if name not in state}
