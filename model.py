"""A slim GPT: the single-device model that every parallel run must match.

Read top to bottom: config, attention, MLP, mixture of experts, block, GPT.
The config describes today's families of decoder: GPT-2 (learned
positions, LayerNorm, GELU MLP, biases), Llama (rotary positions,
grouped-query attention, RMSNorm, SwiGLU MLP, no biases) and DeepSeek-V3
(Llama's block with multi-head latent attention, `LatentAttention`); MoE
layers may add a shared expert (DeepSeek-MoE; Qwen2-MoE's behind a sigmoid
gate), balance their experts with a routing bias instead of, or beside, an
auxiliary loss, and route by DeepSeek-V3's sigmoid scores within groups
(`route`). Rotary positions may be stretched by Llama 3.1's, YaRN's or linear
scaling. A block's norms may sit before each sub-layer, after it (OLMo 2) or
both (Gemma 3, with its (1 + w) RMSNorm, GeGLU, scaled embedding and query
scale): see `Block`.
Everything is plain PyTorch on one device. The parallel files never change
this model's mathematics; they slice its weights, move its activations between
ranks and swap two seams that are kept deliberately small:

- `CausalSelfAttention.core(q, k, v, documents, window=, sinks=)` (and `LatentAttention.core`) is the
  attention core (training replaces it with cp.py's, which computes only the
  keys a query sees, and context parallelism with ring attention; `GPT.generate`,
  for the length of a call, with a key/value cache, `KVCache`);
- `GPT.loss_fn(logits, targets, tokens=None)` is the cross-entropy (tensor
  parallelism replaces it with one that never gathers the vocabulary-sharded
  logits);
- positions are passed in explicitly (`pos`, down to every block, where rotary
  embeddings need them), so a rank holding a shard of the sequence that is
  not contiguous still embeds and rotates the right positions.

Packed documents: a training sequence may hold several documents back to
back, each ended by an EOS token. With `documents` (each token's document,
`document_ids`) attention stays within a document, positions restart at each
document's first token (`token_positions`), and the prediction that would
cross into the next document (the target after an EOS) is marked IGNORE and
left out of the loss. Without it (None), one causal sequence, as GPT-2 trained.
A layer may also see only the latest `sliding_window` tokens (Mistral, Qwen2,
Gemma 3, gpt-oss: `window_layers` says which layers), and with
`attention_sinks` each head has a learned logit in its softmax's denominator
(gpt-oss): both are the layer's own, passed to its core with the documents.

Initial values are drawn by position (`initial_values`): each element's is a
function of (seed, parameter name, its position in the full tensor), so a
rank that holds a slice of a parameter fills it alone, equal to the same
elements of this model.

No dropout: the correctness contract (every configuration equals the single
device, step for step) needs a deterministic model.
"""
import math
import zlib
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    # shape
    vocab_size: int = 256
    seq_len: int = 128           # tokens per training sequence
    n_layer: int = 4
    n_head: int = 4
    n_kv_heads: int = 0          # key/value heads (grouped-query attention); 0 means n_head
    head_dim: int = 0            # features of a head; 0 means d_model // n_head (Qwen3, Mistral NeMo: wider)
    d_model: int = 128
    d_ff: int = 0                # MLP hidden size; 0 means 4 * d_model
    # positions
    position: str = "learned"    # "learned" (a position table, GPT-2) or "rope" (rotary, Llama)
    max_seq_len: int = 0         # the longest sequence: rows of the learned position table; 0: seq_len
    rope_theta: float = 10000.0  # rotary base: pair i of a head turns by pos * theta^(-2i/head_dim)
    rope_factor: float = 1.0     # Llama 3.1's scaling of the rotary frequencies (1: none; see rotary_frequencies)
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    rope_type: str = "llama3"    # how rope_factor > 1 scales: "llama3" (Llama 3.1's), "yarn" (yarn_frequencies) or
    #                              "linear" (every frequency rope_factor times slower: Gemma 3's global layers)
    rope_beta_fast: float = 32.0  # YaRN: pairs turning more than this many times over the original context are kept
    rope_beta_slow: float = 1.0   # YaRN: pairs turning fewer times are slowed by rope_factor
    rope_mscale: float = 0.0      # YaRN's attention temperature terms (0: transformers' default; see yarn_gains)
    rope_mscale_all_dim: float = 0.0
    rope_truncate: bool = True    # YaRN's ramp ends rounded out to whole pairs (transformers' truncate; gpt-oss: no)
    local_rope_theta: float = 0.0  # the windowed layers' own rotary base, unscaled (Gemma 3's rope_local_base_freq;
    #                                0: they rotate as the others do)
    # norms, MLP and biases
    norm: str = "layer"          # "layer" (LayerNorm), "rms" (RMSNorm) or "rms_offset" (Gemma's: OffsetRMSNorm)
    norm_eps: float = 1e-5       # added to the variance (mean square) under the norms' square root
    norm_placement: str = "pre"  # a block's norms: "pre" each sub-layer (GPT-2, Llama), "post" it, inside the
    #                              residual branch (OLMo 2), or "sandwich", both (Gemma 3); see Block
    mlp: str = "gelu"            # "gelu" (exact), "gelu_tanh" (GPT-2's tanh approximation), "swiglu",
    #                              gpt-oss's "clamped_swiglu" or Gemma's "geglu" (ACTIVATIONS)
    bias: bool = True            # biases in the linear layers and LayerNorms
    qkv_bias: bool = None        # biases on q, k and v (Qwen2 has them alone); None: as bias
    qk_norm: bool = False        # RMSNorm of q and k before the rotation (Qwen3, OLMo 2, Gemma 3)
    qk_norm_scope: str = "head"  # over each head's features (Qwen3, Gemma 3) or a token's whole "projection" (OLMo 2)
    query_scale: float = 0.0     # the scores are q kᵀ / √query_scale (Gemma 3's query_pre_attn_scalar); 0: head_dim
    scale_embedding: bool = False  # the token embeddings multiplied by √d_model (Gemma)
    # what a query sees besides the causal order (see causal_attention)
    sliding_window: int = 0      # a token sees at most this many latest tokens, itself included (0: no window)
    window_layers: tuple = field(default_factory=tuple)  # which blocks have the window; empty: all of them
    attention_sinks: bool = False  # a learned logit per head in every softmax's denominator (gpt-oss)
    # multi-head latent attention (DeepSeek-V2 and V3; kv_lora_rank > 0 turns it on, see LatentAttention)
    kv_lora_rank: int = 0        # the compressed latent every head's keys and values come from
    q_lora_rank: int = 0         # the queries' own low-rank bottleneck (0: none, queries straight from x)
    qk_nope_head_dim: int = 0    # a head's query and key features that are not rotated
    qk_rope_head_dim: int = 0    # and those that are: the key's are one set shared by every head
    v_head_dim: int = 0          # a head's value features (0: head_dim)
    # embedding and output tables
    padded_vocab_size: int = 0   # rows of the embedding and output tables (see cross_entropy); 0: vocab_size
    tie_embeddings: bool = False  # the output layer's weight is the embedding's (GPT-2, Llama 3.2 1B and 3B)
    # experts (mixture of experts)
    n_experts: int = 0           # 0: every MLP is dense; > 0: mixture of experts
    top_k: int = 2               # experts chosen per token
    moe_layers: tuple = field(default_factory=tuple)  # which blocks are MoE; empty: all of them
    n_shared_experts: int = 0    # experts every token passes through besides its top-k (DeepSeek-MoE); 0: none
    d_expert: int = 0            # a routed expert's hidden size (Qwen's moe_intermediate_size); 0 means d_ff
    d_shared: int = 0            # the shared expert's hidden size (Qwen2-MoE's); 0 means n_shared_experts * d_expert
    norm_topk_prob: bool = True  # the top-k gates renormalised to sum to 1 (Mixtral); False: their softmax as is
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x W), W: d_model -> 1 (Qwen2-MoE)
    router_scoring: str = "softmax"  # "softmax" over the experts, or each one's "sigmoid" (DeepSeek-V3)
    router_bias: bool = False    # the router's logits have a learned bias (gpt-oss)
    n_group: int = 1             # DeepSeek-V3's group-limited routing: experts in n_group groups, a token's top_k
    topk_group: int = 1          # chosen within its topk_group best groups (see `route`)
    routed_scaling_factor: float = 1.0  # the chosen experts' gates multiplied by it (DeepSeek-V3: 2.5)
    aux_loss_coef: float = 0.01  # weight of the Switch load-balancing loss (0: none)
    aux_loss_scope: str = "batch"  # that loss over each micro-batch, each "sequence" of it (DeepSeek-V3's), or with
    #                                each expert's share of the whole "global" batch (Qwen's; see load_balancing_loss)
    bias_update_rate: float = 0.0  # step of the routing bias towards balance per training step (0: none)

    def __post_init__(self):
        self.d_ff = self.d_ff or 4 * self.d_model
        self.d_expert = self.d_expert or self.d_ff
        self.d_shared = self.d_shared or self.n_shared_experts * self.d_expert
        self.n_kv_heads = self.n_kv_heads or self.n_head
        if self.kv_lora_rank:  # latent attention: every head has its own keys and values, of their own widths
            self.n_kv_heads, self.head_dim = self.n_head, self.qk_nope_head_dim + self.qk_rope_head_dim
        if not self.head_dim and self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}: give head_dim")
        self.head_dim = self.head_dim or self.d_model // self.n_head
        self.v_head_dim = self.v_head_dim or self.head_dim
        self.padded_vocab_size = self.padded_vocab_size or self.vocab_size
        self.max_seq_len = self.max_seq_len or self.seq_len
        self.qkv_bias = self.bias if self.qkv_bias is None else self.qkv_bias
        self.moe_layers, self.window_layers = tuple(self.moe_layers), tuple(self.window_layers)
        if self.head_dim < 1:
            raise ValueError(f"head_dim={self.head_dim} must be at least 1")
        if not 1 <= self.n_kv_heads <= self.n_head or self.n_head % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_head={self.n_head}")
        for name, value, allowed in [("position", self.position, ("learned", "rope")),
                                     ("norm", self.norm, tuple(NORMS)), ("mlp", self.mlp, tuple(ACTIVATIONS)),
                                     ("norm_placement", self.norm_placement, tuple(PLACEMENTS)),
                                     ("qk_norm_scope", self.qk_norm_scope, ("head", "projection")),
                                     ("rope_type", self.rope_type, ("llama3", "yarn", "linear")),
                                     ("router_scoring", self.router_scoring, tuple(SCORES)),
                                     ("aux_loss_scope", self.aux_loss_scope, ("batch", "sequence", "global"))]:
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {allowed}")
        if self.position == "rope" and self.rotary_dim % 2:
            raise ValueError(f"rotary embeddings turn pairs of features: head size {self.rotary_dim} is odd")
        if self.kv_lora_rank and (self.position != "rope" or min(self.qk_nope_head_dim, self.qk_rope_head_dim) < 1):
            raise ValueError("latent attention (kv_lora_rank) rotates qk_rope_head_dim features of each head and "
                             "leaves qk_nope_head_dim as they are: it needs position='rope' and both of at least 1")
        if self.qk_norm_scope == "projection" and self.norm == "rms_offset":
            raise ValueError("QK-norm over a whole projection is OLMo 2's RMSNorm (weight times x/rms), whose "
                             "weights start at 1: not with Gemma's (1 + weight) norms, which start at 0")
        if (self.query_scale or self.local_rope_theta) and (self.position != "rope" or self.kv_lora_rank):
            raise ValueError("query_scale and local_rope_theta act through the rotation of grouped-query attention "
                             "(rotary): they need position='rope' and no latent attention")
        if self.v_head_dim != self.head_dim and not self.kv_lora_rank:
            raise ValueError(f"v_head_dim={self.v_head_dim} differs from head_dim={self.head_dim}: only latent "
                             f"attention (kv_lora_rank) has values of their own width")
        if self.n_experts and (self.n_experts % self.n_group or not 1 <= self.topk_group <= self.n_group
                               or self.top_k > self.topk_group * (self.n_experts // self.n_group)):
            raise ValueError(f"group-limited routing: {self.n_experts} experts in n_group={self.n_group} equal groups, "
                             f"top_k={self.top_k} of them from topk_group={self.topk_group} groups")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size={self.padded_vocab_size} is smaller than vocab_size={self.vocab_size}")
        if self.seq_len > self.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} is longer than max_seq_len={self.max_seq_len}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if (self.d_shared or self.shared_expert_gate) and not self.n_shared_experts:
            raise ValueError("d_shared and shared_expert_gate shape the shared expert: they need n_shared_experts")
        for name, layers in [("moe_layers", self.moe_layers), ("window_layers", self.window_layers)]:
            bad = [i for i in layers if not 0 <= i < self.n_layer]
            if bad:
                raise ValueError(f"{name} {bad} are not layers of a {self.n_layer}-layer model")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be at least 1 token (0: no window)")
        if self.window_layers and not self.sliding_window:
            raise ValueError(f"window_layers {list(self.window_layers)} need a sliding_window of at least 1 token")

    @property
    def gated(self) -> bool:
        """Whether the MLP's first matrix holds a gate and an up half (SwiGLU's kinds)."""
        return self.mlp in GATED

    @property
    def norm_weight(self) -> float:
        """The norms' weight that leaves a normed x as it is: 0 for Gemma's (1 + weight), else 1."""
        return 0.0 if self.norm == "rms_offset" else 1.0

    @property
    def query_gain(self) -> float:
        """What q is multiplied by so that the core's 1/√head_dim scales the scores by 1/√query_scale."""
        return math.sqrt(self.head_dim / self.query_scale) if self.query_scale else 1.0

    def rotation(self, layer: int):
        """The config the layer's rotary embedding reads: a windowed layer with local_rope_theta turns by its
        own base, unscaled (Gemma 3); every other layer by this config's."""
        if self.local_rope_theta and self.window(layer):
            return replace(self, rope_theta=self.local_rope_theta, rope_factor=1.0)
        return self

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and (not self.moe_layers or layer in self.moe_layers)

    def window(self, layer: int):
        """How many latest tokens a query of this layer sees, itself included; None: every earlier one."""
        windowed = self.sliding_window and (not self.window_layers or layer in self.window_layers)
        return self.sliding_window if windowed else None

    @property
    def q_dim(self) -> int:
        """Features of the queries (and of the heads' outputs, which proj maps back to d_model): n_head heads of
        head_dim."""
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Features of the keys (and of the values): n_kv_heads heads of head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """Features of the values (and of the heads' outputs, which proj maps back to d_model)."""
        return self.n_kv_heads * self.v_head_dim

    @property
    def rotary_dim(self) -> int:
        """Features of a head that rotary embeddings turn: all of them, or latent attention's rotated part."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim


def pad_vocabulary(vocab_size, multiple=64):
    """The tables' rows for vocab_size ids: a multiple of 64 (as nanoGPT pads GPT-2's 50257 to 50304), so that
    they split evenly over tensor-parallel ranks; the padding is never predicted (see without_padding)."""
    return -(-vocab_size // multiple) * multiple


def at_least_float32(t):
    """t in float32, or kept in its own dtype if that is wider (float64 checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def without_padding(logits, vocab_size, first_id=0):
    """logits of the ids past the vocabulary (the tables' padding rows) set to -inf: no probability goes there,
    so a padded model predicts what the unpadded one does. logits: of ids first_id, first_id + 1, ...
    (a rank's share of the vocabulary under tensor parallelism). Untouched when none is padding."""
    real = max(0, vocab_size - first_id)
    if real >= logits.shape[-1]:
        return logits
    return logits.index_fill(-1, torch.arange(real, logits.shape[-1], device=logits.device), float("-inf"))


IGNORE = -100  # a target left out of the loss (PyTorch's ignore_index): the prediction across a document's end


def cross_entropy(logits, targets, vocab_size, tokens=None):
    """Cross-entropy of logits over vocab_size ids (and padding), in float32 or better, over the targets that
    count (not IGNORE): their mean, or summed and divided by `tokens`. A run whose shards count different
    numbers passes the same `tokens` to each, so that the shards' losses average to the mean over every
    counted target of the whole batch (and a shard where none counts adds zero)."""
    logits = without_padding(at_least_float32(logits.flatten(0, 1)), vocab_size)
    if tokens is None:
        return F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE)
    return F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE, reduction="sum") / tokens


