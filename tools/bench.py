"""The benchmark: the ten configurations of the seed table, and each dimension against PyTorch's built-in.

    python -m tools.bench            # everything, about twenty minutes on 2 CPU cores
    python -m tools.bench --quick    # the same on a tiny model, a few minutes
    python -m tools.bench --arch llama --out results/llama  # the table with the Llama-style block
    python plot.py             # figures and results/results.md from what this wrote

Part 1 runs train.py under torchrun for each configuration (one model, one
global batch, so every row trains on the same tokens) and summarises its
log: steady-state throughput (steps after the first few, validation
excluded), final validation loss, per-rank memory, bytes per dimension, and
where the time went (compute, waiting on communication, pipeline bubble).
Each configuration is also set against the compute-bound ceiling: the
single-rank throughput times min(ranks, cores). Because this machine's speed
drifts, the 2-rank data-parallel efficiency is measured once more on its
own, alternating one rank and two in a few rounds (`scaling_check`).

Part 2 times this repository's implementation of a dimension and the
PyTorch built-in that does the same job, alternately, in the same processes,
on the same model and data: dp.py against DistributedDataParallel, ZeRO-3
against FSDP2's fully_shard, tp.py against DTensor's parallelize_module,
pp.py's 1F1B and GPipe against torch.distributed.pipelining. Each reports
the median step time of both, the median and range of their per-round
ratios, and the largest difference of their losses (they compute the same
thing).

Everything is written to results/: runs/<name>/ and scaling/ (train.py's
logs), summary.json, comparisons.json, machine.json (with the scaling check).

Beside them are parts of their own, each also run alone by `--only NAME` (see
--help), among them 'zero_pipeline': ZeRO-3 beside ZeRO-1 under 1F1B (train.py
--pp 2 --zero 1 and --zero 3 on 4 ranks, dp 2: the same model, ranks and batch,
the two runs in turn in each round in the same processes, the order rotated):
the median and range of the per-round step-time ratios, each rank's peak
resident memory and logged parameter, gradient and optimizer bytes, and the
bytes each rank sent per step by dp's reduce-scatter, all-gather and all-reduce
and by pp's sends (results/zero_pipeline.json; a table in results.md); 'muon':
train.py --optimizer muon beside AdamW on one rank, on 4 ranks with --zero 1 and
with --zero 3 --tp 2, and there Muon's two assemblies (--muon-assembly owner and
gather), all stepped in turn in each round in the same processes: the whole step's
and the optimizer step's time (medians and ranges of per-round ratios), the
optimizer state and the bytes Muon's all-to-alls sent per step
(comm_optim_all_to_all_bytes) by rank (results/muon.json; a table in results.md);
'muon_convergence': a learning-rate sweep of each optimizer on the synthetic
language, the best final validation loss of each (results/muon_convergence.json;
plot.py draws muon_convergence.png).

Part 3, run alone with `--soak` (about half an hour), is about reliability,
not speed: every dimension file's self-check and a composed launch of
train.py, twenty times each in a row, must never fail; and a run whose
workers are killed every few dozen steps under `torchrun --max-restarts`
must end with exactly the weights of the same run uninterrupted
(results/soak.json).
"""
import argparse
import copy
import ctypes
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the top folder: train.py's

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
FULL = dict(model="small", batch_size=64, micro_batches=2, steps=50, eval_interval=25, skip=5, rounds=36, k=1,
            scaling_rounds=3, scaling_steps=25, attention_lengths=[2048, 4096, 8192, 16384],
            document_lengths=["short", "half", "long"],
            zero_pipeline=dict(batch_size=64, micro_batches=8, steps=6, rounds=15),
            muon=dict(batch_size=32, micro_batches=1, rounds=12, k=3),
            muon_convergence=dict(model="small", batch_size=32, steps=300, eval_interval=50,
                                  lrs=dict(adamw=[1e-3, 3e-3, 1e-2, 3e-2], muon=[1e-3, 3e-3, 1e-2, 3e-2])))
QUICK = dict(model="tiny", batch_size=16, micro_batches=2, steps=12, eval_interval=6, skip=3, rounds=6, k=1,
             scaling_rounds=1, scaling_steps=8, attention_lengths=[256, 512], document_lengths=["short", "long"],
             zero_pipeline=dict(batch_size=16, micro_batches=4, steps=5, rounds=3),
             muon=dict(batch_size=8, micro_batches=1, rounds=2, k=1),
             muon_convergence=dict(model="tiny", batch_size=8, steps=20, eval_interval=10,
                                   lrs=dict(adamw=[3e-3, 1e-2], muon=[3e-3, 1e-2])))


def torchrun_command(n_ranks, *argv, max_restarts=0):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", str(max_restarts),
            "--nproc_per_node", str(n_ranks), *argv]


ENV = dict(os.environ, OMP_NUM_THREADS="1")  # one thread a rank: ranks share the cores


def torchrun(n_ranks, *argv, timeout=1800, env=ENV):
    cmd = torchrun_command(n_ranks, *argv)
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


# ---------------------------------------------------------------------------
# Part 1: the table
# ---------------------------------------------------------------------------

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


# -- packed documents: document masking against plain causal attention ------------------------------------

# Document length distributions: each document's length is geometric with this mean, in sequences.
DOCUMENT_LENGTHS = {"short": 1 / 8, "half": 1 / 2, "long": 2}


def packed_data(folder, seq_len, mean_sequences, vocab_size, n_tokens=1 << 18, seed=0):
    """A token directory (tools/prepare.py's layout) of random documents of geometric lengths (mean
    mean_sequences x seq_len tokens), each ended by the EOS id vocab_size - 1; returns the documents per
    sequence."""
    import numpy as np
    rng = np.random.default_rng(seed)
    lengths = rng.geometric(1 / max(2.0, mean_sequences * seq_len), n_tokens)
    ends = np.cumsum(lengths)
    ends = ends[ends <= n_tokens] - 1
    tokens = rng.integers(0, vocab_size - 1, n_tokens).astype(np.uint16)
    tokens[ends] = vocab_size - 1
    os.makedirs(folder, exist_ok=True)
    cut = n_tokens * 9 // 10
    tokens[:cut].tofile(os.path.join(folder, "train.bin"))
    tokens[cut:].tofile(os.path.join(folder, "val.bin"))
    write_json(os.path.join(folder, "meta.json"), dict(dtype="uint16", vocab_size=vocab_size, eos_id=vocab_size - 1))
    return len(ends) * seq_len / n_tokens


