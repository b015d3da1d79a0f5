"""ZeRO-3 beside ZeRO-1 under a pipeline (1F1B, pp 2 x dp 2): step time, each rank's memory, the bytes dp and
pp send."""
import json
import os
import shutil
import statistics

from tools.bench.common import read_log, reset_peak, status_kib, torchrun, worker_result


ZERO_PIPELINE_ARMS = {"zero1": "1", "zero3": "3"}  # arm: train.py --zero
ZERO_PIPELINE_RANKS = 4  # --pp 2, so dp = 2
ZERO_PIPELINE_FIELDS = ("param_bytes", "grad_bytes", "optim_bytes", "activation_peak_bytes", "peak_resident_bytes",
                        "comm_dp_reduce_scatter_bytes", "comm_dp_all_gather_bytes", "comm_dp_all_reduce_bytes",
                        "comm_pp_send_recv_bytes")


def zero_pipeline_argv(settings, arm):
    """train.py's flags for one arm of the ZeRO-under-1F1B comparison: the settings' model, pp 2 (1F1B) x dp 2."""
    run = settings["zero_pipeline"]
    return ["--model", settings["model"], "--arch", settings.get("arch", "gpt"), "--dtype",
            settings.get("dtype", "float32"), "--pp", "2", "--schedule", "1f1b", "--zero", ZERO_PIPELINE_ARMS[arm],
            "--batch-size", str(run["batch_size"]), "--micro-batches", str(run["micro_batches"]), "--steps",
            str(run["steps"]), "--eval-interval", str(run["steps"]), "--log-interval", str(run["steps"])]


def worker_zero_pipeline(settings):
    """train.py's training (train.train) with --zero 1 and with --zero 3, in turn in each round in these same
    processes (the order rotated by round, so the machine's drift cancels), each arm a whole run of its own
    with its own log. Before each run the process gives back what it freed and its peak resident memory starts
    again from the current one (reset_peak), so the peak_resident_bytes a run logs (VmHWM) is its own: the
    process's resident memory then (the interpreter, PyTorch, what earlier runs leave), returned too, and what
    the run adds (construction included). Returns, by round, each arm's run name and every rank's resident
    bytes at its start."""
    import gc
    import torch
    import torch.distributed as dist
    import train
    from training import cli
    names = list(ZERO_PIPELINE_ARMS)
    runs = []
    for r in range(settings["zero_pipeline"]["rounds"]):
        order = names[r % len(names):] + names[:r % len(names)]
        runs.append({})
        for arm in order:
            name = f"{arm}_{r}"
            if dist.get_rank() == 0:
                print(f"bench: ZeRO under 1F1B, round {r + 1} of {settings['zero_pipeline']['rounds']}: {arm}",
                      flush=True)
            gc.collect()
            dist.barrier()
            reset_peak()
            start = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
            dist.all_gather(start, torch.tensor([status_kib("VmRSS") * 1024.0], dtype=torch.float64))
            train.train(cli.parse_args([*zero_pipeline_argv(settings, arm), "--out", settings["out"], "--name", name]))
            runs[-1][arm] = dict(name=name, start_resident_bytes=[int(t.item()) for t in start])
    return runs


