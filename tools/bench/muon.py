"""Muon beside AdamW: the step's and the optimizer step's time, Muon's two ways of assembling a matrix, and a
learning-rate sweep of each on the synthetic language (their convergence)."""
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from tools.bench.common import ENV, REPO, paired_ratio, read_log, torchrun, worker_result


# The layouts (ranks, train.py flags) Muon is timed on: one rank, where every matrix is whole and the two
# assemblies are the same (nothing to exchange), and four ranks whose stage cuts each matrix into pieces: by
# ZeRO-1's flat shards alone (dp 4), and by tensor parallelism's bands then ZeRO-3's shards (tp 2 x dp 2).
MUON_LAYOUTS = [(1, []), (4, ["--zero", "1"]), (4, ["--zero", "3", "--tp", "2"])]
MUON_ARMS = {"adamw": ["--optimizer", "adamw"], "owner": ["--optimizer", "muon", "--muon-assembly", "owner"],
             "gather": ["--optimizer", "muon", "--muon-assembly", "gather"]}  # arm: train.py's flags
MUON_FIELDS = ("comm_optim_all_to_all_bytes", "optim_bytes", "comm_dp_reduce_scatter_bytes",
               "comm_dp_all_gather_bytes", "comm_dp_all_reduce_bytes", "comm_tp_all_reduce_bytes")


def muon_argv(settings, flags, arm):
    """train.py's flags for one arm of the Muon timing on one layout: the settings' model with the Llama block."""
    run = settings["muon"]
    steps = (run["rounds"] + 1) * run["k"]
    return ["--model", settings["model"], "--arch", "llama", "--dtype", settings.get("dtype", "float32"),
            "--batch-size", str(run["batch_size"]), "--micro-batches", str(run["micro_batches"]), "--steps",
            str(steps), "--eval-interval", str(steps), *flags, *MUON_ARMS[arm]]


