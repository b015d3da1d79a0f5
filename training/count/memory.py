"""Memory of parameters, gradients and optimizer state (the article's 16 Psi; ZeRO's 4+12/N, 2+14/N, 16/N), and the
traffic of data parallelism and ZeRO that comes with them."""
import functools
from collections import Counter
from dataclasses import replace
from typing import Callable, NamedTuple

from dp import ring_bytes_sent
from training.count.buckets import make_buckets, zero3_buckets
from training.count.layout import layout_of
from training.count.parameters import rank_parameters


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
    pipeline; under one (or combined 1F1B on a single stage: layout.scheduled), the schedule's no_sync defers
    the reduction to each chunk's last backward: once.
    ZeRO-3 gathers a unit before its forward and again before its backward (2M) without a pipeline; under
    one it keeps the unit gathered from its first forward to that reduction (reshard_after_forward False):
    once."""
    if layout.zero == 1:
        return 1, 1
    pipelined = layout.scheduled
    reductions = 1 if pipelined else layout.micro_batches
    gathers = (1 if pipelined else 2 * layout.micro_batches) if layout.zero == 3 else 1
    return reductions, gathers


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
