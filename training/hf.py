"""Hugging Face model folders in and out: continue training a released model, and hand the result back.

    torchrun --nproc_per_node 8 train.py --init-from Llama-3.2-1B --tp 2 --pp 2 ...   # start from its weights
    python -m tools.convert to-hf runs/x/checkpoint-00000100 llama-continued [--dtype bfloat16]  # and back

A Hugging Face model folder holds config.json (the architecture and its shape) and the weights in the
safetensors format: one model.safetensors, or model-0000N-of-0000M.safetensors with
model.safetensors.index.json naming the file of every tensor. This file reads GPT-2, Llama (2, 3, 3.1,
3.2), Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE and Qwen2-MoE folders (docs/model-families.md: what each
maps and what it refuses); tools/convert.py writes any run's checkpoint as one, with the same tables.

Three things translate:
- the config (config_from_hf): each setting mapped to model.py's GPTConfig, and one it cannot represent
  refused by name (never approximated). Settings that only shape training (dropout, the router's
  auxiliary-loss coefficient, initialisation) are not the model's: they come from train.py's flags.
- the names (TABLES, one per architecture): each of model.py's tensors is made of Hugging Face tensors
  stacked along its rows (attention's q | k | v, SwiGLU's gate | up), stored transposed in GPT-2's
  Conv1D layers, and for the vocabulary tables padded with zero rows past the vocabulary (model.py
  keeps the padding out of every prediction, so the logits are the released model's).
- the values: `HuggingFaceValues` gives any elements of any of model.py's tensors, read from the files
  without loading a whole tensor (train.py's Share asks each rank's own elements, so a rank reads only
  what it will hold).
"""
import json
import math
import os
import re
from dataclasses import dataclass

import torch

from training import checkpoint
from model import GPT, GPTConfig, pad_vocabulary, tied_name


class UnsupportedModel(ValueError):
    """A Hugging Face config with a setting model.py cannot represent."""


# ---------------------------------------------------------------------------
# Names: model.py's tensor <- the Hugging Face tensors it is made of
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """model.py's tensor is `names` stacked along its rows (dim 0); `transposed`: each is stored as (in,
    out), as GPT-2's Conv1D layers keep their weights, where model.py's nn.Linear keeps (out, in)."""
    names: tuple
    transposed: bool = False


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

TABLES = {"gpt2": GPT2, "llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "mixtral": LLAMA,
          "qwen3": LLAMA_BLOCK | QK_NORM, "qwen3_moe": LLAMA_BLOCK | QK_NORM | QWEN_EXPERTS,
          "qwen2_moe": LLAMA_BLOCK | QWEN_EXPERTS | QWEN_SHARED_EXPERT}
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
INDEXED = re.compile(r"(blocks|experts)\.(\d+)")


def source(model_type, name):
    """The Hugging Face tensors of model.py's `name` (say blocks.3.attn.qkv.weight) in a model_type folder."""
    numbers = {"blocks": "i", "experts": "e"}
    pattern = INDEXED.sub(lambda m: f"{m.group(1)}.{{{numbers[m.group(1)]}}}", name)
    indices = {numbers[kind]: int(index) for kind, index in INDEXED.findall(name)}
    if pattern not in TABLES[model_type]:
        raise UnsupportedModel(f"{model_type} has no tensor for model.py's {name}")
    entry = TABLES[model_type][pattern]
    return Source(tuple(n.format(**indices) for n in entry.names), entry.transposed)


# ---------------------------------------------------------------------------
# Configs: Hugging Face's config.json <-> model.py's GPTConfig
# ---------------------------------------------------------------------------

def with_layers(hf_config, n_layer):
    """hf_config (a config.json's dict) of a model of its first n_layer blocks (train.py --layers)."""
    key = "n_layer" if hf_config.get("model_type") == "gpt2" else "num_hidden_layers"
    return dict(hf_config, **{key: n_layer})


def read_config(folder):
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UnsupportedModel(f"{folder}: not a Hugging Face model folder (no config.json)")
    with open(path) as f:
        return json.load(f)


def refuse(hf, setting, why):
    raise UnsupportedModel(f"{hf.get('model_type')} with {setting}={hf.get(setting)!r}: {why}")


