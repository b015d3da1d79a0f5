"""The planner's strategies measured: tools/plan/figure.py's strategies at a size this machine runs, the
busiest rank's logged memory beside the planner's prediction for it, and the planner's figure at full size
(plot.py draws both from planner.json)."""
import os

from tools.bench.common import read_log, torchrun


def planner_check(out, seq_lens=(128, 512), model=("--model", "medium", "--arch", "llama", "--kv-heads", "8")):
    """tools/plan/figure.py's strategies (its memory figure) at a size this machine runs: each strategy alone on
    8 ranks (or one), for two sequence lengths and the three recomputation modes, one step each: the busiest
    rank's logged memory and tools/plan/'s prediction for that rank; and tools/plan/'s figure (planned_memory)."""
    from tools import plan
    runs, points = os.path.join(out, "planner"), []
    for label, world, flags in plan.STRATEGIES:
        model_flags = [*model, *(plan.EXPERTS if label.startswith("EP") else [])]
        for seq_len in seq_lens:
            for mode in ("none", "selective", "full"):
                name = f"{label.split()[0].replace('=', '')}_{seq_len}_{mode}"
                argv = [*plan.strategy_argv(model_flags, flags, world, seq_len, mode), "--steps", "1"]
                print(f"bench: planner check, {label}, {seq_len} tokens, recompute {mode}", flush=True)
                torchrun(world, "train.py", *argv, "--out", runs, "--name", name)
                record = read_log(os.path.join(runs, name, "log.jsonl"))[0]
                parts = dict(param="param_bytes", grad="grad_bytes", optim="optim_bytes",
                             activations="activation_peak_bytes")
                measured = [{key: record[field][r] for key, field in parts.items()} for r in range(world)]
                busiest = max(range(world), key=lambda r: sum(measured[r].values()))
                points.append(dict(strategy=label, seq_len=seq_len, recompute=mode, argv=argv, world=world,
                                   rank=busiest, measured=measured[busiest],
                                   predicted=plan.predicted_for(argv, world, busiest)))
    return dict(model=" ".join(model), strategies=plan.STRATEGIES, points=points, planned=plan.planned_memory())