def attention_times(config, micro_batch, documents, rounds):
    """Seconds of one attention forward and backward (model.py's core) with the documents' mask and with plain
    causal attention, alternated `rounds` times in this process: {arm: per round}."""
    import torch
    from model import causal_attention
    head_dim = config.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(micro_batch, config.n_head, config.seq_len, head_dim, generator=g, requires_grad=True)
    k, v = (torch.randn(micro_batch, config.n_kv_heads, config.seq_len, head_dim, generator=g, requires_grad=True)
            for _ in range(2))
    times = {"causal": [], "documents": []}
    for r in range(rounds + 1):  # the first to warm up
        for arm, given in [("causal", None), ("documents", documents)][::1 if r % 2 else -1]:  # order alternated
            start = time.perf_counter()
            causal_attention(q, k, v, given).sum().backward()
            if r:
                times[arm].append(time.perf_counter() - start)
    return times


def documents_check(settings, out):
    """train.py on one rank with --document-mask and with --no-document-mask, in turn in each round, on the
    same packed data, for each document length distribution: tokens per second, and model.py's attention
    core timed alone on the same micro-batches' documents; the median and range of the per-round ratios
    (masked over causal)."""
    from model import document_ids
    from training import cli
    from training.data import load_data
    steps, rounds = settings["scaling_steps"], settings["scaling_rounds"]
    args = cli.parse_args(["--model", settings["model"], "--arch", settings.get("arch", "gpt")])
    vocab = cli.PRESETS[settings["model"]]["vocab_size"]
    config = cli.model_config(args, vocab)
    micro_batch = settings["batch_size"] // settings["micro_batches"]
    rows = {}
    for name in settings["document_lengths"]:
        mean_sequences = DOCUMENT_LENGTHS[name]
        data = os.path.join(out, "documents", name)
        per_sequence = packed_data(data, config.seq_len, mean_sequences, vocab)
        common = ["--model", settings["model"], "--arch", settings.get("arch", "gpt"), "--data", data, "--batch-size",
                  str(settings["batch_size"]), "--micro-batches", str(settings["micro_batches"]), "--steps",
                  str(steps), "--eval-interval", str(steps), "--out", os.path.join(out, "documents", "runs")]
        per_round = []
        for r in range(rounds):
            print(f"bench: documents {name}, round {r + 1} of {rounds}", flush=True)
            speeds = {}
            for arm, flag in (("causal", "--no-document-mask"), ("documents", "--document-mask")):
                run = f"{name}-{arm}{r}"
                torchrun(1, "train.py", *common, flag, "--name", run)
                speeds[arm] = tokens_per_s(read_log(os.path.join(out, "documents", "runs", run, "log.jsonl"))[
                    settings["skip"]:])
            per_round.append(speeds)
        tokens = load_data(data, vocab).batch("train", 0, micro_batch, config.seq_len)[:, :-1]
        times = attention_times(config, micro_batch, document_ids(tokens, vocab - 1), max(3, rounds))
        step = [r["causal"] / r["documents"] for r in per_round]  # > 1: masking is slower
        attention = [d / c for c, d in zip(times["causal"], times["documents"])]
        rows[name] = dict(mean_document_sequences=mean_sequences, documents_per_sequence=per_sequence,
                          tokens_per_s={arm: statistics.median(r[arm] for r in per_round) for arm in per_round[0]},
                          step_time_ratio=statistics.median(step), step_time_range=[min(step), max(step)],
                          attention_s={arm: statistics.median(t) for arm, t in times.items()},
                          attention_time_ratio=statistics.median(attention),
                          attention_time_range=[min(attention), max(attention)])
    return dict(model=settings["model"], rounds=rounds, steps=steps, micro_batch=micro_batch, seq_len=config.seq_len,
                rows=rows)


def planner_check(out, seq_lens=(128, 512), model=("--model", "medium", "--arch", "llama", "--kv-heads", "8")):
    """tools/plan.py's strategies (its memory figure) at a size this machine runs: each strategy alone on 8 ranks
    (or one), for two sequence lengths and the three recomputation modes, one step each: the busiest
    rank's logged memory (plot.py sets tools/plan.py's prediction for that rank beside it)."""
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
                                   rank=busiest, measured=measured[busiest]))
    return dict(model=" ".join(model), strategies=plan.STRATEGIES, points=points)


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
    against_pytorch = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    return dict(flags=list(model), rounds=rounds, steps=steps, schedules=summary, over_1f1b=over_1f1b,
                zbv_against_pytorch=dict(against_pytorch, settings=settings),
                per_round=[{s: {k: v for k, v in m[s].items() if k != "timeline"} for s in schedules}
                           for m in per_round])


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


def tokens_per_s(records):
    """Tokens per second over these steps of a log (the steady ones: start-up left out)."""
    return sum(e["tokens_per_s"] * e["step_s"] for e in records) / sum(e["step_s"] for e in records)


def read_json(path):
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def summarise(out, settings, cores):
    """One summary per configuration, from its log; efficiency against the compute-bound ceiling, and MFU
    where train.py knew the device's peak (GPUs of its table, or --peak-tflops)."""
    from model import GPTConfig
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
        flops, peak = GPTConfig(**config["model"]).flops_per_token() * throughput, config["peak_flops"]
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


# ---------------------------------------------------------------------------
# Part 2: side by side with PyTorch's built-ins (run under torchrun: tools/bench.py --worker NAME)
# ---------------------------------------------------------------------------

def _gpt(settings, seed=0):
    import torch
    from training import cli
    import train
    args = cli.parse_args(["--model", settings["model"]])
    config = cli.model_config(args, cli.PRESETS[settings["model"]]["vocab_size"])
    return train.build_model(config, seed, torch.float32, torch.device("cpu")), args


def _batches(settings, args, n, rank, world):
    from training.data import MarkovLanguage
    from training import cli
    import train
    data = MarkovLanguage(cli.PRESETS[settings["model"]]["vocab_size"])
    for step in range(n):
        tokens = data.batch("train", step, settings["batch_size"], args.seq_len)
        yield next(train.local_micro_batches(tokens, 1, world, rank))