def config_from_hf(hf, seq_len, **training):
    """model.py's GPTConfig of a Hugging Face config (a dict), for training on sequences of seq_len tokens;
    `training`: the GPTConfig fields that are training choices (the MoE balancing), from the flags."""
    model_type = hf.get("model_type")
    if model_type not in TABLES:
        raise UnsupportedModel(f"model_type {model_type!r} is not one of {sorted(TABLES)}")
    fields = gpt2_fields(hf) if model_type == "gpt2" else llama_fields(hf, seq_len)
    vocab = hf["vocab_size"]
    fields.update(vocab_size=vocab, padded_vocab_size=pad_vocabulary(vocab), seq_len=seq_len)
    try:
        return GPTConfig(**fields, **training)
    except ValueError as e:
        raise UnsupportedModel(f"{model_type}: {e}") from None


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


def llama_fields(hf, seq_len):
    model_type, d, heads = hf["model_type"], hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("hidden_act", "silu") != "silu":
        refuse(hf, "hidden_act", "model.py's gated MLP is SwiGLU (silu)")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window is not None and window < seq_len:
        refuse(hf, "sliding_window", f"model.py attends to the whole sequence, longer ({seq_len}) than the window")
    bias = hf.get("attention_bias", False)
    if model_type == "llama" and hf.get("mlp_bias", False) != bias:
        refuse(hf, "mlp_bias", "model.py has biases in every linear layer or in none (besides q, k, v)")
    fields = dict(n_layer=hf["num_hidden_layers"], n_head=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
                  head_dim=hf.get("head_dim") or d // heads,  # wider than hidden_size / heads in Mistral NeMo, Qwen3
                  d_model=d, d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
                  position="rope", norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", bias=bias,
                  qkv_bias=True if model_type == "qwen2" else bias,
                  tie_embeddings=hf.get("tie_word_embeddings", False), **rope_fields(hf))
    return fields | FAMILY_FIELDS.get(model_type, lambda hf: {})(hf)


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
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0] if hf.get("num_experts") else []
    if not sparse:
        return {}  # every MLP dense: intermediate_size alone
    return dict(n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"], d_expert=hf["moe_intermediate_size"],
                norm_topk_prob=hf.get("norm_topk_prob", False), moe_layers=() if len(sparse) == layers else sparse)


def qwen2_moe_fields(hf):
    """Qwen2-MoE: Qwen2's biases on q, k, v (transformers 5's qkv_bias, True; 4 always has them), and beside the
    experts one shared expert of shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate(x))."""
    experts = qwen_experts_fields(hf)
    shared = dict(n_shared_experts=1, d_shared=hf["shared_expert_intermediate_size"], shared_expert_gate=True)
    return dict(qkv_bias=hf.get("qkv_bias", True), **experts, **(shared if experts else {}))


FAMILY_FIELDS = {"mixtral": mixtral_fields, "qwen3": qwen3_fields, "qwen2_moe": qwen2_moe_fields,
                 "qwen3_moe": lambda hf: qwen3_fields(hf) | qwen_experts_fields(hf)}


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
#   models whose kinds of layer rotate differently (Gemma 3 and the like): the rotary embedding of Llama,
#   Mistral, Qwen2 and Mixtral reads one flat dict (rope_parameters["rope_type"]), so a nested one is refused.
# Both forms in one file (edited by hand, or by a tool that knows one of them): where each states a value,
# they must agree, or the folder is refused by name, since transformers 4 and 5 would each take another one.
ROPE_FORMS = ("rope_scaling", "rope_parameters")  # transformers 4's dict, transformers 5's
LLAMA3 = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
          "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_context"}
