"""The five pipeline schedules on one model: bubbles, step times and timelines, and pp.py's ZB-V beside
PyTorch's ScheduleZBVZeroBubble."""
import json
import os
import statistics

from tools.bench.common import read_log, torchrun, worker_result


PIPELINE_MODEL = ("--model", "medium", "--pp", "2", "--micro-batches", "8", "--batch-size", "32")


def pipeline_schedules(out, rounds=3, steps=4, schedules=("gpipe", "1f1b", "interleaved", "zb1", "zbv"),
                       model=PIPELINE_MODEL):
    """The five schedules on the same model, P and M, in turn in each round (the order rotated, so the
    machine's drift cancels): each run's measured bubble (the mean over its ranks and steps after the first)
    and step time, the zero-bubble schedules' bubble over 1F1B's per round, and the last round's timelines
    (train.py logs the last step's); then pp.py's ZB-V beside PyTorch's ScheduleZBVZeroBubble on the same
    model, P and M."""
    runs, per_round = os.path.join(out, "pipeline"), []
    for r in range(rounds):
        order = schedules[r % len(schedules):] + schedules[:r % len(schedules)]
        measured = {}
        for schedule in order:
            print(f"bench: pipeline schedules, round {r + 1} of {rounds}: {schedule}", flush=True)
            name = f"{schedule}{r}"
            torchrun(2, "train.py", *model, "--schedule", schedule, "--steps", str(steps), "--eval-interval",
                     str(steps), "--out", runs, "--name", name)
            log = read_log(os.path.join(runs, name, "log.jsonl"))
            measured[schedule] = dict(bubble=statistics.mean(b for e in log[1:] for b in e["pp_bubble"]),
                                      step_s=statistics.mean(e["step_s"] for e in log[1:]),
                                      formula=log[-1]["pp_bubble_formula"], timeline=log[-1]["pp_timeline"])
        per_round.append(measured)
    summary = {s: dict(bubble=statistics.median(m[s]["bubble"] for m in per_round),
                       bubble_range=[min(m[s]["bubble"] for m in per_round), max(m[s]["bubble"] for m in per_round)],
                       step_s=statistics.median(m[s]["step_s"] for m in per_round),
                       formula=per_round[0][s]["formula"], timeline=per_round[-1][s]["timeline"])
               for s in schedules}
    over_1f1b = {}
    for s in ("zb1", "zbv"):
        ratios = [m[s]["bubble"] / m["1f1b"]["bubble"] for m in per_round]
        over_1f1b[s] = dict(bubble_ratio=statistics.median(ratios), range=[min(ratios), max(ratios)])
    flags = dict(zip(model[::2], model[1::2]))
    settings = dict(model=flags["--model"], batch_size=int(flags["--batch-size"]),
                    micro_batches=int(flags["--micro-batches"]), rounds=2 * rounds, k=1)
    print("bench: pp.py's ZB-V against PyTorch's ScheduleZBVZeroBubble", flush=True)
    stdout = torchrun(2, "-m", "tools.bench", "--worker", "pp_zbv", "--settings", json.dumps(settings))
    against_pytorch = worker_result(stdout)
    return dict(flags=list(model), rounds=rounds, steps=steps, schedules=summary, over_1f1b=over_1f1b,
                zbv_against_pytorch=dict(against_pytorch, settings=settings),
                per_round=[{s: {k: v for k, v in m[s].items() if k != "timeline"} for s in schedules}
                           for m in per_round])
