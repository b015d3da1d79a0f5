"""Predict what a run of train.py would hold and send, per rank, without running it.

    python plan.py --world 8 --tp 2 --pp 2 --ep 2 --experts 8 --micro-batches 4
    python plan.py --model llama3-405b --arch llama --world 16384 --tp 8 --pp 16 --zero 1 ...
    python plan.py --model llama3-8b --arch llama --world 64 --memory 80GiB --search

It takes train.py's own flags, plus the number of ranks (`--world`), and
predicts per rank the four memory figures and the traffic that train.py logs
(`log.jsonl`'s `param_bytes`, `grad_bytes`, `optim_bytes`,
`activation_peak_bytes` and `comm_<dim>_<kind>_bytes`). `--json` prints them
under those names, as lists indexed by rank; tests/test_plan.py runs
train.py and checks that every counter equals its prediction.

Where the numbers come from:
- Parameter shapes are model.py's own: the model is built on PyTorch's
  "meta" device (shapes without memory), so the planner cannot drift from it.
- How the dimensions split them is written out below, one rule per dimension
  (tensor: by the rules of tp.py; pipeline: pp.py's stage split; expert:
  E/ep experts per rank), and so are the buckets data parallelism and ZeRO
  pack them into (padded to a multiple of the group, as dp.py pads them).
- Memory per parameter follows the article's accounting (params, grads,
  AdamW's two moments; ZeRO-1/2/3 divide them by the data-parallel size),
  in the run's own dtype: float32 weights, gradients and moments (16 bytes
  a parameter; the article's 16 bytes assume bf16 weights with an fp32
  master copy, the same total).
- Traffic counts what each collective sends as a ring algorithm does, as
  the runs count it: an all-reduce of n bytes over N ranks sends 2(N-1)/N n,
  a reduce-scatter or an all-gather (N-1)/N n; point-to-point and
  all-to-all what leaves the rank.
- Activations are the tensors autograd saves for backward, modelled per
  token and layer from what model.py's operators save (Korthikanti et al.,
  2022, count them the same way for Megatron's block). Mixture-of-experts
  traffic and activations assume balanced routing (each expert gets its
  fair share of every rank's tokens).

`--search` lists the layouts of `--world` ranks that fit `--memory` per
rank, with their traffic inside a node and across nodes (`--gpus-per-node`,
ranks laid out as mesh.py lays them: tp fastest, then cp, ep, pp, dp).
"""
import argparse
import bisect
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, replace

import torch

import pp
import train
from mesh import DIMS, GROUPS, coordinates, group_ranks
from model import GPT

INT64, BOOL = 8, 1  # bytes of the index and mask tensors some operators save


# ---------------------------------------------------------------------------
# The layout: train.py's flags, reduced to what sizes and traffic depend on
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    world: int
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    zero: int
    sp: bool
    schedule: str
    virtual_stages: int
    micro_batches: int
    batch_size: int        # global, in sequences
    recompute: str
    dtype: str
    bucket_bytes: int

    @property
    def dense_group(self):  # ranks averaging dense gradients (mesh.py's "dense")
        return self.dp * self.ep * self.cp

    @property
    def expert_group(self):  # ranks averaging expert gradients (mesh.py's "expert")
        return self.dp * self.cp

    @property
    def micro_batch(self):  # sequences a rank computes per micro-batch
        return self.batch_size // (self.micro_batches * self.dp * self.ep)

    @property
    def weight_bytes(self):  # weights, gradients and moments (bf16 runs keep float32 weights)
        return 8 if self.dtype == "float64" else 4

    @property
    def activation_bytes(self):  # matrix products' outputs (bf16 under autocast)
        return {"float64": 8, "float32": 4, "bfloat16": 2}[self.dtype]


def layout_of(args, world):
    """The Layout train.py would build from these flags on `world` ranks (a train.ConfigError if none)."""
    shape = train.check_args(args, world)
    return Layout(world=world, dp=shape.dp, tp=shape.tp, pp=shape.pp, cp=shape.cp, ep=shape.ep, zero=args.zero,
                  sp=args.sp, schedule=args.schedule, virtual_stages=args.virtual_stages,
                  micro_batches=args.micro_batches, batch_size=args.batch_size, recompute=args.recompute,
                  dtype=args.dtype, bucket_bytes=int(args.bucket_mb * 2**20))


