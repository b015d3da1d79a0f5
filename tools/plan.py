"""Predict what a run of train.py would hold and send, per rank, without running it.

    python -m tools.plan --world 8 --tp 2 --pp 2 --ep 2 --experts 8 --micro-batches 4
    python -m tools.plan --model llama3-405b --arch llama --world 16384 --tp 8 --pp 16 --zero 1 ...
    python -m tools.plan --model llama3-8b --arch llama --world 64 --memory 80GiB --search

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
  E/ep experts per rank, each split over expert-tp as tp.py splits an MLP),
  and so are the buckets data parallelism and ZeRO pack them into (padded to
  a multiple of the group, as dp.py pads them).
- Experts are folded over each pipeline stage's dp x cp x tp ranks
  (mesh.py): ep and expert-tp do not multiply the world, the world is
  dp x pp x cp x tp and dp is also the number of data ranks. The MoE layers
  read a stage's ranks as expert_dp x ep x expert_tp: expert gradients are
  averaged (and ZeRO shards them) over the expert_dp ranks holding the same
  expert shard, dense gradients over dp x cp. Every rank of a stage routes
  tokens of its own (under tp without sp its 1/tp of the tokens the tp
  ranks share), and the rows ep.py moves (dispatch and combine over ep,
  the token split over tp, expert-tp's gather and reduce-scatter) are all
  logged as ep's all-to-all.
- Memory per parameter follows the article's accounting (params, grads,
  AdamW's two moments; ZeRO-1/2/3 divide them by the data-parallel size),
  in the dtypes of train.Precision: under bfloat16, 18 bytes a parameter
  without ZeRO (2 for the bf16 weights, 4 for their float32 master copy,
  4 for the float32 gradient buckets, 8 for the moments): the article's 16
  with float32 gradients, as Megatron-LM's main_grad keeps them.
- ZeRO's collectives per step (dp.py): ZeRO-2 and 3 reduce-scatter in every
  backward without a pipeline (M times for M micro-batches; ZeRO-3 gathers
  each unit before its forward and before its backward, 2M times), but once
  under one (--pp > 1: the pipeline defers the reduction to each chunk's last
  backward, and ZeRO-3 keeps a unit gathered from its first forward to it,
  one all-gather). Under a pipeline a stage therefore holds its full
  gradient buckets (ZeRO-2 and 3) and full weights (ZeRO-3) through the
  step's backwards, which the step's peak counts.
- Hybrid sharding (--dp-shard N): ZeRO shards over N of the dp ranks (with
  cp for the dense parameters, as without it; the experts over their
  expert_dp ranks of one copy) and the dp/N groups hold copies; each reduction
  of a shard group is followed by an all-reduce of the shard over the copies
  ("dense_replicas", "expert_replicas" in the traffic, logged under dp, which
  `--search` counts across nodes when the copies are on other nodes).
- Muon (--optimizer muon, training/muon.py): for each optimizer (ZeRO's
  dense, tied and expert instances, or the one without ZeRO) the planner
  lays out every rank's pieces as the optimizer holds them (the buckets and
  shards above, tp's and expert-tp's bands, each expert under its ep rank's
  name, each copy numbered as train.with_muon numbers it) and hands them to
  muon.held_segments, muon.assign_owners and muon.bytes_sent, the functions
  the run itself calls: the owners, and each rank's bytes in the two
  all-to-alls over its stage ("optim", in the weights' dtype), are the
  run's. The matrices' pieces keep one momentum where AdamW keeps two
  moments; the step's working set (the look-ahead U, the all-to-alls'
  buffers, the matrices an owner assembles and their orthogonalised
  copies, Newton-Schulz's temporaries) counts in the step's peak, which
  stands for its stage at the rank holding most.
- Traffic counts what each collective sends as a ring algorithm does, as
  the runs count it: an all-reduce of n bytes over N ranks sends 2(N-1)/N n,
  a reduce-scatter or an all-gather (N-1)/N n; point-to-point and
  all-to-all what leaves the rank.
- Activations are the tensors autograd saves for backward, modelled per
  token and layer from what model.py's operators save (Korthikanti et al.,
  2022, count them the same way for Megatron's block), per attention kind
  (attention_of: CausalSelfAttention's grouped heads, DeepSeek's latent
  attention) on the kernels of `--device` (cpu, as the tests run; cuda:
  one device's latent attention on the memory-efficient kernel, not the
  CPU's composite). Mixture-of-experts traffic and activations assume
  balanced routing (each expert gets its fair share of every rank's tokens).

- Peak resident memory (`predict_peaks`, the last line of the table, and
  `--json`'s `*_peak_bytes`): of start-up, of a step, of a checkpoint's save
  and of its load, as a process on the CPU holds them: the state above,
  plus what each phase holds for a while (ZeRO-3's units gathered, the
  gradient norm's float64 squares, a checkpoint's pieces copied aside to be written, the
  chunks initial values are drawn and checkpoints read in) and the
  interpreter and PyTorch themselves (PROCESS_BYTES). On a GPU the
  interpreter stays on the host and so does a save's copy.

`--search` lists the layouts of `--world` ranks whose every GPU's peak
fits `--memory`, with their traffic inside a node and across nodes
(`--gpus-per-node`, ranks laid out as mesh.py lays them: tp fastest, then
cp, pp, dp, dp read as (copies, shards) under hybrid sharding; the experts'
groups folded over each stage's ranks, expert-tp fastest, then ep; an
all-to-all sending each peer as much, ep's, split by where the peers are;
the stage sending most across standing for the layout), hybrid
ones among them (ZeRO's shard group no larger than a node). With experts it
tries every ep dividing both the experts and a stage's ranks, with experts
whole (expert-tp 1) or split as tp splits the dense layers (expert-tp = tp).
Under Muon it plans each candidate's assembly as above, save those that
cannot fit whatever it holds and those whose stages hold too many pieces to
assign here (MUON_SEARCH_PIECES), which it counts.
"""
import argparse
import bisect
import functools
import itertools
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, fields, replace
from typing import Callable, NamedTuple

import torch

from training import cli, muon
import pp
import train
from dp import ring_bytes_sent
from ep import is_expert_parameter
from mesh import DIMS, EXPERT_AXES, MeshShape
from model import GPT, INIT_CHUNK, GPTConfig

INT64, BOOL = 8, 1  # bytes of the index and mask tensors some operators save


# ---------------------------------------------------------------------------
# The layout: train.py's flags, reduced to what sizes and traffic depend on
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    world: int
    dp: int
    dp_shard: int          # the dp ranks ZeRO's shards span (mesh.py's dp_shard; dp without hybrid sharding)
    tp: int
    pp: int
    cp: int
    ep: int                # folded over each stage's dp x cp x tp ranks, as expert_tp (mesh.py): no world factors
    expert_tp: int
    zero: int
    sp: bool
    cp_mode: str
    schedule: str
    virtual_stages: int
    micro_batches: int
    batch_size: int        # global, in sequences
    recompute: str
    dtype: str             # train.Precision's weights (so activations and messages), master and reduce dtypes
    master_dtype: str
    reduce_dtype: str
    bucket_bytes: int
    documents: bool = False  # packed documents (--document-mask): attention masked, positions per sequence
    optimizer: str = "adamw"  # --optimizer: "muon" steps the blocks' matrices with Muon (training/muon.py)
    muon_gather: bool = False  # --muon-assembly gather: every holder of a matrix assembles it, not one owner
    device: str = "cpu"  # the kernels activations are modelled on: "cpu" (as tests run) or "cuda" (see latent_core)

    @property
    def placement(self):  # which pipeline rank holds which model chunk (pp.py)
        return placement_of(self.schedule, self.pp, self.virtual_stages)

    @property
    def dense_group(self):  # ranks averaging dense gradients (mesh.py's "dense")
        return self.dp * self.cp

    @property
    def stage(self):  # the ranks of a pipeline stage, which the MoE layers read as expert_dp x ep x expert_tp
        return self.dp * self.cp * self.tp

    @property
    def expert_group(self):  # ranks holding the same expert shard, averaging its gradients (mesh.py's "expert")
        return self.stage // (self.ep * self.expert_tp)

    @property
    def replicas(self):  # hybrid sharding: the copies of each ZeRO shard (mesh.py's "dp_replicate"); else 1
        return self.dp // self.dp_shard

    def shard_group(self, kind):
        """The ranks the buckets of `kind` ('dense', 'tied' or 'expert') are padded for and ZeRO shards them
        over: the averaging group, narrowed to one copy's ranks under hybrid sharding (mesh.py's "dense_shard":
        dp_shard x cp; "expert_shard": the expert group's ranks inside one copy, 1/replicas of them)."""
        return self.expert_group // self.replicas if kind == "expert" else self.dp_shard * self.cp

    @property
    def mesh_shape(self):
        return MeshShape(dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp, ep=self.ep, expert_tp=self.expert_tp,
                         dp_shard=self.dp_shard)

    @property
    def micro_batch(self):  # sequences a rank computes per micro-batch (dp: the data ranks)
        return self.batch_size // (self.micro_batches * self.dp)

    @property
    def weight_bytes(self):  # the weights, every activation and every message
        return cli.DTYPES[self.dtype].itemsize

    activation_bytes = weight_bytes  # (the same: activations are computed in the weights' dtype)

    @property
    def master_bytes(self):  # the optimizer's weights and moments, ZeRO's gradient shards
        return cli.DTYPES[self.master_dtype].itemsize

    @property
    def reduce_bytes(self):  # the gradient buckets, and their reduction
        return cli.DTYPES[self.reduce_dtype].itemsize


placement_of = functools.lru_cache(maxsize=None)(pp.Placement.of)  # (--search asks for the same ones often)


def layout_of(args, world, device="cpu", data=None):
    """The Layout train.py would build from these flags on `world` ranks (a cli.ConfigError if none), its
    activations modelled on `device`'s kernels ("cpu" or "cuda"); data: the data's DataInfo where it has been
    read."""
    described = data or cli.describe_data(args)  # the data's meta.json, read once for both
    _, shape = cli.check_args(args, world, described)
    return Layout(world=world, dp=shape.dp, dp_shard=shape.dp_shard or shape.dp, tp=shape.tp, pp=shape.pp,
                  cp=shape.cp, ep=shape.ep, expert_tp=shape.expert_tp, zero=args.zero,
                  sp=args.sp, cp_mode=args.cp_mode, schedule=args.schedule, virtual_stages=args.virtual_stages,
                  micro_batches=args.micro_batches, batch_size=args.batch_size, recompute=args.recompute,
                  dtype=args.dtype, master_dtype=args.master_dtype, reduce_dtype=args.reduce_dtype,
                  bucket_bytes=int(args.bucket_mb * 2**20),
                  documents=cli.document_eos(args, data=described) is not None,
                  optimizer=args.optimizer, muon_gather=args.muon_assembly == "gather", device=device)


# ---------------------------------------------------------------------------
# Parameters: which ones a rank holds, and how large its share is
# ---------------------------------------------------------------------------

def config_key(config):
    """A model config as a hashable key (for the caches below; its fields are numbers, strings and tuples)."""
    return tuple((field.name, getattr(config, field.name)) for field in fields(config))