# ---------------------------------------------------------------------------
# Packed documents: which document each token is in, and where in it
# ---------------------------------------------------------------------------

def document_ids(idx, eos_id):
    """(batch, seq) the document of each token of idx in its row, counted from 0: a document ends with its
    EOS, so a token's document is the number of EOS tokens before it."""
    ends = (idx == eos_id).long()
    return ends.cumsum(1) - ends


def document_targets(idx, targets, eos_id):
    """targets with the prediction made at each EOS (the next document's first token) set to IGNORE: a
    document is not predicted from the one before it."""
    return targets.masked_fill(idx == eos_id, IGNORE)


def token_positions(pos, documents):
    """The position each token is embedded and rotated at: its index in the sequence (pos: of the tokens this
    rank holds), or with documents (of the whole sequence) its place in its own document, 0 at its first token."""
    if documents is None:
        return pos
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first_of_document = torch.where(starts, index, 0).cummax(dim=1).values
    return (index - first_of_document)[:, pos.to(documents.device)]


def visible(documents, window, queries, keys):
    """(batch or 1, 1, queries, keys) True where query i may attend key j: j <= i, in the same document
    (documents None: one sequence), and within the window, i - j < window (None: no window). queries and
    keys: their indices in the sequence (any subset of it, in any order)."""
    mask = keys[None, :] <= queries[:, None]
    if window is not None:
        mask = mask & (queries[:, None] - keys[None, :] < window)
    if documents is not None:
        mask = mask & (documents[:, queries, None] == documents[:, None, keys])
    return mask.expand(1 if documents is None else documents.shape[0], -1, -1).unsqueeze(1)


