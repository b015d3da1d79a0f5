"""Part 1, the table: the seed table's configurations (CONFIGS) run by train.py and summarised, the 2-rank
scaling check, and the recomputation modes."""
import json
import os
import statistics
import subprocess
import sys

from tools.bench.common import ENV, REPO, read_log, tokens_per_s, torchrun


# The seed table's rows: (run name, ranks, flags, what it demonstrates). dp is what the others leave.
CONFIGS = [
    ("gpu1_tp1_pp1_cp1_ep1", 1, [], "DP=1 baseline"),
    ("gpu2_tp1_pp1_cp1_ep1", 2, [], "DP=2"),
    ("gpu4_tp1_pp1_cp1_ep1", 4, [], "DP=4"),
    ("gpu8_tp1_pp1_cp1_ep1", 8, [], "DP=8"),
    ("gpu8_tp2_pp1_cp1_ep1", 8, ["--tp", "2"], "TP=2, DP=4"),
    ("gpu8_tp1_pp2_cp1_ep1", 8, ["--pp", "2"], "PP=2, DP=4"),
    ("gpu8_tp1_pp1_cp2_ep1", 8, ["--cp", "2"], "CP=2, DP=4"),
    # (ep folded over the dp ranks, as before folding; the second with the experts split as tp splits layers)
    ("gpu8_tp1_pp1_cp1_ep4", 8, ["--ep", "4", "--experts", "8"], "EP=4, DP=2"),
    ("gpu8_tp2_pp2_cp1_ep2", 8, ["--tp", "2", "--pp", "2", "--ep", "2", "--expert-tp", "2", "--experts", "8"],
     "TP=2, PP=2, EP=2"),
    ("gpu8_tp2_pp1_cp2_ep1", 8, ["--tp", "2", "--cp", "2"], "TP=2, CP=2, DP=2"),
]


def run_table(settings, out, names=None):
    runs = os.path.join(out, "runs")
    for name, world, flags, _ in CONFIGS:
        if names and name not in names:
            continue
        print(f"bench: {name} ({world} ranks)", flush=True)
        peak = ["--peak-tflops", str(settings["peak_tflops"])] if settings.get("peak_tflops") else []
        torchrun(world, "train.py", "--model", settings["model"], "--arch", settings.get("arch", "gpt"),
                 "--batch-size", str(settings["batch_size"]),
                 "--micro-batches", str(settings["micro_batches"]), "--steps", str(settings["steps"]),
                 "--eval-interval", str(settings["eval_interval"]), "--dtype", settings.get("dtype", "float32"),
                 "--out", runs, "--name", name, *peak, *flags)


