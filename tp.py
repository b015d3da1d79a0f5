"""Tensor parallelism (Megatron-LM), with Megatron-style sequence parallelism.

The article's "Tensor Parallelism" and "Sequence Parallelism, Flavor 1" ("5D Parallelism from Scratch"):
Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (section 3, Figure 3), and Korthikanti et al., 2022, "Reducing Activation Recomputation in
Large Transformer Models" (section 4.2.2). The weight matrices are split over a group of N ranks:

    column-parallel  W = [W_1 | ... | W_N]: rank i computes Y_i = X W_i     (q, k, v by heads; the MLP's first)
    row-parallel     rank i holds X_i and W_i's rows: Y = sum_i X_i W_i     (attention's output; the MLP's last)

Column then row needs nothing in between, so a block costs one all-reduce after attention and one after
the MLP in forward (g) and one before each in backward (f), Megatron-LM's conjugate pair:

    f = CopyToTensorParallel      forward: identity      backward: all-reduce
    g = ReduceFromTensorParallel  forward: all-reduce    backward: identity

Sequence parallelism keeps 1/N of the sequence on each rank outside the split layers (norms, residuals):
in place of f and g, a gather/scatter pair enters and leaves each region (all-gather the sequence forward,
reduce-scatter backward; then reduce-scatter forward, all-gather backward), the same traffic, and a
parameter applied to a sequence shard (a norm's) has its gradient summed over the group.

Copying this file (the glue for a Llama-style model, as tests/test_copy.py's `glue_tp` writes it):
    plan = SequenceParallel(group) if sequence_parallel else TensorParallel(group)
    split_attention(attn, plan, head_dim, ("q_proj", "k_proj", "v_proj"), "o_proj")  # fused: ("qkv",)
    split_mlp(mlp, plan, ("gate_proj", "up_proj"), "down_proj")                       # fused: ("fc",)
    plan.norm(norm) for each norm (a learned position table: plan.position_embedding(table)),
    VocabParallelEmbedding(embedding, plan), ColumnParallelLinear(head, plan), and as the loss
    vocab_parallel_cross_entropy(logits, targets, embedding.vocab_start, group) (targets IGNORE, -100, left out).
The attention reads its heads, of any width, off the shapes (view(..., -1, head_dim)); a split that would
cut a head (fewer key/value heads than ranks) is refused. QK-norm (Qwen3's q_norm, k_norm: one weight shared
by the heads) sees a rank's heads alone, so its gradient is a partial sum that must be summed over the group,
with or without sp: split_attention does it (`norms=`); a module is summed once, however often it is asked.
A mixture of experts folded over the group (ep.py): each rank routes tokens of its own, so the router's
gradient must be summed over the group, or it is silently wrong: `split_moe(moe, plan, router="gate",
shared="shared_expert", columns=..., row=...)` does it and splits the shared expert as an MLP (the router
alone: `gradients_summed(moe.gate, group)`); ep.py's layer then needs its `tokens=` policy. Expert tensor
parallelism: `split_experts(moe, group, columns=..., row=...)`, beside ep.py's `expert_tp=SplitExperts(group)`.

Self-check: torchrun --nproc_per_node 2 tp.py
"""
import copy
import os
from collections import Counter
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# f and g, the conjugate operators (Megatron-LM's section 3, Figure 3)
# ---------------------------------------------------------------------------

