"""The command line (python -m tools.plan): a table of each pipeline stage's first rank, --json, --search."""
import argparse
import json
import math
import sys

from training.count.layout import first_of_stage, layout_of, rank_of
from tools.plan.muon import muon_ranks
from tools.plan.nodes import expert_nodes, node_split
from training.count.parameters import config_key, model_parameters
from tools.plan.peak import PROCESS_BYTES, busiest_of_stage, predict_peaks, stage_peaks
from tools.plan.prediction import comm_fields, predict, predict_stage, rank_figures, rank_traffic
from tools.plan.search import search
from training import cli


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
    description = sys.modules[__package__].__doc__.split("\n")[0]  # (tools/plan/__init__.py's first line)
    p = argparse.ArgumentParser(prog="python -m tools.plan", description=description,
                                epilog="Every other flag is train.py's (python train.py --help).")
    p.add_argument("--world", type=int, required=True, help="ranks (GPUs) of the run")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (inside: fast links)")
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


def print_table(args, plan_args):
    """One row per pipeline stage (its first rank: others differ at most by ZeRO's step counters, and under
    Muon by the pieces of matrices they hold and assemble: print_muon), the busiest first."""
    layout = layout_of(args, plan_args.world)
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
    print(f"peak resident memory of {who} ({unit}, with a typical {PROCESS_BYTES / scale:.2f} "
          f"for the interpreter and PyTorch): start-up {peaks['startup_peak_bytes'] / scale:.2f}, step "
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


def main(argv=None):
    plan_args, args = parse_args(argv)
    try:
        if plan_args.search:
            search(args, plan_args)
        elif plan_args.json:
            print(json.dumps({**predict(args, plan_args.world), **predict_peaks(args, plan_args.world)}))
        else:
            print_table(args, plan_args)
    except cli.ConfigError as e:
        sys.exit(f"python -m tools.plan: error: {e}")