def _alternate(settings, arms):
    """Time `rounds` rounds of k steps of each arm, rotating their order every round.

    arms: {name: step}, where step(i) trains on batch i and returns the loss. The machine's speed
    drifts, so timings taken back to back in the same round are set against each other (see
    _ratio). A first, untimed round warms every arm up. Returns ({name: seconds per step, a list
    over rounds}, {name: losses, in step order}).
    """
    import torch.distributed as dist
    names = list(arms)
    times = {name: [] for name in names}
    losses = {name: [] for name in names}
    for r in range(settings["rounds"] + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            for i in range(settings["k"]):
                losses[name].append(arms[name](r * settings["k"] + i))
            dist.barrier()
            if r:
                times[name].append((time.perf_counter() - start) / settings["k"])
    return times, losses


def _ratio(times, ours="ours", theirs="builtin"):
    """The median of the rounds' paired ratios of step time, and their range."""
    ratios = [a / b for a, b in zip(times[ours], times[theirs])]
    return statistics.median(ratios), [min(ratios), max(ratios)]


def _against_builtin(settings, ours, theirs):
    """ours and theirs alternated: their median step times, the ratio, the largest loss difference."""
    times, losses = _alternate(settings, {"ours": ours, "builtin": theirs})
    return _report(times, losses)


def _report(times, losses):
    ratio, ratio_range = _ratio(times)
    return dict(ours_step_s=statistics.median(times["ours"]), builtin_step_s=statistics.median(times["builtin"]),
                ratio=ratio, ratio_range=ratio_range,
                max_loss_difference=max(abs(a - b) for a, b in zip(losses["ours"], losses["builtin"])))


def n_batches(settings):
    return (settings["rounds"] + 1) * settings["k"]


def _sgd_step(model, optimizer, inputs, targets, sync=None):
    _, loss = model(inputs, targets)
    loss.backward()
    if sync:
        sync()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return loss.item()


def worker_ddp(settings):
    """dp.py's DataParallel against DistributedDataParallel, and against the same ranks not communicating.

    The third arm trains a copy on each rank's share of the batch with no gradient exchange at all
    (each rank drifts its own way): what dp.py's step costs beyond it is the whole price of data
    parallelism on these ranks, apart from waiting for the slower one.
    """
    import torch
    import torch.distributed as dist
    from dp import DataParallel
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, args = _gpt(settings)
    theirs, alone = copy.deepcopy(ours), copy.deepcopy(ours)
    data = list(_batches(settings, args, n_batches(settings), rank, world))
    sync = DataParallel(ours.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(theirs)
    opt_ours, opt_theirs, opt_alone = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs, alone))
    times, losses = _alternate(settings, {
        "ours": lambda i: _sgd_step(ours, opt_ours, *data[i], sync.finish_grad_sync),
        "builtin": lambda i: _sgd_step(ddp, opt_theirs, *data[i]),
        "no_communication": lambda i: _sgd_step(alone, opt_alone, *data[i])})
    result = _report(times, losses)
    result["no_communication_step_s"] = statistics.median(times["no_communication"])
    result["over_no_communication"], result["over_no_communication_range"] = _ratio(times, theirs="no_communication")
    return result


def _zero_step(model, zero, inputs, targets):
    _, loss = model(inputs, targets)
    loss.backward()
    zero.finish_grad_sync()
    zero.step()
    zero.zero_grad()
    return loss.item()


def worker_fsdp(settings):
    """dp.py's ZeRO-3 against FSDP2's fully_shard, one unit per block (and the rest)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from dp import ZeRO3, gpt_units
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, args = _gpt(settings)
    theirs = copy.deepcopy(ours)
    data = list(_batches(settings, args, n_batches(settings), rank, world))
    zero = ZeRO3(ours, None, lambda shards: torch.optim.AdamW(shards, lr=1e-3), units=gpt_units(ours))
    mesh = init_device_mesh("cpu", (world,))
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    return _against_builtin(settings, lambda i: _zero_step(ours, zero, *data[i]),
                            lambda i: _sgd_step(theirs, opt_theirs, *data[i]))


def worker_tp(settings):
    """tp.py's column/row-parallel blocks against DTensor's parallelize_module with the same plan."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import tp
    world = dist.get_world_size()
    ours, args = _gpt(settings)
    theirs = copy.deepcopy(ours)
    data = list(_batches(settings, args, n_batches(settings), 0, 1))  # tp ranks share data
    plan = tp.TensorParallel(None)  # the default group, without sequence parallelism
    for block in ours.blocks:
        block.attn.qkv = tp.ColumnParallelLinear(block.attn.qkv, plan, blocks=[ours.config.d_model] * 3)
        block.attn.proj = tp.RowParallelLinear(block.attn.proj, plan)
        block.mlp.fc = tp.ColumnParallelLinear(block.mlp.fc, plan)
        block.mlp.proj = tp.RowParallelLinear(block.mlp.proj, plan)
    mesh = init_device_mesh("cpu", (world,))
    for block in theirs.blocks:
        # ColwiseParallel splits the output features contiguously: lay each rank's q, k and v heads side by side.
        with torch.no_grad():
            for t in (block.attn.qkv.weight, block.attn.qkv.bias):
                t.copy_(t.view(3, world, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape))
        parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                         "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    opt_ours, opt_theirs = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs))
    return _against_builtin(settings, lambda i: _sgd_step(ours, opt_ours, *data[i]),
                            lambda i: _sgd_step(theirs, opt_theirs, *data[i]))