class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward; all-reduce backward (every rank's use of x contributes to its gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce forward (sum the partial products); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# f's and g's all-reduce is dist.all_reduce, out of place, counting the bytes each rank sends.

comm_bytes = Counter()  # bytes this rank sent, per collective kind, assuming ring algorithms


def _count(kind, full_bytes, n_ranks):
    passes = 2 if kind == "all_reduce" else 1  # all-reduce = reduce-scatter + all-gather
    comm_bytes[kind] += passes * (n_ranks - 1) * full_bytes // n_ranks


@torch.compiler.disable  # communication runs eagerly under torch.compile, counted as it goes
def all_reduce(x, group, op=dist.ReduceOp.SUM):
    x = x.clone()
    dist.all_reduce(x, op=op, group=group)
    _count("all_reduce", x.numel() * x.element_size(), dist.get_world_size(group))
    return x


@dataclass(frozen=True)
class TensorParallel:
    """The plan every split layer is handed: tensor parallelism over `group` (None: the default group), f
    into a region and g out of it. Each method is a place where `SequenceParallel` differs; a model is
    split with one plan throughout, so no layer asks which."""

    group: object

    def enter(self, x):
        """Into a region: f."""
        return CopyToTensorParallel.apply(x, self.group)

    def leave(self, partial_sums):
        """Out of a region: g, summing the ranks' partial products."""
        return ReduceFromTensorParallel.apply(partial_sums, self.group)

    # Outside the regions every rank sees every token: a replicated parameter applied there (the
    # row-parallel bias) already has its whole gradient, and norms and a position table stay as they are.
    def replicated(self, parameter):
        return parameter

    def norm(self, norm):
        return norm

    def position_embedding(self, table):
        return table


# ---------------------------------------------------------------------------
# Column- and row-parallel linear layers
# ---------------------------------------------------------------------------

def shard(full, dim, rank, n_ranks, blocks=None):
    """This rank's slice of `full` along dim. blocks: the sizes of consecutive blocks along dim
    that are each split on their own (attention's q | k | v, SwiGLU's gate | up); None: one block."""
    pieces = full.split(list(blocks or [full.shape[dim]]), dim)
    return torch.cat([piece.chunk(n_ranks, dim)[rank] for piece in pieces], dim).clone()


def unshard(local, dim, group, blocks=None):
    """The inverse of shard: the full tensor, from every rank's slice."""
    n = dist.get_world_size(group)
    pieces = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    sizes = [size // n for size in blocks] if blocks else [local.shape[dim]]
    per_rank = [piece.split(sizes, dim) for piece in pieces]
    return torch.cat([per_rank[r][b] for b in range(len(sizes)) for r in range(n)], dim)


def _sharded_parameter(full, dim, group, blocks=None):
    return nn.Parameter(shard(full.detach(), dim, dist.get_rank(group), dist.get_world_size(group), blocks))


class ColumnParallelLinear(nn.Module):
    """Y_i = X W_i + b_i: this rank's output features (the input is replicated, or gathered: plan.enter).

    Beyond the article: blocks, the sizes of consecutive blocks of output features, each split on its own
    (see `shard`); head_dim, the features are heads of this width, and a rank must hold whole ones (refused
    otherwise); entered, the input has already entered the region (`share_region_entry`).
    """

    def __init__(self, full: nn.Linear, plan: TensorParallel, *,  # beyond the article:
                 blocks=None, entered=False, head_dim=None):
        super().__init__()
        self.plan, self.entered = plan, entered
        n = dist.get_world_size(plan.group)
        for size in blocks or [full.weight.shape[0]]:
            if size % (n * (head_dim or 1)):
                raise ValueError(_indivisible_block(size, n, head_dim))
        self.weight = _sharded_parameter(full.weight, 0, plan.group, blocks)
        self.bias = None if full.bias is None else _sharded_parameter(full.bias, 0, plan.group, blocks)
        self.layouts = {"weight": (0, blocks), "bias": (0, blocks)}  # how to unshard each parameter

    def forward(self, x):
        if not self.entered:
            x = self.plan.enter(x)
        return F.linear(x, self.weight, self.bias)


def _indivisible_block(size, n, head_dim):
    if head_dim is None:
        return f"a block of {size} output features does not divide by the tensor-parallel size {n}"
    heads = size // head_dim
    return (f"a block of {heads} head{'s' * (heads != 1)} of width {head_dim} does not divide by the tensor-parallel "
            f"size {n}: each rank must hold whole heads (with grouped-query attention, as many key/value heads as "
            f"ranks at least)")


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i W_i + b: this rank's input features; the bias is added once, after the sum."""

    def __init__(self, full: nn.Linear, plan: TensorParallel):
        super().__init__()
        self.plan = plan
        self.weight = _sharded_parameter(full.weight, 1, plan.group)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        self.layouts = {"weight": (1, None)}

    def forward(self, x):
        y = self.plan.leave(F.linear(x, self.weight))
        return y if self.bias is None else y + self.plan.replicated(self.bias)


# ---------------------------------------------------------------------------
# A block's plan: attention and the MLP, each column-parallel layers then a row-parallel one
# ---------------------------------------------------------------------------

def share_region_entry(module, plan):
    """Enter the region once, at module's first input, for the separate column-parallel layers inside it
    that all read that input (q, k and v; SwiGLU's gate and up; made with entered=True): one all-reduce
    (under sequence parallelism, reduce-scatter) for all of them in backward, as for a fused layer,
    instead of one each."""
    module.register_forward_pre_hook(lambda _, args: (plan.enter(args[0]), *args[1:]))
    return module


def split_region(module, plan, columns, row, fused_blocks=lambda layer: None, head_dim=None):
    """module's layers named `columns` column-parallel, `row` row-parallel: no communication between them,
    plan.enter before (f) and plan.leave after (g). Several columns read the same input and share one entry;
    a single one may fuse several matrices, each split on its own (fused_blocks(layer): their sizes)."""
    separate = len(columns) > 1
    if separate:
        share_region_entry(module, plan)
    for name in columns:
        layer = getattr(module, name)
        blocks = None if separate else fused_blocks(layer)
        setattr(module, name, ColumnParallelLinear(layer, plan, blocks=blocks, entered=separate, head_dim=head_dim))
    setattr(module, row, RowParallelLinear(getattr(module, row), plan))


def split_attention(attention, plan, head_dim, columns=("qkv",), row="proj", norms=("q_norm", "k_norm")):
    """q, k and v column-parallel by heads, the output projection row-parallel: a rank attends with its heads
    alone. Query and key/value heads are split each N ways (a fused layer holds q | k | v), so with
    grouped-query attention a rank's query heads find their key/value heads on the same rank. norms: QK-norm's
    modules, where the attention has them (one weight normalising every head's q, one every head's k): a rank
    applies each to its heads alone, so each one's gradient is summed over the group (`gradients_summed`)."""
    width = getattr(attention, row).in_features  # the query heads'

    def q_k_v(fused):  # the query heads' width, then the keys' and the values', equal
        kv_width = (fused.out_features - width) // 2
        return [width, kv_width, kv_width]
    split_region(attention, plan, columns, row, q_k_v, head_dim)
    for name in norms:
        if getattr(attention, name, None) is not None:
            gradients_summed(getattr(attention, name), plan.group)


def split_mlp(mlp, plan, columns=("fc",), row="proj"):
    """The article's MLP (Megatron-LM's Figure 3a), on rank i:

        y = g(gelu(f(x) W1_i) W2_i)

    W1 column-parallel by hidden units, W2 row-parallel, and nothing communicates between the two matmuls:
    g's all-reduce is the article's "one AllReduce per block". A fused SwiGLU fc holds gate | up, each split
    alike, so a rank holds the gate and up of the same units."""
    width = getattr(mlp, row).in_features
    split_region(mlp, plan, columns, row, lambda fused: [width] * (fused.out_features // width))


def check_tensor_parallel(n_ranks, n_head, d_ff, vocab_size, seq_len=None, n_kv_heads=None):
    """Why a model cannot be split n_ranks ways (seq_len given: with sequence parallelism), or None."""
    for what, size in [("attention heads", n_head), ("key/value heads", n_kv_heads), ("MLP hidden size", d_ff),
                       ("vocabulary", vocab_size), ("sequence length (sequence parallelism)", seq_len)]:
        if size is not None and size % n_ranks:
            return f"{what} {size} does not divide by the tensor-parallel size {n_ranks}"
    return None


# ---------------------------------------------------------------------------
# Sequence parallelism (the article's "Flavor 1", Korthikanti et al.'s): a gather/scatter pair in place of f, g
# ---------------------------------------------------------------------------

# torch 2.13 renamed the flat collectives; older releases only know the old names. (A deliberate copy of
# dp.py's: each dimension file stands alone.)
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@torch.compiler.disable  # communication runs eagerly under torch.compile, counted as it goes
def all_gather_sequence(x, group):
    """(batch, seq/N, ...) on each rank -> (batch, seq, ...), rank r's part at position r."""
    n = dist.get_world_size(group)
    out = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
    all_gather_flat(out.view(-1), x.contiguous().view(-1), group=group)  # flat: every backend takes it
    _count("all_gather", out.numel() * out.element_size(), n)
    return out.movedim(0, 1).flatten(1, 2)


@torch.compiler.disable  # communication runs eagerly under torch.compile, counted as it goes
def reduce_scatter_sequence(x, group):
    """(batch, seq, ...) partial sums on each rank -> this rank's (batch, seq/N, ...) of their sum."""
    n = dist.get_world_size(group)
    if x.shape[1] % n:
        raise ValueError(f"sequence length {x.shape[1]} does not divide by the tensor-parallel size {n}")
    chunks = x.unflatten(1, (n, -1)).movedim(1, 0).contiguous()  # (N, batch, seq/N, ...)
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out.view(-1), chunks.view(-1), group=group)
    _count("reduce_scatter", chunks.numel() * chunks.element_size(), n)
    return out


class GatherFromSequenceParallel(torch.autograd.Function):
    """Entering a tensor-parallel region: all-gather the sequence forward, reduce-scatter it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class ScatterToSequenceParallel(torch.autograd.Function):
    """Leaving a tensor-parallel region: reduce-scatter the sequence forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class SequenceParallel(TensorParallel):
    """Outside the regions each rank keeps 1/N of the sequence, so a region begins with an all-gather and
    ends with a reduce-scatter (the article's "gather ... before" and "scatter ... after" a tensor-parallel
    region; an all-reduce's two halves: the same traffic), and whatever acts outside sees this rank's
    tokens alone."""

    def enter(self, x):
        """In place of f: all-gather the sequence forward, reduce-scatter its gradient backward."""
        return GatherFromSequenceParallel.apply(x, self.group)

    def leave(self, partial_sums):
        """In place of g: reduce-scatter forward (each rank keeps its chunk of the sum), all-gather backward."""
        return ScatterToSequenceParallel.apply(partial_sums, self.group)

    def replicated(self, parameter):
        """It meets only this rank's tokens: f sums its gradient over the group."""
        return CopyToTensorParallel.apply(parameter, self.group)

    def norm(self, norm):
        return sequence_parallel_norm(norm, self.group)

    def position_embedding(self, table):
        return SequenceParallelPositionEmbedding(table, self.group)


def gradients_summed(module, group):
    """A replicated module that each rank applies to tokens (or heads) of its own (a norm under sequence
    parallelism; a router whose experts are folded over the group; QK-norm), in place: each of its parameters'
    gradients is summed over the group (a hook on the gradient does what f applied to the parameter would),
    once, however often it is asked (QK-norm is a norm that split_attention has summed already). Names and
    module type stay the same; `summed_over_ranks` says how many ranks share its tokens' loss (ep.py reads
    it on a router, to refuse a layer that would route every token N times)."""
    if hasattr(module, "summed_over_ranks"):
        return module
    for p in module.parameters():
        p.register_hook(partial(all_reduce, group=group))
    module.summed_over_ranks = dist.get_world_size(group)
    return module


def sequence_parallel_norm(norm, group):
    """Any norm module (LayerNorm, RMSNorm, ...) applied to this rank's sequence shard, in place."""
    return gradients_summed(norm, group)


class SequenceParallelPositionEmbedding(nn.Module):
    """Position embeddings of this rank's sequence shard (positions are given for the whole sequence)."""

    def __init__(self, full: nn.Embedding, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(full.weight.detach().clone())

    def forward(self, pos):
        mine = pos.chunk(dist.get_world_size(self.group), -1)[dist.get_rank(self.group)]
        return F.embedding(mine, CopyToTensorParallel.apply(self.weight, self.group))


# ---- Beyond the article ----
# The vocabulary-parallel embedding and loss, the experts' split (folded over tp, expert tensor
# parallelism), model.py's glue, the gathered state dict, and the self-check.

# ---------------------------------------------------------------------------
# The vocabulary split: embedding and cross-entropy
# ---------------------------------------------------------------------------

class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous range of the vocabulary; ids outside it look up zeros, and leaving the
    region sums the ranks' lookups."""

    def __init__(self, full: nn.Embedding, plan: TensorParallel):
        super().__init__()
        self.plan = plan
        n, rank = dist.get_world_size(plan.group), dist.get_rank(plan.group)
        if full.num_embeddings % n:
            raise ValueError(f"vocabulary {full.num_embeddings} does not divide by the tensor-parallel size {n}")
        self.per_rank = full.num_embeddings // n
        self.vocab_start = rank * self.per_rank
        self.weight = _sharded_parameter(full.weight, 0, plan.group)
        self.layouts = {"weight": (0, None)}

    def forward(self, ids):
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        partial_lookup = F.embedding(local.masked_fill(outside, 0), self.weight)
        partial_lookup = partial_lookup.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.plan.leave(partial_lookup)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-sharded logits, without gathering them.

    loss = log sum_v exp(z_v - m) - (z_target - m), with the max m, the target
    logit and the sum of exponentials each reduced over the group. The
    gradient is softmax - one_hot(target), on this rank's shard only.

    A target that is IGNORE has loss 0 and sends no gradient to its logits.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, vocab_size=None):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        per_rank = logits.shape[-1]
        real = per_rank if vocab_size is None else max(0, vocab_size - vocab_start)  # the rest is padding
        if real < per_rank:  # rows past the vocabulary, which the tables hold to split evenly: no probability
            logits = logits.index_fill(-1, torch.arange(real, per_rank, device=logits.device), float("-inf"))
        logits_max = all_reduce(logits.max(-1).values, group, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        local_target = targets - vocab_start
        inside = (local_target >= 0) & (local_target < per_rank)
        local_target = local_target.clamp(0, per_rank - 1)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        exp = shifted.exp()
        # One all-reduce for both sums: the target's logit (on one rank) and the sum of exponentials.
        target_logit, sum_exp = all_reduce(torch.stack([target_logit, exp.sum(-1)]), group)
        counts = targets != IGNORE
        # An ignored target's row of the softmax is kept as zeros, and IGNORE (negative) is in no rank's shard:
        # its logits get no gradient.
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1) * counts.unsqueeze(-1), local_target, inside)
        ctx.input_dtype = logits.dtype
        return (sum_exp.log() - target_logit) * counts

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -inside.unsqueeze(-1).to(grad.dtype))
        return grad * grad_loss.unsqueeze(-1), None, None, None, None


IGNORE = -100  # a target left out of the loss, as PyTorch's ignore_index (model.py's IGNORE: a deliberate copy)


def vocab_parallel_cross_entropy(logits, targets, vocab_start, group, vocab_size=None, tokens=None):
    """A drop-in for the single device's cross-entropy: summed over the targets that count (not IGNORE) and
    divided by `tokens` (default: their number, the mean). vocab_size: the ids that exist, when the tables
    hold padding rows past them (None: none)."""
    losses = VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group, vocab_size)
    return losses.sum() / ((targets != IGNORE).sum() if tokens is None else tokens)