# ---------------------------------------------------------------------------
# Parameters: which ones a rank holds, and how large its share is
# ---------------------------------------------------------------------------

def model_parameters(config):
    """[(name, shape)] of model.py's GPT in its parameter order, from a model built without memory."""
    with torch.device("meta"):
        model = GPT(config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def is_expert(name):
    return ".experts." in name  # as ep.is_expert_parameter


def tp_sharded(name):
    """Whether tensor parallelism splits this parameter N ways (tp.py): the column-parallel q|k|v, fc (and
    their biases), the row-parallel proj weights, the vocabulary-parallel embedding and head. Norms, the
    position table, routers and row-parallel biases are replicated."""
    if name.endswith(("qkv.bias", "fc.bias")):
        return True
    return name.endswith(".weight") and not any(part in name for part in ("norm", "pos_emb", "router"))


def stage_of(name, layer_stage, last_stage):
    """The pipeline rank that holds this parameter (pp.py: rank 0 the embeddings, the last the head)."""
    if name.startswith(("tok_emb.", "pos_emb.")):
        return 0
    if name.startswith(("norm.", "lm_head.")):
        return last_stage
    return layer_stage[int(name.split(".")[1])]


def layer_stages(config, layout):
    """{layer: pipeline rank}: model chunk c of P*V lives on rank c mod P (pp.split_layers)."""
    chunks = pp.split_layers(config.n_layer, layout.pp * layout.virtual_stages)
    return {layer: c % layout.pp for c, layers in enumerate(chunks) for layer in layers}


def rank_parameters(config, layout, stage):
    """(dense, expert): [(name, elements)] this pipeline rank holds, in parameter order (any tp, ep rank:
    they all hold as many)."""
    stages = layer_stages(config, layout)
    experts_per_rank = config.n_experts // layout.ep if config.n_experts else 0
    dense, expert = [], []
    for name, shape in model_parameters(config):
        if stage_of(name, stages, layout.pp - 1) != stage:
            continue
        if is_expert(name) and int(name.split(".")[4]) >= experts_per_rank:
            continue  # another expert-parallel rank's (every rank holds E/ep, the same sizes)
        numel = math.prod(shape) // (layout.tp if tp_sharded(name) else 1)
        (expert if is_expert(name) else dense).append((name, numel))
    return dense, expert


# ---------------------------------------------------------------------------
# Buckets (dp.py): gradients in backward order, about bucket_bytes each, padded to a multiple of the group
# ---------------------------------------------------------------------------

@dataclass
class Bucket:
    sizes: list   # elements of each parameter, in bucket order
    padded: int   # elements, a multiple of the group's size

    def pieces(self, rank, n_ranks):
        """How many parameters overlap ZeRO rank `rank`'s shard [r S, (r+1) S) of this bucket."""
        offsets = [0]
        for size in self.sizes:
            offsets.append(offsets[-1] + size)
        shard = self.padded // n_ranks
        lo, hi = rank * shard, (rank + 1) * shard
        first = bisect.bisect_right(offsets, lo) - 1  # the parameter in which the shard begins
        last = bisect.bisect_left(offsets, hi)        # one past the parameter in which it ends
        return sum(1 for i in range(max(first, 0), min(last, len(self.sizes)))
                   if min(offsets[i + 1], hi) > max(offsets[i], lo))


def padded(numel, n_ranks):
    return math.ceil(numel / n_ranks) * n_ranks


def make_buckets(sizes, bucket_bytes, itemsize, n_ranks):
    """As dp.make_buckets: in backward (reverse) order, a new bucket once one holds bucket_bytes or more."""
    buckets, current = [], []
    for size in reversed(sizes):
        if current and sum(current) * itemsize >= bucket_bytes:
            buckets.append(current)
            current = []
        current.append(size)
    if current:
        buckets.append(current)
    return [Bucket(b, padded(sum(b), n_ranks)) for b in buckets]


def zero3_buckets(params, config, n_ranks):
    """ZeRO-3's buckets are its units (dp.gpt_units: embeddings, each block, final norm, head), in reverse."""
    unit_of = lambda name: name.split(".")[0] if not name.startswith("blocks.") else ".".join(name.split(".")[:2])  # noqa: E731
    units = {}
    for name, numel in params:
        units.setdefault(unit_of(name), []).append(numel)
    return [Bucket(sizes, padded(sum(sizes), n_ranks)) for sizes in reversed(list(units.values()))]


def ring_bytes(kind, nbytes, n_ranks):
    """What one rank sends in a ring collective over nbytes (as dp.ring_bytes_sent and tp.py count)."""
    passes = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}[kind]
    return passes * (n_ranks - 1) * nbytes // n_ranks


