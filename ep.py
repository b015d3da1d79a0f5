"""Expert parallelism: the experts of a mixture-of-experts layer spread over ranks.

The article's "Expert Parallelism" ("5D Parallelism from Scratch"): all-to-all dispatch is GShard's
(Lepikhin et al., 2020, "GShard: Scaling Giant Models with Conditional Computation and Automatic
Sharding"), top-k routing and the load-balancing loss Switch Transformer's (Fedus et al., 2022, its
equation 4).

A mixture-of-experts layer replaces the MLP by E expert MLPs and a router: y = sum_i g_i(x) E_i(x) over the
token's top-k experts, gates renormalised over them (the article's 0.60/0.35 -> 0.63/0.37). Each of the N
ranks of an expert-parallel group holds E/N experts, and tokens travel to their experts' ranks:

1. route: softmax over the experts, top-k, renormalised gates (`route`);
2. dispatch: sort the (token, choice) pairs by expert, exchange the counts, then the tokens (an all-to-all);
3. compute: each local expert runs on the tokens it received (none: not run, its gradient stays None);
4. combine: the reverse all-to-all brings the outputs home, weighted by their gates and added into place.
Balance: the Switch loss E * sum_i f_i P_i over the micro-batch (`aux_loss`).

Beyond the article (past the banner): DeepSeek-V3's router (DeepSeek-AI, 2024, section 2.1.2: sigmoid
scores, group-limited choice, gate scale, a balancing bias moved after every step from `load`, the balance
loss per sequence) and Qwen2-MoE's unnormalised gates, DeepSeek-MoE's shared expert (Dai et al., 2024), a
capacity factor (dropless without), and folding over tensor parallelism and expert tensor parallelism.

Copying this file: the MoE layer offers `experts` (modules mapping (tokens, d) -> (tokens, d)), its router
(any attribute name: `router=`), `top_k`; optionally `norm_topk_prob` (False: gates not renormalised), a
shared expert (`shared=`) and its gate (`shared_gate=`, Qwen2-MoE's), a `route_bias` with `bias_update_rate`,
DeepSeek-V3's `scoring` ("sigmoid"), `groups` ((n_group, topk_group)), `routed_scaling_factor`. Names stay
the single device's, so checkpoints match. The glue, per MoE layer (stats_group: the ranks routing own tokens):
    layer = ExpertParallelMoE(layer, ep_group, stats_group, router="gate", shared="shared_expert",
                              shared_gate="shared_expert_gate")
Gradients: the router's (and all outside the experts) are averaged over the ranks holding different data;
an expert's are summed over the ranks holding the same expert and divided by the ranks the loss averages.
Folded over tensor parallelism: `tokens=ShardedTokens(tp_group)` under sequence parallelism,
`ReplicatedTokens(tp_group)` without, and the router's gradient summed over tp_group (tp.py's `split_moe`
or `gradients_summed(layer.gate, tp_group)`; a router tp.py summed meeting no `tokens=` is refused).
Expert tensor parallelism: `expert_tp=SplitExperts(group)`, the experts split by tp.py's `split_experts`.

Self-check: torchrun --nproc_per_node 4 ep.py
"""
import os
from collections import Counter
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

comm_bytes = Counter()  # bytes this rank sent to other ranks, per kind


# ---------------------------------------------------------------------------
# The router
# ---------------------------------------------------------------------------

def route(router_logits, top_k, *,  # beyond the article:
          bias=None, variant=None):
    """(gates, experts, probs) for (tokens, E) logits: the article's router. The softmax over the experts,
    its top_k largest renormalised to sum to one are the gates (the article's 0.60, 0.35 -> 0.63, 0.37);
    probs, every expert's, feed the load-balancing loss. In float32 or better, whatever the activations' dtype.

    Beyond the article, a `variant` (a `RouterVariant`, past the banner: DeepSeek-V3's sigmoid scores,
    group-limited choice and gate scale, Qwen2-MoE's gates left unnormalised) or a balancing `bias`
    (DeepSeek-V3's: added to the scores to choose, not to weigh) routes there instead. (model.py's `route`
    in two: a deliberate copy, so that this file stands alone.)"""
    if variant is not None or bias is not None:  # beyond the article
        return (variant or RouterVariant()).route(router_logits, top_k, bias)
    probs = router_logits.to(torch.promote_types(router_logits.dtype, torch.float32)).softmax(-1)
    top_probs, experts = probs.topk(top_k, dim=-1)
    gates = top_probs / top_probs.sum(-1, keepdim=True)  # renormalised over the chosen experts
    return gates, experts, probs


# ---------------------------------------------------------------------------
# Dispatch and combine: the all-to-all
# ---------------------------------------------------------------------------