# ---------------------------------------------------------------------------
# Experts: folded over the group, and split by it (expert tensor parallelism)
# ---------------------------------------------------------------------------

class ExpertTensorParallel(TensorParallel):
    """Inside an expert whose matrices are split over `group` (Megatron-LM's expert tensor parallelism), as
    ep.py's SplitExperts runs it: the expert's rows are all-gathered from every rank of the group before,
    and its partial outputs reduce-scattered after, so nothing communicates inside. The row-parallel bias
    is added by the group's first rank alone (the reduce-scatter adds it once), and f sums its gradient."""

    def enter(self, x):
        return x

    def leave(self, partial_sums):
        return partial_sums

    def replicated(self, parameter):
        first = dist.get_rank(self.group) == 0
        return CopyToTensorParallel.apply(parameter, self.group) * first


def split_moe(moe, plan, router="router", shared="shared", columns=("fc",), row="proj", shared_gate="shared_gate"):
    """A mixture of experts as ep.py runs it folded over the group: each rank routes tokens of its own (a
    sequence shard, or its part of tokens every rank holds), so the replicated router's gradient is summed
    over the group (`gradients_summed`); the shared expert, which every token passes through, is split like
    a dense MLP (`split_mlp`'s columns and row). router, shared, shared_gate: their attribute names (as
    ep.py's layer takes them). The routed experts are ep.py's to place (`split_experts` for expert tensor
    parallelism).

    The shared expert's gate (Qwen2-MoE's sigmoid(x W) * shared(x), W: d_model -> 1) is replicated and
    multiplies the shared expert's output once its row-parallel layer has left the region, where that
    output is summed, on the tokens as they came: like a norm's, its gradient is whole on every rank
    without sequence parallelism (each rank computes the same gate for the same tokens, with the same
    output gradient), and a partial sum over its sequence shard with it, summed over the group (`plan.norm`)."""
    gradients_summed(getattr(moe, router), plan.group)
    if getattr(moe, shared, None) is not None:
        split_mlp(getattr(moe, shared), plan, columns, row)
    if getattr(moe, shared_gate, None) is not None:
        plan.norm(getattr(moe, shared_gate))