# ---------------------------------------------------------------------------
# Memory of parameters, gradients, optimizer state (article: 16 Psi; ZeRO's 4+12/N, 2+14/N, 16/N)
# ---------------------------------------------------------------------------

ADAM_STEP_BYTES = 4  # fused AdamW keeps each parameter's step count as a float32 scalar


def state_memory(params, group, index, layout, unused_check, config):
    """(param, grad, optim, traffic Counter) bytes of one set of parameters averaged over `group` ranks,
    of which this rank is number `index`."""
    w, sizes = layout.weight_bytes, [numel for _, numel in params]
    if not sizes:
        return 0, 0, 0, Counter()
    traffic = Counter()
    if not layout.zero:
        buckets = make_buckets(sizes, layout.bucket_bytes, w, group) if layout.dense_group > 1 else []
        if buckets:  # dp.DataParallel: one all-reduce of each bucket per step (ring: 2 (N-1)/N Psi)
            traffic["all_reduce"] = sum(ring_bytes("all_reduce", b.padded * w, group) for b in buckets)
            if unused_check:  # the used-mask, one byte per parameter
                traffic["all_reduce"] += ring_bytes("all_reduce", len(sizes), group)
            grads = sum(b.padded for b in buckets) * w
        else:
            grads = sum(sizes) * w
        optim = sum(2 * numel * w + ADAM_STEP_BYTES for numel in sizes)
        return sum(sizes) * w, grads, optim, traffic
    buckets = (zero3_buckets(params, config, group) if layout.zero == 3 else
               make_buckets(sizes, layout.bucket_bytes, w, group))
    full = sum(b.padded for b in buckets)
    shard = full // group
    pieces = sum(b.pieces(index, group) for b in buckets)
    param = (shard if layout.zero == 3 else full) * w
    grad = (shard + (full if layout.zero == 1 else 0)) * w  # ZeRO-1 keeps the full gradient as well
    optim = 2 * shard * w + pieces * ADAM_STEP_BYTES        # each parameter's piece of the shard is stepped
    reductions = 1 if layout.zero == 1 else layout.micro_batches  # ZeRO-2/3 reduce in every backward
    gathers = 2 * layout.micro_batches if layout.zero == 3 else 1  # ZeRO-3: before forward and before backward
    traffic["reduce_scatter"] = reductions * sum(ring_bytes("reduce_scatter", b.padded * w, group) for b in buckets)
    traffic["all_gather"] = gathers * sum(ring_bytes("all_gather", b.padded * w, group) for b in buckets)
    traffic["all_reduce"] = ring_bytes("all_reduce", 8, group)  # the gradient norm's sum of squares, float64
    if unused_check:
        traffic["all_reduce"] += ring_bytes("all_reduce", len(sizes), group)
    return param, grad, optim, traffic


# ---------------------------------------------------------------------------
# Traffic of the model-parallel dimensions, per micro-batch (forward and backward)
# ---------------------------------------------------------------------------

def tokens_per_rank(config, layout):
    """Tokens of one micro-batch a rank computes on (its data slice, its cp shard of each sequence)."""
    return layout.micro_batch * config.seq_len // layout.cp