def zero_pipeline_check(settings, out):
    """ZeRO-3 beside ZeRO-1 under the 1F1B schedule, on the same model, ranks (pp 2 x dp 2) and batch
    (worker_zero_pipeline): per round, the ratio of their median step times (ZeRO-3's over ZeRO-1's, the
    first step left out), reported as the median and range over rounds; per rank, from the logs, the peak
    resident memory, the resident memory at the run's start and the peak above it (medians over rounds, and
    ranges), the parameter, gradient and optimizer bytes, and the bytes sent
    per step by dp's reduce-scatter, all-gather and all-reduce and by pp's sends (the last step's: every step
    sends the same); and the largest difference of their losses (they compute the same thing). The runs' logs
    stay in zero_pipeline/runs/, their end-of-run checkpoints are removed."""
    runs = os.path.join(out, "zero_pipeline", "runs")
    shutil.rmtree(runs, ignore_errors=True)
    sizes = settings["zero_pipeline"]
    print(f"bench: ZeRO-1 and ZeRO-3 under 1F1B, {ZERO_PIPELINE_RANKS} ranks, {sizes['rounds']} rounds", flush=True)
    stdout = torchrun(ZERO_PIPELINE_RANKS, "-m", "tools.bench", "--worker", "zero_pipeline", "--settings",
                      json.dumps(dict(settings, out=runs)))
    started = worker_result(stdout)
    logs = [{arm: read_log(os.path.join(runs, run["name"], "log.jsonl")) for arm, run in by_arm.items()}
            for by_arm in started]
    for name in os.listdir(runs):
        for entry in os.listdir(os.path.join(runs, name)):
            if entry.startswith("checkpoint"):
                shutil.rmtree(os.path.join(runs, name, entry))
    step_s = [{arm: statistics.median(e["step_s"] for e in log[1:]) for arm, log in by_arm.items()} for by_arm in logs]
    ratios = [r["zero3"] / r["zero1"] for r in step_s]
    arms = {}
    for arm in ZERO_PIPELINE_ARMS:
        last = logs[0][arm][-1]
        per_rank = {field: last[field] for field in ZERO_PIPELINE_FIELDS}
        per_rank["peak_resident_bytes"] = [int(statistics.median(by_arm[arm][-1]["peak_resident_bytes"][rank]
                                                                 for by_arm in logs))
                                           for rank in range(ZERO_PIPELINE_RANKS)]
        per_rank["peak_resident_range"] = [[min(by_arm[arm][-1]["peak_resident_bytes"][rank] for by_arm in logs),
                                            max(by_arm[arm][-1]["peak_resident_bytes"][rank] for by_arm in logs)]
                                           for rank in range(ZERO_PIPELINE_RANKS)]
        added = [[by_arm[arm][-1]["peak_resident_bytes"][rank] - run[arm]["start_resident_bytes"][rank]
                  for by_arm, run in zip(logs, started)] for rank in range(ZERO_PIPELINE_RANKS)]
        per_rank["start_resident_bytes"] = [int(statistics.median(run[arm]["start_resident_bytes"][rank]
                                                                  for run in started))
                                            for rank in range(ZERO_PIPELINE_RANKS)]
        per_rank["peak_above_start_bytes"] = [int(statistics.median(a)) for a in added]
        per_rank["peak_above_start_range"] = [[min(a), max(a)] for a in added]
        arms[arm] = dict(step_s=statistics.median(r[arm] for r in step_s),
                         step_s_range=[min(r[arm] for r in step_s), max(r[arm] for r in step_s)],
                         final_loss=last["loss"], per_rank=per_rank,
                         param_grad_optim_bytes=[sum(last[f][rank] for f in ZERO_PIPELINE_FIELDS[:3])
                                                 for rank in range(ZERO_PIPELINE_RANKS)],
                         dp_bytes_per_step=[sum(last[f][rank] for f in ZERO_PIPELINE_FIELDS if f.startswith("comm_dp"))
                                            for rank in range(ZERO_PIPELINE_RANKS)])
    losses = [[e["loss"] for e in logs[0][arm]] for arm in ZERO_PIPELINE_ARMS]
    return dict(model=settings["model"], ranks=ZERO_PIPELINE_RANKS, pp=2, dp=ZERO_PIPELINE_RANKS // 2,
                schedule="1f1b", **sizes, argv={arm: zero_pipeline_argv(settings, arm) for arm in ZERO_PIPELINE_ARMS},
                step_time_ratio=statistics.median(ratios), step_time_range=[min(ratios), max(ratios)],
                arms=arms, max_loss_difference=max(abs(a - b) for a, b in zip(*losses)),
                per_round=[dict(r, ratio=r["zero3"] / r["zero1"], start_resident_bytes={
                    arm: run[arm]["start_resident_bytes"] for arm in run}) for r, run in zip(step_s, started)])