def split_experts(moe, group, columns=("fc",), row="proj"):
    """Split each routed expert's MLP over `group` (expert tensor parallelism; columns and row as for
    `split_mlp`, e.g. ("gate_proj", "up_proj"), "down_proj"), with no communication inside: ep.py's
    SplitExperts gathers their rows before and reduce-scatters their partial outputs after."""
    experts = moe.experts.values() if isinstance(moe.experts, nn.ModuleDict) else moe.experts
    for expert in experts:
        split_mlp(expert, ExpertTensorParallel(group), columns, row)


def split_latent_attention(attention, plan, config, columns=("q_up", "kv_up"), row="proj",
                           down=("q_down", "q_down_norm", "kv_down", "kv_down_norm")):
    """DeepSeek's multi-head latent attention (model.py's LatentAttention): the up-projections column-parallel
    by heads (a head's query, and its key | value, are contiguous features), the output projection
    row-parallel, and the down-projections with their norms outside the region, as a norm is (`plan.norm`:
    replicated; under sequence parallelism applied to this rank's tokens, their gradients summed).

    The region is entered by what they output, the compressed tokens (the queries' and the keys' and values'
    latents and the shared rotary key), together (`enter_together`): one all-reduce in backward, or under
    sequence parallelism one all-gather forward, of q_lora_rank + kv_lora_rank + qk_rope_head_dim features a
    token (DeepSeek-V3's 2,112) instead of d_model's (7,168), and each rank down-projects its own tokens only.
    """
    for name in down:
        plan.norm(getattr(attention, name))
    attention.compressed = partial(enter_together, plan=plan)
    query_head = config.qk_nope_head_dim + config.qk_rope_head_dim
    for name, head in zip(columns, (query_head, config.qk_nope_head_dim + config.v_head_dim)):
        setattr(attention, name, ColumnParallelLinear(getattr(attention, name), plan, entered=True, head_dim=head))
    setattr(attention, row, RowParallelLinear(getattr(attention, row), plan))