def tp_traffic(config, layout, layers, first, last):
    """Tensor parallelism's bytes per micro-batch (Megatron: two all-reduces of b*s*h per block forward,
    two backward; sequence parallelism turns each into a reduce-scatter and an all-gather)."""
    t, c, traffic = layout.tp, config, Counter()
    if t == 1:
        return traffic
    hidden = tokens_per_rank(c, layout) * c.d_model  # b*s*h of this rank's cp shard (gathered under sp)
    # What enters a region is a norm's output, in the weights' dtype (float32 under bf16 autocast); what
    # leaves it a matrix product's partial sum, in the activations' dtype. Backward sends the gradients
    # of the same tensors, in the same dtypes.
    enter, leave = hidden * layout.weight_bytes, hidden * layout.activation_bytes
    # A recomputed block (full recomputation) communicates again, but only up to the last tensor its backward
    # needs: non-reentrant checkpointing stops there, so the collective that closes the MLP is not repeated.
    again = 2 if layout.recompute == "full" else 1

    def region(enter, leave, entering, leaving):
        """f then g (all-reduce backward, all-reduce forward), or under sp all-gather then reduce-scatter;
        entering and leaving: how many times the forward's collective runs."""
        if layout.sp:
            send("all_gather", enter, entering)
            send("reduce_scatter", leave, leaving)
            send("all_gather", leave, 1)
            send("reduce_scatter", enter, 1)
        else:
            send("all_reduce", leave, leaving)
            send("all_reduce", enter, 1)

    def send(kind, n_bytes, times):
        traffic[kind] += times * ring_bytes(kind, n_bytes, t)

    def summed_gradients(numel):  # under sp, norms and row biases sum their gradients over the group
        send("all_reduce", numel * layout.weight_bytes, 1)

    norm_numel = c.d_model * (2 if c.norm == "layer" and c.bias else 1)
    if first:  # the vocabulary-parallel embedding's g (its output keeps the weights' dtype)
        if layout.sp:  # reduce-scatter forward, all-gather backward
            send("reduce_scatter", enter, 1)
            send("all_gather", enter, 1)
        else:
            send("all_reduce", enter, 1)
        if layout.sp and c.position == "learned":
            summed_gradients(c.seq_len * c.d_model)
    for layer in layers:
        region(enter, leave, again, again)  # attention
        if c.is_moe(layer):
            moe_tp_traffic(c, layout, send, hidden, again)
        else:
            region(enter, leave, again, 1)  # MLP
        if layout.sp:
            summed_gradients(2 * norm_numel + c.bias * c.d_model * (1 if c.is_moe(layer) else 2))
    if last:
        if layout.sp:
            summed_gradients(norm_numel)
            send("all_gather", enter, 1)
            send("reduce_scatter", enter, 1)
        else:
            send("all_reduce", enter, 1)  # the head's f
        loss_bytes = tokens_per_rank(c, layout) * max(layout.activation_bytes, 4)  # float32 or wider
        send("all_reduce", loss_bytes, 1)      # the largest logit
        send("all_reduce", 2 * loss_bytes, 1)  # the target's logit and the sum of exponentials
    return traffic