def causal_attention(q, k, v, documents=None, window=None, sinks=None):
    """softmax(q kᵀ / √d + mask) v for (batch, heads, seq, head_dim) tensors: each query attends to the
    earlier keys it may see (`visible`: with documents (batch, seq), those of its own document; with a
    window, the `window` latest). sinks (heads,): a learned logit per head added to each softmax's
    denominator (gpt-oss), which lets a query give part of its attention to nothing.

    k and v may have fewer heads than q (grouped-query attention): each group
    of consecutive query heads shares one key/value head.

    The readable reference, holding a (seq, seq) mask when anything but the causal order masks: training
    runs cp.py's core instead, which computes only the blocks of keys a query sees.
    """
    gqa = q.shape[1] != k.shape[1]
    if documents is None and window is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    everything = torch.arange(q.shape[2], device=q.device)
    return masked_attention(q, k, v, visible(documents, window, everything, everything), sinks)


def masked_attention(q, k, v, mask, sinks=None):
    """softmax(q kᵀ / √d, where mask allows) v, with each head's sink logit in the denominator if given."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share dropped
    return weights.to(v.dtype) @ v


def rotary_frequencies(config, head_dim, dtype, device):
    """How fast each feature pair of a head turns with the position: pair i by theta^(-2i/head_dim) a token.

    With Llama 3.1's scaling (rope_factor > 1; Meta's `apply_scaling`, transformers' "llama3" rope type), the
    pairs whose wavelength 2 pi / frequency is longer than the original context over rope_low_freq_factor
    turn rope_factor times slower, those shorter than it over rope_high_freq_factor are kept, and those
    between are blended linearly in (original context / wavelength). With YaRN's, see yarn_frequencies.
    """
    half = head_dim // 2
    frequencies = config.rope_theta ** (-torch.arange(half, dtype=dtype, device=device) / half)
    if config.rope_factor == 1:
        return frequencies
    if config.rope_type == "yarn":
        return yarn_frequencies(config, frequencies)
    if config.rope_type == "linear":  # (positions rope_factor times closer together)
        return frequencies / config.rope_factor
    low, high, context = config.rope_low_freq_factor, config.rope_high_freq_factor, config.rope_original_context
    blend = ((context * frequencies / (2 * math.pi) - low) / (high - low)).clamp(0, 1)  # 0: slowed, 1: kept
    return (1 - blend) * frequencies / config.rope_factor + blend * frequencies


def yarn_frequencies(config, frequencies):
    """YaRN's blend (Peng et al., 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
    section 3.2, as transformers computes it): the pairs that turn more than rope_beta_fast times over the
    original context are kept, those that turn fewer than rope_beta_slow times are slowed rope_factor times,
    and between the two a linear ramp over the pair index, whose ends are rounded outwards to whole pairs
    (unless rope_truncate is false, as gpt-oss's config says).

    Pair i turns context * theta^(-2i/d) / (2 pi) times over the context, so it turns b times at
    i(b) = d ln(context / (2 pi b)) / (2 ln theta), with d the rotated features (2 * len(frequencies)).
    """
    d, context = 2 * len(frequencies), config.rope_original_context

    def pair_turning(times):
        return d * math.log(context / (2 * math.pi * times)) / (2 * math.log(config.rope_theta))
    first, last = pair_turning(config.rope_beta_fast), pair_turning(config.rope_beta_slow)
    if config.rope_truncate:
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, d - 1)
    last = last if last > first else first + 0.001  # (transformers' guard against a ramp of no width)
    pair = torch.arange(len(frequencies), dtype=frequencies.dtype, device=frequencies.device)
    slowed = ((pair - first) / (last - first)).clamp(0, 1)  # 0: kept, 1: slowed
    return slowed * frequencies / config.rope_factor + (1 - slowed) * frequencies


def yarn_gains(config):
    """(rotary_gain, softmax_gain) of YaRN's attention temperature: sqrt(1/t) = 0.1 ln(s) + 1 for a context
    s = rope_factor times longer (the paper's equation 22), written mscale(s, m) = 0.1 m ln(s) + 1.

    transformers' rotary embedding multiplies the rotated features by mscale(s, rope_mscale) / mscale(s,
    rope_mscale_all_dim) when a config gives both (DeepSeek-V3's: 1 and 1, so 1), else by mscale(s, 1);
    DeepSeek's latent attention also multiplies its softmax's scale by mscale(s, rope_mscale_all_dim)² when
    a config gives it. (1, 1) without YaRN.
    """
    if config.rope_type != "yarn" or config.rope_factor <= 1:
        return 1.0, 1.0
    m, m_all = config.rope_mscale, config.rope_mscale_all_dim
    softmax_gain = yarn_mscale(config.rope_factor, m_all) ** 2 if m_all else 1.0
    return yarn_rotary_gain(config.rope_factor, m, m_all), softmax_gain


def yarn_mscale(factor, m):
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_rotary_gain(factor, m, m_all):
    """What transformers' rotary embedding multiplies the rotated features by (its attention_factor, where a
    config states none): mscale(s, m) / mscale(s, m_all) where both are given, else mscale(s, 1)."""
    return yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor, 1.0)


def rotary(x, pos, frequencies, gain=1.0):
    """Rotary position embedding (RoFormer, as Llama lays it out) of x (batch, heads, seq, head_dim).

    Feature pairs (i, i + head_dim/2) of the token at position p are turned by the
    angle p * frequencies[i], so q . k depends on positions only through
    their difference. Positions come from `pos`, (seq,) or each row its own (batch, seq), never from the
    place in x. gain multiplies the turned features (YaRN's rotary gain, see yarn_gains; 1: none).
    """
    x1, x2 = at_least_float32(x).chunk(2, dim=-1)
    angles = (pos.to(x1.dtype).unsqueeze(-1) * frequencies.to(x1.dtype)).unsqueeze(-3)  # (1 or batch, 1, seq, half)
    cos, sin = angles.cos() * gain, angles.sin() * gain
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def qk_norm(config: GPTConfig, heads):
    """QK-norm of q or k (of `heads` heads) before the rotation: an RMSNorm (Gemma's kind with norm
    "rms_offset") over each head's features, one weight of head_dim shared by every head (Qwen3, Gemma 3), or
    over a token's whole projection (ProjectionNorm, OLMo 2); without it, nothing (an identity)."""
    if not config.qk_norm:
        return nn.Identity()
    if config.qk_norm_scope == "projection":
        return ProjectionNorm(heads, config.head_dim, config.norm_eps)
    return (OffsetRMSNorm if config.norm == "rms_offset" else nn.RMSNorm)(config.head_dim, eps=config.norm_eps)


def sum_of_squares(x):
    """Each token's sum of squares over its heads' features, (batch, 1, seq, 1), of x (batch, heads, seq, dim)."""
    return x.pow(2).sum((1, 3), keepdim=True)


class ProjectionNorm(nn.Module):
    """QK-norm over a token's whole projection (OLMo 2's q_norm and k_norm): an RMSNorm of all its heads' features
    at once, one weight a feature, in float32 or wider, applied to (batch, heads, seq, head_dim).

    `squares` is the seam where tensor parallelism, whose rank holds some of the heads, adds the other ranks'
    sums (tp.py); the mean divides by the whole projection's width whatever a rank holds."""

    def __init__(self, heads, head_dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads * head_dim))
        self.width, self.eps = heads * head_dim, eps
        self.squares = sum_of_squares

    def forward(self, x):
        wide = at_least_float32(x)
        normed = wide * torch.rsqrt(self.squares(wide) / self.width + self.eps)
        return (normed * self.weight.view(-1, 1, x.shape[-1])).to(x.dtype)  # (heads, 1, head_dim): a rank's heads


def query_sees(module, config, layer):
    """Give an attention layer what its queries see besides the causal order (passed to its core): its
    window (None: none) and, with attention_sinks, one learned sink logit per query head."""
    module.window = config.window(layer)
    module.sinks = nn.Parameter(torch.empty(config.n_head)) if config.attention_sinks else None


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer=0):
        super().__init__()
        self.head_dim = config.head_dim
        self.group = config.n_head // config.n_kv_heads  # query heads per key/value head
        # Output laid out as (q heads | k heads | v heads) x head_dim; with grouped-query attention
        # the k and v parts are smaller than q's. The heads may be wider or narrower than d_model / n_head.
        self.qkv = nn.Linear(config.d_model, config.q_dim + 2 * config.kv_dim, bias=config.qkv_bias)
        self.q_norm, self.k_norm = qk_norm(config, config.n_head), qk_norm(config, config.n_kv_heads)
        self.proj = nn.Linear(config.q_dim, config.d_model, bias=config.bias)
        rotation = config.rotation(layer)
        self.frequencies = partial(rotary_frequencies, rotation, self.head_dim) if config.position == "rope" else None
        # (k's gain, q's: a query scale other than the core's 1/√head_dim rides on q's rotation)
        self.rotary_gain = yarn_gains(rotation)[0]
        self.query_gain = self.rotary_gain * config.query_gain
        self.core = causal_attention  # the swappable seam (see the module docstring)
        query_sees(self, config, layer)

    def forward(self, x, pos, documents=None):
        qkv = self.qkv(x)
        # Shapes are read off qkv's output, so a rank holding some of the heads (tensor parallelism),
        # or whose qkv gathers the sequence (sequence parallelism), runs this unchanged.
        batch, seq = qkv.shape[:2]
        heads = qkv.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (batch, heads, seq, head_dim)
        n_kv = heads.shape[1] // (self.group + 2)
        q, k, v = heads.split([self.group * n_kv, n_kv, n_kv], dim=1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.frequencies:
            frequencies = self.frequencies(at_least_float32(q).dtype, q.device)
            q, k = rotary(q, pos, frequencies, self.query_gain), rotary(k, pos, frequencies, self.rotary_gain)
        y = self.core(q, k, v, documents, window=self.window, sinks=self.sinks)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


# The epsilon of latent attention's two bottleneck norms, whatever norm_eps is: DeepSeek's inference code and
# transformers' DeepseekV3Attention build them as RMSNorm(rank), whose default is 1e-6 (rms_norm_eps is the
# blocks' norms' alone).
LATENT_NORM_EPS = 1e-6


def low_rank(d_in, rank, d_out):
    """x -> up(norm(down(x))) through a bottleneck of `rank` features, RMS-normed there; rank 0: up(x) alone.
    (down, norm, up), the first two identities without a bottleneck."""
    if not rank:
        return nn.Identity(), nn.Identity(), nn.Linear(d_in, d_out, bias=False)
    return nn.Linear(d_in, rank, bias=False), nn.RMSNorm(rank, eps=LATENT_NORM_EPS), nn.Linear(rank, d_out, bias=False)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, 2024, section 2.1; DeepSeek-V3's): the same seams as
    CausalSelfAttention (`core`, positions passed in), other projections.

    Keys and values come from one compressed latent of kv_lora_rank features a token (kv_down, normed, then kv_up to
    every head's unrotated key part and its value): the latent, not the heads' keys and values, is what an inference
    cache need keep (KVCache here keeps the heads', as it does for every attention). Rotary positions cannot pass
    through that compression (a rotation depends on the position, the up-projection does not), so each head's query
    and key have a second part of qk_rope_head_dim features that is rotated: the query's from the query's own
    projection, the key's one set from kv_down, shared by every head. A head's query and key have qk_nope_head_dim +
    qk_rope_head_dim features (DeepSeek-V3: 128 + 64), its value v_head_dim (128). Queries go through a low-rank
    bottleneck of their own (q_lora_rank; none in DeepSeek-V2-Lite).

    The scores are scaled by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), the core's default for q's width,
    times YaRN's softmax gain, which multiplies q here.
    """

    def __init__(self, config: GPTConfig, layer=0):
        super().__init__()
        self.nope, self.rope, self.v_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_down, self.q_down_norm, self.q_up = low_rank(config.d_model, config.q_lora_rank, config.q_dim)
        self.kv_down = nn.Linear(config.d_model, config.kv_lora_rank + self.rope, bias=False)  # latent | shared key
        self.kv_down_norm = nn.RMSNorm(config.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_up = nn.Linear(config.kv_lora_rank, config.n_head * (self.nope + self.v_head_dim), bias=False)
        self.proj = nn.Linear(config.v_dim, config.d_model, bias=False)
        self.frequencies = partial(rotary_frequencies, config, self.rope)
        self.rotary_gain, self.softmax_gain = yarn_gains(config)
        self.core = causal_attention  # the swappable seam (see the module docstring)
        self.compressed = unchanged  # a second seam: where tensor parallelism's region begins (tp.py)
        query_sees(self, config, layer)

    def forward(self, x, pos, documents=None):
        latent, k_rope = self.kv_down(x).split([self.kv_down_norm.normalized_shape[0], self.rope], dim=-1)
        q_latent, latent, k_rope = self.compressed(self.q_down_norm(self.q_down(x)), self.kv_down_norm(latent), k_rope)
        q, kv = self.q_up(q_latent), self.kv_up(latent)
        # Shapes are read off the up-projections' outputs, so a rank holding some of the heads (tensor
        # parallelism), whose compressed tokens are gathered (sequence parallelism), runs this unchanged.
        batch, seq = q.shape[:2]
        q_nope, q_rope = q.view(batch, seq, -1, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], -1)
        k_nope, v = kv.view(batch, seq, -1, self.nope + self.v_head_dim).transpose(1, 2).split(
            [self.nope, self.v_head_dim], -1)  # (batch, heads, seq, features) from here
        frequencies = self.frequencies(at_least_float32(q).dtype, q.device)
        q_rope = rotary(q_rope, pos, frequencies, self.rotary_gain)
        k_rope = rotary(k_rope.unsqueeze(1), pos, frequencies, self.rotary_gain)  # one head, for every head
        q = torch.cat([q_nope, q_rope], dim=-1) * self.softmax_gain
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        y = self.core(q, k, v, documents, window=self.window, sinks=self.sinks)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


def unchanged(*tensors):
    return tensors


class KVCache:
    """One attention layer's keys and values of the tokens so far, for generation: an attention core, swapped in
    for `CausalSelfAttention.core` (`attention_cores`), that appends the new tokens' keys and values (already
    QK-normed and rotated at their positions) to those it holds and attends to them all. The new tokens are the
    last ones, so the causal mask is aligned to the end: the query at position t sees keys 0..t (within a window,
    the latest `window` of them)."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self):
        return 0 if self.k is None else self.k.shape[2]

    def clear(self):
        self.k = self.v = None

    def __call__(self, q, k, v, documents=None, window=None, sinks=None):
        if documents is not None:
            raise ValueError("a key/value cache holds one sequence a row: no packed documents")
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        keys = torch.arange(k.shape[2], device=q.device)  # query i sits at len(keys) - len(q) + i
        return masked_attention(q, k, v, visible(None, window, keys[k.shape[2] - q.shape[2]:], keys), sinks)


@contextmanager
def attention_cores(blocks, cores):
    """The blocks' attention cores replaced by `cores`, one a block (none: all kept), until the context ends."""
    kept = [block.attn.core for block in blocks]
    for block, core in zip(blocks, cores):
        block.attn.core = core
    try:
        yield
    finally:
        for block, core in zip(blocks, kept):
            block.attn.core = core


def swiglu(h):
    """SwiGLU (Shazeer, 2020): silu(gate) * up, from the two halves of the first projection."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(h, limit=7.0, alpha=1.702):
    """gpt-oss's SwiGLU: the gate clamped above at `limit`, up to [-limit, limit], then (up + 1) · gate ·
    sigmoid(alpha · gate), from the first projection's gate and up halves (SwiGLU's layout; gpt-oss's folders
    interleave them)."""
    gate, up = h.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


def geglu(h):
    """GeGLU (Shazeer, 2020), with GELU's tanh approximation (Gemma's): gelu(gate) * up."""
    gate, up = h.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh"), "swiglu": swiglu,
               "clamped_swiglu": clamped_swiglu, "geglu": geglu}
GATED = ("swiglu", "clamped_swiglu", "geglu")  # the activations that take (gate | up)


class MLP(nn.Module):
    """proj(act(fc(x))): GELU, or SwiGLU (gpt-oss's clamped one too) or GeGLU, whose fc holds the gate and up
    matrices as (gate | up)."""

    def __init__(self, config: GPTConfig, d_ff=None):
        super().__init__()
        d_ff = d_ff or config.d_ff
        n_inputs = 2 if config.gated else 1
        self.fc = nn.Linear(config.d_model, n_inputs * d_ff, bias=config.bias)
        self.act = ACTIVATIONS[config.mlp]
        self.proj = nn.Linear(d_ff, config.d_model, bias=config.bias)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


def softmax_scores(logits):
    """(scores, probs): the softmax over the experts, both."""
    probs = logits.softmax(-1)
    return probs, probs


def sigmoid_scores(logits):
    """(scores, probs): DeepSeek-V3's scores, each expert's sigmoid(logit) on its own, not competing for a sum
    of one; and those normalised to sum to one (its s', which its balance loss averages)."""
    scores = logits.sigmoid()
    return scores, scores / scores.sum(-1, keepdim=True)


SCORES = {"softmax": softmax_scores, "sigmoid": sigmoid_scores}


def route(router_logits, top_k, bias=None, renormalise=True, scoring="softmax", groups=(1, 1), scale=1.0):
    """Top-k routing: (gates, experts, probs) for (tokens, n_experts) logits.

    The scores are the softmax over all experts, or DeepSeek-V3's sigmoid of each (`scoring`); the k
    largest are kept and renormalised to sum to one (the article's 0.60/0.35 -> 0.63/0.37), or with
    renormalise False kept as they are (Qwen2-MoE's norm_topk_prob=False), then multiplied by `scale`
    (DeepSeek-V3's routed_scaling_factor). A balancing bias (DeepSeek-V3) is added to the scores only to
    choose the k experts; the gates stay those of the unbiased scores. groups = (n_group, topk_group):
    DeepSeek-V3's group-limited routing (`best_groups_only`). probs, for the balancing loss, are the scores
    normalised to sum to one over the experts (SCORES). Computed in float32 or better, whatever the
    activations' dtype.
    """
    scores, probs = SCORES[scoring](at_least_float32(router_logits))
    choice = scores if bias is None else scores + bias
    experts = best_groups_only(choice, *groups).topk(top_k, dim=-1).indices
    top_scores = scores.gather(-1, experts)
    gates = top_scores / top_scores.sum(-1, keepdim=True) if renormalise else top_scores
    return gates * scale, experts, probs


def best_groups_only(choice, n_group, topk_group):
    """choice (tokens, n_experts) with the experts outside each token's topk_group best groups set to -inf
    (DeepSeek-V3, section 2.1.2: a token's experts sit in at most topk_group of n_group consecutive groups
    of experts, so placed one group to a node, it travels to at most that many nodes). A group's worth is
    the sum of its two best choice scores (one, in groups of one expert). Unchanged with one group."""
    if n_group == 1:
        return choice
    grouped = choice.unflatten(-1, (n_group, -1))
    worth = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    best = torch.zeros_like(worth, dtype=torch.bool).scatter_(-1, worth.topk(topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~best.unsqueeze(-1), float("-inf")).flatten(-2)


def gated_shared_expert(shared, gate, x):
    """The shared expert's output on x, shared(x), or with a gate (Qwen2-MoE's shared_expert_gate, a
    d_model -> 1 linear) sigmoid(gate(x)) * shared(x): each token takes as much of it as its gate says."""
    out = shared(x)
    return out if gate is None else torch.sigmoid(gate(x)) * out


def load_balancing_loss(probs, experts, n_experts, fractions=None):
    """Switch Transformer auxiliary loss: E * sum_i f_i * P_i, for probs (tokens, E) and the chosen experts
    (tokens, k); given (sequences, tokens, ...), each sequence's, averaged: DeepSeek-V3's sequence-wise balance
    loss (its equations 17-20).

    f_i is the fraction of the (token, choice) assignments that went to expert
    i (no gradient: it comes from an argmax), P_i the mean router probability
    of expert i. It equals 1 when routing is perfectly uniform and grows as
    tokens pile onto a few experts. `fractions`: f given (global balance: the
    previous step's over its whole batch, `step_fractions`), not counted here.
    """
    if fractions is None:
        assignments = experts.flatten(-2)
        counts = torch.zeros(*assignments.shape[:-1], n_experts, dtype=probs.dtype, device=probs.device)
        ones = torch.ones_like(assignments, dtype=probs.dtype)
        fractions = counts.scatter_add_(-1, assignments, ones) / assignments.shape[-1]
    return n_experts * (fractions * probs.mean(-2)).sum(-1).mean()


def step_fractions(load, dtype):
    """Each expert's fraction of a step's assignments, from its counts `load` (global balance, Qwen's "global-batch"
    balance, arXiv 2501.11873: over every micro-batch of every rank); uniform before any step was counted."""
    total = load.sum()
    return torch.where(total > 0, load.to(dtype) / total.clamp(min=1), 1 / len(load))


class MoE(nn.Module):
    """Mixture of experts, dropless, on one device: the reference for ep.py.

    y = sum over the token's top-k experts of gate_i(x) * expert_i(x),
    plus shared(x) when the layer has shared experts (DeepSeek-MoE: one MLP of
    n_shared_experts times an expert's width, or d_shared, that every token
    passes through), with Qwen2-MoE's gate sigmoid(x W) * shared(x).
    An expert's width is d_expert (Qwen's moe_intermediate_size), the dense
    layers' d_ff; the gates renormalised over the top-k or not (norm_topk_prob).

    Two ways to balance the experts, either or both: the Switch auxiliary loss
    (`aux_loss`, added to the loss by GPT.forward with aux_loss_coef), and a
    routing bias (DeepSeek-V3's auxiliary-loss-free balancing): `route_bias`
    shifts which experts are chosen, and after every training step
    `end_moe_step` moves it by bias_update_rate towards balance, from
    the tokens each expert received during the step (`load`). With DeepSeek-V3's sigmoid scores the
    auxiliary loss takes their normalised s', so it is that paper's balance loss (its equation 17), and with
    aux_loss_scope "sequence" it is taken over each sequence and averaged, as that paper's is.

    With aux_loss_scope "global" each expert's f_i is its share of the whole global batch (every micro-batch of
    every rank), not of the micro-batch, so that experts may specialise within a batch (Qwen's global-batch
    balance). A micro-batch's loss cannot wait for the loads of micro-batches not yet run, so f is the previous
    step's (`balance_load`, kept by end_moe_step and in checkpoints): one f for every micro-batch of a step,
    whatever the layout, and a recomputed forward reads the same f. The first step has none: f uniform, so the
    loss is constant and pushes nothing.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.top_k, self.bias_update_rate = config.top_k, config.bias_update_rate
        self.norm_topk_prob = config.norm_topk_prob  # (Hugging Face's Qwen MoE blocks' attribute name)
        self.scoring, self.groups = config.router_scoring, (config.n_group, config.topk_group)  # (ep.py reads them)
        self.routed_scaling_factor = config.routed_scaling_factor
        self.aux_loss_scope = config.aux_loss_scope  # (ep.py reads it)
        self.router = nn.Linear(config.d_model, config.n_experts, bias=config.router_bias)
        self.experts = nn.ModuleList(MLP(config, config.d_expert) for _ in range(config.n_experts))
        self.shared = MLP(config, config.d_shared) if config.n_shared_experts else None
        self.shared_gate = nn.Linear(config.d_model, 1, bias=False) if config.shared_expert_gate else None
        self.register_buffer("route_bias", torch.zeros(config.n_experts))  # saved in checkpoints
        self.register_buffer("load", torch.zeros(config.n_experts, dtype=torch.long), persistent=False)  # step's tokens
        self.register_buffer("balance_load", torch.zeros(config.n_experts, dtype=torch.long)  # the last step's
                             if config.aux_loss_scope == "global" else None)
        self.aux_loss = None  # set by every forward; GPT.forward adds it to the loss
        self.recomputing = False  # set while a forward runs again for backward (see `recomputed`)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        gates, experts, probs = route(self.router(tokens), self.top_k, self.route_bias, self.norm_topk_prob,
                                      self.scoring, self.groups, self.routed_scaling_factor)
        # the loss over the micro-batch's tokens, or each sequence's (x: (sequences, tokens, d_model))
        tokens_by = x.shape[:-1] if self.aux_loss_scope == "sequence" else tokens.shape[:-1]
        fractions = None if self.balance_load is None else step_fractions(self.balance_load, probs.dtype)
        self.aux_loss = load_balancing_loss(probs.view(*tokens_by, -1), experts.view(*tokens_by, -1), len(self.experts),
                                            fractions)
        if torch.is_grad_enabled() and not self.recomputing:  # a training forward, counted once
            self.load += torch.bincount(experts.flatten(), minlength=len(self.experts))
        out = (torch.zeros_like(tokens) if self.shared is None
               else gated_shared_expert(self.shared, self.shared_gate, tokens))
        for e, expert in enumerate(self.experts):
            token_idx, choice = torch.where(experts == e)
            if len(token_idx):  # an expert that got no token is simply not run: its gradient stays None
                y = expert(tokens[token_idx]) * gates[token_idx, choice, None].to(x.dtype)
                out.index_add_(0, token_idx, y)
        return out.view_as(x)


@torch.no_grad()
def end_moe_step(model):
    """After a training step, in every MoE layer: b_i += rate * sign(mean load - load_i) (DeepSeek-V3), so an
    expert that got more than its share of the step's tokens is chosen less; with global balance the step's
    loads kept for the next step's loss (balance_load); then the loads restart.

    Found by attribute, like moe_aux_losses; the loads must already be those of the whole step's batch
    (expert parallelism sums them over ranks), so every rank moves its biases alike.
    """
    for m in model.modules():
        if isinstance(getattr(m, "route_bias", None), torch.Tensor):
            load = m.load.to(m.route_bias.dtype)
            m.route_bias += m.bias_update_rate * torch.sign(load.mean() - load)
            if m.balance_load is not None:
                m.balance_load.copy_(m.load)
            m.load.zero_()


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), in float32 or wider, so a weight of 0 leaves x as it is.
    (x/rms + x/rms * weight: what it keeps for backward is RMSNorm's, and no (1 + weight) tensor of its own.)"""

    def __init__(self, width, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(width)), eps

    def forward(self, x):
        wide = at_least_float32(x)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed + normed * self.weight).to(x.dtype)


NORMS = {"layer": lambda config, width: nn.LayerNorm(width, eps=config.norm_eps, bias=config.bias),
         "rms": lambda config, width: nn.RMSNorm(width, eps=config.norm_eps),
         "rms_offset": lambda config, width: OffsetRMSNorm(width, config.norm_eps)}


def make_norm(config: GPTConfig):
    """LayerNorm (GPT-2), RMSNorm (Llama: x / rms(x) * weight; no mean subtracted, no bias) or Gemma's
    OffsetRMSNorm, over d_model features."""
    return NORMS[config.norm](config, config.d_model)


# Where a block's norms are: (before each sub-layer, after it), True where there is one.
PLACEMENTS = {"pre": (True, False), "post": (False, True), "sandwich": (True, True)}


def block_norms(config: GPTConfig):
    """(before, after) one sub-layer, each a norm or an identity, as config.norm_placement places them."""
    return tuple(make_norm(config) if present else nn.Identity() for present in PLACEMENTS[config.norm_placement])


class Block(nn.Module):
    """A transformer block: x + post_norm1(attn(norm1(x))), then x + post_norm2(mlp(norm2(x))). The norms
    before each sub-layer (pre-norm: GPT-2, Llama), after it inside the residual branch (OLMo 2), or both (Gemma
    3's sandwich); those a placement has not are identities."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.norm1, self.post_norm1 = block_norms(config)
        self.attn = (LatentAttention if config.kv_lora_rank else CausalSelfAttention)(config, layer)
        self.norm2, self.post_norm2 = block_norms(config)
        self.mlp = MoE(config) if config.is_moe(layer) else MLP(config)

    def forward(self, x, pos, documents=None):
        x = x + self.post_norm1(self.attn(self.norm1(x), pos, documents))
        return x + self.post_norm2(self.mlp(self.norm2(x)))


@contextmanager
def _recomputing(module):
    """While module's forward runs again for backward: the layers under it that count (MoE tokens) know it."""
    counters = [m for m in module.modules() if hasattr(m, "recomputing")]
    for m in counters:
        m.recomputing = True
    try:
        yield
    finally:
        for m in counters:
            m.recomputing = False


def recomputed(module, fn):
    """fn (a part of module's forward) under activation checkpointing: its forward keeps only its inputs,
    and backward runs it again to get what it needs. No dropout here, so no random state to replay."""
    return partial(checkpoint, fn, use_reentrant=False, preserve_rng_state=False,
                   context_fn=lambda: (nullcontext(), _recomputing(module)))


def apply_recomputation(model, mode):
    """Trade computation for activation memory, in place (Korthikanti et al., 2022, "Reducing Activation
    Recomputation in Large Transformer Models").

    full: every block keeps only its input (b*s*h per block) and runs its whole forward again in
    backward, about a third more computation. selective: only the attention core, softmax(q kᵀ) v,
    runs again: what it saves grows with s² (the attention probabilities, per head) unless a fused
    kernel already avoids that, and it is cheap to recompute. A core that communicates (ring
    attention) communicates again when recomputed. none: nothing changes.
    """
    for block in model.blocks:
        if not isinstance(block, Block):  # another pipeline stage's layer
            continue
        if mode == "full":
            block.forward = recomputed(block, block.forward)
        elif mode == "selective":
            block.attn.core = recomputed(block.attn, block.attn.core)
    return model


def moe_aux_losses(module):
    """The load-balancing losses the MoE layers under `module` set in their last forward.

    Found by attribute, so an MoE layer that another file replaced (expert
    parallelism) or wrapped (sequence parallelism) is found too.
    """
    return [m.aux_loss for m in module.modules() if isinstance(getattr(m, "aux_loss", None), torch.Tensor)]


# ---------------------------------------------------------------------------
# Initial values: a pure function of (seed, parameter name, element position)
# ---------------------------------------------------------------------------

MASK32 = 0xFFFFFFFF
INIT_CHUNK = 1 << 20  # elements filled at a time, so initialisation's working memory stays small


def _mix32(h):
    """A 32-bit integer hash (Wellons' two-round finaliser; each output bit depends on every input bit).
    h holds values below 2**32 in int64, and the multipliers are below 2**31: no product overflows."""
    h = h ^ (h >> 16)
    h = (h * 0x21F0AAAD) & MASK32
    h = h ^ (h >> 15)
    h = (h * 0x735A2D97) & MASK32
    return h ^ (h >> 15)


def counter_normal(seed, name, positions):
    """A standard normal for each position (int64), a pure function of (seed, name, position).

    A counter-based generator (as JAX's and MaxText's): the value of element i is a hash of (key, i),
    not the i-th draw of a stream, so any slice of a tensor can be drawn alone, on any device, and
    equals the same elements drawn whole. The hash gives a uniform in (0, 1), the inverse of the
    normal's distribution function a normal.
    """
    key = zlib.crc32(f"{seed}:{name}".encode())  # stable across processes (Python's hash() is not)
    h = _mix32(_mix32((positions & MASK32) ^ key) ^ (positions >> 32))
    return torch.special.ndtri((h.double() + 0.5) / 2**32)


def initial_values(name, positions, n_layer, seed, norm_weight=1.0):
    """The initial values (float64) of parameter `name`'s elements at `positions`, flat indices into
    the full tensor, named as in GPT: GPT-2's initialisation (Radford et al., 2019), as nanoGPT has it.

    Weights of linear layers and embeddings N(0, 0.02); the projections that write into the residual
    stream N(0, 0.02 / sqrt(2 n_layer)), so the stream's variance does not grow with depth; biases 0;
    norms' weights norm_weight, the one that leaves a normed x as it is (GPTConfig.norm_weight).
    """
    module, kind = name.split(".")[-2:]
    if kind == "bias":
        return torch.zeros(positions.shape, dtype=torch.float64, device=positions.device)
    if "norm" in module:  # the blocks' norms, the final one, and QK-norm's q_norm and k_norm
        return torch.full(positions.shape, norm_weight, dtype=torch.float64, device=positions.device)
    std = 0.02 / math.sqrt(2 * n_layer) if module == "proj" else 0.02
    return std * counter_normal(seed, name, positions)


def tied_name(name, config):
    """The name parameter `name` goes by in values and checkpoints: with a tied output layer, the embedding's.
    (Held together on one device, the two are one parameter, tok_emb.weight; a pipeline's last stage holds the
    weight alone, as lm_head.weight.)"""
    return "tok_emb.weight" if config.tie_embeddings and name == "lm_head.weight" else name


def fill_in_chunks(flat, values_at, positions):
    """flat[start:end] = values_at(positions(start, end)), a chunk at a time: positions maps flat's elements
    to their flat indices in the full tensor (the whole tensor's, or a shard's own map)."""
    for start in range(0, flat.numel(), INIT_CHUNK):
        end = min(start + INIT_CHUNK, flat.numel())
        flat[start:end] = values_at(positions(start, end))


class GPT(nn.Module):
    token_positions = staticmethod(token_positions)  # for what runs the blocks itself (a pipeline stage)

    def __init__(self, config: GPTConfig, seed=0):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.padded_vocab_size, config.d_model)
        # Learned positions are added to the input; rotary ones turn q and k inside every block.
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model) if config.position == "learned" else None
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        self.tie_weights()
        # the swappable seam (see the module docstring)
        self.loss_fn = partial(cross_entropy, vocab_size=config.vocab_size)
        if self.lm_head.weight.device.type != "meta":  # on the meta device there is nothing to fill yet
            self.reset_parameters(seed)

    def tie_weights(self):
        """With a tied output layer, make lm_head's weight the embedding's: one parameter, tok_emb.weight (see
        tied_name). Again after Module.to_empty, which makes a parameter held twice into two."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    @torch.no_grad()
    def reset_parameters(self, seed=0):
        """Every parameter to its initial value (initial_values), every buffer to zero."""
        for name, p in self.named_parameters():
            fill_in_chunks(p.view(-1), partial(initial_values, name, n_layer=self.config.n_layer, seed=seed,
                                               norm_weight=self.config.norm_weight),
                           partial(torch.arange, device=p.device))
        for b in self.buffers():
            b.zero_()

    def embed(self, idx, pos):
        """Token embeddings (with scale_embedding times √d_model, rounded to their dtype as Gemma rounds it), plus
        learned position embeddings (rotary ones act inside attention)."""
        x = self.tok_emb(idx)
        if self.config.scale_embedding:
            x = x * torch.tensor(math.sqrt(self.config.d_model), dtype=x.dtype).item()
        return x if self.pos_emb is None else x + self.pos_emb(pos)

    def forward(self, idx, targets=None, pos=None, documents=None, loss_tokens=None):
        """Logits for token ids idx (batch, seq); with targets, also the loss.

        The logits cover the tables' padded_vocab_size rows; those past vocab_size are padding, which the
        loss and generate leave out. pos holds each token's index in the sequence (default 0..seq-1);
        documents (batch, whole sequence), each token's document (document_ids), or None: one causal
        sequence. The loss is the cross-entropy over the targets that count, divided by loss_tokens (default:
        their number, the mean), plus aux_loss_coef times the sum of the MoE layers' load-balancing losses.
        """
        if pos is None:
            pos = torch.arange(idx.shape[1], device=idx.device)
        at = token_positions(pos, documents)
        x = self.embed(idx, at)
        for block in self.blocks:
            x = block(x, at, documents)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        loss = self.loss_fn(logits, targets, tokens=loss_tokens)
        aux_losses = moe_aux_losses(self.blocks)
        if aux_losses:
            loss = loss + self.config.aux_loss_coef * sum(aux_losses)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None, eos_id=None, cache=True):
        """idx (batch, seq) continued by up to max_new_tokens tokens, one at a time, each from the last position's
        logits: sampled at `temperature` among the top_k most likely (None: all), or with temperature 0 the most
        likely (greedy). A row that emits eos_id is finished: it is padded with eos_id until every row is, and
        then generation stops. The context is the last max_seq_len tokens (the positions the model knows), at
        positions 0 on.

        With the key/value cache (cache=True; KVCache in place of each layer's attention core) the prompt runs
        through the model once, then each new token alone at its position: n new tokens cost O(n) token-passes,
        not O(n^2). Once the sequence outgrows max_seq_len the window slides and every position changes, so from
        then on each new token runs the whole window again, as every one does with cache=False: the same tokens
        either way."""
        if temperature < 0:
            raise ValueError(f"temperature={temperature} is negative")
        finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        caches = [KVCache() for _ in self.blocks] if cache else []
        for _ in range(max_new_tokens):
            logits = without_padding(self.next_logits(idx, caches), self.config.vocab_size)
            if temperature == 0:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth_largest = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth_largest, float("-inf"))
                next_token = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            if eos_id is not None:
                next_token[finished] = eos_id
                finished |= next_token[:, 0] == eos_id
            idx = torch.cat([idx, next_token], dim=1)
            if finished.all():
                break
        return idx

    def next_logits(self, idx, caches=()):
        """The logits after idx's last token (batch, padded_vocab_size), from its context: the last max_seq_len
        tokens, at positions 0 on. caches (a KVCache a block, or none) hold the context's first tokens, and only
        the rest runs, unless the window slid: then every position changed, and they start again."""
        context = idx[:, -self.config.max_seq_len:]
        if idx.shape[1] > self.config.max_seq_len:
            for c in caches:
                c.clear()
        start = len(caches[0]) if caches else 0
        pos = torch.arange(start, context.shape[1], device=idx.device)
        with attention_cores(self.blocks, caches):
            return self(context[:, start:], pos=pos)[0][:, -1, :]
