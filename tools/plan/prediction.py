"""The prediction: every rank's memory and traffic, under log.jsonl's names (predict), from each pipeline
stage's (predict_stage)."""
import functools
from collections import Counter
from dataclasses import replace

import pp
import train
from dp import ring_bytes_sent
from model import GPTConfig
from tools.plan.activations import activation_peak
from training.count.buckets import padded
from training.count.layout import coordinates, group_index, layout_of, stage_place
from training.count.memory import ADAM_STEP_BYTES, stage_states, state_memory
from tools.plan.muon import muon_ranks
from training.count.parameters import config_key, rank_parameters
from tools.plan.traffic import cp_traffic, fp8_traffic, moe_traffic, pp_traffic, ring_differs_by_rank, tp_traffic
from training import cli


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
    per_micro_batch = {"tp": tp_traffic(config, layout, layers, first, last), "cp": cp_traffic(config, layout, layers),
                       **fp8_traffic(config, layout, layers), **moe_traffic(config, layout, layers)}
    if ring_differs_by_rank(config, layout):  # (each cp rank's, the first's "cp" too)
        per_micro_batch.update({f"cp {r}": cp_traffic(config, layout, layers, r) for r in range(1, layout.cp)})
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
    """The stage's traffic as the rank at `where` sends it: its cp rank's ring ("cp {r}", where it differs),
    and under Muon with the all-to-alls of its optimizers' assembly ("optim"), which differ from rank to rank
    (the owners answer for the matrices they assemble)."""
    traffic = {group: counter for group, counter in stage_prediction["traffic"].items() if not group.startswith("cp ")}
    traffic["cp"] = stage_prediction["traffic"].get(f"cp {where['cp']}", traffic["cp"])  # (see ring_differs_by_rank)
    if stage_prediction["muon"]:
        traffic["optim"] = Counter(all_to_all=muon_rank(stage_prediction, layout, where).sent)
    return traffic


LOGGED_UNDER = {  # traffic group -> the dimension train.py logs it under (the counter of the file that sends it)
    "dense": "dp", "expert": "dp", "dense_replicas": "dp", "expert_replicas": "dp",  # dp.py's
    "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep",
    "tp_rows": "ep", "expert_tp": "ep",  # ep.py's all-to-alls over the tp and expert-tp groups
    "expert_tp_bias": "tp",              # tp.py's all-reduce over the expert-tp group
    "optim": "optim",                    # training/muon.py's all-to-alls over the stage
    "fp8": "fp8", "fp8_expert_tp": "fp8"}  # training/fp8.py's maxima over the tp and expert-tp groups


def comm_fields(traffic):
    """Traffic under log.jsonl's names, comm_<dim>_<kind>_bytes (dp: dense and expert averaging together, and
    hybrid sharding's sums over the copies; ep: every row ep.py moves, whichever group it travels in; optim:
    Muon's assembly of the matrices)."""
    by_dim = {dim: Counter() for dim in train.COMM_KINDS}
    for group, counter in traffic.items():
        by_dim[LOGGED_UNDER[group]].update(counter)
    return {f"comm_{dim}_{kind}_bytes": by_dim[dim].get(kind, 0)
            for dim, kinds in train.COMM_KINDS.items() for kind in kinds}


def predict(args, world):
    """{field: [value of rank 0, rank 1, ...]} for the run train.py would make of args on `world` ranks:
    log.jsonl's memory and traffic fields, and recompute_bytes (see activation_peak)."""
    layout = layout_of(args, world)
    config = cli.model_config(args, cli.data_vocab_size(args))
    stages = [predict_stage(config, layout, stage) for stage in range(layout.pp)]
    ranks = []
    for rank in range(world):
        where = coordinates(layout, rank)
        stage = stages[where["pp"]]
        ranks.append({**rank_figures(stage, layout, where), **comm_fields(rank_traffic(stage, layout, where))})
    return {field: [r[field] for r in ranks] for field in ranks[0]}