def scaling_check(settings, out, cores):
    """Data parallelism at n = min(2, cores) ranks against n times one rank, timed alternately.

    This is the 2-core efficiency on its own, measured so that the machine's drift cancels: it is
    shared, and its speed wanders by tens of percent over minutes, so one run of each, minutes apart
    (as in the table), compares two moments as much as two programs. Each round runs back to back
    one rank, n data-parallel ranks, and n independent one-rank trainings at once, each on 1/n of the
    batch with no communication at all (how far the machine itself scales). Every round gives its
    own ratios; their median and range are reported.
    """
    n, steps, rounds = min(2, cores), settings["scaling_steps"], settings["scaling_rounds"]
    runs = os.path.join(out, "scaling")
    common = ["--model", settings["model"], "--micro-batches", str(settings["micro_batches"]),
              "--steps", str(steps), "--eval-interval", str(steps), "--out", runs]
    throughput = lambda name: tokens_per_s(read_log(os.path.join(runs, name, "log.jsonl"))[settings["skip"]:])  # noqa: E731
    per_round = []
    for r in range(rounds):
        print(f"bench: scaling check, round {r + 1} of {rounds}", flush=True)
        torchrun(1, "train.py", *common, "--batch-size", str(settings["batch_size"]), "--name", f"one{r}")
        torchrun(n, "train.py", *common, "--batch-size", str(settings["batch_size"]), "--name", f"dp{r}")
        alone = [subprocess.Popen([sys.executable, "train.py", *common, "--batch-size", str(settings["batch_size"] // n),
                                   "--name", f"alone{r}_{i}"], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL)
                 for i in range(n)]
        if any(proc.wait() for proc in alone):
            raise RuntimeError("an independent 1-rank training failed")
        one, dp = throughput(f"one{r}"), throughput(f"dp{r}")
        independent = sum(throughput(f"alone{r}_{i}") for i in range(n))
        per_round.append(dict(one_rank=one, data_parallel=dp, independent=independent,
                              efficiency=dp / (n * one), machine_scaling=independent / (n * one)))
    summary = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
    ranges = {f"{key}_range": [min(r[key] for r in per_round), max(r[key] for r in per_round)]
              for key in ("efficiency", "machine_scaling")}
    return dict(ranks=n, rounds=rounds, steps=steps, **summary, **ranges, per_round=per_round)


def recomputation_check(settings, out, modes=("none", "selective", "full")):
    """The three recomputation modes of train.py on one rank, run in turn in each round (so the machine's
    drift cancels): activation memory (exact, from the log) and the step time of each against none's,
    per round; the median and range of those ratios are reported."""
    steps, rounds = settings["scaling_steps"], settings["scaling_rounds"]
    runs = os.path.join(out, "recompute")
    common = ["--model", settings["model"], "--arch", settings.get("arch", "gpt"), "--batch-size",
              str(settings["batch_size"]), "--micro-batches", str(settings["micro_batches"]), "--steps", str(steps),
              "--eval-interval", str(steps), "--out", runs]
    per_round = []
    for r in range(rounds):
        print(f"bench: recomputation, round {r + 1} of {rounds}", flush=True)
        logs = {}
        for mode in modes:
            torchrun(1, "train.py", *common, "--recompute", mode, "--name", f"{mode}{r}")
            logs[mode] = read_log(os.path.join(runs, f"{mode}{r}", "log.jsonl"))
        per_round.append({mode: dict(activation_peak_bytes=logs[mode][-1]["activation_peak_bytes"][0],
                                     tokens_per_s=tokens_per_s(logs[mode][settings["skip"]:])) for mode in modes})
    result = {}
    for mode in modes:
        slowdown = [r["none"]["tokens_per_s"] / r[mode]["tokens_per_s"] for r in per_round]
        result[mode] = dict(activation_peak_bytes=per_round[0][mode]["activation_peak_bytes"],
                            step_time_vs_none=statistics.median(slowdown), range=[min(slowdown), max(slowdown)])
    return dict(model=settings["model"], rounds=rounds, steps=steps, modes=result, per_round=per_round)


def summarise(out, settings, cores):
    """One summary per configuration, from its log; efficiency against the compute-bound ceiling, and MFU
    where train.py knew the device's peak (GPUs of training/mfu.py's table, or --peak-tflops)."""
    rows = []
    for name, world, flags, what in CONFIGS:
        path = os.path.join(out, "runs", name, "log.jsonl")
        if not os.path.exists(path):
            continue
        log = read_log(path)
        steady = log[settings["skip"]:] or log
        throughput = tokens_per_s(steady)
        mean = lambda key: statistics.mean(statistics.mean(e[key]) for e in steady)  # noqa: E731 (over steps, ranks)
        comm = {}
        for key in steady[0]:
            if key.startswith("comm_") and key.endswith("_bytes"):
                dim = key.split("_")[1]
                comm[dim] = comm.get(dim, 0) + mean(key) * world  # all ranks, per step
        val = [e["val_loss"] for e in log if "val_loss" in e]
        with open(os.path.join(out, "runs", name, "config.json")) as f:
            config = json.load(f)
        flops, peak = statistics.mean(e["flops_per_token"] for e in steady) * throughput, config["peak_flops"]
        rows.append(dict(
            model_flops_per_s=flops, mfu=flops / (world * peak) if peak else None,
            name=name, world=world, flags=flags, demonstrates=what, tokens_per_s=throughput,
            final_val_loss=val[-1] if val else None, final_loss=log[-1]["loss"],
            param_bytes=max(log[-1]["param_bytes"]), grad_bytes=max(log[-1]["grad_bytes"]),
            optim_bytes=max(log[-1]["optim_bytes"]), activation_bytes=max(log[-1]["activation_peak_bytes"]),
            comm_bytes_per_step=comm, compute_s=mean("compute_s"), comm_wait_s=mean("comm_wait_s"),
            bubble=mean("pp_bubble") if "pp_bubble_formula" in log[-1] else None,
            bubble_formula=log[-1].get("pp_bubble_formula"), step_s=statistics.mean(e["step_s"] for e in steady)))
    base = next((r["tokens_per_s"] for r in rows if r["world"] == 1), None)
    for r in rows:
        r["ceiling_tokens_per_s"] = base * min(r["world"], cores) if base else None
        r["efficiency"] = r["tokens_per_s"] / r["ceiling_tokens_per_s"] if base else None
    return rows