# A file that states no rope_theta at all rotates by its config class's default, the same in transformers 4
# and 5: 10000.0 for Llama, Mistral, Qwen2, Qwen3 and the Qwen MoEs (their rope_theta argument in 4,
# RotaryEmbeddingConfigMixin's default_theta in 5), 1e6 for Mixtral (rope_theta=1e6 in 4,
# MixtralConfig.default_theta in 5). Neither version depends on which wrote the file, so the default is taken,
# not refused.
DEFAULT_THETA = {"llama": 10000.0, "mistral": 10000.0, "qwen2": 10000.0, "mixtral": 1e6, "qwen3": 10000.0,
                 "qwen3_moe": 10000.0, "qwen2_moe": 10000.0}


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
    if kind != "llama3":
        refuse(hf, name, f"rope type {kind!r}: model.py's rotary scaling is Llama 3.1's (llama3) alone")
    missing = [key for key in LLAMA3 if form.get(key) is None]
    if missing:
        refuse(hf, name, f"llama3 scaling without {', '.join(missing)}")
    return {field: form[key] for key, field in LLAMA3.items()}


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
    Qwen3 (QK-norm), Qwen3-MoE (QK-norm and experts) or Qwen2-MoE (a gated shared expert)."""
    c, common = config, dict(vocab_size=config.vocab_size, tie_word_embeddings=config.tie_embeddings)
    if c.position == "learned" and c.norm == "layer" and c.mlp in ("gelu", "gelu_tanh") and c.bias \
            and c.n_kv_heads == c.n_head and not c.n_experts and not c.qk_norm and c.head_dim * c.n_head == c.d_model:
        activation = "gelu_new" if c.mlp == "gelu_tanh" else "gelu"
        return dict(model_type="gpt2", n_layer=c.n_layer, n_head=c.n_head, n_embd=c.d_model, n_inner=c.d_ff,
                    n_positions=c.max_seq_len, activation_function=activation, layer_norm_epsilon=c.norm_eps,
                    **common)
    if not (c.position == "rope" and c.norm == "rms" and c.mlp == "swiglu"):
        raise UnsupportedModel("this model has no Hugging Face architecture here: GPT-2's block, or the Llama block")
    model_type = llama_family(c)
    fields = dict(model_type=model_type, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                  num_key_value_heads=c.n_kv_heads, hidden_size=c.d_model, head_dim=c.head_dim,
                  intermediate_size=c.d_ff, max_position_embeddings=c.max_seq_len, rope_theta=c.rope_theta,
                  rms_norm_eps=c.norm_eps, hidden_act="silu", **common)
    fields.update(EXPORTED_FIELDS[model_type](c))
    # transformers 4's form alone (rope_theta, rope_scaling): transformers 4 reads nothing else, and 5 reads it
    # as its own (convert_rope_params_to_dict moves both into rope_parameters), so one form is written once.
    if c.rope_factor != 1:
        fields["rope_scaling"] = dict(rope_type="llama3", factor=c.rope_factor,
                                      low_freq_factor=c.rope_low_freq_factor,
                                      high_freq_factor=c.rope_high_freq_factor,
                                      original_max_position_embeddings=c.rope_original_context)
    return fields


def llama_family(c):
    """The model_type of a Llama-block config: the family whose modeling code computes what model.py does, or
    UnsupportedModel naming what none of them has."""
    if c.qk_norm:
        family = "qwen3_moe" if c.n_experts else "qwen3"
    elif c.shared_expert_gate:
        family = "qwen2_moe"
    else:
        family = "mixtral" if c.n_experts else "qwen2" if c.qkv_bias and not c.bias else "llama"
    every_layer = not c.moe_layers or len(c.moe_layers) == c.n_layer
    lacks = {  # (family: [(what model.py has, that the family's modeling code has not)])
        "mixtral": [(c.n_shared_experts, "a shared expert"), (not every_layer, "dense layers beside the MoE ones"),
                    (not c.norm_topk_prob, "top-k gates left unnormalised"),
                    (c.d_expert != c.d_ff, "experts of another width than intermediate_size")],
        "qwen3": [(c.bias or c.qkv_bias, "biases (Qwen3's attention_bias puts them on q, k, v and o alone)")],
        "qwen3_moe": [(c.bias or c.qkv_bias, "biases"), (c.n_shared_experts, "a shared expert")],
        "qwen2_moe": [(c.bias, "biases besides those of q, k, v")],
    }
    missing = [what for has, what in lacks.get(family, []) if has]
    if missing:
        raise UnsupportedModel(f"this model has no Hugging Face architecture here: {family} is the nearest, "
                               f"but has not {', '.join(missing)}")
    return family


def qwen_experts_config(c):
    """num_experts and the rest, as Qwen2MoeConfig and Qwen3MoeConfig name them: the dense layers listed."""
    dense = [i for i in range(c.n_layer) if not c.is_moe(i)]
    return dict(num_experts=c.n_experts, num_experts_per_tok=c.top_k, moe_intermediate_size=c.d_expert,
                norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=dense)


EXPORTED_FIELDS = {  # each family's own settings, beside the Llama block's
    "llama": lambda c: dict(attention_bias=c.bias, mlp_bias=c.bias),
    "qwen2": lambda c: {},
    "mixtral": lambda c: dict(num_local_experts=c.n_experts, num_experts_per_tok=c.top_k),
    "qwen3": lambda c: dict(attention_bias=False),
    "qwen3_moe": lambda c: dict(attention_bias=False, **qwen_experts_config(c)),
    "qwen2_moe": lambda c: dict(qkv_bias=c.qkv_bias, shared_expert_intermediate_size=c.d_shared,
                                **qwen_experts_config(c)),
}


# ---------------------------------------------------------------------------
# Reading: any elements of model.py's tensors, from the folder's files
# ---------------------------------------------------------------------------

class Folder:
    """A Hugging Face model folder's tensors, read a range of elements at a time."""

    def __init__(self, folder):
        self.folder, self.config = folder, read_config(folder)
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(folder, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise UnsupportedModel(f"{folder}: no model.safetensors nor model.safetensors.index.json")
        self.file_of = {}
        for name in files:
            file = checkpoint.SafetensorsFile(os.path.join(folder, name))
            self.file_of.update({entry: file for entry in file.header})

    def _entry(self, name):
        """The entry of tensor `name` (GPT-2's first release names its tensors without "transformer.")."""
        for entry in (name, name.removeprefix("transformer.")):
            if entry in self.file_of:
                return entry
        raise UnsupportedModel(f"{self.folder}: no tensor {name}")

    def shape(self, name):
        entry = self._entry(name)
        return self.file_of[entry].header[entry]["shape"]

    def read(self, name, start, end):
        entry = self._entry(name)
        return self.file_of[entry].read(entry, start, end)


class HuggingFaceValues:
    """The values of model.py's tensors in a Hugging Face folder, for train.py's Share, as InitialValues
    and SavedValues give them: parameter(name, positions) reads the elements at flat `positions` of the
    full tensor, from the ranges of the files that hold them."""

    def __init__(self, folder, config):
        self.folder, self.config = Folder(folder), config
        self.model_type = self.folder.config["model_type"]

    def parameter(self, name, positions):
        parts, positions = source(self.model_type, tied_name(name, self.config)), positions.cpu()
        shapes = [self.folder.shape(n) for n in parts.names]
        rows = [shape[-1] if parts.transposed else shape[0] for shape in shapes]
        columns = math.prod(shapes[0]) // rows[0]
        row, column = positions // columns, positions % columns
        values = torch.zeros(positions.shape, dtype=torch.float64)  # past the last part: vocabulary padding
        first_row = 0
        for name_k, rows_k in zip(parts.names, rows):
            here = (row >= first_row) & (row < first_row + rows_k)
            if here.any():
                local = row[here] - first_row
                flat = column[here] * rows_k + local if parts.transposed else local * columns + column[here]
                start, end = flat.min().item(), flat.max().item() + 1
                values[here] = self.folder.read(name_k, start, end)[flat - start].to(torch.float64)
            first_row += rows_k
        return values

    def buffer(self, name, empty):
        return torch.zeros_like(empty)  # the routing biases (DeepSeek-V3's balancing) start at zero


def load_state_dict(folder, config):
    """model.py's whole state dict (on the CPU, float64) from a Hugging Face folder: for one device and tests."""
    values = HuggingFaceValues(folder, config)
    with torch.device("meta"):
        model = GPT(config)
    state = {name: values.parameter(name, torch.arange(p.numel())).view(p.shape)
             for name, p in model.named_parameters(remove_duplicate=False)}
    return state | {name: torch.zeros(b.shape, dtype=torch.float64) for name, b in model.state_dict().items()
                    if name not in state}
