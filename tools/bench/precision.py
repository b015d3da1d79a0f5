"""bfloat16 before and after the mixed-precision policy: train.py of AUTOCAST_COMMIT (float32 weights under
autocast) beside this one's (bfloat16 weights, float32 master), on small layouts."""
import os
import shutil
import statistics
import subprocess

from tools.bench.common import ENV, REPO, read_log, torchrun_command


# The last commit whose --dtype bfloat16 meant float32 weights under torch.autocast (before train.Precision).
AUTOCAST_COMMIT = "4f6e0f2"
PRECISION_LAYOUTS = [(1, []), (2, []), (2, ["--tp", "2"]), (2, ["--pp", "2"]), (2, ["--cp", "2"]),
                     (2, ["--ep", "2", "--experts", "4"]), (2, ["--zero", "3"])]


def precision_check(settings, out, rounds=3, steps=6):
    """--dtype bfloat16 before (float32 weights under autocast, train.py of AUTOCAST_COMMIT, checked out
    beside this one) and after (bfloat16 weights, float32 master), each small layout run by both in turn,
    the order alternated by round: per layout and version the median step time (the first step left out),
    the largest peak resident memory and per-rank counters, and after/before step-time ratios per round."""
    before = os.path.join(out, "precision", "before")
    shutil.rmtree(before, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=REPO, check=True)
    subprocess.run(["git", "worktree", "add", "--detach", before, AUTOCAST_COMMIT], cwd=REPO, check=True,
                   capture_output=True)
    versions = {"before": before, "after": REPO}
    common = ["--model", settings["model"], "--arch", settings.get("arch", "gpt"), "--dtype", "bfloat16",
              "--batch-size", str(settings["batch_size"]), "--micro-batches", str(settings["micro_batches"]),
              "--steps", str(steps), "--eval-interval", str(steps), "--log-interval", str(steps)]
    measured = {}
    try:
        for r in range(rounds):
            for world, flags in PRECISION_LAYOUTS:
                layout = " ".join(flags) or ("one rank" if world == 1 else f"DP={world}")
                order = list(versions) if r % 2 == 0 else list(versions)[::-1]
                for version in order:
                    print(f"bench: bfloat16 {version}, {layout}, round {r + 1} of {rounds}", flush=True)
                    runs = os.path.join(out, "precision", "runs", version)
                    measured.setdefault(layout, {}).setdefault(version, []).append(
                        measured_run(versions[version], world, [*common, *flags], runs, f"{world}{'_'.join(flags)}{r}"))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", before], cwd=REPO, capture_output=True)
    summary = {}
    for layout, by_version in measured.items():
        ratios = [a["step_s"] / b["step_s"] for a, b in zip(by_version["after"], by_version["before"])]
        summary[layout] = dict(step_time_ratio=statistics.median(ratios), ratio_range=[min(ratios), max(ratios)],
                               **{version: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                                  for version, runs in by_version.items()})
    return dict(before_commit=AUTOCAST_COMMIT, rounds=rounds, steps=steps, flags=common, layouts=summary)


def measured_run(repo, world, argv, runs, name):
    """train.py of the checkout `repo` on `world` ranks: its median step time (the first step left out), its
    ranks' largest peak resident memory, and its last step's largest counters, loss."""
    done = subprocess.run(torchrun_command(world, os.path.join(repo, "train.py"), *argv, "--out", runs, "--name", name),
                          cwd=repo, env=ENV, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"train.py of {repo} {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    log = read_log(os.path.join(runs, name, "log.jsonl"))
    peak = next(line for line in done.stdout.splitlines() if line.startswith("peak "))
    last = log[-1]
    return dict(step_s=statistics.median(e["step_s"] for e in log[1:]),
                peak_resident_gib=max(float(x) for x in peak.split(":")[1].split()),
                **{key: max(last[key])
                   for key in ("param_bytes", "grad_bytes", "optim_bytes", "activation_peak_bytes")},
                comm_bytes=max(sum(last[key][rank] for key in last
                                   if key.startswith("comm_") and key.endswith("_bytes")) for rank in range(world)),
                final_loss=last["loss"])
