"""--search: every layout train.py accepts for the flags on --world ranks, those whose every GPU fits --memory,
least traffic across nodes first."""
import argparse
import math
from dataclasses import replace

from training.count.layout import first_of_stage, layout_of
from training.count.memory import zero_buckets
from tools.plan.muon import optimizer_sets
from tools.plan.nodes import node_split
from tools.plan.peak import busiest_of_stage, device_peak
from tools.plan.prediction import predict_stage, rank_figures
from training import cli


def powers_of_two(limit):
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def candidate_layouts(args, world, gpus_per_node):
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
                                    yield candidate, layout_of(candidate, world)
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
    for candidate, layout in candidate_layouts(args, plan_args.world, plan_args.gpus_per_node):
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