def enter_together(*tensors, plan):
    """The tensors (batch, seq, features each) into the region as one: concatenated, plan.enter, split again."""
    together = plan.enter(torch.cat(tensors, dim=-1))
    return together.split([t.shape[-1] for t in tensors], dim=-1)


# ---------------------------------------------------------------------------
# Applying it to model.py's GPT (the only model knowledge in this file)
# ---------------------------------------------------------------------------

def split_block(block, config, plan):
    """One transformer block of model.py, in place: one all-reduce (under sequence parallelism,
    reduce-scatter) after attention and one after the MLP in forward, and their conjugates in backward."""
    if hasattr(block.attn, "kv_up"):  # DeepSeek's latent attention
        split_latent_attention(block.attn, plan, config)
    elif config.qk_norm and config.qk_norm_scope == "projection":  # OLMo 2's: split with the heads
        split_attention(block.attn, plan, config.head_dim, norms=())
        for norm in (block.attn.q_norm, block.attn.k_norm):
            split_projection_norm(norm, plan.group)
    else:
        split_attention(block.attn, plan, config.head_dim)
    if getattr(block.attn, "sinks", None) is not None:  # attention sinks (gpt-oss): one a query head, split with them
        block.attn.sinks = _sharded_parameter(block.attn.sinks, 0, plan.group)
        block.attn.layouts = {"sinks": (0, None)}
    if hasattr(block.mlp, "experts"):  # mixture of experts: the router is replicated, the experts ep.py's
        split_moe(block.mlp, plan)
    else:
        split_mlp(block.mlp, plan)
    for norm in (block.norm1, block.post_norm1, block.norm2, block.post_norm2):  # (absent ones: identities)
        plan.norm(norm)


