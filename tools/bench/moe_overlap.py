"""The experts' all-to-alls beside computation: ep 2 under 1F1B (pp 2) with 4 micro-batches, three arms alternated
by round: the exchanges in chunks within each layer (train.py --ep-overlap 4), each micro-batch's beside another's
(--schedule combined, pp.py's paired forward and backward, --ep-overlap 1), and waited for. From each rank's trace
(--profile), the share of the time some exchange was in flight that the rank computed rather than waited; from
the logs, the step times and their ratios to the waited arm's over the rounds."""
import glob
import json
import os
import statistics
from collections import defaultdict, deque

from tools.bench.common import read_log, torchrun

# arm: its flags (the exchanges in 4 chunks each; whole, each micro-batch's beside another's; waited for)
MOE_OVERLAP_ARMS = {"overlapped": ["--schedule", "1f1b", "--ep-overlap", "4"],
                    "paired": ["--schedule", "combined", "--ep-overlap", "1"], "waited": ["--schedule", "1f1b"]}
MOE_OVERLAP_RANKS = 4  # --pp 2 x --ep 2
DRAWN_RANK = 3         # the last stage's: under combined 1F1B it pairs all but the first micro-batch


def moe_overlap_argv(settings, arm):
    """train.py's flags for one arm: the settings' model with 4 experts (top 2) on ep 2 under pp 2, 4
    micro-batches, every step after the first traced."""
    run = settings["moe_overlap"]
    return ["--model", settings["model"], "--experts", "4", "--top-k", "2", "--ep", "2", "--pp", "2",
            "--micro-batches", "4", "--batch-size", str(run["batch_size"]), "--steps", str(run["steps"]),
            "--eval-interval", str(run["steps"]), "--log-interval", "1", "--profile", f"1-{run['steps'] - 1}",
            *MOE_OVERLAP_ARMS[arm]]


def exchange_spans(events):
    """[(name, start, wait start, end)] in microseconds of every exchange in a trace, in the order they started:
    each in flight from its `<name> start` to the end of its `<name> wait` (ep.Exchange names them; a name's
    starts and waits come in turn), the rank idle only while it waits."""
    marks = sorted((e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ep.")),
                   key=lambda e: e["ts"])
    started, spans = defaultdict(deque), []
    for e in marks:
        name = e["name"]
        if name.endswith(" start"):
            started[name.removesuffix(" start")].append(e["ts"])
        elif name.endswith(" wait") and started[name.removesuffix(" wait")]:
            spans.append((name.removesuffix(" wait"), started[name.removesuffix(" wait")].popleft(), e["ts"],
                          e["ts"] + e["dur"]))
    return sorted(spans, key=lambda span: span[1])


def covered(intervals):
    """The length of the union of [start, end) intervals."""
    length, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        length += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return length


def overlapped_fraction(events):
    """(in flight, waited) seconds of the experts' exchanges in one rank's trace: the time some exchange was in
    flight, and the time the rank waited for one (unions: exchanges overlap one another, and a paired
    micro-batch waits in its own thread). 1 - waited / in flight is the share computation ran beside."""
    spans = exchange_spans(events)
    in_flight = covered([(start, end) for _, start, _, end in spans])
    waited = covered([(wait, end) for _, _, wait, end in spans])
    return in_flight / 1e6, waited / 1e6


def exchanges(events):
    """[(name, start, wait start, end)] in seconds of each exchange of the trace's first step (from that step's
    start; the last one also evaluates), in the order they started: what plot.py draws."""
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("step ")]
    first = min(steps, key=lambda e: e["ts"])
    return [(name, *((t - first["ts"]) / 1e6 for t in times)) for name, *times in exchange_spans(events)
            if first["ts"] <= times[0] and times[2] <= first["ts"] + first["dur"]]


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
    """Each arm in turn in each round (the order rotated, so the machine's drift cancels): each arm's fraction
    per round (its traces), step times (the logs' steps after the first), the ratio of each overlapping arm's
    step time to the waited one's per round, and the losses of all (the same numbers)."""
    runs, rounds, arms = os.path.join(out, "moe_overlap"), settings["moe_overlap"]["rounds"], list(MOE_OVERLAP_ARMS)
    per_round = []
    for r in range(rounds):
        measured = {}
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            print(f"bench: experts' all-to-alls, round {r + 1} of {rounds}: {arm}", flush=True)
            name = f"{arm}_{r}"
            torchrun(MOE_OVERLAP_RANKS, "train.py", *moe_overlap_argv(settings, arm), "--out", runs, "--name", name)
            log = read_log(os.path.join(runs, name, "log.jsonl"))
            measured[arm] = dict(step_s=statistics.mean(e["step_s"] for e in log[1:]),
                                 losses=[e["loss"] for e in log], **traced_fraction(os.path.join(runs, name)))
        per_round.append(measured)
    summary = {}
    for arm in ("overlapped", "paired"):
        ratios = [m[arm]["step_s"] / m["waited"]["step_s"] for m in per_round]
        fractions = [m[arm]["fraction"] for m in per_round]
        summary[arm] = dict(flags=moe_overlap_argv(settings, arm), fraction=statistics.median(fractions),
                            fraction_range=[min(fractions), max(fractions)], step_time_ratio=statistics.median(ratios),
                            ratio_range=[min(ratios), max(ratios)],
                            exchanges=exchanges(read_trace(os.path.join(runs, f"{arm}_{rounds - 1}"), DRAWN_RANK)))
    return dict(rounds=rounds, drawn_rank=DRAWN_RANK, **summary,
                max_loss_difference=max(abs(a - b) for m in per_round for arm in ("overlapped", "paired")
                                        for a, b in zip(m[arm]["losses"], m["waited"]["losses"])),
                per_round=[{arm: {k: v for k, v in row.items() if k != "losses"} for arm, row in m.items()}
                           for m in per_round])