def worker_pp(settings, schedule):
    """pp.py's schedule against torch.distributed.pipelining's, on the same split: one stage a rank, or (ZB-V)
    two in a V."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
    import pp
    rank, world = dist.get_rank(), dist.get_world_size()
    n_micro, n_chunks = settings["micro_batches"], 2 if schedule == "zbv" else 1
    ours, args = _gpt(settings)
    theirs = copy.deepcopy(ours)
    data = list(_batches(settings, args, n_batches(settings), 0, 1))  # stages share data
    placement = pp.Placement.of(schedule, world, n_chunks)
    our_chunks = pp.apply_pipeline_parallel(ours, None, placement)
    their_chunks = pp.apply_pipeline_parallel(theirs, None, placement)

    class Stage(torch.nn.Module):  # a PipelineStage runs a module holding its own weights
        def __init__(self, chunk):
            super().__init__()
            self.held, self.chunk = torch.nn.ModuleList(chunk.modules()), chunk

        def forward(self, x):
            return self.chunk(x)

    model_chunks = placement.model_chunks(rank)
    stages = [PipelineStage(Stage(chunk), k, placement.n_model_chunks, torch.device("cpu"))
              for k, chunk in zip(model_chunks, their_chunks)]
    if schedule == "zbv":
        builtin = ScheduleZBVZeroBubble(stages, n_micro, loss_fn=theirs.loss_fn)
    elif schedule == "zb1":  # PyTorch's zero-bubble schedule for one stage per rank: ZB-H1's (a list of stages)
        builtin = ScheduleInterleavedZeroBubble(stages, n_micro, loss_fn=theirs.loss_fn)
    else:
        builtin = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule](stages[0], n_micro, loss_fn=theirs.loss_fn)
    schedules = [pp.make_schedule(schedule, n_micro, world, r, n_chunks) for r in range(world)]
    micro = settings["batch_size"] // n_micro
    shape = (micro, args.seq_len, ours.config.d_model)
    opt_ours, opt_theirs = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs))

    def shared_loss(losses):  # the last stage's mean loss, on every rank
        t = torch.tensor([sum(losses) / n_micro if losses else 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()

    def ours_step(i):
        inputs, targets = data[i]
        micro_batches = list(zip(inputs.chunk(n_micro), targets.chunk(n_micro)))
        losses, _ = pp.run_schedule(schedules, our_chunks, micro_batches, ours.loss_fn, None, shape,
                                    torch.float32, torch.device("cpu"), placement=placement)
        opt_ours.step()
        opt_ours.zero_grad()
        return shared_loss(losses)

    def theirs_step(i):
        inputs, targets = data[i]
        losses = []
        first, last = 0 in model_chunks, placement.n_model_chunks - 1 in model_chunks
        builtin.step(*([inputs] if first else []), **(dict(target=targets, losses=losses) if last else {}))
        opt_theirs.step()
        opt_theirs.zero_grad()
        return shared_loss([loss.item() for loss in losses])
    return _against_builtin(settings, ours_step, theirs_step)


WORKERS = {  # name: (ranks, worker)
    "ddp": (2, worker_ddp),
    "fsdp": (2, worker_fsdp),
    "tp": (2, worker_tp),
    "pp_1f1b": (2, lambda settings: worker_pp(settings, "1f1b")),
    "pp_gpipe": (2, lambda settings: worker_pp(settings, "gpipe")),
    "pp_zb1": (2, lambda settings: worker_pp(settings, "zb1")),
    "pp_zbv": (2, lambda settings: worker_pp(settings, "zbv")),
}


# -- ring attention's memory and time, by sequence length ------------------------------------

def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def worker_attention(settings):
    """One causal attention forward and backward over settings["length"] tokens in float32: one of cp.py's
    three ways (ring attention, with the fused or the explicit blocks; all-gathered K and V; the all-to-all
    to head shards) on this launch's ranks, or SDPA of the whole sequence on one rank.
    The memory is the peak resident memory above what the process held before (Linux: /proc/self/clear_refs
    resets the peak; every allocation of 64 KiB or more is its own mapping, given back when freed, so the
    resident memory follows what is allocated), the most over ranks; the time the slowest rank's; the bytes
    a rank sent. Each is the median of a few rounds after one to warm up (first calls set up kernels and
    buffers)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import cp
    rank, n = dist.get_rank(), dist.get_world_size()
    shape = (1, settings["heads"], settings["length"] // n, settings["head_dim"])
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    times, peaks, sent = [], [], []
    for _ in range(settings["rounds"] + 1):
        q.grad = k.grad = v.grad = None
        cp.comm_bytes.clear()
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set starts again from the current one
        before, start = _status_kib("VmRSS"), time.perf_counter()
        if settings["kernels"] == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out, _ = cp.MODES[settings["mode"]](q, k, v, None, getattr(cp, settings["kernels"].upper()))
        out.backward(torch.ones_like(out))
        measured = torch.tensor([time.perf_counter() - start, (_status_kib("VmHWM") - before) * 1024.0,
                                 float(sum(cp.comm_bytes.values()))], dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        times.append(measured[0].item())
        peaks.append(measured[1].item())
        sent.append(measured[2].item())
    return dict(seconds=statistics.median(times[1:]), peak_bytes=statistics.median(peaks[1:]),
                bytes_sent=statistics.median(sent[1:]))


# The attention benchmark's arms: row key -> (cp.py's way, its block kernels, ranks).
ATTENTION_ARMS = {"fused": ("ring", "fused", 2), "explicit": ("ring", "explicit", 2),
                  "allgather": ("allgather", "fused", 2), "alltoall": ("alltoall", "fused", 2),
                  "sdpa": (None, "sdpa", 1)}


def attention_by_length(lengths, heads=4, head_dim=64, rounds=3):
    """cp.py's three ways on one rank pair (ring attention with fused and with explicit blocks, the all-gather
    and the all-to-all with fused blocks), and SDPA of the whole sequence on one rank, at each length in
    turn (one fresh launch each): memory, time and bytes sent of a forward and backward."""
    results = []
    for length in lengths:
        row = dict(length=length)
        for name, (mode, kernels, ranks) in ATTENTION_ARMS.items():
            print(f"bench: attention, {length} tokens, {name}", flush=True)
            settings = dict(length=length, mode=mode, kernels=kernels, heads=heads, head_dim=head_dim, rounds=rounds)
            stdout = torchrun(ranks, "-m", "tools.bench", "--worker", "attention", "--settings", json.dumps(settings),
                              env=dict(ENV, MALLOC_MMAP_THRESHOLD_="65536"))
            row[name] = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
        results.append(row)
    return dict(heads=heads, head_dim=head_dim, dtype="float32", batch=1, rounds=rounds, rows=results)


# -- checkpoints: sharded against consolidated, save and load, time and peak memory -----------------

CHECKPOINT_RUN = ["--model", "gpt2-medium", "--zero", "3", "--batch-size", "4", "--seq-len", "32", "--steps", "1"]


def _reset_peak():
    """The peak resident set starts again from the current one (Linux), once glibc has given back the freed
    memory it keeps for reuse (malloc_trim), so that one phase's leftovers do not count in the next's."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _phase(run):
    """(run's result, its seconds on the slowest rank, every rank's peak resident bytes during it)."""
    import torch
    import torch.distributed as dist
    dist.barrier()
    _reset_peak()
    start = time.perf_counter()
    result = run()
    dist.barrier()
    seconds = time.perf_counter() - start
    peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([_status_kib("VmHWM") * 1024.0], dtype=torch.float64))
    return result, seconds, [int(p.item()) for p in peaks]


class ConsolidatedFile:
    """The consolidated checkpoint (one torch.save file of model.py's state dict and the optimizer's state by
    parameter name), read through the interface train.py reads a sharded one by (checkpoint.Checkpoint)."""

    def __init__(self, path):
        import torch
        self.state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        self.step, self.skipped_steps, self.tensors = self.state["step"], 0, self.state["model"]
        self.steps = {name: state["step"].item() for name, state in self.state["optimizer"].items()}
        # A sharded checkpoint's also names the Hugging Face config a run began from (none here) and the run's
        # flags, of which train.py reads the optimizer: none named, AdamW's state, as this file's
        self.manifest = {"args": {}}

    def optimizer_keys(self, name):
        return sorted(key for key in self.state["optimizer"].get(name, {}) if key != "step")

    def read(self, name, key, positions):
        tensor = self.state["model"][name] if key == "model" else self.state["optimizer"][name][key]
        return tensor.reshape(-1)[positions.cpu()]

    def full(self, name):
        return self.state["model"][name]


def save_consolidated(trainer, path):
    """The checkpoint as one file, as this repository wrote it before sharded checkpoints (then gathered to
    every rank; here to rank 0 alone, the least a consolidated file needs): each rank in turn sends rank 0
    its pieces, which places them in the whole tensors and writes the file."""
    import torch
    import torch.distributed as dist
    from training import checkpoint
    pieces, layouts, steps = trainer.state.checkpoint_pieces()
    if dist.get_rank():
        for rank in range(1, dist.get_world_size()):
            dist.barrier()
            if rank == dist.get_rank():
                dist.send_object_list([[(p, t.detach().cpu()) for p, t in pieces], layouts, steps], dst=0)
        dist.barrier()
        return
    whole = {}

    def place(received):
        for piece, tensor in received:
            shape, split = layouts[piece.name]["shape"], layouts[piece.name]["split"]
            flat = whole.setdefault((piece.name, piece.key), torch.empty(math.prod(shape), dtype=tensor.dtype))
            if split is None:
                flat[piece.start:piece.end] = tensor
                continue
            where = checkpoint.in_parts(torch.arange(flat.numel()), shape, split)  # (tensor parallelism)
            lo = piece.part * (flat.numel() // split["parts"]) + piece.start
            mine = (where >= lo) & (where < lo + piece.end - piece.start)
            flat[mine] = tensor[where[mine] - lo]
    place([(p, t.detach().cpu()) for p, t in pieces])
    for rank in range(1, dist.get_world_size()):
        dist.barrier()
        received = [None, None, None]
        dist.recv_object_list(received, src=rank)
        layouts.update(received[1])
        steps.update(received[2])
        place(received[0])
        del received
    dist.barrier()
    model = {name: flat.view(layouts[name]["shape"]) for (name, key), flat in whole.items() if key == "model"}
    optimizer = {}
    for (name, key), flat in whole.items():
        if key != "model":
            optimizer.setdefault(name, {"step": torch.tensor(steps[name])})[key] = flat.view(layouts[name]["shape"])
    torch.save(dict(model=model, optimizer=optimizer, step=1), path)


def fingerprint(trainer):
    """The SHA-256 of this rank's pieces of the training state (weights and optimizer state), in order."""
    import hashlib
    import torch
    digest = hashlib.sha256()
    for piece, tensor in trainer.state.checkpoint_pieces()[0]:
        digest.update(repr(piece).encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def worker_checkpoint(settings):
    """gpt2-medium under ZeRO-3 on this launch's ranks, after one step: save and load its checkpoint,
    sharded (training/checkpoint.py) and consolidated (one file), alternately for a few rounds; per round, the
    slowest rank's seconds and every rank's peak resident memory, for each. The sharded save's time is
    until the files are complete; `blocking` is what training waits (the copy aside)."""
    import gc
    import torch
    import torch.distributed as dist
    from training import checkpoint
    from training import cli
    from training.data import open_data
    from tools import plan
    import train
    from mesh import Mesh
    world, device = dist.get_world_size(), torch.device("cpu")
    args = cli.parse_args([*CHECKPOINT_RUN, "--out", settings["out"]])
    described = cli.describe_data(args)
    config, shape = cli.check_args(args, world, described)
    mesh = Mesh(shape)
    data = open_data(described, args.seed)
    trainer, startup_s, startup_peaks = _phase(lambda: train.Trainer(args, config, mesh, data, device))
    _, step_s, step_peaks = _phase(lambda: trainer.train_step(0))
    saver = checkpoint.Saver(dist.new_group(backend="gloo"))
    sharded = os.path.join(settings["out"], "checkpoint-00000001")
    consolidated = os.path.join(settings["out"], "consolidated.pt")
    rounds = {kind: [] for kind in ("sharded save", "consolidated save", "sharded load", "consolidated load")}
    blocking = []
    for _ in range(settings["rounds"]):
        def save_sharded():
            start = time.perf_counter()
            trainer.save_checkpoint(saver, sharded, 1, keep=1)
            blocking.append(time.perf_counter() - start)
            saver.wait()
        rounds["sharded save"].append(_phase(save_sharded)[1:])
        rounds["consolidated save"].append(_phase(lambda: save_consolidated(trainer, consolidated))[1:])
    saved = fingerprint(trainer)
    del trainer
    gc.collect()
    resumed = {}
    for _ in range(settings["rounds"]):
        for kind, path in (("sharded load", sharded), ("consolidated load", consolidated)):
            args.resume = path
            original = checkpoint.Checkpoint
            checkpoint.Checkpoint = original if kind == "sharded load" else ConsolidatedFile
            loaded, seconds, peaks = _phase(lambda: train.Trainer(args, config, mesh, data, device))
            checkpoint.Checkpoint = original
            rounds[kind].append((seconds, peaks))
            exact = torch.tensor([float(fingerprint(loaded) == saved)])
            dist.all_reduce(exact, op=dist.ReduceOp.MIN)
            resumed[kind] = bool(exact.item())
            del loaded
            gc.collect()
    predicted = plan.predict_peaks(cli.parse_args(CHECKPOINT_RUN), world)
    return dict(ranks=world, run=CHECKPOINT_RUN, rounds=settings["rounds"], startup=(startup_s, startup_peaks),
                step=(step_s, step_peaks), blocking_s=blocking, measured=rounds, resumed_exactly=resumed,
                bytes=dict(sharded=sum(os.path.getsize(os.path.join(sharded, f)) for f in os.listdir(sharded)),
                           consolidated=os.path.getsize(consolidated)),
                predicted={k: v for k, v in predicted.items()})


def checkpoint_comparison(out, rounds=2, ranks=4):
    """worker_checkpoint on `ranks` ranks, summarised: per kind the median seconds over rounds and the largest
    peak over ranks and rounds, beside tools/plan.py's predicted peaks."""
    print(f"bench: checkpoints, sharded and consolidated, {ranks} ranks", flush=True)
    settings = dict(out=os.path.join(out, "checkpoint"), rounds=rounds)
    os.makedirs(settings["out"], exist_ok=True)
    stdout = torchrun(ranks, "-m", "tools.bench", "--worker", "checkpoint", "--settings", json.dumps(settings))
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    summary = {kind: dict(seconds=statistics.median(s for s, _ in values), seconds_range=[
        min(s for s, _ in values), max(s for s, _ in values)], peak_bytes=max(max(p) for _, p in values))
        for kind, values in result["measured"].items()}
    summary["sharded save"]["blocking_seconds"] = statistics.median(result["blocking_s"])
    for phase in ("startup", "step"):
        summary[phase] = dict(seconds=result[phase][0], peak_bytes=max(result[phase][1]))
    shutil.rmtree(settings["out"], ignore_errors=True)
    return dict(result, summary=summary)


# -- ZeRO-3 beside ZeRO-1 under a pipeline (1F1B): time, memory, bytes --------------------------------

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
    again from the current one (_reset_peak), so the peak_resident_bytes a run logs (VmHWM) is its own: the
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
            _reset_peak()
            start = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
            dist.all_gather(start, torch.tensor([_status_kib("VmRSS") * 1024.0], dtype=torch.float64))
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
    started = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
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


# -- Muon beside AdamW: the optimizer step's time, and Muon's two ways of assembling a matrix ------------------

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
    """The median of the rounds' paired ratios, and their range (_ratio's), by name."""
    ratio, spread = _ratio(dict(numerator=numerator, denominator=denominator), "numerator", "denominator")
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
        measured = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
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


# -- Muon's convergence beside AdamW's: a learning-rate sweep of each on the synthetic language ----------------

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


RUN_ALONE = {"attention": worker_attention, "checkpoint": worker_checkpoint,
             "zero_pipeline": worker_zero_pipeline, "muon": worker_muon}  # run by their own part of main
DEVICE_WORKERS = {"muon"}  # they join the launch's group as train.py does (NCCL on GPUs), on its device


def run_worker(name, settings_json):
    import torch.distributed as dist
    settings = json.loads(settings_json)
    if name in DEVICE_WORKERS:
        from training.launch import init_distributed
        init_distributed()
    else:
        dist.init_process_group("gloo")
    result = RUN_ALONE[name](settings) if name in RUN_ALONE else WORKERS[name][1](settings)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def run_comparisons(settings, out, names=None):
    results = {}
    for name, (world, _) in WORKERS.items():
        if names and name not in names:
            continue
        print(f"bench: {name} against the built-in ({world} ranks)", flush=True)
        stdout = torchrun(world, "-m", "tools.bench", "--worker", name, "--settings", json.dumps(settings))
        results[name] = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    return results


# ---------------------------------------------------------------------------
# Part 3: the soak (--soak): launches that never fail, and kills that lose nothing
# ---------------------------------------------------------------------------

SELF_CHECKS = {"dp.py": 4, "tp.py": 2, "pp.py": 4, "cp.py": 4, "ep.py": 4}  # file: ranks, as in the README's reading map
SOAK_RUN = ["train.py", "--model", "tiny", "--batch-size", "8", "--micro-batches", "2", "--dtype", "float64",
            "--tp", "2", "--pp", "2", "--ep", "2", "--experts", "4", "--eval-interval", "1000"]  # 8 ranks


def soak(out, repeats=20, steps=300, kill_every=40):
    """Every dimension's self-check and a short composed train.py launch, `repeats` times each in a row,
    counting failures (a flaky teardown shows here, where one run would not); then a run of `steps`
    steps whose workers are SIGKILLed every `kill_every` logged steps, set against the same run
    uninterrupted."""
    launches = {name: (ranks, [name]) for name, ranks in SELF_CHECKS.items()}
    launches["train.py"] = (8, [*SOAK_RUN, "--steps", "3", "--out", os.path.join(out, "soak", "launches")])
    failures = {}
    for name, (ranks, argv) in launches.items():
        print(f"bench: soak, {name} on {ranks} ranks x {repeats}", flush=True)
        failures[name] = []
        for i in range(repeats):
            run = subprocess.run(torchrun_command(ranks, *argv), cwd=REPO, env=ENV, capture_output=True, text=True,
                                 timeout=600)
            if run.returncode:
                failures[name].append(dict(launch=i, returncode=run.returncode, stderr=run.stderr[-2000:]))
    result = dict(repeats=repeats, failures={name: len(f) for name, f in failures.items()}, failed=failures,
                  kills=killed_run(os.path.join(out, "soak"), steps, kill_every))
    write_json(os.path.join(out, "soak.json"), result)
    return result


def killed_run(out, steps, kill_every):
    """Train `steps` steps under torchrun --max-restarts, SIGKILLing a worker whenever `kill_every` more
    steps are logged; then the same run with no kill. Returns the restarts, the steps trained twice
    (logged, then lost with the worker: they come after the last checkpoint) and the largest difference
    of the final weights and of the losses between the two."""
    argv = [*SOAK_RUN, "--steps", str(steps), "--checkpoint-interval", "10", "--resume", "auto", "--log-interval", "1"]
    log = os.path.join(out, "killed", "soak", "log.jsonl")
    print(f"bench: soak, {steps} steps with a worker killed every {kill_every}", flush=True)
    launch = subprocess.Popen(torchrun_command(8, *argv, "--out", os.path.join(out, "killed"), "--name", "soak",
                                               max_restarts=steps // kill_every + 1),
                              cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    reader = threading.Thread(target=lambda: output.extend(launch.stdout), daemon=True)
    reader.start()
    kills = 0
    for logged in range(kill_every, steps, kill_every):
        while launch.poll() is None and not (os.path.exists(log) and len(read_log(log)) >= logged):
            time.sleep(0.05)
        if launch.poll() is not None:
            break
        os.kill(worker_pids(launch.pid)[-1], signal.SIGKILL)
        kills += 1
    launch.wait()
    reader.join()
    if launch.returncode:
        raise RuntimeError("the killed run did not finish:\n" + "".join(output[-40:]))
    torchrun(8, *argv, "--out", os.path.join(out, "uninterrupted"), "--name", "soak")
    from training import checkpoint
    final = {kind: checkpoint.Checkpoint(checkpoint.checkpoints(os.path.join(out, kind, "soak"))[0]).model_state()
             for kind in ("killed", "uninterrupted")}
    losses = {kind: [e["loss"] for e in read_log(os.path.join(out, kind, "soak", "log.jsonl"))]
              for kind in ("killed", "uninterrupted")}
    return dict(steps=steps, kills=kills, restarts=sum(line.startswith("run ") for line in output) - 1,
                steps_recomputed=sum(line.startswith("step ") for line in output) - steps,
                log_steps=[e["step"] for e in read_log(log)] == list(range(steps)),
                max_weight_difference=max((final["killed"][k] - v).abs().max().item()
                                          for k, v in final["uninterrupted"].items()),
                max_loss_difference=max(abs(a - b) for a, b in zip(losses["killed"], losses["uninterrupted"])))


def worker_pids(launcher_pid):
    """The processes whose parent is the launcher (torchrun's workers), oldest first."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == launcher_pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return sorted(found)


# ---------------------------------------------------------------------------

def machine():
    import torch
    return dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cores=os.cpu_count(), torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def main():
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model and few steps: a few minutes")
    p.add_argument("--out", default=os.path.join(REPO, "results"))
    p.add_argument("--only", nargs="*", help="run only these configurations / comparisons (and 'scaling' for the "
                                             "scaling check, 'recompute' for the recomputation modes, 'planner' for tools/plan.py's "
                                             "strategies measured, 'documents' for document masking against plain causal attention, "
                                             "'zero_pipeline' for ZeRO-3 beside ZeRO-1 under 1F1B, "
                                             "'muon' for Muon's step beside AdamW's and its two assemblies, "
                                             "'muon_convergence' for their learning-rate sweeps, "
                                             "'checkpoint' for sharded against "
                                             "consolidated checkpoints, 'pipeline' for the five schedules' "
                                             "timelines, 'precision' for bfloat16 before and after its "
                                             "mixed-precision policy); the rest "
                                             "keep their earlier results")
    p.add_argument("--model", default=None, help="override the preset (tests use tiny)")
    p.add_argument("--arch", choices=("gpt", "llama"), default="gpt", help="the table's block (train.py --arch)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of one device, for MFU (default: train.py's table of GPUs)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="of the table's runs (bfloat16: bfloat16 weights with float32 master weights)")
    p.add_argument("--soak", action="store_true",
                   help="only the soak: repeated self-checks and launches, and a run killed every few dozen steps")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return run_worker(args.worker, args.settings)
    if args.soak:
        result = soak(args.out)
        print(json.dumps(dict(failures=result["failures"], kills=result["kills"]), indent=2))
        return
    settings = dict(QUICK if args.quick else FULL)
    if args.model:
        settings["model"] = args.model
    settings.update(arch=args.arch, dtype=args.dtype, peak_tflops=args.peak_tflops)
    os.makedirs(args.out, exist_ok=True)
    # With --only, what is not run again keeps its earlier results.
    earlier = {name: read_json(os.path.join(args.out, name)) if args.only else {}
               for name in ("machine.json", "comparisons.json")}
    info = dict(machine(), settings=settings)
    run_table(settings, args.out, args.only)
    if not args.only or any(name in args.only for name, *_ in CONFIGS):
        rows = summarise(args.out, settings, info["cores"])
        write_json(os.path.join(args.out, "summary.json"), rows)
    else:  # the table was not run again: its earlier summary stands
        rows = read_json(os.path.join(args.out, "summary.json")) or []
    if not args.only or "attention" in args.only:
        attention = attention_by_length(settings["attention_lengths"])
        write_json(os.path.join(args.out, "attention.json"), attention)
        for row in attention["rows"]:
            print(f"attention {row['length']:6d} tokens: " + ", ".join(
                f"{kind} {row[kind]['peak_bytes'] / 2**20:,.0f} MiB {row[kind]['seconds']:.2f} s "
                f"{row[kind]['bytes_sent'] / 2**20:,.0f} MiB sent" for kind in ATTENTION_ARMS))
    if not args.only or "recompute" in args.only:
        recomputation = recomputation_check(settings, args.out)
        write_json(os.path.join(args.out, "recomputation.json"), recomputation)
        for mode, r in recomputation["modes"].items():
            print(f"recompute {mode:9s} activations {r['activation_peak_bytes']:,} bytes, step time x"
                  f"{r['step_time_vs_none']:.2f} of none's (range {r['range'][0]:.2f}-{r['range'][1]:.2f})")
    if not args.only or "pipeline" in args.only:
        pipeline = pipeline_schedules(args.out)
        write_json(os.path.join(args.out, "pipeline.json"), pipeline)
        for name, p in pipeline["schedules"].items():
            print(f"pipeline {name:11s} bubble {p['bubble']:.3f} (formula {p['formula']:.3f}), "
                  f"step {p['step_s']:.2f} s")
        for name, r in pipeline["over_1f1b"].items():
            print(f"pipeline {name} bubble / 1F1B's {r['bubble_ratio']:.2f} (rounds {r['range'][0]:.2f}-"
                  f"{r['range'][1]:.2f})")
        zbv = pipeline["zbv_against_pytorch"]
        print(f"pipeline zbv step / PyTorch's ScheduleZBVZeroBubble {zbv['ratio']:.2f} (rounds "
              f"{zbv['ratio_range'][0]:.2f}-{zbv['ratio_range'][1]:.2f}), loss difference "
              f"{zbv['max_loss_difference']:.2g}")
    if not args.only or "checkpoint" in args.only:
        checkpoints = checkpoint_comparison(args.out)
        write_json(os.path.join(args.out, "checkpoint.json"), checkpoints)
        for kind, row in checkpoints["summary"].items():
            print(f"checkpoint {kind:17s} {row['seconds']:7.1f} s, peak resident {row['peak_bytes'] / 2**30:.2f} GiB")
    if not args.only or "documents" in args.only:
        documents = documents_check(settings, args.out)
        write_json(os.path.join(args.out, "documents.json"), documents)
        for name, row in documents["rows"].items():
            print(f"documents {name:5s} ({row['documents_per_sequence']:.1f} a sequence): step time x"
                  f"{row['step_time_ratio']:.2f} ({row['step_time_range'][0]:.2f}-{row['step_time_range'][1]:.2f}), "
                  f"attention x{row['attention_time_ratio']:.2f} ({row['attention_time_range'][0]:.2f}-"
                  f"{row['attention_time_range'][1]:.2f}) of plain causal's")
    if not args.only or "zero_pipeline" in args.only:
        zero = zero_pipeline_check(settings, args.out)
        write_json(os.path.join(args.out, "zero_pipeline.json"), zero)
        low, high = zero["step_time_range"]
        print(f"zero under 1f1b: ZeRO-3 step / ZeRO-1's {zero['step_time_ratio']:.2f} (rounds {low:.2f}-{high:.2f}), "
              f"loss difference {zero['max_loss_difference']:.2g}")
        for arm, row in zero["arms"].items():
            print(f"zero under 1f1b: {arm} {row['step_s']:.3f} s a step, per rank: peak resident " +
                  " ".join(f"{b / 2**20:.0f}" for b in row["per_rank"]["peak_resident_bytes"]) +
                  " MiB, param+grad+optim " + " ".join(f"{b:,}" for b in row["param_grad_optim_bytes"]) +
                  " bytes, dp sent " + " ".join(f"{b:,}" for b in row["dp_bytes_per_step"]) + " bytes a step")
    if not args.only or "muon" in args.only:
        muon = muon_check(settings, args.out)
        write_json(os.path.join(args.out, "muon.json"), muon)
        for layout, row in muon["layouts"].items():
            for arm, a in row["arms"].items():
                print(f"muon {layout:20s} {arm:6s} step {a['step_s']:.4f} s, optimizer step {a['optimizer_s']:.4f} s, "
                      f"Muon sent per step (bytes, per rank) " +
                      " ".join(f"{b:,}" for b in a["per_rank"]["comm_optim_all_to_all_bytes"]))
            ratios = dict(row["muon_over_adamw"], **{f"gather/owner {k}": v for k, v in
                                                     row.get("gather_over_owner", {}).items() if k != "bytes"})
            print(f"muon {layout:20s} " + ", ".join(
                f"{k if k.startswith('gather') else 'muon/adamw ' + k} x{v['ratio']:.2f} ({v['range'][0]:.2f}-"
                f"{v['range'][1]:.2f})" for k, v in ratios.items()))
    if not args.only or "muon_convergence" in args.only:
        convergence = muon_convergence(settings, args.out)
        write_json(os.path.join(args.out, "muon_convergence.json"), convergence)
        for r in convergence["runs"]:
            print(f"muon convergence {r['optimizer']:5s} lr {r['lr']:<7g} final loss {r['final_loss']:.4f}, "
                  f"validation {r['final_val_loss']:.4f}")
        for optimizer, b in convergence["best"].items():
            print(f"muon convergence {optimizer}: best lr {b['lr']:g}, validation loss {b['final_val_loss']:.4f} "
                  f"(entropy floor {convergence['entropy_floor']:.4f})")
    if not args.only or "planner" in args.only:
        write_json(os.path.join(args.out, "planner.json"), planner_check(args.out))
    if not args.only or "precision" in args.only:
        precision = precision_check(settings, args.out)
        write_json(os.path.join(args.out, "precision.json"), precision)
        for layout, row in precision["layouts"].items():
            print(f"bfloat16 {layout:22s} step {row['before']['step_s']:.3f} s -> {row['after']['step_s']:.3f} s "
                  f"(x{row['step_time_ratio']:.2f}, {row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f}), peak "
                  f"{row['before']['peak_resident_gib']:.2f} -> {row['after']['peak_resident_gib']:.2f} GiB, sent "
                  f"{row['before']['comm_bytes']:,} -> {row['after']['comm_bytes']:,} bytes")
    if not args.only or "scaling" in args.only:
        info["scaling"] = scaling_check(settings, args.out, info["cores"])
    elif "scaling" in earlier["machine.json"]:
        info["scaling"] = earlier["machine.json"]["scaling"]
    write_json(os.path.join(args.out, "machine.json"), info)
    comparisons = dict(earlier["comparisons.json"], **run_comparisons(settings, args.out, args.only))
    write_json(os.path.join(args.out, "comparisons.json"), comparisons)
    for r in rows:
        efficiency = f"{r['efficiency']:.0%}" if r["efficiency"] is not None else "?"
        print(f"{r['name']:24s} {r['tokens_per_s']:10,.0f} tok/s  efficiency {efficiency}  "
              f"val {r['final_val_loss']:.4f}")
    if "scaling" in info:
        check = info["scaling"]
        print(f"scaling  data parallelism on {check['ranks']} ranks: {check['efficiency']:.0%} of the ceiling "
              f"(independent processes: {check['machine_scaling']:.0%})")
    for name, c in comparisons.items():
        print(f"{name:8s} ours/built-in step time {c['ratio']:.2f}  loss difference {c['max_loss_difference']:.2g}")


if __name__ == "__main__":
    main()
