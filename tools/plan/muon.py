"""Muon (--optimizer muon): each optimizer's pieces as training/muon.py's Segments, assembled by its functions
(the owners, the bytes of the two all-to-alls, the step's working set)."""
import functools
from collections import Counter
from dataclasses import replace
from typing import NamedTuple

from ep import is_expert_parameter
from model import GPTConfig
from training.count.buckets import unit_of
from training.count.layout import expert_coordinates, group_index, stage_place, stage_rank
from training.count.memory import zero_buckets
from training.count.parameters import config_key, model_parameters, rank_parameters, tp_sharded
from training import muon


def tp_split_dim(name):
    """The dimension tensor parallelism cuts a tp_sharded parameter along (tp.py's layouts): a row-parallel
    proj's columns, every other's rows (column-parallel layers, the vocabulary of the embedding and head)."""
    return 1 if name.endswith("proj.weight") else 0


def tp_split(name, layout, where, config):
    """Tensor parallelism's (dim, parts, part) of a parameter on the rank at `where`, as train.with_muon's
    split_of gives it to training/muon.py, or None if it is whole there: a routed expert's over expert-tp."""
    if not tp_sharded(name, config):
        return None
    if is_expert_parameter(name):
        return tp_split_dim(name), layout.expert_tp, expert_coordinates(layout, where)["expert_tp"]
    return tp_split_dim(name), layout.tp, where["tp"]


def local_shape(name, shape, layout, config):
    """A parameter's shape on a rank: its full shape, cut by tensor parallelism (a routed expert's by
    expert-tp)."""
    if not tp_sharded(name, config):
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
    (dp.Shard.named_pieces)."""
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
    shapes = {name: local_shape(name, shape, layout, config) for name, shape in model_parameters(config_key(config))}
    shapes.setdefault("lm_head.weight", shapes["tok_emb.weight"])  # a tied output layer's copy on the last stage
    instances = []
    for kind, params in optimizer_sets(config, layout, stage):
        held = {}
        for place in range(layout.stage):
            where = stage_rank(layout, stage, place)
            pieces = [(rank_name(name, config, layout, where), start, end, None)
                      for name, start, end in optimizer_pieces(params, layout, kind, where)]
            split = functools.partial(tp_split, layout=layout, where=where, config=config)
            found = muon.held_segments(pieces, shapes, config, split,
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
