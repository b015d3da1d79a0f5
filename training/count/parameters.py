"""Parameters: which ones a rank holds, and how large its share is (model.py's shapes, split by tp.py's rules,
pp.py's stages and ep.py's experts)."""
import functools
import math
from dataclasses import fields

import torch

import pp
from ep import is_expert_parameter
from model import GPT, PLACEMENTS, GPTConfig


def config_key(config):
    """A model config as a hashable key (for the caches below; its fields are numbers, strings and tuples)."""
    return tuple((field.name, getattr(config, field.name)) for field in fields(config))


@functools.lru_cache(maxsize=None)
def model_parameters(config_fields):
    """[(name, shape)] of model.py's GPT in its parameter order, from a model built without memory."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**dict(config_fields)))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def norms_per_block(c):
    """A block's norms: before each sub-layer, after it, or both (model.PLACEMENTS). A norm after a sub-layer
    keeps that sub-layer's output, which nothing else keeps; a sub-layer without a norm before it has its input
    kept by its first matrix, where a norm before it would keep it: each norm keeps what
    activations.norm_activations counts."""
    return 2 * sum(PLACEMENTS[c.norm_placement])


# Parameters tensor parallelism leaves whole on every rank: norms, the position table, routers, a shared expert's
# gate, and latent attention's down-projections (tp.split_latent_attention treats them as norms).
REPLICATED = ("norm", "pos_emb", "router", "shared_gate", "attn.q_down.", "attn.kv_down.")


def tp_sharded(name, config):
    """Whether tensor parallelism splits this parameter of a model of `config` N ways (tp.py): the
    column-parallel q|k|v (latent attention's q_up and kv_up), fc (and their biases), the row-parallel proj
    weights, the vocabulary-parallel embedding and head, the attention sinks and QK-norm over a whole projection
    (by heads). REPLICATED's and row-parallel biases are not."""
    if name.endswith(("qkv.bias", "fc.bias", "attn.sinks")):  # (attention sinks: one a query head)
        return True
    if config.qk_norm_scope == "projection" and name.endswith(("attn.q_norm.weight", "attn.k_norm.weight")):
        return True  # (tp.split_projection_norm)
    return name.endswith(".weight") and not any(part in name for part in REPLICATED)


def stage_of(name, layer_stage, placement):
    """The pipeline rank that holds this parameter (pp.py: the first model chunk's the embeddings, the last's
    the head)."""
    if name.startswith(("tok_emb.", "pos_emb.")):
        return placement.first_rank
    if name.startswith(("norm.", "lm_head.")):
        return placement.last_rank
    return layer_stage[int(name.split(".")[1])]


def layer_stages(config, placement):
    """{layer: pipeline rank}: the rank holding its model chunk (pp.split_layers, pp.Placement)."""
    chunks = pp.split_layers(config.n_layer, placement.n_model_chunks)
    return {layer: placement.holder(k)[0] for k, layers in enumerate(chunks) for layer in layers}


def rank_parameters(config, layout, stage):
    """(dense, expert, tied): [(name, elements)] this pipeline rank holds, in parameter order (any rank of the
    stage: they all hold as many); tied: a tied output layer's copy on the first or last of several stages,
    which train.data_parallel averages on its own."""
    return stage_parameters(config_key(config), layout.tp, layout.pp, layout.virtual_stages, layout.schedule,
                            layout.ep, layout.expert_tp)[stage]


@functools.lru_cache(maxsize=None)
def stage_parameters(config_fields, tp, pp_size, virtual_stages, schedule, ep, expert_tp):
    """rank_parameters of every pipeline stage, in one pass over the model's parameters. A routed expert is
    split over expert_tp as tp splits a dense MLP (tp itself leaves the routed experts whole); the router and
    a shared expert are dense parameters, split by tp."""
    config = GPTConfig(**dict(config_fields))
    placement = pp.Placement.of(schedule, pp_size, virtual_stages)
    stages = layer_stages(config, placement)
    experts_per_rank = config.n_experts // ep if config.n_experts else 0
    held = [([], [], []) for _ in range(pp_size)]
    for name, shape in model_parameters(config_fields):
        expert = is_expert_parameter(name)
        if expert and int(name.split(".")[4]) >= experts_per_rank:
            continue  # another expert-parallel rank's (every rank holds E/ep, the same sizes)
        parts = (expert_tp if expert else tp) if tp_sharded(name, config) else 1
        numel = math.prod(shape) // parts
        if config.tie_embeddings and placement.ends_apart() and name == "tok_emb.weight":  # one on each end
            held[stage_of(name, stages, placement)][2].append((name, numel))
            held[stage_of("lm_head.weight", stages, placement)][2].append(("lm_head.weight", numel))
            continue
        dense, expert_params, _ = held[stage_of(name, stages, placement)]
        (expert_params if expert else dense).append((name, numel))
    return [tuple(map(tuple, stage)) for stage in held]  # (hashable: the caches below take them)