class SumOverRanks(torch.autograd.Function):
    """All-reduce forward and backward: a sum that every rank's output depends on, so that the gradient of each
    rank's share of it is the sum of every rank's gradient of the whole."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


def _summed_over_ranks(local, group, x):
    return SumOverRanks.apply(local(x), group)


def split_projection_norm(norm, group):
    """QK-norm over a token's whole projection (model.py's ProjectionNorm, OLMo 2's), on a rank holding some of
    the heads: its weight split with them, and each token's sum of squares over its heads summed over the group
    (its `squares` seam), forward and backward."""
    norm.weight = _sharded_parameter(norm.weight, 0, group)
    norm.layouts = {"weight": (0, None)}
    norm.squares = partial(_summed_over_ranks, norm.squares, group)


def apply_tensor_parallel(model, group, sequence_parallel=False):
    """Shard a GPT in place across `group`: heads, key/value heads, MLP units and vocabulary split N ways,
    and with sequence_parallel the sequence between the tensor-parallel regions."""
    c = model.config
    problem = check_tensor_parallel(dist.get_world_size(group), c.n_head, c.d_ff, c.padded_vocab_size,
                                    c.seq_len if sequence_parallel else None, c.n_kv_heads)
    if problem:
        raise ValueError(problem)
    plan = SequenceParallel(group) if sequence_parallel else TensorParallel(group)
    tied = model.lm_head.weight is model.tok_emb.weight
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, plan)
    if model.pos_emb is not None:
        model.pos_emb = plan.position_embedding(model.pos_emb)
    for block in model.blocks:
        split_block(block, c, plan)
    plan.norm(model.norm)
    model.lm_head = ColumnParallelLinear(model.lm_head, plan)
    if tied:  # the output layer's slice of the vocabulary is the embedding's: the same rows, one parameter
        model.lm_head.weight = model.tok_emb.weight
    model.loss_fn = partial(vocab_parallel_cross_entropy, vocab_start=model.tok_emb.vocab_start, group=group,
                            vocab_size=c.vocab_size)
    return model


def sharded_layouts(model):
    """{parameter name: (dim, blocks)} for every parameter split across the group; others are replicated."""
    return {f"{module_name}.{name}": layout
            for module_name, module in model.named_modules() if hasattr(module, "layouts")
            for name, layout in module.layouts.items() if getattr(module, name, None) is not None}


def full_state_dict(model, group):
    """The model's state dict with every shard gathered back to full size (the single device's layout)."""
    layouts = sharded_layouts(model)
    return {name: unshard(t, layouts[name][0], group, layouts[name][1]) if name in layouts else t
            for name, t in model.state_dict().items()}


# ---------------------------------------------------------------------------
# Self-check: torchrun --nproc_per_node 2 tp.py
# ---------------------------------------------------------------------------

class _ToyLM(nn.Module):
    """Embedding, a pre-norm grouped-query attention block (two query heads per key/value head, q | k | v
    fused, QK-norm) and an MLP block with residuals, final norm, head: the pieces tp.py splits."""

    def __init__(self, vocab, seq, kv_heads, head_dim=2):
        super().__init__()
        d, self.head_dim = 2 * kv_heads * head_dim, head_dim
        self.qkv_sizes = [d, kv_heads * head_dim, kv_heads * head_dim]
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.norm0, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, sum(self.qkv_sizes)), nn.Linear(d, d)
        self.q_norm, self.k_norm = nn.RMSNorm(head_dim), nn.RMSNorm(head_dim)  # one weight for every head's q, k
        self.norm1, self.fc, self.proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.norm, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.loss_fn = lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def attend(self, x):
        heads = self.qkv(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # (batch, heads, seq, head_dim)
        n_kv = heads.shape[1] // 4  # per key/value head: two query heads, a key and a value
        q, k, v = heads.split([2 * n_kv, n_kv, n_kv], dim=1)
        y = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True, enable_gqa=True)
        return self.out(y.transpose(1, 2).flatten(2))

    def forward(self, ids, targets):
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1], device=ids.device))
        x = x + self.attend(self.norm0(x))
        x = x + self.proj(F.gelu(self.fc(self.norm1(x))))
        return self.loss_fn(self.lm_head(self.norm(x)), targets)


def _split_toy(model, plan):
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, plan)
    model.pos_emb = plan.position_embedding(model.pos_emb)
    model.qkv = ColumnParallelLinear(model.qkv, plan, blocks=model.qkv_sizes, head_dim=model.head_dim)  # whole heads
    model.out = RowParallelLinear(model.out, plan)
    for norm in (model.q_norm, model.k_norm):  # QK-norm: each rank normalises its own heads
        gradients_summed(norm, plan.group)
    model.fc, model.proj = ColumnParallelLinear(model.fc, plan), RowParallelLinear(model.proj, plan)
    for norm in (model.norm0, model.norm1, model.norm):
        plan.norm(norm)
    model.lm_head = ColumnParallelLinear(model.lm_head, plan)
    model.loss_fn = partial(vocab_parallel_cross_entropy, vocab_start=model.tok_emb.vocab_start, group=plan.group)
    return model


def _join_process_group():
    """torchrun's group: on GPUs NCCL for CUDA tensors and gloo for CPU ones, one GPU per rank; else gloo.
    (A deliberate copy in each dimension file: each stands alone.)"""
    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    return device


def _self_check():
    device = _join_process_group()
    backend, rank, world = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _ToyLM(vocab=8 * world, seq=2 * world, kv_heads=world).to(device, torch.float64)
    ids = torch.randint(0, 8 * world, (3, 2 * world + 1), generator=torch.Generator().manual_seed(1)).to(device)
    ref_loss = reference(ids[:, :-1], ids[:, 1:])
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    for sp in (False, True):
        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        model = _split_toy(model, SequenceParallel(None) if sp else TensorParallel(None))
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        layouts = sharded_layouts(model)
        worst = (loss - ref_loss).abs().item()
        for name, p in model.named_parameters():
            grad = unshard(p.grad, layouts[name][0], None, layouts[name][1]) if name in layouts else p.grad
            worst = max(worst, (grad - ref_grads[name]).abs().max().item())
        if rank == 0:
            print(f"tp.py self-check on {world} ranks ({backend}), grouped-query attention with QK-norm and an MLP, "
                  f"sequence parallel {'on ' if sp else 'off'}: "
                  f"largest difference from one device (loss and every gradient, float64) = {worst:.3g}")
        if worst > 1e-12:
            raise SystemExit(f"rank {rank}: tensor-parallel result differs from the single device by {worst:.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    _self_check()
