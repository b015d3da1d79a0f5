"""The playbook's figure: per-rank memory of each strategy alone, by sequence length (plot.py draws it, and
tools/bench/planner.py measures it)."""
from tools.plan.layout import first_of_stage, layout_of
from tools.plan.prediction import predict_stage, rank_figures
from training import cli


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