@functools.lru_cache(maxsize=None)
def model_parameters(config_fields):
    """[(name, shape)] of model.py's GPT in its parameter order, from a model built without memory."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**dict(config_fields)))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


# Parameters tensor parallelism leaves whole on every rank: norms, the position table, routers, a shared expert's
# gate, and latent attention's down-projections (tp.split_latent_attention treats them as norms).
REPLICATED = ("norm", "pos_emb", "router", "shared_gate", "attn.q_down.", "attn.kv_down.")


def tp_sharded(name):
    """Whether tensor parallelism splits this parameter N ways (tp.py): the column-parallel q|k|v (latent
    attention's q_up and kv_up), fc (and their biases), the row-parallel proj weights, the vocabulary-parallel
    embedding and head. REPLICATED's and row-parallel biases are not."""
    if name.endswith(("qkv.bias", "fc.bias")):
        return True
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
        parts = (expert_tp if expert else tp) if tp_sharded(name) else 1
        numel = math.prod(shape) // parts
        if config.tie_embeddings and placement.ends_apart() and name == "tok_emb.weight":  # one on each end
            held[stage_of(name, stages, placement)][2].append((name, numel))
            held[stage_of("lm_head.weight", stages, placement)][2].append(("lm_head.weight", numel))
            continue
        dense, expert_params, _ = held[stage_of(name, stages, placement)]
        (expert_params if expert else dense).append((name, numel))
    return [tuple(map(tuple, stage)) for stage in held]  # (hashable: the caches below take them)


# ---------------------------------------------------------------------------
# Buckets (dp.py): gradients in backward order, about bucket_bytes each, padded to a multiple of the group
# ---------------------------------------------------------------------------

@dataclass
class Bucket:
    sizes: list   # elements of each parameter, in bucket order
    padded: int   # elements, a multiple of the group's size

    def __post_init__(self):
        self.offsets = [0, *itertools.accumulate(self.sizes)]  # where each parameter begins, and the end

    def pieces(self, rank, n_ranks):
        """How many parameters overlap ZeRO rank `rank`'s shard [r S, (r+1) S) of this bucket."""
        shard = self.padded // n_ranks
        lo, hi = rank * shard, (rank + 1) * shard
        first = bisect.bisect_right(self.offsets, lo) - 1  # the parameter in which the shard begins
        last = bisect.bisect_left(self.offsets, hi)        # one past the parameter in which it ends
        return sum(1 for i in range(max(first, 0), min(last, len(self.sizes)))
                   if min(self.offsets[i + 1], hi) > max(self.offsets[i], lo))


def padded(numel, n_ranks):
    return math.ceil(numel / n_ranks) * n_ranks


@functools.lru_cache(maxsize=4096)
def make_buckets(sizes, bucket_bytes, itemsize, n_ranks):
    """As dp.make_buckets: in backward (reverse) order, a new bucket once one holds bucket_bytes or more.
    (sizes: a tuple; the buckets are shared by every call alike: read only.)"""
    buckets, current = [], []
    for size in reversed(sizes):
        if current and sum(current) * itemsize >= bucket_bytes:
            buckets.append(current)
            current = []
        current.append(size)
    if current:
        buckets.append(current)
    return tuple(Bucket(b, padded(sum(b), n_ranks)) for b in buckets)


def unit_of(name):
    """The ZeRO-3 unit (dp.gpt_units) a parameter belongs to: 'blocks.3', or 'tok_emb', 'norm', ..."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


@functools.lru_cache(maxsize=4096)
def zero3_buckets(params, n_ranks):
    """ZeRO-3's buckets are its units (embeddings, each block, final norm, head), in reverse. (params: a tuple
    of (name, elements); the buckets are shared: read only.)"""
    units = {}
    for name, numel in params:
        units.setdefault(unit_of(name), []).append(numel)
    return tuple(Bucket(sizes, padded(sum(sizes), n_ranks)) for sizes in reversed(list(units.values())))


# ---------------------------------------------------------------------------
# Memory of parameters, gradients, optimizer state (article: 16 Psi; ZeRO's 4+12/N, 2+14/N, 16/N)
# ---------------------------------------------------------------------------

ADAM_STEP_BYTES = 4  # fused AdamW keeps each parameter's (or piece's) step count as a float32 scalar


class State(NamedTuple):
    """What one set of parameters (dense, experts, a tied output layer) costs a rank: bytes of weights,
    gradients and optimizer state as logged after a step; traffic per step by kind in its (shard) group, and
    across its copies under hybrid sharding (`replica_traffic`); steps(i), the AdamW step counters the i-th
    rank of its shard group keeps (ZeRO: one per parameter piece in its shard)."""
    param: int
    grad: int
    optim: int
    traffic: Counter
    replica_traffic: Counter
    steps: Callable[[int], int]


def state_memory(params, group, layout, unused_check, replicas=1):
    """The State of one set of parameters, `group` ranks padding its buckets and sharing them (ZeRO's shard
    group: the averaging group, or its part under hybrid sharding, `replicas` such groups holding copies).
    The master weights count as parameters: the weights themselves where the dtypes agree, else a second
    copy (of the whole parameters, or ZeRO's shard of them). (params: a tuple; the State is shared: read only.)"""
    # (what leaves the state alike is left out of the cache's key: --search asks for each recomputation)
    same = replace(layout, recompute="none", sp=False, cp_mode="ring", documents=False)
    return layout_state(params, group, same, unused_check, replicas)


@functools.lru_cache(maxsize=2**12)
def layout_state(params, group, layout, unused_check, replicas):
    """state_memory, computed; its steps(index) remembered (a sum over every bucket, which --search asks often)."""
    w, m, r, sizes = layout.weight_bytes, layout.master_bytes, layout.reduce_bytes, [numel for _, numel in params]
    if not sizes:
        return State(0, 0, 0, Counter(), Counter(), lambda index: 0)
    master_copy = m if m != w else 0
    traffic, replica_traffic = Counter(), Counter()
    if not layout.zero:  # dp.DataParallel (on one data rank too): one all-reduce of each bucket per step
        buckets = make_buckets(tuple(sizes), layout.bucket_bytes, r, group)
        traffic["all_reduce"] = sum(ring_bytes_sent("all_reduce", b.padded * r, group) for b in buckets)
        if unused_check:  # the used-mask, one byte per parameter
            traffic["all_reduce"] += ring_bytes_sent("all_reduce", len(sizes), group)
        grads = sum(b.padded for b in buckets) * r
        return State(sum(sizes) * (w + master_copy), grads, 2 * sum(sizes) * m, traffic, replica_traffic,
                     lambda index: len(sizes))
    buckets = zero_buckets(params, group, layout)
    full = sum(b.padded for b in buckets)
    shard = full // group
    param = shard * m if layout.zero == 3 else full * w + shard * master_copy  # ZeRO-3: its master shard alone
    grad = shard * m + (full * r if layout.zero == 1 else 0)  # ZeRO-1 keeps the full gradient as well
    reductions, gathers = zero_collectives(layout)
    one_pass = {kind: sum(ring_bytes_sent(kind, b.padded * itemsize, group) for b in buckets)  # (N-1)/N of each
                for kind, itemsize in (("reduce_scatter", r), ("all_gather", w))}
    traffic["reduce_scatter"] = reductions * one_pass["reduce_scatter"]
    traffic["all_gather"] = gathers * one_pass["all_gather"]
    traffic["all_reduce"] = ring_bytes_sent("all_reduce", 8, group)  # the gradient norm's sum of squares, float64
    if unused_check:
        traffic["all_reduce"] += ring_bytes_sent("all_reduce", len(sizes), group)
    if replicas > 1:  # each reduction's shards (reduce dtype) summed over the copies, and the used-mask too
        replica_traffic["all_reduce"] = reductions * sum(
            ring_bytes_sent("all_reduce", b.padded // group * r, replicas) for b in buckets)
        if unused_check:
            replica_traffic["all_reduce"] += ring_bytes_sent("all_reduce", len(sizes), replicas)
    return State(param, grad, 2 * shard * m, traffic, replica_traffic,
                 functools.lru_cache(maxsize=None)(lambda index: sum(b.pieces(index, group) for b in buckets)))


def zero_buckets(params, group, layout):
    """ZeRO's buckets of these parameters: its units under ZeRO-3, else about bucket_bytes each."""
    if layout.zero == 3:
        return zero3_buckets(params, group)
    return make_buckets(tuple(numel for _, numel in params), layout.bucket_bytes, layout.reduce_bytes, group)


def zero_collectives(layout):
    """(reductions, gathers) of each ZeRO bucket per step. ZeRO-1 reduces once, after the last backward, and
    gathers once, after the optimizer's step. ZeRO-2 and 3 reduce in every backward (M of them) without a
    pipeline; under one, the pipeline's no_sync defers the reduction to each chunk's last backward: once.
    ZeRO-3 gathers a unit before its forward and again before its backward (2M) without a pipeline; under
    one it keeps the unit gathered from its first forward to that reduction (reshard_after_forward False):
    once."""
    if layout.zero == 1:
        return 1, 1
    pipelined = layout.pp > 1
    reductions = 1 if pipelined else layout.micro_batches
    gathers = (1 if pipelined else 2 * layout.micro_batches) if layout.zero == 3 else 1
    return reductions, gathers


# ---------------------------------------------------------------------------
# Muon (--optimizer muon): each optimizer's pieces as training/muon.py's Segments, assembled by its functions
# ---------------------------------------------------------------------------

def stage_rank(layout, stage, place):
    """The grid coordinates of the rank at `place` in a pipeline stage's group (mesh.py's "stage": its
    dp x cp x tp ranks, row-major)."""
    dp, rest = divmod(place, layout.cp * layout.tp)
    return {"dp": dp, "pp": stage, "cp": rest // layout.tp, "tp": rest % layout.tp}


def stage_place(layout, where):
    """The place of the rank at `where` in its stage's group (stage_rank's inverse)."""
    return (where["dp"] * layout.cp + where["cp"]) * layout.tp + where["tp"]


def tp_split_dim(name):
    """The dimension tensor parallelism cuts a tp_sharded parameter along (tp.py's layouts): a row-parallel
    proj's columns, every other's rows (column-parallel layers, the vocabulary of the embedding and head)."""
    return 1 if name.endswith("proj.weight") else 0


def tp_split(name, layout, where):
    """Tensor parallelism's (dim, parts, part) of a parameter on the rank at `where`, as train.with_muon's
    split_of gives it to training/muon.py, or None if it is whole there: a routed expert's over expert-tp."""
    if not tp_sharded(name):
        return None
    if is_expert_parameter(name):
        return tp_split_dim(name), layout.expert_tp, expert_coordinates(layout, where)["expert_tp"]
    return tp_split_dim(name), layout.tp, where["tp"]


def local_shape(name, shape, layout):
    """A parameter's shape on a rank: its full shape, cut by tensor parallelism (a routed expert's by
    expert-tp)."""
    if not tp_sharded(name):
        return shape
    parts = layout.expert_tp if is_expert_parameter(name) else layout.tp
    return tuple(n // parts if dim == tp_split_dim(name) else n for dim, n in enumerate(shape))


def rank_name(name, config, layout, where):
    """A parameter of rank_parameters (which lists the first ep rank's experts) as the rank at `where` names
    it: ep.py keeps a routed expert under its index in the layer, ep rank k holding [k E/ep, (k+1) E/ep)."""
    if not is_expert_parameter(name):
        return name
    parts = name.split(".")
    parts[4] = str(int(parts[4]) + expert_coordinates(layout, where)["ep"] * (config.n_experts // layout.ep))
    return ".".join(parts)


def optimizer_sets(config, layout, stage):
    """[(kind, [(name, elements)])]: the parameters of each optimizer of a rank of this stage, in
    train.data_parallel's order. Under ZeRO an instance each for the dense parameters, a tied output layer and
    the experts (each padded and sharded over its own group); without it one over every parameter ("all"),
    in the model's order."""
    dense, expert, tied = rank_parameters(config, layout, stage)
    if layout.zero:
        return [(kind, params) for kind, params in (("dense", dense), ("tied", tied), ("expert", expert)) if params]
    order = {name: i for i, (name, _) in enumerate(model_parameters(config_key(config)))}
    return [("all", sorted(dense + expert + tied, key=lambda param: order.get(param[0], len(order))))]


def named_buckets(params, group, layout):
    """[(Bucket, names of its parameters in its order)] of zero_buckets: ZeRO-3's units last first, each in
    forward order; else the parameters in backward (reverse) order, cut as make_buckets cuts them."""
    buckets = zero_buckets(params, group, layout)
    if layout.zero == 3:
        units = {}
        for name, _ in params:
            units.setdefault(unit_of(name), []).append(name)
        return list(zip(buckets, reversed(units.values())))
    names = iter([name for name, _ in reversed(params)])
    return [(bucket, [next(names) for _ in bucket.sizes]) for bucket in buckets]


def optimizer_pieces(params, layout, kind, where):
    """[(name, start, end)]: the pieces (elements [start, end) of a flattened parameter) the optimizer of
    `params` steps on the rank at `where`, in its order: every parameter whole without ZeRO
    (ReplicatedOptimizer.pieces); with it, bucket by bucket, each parameter's overlap with the rank's shard
    (dp.pieces_of_shards)."""
    if not layout.zero:
        return [(name, 0, numel) for name, numel in params]
    group = layout.shard_group(kind)
    index = group_index(layout, "expert" if kind == "expert" else "dense", where)
    pieces = []
    for bucket, names in named_buckets(params, group, layout):
        lo, hi = index * bucket.padded // group, (index + 1) * bucket.padded // group
        for name, offset, size in zip(names, bucket.offsets, bucket.sizes):
            if min(offset + size, hi) > max(offset, lo):
                pieces.append((name, max(offset, lo) - offset, min(offset + size, hi) - offset))
    return pieces


def muon_copy(name, layout, where):
    """Which copy of a matrix the rank at `where` holds a piece of, as train.with_muon's copy_of numbers them:
    under ZeRO its replica under hybrid sharding (else 0, the shard group holding the only copy); without
    ZeRO its data-parallel replica, its place in the dense group (dp x cp) or, for an expert, in the expert
    group."""
    if layout.zero:
        return where["dp"] // layout.dp_shard
    if is_expert_parameter(name):
        return stage_place(layout, where) // (layout.ep * layout.expert_tp)
    return where["dp"] * layout.cp + where["cp"]


def muon_held(config, layout, stage):
    """[{place: [Segment]}]: what each optimizer of the stage's ranks gives training/muon.py's Assembly (its
    `held`), every rank by its place in the stage's group, the optimizers in train.with_muon's order:
    muon.held_segments of the rank's pieces (optimizer_pieces), each parameter named, shaped and split as
    that rank holds it."""
    shapes = {name: local_shape(name, shape, layout) for name, shape in model_parameters(config_key(config))}
    shapes.setdefault("lm_head.weight", shapes["tok_emb.weight"])  # a tied output layer's copy on the last stage
    instances = []
    for kind, params in optimizer_sets(config, layout, stage):
        held = {}
        for place in range(layout.stage):
            where = stage_rank(layout, stage, place)
            pieces = [(rank_name(name, config, layout, where), start, end, None)
                      for name, start, end in optimizer_pieces(params, layout, kind, where)]
            found = muon.held_segments(pieces, shapes, config, functools.partial(tp_split, layout=layout, where=where),
                                       functools.partial(muon_copy, layout=layout, where=where))
            held[place] = [s for _, segments in found for s in segments]
        instances.append(held)
    return instances


class MuonRank(NamedTuple):
    """What Muon costs one rank: bytes its two all-to-alls send a step (all its optimizers'); the elements of
    its pieces Muon steps, by kind ("dense", "expert": a tied output layer holds no matrix), each keeping one
    momentum where AdamW keeps two moments; the most its step holds beyond its state (muon_working)."""
    sent: int
    elements: Counter
    working: int


def muon_ranks(config, layout, stage):
    """[MuonRank] of each rank of a pipeline stage, by its place in the stage's group, or None under AdamW.
    (The layout is read without what leaves every optimizer's pieces alike: ZeRO-1's and 2's are the same.)"""
    if layout.optimizer != "muon":
        return None
    same = replace(layout, zero={2: 1}.get(layout.zero, layout.zero), sp=False, recompute="none", micro_batches=1)
    return muon_stage(config_key(config), same, stage)


@functools.lru_cache(maxsize=256)
def muon_stage(config_fields, layout, stage):
    """muon_ranks, computed (shared: read only): each optimizer's Assembly as every rank builds it, its owners
    muon.assign_owners' and the bytes muon.bytes_sent's, the matrices' elements in the weights' dtype. Each
    optimizer steps in turn, so the working sets are the largest of them."""
    config = GPTConfig(**dict(config_fields))
    sent, elements, working = Counter(), [Counter() for _ in range(layout.stage)], [0] * layout.stage
    for held in muon_held(config, layout, stage):
        owners = muon.assign_owners(held, layout.muon_gather)
        sent.update(muon.bytes_sent(held, owners, layout.weight_bytes))
        travel, buffers = answers_travel(held, owners), muon_buffers(held, owners)
        for place, found in held.items():
            for s in found:
                elements[place]["expert" if is_expert_parameter(s.key) else "dense"] += s.numel
            if owners:  # (an optimizer whose ranks hold no matrix skips the exchange, Muon.step)
                working[place] = max(working[place], muon_working(buffers[place], layout, travel))
    return [MuonRank(sent[place], elements[place], working[place]) for place in range(layout.stage)]


def answers_travel(held, owners):
    """Whether some rank's pieces of O come from another rank (muon.Assembly's answers_travel): else, each
    holder assembling what it holds, the second all-to-all is left out and its send buffer is what comes
    back."""
    return any(muon.answerer(owners[s.copy, s.key], rank) != rank for rank, found in held.items() for s in found)


def muon_buffers(held, owners):
    """{place: Counter}: the elements of what one optimizer's Muon step fills on each rank (see muon_working):
    its pieces (E), its first all-to-all's send buffer (each piece once for each owner, itself included) and
    receive buffer, the matrices it assembles (A), the answers it sends back (its matrices' pieces each
    holder that assembles none asks of it), and Newton-Schulz's temporaries for the matrix that needs most."""
    buffers, assembled = {place: Counter() for place in held}, {place: {} for place in held}
    for rank, found in held.items():
        for s in found:
            ranks = owners[s.copy, s.key]
            buffers[rank]["pieces"] += s.numel
            buffers[rank]["sent"] += s.numel * len(ranks)
            buffers[muon.answerer(ranks, rank)]["answered"] += s.numel
            for owner in ranks:
                buffers[owner]["received"] += s.numel
                assembled[owner][s.copy, s.key] = s.shape
    for place, shapes in assembled.items():
        buffers[place]["assembled"] = sum(rows * cols for rows, cols in shapes.values())
        buffers[place]["newton_schulz"] = max(map(newton_schulz_temporaries, shapes.values()), default=0)
    return buffers


def newton_schulz_temporaries(shape):
    """The elements muon.newton_schulz holds at once for a matrix of `shape` beyond its result: at the
    quintic's sum X <- a X + (b A + c A^2) X the old X, a X, the product (b A + c A^2) X and the new X (four
    of the matrix's size, one of which becomes the result) and the Gram matrix A = X X^T of its wide
    orientation."""
    rows, cols = shape
    return 3 * rows * cols + min(rows, cols) ** 2


def muon_working(b, layout, travel):
    """The most bytes one Muon step holds on a rank beyond its state (training/muon.py's Muon.step and
    Assembly.orthogonalise), from its buffers' elements b (muon_buffers): its pieces' look-ahead U, one
    tensor each and their concatenation (2 E in the master's dtype), then, in the weights' dtype, the largest
    of four moments:
      1. the first all-to-all: its send buffer (the pieces, first cast when the dtypes differ) and receive
         buffer,
      2. the matrices it assembles, and their orthogonalised copies as Newton-Schulz makes them,
      3. the second all-to-all: the answers copied out and concatenated (2 each), and the pieces of O it
         receives (E) where answers travel (answers_travel: else its send buffer comes back),
      4. those and the update back in the master's dtype (E),
    the first receive buffer and the matrices being kept to the end. One rank alone receives its own send
    buffers."""
    w, m, alone = layout.weight_bytes, layout.master_bytes, layout.stage == 1
    received = b["sent"] if alone else b["received"]
    kept = received + 2 * b["assembled"]  # (from the second moment on)
    travelling = travel and not alone
    back = b["pieces"] if travelling else b["answered"]  # what the second exchange hands back
    moments = ((b["sent"] * (2 if m != w else 1) + (0 if alone else received)) * w,
               (received + b["assembled"] * 2 + b["newton_schulz"]) * w,
               (kept + 2 * b["answered"] + (back if travelling else 0)) * w,
               (kept + back) * w + b["pieces"] * m)
    return 2 * b["pieces"] * m + max(moments)


# ---------------------------------------------------------------------------
# Traffic of the model-parallel dimensions, per micro-batch (forward and backward)
# ---------------------------------------------------------------------------

def tokens_per_rank(config, layout):
    """Tokens of one micro-batch a rank computes on (its data slice, its cp shard of each sequence)."""
    return layout.micro_batch * config.seq_len // layout.cp


def routed_tokens(config, layout):
    """Tokens of one micro-batch a rank routes in an MoE layer (ep.py): no other rank routes them. Under tp
    with sp its sequence shard; under tp without sp its 1/tp of the tokens the tp ranks share (ep.py's
    split_counts: the first ranks one more when tp does not divide them; the planner assumes it does)."""
    return tokens_per_rank(config, layout) // layout.tp


def tp_traffic(config, layout, layers, first, last):
    """Tensor parallelism's bytes per micro-batch (Megatron: two all-reduces of b*s*h per block forward,
    two backward; sequence parallelism turns each into a reduce-scatter and an all-gather)."""
    t, c, traffic = layout.tp, config, Counter()
    if t == 1:
        return traffic
    hidden = tokens_per_rank(c, layout) * c.d_model  # b*s*h of this rank's cp shard (gathered under sp)
    # What enters a region is a norm's output, what leaves it a matrix product's partial sum, both in the
    # weights' dtype; backward sends the gradients of the same tensors, in the same dtype.
    enter = leave = hidden * layout.weight_bytes
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
        traffic[kind] += times * ring_bytes_sent(kind, n_bytes, t)

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
            summed_gradients(c.max_seq_len * c.d_model)  # the whole position table's
    entering_attention = tokens_per_rank(c, layout) * attention_of(c).entering(c) * layout.weight_bytes
    for layer in layers:
        region(entering_attention, leave, again, again)  # attention
        mlp = not c.is_moe(layer) or c.n_shared_experts  # a dense MLP, or the shared expert, split alike
        if mlp:  # recomputed up to the last tensor backward needs: with a gate, the output its product keeps
            region(enter, leave, again, again if c.is_moe(layer) and c.shared_expert_gate else 1)
        if c.is_moe(layer):  # tp.split_moe: every tp rank routed tokens of its own, so the router's gradient is summed
            send("all_reduce", c.n_experts * c.d_model * layout.weight_bytes, 1)
        for numel in attention_of(c).summed_over_tp(c, layout):  # replicated weights that met only some tokens
            summed_gradients(numel)
        if layout.sp:  # the norms, the row-parallel biases of attention and the MLP, a shared expert's gate
            gate = c.is_moe(layer) and c.shared_expert_gate
            summed_gradients(2 * norm_numel + c.bias * c.d_model * (2 if mlp else 1) + gate * c.d_model)
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


def cp_traffic(config, layout, layers):
    """Context parallelism's bytes per micro-batch (cp.py, each way's formula), with k, v and q the bytes of this
    rank's K, V and Q shards (V of its own width, c.v_dim: latent attention's values are narrower than its keys)
    and o of the heads' output (n_head x v_head_dim features):
      ring       K and V go round the ring (N-1 passes) in forward and again in backward, where their
                 gradient accumulators also travel N passes (each block home)
      allgather  K and V all-gathered in forward and again in backward, dK and dV reduce-scattered:
                 (N-1) (k + v) each
      alltoall   q, k, v to head shards and the output back, forward, and their gradients in backward:
                 (N-1)/N of each
    Recomputation runs the forward's part again. With packed documents the ring's figure is its most: a K/V
    block that no rank ahead needs in any row of the micro-batch goes no further, which depends on the data
    (cp.py's tests count the bytes saved exactly)."""
    n = layout.cp
    if n == 1:
        return Counter()
    c, a = config, layout.activation_bytes
    q, k, v, o = (tokens_per_rank(c, layout) * features // layout.tp * a
                  for features in (c.q_dim, c.kv_dim, c.v_dim, c.n_head * c.v_head_dim))
    forward_passes = 1 if layout.recompute == "none" else 2  # both modes run the attention again
    if layout.cp_mode == "allgather":
        return Counter(all_gather=len(layers) * (forward_passes + 1) * (n - 1) * (k + v),
                       reduce_scatter=len(layers) * (n - 1) * (k + v))
    if layout.cp_mode == "alltoall":
        # Selective recomputation reruns the core only up to what it saves (the attention's inputs and output,
        # on head shards): checkpoint's recomputation stops there, before the output goes back.
        recomputed = {"none": 0, "selective": q + k + v, "full": q + k + v + o}[layout.recompute]
        return Counter(all_to_all=len(layers) * (n - 1) * (2 * (q + k + v + o) + recomputed) // n)
    forward = (n - 1) * (k + v)
    backward = (n - 1) * (k + v) + n * (k + v)  # dK, dV travel in K's and V's dtype
    return Counter(send_recv=len(layers) * (forward_passes * forward + backward))


def moe_traffic(config, layout, layers):
    """The MoE layers' traffic per micro-batch (ep.py, balanced routing), by the group it travels in:
      ep              dispatch and combine: the routed tokens' assignments to experts of the other ep ranks,
                      (ep-1)/ep of them, go out and their outputs come back; backward the reverse
      tp_rows         tp without sp: each tp rank routes its 1/tp of the tokens they share (KeepRows: its
                      part's gradient to every other tp rank, backward) and all-gathers the outputs
                      (GatherRows, forward)
      expert_tp       expert tp: the rows a rank received go to every other rank of its group, and its
                      experts' partial outputs of their rows go back to them (SplitExperts); backward the
                      reverse of each
      expert_tp_bias  expert tp: each local expert's proj bias, whole on every rank, has its gradient summed
                      over the group once per backward (tp.ExpertTensorParallel; the GPT blocks' bias)
    All but the last are ep.py's all-to-alls, each row in the weights' dtype, which is the activations'.
    Full recomputation runs the forward's again up to the last tensor backward needs: the combined outputs
    (weighted), so GatherRows too only when a shared expert, whose tensors come after, is there."""
    c = config
    moe_layers = sum(1 for layer in layers if c.is_moe(layer))
    if not moe_layers:
        return {}
    forwards = 2 if layout.recompute == "full" else 1
    row = c.d_model * layout.activation_bytes
    routed = routed_tokens(c, layout)
    assignments = routed * c.top_k  # balanced: each rank also receives as many for its experts

    def rows(n_rows, passes):  # all-to-all bytes of every MoE layer, n_rows sent per pass
        return Counter(all_to_all=moe_layers * passes * n_rows * row)

    traffic = {"ep": rows(assignments * (layout.ep - 1) // layout.ep, 2 * (forwards + 1))}
    if layout.tp > 1 and not layout.sp:
        gathers = forwards if c.n_shared_experts else 1
        traffic["tp_rows"] = rows((layout.tp - 1) * routed, gathers + 1)
    if layout.expert_tp > 1:
        traffic["expert_tp"] = rows((layout.expert_tp - 1) * assignments, 2 * (forwards + 1))
        if c.bias:
            bias = ring_bytes_sent("all_reduce", c.d_model * layout.weight_bytes, layout.expert_tp)
            traffic["expert_tp_bias"] = Counter(all_reduce=moe_layers * c.n_experts // layout.ep * bias)
    return traffic


def pp_traffic(config, layout, stage):
    """Point-to-point bytes per step: an activation forward and a gradient backward per micro-batch and
    chunk boundary (the article's b*s*h; a sequence-parallel shard under sp), in the weights' dtype."""
    if layout.pp == 1:
        return Counter()
    seq = config.seq_len // layout.cp // (layout.tp if layout.sp else 1)
    message = layout.micro_batch * seq * config.d_model * layout.weight_bytes
    placement = layout.placement
    sent = [placement.holder(k + 1)[0] for k in placement.model_chunks(stage) if k < placement.n_model_chunks - 1]
    sent += [placement.holder(k - 1)[0] for k in placement.model_chunks(stage) if k > 0]
    boundaries = sum(destination != stage for destination in sent)  # (the turn of a V stays on its rank)
    return Counter(send_recv=layout.micro_batches * boundaries * message)


# ---------------------------------------------------------------------------
# Activations saved for backward (what meter.ActivationMeter counts), per micro-batch
# ---------------------------------------------------------------------------

def block_activations(c, layout, layer):
    """Bytes one block saves for backward in one micro-batch's forward, term by term (Korthikanti et al.,
    2022, section 4, count Megatron's block the same way: b*s*h units, sharded by t where tp splits them).
    Under selective recomputation, what it keeps: its attention core's own tensors go (recomputed_block)."""
    t, a = layout.tp, layout.activation_bytes
    tokens = tokens_per_rank(c, layout)
    sharded = tokens // t if layout.sp else tokens  # the residual stream: a sequence shard under sp
    norm = sharded * norm_activations(c, layout)
    attention = attention_of(c).activations(c, layout, tokens).kept
    if c.is_moe(layer):
        mlp = moe_activations(c, layout, tokens)
    else:  # fc's input, and the MLP's own
        mlp = tokens * c.d_model * a + mlp_activations(c, tokens, t, a)
    return 2 * norm + attention + mlp


class AttentionSaved(NamedTuple):
    """What an attention layer saves for backward in one micro-batch: `kept` until its backward (under
    selective recomputation without its core's own tensors), `core` those the core keeps of its own, which
    selective recomputation drops and holds again while the core is recomputed in backward."""
    kept: int
    core: int


class Attention(NamedTuple):
    """How the planner reads one of model.py's attention layers: its activations (c, layout, tokens) ->
    AttentionSaved, the elements of each weight tensor parallelism replicates and sums the gradient of over
    the group in every backward (c, layout -> [elements]), beyond the block's norms, and the features a token
    enters the tensor-parallel region with (c -> features)."""
    activations: Callable
    summed_over_tp: Callable
    entering: Callable


def attention_of(c):
    """model.py's attention of this config: LatentAttention (kv_lora_rank) or CausalSelfAttention."""
    return LATENT_ATTENTION if c.kv_lora_rank else GROUPED_ATTENTION


def grouped_attention_activations(c, layout, tokens):
    """CausalSelfAttention (grouped-query heads, q | k | v fused in qkv), under the layout's recomputation."""
    t, a = layout.tp, layout.activation_bytes
    h, q, wide = c.d_model, c.q_dim, max(a, 4)
    attention = (tokens * h * a                            # qkv's input (gathered under sp)
                 + tokens * (q + 2 * c.kv_dim) // t * a    # q | k | v, which the attention core keeps
                 + tokens * q // t * a                     # the core's output
                 + tokens * c.n_head // t * wide)          # and its log-sum-exp per head
    if c.position == "rope":  # rotated q and k, and the cos and sin tables of q's and k's rotations
        attention += 2 * position_rows(layout) * (c.seq_len // layout.cp) * c.head_dim * wide
        if rotated_kept(layout):
            attention += tokens * (q + c.kv_dim) // t * a
    if proj_copies_heads(c, layout):
        attention += tokens * q // t * a
    attention += head_norm_activations(c, layout, tokens) + document_mask_bytes(c, layout)
    # The core's own: its log-sum-exp (and a mask), and its output unless proj reads it in place
    core = tokens * c.n_head // t * wide + document_mask_bytes(c, layout)
    if proj_copies_heads(c, layout):  # proj keeps its own copy of the output, so the core's goes too
        core += tokens * q // t * a
    return AttentionSaved(attention - core if layout.recompute == "selective" else attention, core)


def qk_norm_weights(c, layout):
    """QK-norm's q_norm and k_norm (c.qk_norm) met this rank's heads alone, sp or not: tp.split_attention sums
    their gradients."""
    return [c.head_dim] * 2 * c.qk_norm


GROUPED_ATTENTION = Attention(grouped_attention_activations, qk_norm_weights, lambda c: c.d_model)


def latent_attention_activations(c, layout, tokens):
    """model.py's LatentAttention (DeepSeek-V2, section 2.1): what each of its operators saves, per token.
    Before tp's region, on this rank's tokens (1/tp of them under sp; tp.split_latent_attention): the input x
    that q_down and kv_down read; the queries' bottleneck norm (q_down_norm, an RMSNorm); the latent's norm
    (kv_down_norm, whose input is a view of kv_down's output latent | shared rotary key). Replicated over tp,
    on every token of the micro-batch: the compressed tokens (queries' latent | latent | rotary key, made by
    torch.cat and gathered under sp), of which q_up's and kv_up's inputs are views (on one rank of tp, the
    norms' outputs themselves: nothing enters a region); the cos and sin of the two
    rotations (of the rope features alone). This rank's heads: the core's inputs (q and k, made by torch.cat,
    and v, a view of kv_up's output, so that whole output) and what the core keeps (latent_core); proj's
    input, the heads' outputs, unless it is the core's own output read in place."""
    t, a, wide = layout.tp, layout.activation_bytes, max(layout.activation_bytes, 4)
    own_tokens = tokens // t if layout.sp else tokens
    x = own_tokens * c.d_model * a
    queries = rms_norm_activations(own_tokens, c.q_lora_rank, c.q_lora_rank, a) if c.q_lora_rank else 0
    latent = rms_norm_activations(own_tokens, c.kv_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim, a)
    if t > 1:  # q_up's and kv_up's inputs: views of the compressed tokens, concatenated to enter the region
        latent += tokens * compressed_features(c) * a
    else:  # the norms' own outputs (without a query bottleneck, x itself, counted already)
        latent += tokens * (c.q_lora_rank + c.kv_lora_rank) * a
    rotations = 2 * position_rows(layout) * (c.seq_len // layout.cp) * c.rotary_dim * wide
    inputs = tokens * (c.q_dim + c.kv_dim + c.n_head * (c.qk_nope_head_dim + c.v_head_dim)) // t * a
    outputs = tokens * c.v_dim // t * a
    core = LATENT_CORES[latent_core(c, layout)]
    own = core.own(c, layout, tokens)
    selective = layout.recompute == "selective"  # the checkpoint keeps the core's inputs, not its own tensors
    proj_input = 0 if core.output_in_place and c.n_head // t == 1 and not selective else outputs
    kept = x + queries + latent + rotations + proj_input
    if selective or core.keeps_inputs:
        kept += inputs
    return AttentionSaved(kept if selective else kept + own, own)


def rms_norm_activations(tokens, width, input_width, a):
    """An RMSNorm over `width` features (norm_activations, PyTorch's composite on CPUs): x/rms and 1/rms in
    float32 or wider, and its input: itself, which may be a view of `input_width` features a token (its whole
    storage), or narrower than float32, a copy of it cast up."""
    wide = max(a, 4)
    kept_input = input_width * a if a == wide else width * wide
    return tokens * (width * wide + wide + kept_input)


class LatentCore(NamedTuple):
    """An attention core given latent attention's q, k (head_dim features) and v (v_head_dim): own (c, layout,
    tokens) -> the bytes it keeps of its own; keeps_inputs: whether it keeps q, k and v themselves too;
    output_in_place: whether what it keeps of its output is the tensor proj reads (in place, one head a rank)."""
    own: Callable
    keeps_inputs: bool
    output_in_place: bool


def latent_core(c, layout):
    """Which core runs: context parallelism's (cp.py: 'ring', 'allgather', 'alltoall'), or on one device PyTorch's
    scaled_dot_product_attention: a fused kernel ('fused') where the device has one for these widths (CPU's
    flash kernel wants values as wide as the keys; CUDA's memory-efficient one takes them narrower), else its
    written-out composite ('math')."""
    if layout.cp > 1:
        return layout.cp_mode
    return "fused" if layout.device == "cuda" or c.v_head_dim == c.head_dim else "math"


def kernel_output(c, layout, tokens):
    """What a fused core keeps of its own: its output (this rank's heads, v_head_dim features each) and its
    log-sum-exp per head; on one device, with packed documents, the mask it was given (document_mask_bytes)."""
    t, a = layout.tp, layout.activation_bytes
    return (tokens * c.v_dim // t * a + tokens * c.n_head // t * max(a, 4)) + document_mask_bytes(c, layout)


def head_shard_copies(c, layout, tokens):
    """Ulysses's core (cp_mode alltoall): its head-shard copies of q, k and v, and kernel_output."""
    copies = tokens * (c.q_dim + c.kv_dim + c.v_dim) // layout.tp * layout.activation_bytes
    return copies + kernel_output(c, layout, tokens)


def math_core(c, layout, tokens):
    """PyTorch's composite attention (at::_scaled_dot_product_attention_math), in float32 or wider: q scaled and
    k transposed and scaled (copies), v as its batched product reads it, and the softmax's probabilities,
    b x heads x s x s (the causal or document mask is added to the scores in place, and not kept). v is a
    contiguous copy, but with one head a rank, in its own dtype, the product reads it in place: a view of
    kv_up's output, so that whole output."""
    t, a, wide = layout.tp, layout.activation_bytes, max(layout.activation_bytes, 4)
    v = tokens * c.v_dim // t * wide
    if c.n_head // t == 1 and a == wide:
        v = tokens * c.n_head * (c.qk_nope_head_dim + c.v_head_dim) // t * a
    scores = layout.micro_batch * c.n_head // t * c.seq_len ** 2 * wide
    return tokens * (c.q_dim + c.kv_dim) // t * wide + v + scores


LATENT_CORES = {"fused": LatentCore(kernel_output, True, True), "math": LatentCore(math_core, False, False),
                "ring": LatentCore(kernel_output, True, True), "allgather": LatentCore(kernel_output, True, True),
                "alltoall": LatentCore(head_shard_copies, False, False)}


def latent_replicated_weights(c, layout):
    """tp.split_latent_attention treats q_down, q_down_norm (with a query bottleneck), kv_down and kv_down_norm
    as norms: replicated, and under sp applied to this rank's tokens alone, their gradients summed."""
    if not layout.sp:
        return []
    queries = [c.q_lora_rank * c.d_model, c.q_lora_rank] if c.q_lora_rank else []
    return [*queries, (c.kv_lora_rank + c.qk_rope_head_dim) * c.d_model, c.kv_lora_rank]


def compressed_features(c):
    """What a token enters latent attention's tensor-parallel region with (LatentAttention.compressed): the
    queries' latent (x itself without a query bottleneck), the keys' and values' latent, the shared rotary key."""
    return (c.q_lora_rank or c.d_model) + c.kv_lora_rank + c.qk_rope_head_dim


LATENT_ATTENTION = Attention(latent_attention_activations, latent_replicated_weights, compressed_features)


def head_norm_activations(c, layout, tokens):
    """QK-norm's (c.qk_norm): q_norm and k_norm each keep what an RMSNorm keeps of this rank's heads, x/rms and
    1/rms per head in float32 or wider, and their input: narrower than float32, a copy cast up; else a view of
    q | k | v, whose storage is kept already where the attention core keeps its inputs (rotated_kept), but
    not by Ulysses's (which keeps its own copies). Their outputs are new tensors: the rotation that follows
    keeps only its cos and sin, but without one the core keeps them where it keeps its inputs."""
    if not c.qk_norm:
        return 0
    t, a, wide = layout.tp, layout.activation_bytes, max(layout.activation_bytes, 4)
    features, heads = tokens * (c.q_dim + c.kv_dim) // t, tokens * (c.n_head + c.n_kv_heads) // t
    kept = features * wide + heads * wide
    if a < wide:
        kept += features * wide
    elif not rotated_kept(layout):
        kept += tokens * (c.q_dim + 2 * c.kv_dim) // t * a
    if c.position != "rope" and rotated_kept(layout):
        kept += features * a
    return kept


def position_rows(layout):
    """Rows of positions a micro-batch has: one for all its sequences, or with packed documents one a sequence
    (each restarts at its documents' first tokens)."""
    return layout.micro_batch if layout.documents else 1


def document_mask_bytes(c, layout):
    """Packed documents: the fused kernel keeps the block-diagonal causal mask it was given, (b, 1, s, s) in the
    activations' dtype, for its backward (every head and tensor-parallel rank shares it). cp.py's three ways
    keep none: their backward makes each block's mask again from the documents' ids."""
    masked = layout.documents and layout.cp == 1
    return layout.micro_batch * c.seq_len ** 2 * layout.activation_bytes if masked else 0


def rotated_kept(layout):
    """Whether the rotated q and k are kept for backward: the attention core keeps its inputs (one device,
    ring attention, the all-gather), or selective recomputation keeps the inputs of the core it reruns;
    Ulysses's core (cp_mode alltoall) keeps its head-shard copies of them instead."""
    return layout.cp == 1 or layout.cp_mode != "alltoall" or layout.recompute == "selective"


def norm_activations(c, layout):
    """What a norm keeps per token: LayerNorm's kernel its input and statistics (mean, 1/std) in the input's
    dtype; RMSNorm (PyTorch's composite on CPUs) its input and x/rms in float32 or wider (an input
    narrower than float32 is cast up first), and 1/rms."""
    if c.norm == "layer":
        return c.d_model * layout.weight_bytes + 2 * layout.weight_bytes
    wide = max(layout.weight_bytes, 4)
    return 2 * c.d_model * wide + wide


def proj_copies_heads(c, layout):
    """Whether the attention's output projection keeps its own contiguous copy of the heads' outputs: a
    linear without bias does; with bias it reads them in place when they come from PyTorch's fused kernel
    (laid out token-major, as the queries it reads off q | k | v), but ring attention returns them head-major,
    and so does the kernel given QK-norm's queries (new tensors, head-major). A rank with one head has them
    contiguous either way."""
    return c.n_head // layout.tp > 1 and (not c.bias or layout.cp > 1 or c.qk_norm)


def mlp_activations(c, rows, t, a, d_ff=None):
    """fc's output and the activation's (GELU: both; SwiGLU: gate | up, silu(gate) and their product)."""
    return rows * (d_ff or c.d_ff) // t * a * (4 if c.mlp == "swiglu" else 2)


def moe_activations(c, layout, tokens):
    """An MoE layer as ep.py computes it, balanced, on a rank holding `tokens` of the micro-batch:
    - the router: its input, the arriving tokens (tp without sp keeps its part of them as a view, so their
      whole storage), and per routed token (routed_tokens) the scores (SCORES_KEPT) and choices, and where the
      gates are renormalised (norm_topk_prob) the top-k probabilities and their sum that divides them;
    - per (token, expert) assignment it sends: the indices that sort and return it, the mask that kept it,
      its gate, the output that came back and its weighted copy;
    - per row its experts compute (under expert tp the rows of every rank of the group, each having received
      as many): the expert's input and its MLP, of hidden width d_expert / expert_tp;
    - the shared expert's MLP on every arriving token, split by tp (under sp on the gathered sequence, its
      input a tensor of its own), of hidden width d_shared; with a gate (Qwen2-MoE), the sigmoid and the
      shared expert's output it multiplies, per arriving token."""
    t, a, wide, h = layout.tp, layout.activation_bytes, max(layout.activation_bytes, 4), c.d_model
    arriving = tokens // t if layout.sp else tokens
    routed = routed_tokens(c, layout)
    assignments = routed * c.top_k
    rows = assignments * layout.expert_tp
    renormalised = c.norm_topk_prob * (c.top_k + 1)
    router = (arriving * h * a + routed * ((SCORES_KEPT[c.router_scoring](c) + renormalised) * wide
                                           + c.top_k * INT64) + balance_statistics(c, layout))
    # (the gates are cast to the tokens' dtype)
    sent = assignments * (2 * h * a + a + 2 * INT64 + BOOL)
    experts = rows * h * a + mlp_activations(c, rows, layout.expert_tp, a, c.d_expert)
    shared = 0
    if c.n_shared_experts:
        gathered = tokens * h * a if layout.sp else 0
        gate = c.shared_expert_gate * arriving * (1 + h) * a
        shared = gathered + mlp_activations(c, tokens, t, a, c.d_shared) + gate
    return router + sent + experts + shared


# What the router's scores keep per routed token (ep.py's SCORES), in elements: the softmax its output; DeepSeek-V3's
# sigmoid its output, and the division that makes them the probabilities (scores / their sum) the sum.
SCORES_KEPT = {"softmax": lambda c: c.n_experts, "sigmoid": lambda c: c.n_experts + 1}


def balance_statistics(c, layout):
    """What the load-balancing loss keeps (ep.py), per unit it balances (the micro-batch, or each of its
    sequences): each expert's fraction f_i and the unit's token count. Per sequence also what summing each
    sequence's probabilities keeps (an index_add): each routed token's sequence, and the probabilities, which
    a softmax's output already holds but DeepSeek-V3's sigmoid scores divide into a tensor of their own."""
    wide = max(layout.activation_bytes, 4)
    per_unit = (c.n_experts + 1) * wide
    if c.aux_loss_scope == "batch":
        return per_unit
    probs = c.n_experts * wide if c.router_scoring == "sigmoid" else 0
    return layout.micro_batch * per_unit + routed_tokens(c, layout) * (INT64 + probs)


def recomputed_block(c, layout, layer):
    """(what a block keeps from forward until its backward, what its backward's recomputation holds)."""
    full = block_activations(c, layout, layer)
    tokens = tokens_per_rank(c, layout)
    if layout.recompute == "full":  # only the block's input, the residual stream
        kept = (tokens // layout.tp if layout.sp else tokens) * c.d_model * layout.weight_bytes
        return kept, full
    if layout.recompute == "selective":  # (full: what it keeps without its core's own, which it holds again)
        return full, attention_of(c).activations(c, layout, tokens).core
    return full, 0


def recomputed_positions(c, layout, first):
    """With packed documents, what a chunk's recomputed blocks keep besides the residual stream, once for all
    of them: under full recomputation the positions (each chunk computes its own), unless they are the ones
    the first chunk's learned table keeps already."""
    if not layout.documents or layout.recompute != "full" or (first and c.position == "learned"):
        return 0
    return tokens_per_rank(c, layout) * INT64


def recomputed_documents(c, layout):
    """With packed documents, what recomputed blocks keep of a micro-batch's document ids (of the whole
    sequence, for the core): one tensor, whichever of a rank's chunks keep it, until the last lets it go."""
    if not layout.documents or layout.recompute == "none":
        return 0
    return layout.micro_batch * c.seq_len * INT64


def edge_activations(c, layout, first, last):
    """(the embedding's token ids; the final norm and the head's input, the loss's softmax and targets)."""
    t, a, tokens = layout.tp, layout.activation_bytes, tokens_per_rank(c, layout)
    embedding = head = loss = 0
    if first:
        if t > 1:  # the vocabulary-parallel embedding's local ids and what lies outside its range
            embedding = tokens * (INT64 + BOOL)
        elif layout.cp > 1:  # the ids: a copy, this rank's zigzag shard (else a view, see shared_activations)
            embedding = tokens * INT64
        if c.position == "learned" and layout.documents:  # the micro-batch's own positions, which it looks up
            embedding += tokens * INT64
    if last:
        sharded = tokens // t if layout.sp else tokens
        norm = sharded * norm_activations(c, layout)
        head = norm + tokens * c.d_model * a
        softmax = tokens * c.padded_vocab_size // t * max(a, 4)
        # The cross-entropy keeps a flat copy of the targets (tp: local targets, and which are its own).
        targets = tokens * (INT64 + BOOL if t > 1 else INT64) if not batch_view_targets(layout) else 0
        mean = max(a, 4) if t == 1 else 0  # cross_entropy's mean keeps a scalar; tp's own mean does not
        # model.without_padding keeps the index of the padding it fills (tp's cross-entropy saves none of its own)
        padding = (c.padded_vocab_size - c.vocab_size) * INT64 if t == 1 else 0
        loss = softmax + targets + mean + padding
    return embedding + head, loss


def batch_view_targets(layout):
    """Whether the cross-entropy keeps the targets as a view into the step's batch of tokens rather than a
    flat copy: a single sequence's (1, s) slice flattens without copying (unless cp copied out a shard, or
    tp's cross-entropy keeps local targets instead)."""
    return layout.micro_batch == 1 and layout.cp == 1 and layout.tp == 1 and not layout.documents


def shared_activations(c, layout, stage):
    """What every micro-batch saves from the same storage, counted once: on the first stage the ids, a view
    into the step's whole batch of tokens (unless cp copied out a shard, or tp looks up local ids instead),
    on the last the targets if they are such a view too;
    the positions, if a learned table looks them up or full recomputation keeps them with each block's input
    (under sp a view of them all)."""
    shared, first, last = 0, stage == layout.placement.first_rank, stage == layout.placement.last_rank
    if (first and layout.cp == 1 and layout.tp == 1) or (last and batch_view_targets(layout)):
        shared += layout.batch_size * (c.seq_len + 1) * INT64
    if ((first and c.position == "learned") or layout.recompute == "full") and not layout.documents:
        shared += c.seq_len // layout.cp * INT64
    return shared


def chunk_activations(c, layout, model_chunk):
    """(kept until the weights' gradients, of which the losses': freed at B by ZB-H1, the most held by one
    recomputation) of one model chunk and micro-batch. The losses' share is the cross-entropy's and the
    load-balancing losses' statistics: it lies above every weight's branch."""
    n_model_chunks = layout.placement.n_model_chunks
    layers = pp.split_layers(c.n_layer, n_model_chunks)[model_chunk]
    blocks = [recomputed_block(c, layout, layer) for layer in layers]
    first, last = model_chunk == 0, model_chunk == n_model_chunks - 1
    edges, loss = edge_activations(c, layout, first, last)
    kept = sum(kept for kept, _ in blocks) + edges + loss + recomputed_positions(c, layout, first)
    if layout.recompute != "full":  # (a recomputed block keeps only its input)
        loss += sum(balance_statistics(c, layout) for layer in layers if c.is_moe(layer))
    return kept, loss, max(r for _, r in blocks)


def activation_peak(c, layout, stage):
    """(peak, recomputation): the most bytes kept for backward at once, over the micro-batches in flight
    (pp.py's schedule; one at a time without pipelining) times their chunk's activations; and what one
    block's recomputation holds on top of that during backward (which the meter, counting what forwards
    keep, does not see). Under ZB-H1 a micro-batch is held until its W, but its B already frees what lies
    above every weight's branch: the loss's softmax and targets (every node of a block leads to a weight)."""
    n_chunks = layout.virtual_stages
    sizes = {chunk: chunk_activations(c, layout, k) for chunk, k in enumerate(layout.placement.model_chunks(stage))}
    if layout.pp == 1:
        actions = [(kind, 0, m) for m in range(layout.micro_batches) for kind in ("forward", "backward")]
    else:
        actions = pp.make_schedule(layout.schedule, layout.micro_batches, layout.pp, stage, n_chunks)
    split = any(kind == "weight" for kind, _, _ in actions)
    live = peak = shared_activations(c, layout, stage)
    documents, holders = recomputed_documents(c, layout), Counter()  # micro-batch: its chunks keeping its ids
    last_use = "weight" if split else "backward"
    for kind, chunk, m in actions:
        kept, loss, _ = sizes[chunk]
        live -= {"forward": -kept, "backward": loss if split else kept, "weight": kept - loss}[kind]
        if kind == "forward":  # the first of the rank's chunks to run this micro-batch keeps its ids
            holders[m] += 1
            live += documents if holders[m] == 1 else 0
        elif kind == last_use:  # and the last to be done with it lets them go
            holders[m] -= 1
            live -= documents if holders[m] == 0 else 0
        peak = max(peak, live)
    return peak, max(recomputed for _, _, recomputed in sizes.values())


# ---------------------------------------------------------------------------
# The prediction: every rank's figures, under log.jsonl's names
# ---------------------------------------------------------------------------

def coordinates(layout, rank):
    """{dim: index} of a rank in the grid arange(world).view(dp, pp, cp, tp) (mesh.py), tp fastest."""
    where = {}
    for dim in reversed(DIMS):
        rank, where[dim] = divmod(rank, getattr(layout, dim))
    return where


def rank_of(layout, where):
    """The rank at grid coordinates `where` (coordinates' inverse)."""
    rank = 0
    for dim in DIMS:
        rank = rank * getattr(layout, dim) + where[dim]
    return rank


def expert_coordinates(layout, where):
    """{axis: index} of the rank at `where` in the experts' grid (mesh.py's expert_axis_sizes): its place in
    its stage's dp x cp x tp ranks (row-major) read as (dp_replicate, expert_dp_shard, ep, expert_tp)."""
    place = (where["dp"] * layout.cp + where["cp"]) * layout.tp + where["tp"]
    indices = {}
    for axis, size in reversed(layout.mesh_shape.expert_axis_sizes().items()):
        if axis != "pp":
            place, indices[axis] = divmod(place, size)
    return {"pp": where["pp"], **indices}


def group_index(layout, group, where):
    """A rank's position in ZeRO's shard group of its mesh.py group `group` ('dense', 'expert'), from its
    coordinates, as mesh.group_ranks orders them: for the dense group row-major over (dp, cp), dp's
    coordinate being its place among the dp_shard ranks of its shard group (all of dp without hybrid
    sharding); for the experts' its place among the expert_dp ranks of one copy."""
    if group == "expert":
        return expert_coordinates(layout, where)["expert_dp_shard"]
    return where["dp"] % layout.dp_shard * layout.cp + where["cp"]


def predict_stage(config, layout, stage):
    """{'param_bytes': n, ..., 'traffic': {group name: Counter of bytes by kind}, 'steps': {group name: f},
    'muon': [MuonRank] or None} for the ranks of one pipeline stage (f(i): the step counters of the i-th rank
    of the group's shard group; muon_ranks: Muon's state and traffic, by the rank's place in the stage).
    The traffic's groups (TRAFFIC_GROUPS): "dense" and "expert" (data parallelism's, ZeRO's shard groups
    under hybrid sharding), "dense_replicas" and "expert_replicas" (hybrid sharding's all-reduces over the
    copies), the model-parallel dimensions', and the MoE layers' other groups (moe_traffic)."""
    states = stage_states(config, layout, stage)
    # (the model-parallel part is the same under every ZeRO stage and shard group, which --search varies)
    model_traffic, activations, recomputation = model_parallel_stage(
        config_key(config), replace(layout, zero=0, dp_shard=layout.dp), stage)
    traffic = {"dense": states["dense"].traffic + states["tied"].traffic, "expert": Counter(states["expert"].traffic),
               "dense_replicas": states["dense"].replica_traffic + states["tied"].replica_traffic,
               "expert_replicas": Counter(states["expert"].replica_traffic),
               **{group: Counter(counter) for group, counter in model_traffic.items()}}
    traffic["pp"] += tied_sum_traffic(rank_parameters(config, layout, stage)[2], layout)
    return dict(param_bytes=sum(s.param for s in states.values()), grad_bytes=sum(s.grad for s in states.values()),
                optim_bytes=sum(s.optim for s in states.values()), activation_peak_bytes=activations,
                recompute_bytes=recomputation, traffic=traffic,
                steps={kind: state.steps for kind, state in states.items()}, muon=muon_ranks(config, layout, stage))


def stage_states(config, layout, stage):
    """{"dense", "expert", "tied": State} of the parameters the ranks of one pipeline stage hold."""
    dense, expert, tied = rank_parameters(config, layout, stage)
    return {kind: state_memory(params, layout.shard_group(kind), layout, kind == "expert", layout.replicas)
            for kind, params in (("dense", dense), ("expert", expert), ("tied", tied))}


def largest_parameter_bytes(args, world, config, data):
    """The most param_bytes any rank of the run would hold (its weights, and their master copy where the dtypes
    differ): what train.py checks against a device's memory before it allocates anything (config: the model,
    data: its DataInfo, both as train.py has them)."""
    layout = layout_of(args, world, data=data)
    return max(sum(state.param for state in stage_states(config, layout, stage).values()) for stage in range(layout.pp))


@functools.lru_cache(maxsize=2**14)
def model_parallel_stage(config_fields, layout, stage):
    """({group: Counter of bytes sent per step} of tp, cp, pp (its activations and gradients) and the MoE
    layers' groups (moe_traffic), the activations' peak, the recomputation's) for the ranks of one pipeline
    stage. (Shared: read only.)"""
    config = GPTConfig(**dict(config_fields))
    chunks, n_model_chunks = layout.placement.model_chunks(stage), layout.placement.n_model_chunks
    split = pp.split_layers(config.n_layer, n_model_chunks)
    layers = [layer for chunk in chunks for layer in split[chunk]]
    first, last = 0 in chunks, n_model_chunks - 1 in chunks
    per_micro_batch = {"tp": tp_traffic(config, layout, layers, first, last),
                       "cp": cp_traffic(config, layout, layers), **moe_traffic(config, layout, layers)}
    traffic = {"pp": pp_traffic(config, layout, stage),
               **{group: Counter({k: v * layout.micro_batches for k, v in c.items()})
                  for group, c in per_micro_batch.items()}}
    return (traffic, *activation_peak(config, layout, stage))


def tied_sum_traffic(tied, layout):
    """train.TiedOutputLayer: one all-reduce over the first and last stage of the tied weight's averaged
    gradient (its bucket, or under ZeRO its shard in the master's dtype, of the dense shard group)."""
    if not tied:
        return Counter()
    (_, numel), = tied
    group = layout.shard_group("tied")
    bucket = padded(numel, group)
    averaged = bucket // group * layout.master_bytes if layout.zero else bucket * layout.reduce_bytes
    return Counter(all_reduce=ring_bytes_sent("all_reduce", averaged, 2))


def rank_figures(stage_prediction, layout, where):
    """The stage's figures for the rank at grid coordinates `where`: its optimizer adds its step counters (and
    under Muon keeps one momentum, not two moments, for the elements of its pieces of matrices)."""
    fields = {k: v for k, v in stage_prediction.items() if k not in ("traffic", "steps", "muon")}
    steps = stage_prediction["steps"]
    counters = sum(steps[group](group_index(layout, "dense" if group == "tied" else group, where))
                   for group in ("dense", "expert", "tied"))
    fields["optim_bytes"] += counters * ADAM_STEP_BYTES
    if stage_prediction["muon"]:
        fields["optim_bytes"] -= sum(muon_rank(stage_prediction, layout, where).elements.values()) * layout.master_bytes
    return fields


def muon_rank(stage_prediction, layout, where):
    """The MuonRank of the rank at `where`, from its stage's prediction under --optimizer muon."""
    return stage_prediction["muon"][stage_place(layout, where)]


def rank_traffic(stage_prediction, layout, where):
    """The stage's traffic as the rank at `where` sends it: under Muon with the all-to-alls of its optimizers'
    assembly ("optim"), which differ from rank to rank (the owners answer for the matrices they assemble)."""
    if not stage_prediction["muon"]:
        return stage_prediction["traffic"]
    sent = muon_rank(stage_prediction, layout, where).sent
    return {**stage_prediction["traffic"], "optim": Counter(all_to_all=sent)}


LOGGED_UNDER = {  # traffic group -> the dimension train.py logs it under (the counter of the file that sends it)
    "dense": "dp", "expert": "dp", "dense_replicas": "dp", "expert_replicas": "dp",  # dp.py's
    "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep",
    "tp_rows": "ep", "expert_tp": "ep",  # ep.py's all-to-alls over the tp and expert-tp groups
    "expert_tp_bias": "tp",              # tp.py's all-reduce over the expert-tp group
    "optim": "optim"}                    # training/muon.py's all-to-alls over the stage


def comm_fields(traffic):
    """Traffic under log.jsonl's names, comm_<dim>_<kind>_bytes (dp: dense and expert averaging together, and
    hybrid sharding's sums over the copies; ep: every row ep.py moves, whichever group it travels in; optim:
    Muon's assembly of the matrices)."""
    by_dim = {dim: Counter() for dim in train.COMM_KINDS}
    for group, counter in traffic.items():
        by_dim[LOGGED_UNDER[group]].update(counter)
    return {f"comm_{dim}_{kind}_bytes": by_dim[dim].get(kind, 0)
            for dim, kinds in train.COMM_KINDS.items() for kind in kinds}


def predict(args, world, device="cpu"):
    """{field: [value of rank 0, rank 1, ...]} for the run train.py would make of args on `world` ranks:
    log.jsonl's memory and traffic fields, and recompute_bytes (see activation_peak)."""
    layout = layout_of(args, world, device)
    config = cli.model_config(args, cli.data_vocab_size(args))
    stages = [predict_stage(config, layout, stage) for stage in range(layout.pp)]
    ranks = []
    for rank in range(world):
        where = coordinates(layout, rank)
        stage = stages[where["pp"]]
        ranks.append({**rank_figures(stage, layout, where), **comm_fields(rank_traffic(stage, layout, where))})
    return {field: [r[field] for r in ranks] for field in ranks[0]}


# ---------------------------------------------------------------------------
# Peak resident memory: of start-up, of a step, of a checkpoint's save and of its load
# ---------------------------------------------------------------------------

# What a process holds before any tensor: the interpreter, PyTorch's libraries, this repository's modules, the
# process groups (measured on Linux with PyTorch 2.13's CPU build: 0.29 to 0.31 GiB; on a GPU the device's
# figure, torch.cuda.max_memory_allocated, leaves it out, and the CUDA context adds to the host's).
PROCESS_BYTES = int(0.30 * 2**30)
# Filling or reading a chunk of model.INIT_CHUNK elements holds a few arrays of 8 bytes an element at once:
# the positions, their index along each dimension, the hash's steps, the values.
CHUNK_ARRAYS = 8


def chunk_bytes(largest):
    """The working arrays of filling or reading the chunks of a tensor of `largest` elements."""
    return CHUNK_ARRAYS * min(INIT_CHUNK, largest) * INT64


def zero_working(params, group, layout):
    """The most bytes ZeRO-2 and 3 hold during a step beyond what is logged after it (their shards), in
    full weights (weights' dtype) and full gradient buckets (reduce dtype):
    - without a pipeline, ZeRO-3's two neighbouring units gathered whole (one computing, the next
      prefetched) and, in backward, their full gradients (one filling, the one before it being
      reduce-scattered); ZeRO-2's one bucket in flight is left out (a bucket_bytes, small beside the rest);
    - under a pipeline, whose reduction comes once, after each chunk's last backward (dp.ZeRO2, ZeRO3):
      ZeRO-2 the stage's full gradient buckets, through the step's backwards; ZeRO-3 the stage's units
      gathered whole from their first forward to that reduction, and their full gradients besides.
    The figure is added to the activations' peak, as if both came at once: under a pipeline the
    gradients arrive with the first backward, about when the micro-batches in flight are most."""
    if layout.zero < 2 or not params:
        return 0
    w, r = layout.weight_bytes, layout.reduce_bytes
    buckets = [b.padded for b in zero_buckets(params, group, layout)]
    if layout.pp > 1:
        return sum(buckets) * (r + (w if layout.zero == 3 else 0))
    if layout.zero == 3:
        return max(a + b for a, b in zip(buckets, buckets[1:] or [0])) * (w + r)
    return 0


def largest_piece(params, group, layout):
    """The most elements of one parameter a rank keeps together: a whole parameter, or under ZeRO a piece of
    one, no longer than a shard."""
    sizes = [numel for _, numel in params]
    if not sizes:
        return 0
    if not layout.zero:
        return max(sizes)
    return min(max(sizes), max(b.padded for b in zero_buckets(params, group, layout)) // group)


def norm_working(params, group, layout):
    """The gradient norm sums squares in float64, a gradient piece at a time: the largest, cast (unless it is
    float64) and squared."""
    grads = layout.master_dtype if layout.zero else layout.reduce_dtype  # ZeRO's shards, or the buckets
    return largest_piece(params, group, layout) * INT64 * (1 if grads == "float64" else 2)


def written_by(layout, where, expert):
    """Whether the rank at `where` writes the checkpoint pieces it holds (checkpoint.Saver: each piece by the
    lowest rank holding it). ZeRO's shards differ on every rank of their shard group (only the replicated
    norms and biases of tp ranks other than 0 are written by another: left out here), and under hybrid
    sharding the first copy's group writes them (dp // dp_shard == 0); without ZeRO, the first replica
    writes: of a dense piece the rank with dp and cp 0, of an expert's the first of its expert group."""
    if layout.zero:
        return where["dp"] < layout.dp_shard
    if expert:
        place = expert_coordinates(layout, where)
        return place["dp_replicate"] == place["expert_dp_shard"] == 0
    return where["dp"] == where["cp"] == 0


def predict_peaks(args, world, device="cpu"):
    """{field: [bytes of rank 0, rank 1, ...]}: each rank's peak resident memory at start-up, during a step,
    while a checkpoint is saved and while one is loaded, and the largest of the four (peak_bytes)."""
    layout = layout_of(args, world, device)
    config = cli.model_config(args, cli.data_vocab_size(args))
    stages = [(predict_stage(config, layout, stage), working_sets(config, layout, stage)) for stage in range(layout.pp)]
    ranks = []
    for rank in range(world):
        where = coordinates(layout, rank)
        prediction, working = stages[where["pp"]]
        ranks.append(phase_peaks(layout, rank_figures(prediction, layout, where), working, where))
    return {field: [r[field] for r in ranks] for field in ranks[0]}


def working_sets(config, layout, stage):
    """What a rank of this pipeline stage holds beyond its state at some moment: ZeRO-2 and 3's full weights
    and gradients during a step (zero_working), the gradient norm's squares, the bytes of one optimizer
    moment of its dense and of its expert pieces, and under Muon each rank's MuonRank (its step's working
    set, and the elements for which it keeps one momentum, not two moments)."""
    dense, expert, tied = rank_parameters(config, layout, stage)
    groups = {kind: (params, layout.shard_group(kind))
              for kind, params in (("dense", dense), ("expert", expert), ("tied", tied))}
    return dict(largest=max(numel for _, numel in dense + expert + tied),
                zero=sum(zero_working(p, g, layout) for p, g in groups.values()),
                piece=max(largest_piece(p, g, layout) for p, g in groups.values()),
                norm=max(norm_working(p, g, layout) for p, g in groups.values()),
                moment={kind: state_memory(p, g, layout, kind == "expert", layout.replicas).optim // 2
                        for kind, (p, g) in groups.items()},
                muon=muon_ranks(config, layout, stage))


def phase_peaks(layout, figures, working, where):
    """One rank's peaks (see predict_peaks), from its figures and its stage's working sets."""
    state = figures["param_bytes"] + figures["grad_bytes"] + figures["optim_bytes"]
    muon_rank = working["muon"][stage_place(layout, where)] if working["muon"] else MuonRank(0, Counter(), 0)
    # A save copies aside the weights and both moments of the pieces the rank writes: 3 moments' bytes (under
    # Muon one fewer for the elements of its pieces of matrices).
    copied = sum(3 * moment - muon_rank.elements[kind] * layout.master_bytes
                 for kind, moment in working["moment"].items()
                 if written_by(layout, where, expert=kind == "expert") and (kind != "tied" or where["pp"] == 0))
    # At start-up ZeRO-1 and 2 copy each bucket into their flat buffer, one at a time; ZeRO-3 draws each
    # piece of its shards in float64 before keeping it in the run's dtype.
    largest, weights = working["largest"], figures["param_bytes"]
    flat = {1: min(layout.bucket_bytes, weights), 2: min(layout.bucket_bytes, weights), 3: working["piece"] * INT64}
    buckets = layout.zero or layout.dense_group > 1  # (else gradients come with the first backward)
    startup = figures["param_bytes"] + (figures["grad_bytes"] if buckets else 0) + chunk_bytes(largest) + \
        flat.get(layout.zero, 0)
    computing = figures["activation_peak_bytes"] + figures["recompute_bytes"] + working["zero"]
    # (the norm comes once backward has freed everything, and the optimizer's step after it)
    step = state + max(computing, working["norm"], muon_rank.working)
    save = state + copied
    # Loading builds the rank as start-up does, then reads its optimizer state a chunk at a time, with the
    # range of the saved piece holding the chunk: the chunk itself when the checkpoint was split alike, up
    # to tp (an expert's: expert-tp) times it when it was saved whole and is read back as a slice.
    parts = max(layout.tp, layout.expert_tp)
    load = startup + figures["optim_bytes"] + min(INIT_CHUNK, largest) * layout.master_bytes * parts
    peaks = dict(startup_peak_bytes=startup, step_peak_bytes=step, save_peak_bytes=save, load_peak_bytes=load)
    peaks = {field: PROCESS_BYTES + value for field, value in peaks.items()}
    return dict(peaks, peak_bytes=max(peaks.values()))


# ---------------------------------------------------------------------------
# The playbook's figure: per-rank memory of each strategy alone, by sequence length (plot.py draws it)
# ---------------------------------------------------------------------------

# (label, ranks, flags): each strategy alone; EP needs a mixture-of-experts model (its flags add the experts).
STRATEGIES = [
    ("1 GPU", 1, []), ("ZeRO-1", 8, ["--zero", "1"]), ("ZeRO-2", 8, ["--zero", "2"]), ("ZeRO-3", 8, ["--zero", "3"]),
    ("TP=8 +SP", 8, ["--tp", "8", "--sp"]), ("PP=8", 8, ["--pp", "8", "--micro-batches", "8"]),
    ("CP=8", 8, ["--cp", "8"]), ("EP=8", 8, ["--ep", "8"]),
]
EXPERTS = ["--experts", "8", "--top-k", "2"]


def strategy_argv(model_flags, flags, world, seq_len, recompute):
    """train.py's flags for one strategy: one sequence per data rank and micro-batch."""
    argv = [*model_flags, *flags, "--seq-len", str(seq_len), "--recompute", recompute]
    args = cli.parse_args(argv)
    data_ranks = world // (args.tp * args.pp * args.cp)
    return [*argv, "--batch-size", str(args.micro_batches * data_ranks)]


def busiest_memory(argv, world):
    """{param, grad, optim, activations (with one block's recomputation)}: bytes of the rank that needs most."""
    args = cli.parse_args(argv)
    layout = layout_of(args, world)
    config = cli.model_config(args, cli.data_vocab_size(args))
    ranks = []
    for stage in range(layout.pp):
        figures = rank_figures(predict_stage(config, layout, stage), layout, first_of_stage(layout, stage))
        ranks.append(dict(param=figures["param_bytes"], grad=figures["grad_bytes"], optim=figures["optim_bytes"],
                          activations=figures["activation_peak_bytes"] + figures["recompute_bytes"]))
    return max(ranks, key=lambda r: sum(r.values()))


# ---------------------------------------------------------------------------
# Inside a node or across nodes: which groups a rank's traffic travels in
# ---------------------------------------------------------------------------

TRAFFIC_GROUPS = {  # the axes each group of traffic spans (mesh.py's grid, dp read as (dp_replicate, dp_shard), or
    # the experts' grid folded over each stage's ranks, mesh.EXPERT_AXES; see LOGGED_UNDER for their names in the log)
    "dense": ("dp_shard", "cp"), "expert": ("expert_dp_shard",),  # all of dp (expert_dp) without hybrid sharding
    "dense_replicas": ("dp_replicate",), "expert_replicas": ("dp_replicate",),
    "tp": ("tp",), "pp": ("pp",), "cp": ("cp",), "ep": ("ep",),
    "tp_rows": ("tp",), "expert_tp": ("expert_tp",), "expert_tp_bias": ("expert_tp",),
    "optim": ("dp", "cp", "tp")}  # Muon's assembly of the matrices: a stage's ranks (mesh.py's "stage")


def grid_coordinates(layout, where, experts=False):
    """{axis: (size, the rank's index)} of mesh.py's grid arange(world).view(dp_replicate, dp_shard, pp, cp, tp),
    slowest first, for the rank at `where` (its coordinates in dp, pp, cp, tp); with `experts`, of the experts'
    grid (pp, dp_replicate, expert_dp_shard, ep, expert_tp), each stage's ranks read in their order."""
    if experts:
        sizes, indices = layout.mesh_shape.expert_axis_sizes(), expert_coordinates(layout, where)
    else:
        sizes = layout.mesh_shape.axis_sizes()
        indices = {"dp_replicate": where["dp"] // layout.dp_shard, "dp_shard": where["dp"] % layout.dp_shard,
                   **{dim: where[dim] for dim in DIMS[1:]}}
    return {axis: (size, indices[axis]) for axis, size in sizes.items()}


def grid_axes(axes):
    """The grid's axes a group spans ('dp' is both parts, 'expert_dp' both of its own), and whether they are
    the experts' grid's."""
    parts = {"dp": ("dp_replicate", "dp_shard"), "expert_dp": ("dp_replicate", "expert_dp_shard")}
    axes = {part for axis in axes for part in parts.get(axis, (axis,))}
    return axes, any(axis in EXPERT_AXES for axis in axes)


def expert_place_rank(layout, place):
    """The rank at a place of the experts' grid (pp-major, then each stage's ranks in order): (dp, pp, cp x tp)
    row-major."""
    stage, cp_tp = layout.stage, layout.cp * layout.tp
    return (place % stage // cp_tp * layout.pp + place // stage) * cp_tp + place % cp_tp


def crosses_nodes(layout, where, axes, gpus_per_node):
    """Whether the group of the rank at `where` spanning `axes` (grid_coordinates' names; 'dp' is both parts,
    'expert_dp' both of its own) holds ranks of more than one node: a node holds consecutive ranks, and the
    group's lie between its lowest (its axes' indices 0) and its highest (their last)."""
    axes, experts = grid_axes(axes)
    stride, lowest, span = 1, 0, 0
    for axis, (size, index) in reversed(grid_coordinates(layout, where, experts).items()):
        if axis in axes:
            span += (size - 1) * stride
        else:
            lowest += index * stride
        stride *= size
    ends = [lowest, lowest + span]
    if experts:  # a place in the experts' grid to its rank
        ends = [expert_place_rank(layout, place) for place in ends]
    return ends[0] // gpus_per_node != ends[1] // gpus_per_node


def group_members(layout, where, axes):
    """The ranks of the group of the rank at `where` spanning `axes`, in the order of their indices along them
    (mesh.group_ranks' order: for ep, ep rank 0 first)."""
    axes, experts = grid_axes(axes)
    stride, lowest, offsets = 1, 0, [0]
    for axis, (size, index) in reversed(grid_coordinates(layout, where, experts).items()):
        if axis in axes:
            offsets = [i * stride + offset for i in range(size) for offset in offsets]
        else:
            lowest += index * stride
        stride *= size
    places = sorted(lowest + offset for offset in offsets)
    return [expert_place_rank(layout, place) for place in places] if experts else places


# Groups whose traffic is an all-to-all sending each peer as much (balanced routing's rows): the share going to
# peers on the rank's own node stays inside it. (A ring collective's group that crosses nodes is counted across.)
EVEN_ALL_TO_ALL = ("ep", "tp_rows", "expert_tp")


def inside_share(layout, where, axes, gpus_per_node):
    """(peers on the node of the rank at `where`, peers) in its group spanning `axes`."""
    me, members = rank_of(layout, where), group_members(layout, where, axes)
    peers = [rank for rank in members if rank != me]
    return sum(rank // gpus_per_node == me // gpus_per_node for rank in peers), len(peers)


def node_split(layout, stage_prediction, where, gpus_per_node):
    """(bytes sent per step inside the node, across nodes) by the rank at `where`: a group's traffic inside when
    the group lies in the rank's node, else across, but for the all-to-alls of EVEN_ALL_TO_ALL, split by where
    the peers are."""
    inside = across = 0
    for group, counter in rank_traffic(stage_prediction, layout, where).items():
        sent, axes = sum(counter.values()), TRAFFIC_GROUPS[group]
        if not sent:
            continue
        if not crosses_nodes(layout, where, axes, gpus_per_node):
            inside += sent
            continue
        near, peers = inside_share(layout, where, axes, gpus_per_node) if group in EVEN_ALL_TO_ALL else (0, 1)
        inside += sent * near // peers
        across += sent - sent * near // peers
    return inside, across


class ExpertNodes(NamedTuple):
    """Where the experts of one MoE layer lie for the rank at `where` (its ep group): the nodes its ep group
    spans, the share of its dispatch's peers on its own node, and for group-limited routing (n_group,
    topk_group) the most nodes one group's experts lie on and the most a token's top_k experts can reach."""
    nodes: int
    near: int
    peers: int
    group_nodes: int
    token_nodes: int


def expert_nodes(config, layout, where, gpus_per_node):
    """ExpertNodes of the rank at `where`: ep rank k holds experts [k E/ep, (k+1) E/ep) (ep.py) and group g of
    DeepSeek-V3's routing the experts [g E/n_group, (g+1) E/n_group) (model.best_groups_only), so a group's
    experts lie on the nodes of the ep ranks holding them. A token's top_k experts lie in at most topk_group
    groups: at most the topk_group groups spanning most nodes, and never more than top_k nodes."""
    members = group_members(layout, where, ("ep",))
    node_of_ep_rank = [rank // gpus_per_node for rank in members]
    per_rank, per_group = config.n_experts // layout.ep, config.n_experts // config.n_group
    nodes_of_group = [len({node_of_ep_rank[expert // per_rank] for expert in range(g * per_group, (g + 1) * per_group)})
                      for g in range(config.n_group)]
    widest = sorted(nodes_of_group, reverse=True)[:config.topk_group]
    nodes = len(set(node_of_ep_rank))
    near, peers = inside_share(layout, where, ("ep",), gpus_per_node)
    return ExpertNodes(nodes, near, peers, max(nodes_of_group), min(config.top_k, nodes, sum(widest)))


# ---------------------------------------------------------------------------
# The command line: a table of each distinct rank, --json, --search
# ---------------------------------------------------------------------------

MEMORY = ("param_bytes", "grad_bytes", "optim_bytes", "activation_peak_bytes", "recompute_bytes")


def parse_bytes(text):
    """'80GiB', '80GB', '1.5TiB', '123456' -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    number = text.rstrip("KMGTiBb")
    unit = text[len(number):].upper()
    if unit not in units:
        raise argparse.ArgumentTypeError(f"{text!r}: a size like 80GiB or 80GB")
    return int(float(number) * units[unit])


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.plan", description=__doc__.split("\n")[0],
                                epilog="Every other flag is train.py's (python train.py --help).")
    p.add_argument("--world", type=int, required=True, help="ranks (GPUs) of the run")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (inside: fast links)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="whose kernels the activations are modelled on: cpu (exact for runs on CPUs) or cuda (where "
                        "they differ: latent attention on one device runs CUDA's memory-efficient kernel, not the "
                        "CPU's composite, which keeps the softmax's s x s probabilities)")
    p.add_argument("--json", action="store_true", help="print the prediction as log.jsonl's fields, per rank")
    p.add_argument("--search", action="store_true",
                   help="list the layouts of --world ranks that fit --memory (tp, pp, cp, ZeRO, hybrid sharding, "
                        "recomputation; with experts ep and expert-tp, folded over each stage's ranks)")
    p.add_argument("--memory", type=parse_bytes, default=parse_bytes("80GiB"), help="memory per rank, for --search")
    p.add_argument("--top", type=int, default=20, help="layouts --search lists (0: all that fit)")
    plan_args, rest = p.parse_known_args(argv)
    return plan_args, cli.parse_args(rest)


def describe(layout, args, config):
    n_params = sum(math.prod(shape) for _, shape in model_parameters(config_key(config)))
    size = f"{n_params / 1e9:.2f}B" if n_params >= 1e9 else f"{n_params / 1e6:.2f}M"
    experts = f", {config.n_experts} experts top-{config.top_k}" if config.n_experts else ""
    hybrid = f" (ZeRO's shards over {layout.dp_shard}, {layout.replicas} copies)" if layout.replicas > 1 else ""
    return (f"{args.model} ({args.arch}{experts}, {size} parameters) on {layout.world} ranks: "
            f"dp={layout.dp}{hybrid} tp={layout.tp}{' +sp' if layout.sp else ''} pp={layout.pp} cp={layout.cp}, "
            f"{expert_split(layout, config)}ZeRO-{layout.zero}, {layout.schedule} x{layout.virtual_stages}, "
            f"{layout.micro_batches} micro-batches of {layout.micro_batch} x {config.seq_len} tokens, "
            f"recompute {layout.recompute}, {layout.dtype}{', Muon' if layout.optimizer == 'muon' else ''}")


def expert_split(layout, config):
    """How the experts are folded over a stage's ranks, for describe (nothing without experts)."""
    if not config.n_experts:
        return ""
    return f"experts folded as ep={layout.ep} expert-tp={layout.expert_tp} expert-dp={layout.expert_group}, "


def first_of_stage(layout, stage):
    """The coordinates of a pipeline stage's first rank (every other coordinate 0)."""
    return {**{dim: 0 for dim in DIMS}, "pp": stage}


def print_table(args, plan_args):
    """One row per pipeline stage (its first rank: others differ at most by ZeRO's step counters, and under
    Muon by the pieces of matrices they hold and assemble: print_muon), the busiest first."""
    layout = layout_of(args, plan_args.world, plan_args.device)
    config = cli.model_config(args, cli.data_vocab_size(args))
    print(describe(layout, args, config))
    rows = []
    for stage in range(layout.pp):
        prediction, where = predict_stage(config, layout, stage), first_of_stage(layout, stage)
        figures = rank_figures(prediction, layout, where)
        rows.append((sum(figures[f] for f in MEMORY), stage, figures,
                     node_split(layout, prediction, where, plan_args.gpus_per_node),
                     {dim: value for dim, value in comm_fields(rank_traffic(prediction, layout, where)).items()
                      if value}))
    rows.sort(key=lambda row: -row[0])
    unit, scale = ("GiB", 2**30) if rows[0][0] >= 2**30 else ("MiB", 2**20)
    print(f"{unit + ' per rank':18s} {'params':>9s} {'grads':>9s} {'optim':>9s} {'activ.':>9s} {'recomp.':>9s} "
          f"{'total':>9s} | sent per step ({unit}): in node, across nodes; by dimension and kind")
    for i, (total, stage, figures, (inside, across), comm) in enumerate(rows):
        who = f"{'busiest: ' if i == 0 and len(rows) > 1 else ''}stage {stage}"
        memory = "".join(f"{figures[f] / scale:9.2f} " for f in MEMORY)
        by_kind = ", ".join(f"{name[5:-6]} {value / scale:.2f}" for name, value in comm.items())
        print(f"{who:18s} {memory}{total / scale:9.2f} | {inside / scale:.2f}, {across / scale:.2f}; "
              f"{by_kind or 'none'}")
    print_muon(config, layout, unit, scale)
    print_expert_nodes(config, layout, plan_args.gpus_per_node)
    busiest = rows[0][1]
    prediction = predict_stage(config, layout, busiest)
    peaks = stage_peaks(config, layout, busiest, prediction)
    where = busiest_of_stage(layout, busiest, prediction)
    who = f"stage {busiest}'s first rank" if where == first_of_stage(layout, busiest) else \
        f"stage {busiest}'s busiest rank, {rank_of(layout, where)}"
    print(f"peak resident memory of {who} ({unit}, with {PROCESS_BYTES / scale:.2f} for "
          f"the interpreter and PyTorch): start-up {peaks['startup_peak_bytes'] / scale:.2f}, step "
          f"{peaks['step_peak_bytes'] / scale:.2f}, checkpoint save {peaks['save_peak_bytes'] / scale:.2f}, load "
          f"{peaks['load_peak_bytes'] / scale:.2f}")


def print_expert_nodes(config, layout, gpus_per_node):
    """With experts over several ep ranks, where a token's experts lie (expert_nodes, for the first rank of the
    last stage: every ep group lies alike): the nodes of its ep group, the share of the dispatch staying inside
    the node, and under group-limited routing the nodes a token can reach. ep.py sends each (token, expert)
    pair on its own (no copy per node forwarded inside it, as DeepSeek-V3's kernels do), so under balanced
    routing the limit leaves the bytes as they are: it bounds the nodes a token reaches."""
    if not config.n_experts or layout.ep == 1:
        return
    where = first_of_stage(layout, layout.placement.last_rank)
    nodes = expert_nodes(config, layout, where, gpus_per_node)
    print(f"experts: an ep group of {layout.ep} ranks on {nodes.nodes} of the nodes ({gpus_per_node} GPUs each); "
          f"{nodes.near} of a rank's {nodes.peers} dispatch peers on its own node, so {nodes.near}/{nodes.peers} of "
          f"its all-to-all stays inside")
    if config.n_group > 1:
        print(f"group-limited routing: {config.n_experts // config.n_group} experts a group on at most "
              f"{nodes.group_nodes} node(s); a token's {config.top_k} experts lie on at most {nodes.token_nodes} of "
              f"the {nodes.nodes} node(s) ({config.topk_group} of {config.n_group} groups; without the limit "
              f"{min(config.top_k, nodes.nodes)}). Each (token, expert) pair travels on its own, so the limit "
              f"bounds the nodes a token reaches, not the bytes")


def print_muon(config, layout, unit, scale):
    """Under Muon, per stage, how its ranks differ: the bytes each sends in a step's two all-to-alls (least,
    mean, most: an owner answers for its matrices), the optimizer state Muon saves them (one momentum in
    place of AdamW's two moments for the matrices' pieces) and the most its step holds beyond the state."""
    if layout.optimizer != "muon":
        return
    how = "every holder" if layout.muon_gather else "one owner"
    print(f"Muon ({how} assembling each matrix, over a stage's {layout.stage} ranks), per rank ({unit}):")
    for stage in range(layout.pp):
        ranks = muon_ranks(config, layout, stage)
        sent = [r.sent / scale for r in ranks]
        saved = max(sum(r.elements.values()) for r in ranks) * layout.master_bytes / scale
        print(f"  stage {stage}: sends {min(sent):.2f} to {max(sent):.2f} a step (mean {sum(sent) / len(sent):.2f}), "
              f"optimizer state up to {saved:.2f} below AdamW's, the step's working set up to "
              f"{max(r.working for r in ranks) / scale:.2f}")


def powers_of_two(limit):
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def candidate_layouts(args, world, gpus_per_node, device="cpu"):
    """Every (tp, pp, cp, ep, expert-tp, zero, dp_shard, recompute) train.py accepts for these flags on `world`
    ranks, tp within a node (its collectives are on every block's critical path) and sequence parallelism on
    with tp (the same traffic for less memory); the experts' split folded over each stage's ranks
    (expert_splits); ZeRO with hybrid sharding too (hybrid_shards)."""
    config = cli.model_config(args, cli.data_vocab_size(args))
    for tp in powers_of_two(min(gpus_per_node, config.n_kv_heads, world)):
        for pp_size in powers_of_two(min(config.n_layer, world // tp)):
            for cp in powers_of_two(world // (tp * pp_size)):
                dp = world // (tp * pp_size * cp)
                for ep, expert_tp in expert_splits(config, dp * cp * tp, tp):
                    for zero in range(4):
                        for dp_shard in [0, *(hybrid_shards(dp, cp, gpus_per_node) if zero else ())]:
                            for recompute in ("none", "selective", "full"):
                                candidate = argparse.Namespace(**{
                                    **vars(args), "tp": tp, "pp": pp_size, "cp": cp, "ep": ep,
                                    "expert_tp": expert_tp, "zero": zero, "dp_shard": dp_shard,
                                    "recompute": recompute, "sp": tp > 1})
                                try:
                                    yield candidate, layout_of(candidate, world, device)
                                except (cli.ConfigError, ValueError):
                                    continue


def expert_splits(config, stage, tp):
    """The (ep, expert_tp) --search tries for a stage of `stage` ranks: ep any divisor of both the experts
    and the stage's ranks (folded over them, it costs no ranks of its own), the experts whole (expert_tp 1,
    DeepSeek-V3's choice) or split over the tp ranks as the dense layers are (expert_tp = tp, the layout
    before folding). Without experts only (1, 1)."""
    if not config.n_experts:
        return [(1, 1)]
    common = math.gcd(config.n_experts, stage)
    eps = [n for n in range(1, common + 1) if common % n == 0]
    return [(ep, expert_tp) for ep in eps for expert_tp in sorted({1, tp}) if stage % (ep * expert_tp) == 0]


def hybrid_shards(dp, cp, gpus_per_node):
    """The dp_shard values --search tries: those under dp whose dense shard group (dp_shard x cp ranks) is at
    most a node's worth of ranks. That takes in every shard group lying inside a node (dp_shard x pp x cp x
    tp ranks at most a node: the gathers and reductions on its links, the copies' all-reduce alone across
    nodes), and small groups spread over as many nodes (less optimizer memory than no ZeRO, a shorter ring
    than sharding over all of dp). A shard group of one rank, which would shard nothing, is left out."""
    return [n for n in powers_of_two(dp) if n < dp and dp % n == 0 and 1 < n * cp <= gpus_per_node]


def busiest_of_stage(layout, stage, prediction):
    """The coordinates of the rank whose peak stands for its pipeline stage's: the first (the others differ by
    ZeRO's step counters alone), or under Muon the one whose step holds most beyond the rest (an owner of
    large matrices: the largest working set, less the moments Muon saves it)."""
    if not prediction["muon"]:
        return first_of_stage(layout, stage)
    place = max(range(layout.stage), key=lambda p: prediction["muon"][p].working
                - sum(prediction["muon"][p].elements.values()) * layout.master_bytes)
    return stage_rank(layout, stage, place)


def stage_peaks(config, layout, stage, prediction):
    """phase_peaks of a pipeline stage's busiest rank (busiest_of_stage), from the stage's prediction
    (predict_stage)."""
    where = busiest_of_stage(layout, stage, prediction)
    return phase_peaks(layout, rank_figures(prediction, layout, where), working_sets(config, layout, stage), where)


def device_peak(config, layout, stage, prediction):
    """The most a GPU of this pipeline stage holds (its busiest rank): the peak of start-up, a step or a load,
    without the interpreter and PyTorch, which stay on the host, as does a save's copy."""
    peaks = stage_peaks(config, layout, stage, prediction)
    return max(peaks[f"{phase}_peak_bytes"] for phase in ("startup", "step", "load")) - PROCESS_BYTES


# --search under Muon plans the layouts whose ranks step at most this many optimizer pieces in all (every stage's):
# the planner gathers their Segments and assigns the owners as each rank's start-up in train.py does, about ten
# seconds a million
MUON_SEARCH_PIECES = 200_000


def stage_pieces(config, layout, stage):
    """How many pieces the optimizers of a pipeline stage's ranks step in all (of which Muon's Segments, one
    or a few a piece of a matrix): under ZeRO about a piece per parameter and shard of each bucket, held by
    each of the stage's ranks in the shard's place; without ZeRO every parameter on every rank."""
    total = 0
    for kind, params in optimizer_sets(config, layout, stage):
        if not layout.zero:
            total += layout.stage * len(params)
            continue
        group = layout.shard_group(kind)
        total += layout.stage // group * sum(group + len(b.sizes) for b in zero_buckets(params, group, layout))
    return total


def muon_floor(config, layout):
    """Less than the worst stage's device peak under Muon, without planning its assembly: AdamW's less one
    moment of the rank's pieces (Muon keeps at least one of AdamW's two, and its step's working set comes
    on top)."""
    adamw = replace(layout, optimizer="adamw")
    floors = []
    for stage in range(layout.pp):
        prediction = predict_stage(config, adamw, stage)
        optim = rank_figures(prediction, adamw, first_of_stage(adamw, stage))["optim_bytes"]
        floors.append(device_peak(config, adamw, stage, prediction) - optim // 2)
    return max(floors)


def busiest_traffic(layout, stages, gpus_per_node):
    """(across, inside): the bytes a step sends across nodes and inside one by the rank of the stage that sends
    most across (busiest_of_stage's; a pipeline is as slow as its slowest stage: with dense first layers, not
    the stage holding most)."""
    return max(node_split(layout, prediction, busiest_of_stage(layout, stage, prediction), gpus_per_node)[::-1]
               for stage, prediction in enumerate(stages))


def search(args, plan_args):
    """The layouts whose every GPU's peak (device_peak) fits --memory, least traffic across nodes first (of the
    stage sending most across, busiest_traffic). Under Muon, those that cannot fit (muon_floor) are left out
    before their assembly is planned, and so are those too large to plan here (MUON_SEARCH_PIECES), which are
    counted."""
    config = cli.model_config(args, cli.data_vocab_size(args))
    fits, too_large = [], 0
    for candidate, layout in candidate_layouts(args, plan_args.world, plan_args.gpus_per_node,
                                                 plan_args.device):
        if layout.optimizer == "muon":
            if muon_floor(config, layout) > plan_args.memory:
                continue
            if sum(stage_pieces(config, layout, stage) for stage in range(layout.pp)) > MUON_SEARCH_PIECES:
                too_large += 1
                continue
        stages = [predict_stage(config, layout, stage) for stage in range(layout.pp)]
        peaks = [device_peak(config, layout, stage, stages[stage]) for stage in range(layout.pp)]
        memory = max(peaks)
        if memory <= plan_args.memory:
            across, inside = busiest_traffic(layout, stages, plan_args.gpus_per_node)
            fits.append((across, inside, memory, layout))
    fits.sort(key=lambda fit: fit[:3])
    if too_large:
        print(f"(left out: {too_large} layouts whose ranks step over {MUON_SEARCH_PIECES:,} optimizer pieces in all, "
              f"too many to assign Muon's owners here; plan one alone without --search)")
    print(f"{len(fits)} layouts of {args.model} on {plan_args.world} ranks fit {plan_args.memory / 2**30:.1f} GiB "
          f"per rank ({args.micro_batches} micro-batches, global batch {args.batch_size}, {args.dtype}, "
          f"{args.schedule}); least traffic across nodes ({plan_args.gpus_per_node} GPUs each) first:")
    print(f"{'dp':>5s} {'tp':>3s} {'pp':>3s} {'cp':>3s} {'ep':>3s} {'etp':>3s} {'ZeRO':>4s} {'dp-shard':>8s} "
          f"{'recompute':>9s} {'memory GiB':>10s} {'across GiB':>10s} {'in node GiB':>11s}")
    for across, inside, memory, lay in fits[:plan_args.top or None]:
        shard = str(lay.dp_shard) if lay.replicas > 1 else "-"  # (-: ZeRO's shards span all of dp, or no ZeRO)
        print(f"{lay.dp:5d} {lay.tp:3d} {lay.pp:3d} {lay.cp:3d} {lay.ep:3d} {lay.expert_tp:3d} {lay.zero:4d} "
              f"{shard:>8s} {lay.recompute:>9s} {memory / 2**30:10.2f} {across / 2**30:10.2f} {inside / 2**30:11.2f}")
    return fits


def main(argv=None):
    plan_args, args = parse_args(argv)
    try:
        if plan_args.search:
            search(args, plan_args)
        elif plan_args.json:
            print(json.dumps({**predict(args, plan_args.world, plan_args.device),
                              **predict_peaks(args, plan_args.world, plan_args.device)}))
        else:
            print_table(args, plan_args)
    except cli.ConfigError as e:
        sys.exit(f"python -m tools.plan: error: {e}")


if __name__ == "__main__":
    main()
