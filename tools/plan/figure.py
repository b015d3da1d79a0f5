"""The playbook's figure: per-rank memory of each strategy alone, by sequence length (tools/bench/planner.py
measures it at a small size and writes it with the planner's figures, planned_memory and predicted_for, into
planner.json; plot.py draws that file)."""
from training.count.layout import first_of_stage, layout_of
from tools.plan.prediction import predict, predict_stage, rank_figures
from training import cli


# (label, ranks, flags): each strategy alone; EP needs a mixture-of-experts model (its flags add the experts).
STRATEGIES = [
    ("1 GPU", 1, []), ("ZeRO-1", 8, ["--zero", "1"]), ("ZeRO-2", 8, ["--zero", "2"]), ("ZeRO-3", 8, ["--zero", "3"]),
    ("TP=8 +SP", 8, ["--tp", "8", "--sp"]), ("PP=8", 8, ["--pp", "8", "--micro-batches", "8"]),
    ("CP=8", 8, ["--cp", "8"]), ("EP=8", 8, ["--ep", "8"]),
]
EXPERTS = ["--experts", "8", "--top-k", "2"]
MODES = ("none", "selective", "full")  # --recompute


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


def planned_memory(model="llama3-8b", moe="mixtral", seq_lens=tuple(2**i for i in range(10, 18))):
    """The figure's figures: {mode: {strategy: [busiest_memory, a sequence length each]}} for an 8B shape (EP:
    Mixtral 8x7B), without, with selective and with full recomputation, in bf16, and what they are of."""
    base = ["--model", model, "--arch", "llama", "--dtype", "bfloat16"]
    moe_base = ["--model", moe, "--arch", "llama", "--dtype", "bfloat16", *EXPERTS]
    memory = {mode: {label: [busiest_memory(strategy_argv(moe_base if label.startswith("EP") else base, flags, world,
                                                          seq_len, mode), world) for seq_len in seq_lens]
                     for label, world, flags in STRATEGIES} for mode in MODES}
    return dict(model=model, moe=moe, seq_lens=list(seq_lens), memory=memory)


def predicted_for(argv, world, rank):
    """{param, grad, optim, activations (with the block being recomputed, which the meter does not see)}: the
    prediction for one rank of a measured run."""
    figures = {field: values[rank] for field, values in predict(cli.parse_args(argv), world).items()}
    return dict(param=figures["param_bytes"], grad=figures["grad_bytes"], optim=figures["optim_bytes"],
                activations=figures["activation_peak_bytes"] + figures["recompute_bytes"])