def moe_tp_traffic(c, layout, send, hidden, again):
    """An MoE layer under tp: each expert (and the shared one) is a column/row pair over the rows it gets
    (f and g, with no sequence parallelism inside); under sp the router sees the whole sequence, gathered
    in forward, and its gradient is gathered back. A recomputation runs up to the experts' weighted outputs
    (the last tensors backward needs), not the shared expert's closing all-reduce, which comes after."""
    per_expert = hidden * c.top_k * layout.ep // c.n_experts  # balanced: from every ep rank, its share
    rows = [(per_expert, again)] * (c.n_experts // layout.ep) + ([(hidden, 1)] if c.n_shared_experts else [])
    for n, leaving in rows:
        send("all_reduce", n * layout.activation_bytes, leaving)
        send("all_reduce", n * layout.weight_bytes, 1)
    if layout.sp:  # GatherReplicatedSequence forward, SplitSequence backward
        send("all_gather", hidden * layout.weight_bytes, again)
        send("all_gather", hidden * layout.activation_bytes, 1)


def cp_traffic(config, layout, layers):
    """Ring attention's bytes per micro-batch: K and V go round the ring (N-1 passes) in forward and again
    in backward, where their gradient accumulators also travel N passes (each block home)."""
    n = layout.cp
    if n == 1:
        return Counter()
    c, a = config, layout.activation_bytes
    kv_elements = tokens_per_rank(c, layout) * c.kv_dim // layout.tp  # this rank's K (or V)
    accumulator = max(a, 4)  # dK, dV accumulate in float32 or wider
    forward = (n - 1) * 2 * kv_elements * a
    backward = (n - 1) * 2 * kv_elements * a + n * 2 * kv_elements * accumulator
    forward_passes = 1 if layout.recompute == "none" else 2  # both modes run the ring again
    return Counter(send_recv=len(layers) * (forward_passes * forward + backward))


def ep_traffic(config, layout, layers):
    """The all-to-all's bytes per micro-batch: a token's assignments to experts on other ranks go out and
    come back, in forward and backward (balanced routing: (N-1)/N of them leave the rank)."""
    n, c = layout.ep, config
    if n == 1:
        return Counter()
    remote = tokens_per_rank(c, layout) * c.top_k * (n - 1) // n  # under sp too: the MoE sees the whole shard
    forwards = 2 if layout.recompute == "full" else 1
    moe_layers = sum(1 for layer in layers if c.is_moe(layer))
    # Out go the tokens (weights' dtype), back come the experts' outputs (activations'); backward the reverse.
    row = c.d_model * (layout.weight_bytes + layout.activation_bytes)
    return Counter(all_to_all=moe_layers * (forwards + 1) * remote * row)


def pp_traffic(config, layout, stage):
    """Point-to-point bytes per step: an activation forward and a gradient backward per micro-batch and
    chunk boundary (the article's b*s*h; a sequence-parallel shard under sp), in the weights' dtype."""
    if layout.pp == 1:
        return Counter()
    seq = config.seq_len // layout.cp // (layout.tp if layout.sp else 1)
    message = layout.micro_batch * seq * config.d_model * layout.weight_bytes
    n_model_chunks = layout.pp * layout.virtual_stages
    chunks = [c * layout.pp + stage for c in range(layout.virtual_stages)]
    boundaries = sum(k < n_model_chunks - 1 for k in chunks) + sum(k > 0 for k in chunks)
    return Counter(send_recv=layout.micro_batches * boundaries * message)


# ---------------------------------------------------------------------------
# Activations saved for backward (what meter.ActivationMeter counts), per micro-batch
# ---------------------------------------------------------------------------

def block_activations(c, layout, layer):
    """Bytes one block saves for backward in one micro-batch's forward, term by term (Korthikanti et al.,
    2022, section 4, count Megatron's block the same way: b*s*h units, sharded by t where tp splits them)."""
    t, a, w = layout.tp, layout.activation_bytes, layout.weight_bytes
    tokens = tokens_per_rank(c, layout)
    sharded = tokens // t if layout.sp else tokens  # the residual stream: a sequence shard under sp
    h, head_dim, wide = c.d_model, c.d_model // c.n_head, max(a, 4)
    # A norm keeps its input and its statistics (LayerNorm: mean and 1/std; RMSNorm: 1/rms and x/rms).
    norm = sharded * (h * w + 2 * w if c.norm == "layer" else 2 * h * w + w)
    attention = (tokens * h * a                            # qkv's input (gathered under sp)
                 + tokens * (h + 2 * c.kv_dim) // t * a    # q | k | v, which the attention core keeps
                 + tokens * (h + c.n_head) // t * wide)    # the core's output and log-sum-exp per head
    if c.position == "rope":  # rotated q and k, and the cos and sin tables of q's and k's rotations
        attention += tokens * (h + c.kv_dim) // t * a + 2 * (c.seq_len // layout.cp) * head_dim * wide
    if not c.bias:  # a linear without bias keeps its own contiguous copy of the heads' outputs
        attention += tokens * h // t * a
    mlp = moe_activations(c, layout, tokens) if c.is_moe(layer) else tokens * h * a + mlp_activations(c, tokens, t, a)
    return 2 * norm + attention + mlp


def mlp_activations(c, rows, t, a, d_ff=None):
    """fc's output and the activation's (GELU: both; SwiGLU: gate | up, silu(gate) and their product)."""
    return rows * (d_ff or c.d_ff) // t * a * (4 if c.mlp == "swiglu" else 2)


def moe_activations(c, layout, tokens):
    """A balanced MoE layer: the router's probabilities and choices per token, then per (token, expert)
    assignment the expert's input, its MLP and its weighted output; the shared expert on every token."""
    t, a, wide = layout.tp, layout.activation_bytes, max(layout.activation_bytes, 4)
    h, assignments = c.d_model, tokens * c.top_k  # balanced: as many arrive at this rank's experts
    router = tokens * h * a + tokens * (2 * c.n_experts * wide + c.top_k * (INT64 + wide))
    experts = assignments * (2 * h * a + wide + INT64) + mlp_activations(c, assignments, t, a)
    shared = 0
    if c.n_shared_experts:
        shared = mlp_activations(c, tokens, t, a, c.n_shared_experts * c.d_ff)
    return router + experts + shared


def recomputed_block(c, layout, layer):
    """(what a block keeps from forward until its backward, what its backward's recomputation holds)."""
    full = block_activations(c, layout, layer)
    tokens = tokens_per_rank(c, layout)
    if layout.recompute == "full":  # only the block's input, the residual stream
        kept = (tokens // layout.tp if layout.sp else tokens) * c.d_model * layout.weight_bytes
        return kept, full
    if layout.recompute == "selective":  # the core's log-sum-exp goes; q, k, v and the output stay
        lse = tokens * c.n_head // layout.tp * max(layout.activation_bytes, 4)
        return full - lse, lse
    return full, 0


def edge_activations(c, layout, first, last):
    """The embedding's (token ids, positions) and the head's (final norm, head input, the softmax)."""
    t, a, w, tokens = layout.tp, layout.activation_bytes, layout.weight_bytes, tokens_per_rank(c, layout)
    total = 0
    if first:
        total += tokens * INT64 * (2 if t > 1 else 1) + tokens * BOOL * (t > 1)  # ids (and tp's local ids, mask)
        if c.position == "learned":
            total += (c.seq_len // layout.cp // (t if layout.sp else 1)) * INT64
    if last:
        sharded = tokens // t if layout.sp else tokens
        norm = sharded * (c.d_model * w + 2 * w if c.norm == "layer" else 2 * c.d_model * w + w)
        softmax = tokens * c.vocab_size // t * max(a, 4) + (tokens * (INT64 + BOOL) if t > 1 else 0)
        total += norm + tokens * c.d_model * a + softmax
    return total


def chunk_activations(c, layout, model_chunk):
    """(kept until backward, the most held by one recomputation) of one model chunk and micro-batch."""
    layers = pp.split_layers(c.n_layer, layout.pp * layout.virtual_stages)[model_chunk]
    blocks = [recomputed_block(c, layout, layer) for layer in layers]
    first, last = model_chunk == 0, model_chunk == layout.pp * layout.virtual_stages - 1
    return sum(kept for kept, _ in blocks) + edge_activations(c, layout, first, last), max(r for _, r in blocks)


def activation_peak(c, layout, stage):
    """(peak, recomputation): the most bytes kept for backward at once, over the micro-batches in flight
    (pp.py's schedule; one at a time without pipelining) times their chunk's activations; and what one
    block's recomputation holds on top of that during backward (which the meter, counting what forwards
    keep, does not see)."""
    n_chunks = layout.virtual_stages
    sizes = {chunk: chunk_activations(c, layout, chunk * layout.pp + stage) for chunk in range(n_chunks)}
    if layout.pp == 1:
        actions = [(kind, 0, m) for m in range(layout.micro_batches) for kind in ("forward", "backward")]
    else:
        actions = pp.make_schedule(layout.schedule, layout.micro_batches, layout.pp, stage, n_chunks)
    live = peak = 0
    for kind, chunk, _ in actions:
        live += sizes[chunk][0] if kind == "forward" else -sizes[chunk][0]
        peak = max(peak, live)
    return peak, max(recomputed for _, recomputed in sizes.values())


# ---------------------------------------------------------------------------
# The prediction: every rank's figures, under log.jsonl's names
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Role:
    """What makes ranks differ: the pipeline stage, and (ZeRO) the place in each data-parallel group."""
    stage: int
    dense_index: int
    expert_index: int


def group_index(layout, group, rank):
    """The rank's position in its mesh.py group `group` ('dense' or 'expert')."""
    where = coordinates(mesh_of(layout), rank)
    index = 0
    for dim in DIMS:  # row-major over the group's dimensions, as mesh.group_ranks orders them
        if dim in GROUPS[group]:
            index = index * getattr(layout, dim) + where[dim]
    return index


def mesh_of(layout):
    return train.mesh_shape(layout.world, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep)


def role_of(layout, rank):
    # ZeRO's shards differ by position in the group; without ZeRO every position holds the same.
    indices = ((group_index(layout, "dense", rank), group_index(layout, "expert", rank)) if layout.zero
               else (0, 0))
    return Role(coordinates(mesh_of(layout), rank)["pp"], *indices)


def predict_role(config, layout, role):
    """{'param_bytes': n, ..., 'traffic': {group name: Counter of bytes by kind}} for one role."""
    dense, expert = rank_parameters(config, layout, role.stage)
    param, grad, optim, dense_traffic = state_memory(dense, layout.dense_group, role.dense_index, layout, False,
                                                     config)
    e_param, e_grad, e_optim, expert_traffic = state_memory(expert, layout.expert_group, role.expert_index,
                                                            layout, True, config)
    chunks = [c * layout.pp + role.stage for c in range(layout.virtual_stages)]
    split = pp.split_layers(config.n_layer, layout.pp * layout.virtual_stages)
    layers = [layer for chunk in chunks for layer in split[chunk]]
    first, last = 0 in chunks, layout.pp * layout.virtual_stages - 1 in chunks
    per_micro_batch = {"tp": tp_traffic(config, layout, layers, first, last),
                       "cp": cp_traffic(config, layout, layers), "ep": ep_traffic(config, layout, layers)}
    traffic = {"dense": dense_traffic, "expert": expert_traffic, "pp": pp_traffic(config, layout, role.stage),
               **{dim: Counter({k: v * layout.micro_batches for k, v in c.items()})
                  for dim, c in per_micro_batch.items()}}
    activations, recomputation = activation_peak(config, layout, role.stage)
    return dict(param_bytes=param + e_param, grad_bytes=grad + e_grad, optim_bytes=optim + e_optim,
                activation_peak_bytes=activations, recompute_bytes=recomputation, traffic=traffic)


def log_fields(role_prediction):
    """The role's figures under log.jsonl's names (dp: the dense and the expert averaging together)."""
    fields = {k: v for k, v in role_prediction.items() if k != "traffic"}
    traffic = role_prediction["traffic"]
    by_dim = {"dp": traffic["dense"] + traffic["expert"], **{d: traffic[d] for d in ("tp", "pp", "cp", "ep")}}
    for dim, kinds in train.COMM_KINDS.items():
        for kind in kinds:
            fields[f"comm_{dim}_{kind}_bytes"] = by_dim[dim].get(kind, 0)
    return fields


def predict(args, world):
    """{field: [value of rank 0, rank 1, ...]} for the run train.py would make of args on `world` ranks."""
    layout = layout_of(args, world)
    config = train.model_config(args, train.data_vocab_size(args))
    roles = [role_of(layout, rank) for rank in range(world)]
    by_role = {role: log_fields(predict_role(config, layout, role)) for role in set(roles)}
    return {field: [by_role[role][field] for role in roles] for field in next(iter(by_role.values()))}