def _synchronize(device):
    """Wait for the device's queued work, so that the host's clock spans it (nothing to wait for on a CPU)."""
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker_muon(settings):
    """One Trainer per arm (AdamW; Muon assembling each matrix on one owner; Muon assembling it on every
    holder: on one rank, AdamW and Muon alone), the same model, layout, batch and data, stepped in turn in
    each round in these processes, the order rotated by round (the first round warms up, untimed). Each
    step is timed whole (train_step, from a barrier) and its optimizer step alone (the time in the
    optimizer that updates this rank's pieces: torch's fused AdamW, or training/muon.py's Muon with its
    AdamW for the rest and its two all-to-alls), the device synchronised around both, the slowest rank's.
    Returns per arm the rounds' mean step and optimizer times, every step's loss, and every rank's fields
    of the last step's record as train.py logs them (MUON_FIELDS: Muon's bytes, the optimizer state)."""
    import torch
    import torch.distributed as dist
    import train
    from mesh import Mesh
    from training import cli
    from training.data import open_data
    from training.launch import init_distributed
    world = dist.get_world_size()
    # The launch's device where its group has NCCL (run_worker joins as train.py does), else the CPU (gloo alone)
    device = init_distributed() if "nccl" in str(dist.get_backend()) else torch.device("cpu")
    run = settings["muon"]
    arms = [arm for arm in MUON_ARMS if world > 1 or arm != "gather"]
    trainers, clocks, mesh = {}, {arm: [0.0] for arm in arms}, None
    for arm in arms:
        args = cli.parse_args(muon_argv(settings, settings["flags"], arm))
        described = cli.describe_data(args)
        config, shape = cli.check_args(args, world, described)
        mesh = mesh or Mesh(shape)  # every arm has the same shape: the same groups
        trainers[arm] = train.Trainer(args, config, mesh, open_data(described, args.seed), device)
        for optimizer in trainers[arm].optimizers:  # the optimizer's step within dp.py's, timed
            optimizer.optimizer.step = _timed(optimizer.optimizer.step, clocks[arm], device)
    measured = {arm: dict(step_s=[], optimizer_s=[], losses=[]) for arm in arms}
    for r in range(run["rounds"] + 1):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            trainer, times = trainers[arm], []
            for i in range(run["k"]):
                trainer.reset_comm_baseline()  # the counters are shared by the arms: count this step's alone
                clocks[arm][0] = 0.0
                _synchronize(device)
                dist.barrier()
                start = time.perf_counter()
                record = trainer.train_step(r * run["k"] + i)
                _synchronize(device)
                slowest = torch.tensor([time.perf_counter() - start, clocks[arm][0]], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                times.append(slowest.tolist())
                records = train.gather_records(dict(record, stop_requested=False))
                measured[arm]["losses"].append(train.step_loss(trainer.args, records["loss"]))
            if r:
                measured[arm]["step_s"].append(statistics.mean(t[0] for t in times))
                measured[arm]["optimizer_s"].append(statistics.mean(t[1] for t in times))
            measured[arm]["last_step"] = {field: records[field] for field in MUON_FIELDS}
    return measured


def _timed(step, clock, device):
    """step, adding the seconds it takes (its device work included) to clock[0]."""
    def timed_step(*args, **kwargs):
        _synchronize(device)
        start = time.perf_counter()
        result = step(*args, **kwargs)
        _synchronize(device)
        clock[0] += time.perf_counter() - start
        return result
    return timed_step


def _paired(numerator, denominator):
    """The median of the rounds' paired ratios, and their range (paired_ratio's), by name."""
    ratio, spread = paired_ratio(dict(numerator=numerator, denominator=denominator), "numerator", "denominator")
    return dict(ratio=ratio, range=spread)


def muon_check(settings, out):
    """worker_muon on each of MUON_LAYOUTS (one launch each): per layout and arm the median step and optimizer
    times over rounds (and their ranges), every rank's bytes sent by Muon's all-to-alls per step (the logged
    comm_optim_all_to_all_bytes) and optimizer state; Muon's times over AdamW's and gather's over owner's as
    medians of per-round ratios with their range; the largest loss difference of the two assemblies (they
    compute the same thing). A layout with more ranks than the machine has GPUs is left out on GPUs."""
    import torch
    layouts = {}
    for world, flags in MUON_LAYOUTS:
        layout = " ".join(flags) or "one rank"
        if torch.cuda.is_available() and world > torch.cuda.device_count():
            print(f"bench: Muon, {layout}: {world} ranks, {torch.cuda.device_count()} GPUs: left out", flush=True)
            continue
        print(f"bench: Muon beside AdamW, {layout} on {world} ranks, {settings['muon']['rounds']} rounds",
              flush=True)
        stdout = torchrun(world, "-m", "tools.bench", "--worker", "muon", "--settings",
                          json.dumps(dict(settings, flags=flags)))
        measured = worker_result(stdout)
        muon = "owner"  # train.py's default assembly (on one rank, the only one)
        arms = {arm: dict(step_s=statistics.median(m["step_s"]), step_s_range=[min(m["step_s"]), max(m["step_s"])],
                          optimizer_s=statistics.median(m["optimizer_s"]),
                          optimizer_s_range=[min(m["optimizer_s"]), max(m["optimizer_s"])],
                          final_loss=m["losses"][-1], per_rank=m["last_step"],
                          argv=muon_argv(settings, flags, arm)) for arm, m in measured.items()}
        row = dict(ranks=world, flags=flags, arms=arms,
                   muon_over_adamw=dict(step=_paired(measured[muon]["step_s"], measured["adamw"]["step_s"]),
                                        optimizer=_paired(measured[muon]["optimizer_s"],
                                                          measured["adamw"]["optimizer_s"])),
                   per_round={arm: dict(step_s=m["step_s"], optimizer_s=m["optimizer_s"]) for arm, m in measured.items()})
        if "gather" in measured:
            row["gather_over_owner"] = dict(
                step=_paired(measured["gather"]["step_s"], measured["owner"]["step_s"]),
                optimizer=_paired(measured["gather"]["optimizer_s"], measured["owner"]["optimizer_s"]),
                bytes=sum(arms["gather"]["per_rank"]["comm_optim_all_to_all_bytes"]) /
                sum(arms["owner"]["per_rank"]["comm_optim_all_to_all_bytes"]))
            row["max_loss_difference"] = max(abs(a - b) for a, b in zip(measured["owner"]["losses"],
                                                                        measured["gather"]["losses"]))
        layouts[layout] = row
    return dict(model=settings["model"], arch="llama", dtype=settings.get("dtype", "float32"), **settings["muon"],
                layouts=layouts)




def muon_convergence(settings, out):
    """train.py on one rank for each optimizer and learning rate of settings["muon_convergence"], on the
    synthetic language (no --data), the same model, batch, steps and seed: each run's training loss at every
    step, its validation losses and its final validation loss; per optimizer the learning rate of the lowest
    final validation loss. Runs go as many at a time as the machine has cores (each alone on one thread:
    the losses do not depend on it), or one at a time on GPUs."""
    import torch
    run = settings["muon_convergence"]
    runs = os.path.join(out, "muon_convergence", "runs")
    shutil.rmtree(runs, ignore_errors=True)
    common = ["--model", run["model"], "--arch", "llama", "--batch-size", str(run["batch_size"]), "--steps",
              str(run["steps"]), "--eval-interval", str(run["eval_interval"]), "--log-interval", str(run["steps"]),
              "--out", runs]
    jobs = [(optimizer, lr) for optimizer, lrs in run["lrs"].items() for lr in lrs]
    parallel = 1 if torch.cuda.is_available() else max(1, os.cpu_count() or 1)
    name = lambda optimizer, lr: f"{optimizer}_lr{lr:g}"  # noqa: E731
    os.makedirs(runs)
    running = []
    for i, (optimizer, lr) in enumerate(jobs):
        print(f"bench: Muon convergence, {optimizer} at lr {lr:g} ({i + 1} of {len(jobs)})", flush=True)
        errors = os.path.join(runs, name(optimizer, lr) + ".stderr")
        with open(errors, "w") as stderr:
            running.append((subprocess.Popen([sys.executable, "train.py", *common, "--optimizer", optimizer, "--lr",
                                              str(lr), "--name", name(optimizer, lr)], cwd=REPO, env=ENV,
                                             stdout=subprocess.DEVNULL, stderr=stderr), errors))
        while len(running) >= parallel or (running and i == len(jobs) - 1):  # wait for the oldest
            done, errors = running.pop(0)
            if done.wait():
                with open(errors) as f:
                    raise RuntimeError(f"a Muon convergence run failed:\n{f.read()[-3000:]}")
            os.remove(errors)
    rows = []
    for optimizer, lr in jobs:
        folder = os.path.join(runs, name(optimizer, lr))
        log = read_log(os.path.join(folder, "log.jsonl"))
        for entry in os.listdir(folder):  # the end-of-run checkpoint is not needed
            if entry.startswith("checkpoint"):
                shutil.rmtree(os.path.join(folder, entry))
        rows.append(dict(optimizer=optimizer, lr=lr, final_loss=log[-1]["loss"],
                         final_val_loss=log[-1]["val_loss"], loss=[e["loss"] for e in log],
                         val_loss=[[e["step"], e["val_loss"]] for e in log if "val_loss" in e]))
    with open(os.path.join(runs, name(*jobs[0]), "config.json")) as f:
        floor = json.load(f)["entropy_floor"]
    best = {optimizer: min((r for r in rows if r["optimizer"] == optimizer), key=lambda r: r["final_val_loss"])
            for optimizer in run["lrs"]}
    return dict(run, arch="llama", data="synthetic (train.py's default)", entropy_floor=floor,
                argv=common[:-2], runs=rows,
                best={optimizer: dict(lr=r["lr"], final_val_loss=r["final_val_loss"], final_loss=r["final_loss"])
                      for optimizer, r in best.items()})
