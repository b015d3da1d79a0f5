"""A slim GPT: the single-device model that every parallel run must match.

Read top to bottom: config, attention, MLP, mixture of experts, block, GPT.
Everything is plain PyTorch on one device. The parallel files never change
this model's mathematics; they slice its weights, move its activations between
ranks and swap two seams that are kept deliberately small:

- `CausalSelfAttention.core(q, k, v)` is the attention core (context
  parallelism replaces it with ring attention);
- `GPT.loss_fn(logits, targets)` is the cross-entropy (tensor parallelism
  replaces it with one that never gathers the vocabulary-sharded logits);
- positions are passed in explicitly (`pos`), so a rank holding a shard of the
  sequence that is not contiguous still embeds the right positions.

No dropout: the correctness contract (every configuration equals the single
device, step for step) needs a deterministic model.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128           # the longest sequence (size of the position table)
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 0                # MLP hidden size; 0 means 4 * d_model
    n_experts: int = 0           # 0: every MLP is dense; > 0: mixture of experts
    top_k: int = 2               # experts chosen per token
    moe_layers: tuple = field(default_factory=tuple)  # which blocks are MoE; empty: all of them
    aux_loss_coef: float = 0.01  # weight of the Switch load-balancing loss

    def __post_init__(self):
        self.d_ff = self.d_ff or 4 * self.d_model
        self.moe_layers = tuple(self.moe_layers)
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        bad = [i for i in self.moe_layers if not 0 <= i < self.n_layer]
        if bad:
            raise ValueError(f"moe_layers {bad} are not layers of a {self.n_layer}-layer model")

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and (not self.moe_layers or layer in self.moe_layers)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: forward and backward are 3 x the forward's 2 per multiply-add.

        Every matrix a token passes through counts (in an MoE layer: the router and its top-k
        experts), plus causal attention's scores and weighted sum (about seq_len/2 keys per query).
        """
        d, mlp = self.d_model, 2 * self.d_model * self.d_ff
        per_layer = [4 * d * d + 2 * d * self.seq_len +  # q, k, v, projection; attention's two products
                     (self.top_k * mlp + d * self.n_experts if self.is_moe(i) else mlp) for i in range(self.n_layer)]
        return 6 * (sum(per_layer) + d * self.vocab_size)


def at_least_float32(t):
    """t in float32, or kept in its own dtype if that is wider (float64 checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def cross_entropy(logits, targets):
    """Mean cross-entropy over all tokens, computed in float32 or better."""
    return F.cross_entropy(at_least_float32(logits.flatten(0, 1)), targets.flatten())


def causal_attention(q, k, v):
    """softmax(q kᵀ / √d + causal mask) v for (batch, heads, seq, head_dim) tensors."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.d_model // config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)  # output laid out as (q|k|v, head, head_dim)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.core = causal_attention  # the swappable seam (see the module docstring)

    def forward(self, x):
        qkv = self.qkv(x)
        # Shapes are read off qkv's output, so a rank holding some of the heads (tensor parallelism),
        # or whose qkv gathers the sequence (sequence parallelism), runs this unchanged.
        batch, seq = qkv.shape[:2]
        heads = qkv.view(batch, seq, 3, -1, self.head_dim)
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # each (batch, heads, seq, head_dim)
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff)
        self.proj = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def route(router_logits, top_k):
    """Top-k routing: (gates, experts, probs) for (tokens, n_experts) logits.

    probs are the softmax over all experts; the k largest are kept and
    renormalised to sum to one (the article's 0.60/0.35 -> 0.63/0.37).
    Computed in float32 or better, whatever the activations' dtype.
    """
    probs = at_least_float32(router_logits).softmax(-1)
    top_probs, experts = probs.topk(top_k, dim=-1)
    gates = top_probs / top_probs.sum(-1, keepdim=True)
    return gates, experts, probs


def load_balancing_loss(probs, experts, n_experts):
    """Switch Transformer auxiliary loss: E * sum_i f_i * P_i.

    f_i is the fraction of the (token, choice) assignments that went to expert
    i (no gradient: it comes from an argmax), P_i the mean router probability
    of expert i. It equals 1 when routing is perfectly uniform and grows as
    tokens pile onto a few experts.
    """
    counts = torch.bincount(experts.flatten(), minlength=n_experts)
    f = counts.to(probs.dtype) / experts.numel()
    return n_experts * (f * probs.mean(0)).sum()


class MoE(nn.Module):
    """Mixture of experts, dropless, on one device: the reference for ep.py.

    y = sum over the token's top-k experts of gate_i(x) * expert_i(x).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config) for _ in range(config.n_experts))
        self.aux_loss = None  # set by every forward; GPT.forward adds it to the loss

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        gates, experts, probs = route(self.router(tokens), self.top_k)
        self.aux_loss = load_balancing_loss(probs, experts, len(self.experts))
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token_idx, choice = torch.where(experts == e)
            if len(token_idx):  # an expert that got no token is simply not run
                y = expert(tokens[token_idx]) * gates[token_idx, choice, None].to(x.dtype)
                out.index_add_(0, token_idx, y)
        return out.view_as(x)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.mlp = MoE(config) if config.is_moe(layer) else MLP(config)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def moe_aux_losses(module):
    """The load-balancing losses the MoE layers under `module` set in their last forward.

    Found by attribute, so an MoE layer that another file replaced (expert
    parallelism) or wrapped (sequence parallelism) is found too.
    """
    return [m.aux_loss for m in module.modules() if isinstance(getattr(m, "aux_loss", None), torch.Tensor)]


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.loss_fn = cross_entropy  # the swappable seam (see the module docstring)
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by
        # 1/sqrt(2 * n_layer), so the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None, pos=None):
        """Logits for token ids idx (batch, seq); with targets, also the loss.

        pos holds each token's position (default 0..seq-1). The loss is the
        mean cross-entropy over all tokens plus aux_loss_coef times the sum of
        the MoE layers' load-balancing losses.
        """
        if pos is None:
            pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        loss = self.loss_fn(logits, targets)
        aux_losses = moe_aux_losses(self.blocks)
        if aux_losses:
            loss = loss + self.config.aux_loss_coef * sum(aux_losses)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Sample max_new_tokens continuations of idx (batch, seq), one at a time."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.seq_len:]
            logits = self(context)[0][:, -1, :] / temperature
            if top_k is not None:
                kth_largest = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            next_token = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            idx = torch.cat([idx, next_token], dim=1)
        return idx
