"""The experts' all-to-alls beside their computation (train.py --ep-overlap): ep 2 under 1F1B (pp 2) with 4
micro-batches, with the overlap and without, alternated by round. From each rank's trace (--profile), the
fraction of the exchanges' time in flight that the rank computed beside rather than waited; from the logs,
the step times and their ratio over the rounds."""
import glob
import json
import os
import statistics
from collections import defaultdict, deque

from tools.bench.common import read_log, torchrun

MOE_OVERLAP_ARMS = {"overlapped": "4", "waited": "0"}  # arm: train.py --ep-overlap (chunks; 0: none)
MOE_OVERLAP_RANKS = 4  # --pp 2 x --ep 2


def moe_overlap_argv(settings, arm):
    """train.py's flags for one arm: the settings' model with 4 experts (top 2) on ep 2 under 1F1B, 4
    micro-batches, every step after the first traced."""
    run = settings["moe_overlap"]
    return ["--model", settings["model"], "--experts", "4", "--top-k", "2", "--ep", "2", "--pp", "2", "--schedule",
            "1f1b", "--micro-batches", "4", "--batch-size", str(run["batch_size"]), "--steps", str(run["steps"]),
            "--eval-interval", str(run["steps"]), "--log-interval", "1", "--profile", f"1-{run['steps'] - 1}",
            "--ep-overlap", MOE_OVERLAP_ARMS[arm]]


def overlapped_fraction(events):
    """(in flight, waited) seconds of the experts' exchanges in one rank's trace: each exchange in flight from
    its `<name> start` to the end of its `<name> wait` (ep.Exchange names them; a name's starts and waits come
    in turn), the rank idle only while it waits. 1 - waited / in flight is the share computation ran beside."""
    marks = sorted((e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ep.")),
                   key=lambda e: e["ts"])
    started, in_flight, waited = defaultdict(deque), 0.0, 0.0
    for e in marks:
        name = e["name"]
        if name.endswith(" start"):
            started[name.removesuffix(" start")].append(e["ts"])
        elif name.endswith(" wait"):
            begin = started[name.removesuffix(" wait")].popleft()
            in_flight += (e["ts"] + e["dur"] - begin) / 1e6
            waited += e["dur"] / 1e6
    return in_flight, waited


def exchanges(events):
    """[(name, start, wait start, end)] in seconds of each exchange of the trace's first step (from that step's
    start; the last one also evaluates), in the order they started: what plot.py draws."""
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("step ")]
    first = min(steps, key=lambda e: e["ts"])
    within = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ep.")
              and first["ts"] <= e["ts"] <= first["ts"] + first["dur"]]
    started, drawn = defaultdict(deque), []
    for e in sorted(within, key=lambda e: e["ts"]):
        name = e["name"]
        if name.endswith(" start"):
            started[name.removesuffix(" start")].append(e["ts"])
        elif name.endswith(" wait") and started[name.removesuffix(" wait")]:
            begin = started[name.removesuffix(" wait")].popleft()
            drawn.append((name.removesuffix(" wait"), *((t - first["ts"]) / 1e6 for t in
                                                        (begin, e["ts"], e["ts"] + e["dur"]))))
    return sorted(drawn, key=lambda row: row[1])


def read_trace(run_folder, rank):
    with open(os.path.join(run_folder, "traces", f"rank{rank}.json")) as f:
        return json.load(f)["traceEvents"]


def traced_fraction(run_folder):
    """The overlapped fraction over every rank's trace of a run, and each rank's."""
    ranks = len(glob.glob(os.path.join(run_folder, "traces", "rank*.json")))
    per_rank = [overlapped_fraction(read_trace(run_folder, rank)) for rank in range(ranks)]
    in_flight, waited = sum(i for i, _ in per_rank), sum(w for _, w in per_rank)
    return dict(fraction=1 - waited / in_flight if in_flight else 0.0,
                per_rank=[1 - w / i if i else 0.0 for i, w in per_rank], in_flight_s=in_flight, waited_s=waited)


def moe_overlap_check(settings, out):
    """Each arm in turn in each round (the order rotated, so the machine's drift cancels): the overlapped arm's
    fraction per round (its traces), both arms' step times (the logs' steps after the first), the ratio of
    the overlapped step time to the waited one per round, and the losses of both (the same numbers)."""
    runs, rounds, arms = os.path.join(out, "moe_overlap"), settings["moe_overlap"]["rounds"], list(MOE_OVERLAP_ARMS)
    per_round = []
    for r in range(rounds):
        measured = {}
        for arm in arms[r % 2:] + arms[:r % 2]:
            print(f"bench: experts' all-to-alls, round {r + 1} of {rounds}: {arm}", flush=True)
            name = f"{arm}_{r}"
            torchrun(MOE_OVERLAP_RANKS, "train.py", *moe_overlap_argv(settings, arm), "--out", runs, "--name", name)
            log = read_log(os.path.join(runs, name, "log.jsonl"))
            measured[arm] = dict(step_s=statistics.mean(e["step_s"] for e in log[1:]),
                                 losses=[e["loss"] for e in log], **traced_fraction(os.path.join(runs, name)))
        per_round.append(measured)
    ratios = [m["overlapped"]["step_s"] / m["waited"]["step_s"] for m in per_round]
    fractions = [m["overlapped"]["fraction"] for m in per_round]
    return dict(flags=moe_overlap_argv(settings, "overlapped"), rounds=rounds,
                fraction=statistics.median(fractions), fraction_range=[min(fractions), max(fractions)],
                step_time_ratio=statistics.median(ratios), ratio_range=[min(ratios), max(ratios)],
                max_loss_difference=max(abs(a - b) for m in per_round
                                        for a, b in zip(m["overlapped"]["losses"], m["waited"]["losses"])),
                exchanges=exchanges(read_trace(os.path.join(runs, f"overlapped_{rounds - 1}"), rank=0)),
                per_round=[{arm: {k: v for k, v in row.items() if k != "losses"} for arm, row in m.items()}
                           for m in per_round])