class AllToAll(torch.autograd.Function):
    """Rows of x, split by input_splits, go to the ranks of the group; backward sends gradients back."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(x, output_splits, input_splits, group):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    rank, row_bytes = dist.get_rank(group), x[0].numel() * x.element_size() if len(x) else 0
    comm_bytes["all_to_all"] += sum(n for r, n in enumerate(input_splits) if r != rank) * row_bytes
    return out


# ---------------------------------------------------------------------------
# The layer, and its seams' defaults: tokens this rank's alone, experts held whole, the micro-batch balanced
# ---------------------------------------------------------------------------

class OwnTokens:
    """The tokens arriving at the MoE layer are this rank's alone (no tensor parallelism): route them all.
    Folded over tensor parallelism, ShardedTokens and ReplicatedTokens (after the banner) take its place."""

    size = 1  # ranks sharing these tokens' loss

    def enter(self, tokens):
        return tokens

    def leave(self, out, tokens):
        return out

    def total(self, x):
        """x summed over the tokens the ranks sharing a loss route."""
        return x


class WholeExperts:
    """Each rank holds its experts whole, and computes the rows it received (SplitExperts: slices of them)."""

    def gather(self, received, recv_counts):
        """(rows to compute, their counts per (expert-tp rank, source rank, local expert))."""
        return received, recv_counts.unsqueeze(0)

    def reduce(self, outputs, counts):
        return outputs


class MicroBatchBalance:
    """The Switch loss balances the whole micro-batch: one unit, whose counts are those summed over stats_group.
    (SequenceBalance, after the banner, balances each sequence.)"""

    scope = "batch"  # model.py's aux_loss_scope

    def __init__(self, stats_group):
        self.stats_group = stats_group

    def statistics(self, layer, x, probs, experts, counts):
        """(assignments per expert over all ranks, this rank's probabilities summed, the ranks sharing them),
        the first two with a row per unit balanced."""
        return counts.unsqueeze(0), probs.sum(0, keepdim=True), dist.get_world_size(self.stats_group)

    def fractions(self, layer, counts, tokens):
        """f_i: each expert's share of the unit's assignments."""
        return counts / (tokens * layer.top_k)


def gated_shared_expert(shared, gate, x):
    """shared(x), or with a gate (Qwen2-MoE's d_model -> 1 shared_expert_gate) sigmoid(gate(x)) * shared(x).
    (A deliberate copy of model.py's.)"""
    out = shared(x)
    return out if gate is None else torch.sigmoid(gate(x)) * out


class ExpertParallelMoE(nn.Module):
    """An MoE layer whose experts are spread over `ep_group`; `stats_group` holds all ranks routing distinct
    tokens (for the balancing statistics). Made from a single-device MoE layer (the contract in the module
    docstring): the router is replicated, this rank keeps experts [r*E/N, (r+1)*E/N) under their global
    indices, so names match the single device's.

    Beyond the article: the attribute names of the router, a shared expert (replicated) and its gate; a
    capacity factor; the balance loss's unit (`balance`); and two seams a reader can skip (defaults: nothing
    shared, nothing split): `tokens`, how the arriving tokens are shared with tensor parallelism (OwnTokens;
    ShardedTokens, ReplicatedTokens), and `expert_tp`, whether this rank holds its experts whole
    (WholeExperts) or slices of them (SplitExperts).
    """

    def __init__(self, moe, ep_group, stats_group, *,  # beyond the article:
                 capacity_factor=0.0, router="router", shared="shared", shared_gate="shared_gate",
                 tokens=OwnTokens(), expert_tp=WholeExperts(), balance=None):
        super().__init__()
        self.balance = balance or MicroBatchBalance(stats_group)
        check_moe(self, moe, (router, shared, shared_gate, "experts"))  # what it would get wrong silently
        self.n_experts, self.top_k = len(moe.experts), moe.top_k
        n, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if self.n_experts % n:
            raise ValueError(f"{self.n_experts} experts do not divide over {n} expert-parallel ranks")
        self.ep_group, self.stats_group = ep_group, stats_group
        self.per_rank, self.first = self.n_experts // n, rank * (self.n_experts // n)
        self.router_name, self.shared_name, self.shared_gate_name = router, shared, shared_gate
        setattr(self, router, getattr(moe, router))  # replicated, under the single device's names
        for name in (shared, shared_gate):  # optional
            setattr(self, name, getattr(moe, name, None))
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in range(self.first, self.first + self.per_rank)})
        self.aux_loss = self.tokens_per_expert = None
        # Beyond the article: the capacity and the seams; DeepSeek-V3's or Qwen's router (None: the article's)
        # and its balancing bias (None if the layer has none), with this step's tokens per expert over every
        # rank, which move that bias (the model's rule): the same counts on every rank, so all move it alike.
        self.capacity_factor, self.tokens, self.expert_tp = capacity_factor, tokens, expert_tp
        self.variant = RouterVariant.of(moe)
        self.register_buffer("route_bias", getattr(moe, "route_bias", None))
        self.register_buffer("balance_load", getattr(moe, "balance_load", None))  # (GlobalBalance's)
        self.bias_update_rate = getattr(moe, "bias_update_rate", 0.0)
        self.register_buffer("load", torch.zeros(self.n_experts, dtype=torch.long,
                                                 device=next(moe.parameters()).device), persistent=False)
        self.dropped = 0
        self.recomputing = False  # set while the forward runs again for backward: its tokens were counted

    def forward(self, x):
        arrived = x.reshape(-1, x.shape[-1])
        tokens = self.tokens.enter(arrived)  # those this rank routes: no other rank routes them
        router = getattr(self, self.router_name)
        gates, experts, probs = route(router(tokens), self.top_k, bias=self.route_bias, variant=self.variant)
        keep = within_capacity(experts, self.n_experts, self.capacity_factor)  # all, unless a capacity factor
        self.aux_loss = self._load_balancing_loss(probs, experts, keep, x)
        out = self.tokens.leave(self._dispatch_compute_combine(tokens, gates, experts, keep), arrived).view_as(x)
        shared = getattr(self, self.shared_name)  # on x as it came (a sequence shard under sp: tp.py gathers it)
        return out if shared is None else out + gated_shared_expert(shared, getattr(self, self.shared_gate_name), x)

    def _load_balancing_loss(self, probs, experts, keep, x):
        """This rank's share of the Switch loss E * sum_i f_i P_i over the micro-batch (`balance`: of each
        sequence, averaged), f_i the fraction of token assignments that went to expert i, P_i its mean router
        probability; and the step's statistics (tokens per expert and dropped, over stats_group).

        f_i and the token count are summed over the ranks sharing the unit
        balanced (no gradient flows through them), the probabilities over the
        ranks sharing this rank's loss (tensor parallelism), each differentiating
        its own tokens'. Each of the N ranks holding part of a unit contributes
        E * N * sum_i f_i * (sum of its p_ti) / T: averaged, as data parallelism
        averages the losses, that is exactly E * sum_i f_i P_i, value and gradient.
        """
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts).to(probs.dtype)
        stats = torch.cat([counts, (~keep).sum().to(probs.dtype).view(1)])
        dist.all_reduce(stats, group=self.stats_group)
        counts, dropped = stats[:-1], stats[-1]
        self.tokens_per_expert, self.dropped = counts.long().tolist(), int(dropped)
        if torch.is_grad_enabled() and not self.recomputing:  # a training forward, counted once
            self.load += counts.long()
        counts, prob_sums, n_ranks = self.balance.statistics(self, x, probs, experts, counts)  # (units, E) each
        tokens = counts.sum(-1, keepdim=True) / self.top_k  # each unit's, over every rank
        f, p = self.balance.fractions(self, counts, tokens), self.tokens.total(prob_sums) / tokens
        return self.n_experts * (n_ranks // self.tokens.size) * (f * p).sum(-1).mean()

    def _dispatch_compute_combine(self, tokens, gates, experts, keep):
        n = dist.get_world_size(self.ep_group)
        flat_experts = experts.flatten()[keep.flatten()]
        assignment = torch.nonzero(keep.flatten()).squeeze(1)  # index into the (token, choice) pairs
        order = torch.argsort(flat_experts, stable=True)        # grouped by expert, hence by owner rank
        token_of, expert_of = assignment[order] // self.top_k, flat_experts[order]
        send_counts = torch.bincount(expert_of, minlength=self.n_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)  # per (source rank, local expert)
        send_splits = send_counts.view(n, self.per_rank).sum(1).tolist()
        recv_counts = recv_counts.view(n, self.per_rank)
        with torch.profiler.record_function("ep.dispatch"):  # a profiler's trace names it (free without one)
            received = AllToAll.apply(tokens[token_of], recv_counts.sum(1).tolist(), send_splits, self.ep_group)
        expert_outputs = self._compute(received, recv_counts)
        with torch.profiler.record_function("ep.combine"):
            returned = AllToAll.apply(expert_outputs, send_splits, recv_counts.sum(1).tolist(), self.ep_group)
        weights = gates.flatten()[keep.flatten()][order].to(tokens.dtype)
        return torch.zeros_like(tokens).index_add(0, token_of, returned * weights.unsqueeze(1))

    def _compute(self, received, recv_counts):
        """Run each local expert on the rows it received (grouped by source rank, then by local expert), under
        expert tensor parallelism on every rank's of the group (expert_tp)."""
        rows_in, counts = self.expert_tp.gather(received, recv_counts)
        pieces = list(rows_in.split(counts.flatten().tolist()))
        blocks = len(pieces) // self.per_rank  # (expert-tp rank, source rank) pairs
        for e, expert in enumerate(self.experts.values()):
            rows = [pieces[b * self.per_rank + e] for b in range(blocks)]
            if not sum(len(r) for r in rows):  # no token: not run, so no gradient, as on one device
                with torch.no_grad():
                    dtype = expert(rows[0]).dtype  # the dtype a run would give (the activations')
                outputs = [row.to(dtype) for row in rows]  # empty, so that every rank sends the same dtype
            else:
                outputs = expert(torch.cat(rows)).split([len(r) for r in rows])
            for b in range(blocks):
                pieces[b * self.per_rank + e] = outputs[b]
        return self.expert_tp.reduce(torch.cat(pieces), counts)


# ---- Beyond the article ----
# DeepSeek-V3's and Qwen's router and the balance loss per sequence, what the layer refuses, the capacity
# limit, folding over tensor parallelism, expert tensor parallelism, model.py's glue, the self-check.


# ---------------------------------------------------------------------------
# DeepSeek-V3's and Qwen's router, and the balance loss per sequence
# ---------------------------------------------------------------------------

def softmax_scores(logits):
    """(scores, probs) of the router: the softmax over the experts, both."""
    probs = logits.softmax(-1)
    return probs, probs


def sigmoid_scores(logits):
    """(scores, probs): DeepSeek-V3's router scores, each expert's sigmoid on its own, and those normalised
    to sum to one (its s', which the balance loss averages). (Copies of model.py's, as `route` is.)"""
    scores = logits.sigmoid()
    return scores, scores / scores.sum(-1, keepdim=True)


SCORES = {"softmax": softmax_scores, "sigmoid": sigmoid_scores}


def best_groups_only(choice, n_group, topk_group):
    """choice (tokens, n_experts) with the experts outside each token's topk_group best groups (of n_group
    consecutive ones; a group's worth: its two best choice scores summed) set to -inf: DeepSeek-V3's
    group-limited routing. With a group per rank (or node) of the expert grid, a token travels to at most
    topk_group of them. Unchanged with one group."""
    if n_group == 1:
        return choice
    grouped = choice.unflatten(-1, (n_group, -1))
    worth = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
    best = torch.zeros_like(worth, dtype=torch.bool).scatter_(-1, worth.topk(topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~best.unsqueeze(-1), float("-inf")).flatten(-2)


@dataclass(frozen=True)
class RouterVariant:
    """The router's options past the article, as model.py's `route` takes them: the scores (`SCORES`:
    DeepSeek-V3's "sigmoid"), group-limited choice ((n_group, topk_group): `best_groups_only`), the top-k
    gates renormalised or not (Qwen2-MoE's norm_topk_prob), and a scale on them (DeepSeek-V3's
    routed_scaling_factor)."""

    scoring: str = "softmax"
    groups: tuple = (1, 1)
    renormalise: bool = True
    scale: float = 1.0

    @classmethod
    def of(cls, moe):
        """The variant an MoE layer's attributes ask for (the module docstring's contract); None: the article's."""
        variant = cls(getattr(moe, "scoring", "softmax"), tuple(getattr(moe, "groups", (1, 1))),
                      getattr(moe, "norm_topk_prob", True), getattr(moe, "routed_scaling_factor", 1.0))
        return None if variant == cls() else variant

    def route(self, router_logits, top_k, bias=None):
        """`route` with these options: a balancing bias (DeepSeek-V3's) is added to the scores only to choose
        the experts; the gates stay those of the unbiased scores."""
        scores, probs = SCORES[self.scoring](router_logits.to(torch.promote_types(router_logits.dtype,
                                                                                  torch.float32)))
        choice = scores if bias is None else scores + bias
        experts = best_groups_only(choice, *self.groups).topk(top_k, dim=-1).indices
        top_scores = scores.gather(-1, experts)
        gates = top_scores / top_scores.sum(-1, keepdim=True) if self.renormalise else top_scores
        return gates * self.scale, experts, probs


class SequenceBalance(MicroBatchBalance):
    """DeepSeek-V3's sequence-wise balance loss (its equations 17-20): the Switch loss of each sequence of the
    micro-batch, averaged. `group`: the ranks holding parts of the same sequences (context and tensor
    parallelism's), over which each sequence's counts are summed. The layer's input is (sequences, tokens,
    d_model), its rows the same sequences on every rank of the group."""

    scope = "sequence"

    def __init__(self, group):
        super().__init__(group)
        self.group = group

    def statistics(self, layer, x, probs, experts, counts):
        """MicroBatchBalance's, with a row per sequence."""
        n = x.shape[0]
        sequence = layer.tokens.enter(torch.arange(n, device=x.device).repeat_interleave(x.shape[1]))
        pairs = sequence.unsqueeze(1) * layer.n_experts + experts  # (sequence, expert) of each assignment
        counts = torch.bincount(pairs.flatten(), minlength=n * layer.n_experts).view(n, -1).to(probs.dtype)
        dist.all_reduce(counts, group=self.group)
        prob_sums = torch.zeros_like(counts).index_add(0, sequence, probs)
        return counts, prob_sums, dist.get_world_size(self.group)


class GlobalBalance(MicroBatchBalance):
    """Qwen's global-batch balance (arXiv 2501.11873): each expert's f_i its share of the whole global batch's
    assignments, not the micro-batch's, the probabilities still the micro-batch's. The layer's `balance_load`
    holds the previous step's loads over every micro-batch of every rank (model.py's end_moe_step keeps them),
    since a micro-batch cannot wait for those not yet run: the same f for every micro-batch and rank, and for
    a recomputed forward; uniform before the first step was counted."""

    scope = "global"

    def fractions(self, layer, counts, tokens):
        load = layer.balance_load
        total = load.sum()
        return torch.where(total > 0, load.to(counts.dtype) / total.clamp(min=1), 1 / len(load)).unsqueeze(0)


# ---------------------------------------------------------------------------
# What the layer refuses: what it would otherwise get wrong without a word
# ---------------------------------------------------------------------------

def check_moe(layer, moe, named):
    """The layer's refusals, at its making: a balance loss over a unit it was not given the ranks for
    (`refuse_other_balance`), a part of moe the glue did not name (`refuse_unnamed_parts`); and at each
    forward, before it runs, a router tp.py summed over more ranks than the tokens are shared with
    (`refuse_unshared_tokens`: train.py makes the layer before tp.py splits the block)."""
    refuse_other_balance(moe, layer.balance)
    refuse_unnamed_parts(moe, named)
    layer.register_forward_pre_hook(_refuse_unshared_tokens_before_forward)


def _refuse_unshared_tokens_before_forward(layer, args):
    refuse_unshared_tokens(getattr(layer, layer.router_name), layer.tokens)


def refuse_other_balance(moe, balance):
    """The layer balances per sequence (model.py's aux_loss_scope) but was given no group for it, or the reverse."""
    scope = getattr(moe, "aux_loss_scope", "batch")
    if scope != balance.scope:
        raise ValueError(f"the MoE layer's balance loss is over each {scope}, but balance={type(balance).__name__}: "
                         f"pass balance=SequenceBalance(group) (group: the ranks holding parts of the same "
                         f"sequences) for 'sequence', nothing for 'batch'")


def refuse_unshared_tokens(router, tokens):
    """Refuse a router whose gradient tp.py sums over more ranks (`summed_over_ranks`, set by its
    `gradients_summed`) than the token policy shares tokens with: under tensor parallelism without
    `tokens=`, every rank would route the same tokens (each routed N times) or only its shard's with the
    balancing loss counted alone, and nothing else would fail."""
    ranks = getattr(router, "summed_over_ranks", 1)
    if ranks > tokens.size:
        raise ValueError(f"the router's gradient is summed over {ranks} tensor-parallel ranks (tp.py), but the "
                         f"layer's token policy {type(tokens).__name__} shares its tokens with {tokens.size}: pass "
                         f"tokens=ShardedTokens(tp_group) under sequence parallelism, ReplicatedTokens(tp_group) "
                         f"without")


def refuse_unnamed_parts(moe, named):
    """Refuse a layer with a submodule the glue did not name (say Qwen2-MoE's `shared_expert_gate` without
    `shared_gate=`): the parallel layer runs only what it is told of, and would silently leave it out."""
    unnamed = [name for name, _ in moe.named_children() if name not in named]
    if unnamed:
        raise ValueError(f"the MoE layer's {', '.join(unnamed)} is none of router={named[0]!r}, shared={named[1]!r}, "
                         f"shared_gate={named[2]!r}, 'experts': name it, or the parallel layer would not run it")


# ---------------------------------------------------------------------------
# The capacity limit (GShard's, Switch Transformer's): dropless without it
# ---------------------------------------------------------------------------

def within_capacity(experts, n_experts, capacity_factor):
    """Which (token, choice) assignments are kept: all (dropless), or under a capacity factor the first
    capacity_factor * tokens * k / E of each expert's, in token order; the others are dropped (their output
    is zero, the residual stream carries them) and counted."""
    if not capacity_factor:
        return torch.ones_like(experts, dtype=torch.bool)
    n_tokens, top_k = experts.shape
    return capacity_mask(experts, n_experts, int(capacity_factor * n_tokens * top_k / n_experts + 0.999999))


def capacity_mask(experts, n_experts, capacity):
    """Which (token, choice) assignments an expert keeps: the first `capacity` of each expert, in token order."""
    flat = experts.flatten()
    one_hot = F.one_hot(flat, n_experts)
    rank_within_expert = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
    return (rank_within_expert < capacity).view_as(experts)


# ---------------------------------------------------------------------------
# Folded over tensor parallelism (Megatron-LM's "MoE parallel folding")
# ---------------------------------------------------------------------------
# The ep group need not be a dimension of its own: its ranks may be the ones attention splits heads (tp)
# or the sequence (cp) over, so every rank must route tokens no other rank routes. The `tokens` policy says
# how the arriving tokens relate to those of the other ranks of a tensor-parallel group: OwnTokens (no tp),
# ShardedTokens (sequence parallelism: each rank holds a shard) or ReplicatedTokens (every rank holds them
# all: each routes its 1/N and the outputs are all-gathered back, so a token is routed once, not N times).
# The ranks sharing a loss then each differentiate their own tokens' part of it: the router's gradient is
# summed over them (tp.py's split_moe), and the balancing loss sums their probabilities forward (SumForward).

# Row counts differ from rank to rank (the router decides them), which all-gather and reduce-scatter do not
# take on every backend; an all-to-all does, sending the same bytes a ring would.

def _gather_rows(x, counts, group):
    """Every rank's rows, in rank order (rank r has counts[r]): each rank sends its own to every rank."""
    n = len(counts)
    return _all_to_all(x.repeat(n, 1), counts, [len(x)] * n, group)


def all_gather_rows(x, counts, group):
    """Every rank's rows, in rank order (rank r has counts[r]); backward, each rank's rows get the sum of
    their gradients over the group (a reduce-scatter: the gradient of the copies each rank was sent)."""
    n = len(counts)
    return AllToAll.apply(x.repeat(n, 1), counts, [len(x)] * n, group)


def reduce_scatter_rows(x, counts, group):
    """x: every rank's rows in rank order (as all_gather_rows gives), partial sums; returns this rank's rows
    summed over the group. Backward, every rank gets the gradient of its rows (an all-gather)."""
    n, mine = len(counts), counts[dist.get_rank(group)]
    return AllToAll.apply(x, [mine] * n, counts, group).view(n, mine, *x.shape[1:]).sum(0)


def split_counts(n_rows, n):
    """How n_rows rows split over n ranks as evenly as they can, in order (torch.tensor_split's sizes)."""
    return [n_rows // n + (r < n_rows % n) for r in range(n)]


class KeepRows(torch.autograd.Function):
    """Rows every rank of the group holds alike: keep this rank's part forward; backward, all-gather the
    parts' gradients, so every rank gets the whole gradient, as the rows' other users expect."""

    @staticmethod
    def forward(ctx, x, group):
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.counts = group, split_counts(len(x), n)
        return x.split(ctx.counts)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.counts, ctx.group), None


class GatherRows(torch.autograd.Function):
    """The inverse of KeepRows: all-gather the parts forward; backward keep this rank's part of the
    gradient, which every rank holds alike."""

    @staticmethod
    def forward(ctx, x, counts, group):
        ctx.rows = sum(counts[:dist.get_rank(group)]), len(x)
        return _gather_rows(x, counts, group)

    @staticmethod
    def backward(ctx, grad):
        start, rows = ctx.rows
        return grad[start:start + rows], None, None


class SumForward(torch.autograd.Function):
    """All-reduce forward, identity backward: a sum every rank uses alike, each differentiating its own part."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ShardedTokens(OwnTokens):
    """Sequence parallelism: the ranks of `group` (tensor parallelism's) share one loss, each holding its own
    shard of the sequence. Each routes its shard; the load-balancing loss sums their probabilities."""

    def __init__(self, group):
        self.group, self.size = group, dist.get_world_size(group)

    def total(self, x):
        return SumForward.apply(x, self.group)


class ReplicatedTokens(ShardedTokens):
    """Tensor parallelism without sequence parallelism: every rank of `group` holds the same tokens. Each
    routes its 1/N of them (so a token is routed once, not N times: Megatron-LM's MoE under tensor
    parallelism), and the outputs are gathered back."""

    def enter(self, tokens):
        return KeepRows.apply(tokens, self.group)

    def leave(self, out, tokens):
        return GatherRows.apply(out, split_counts(len(tokens), self.size), self.group)


# ---------------------------------------------------------------------------
# Expert tensor parallelism
# ---------------------------------------------------------------------------

class SplitExperts(WholeExperts):
    """Expert tensor parallelism: the ranks of `group` hold slices of the same experts (each expert's first
    matrices column-parallel, its last row-parallel, nothing communicating inside: tp.py's `split_experts`,
    any MLP's layer names) and received different rows. Each expert's rows from all of them are gathered, every
    rank computes its slice's partial outputs for all of them, and a reduce-scatter sums those and hands
    each rank its own rows: Megatron-LM's expert tensor parallelism, all-gather in, reduce-scatter out."""

    def __init__(self, group):
        self.group = group

    def gather(self, received, recv_counts):
        everyone = [torch.empty_like(recv_counts) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, recv_counts, group=self.group)
        counts = torch.stack(everyone)
        return all_gather_rows(received, counts.flatten(1).sum(1).tolist(), self.group), counts

    def reduce(self, outputs, counts):
        return reduce_scatter_rows(outputs, counts.flatten(1).sum(1).tolist(), self.group)


# ---------------------------------------------------------------------------
# The all-to-alls beside the experts' computation: the routed tokens in chunks
# ---------------------------------------------------------------------------

class Exchange:
    """One all-to-all of rows, started in one place and finished in another, so that computation runs between
    (dist.all_to_all_single with async_op), forward, and its reverse, backward. The trace names each start
    `<name> start` and each finish `<name> wait`: from the one's start to the other's end the rows are in
    flight, and only the wait leaves the rank idle (tools/bench's moe_overlap reads them). in_flight is called
    once the rows are on their way (OverlappedExpertParallelMoE's)."""

    def __init__(self, name, output_splits, input_splits, group, in_flight=None):
        self.name, self.splits, self.group = name, (output_splits, input_splits), group
        self.in_flight = in_flight or (lambda: None)
        self.pending = None

    def start(self, x, backward=False):
        output_splits, input_splits = self.splits[::-1] if backward else self.splits
        name = f"{self.name} grad" if backward else self.name
        with torch.profiler.record_function(f"{name} start"):
            out, x = x.new_empty((sum(output_splits), *x.shape[1:])), x.contiguous()
            work = dist.all_to_all_single(out, x, output_splits, input_splits, group=self.group, async_op=True)
        rank, row_bytes = dist.get_rank(self.group), x[0].numel() * x.element_size() if len(x) else 0
        comm_bytes["all_to_all"] += sum(n for r, n in enumerate(input_splits) if r != rank) * row_bytes
        self.pending = (name, work, out, x)  # (x kept alive until the rows have left)
        self.in_flight()

    def finish(self):
        name, work, out, _ = self.pending
        self.pending = None
        with torch.profiler.record_function(f"{name} wait"):
            work.wait()
        return out


class StartExchange(torch.autograd.Function):
    """Forward: start sending x's rows; returns an empty tensor that ties the start to its finish in the graph.
    Backward: finish receiving the gradient's rows, which FinishExchange's backward started."""

    @staticmethod
    def forward(ctx, x, exchange):
        ctx.exchange = exchange
        exchange.start(x)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        return ctx.exchange.finish(), None


class FinishExchange(torch.autograd.Function):
    """Forward: the rows received; backward: start sending their gradient back."""

    @staticmethod
    def forward(ctx, started, exchange):
        ctx.exchange = exchange
        return exchange.finish()

    @staticmethod
    def backward(ctx, grad):
        ctx.exchange.start(grad, backward=True)
        return grad.new_empty(0), None


class OverlappedExpertParallelMoE(ExpertParallelMoE):
    """ExpertParallelMoE whose all-to-alls travel beside its experts' computation (Megatron's and DeepSeek's
    overlap within a layer): the routed tokens in `chunks` groups, each dispatched, computed and combined on
    its own. Every chunk's dispatch starts at once, each combine as soon as its chunk is computed, so chunk
    c's experts compute while the later chunks' tokens travel and the earlier chunks' outputs return (the
    first dispatch and the last combine alone wait in the open). Backward the same, reversed: the autograd
    engine runs the later chunk first, so its experts' backward runs while the earlier chunk's gradients travel.
    Every row meets the same weights as in ExpertParallelMoE: the same numbers (an expert's gradient summed over
    the chunks in another order: to rounding), the same activations kept, the same bytes sent.

    in_flight: called as soon as each exchange has started, while its rows travel (default: nothing). A
    pipeline pairing two micro-batches (pp.py's combined 1F1B) passes its `pass_turn`: the other micro-batch
    computes meanwhile, forward beside backward, as Megatron's combined 1F1B and DeepSeek's DualPipe do."""

    def __init__(self, moe, ep_group, stats_group, *, chunks=2, in_flight=None, **options):
        super().__init__(moe, ep_group, stats_group, **options)
        self.chunks, self.in_flight = chunks, in_flight

    def _dispatch_compute_combine(self, tokens, gates, experts, keep):
        n, kept = dist.get_world_size(self.ep_group), keep.flatten()
        flat_experts, flat_gates = experts.flatten()[kept], gates.flatten()[kept]
        assignment = torch.nonzero(kept).squeeze(1)  # (token, choice) pairs kept, in token order
        ends = torch.linspace(0, len(tokens), self.chunks + 1, device=tokens.device).long()[1:] * self.top_k
        sizes = torch.diff(torch.searchsorted(assignment, ends), prepend=ends.new_zeros(1)).tolist()
        chunks = [self._sorted(*pieces) for pieces in zip(assignment.split(sizes), flat_experts.split(sizes),
                                                         flat_gates.split(sizes))]
        recv_counts = self._exchange_counts(torch.stack([send for _, _, send in chunks]), n)
        dispatches, combines = [], []
        for c, (token_of, _, send_counts) in enumerate(chunks):
            send_splits = send_counts.view(n, self.per_rank).sum(1).tolist()
            received = recv_counts[c].sum(1).tolist()
            dispatches.append(Exchange(f"ep.dispatch c{c}", received, send_splits, self.ep_group, self.in_flight))
            combines.append(Exchange(f"ep.combine c{c}", send_splits, received, self.ep_group, self.in_flight))
        started = [StartExchange.apply(tokens[token_of], exchange)
                   for (token_of, _, _), exchange in zip(chunks, dispatches)]
        for c, exchange in enumerate(dispatches):
            computed = self._compute(FinishExchange.apply(started[c], exchange), recv_counts[c])
            started[c] = StartExchange.apply(computed, combines[c])
        out = torch.zeros_like(tokens)
        for (token_of, weights, _), start, exchange in zip(chunks, started, combines):
            returned = FinishExchange.apply(start, exchange)
            out = out.index_add(0, token_of, returned * weights.to(tokens.dtype).unsqueeze(1))
        return out

    def _sorted(self, assignment, flat_experts, flat_gates):
        """A chunk's (token of each assignment, its gate, assignments per expert), grouped by expert."""
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.n_experts)
        return assignment[order] // self.top_k, flat_gates[order], counts

    def _exchange_counts(self, send_counts, n):
        """Every chunk's counts in one all-to-all: (chunks, source rank, local expert) of those this rank gets."""
        by_rank = send_counts.view(self.chunks, n, self.per_rank).transpose(0, 1).contiguous()
        received = torch.empty_like(by_rank)
        dist.all_to_all_single(received, by_rank, group=self.ep_group)
        return received.transpose(0, 1)


# ---------------------------------------------------------------------------
# Applying it to model.py's GPT
# ---------------------------------------------------------------------------

def is_expert_parameter(name):
    return ".experts." in name


def apply_expert_parallel(model, ep_group, stats_group, capacity_factor=0.0, overlap_chunks=0, in_flight=None,
                          **options):
    """Replace every MoE layer of a GPT by its expert-parallel version (the only model knowledge here), with
    overlap_chunks its all-to-alls beside its experts' computation, the tokens in that many chunks, and
    in_flight called while each travels (OverlappedExpertParallelMoE); options: ExpertParallelMoE's `tokens`,
    `expert_tp` and `balance`."""
    layer = (partial(OverlappedExpertParallelMoE, chunks=overlap_chunks, in_flight=in_flight) if overlap_chunks
             else ExpertParallelMoE)
    for block in model.blocks:
        if hasattr(getattr(block, "mlp", None), "experts"):
            block.mlp = layer(block.mlp, ep_group, stats_group, capacity_factor=capacity_factor, **options)
    return model


# ---------------------------------------------------------------------------
# Self-check: torchrun --nproc_per_node 4 ep.py
# ---------------------------------------------------------------------------

class _ToyMoE(nn.Module):
    """Router and experts, computed on one device for every token (the reference)."""

    def __init__(self, d, n_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(n_experts))

    def forward(self, tokens):
        gates, experts, probs = route(self.router(tokens), self.top_k)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token_idx, choice = torch.where(experts == e)
            out.index_add_(0, token_idx, expert(tokens[token_idx]) * gates[token_idx, choice, None])
        counts = torch.bincount(experts.flatten(), minlength=len(self.experts)).to(probs.dtype)
        aux = len(self.experts) * (counts / experts.numel() * probs.mean(0)).sum()
        return out, aux


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
    import copy
    device = _join_process_group()
    backend, rank, n = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _ToyMoE(8, 2 * n, 2).to(device, torch.float64)
    g = torch.Generator().manual_seed(1)
    tokens, grad = (torch.randn(n, 5, 8, generator=g, dtype=torch.float64).to(device) for _ in range(2))
    expected, expected_aux = reference(tokens.flatten(0, 1))
    ((expected * grad.flatten(0, 1)).sum() + expected_aux).backward()
    layer = ExpertParallelMoE(copy.deepcopy(reference), None, None)
    for p in layer.parameters():
        p.grad = None
    out = layer(tokens[rank])
    # Each rank holds 1/n of the tokens: its aux-loss term is n times too large on its own, averaged below.
    ((out * grad[rank]).sum() + layer.aux_loss / n).backward()
    dist.all_reduce(layer.router.weight.grad)  # the router is replicated: its gradient is summed over ranks
    aux = layer.aux_loss.detach().clone()
    dist.all_reduce(aux)
    worst = max((out - expected.view(n, 5, 8)[rank]).abs().max().item(), (aux / n - expected_aux).abs().item(),
                (layer.router.weight.grad - reference.router.weight.grad).abs().max().item())
    for e, expert in layer.experts.items():
        for p, ref in zip(expert.parameters(), reference.experts[int(e)].parameters()):
            worst = max(worst, (p.grad - ref.grad).abs().max().item())
    worst_all = torch.tensor([worst], device=device)
    dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"ep.py self-check on {n} ranks ({backend}), {2 * n} experts, top-2: largest difference from one "
              f"device (output, load-balancing loss, router and expert gradients, float64) = {worst_all.item():.3g}; "
              f"tokens per expert {layer.tokens_per_expert}", flush=True)
    dist.destroy_process_group()
    if worst_all.item() > 1e-12:
        raise SystemExit(f"rank {rank}: expert parallelism differs from the single device")


if __name__ == "__main__":
    _self_check()
