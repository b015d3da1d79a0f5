"""Figures and the results table from what tools/bench/ wrote to results/.

    python plot.py [--results results]
    python plot.py --timeline runs/<name>/log.jsonl   # a pipeline run's measured timeline

Writes results/throughput.png, loss.png, memory.png, communication.png,
bubble.png, experts.png, documents.png (packed documents' attention mask and the ring attention
blocks it skips), memory_planned.png (tools/plan/'s memory per strategy by
sequence length) and memory_measured.png (tools/bench/'s small runs of the same
strategies, measured beside predicted), both from planner.json, timelines.png (the pipeline
schedules as measured), muon_convergence.png (Muon's and AdamW's learning-rate
sweeps, where results/muon_convergence.json exists), fp8.png (each --fp8 recipe's
loss beside bfloat16's, where results/fp8.json exists) and results/results.md (the
seed table's columns, plus memory, communication and efficiency, the comparisons
with PyTorch's built-ins, ZeRO-3 beside ZeRO-1 under 1F1B where
results/zero_pipeline.json exists, and Muon beside AdamW where results/muon.json does).
"""
import argparse
import json
import os

import matplotlib
matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def load(results):
    """The table's summary, its runs' logs and entropy floor (None, None where the runs' folders are absent: they
    are not kept in git, so a fresh checkout has the summary alone), the comparisons and the machine."""
    with open(os.path.join(results, "summary.json")) as f:
        rows = json.load(f)
    logs, floor = {}, None
    for r in rows:
        path = os.path.join(results, "runs", r["name"], "log.jsonl")
        if not os.path.exists(path):
            logs = None
            break
        with open(path) as f:
            logs[r["name"]] = [json.loads(line) for line in f]
    if logs is not None:
        with open(os.path.join(results, "runs", rows[0]["name"], "config.json")) as f:
            floor = json.load(f)["entropy_floor"]
    comparisons = optional_result(results, "comparisons.json") or {}
    with open(os.path.join(results, "machine.json")) as f:
        machine = json.load(f)
    return rows, logs, floor, comparisons, machine


def optional_result(results, name):
    """A JSON result tools/bench/ writes only when asked (--only ...), or None."""
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def short(name):
    return name.replace("_pp1", "").replace("_cp1", "").replace("_tp1", "").replace("_ep1", "")


def save(fig, results, name):
    fig.tight_layout()
    fig.savefig(os.path.join(results, name), dpi=110)
    plt.close(fig)


def throughput(rows, results):
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = np.arange(len(rows))
    ax.bar(x, [r["tokens_per_s"] for r in rows], color="tab:blue", label="measured")
    ax.scatter(x, [r["ceiling_tokens_per_s"] for r in rows], color="black", marker="_", s=400,
               label="compute-bound ceiling: 1-rank throughput x min(ranks, cores)")
    ax.set_xticks(x, [short(r["name"]) for r in rows], rotation=30, ha="right")
    ax.set_ylabel("tokens / s (steady state)")
    ax.set_title("Throughput per configuration")
    ax.legend()
    save(fig, results, "throughput.png")


def losses(rows, logs, floor, results):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in rows:
        log = logs[r["name"]]
        axes[0].plot([e["step"] for e in log], [e["loss"] for e in log], label=short(r["name"]), lw=1)
        val = [(e["step"], e["val_loss"]) for e in log if "val_loss" in e]
        axes[1].plot(*zip(*val), marker="o", label=short(r["name"]), lw=1)
    for ax, title in zip(axes, ("training loss", "validation loss")):
        if floor:
            ax.axhline(floor, color="black", ls="--", label=f"entropy floor {floor:.3f}")
        ax.set_xlabel("step")
        ax.set_title(title)
    axes[1].legend(fontsize=7)
    save(fig, results, "loss.png")


def stacked_bars(rows, series, ylabel, title, results, name):
    """One bar per configuration, stacked from series: [(label, values in MiB)]."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for label, values in series:
        ax.bar(x, values, bottom=bottom, label=label)
        bottom += values
    ax.set_xticks(x, [short(r["name"]) for r in rows], rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    save(fig, results, name)


def memory(rows, results):
    series = [(label, np.array([r[key] for r in rows]) / 2**20)
              for key, label in [("param_bytes", "parameters"), ("grad_bytes", "gradients"),
                                 ("optim_bytes", "optimizer state"), ("activation_bytes", "activations (peak)")]]
    stacked_bars(rows, series, "MiB on the busiest rank", "Memory per rank, counted from tensors", results,
                 "memory.png")


def communication(rows, results):
    dims = sorted({d for r in rows for d in r["comm_bytes_per_step"]})
    series = [(dim, np.array([r["comm_bytes_per_step"].get(dim, 0) for r in rows]) / 2**20) for dim in dims]
    stacked_bars(rows, series, "MiB sent per step, all ranks", "Communication per dimension", results,
                 "communication.png")


def bubble(rows, logs, results):
    pipelined = [r for r in rows if r["bubble_formula"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(pipelined):
        per_rank = np.mean([e["pp_bubble"] for e in logs[r["name"]][1:]], axis=0)
        ax.scatter([i] * len(per_rank), per_rank, label=f"{short(r['name'])}: measured, per rank")
        ax.scatter([i], [r["bubble_formula"]], marker="x", color="black", s=80)
    ax.set_xticks(range(len(pipelined)), [short(r["name"]) for r in pipelined])
    ax.set_ylabel("idle fraction of a step")
    ax.set_title("Pipeline bubble: measured (dots) and (P-1)/(V*M+P-1) (cross)")
    ax.legend(fontsize=7)
    save(fig, results, "bubble.png")


def experts(rows, logs, results):
    moe = [r for r in rows if "tokens_per_expert" in logs[r["name"]][-1]]
    fig, axes = plt.subplots(1, max(len(moe), 1), figsize=(6 * max(len(moe), 1), 4), squeeze=False)
    for ax, r in zip(axes[0], moe):
        counts = np.array(logs[r["name"]][-1]["tokens_per_expert"])  # (layers, experts), last step
        for layer, row in enumerate(counts):
            ax.bar(np.arange(len(row)) + layer * 0.8 / len(counts), row, width=0.8 / len(counts),
                   label=f"layer {layer}")
        ax.axhline(counts.sum(1).mean() / counts.shape[1], color="black", ls="--", label="balanced")
        ax.set_xlabel("expert")
        ax.set_ylabel("tokens routed (last step)")
        ax.set_title(short(r["name"]))
        ax.legend(fontsize=7)
    save(fig, results, "experts.png")


def table(rows, comparisons, machine, results):
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    settings, device = machine["settings"], f", {machine['gpu']}" if machine.get("gpu") else " (CPU, gloo)"
    lines = [f"Measured on {machine['processor']}, {machine['cores']} cores, torch {machine['torch']}{device}; "
             f"model `{settings['model']}`, global batch {settings['batch_size']} sequences, {settings['steps']} steps.",
             "", "| Run | Parallelism | Avg Tok/Sec | Final Val Loss | Efficiency "
             "| Params / Grads / Optim / Activations (MiB, busiest rank) | Sent per step (MiB) "
             "| Compute / wait (s per step) | Bubble (measured / formula) |",
             "|---|---|---|---|---|---|---|---|---|"]
    if machine.get("scaling"):
        check = machine["scaling"]

        def span(key):  # the median over rounds, and the range
            low, high = check[key + "_range"]
            return f"{check[key]:.0%} (rounds: {low:.0%} to {high:.0%})"
        lines[1:1] = ["", f"Efficiency is against the compute-bound ceiling, 1-rank throughput x min(ranks, cores). "
                      f"Measured on its own, alternating 1 rank and {check['ranks']} in {check['rounds']} rounds of "
                      f"{check['steps']} steps: data parallelism on {check['ranks']} ranks reaches "
                      f"{span('efficiency')} of the ceiling; {check['ranks']} independent 1-rank trainings at once, "
                      f"each on 1/{check['ranks']} of the batch and with no communication, reach "
                      f"{span('machine_scaling')}."]
    for r in rows:
        comm = ", ".join(f"{d} {v / 2**20:.2f}" for d, v in r["comm_bytes_per_step"].items() if v) or "none"
        bubble_cell = f"{r['bubble']:.2f} / {r['bubble_formula']:.2f}" if r["bubble"] is not None else ""
        val = f"{r['final_val_loss']:.4f}" if r["final_val_loss"] is not None else ""
        efficiency = f"{r['efficiency']:.0%}" + (f" (MFU {r['mfu']:.0%})" if r.get("mfu") is not None else "")
        lines.append(f"| {r['name']} | {r['demonstrates']} | {r['tokens_per_s']:,.0f} | {val} | {efficiency} "
                     f"| {mib(r['param_bytes'])} / {mib(r['grad_bytes'])} / {mib(r['optim_bytes'])} / "
                     f"{mib(r['activation_bytes'])} | {comm} | {r['compute_s']:.3f} / {r['comm_wait_s']:.3f} "
                     f"| {bubble_cell} |")
    if comparisons:
        lines += ["", "| This repository | PyTorch built-in | Ours (s/step) | Built-in (s/step) | Ours / built-in "
                      "(range over rounds) | Largest loss difference |", "|---|---|---|---|---|---|"]
        names = {"ddp": ("dp.py DataParallel", "DistributedDataParallel"),
                 "fsdp": ("dp.py ZeRO-3", "FSDP2 fully_shard"),
                 "tp": ("tp.py column/row-parallel blocks", "DTensor parallelize_module (Colwise/Rowwise)"),
                 "pp_1f1b": ("pp.py 1F1B", "torch.distributed.pipelining Schedule1F1B"),
                 "pp_gpipe": ("pp.py GPipe", "torch.distributed.pipelining ScheduleGPipe"),
                 "pp_zb1": ("pp.py ZB-H1",
                            "torch.distributed.pipelining ScheduleInterleavedZeroBubble (one stage a rank)"),
                 "pp_zbv": ("pp.py ZB-V", "torch.distributed.pipelining ScheduleZBVZeroBubble (two stages a rank)")}
        for key, c in comparisons.items():
            ours, theirs = names.get(key, (key, "built-in"))
            lines.append(f"| {ours} | {theirs} | {c['ours_step_s']:.4f} | {c['builtin_step_s']:.4f} | {c['ratio']:.2f} "
                         f"({c['ratio_range'][0]:.2f} to {c['ratio_range'][1]:.2f}) | {c['max_loss_difference']:.2g} |")
        if "over_no_communication" in comparisons.get("ddp", {}):
            c = comparisons["ddp"]
            low, high = c["over_no_communication_range"]
            lines += ["", f"dp.py's data-parallel step takes {c['over_no_communication']:.2f}x (rounds: {low:.2f} to "
                          f"{high:.2f}) the time of the same ranks training their shares with no communication."]
    lines += zero_pipeline_lines(optional_result(results, "zero_pipeline.json"))
    lines += muon_lines(optional_result(results, "muon.json"))
    with open(os.path.join(results, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def zero_pipeline_lines(zero):
    """results.md's paragraph and table of python -m tools.bench --only zero_pipeline: ZeRO-1 and ZeRO-3 under 1F1B."""
    if zero is None:
        return []

    def by_rank(ranks, *fields, scale=2**20, digits=3):  # "a / b ; a / b ; ...": the fields of each rank in turn
        return " ; ".join(" / ".join(f"{ranks[field][r] / scale:,.{digits}f}" for field in fields)
                          for r in range(zero["ranks"]))
    low, high = zero["step_time_range"]
    lines = ["", f"ZeRO-3 beside ZeRO-1 under the 1F1B schedule: model `{zero['model']}`, pp {zero['pp']} x dp "
                 f"{zero['dp']} on {zero['ranks']} ranks, {zero['batch_size']} sequences in {zero['micro_batches']} "
                 f"micro-batches, {zero['rounds']} rounds of {zero['steps']} steps, the two runs in turn in each "
                 f"round (the order rotated) in the same processes. ZeRO-3's step takes "
                 f"{zero['step_time_ratio']:.2f}x ZeRO-1's (median of the rounds' ratios; rounds: {low:.2f} to "
                 f"{high:.2f}); largest loss difference {zero['max_loss_difference']:.2g}. Per rank, ranks 0 ; 1 ; ... "
                 f"(the pipeline stage is the rank modulo {zero['pp']}); parameter, gradient and optimizer bytes as "
                 "logged after the step (under a pipeline ZeRO-3 holds its stage's full weights and gradients "
                 "during the step, as ZeRO-1 does: see dp.py); the peak resident memory (VmHWM, the median over "
                 "rounds) is the whole process's during the run, the interpreter and PyTorch included; in brackets "
                 "its rise above what the process held at the run's start (which includes what earlier runs left).",
             "", "| ZeRO | Step (s, median; rounds) | Peak resident (MiB; above the run's start) "
                 "| Params / grads / optim (MiB) "
                 "| dp sent per step: reduce-scatter / all-gather (MiB) | dp all-reduce (bytes) "
                 "| pp sent per step (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for arm, label in (("zero1", "ZeRO-1"), ("zero3", "ZeRO-3")):
        row = zero["arms"][arm]
        ranks = row["per_rank"]
        peaks = " ; ".join(f"{p / 2**20:.0f} (+{a / 2**20:.0f})"
                           for p, a in zip(ranks["peak_resident_bytes"], ranks["peak_above_start_bytes"]))
        lines.append(f"| {label} | {row['step_s']:.4f} ({row['step_s_range'][0]:.4f} to {row['step_s_range'][1]:.4f}) "
                     f"| {peaks} "
                     f"| {by_rank(ranks, 'param_bytes', 'grad_bytes', 'optim_bytes')} "
                     f"| {by_rank(ranks, 'comm_dp_reduce_scatter_bytes', 'comm_dp_all_gather_bytes')} "
                     f"| {by_rank(ranks, 'comm_dp_all_reduce_bytes', scale=1, digits=0)} "
                     f"| {by_rank(ranks, 'comm_pp_send_recv_bytes')} |")
    return lines


def muon_lines(muon):
    """results.md's paragraph and table of python -m tools.bench --only muon: Muon's step beside AdamW's, and its two
    assemblies, per layout."""
    if muon is None:
        return []
    lines = ["", f"Muon beside AdamW: model `{muon['model']}` ({muon['arch']} block, {muon['dtype']}), "
                 f"{muon['batch_size']} sequences a step, {muon['rounds']} rounds of {muon['k']} steps of each arm in "
                 "turn in the same processes (the order rotated); times are the slowest rank's, medians over rounds "
                 "(range); ratios are medians of the rounds' ratios (range): Muon's (owner) over AdamW's, gather's "
                 "over owner's. Muon's bytes are those each rank sent per step by its all-to-alls "
                 "(comm_optim_all_to_all_bytes), ranks 0 ; 1 ; ...",
             "", "| Layout | Optimizer | Step (s) | Optimizer step (s) | Optimizer state (KiB a rank) "
                 "| Muon sent per step (bytes a rank) | Ratio: step / optimizer step |",
             "|---|---|---|---|---|---|---|"]
    labels = {"adamw": "AdamW", "owner": "Muon, owner", "gather": "Muon, gather"}
    span = lambda r: f"{r['ratio']:.2f} ({r['range'][0]:.2f} to {r['range'][1]:.2f})"  # noqa: E731
    after = []
    for layout, row in muon["layouts"].items():
        ratios = dict(owner=row["muon_over_adamw"], gather=row.get("gather_over_owner"))
        for arm, a in row["arms"].items():
            ratio = f"{span(ratios[arm]['step'])} / {span(ratios[arm]['optimizer'])}" if arm in ratios else ""
            lines.append(f"| {layout} ({row['ranks']} rank{'s' * (row['ranks'] > 1)}) | {labels[arm]} "
                         f"| {a['step_s']:.4f} ({a['step_s_range'][0]:.4f} to {a['step_s_range'][1]:.4f}) "
                         f"| {a['optimizer_s']:.4f} ({a['optimizer_s_range'][0]:.4f} to {a['optimizer_s_range'][1]:.4f}) "
                         f"| {' ; '.join(f'{b / 2**10:.0f}' for b in a['per_rank']['optim_bytes'])} "
                         f"| {' ; '.join(f'{b:,}' for b in a['per_rank']['comm_optim_all_to_all_bytes'])} | {ratio} |")
        if ratios["gather"]:
            after.append(f"- {layout}: the gather assembly sends {ratios['gather']['bytes']:.2f}x the owner's bytes "
                         f"(all ranks together); largest loss difference of the two {row['max_loss_difference']:.2g}.")
    return lines + ([""] + after if after else [])


def muon_convergence(results):
    """python -m tools.bench --only muon_convergence: each optimizer at its best learning rate, its training loss (a
    moving average) and its validation loss; and every run's final validation loss by learning rate."""
    convergence = optional_result(results, "muon_convergence.json")
    if convergence is None:
        return
    colours = {"adamw": "tab:blue", "muon": "tab:red"}
    labels = {"adamw": "AdamW", "muon": "Muon (AdamW for the rest)"}
    floor = convergence["entropy_floor"]
    fig, (training, validation, sweep) = plt.subplots(1, 3, figsize=(16, 4.5))
    window = max(1, convergence["steps"] // 30)
    for optimizer, best in convergence["best"].items():
        run = next(r for r in convergence["runs"] if r["optimizer"] == optimizer and r["lr"] == best["lr"])
        loss = np.convolve(run["loss"], np.ones(window) / window, mode="valid")
        label = f"{labels[optimizer]}, lr {best['lr']:g}"
        training.plot(np.arange(len(loss)) + window - 1, loss, color=colours[optimizer], lw=1, label=label)
        validation.plot(*zip(*run["val_loss"]), color=colours[optimizer], marker="o", lw=1,
                        label=f"{label}: final {best['final_val_loss']:.4f}")
        runs = sorted((r for r in convergence["runs"] if r["optimizer"] == optimizer), key=lambda r: r["lr"])
        sweep.plot([r["lr"] for r in runs], [r["final_val_loss"] for r in runs], color=colours[optimizer],
                   marker="o", label=labels[optimizer])
    for ax in (training, validation, sweep):
        ax.axhline(floor, color="black", ls=":", lw=1, label=f"entropy floor {floor:.4f}")
        ax.legend(fontsize=8)
    training.set(xlabel="step", ylabel="loss", ylim=(floor - 0.05, floor + 1),
                 title=f"training loss (mean of {window} steps), best lr")
    validation.set(xlabel="step", title="validation loss, best lr")
    sweep.set(xscale="log", xlabel="peak learning rate (warm-up, cosine decay to 0.1x)",
              title=f"validation loss after {convergence['steps']} steps, by lr")
    fig.suptitle(f"Muon beside AdamW: model `{convergence['model']}` ({convergence['arch']} block), "
                 f"{convergence['batch_size']} sequences of the synthetic language a step, one rank, one seed",
                 fontsize=10)
    save(fig, results, "muon_convergence.png")


def fp8_convergence(results):
    """python -m tools.bench --only fp8: each recipe's training loss beside bfloat16's (moving averages), and its
    difference from bfloat16's step by step."""
    fp8 = optional_result(results, "fp8.json")
    if fp8 is None:
        return
    arms = fp8["arms"]
    window = max(1, len(arms["bfloat16"]["losses"]) // 40)
    smooth = lambda values: np.convolve(values, np.ones(window) / window, mode="valid")  # noqa: E731
    fig, (curves, difference) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (arm, run), colour in zip(arms.items(), ("black", "tab:blue", "tab:red")):
        steps = np.arange(len(run["losses"]) - window + 1) + window - 1
        curves.plot(steps, smooth(run["losses"]), color=colour, lw=1, label=f"{arm}: final {run['final_loss']:.4f}")
        if arm != "bfloat16":
            gap = np.array(run["losses"]) - np.array(arms["bfloat16"]["losses"])
            difference.plot(steps, smooth(gap), color=colour, lw=1,
                            label=f"{arm}: final {run['final_loss'] - arms['bfloat16']['final_loss']:+.4f}")
    difference.axhline(0, color="black", lw=0.5)
    curves.set(xlabel="step", ylabel="loss", yscale="log", title=f"training loss (mean of {window} steps)")
    difference.set(xlabel="step", ylabel="loss - bfloat16's", title="difference from bfloat16, same batches")
    for ax in (curves, difference):
        ax.legend(fontsize=8)
    fig.suptitle("--fp8 beside bfloat16: " + " ".join(fp8["flags"]), fontsize=9)
    save(fig, results, "fp8.png")


PARTS = [("param", "parameters", "tab:blue"), ("grad", "gradients", "tab:orange"),
         ("optim", "optimizer state", "tab:green"), ("activations", "activations (+ one block recomputed)", "tab:red")]
MODES = ("none", "selective", "full")


def stack(ax, x, width, memory, label_parts=False, hatch=None):
    """One stacked bar per x of the four parts (GiB)."""
    bottom = np.zeros(len(x))
    for key, label, colour in PARTS:
        heights = np.array([m[key] for m in memory]) / 2**30
        ax.bar(x, heights, width, bottom=bottom, color=colour, hatch=hatch, label=label if label_parts else None)
        bottom += heights
    return bottom


def planned_memory(results):
    """The playbook's figure, as tools/bench/ wrote tools/plan/'s figures into planner.json: per-rank memory of
    each strategy alone, by sequence length, for an 8B shape (EP: Mixtral 8x7B), without, with selective and
    with full recomputation, in bf16."""
    planner = optional_result(results, "planner.json")
    if planner is None:
        return
    planned, labels = planner["planned"], [label for label, *_ in planner["strategies"]]
    seq_lens, limit = planned["seq_lens"], 200
    x = np.arange(len(seq_lens))
    fig, axes = plt.subplots(len(MODES), len(labels), figsize=(24, 10), sharey=True)
    for row, mode in enumerate(MODES):
        for col, label in enumerate(labels):
            ax = axes[row, col]
            totals = stack(ax, x, 0.8, planned["memory"][mode][label], label_parts=row == 0 and col == 0)
            for xi, total in zip(x, totals):
                if total > limit:  # off the chart: say how far
                    ax.text(xi, limit * 0.97, f"{total:.0f}", rotation=90, ha="center", va="top", fontsize=7)
            ax.axhline(80, color="black", linestyle="--", linewidth=0.8)
            ax.set_ylim(0, limit)
            ax.set_xticks(x, [f"{s // 1024}K" for s in seq_lens], rotation=90, fontsize=7)
            if row == 0:
                ax.set_title(label + (f" ({planned['moe']})" if label.startswith("EP") else ""), fontsize=10)
            if col == 0:
                ax.set_ylabel(f"recompute {mode}\nGiB per GPU")
    fig.legend(loc="upper center", ncol=5, fontsize=9, bbox_to_anchor=(0.5, 0.965))
    fig.suptitle(f"tools/plan/: memory per GPU of {planned['model']} by sequence length, each strategy alone "
                 "(one sequence per rank and micro-batch, bf16 weights, float32 master weights and gradients); dashed: 80 GiB", y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(os.path.join(results, "memory_planned.png"), dpi=80)
    plt.close(fig)


def measured_memory(results):
    """tools/bench/'s small runs of the same strategies: measured (left) beside predicted (right, hatched)."""
    planner = optional_result(results, "planner.json")
    if planner is None:
        return
    points, labels = planner["points"], [label for label, *_ in planner["strategies"]]
    seq_lens = sorted({p["seq_len"] for p in points})
    fig, axes = plt.subplots(len(MODES), len(labels), figsize=(24, 9), sharey=True)
    x = np.arange(len(seq_lens))
    for row, mode in enumerate(MODES):
        for col, label in enumerate(labels):
            ax = axes[row, col]
            mine = {p["seq_len"]: p for p in points if p["strategy"] == label and p["recompute"] == mode}
            stack(ax, x - 0.2, 0.38, [mine[s]["measured"] for s in seq_lens], label_parts=row == 0 and col == 0)
            stack(ax, x + 0.2, 0.38, [mine[s]["predicted"] for s in seq_lens], hatch="//")
            ax.set_xticks(x, [str(s) for s in seq_lens], fontsize=8)
            if row == 0:
                ax.set_title(label, fontsize=10)
            if col == 0:
                ax.set_ylabel(f"recompute {mode}\nGiB per rank")
    fig.legend(loc="upper center", ncol=5, fontsize=9, bbox_to_anchor=(0.5, 0.965))
    fig.suptitle(f"Measured (plain) and predicted (hatched) memory of the busiest rank, {planner['model']}, by "
                 "sequence length; predicted activations add one block's recomputation, which the meter does "
                 "not see", y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(os.path.join(results, "memory_measured.png"), dpi=80)
    plt.close(fig)


ACTIONS = {"forward": ("F", "tab:blue"), "backward": ("B", "tab:orange"), "weight": ("W", "tab:green")}
TITLES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved 1F1B (2 chunks a rank)", "zb1": "ZB-H1",
          "zbv": "ZB-V (2 chunks a rank, in a V)"}


def draw_timeline(ax, timeline, title):
    """One measured pipeline step: a row per stage, a box per action (forward, input-backward, weight-backward)
    from when it started computing to when it ended, grey where it waited for its input."""
    for stage, actions in enumerate(timeline):
        for kind, chunk, micro, waited, start, end in actions:
            ax.barh(stage, start - waited, left=waited, color="lightgrey", height=0.8)
            letter, colour = ACTIONS[kind]
            ax.barh(stage, end - start, left=start, color=colour, alpha=1.0 if chunk == 0 else 0.6,
                    edgecolor="black", linewidth=0.3, height=0.8)
            ax.text((start + end) / 2, stage, f"{letter}{micro}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(timeline)), [f"stage {s}" for s in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)


def timeline_legend(fig):
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in ACTIONS.values()] + [
        plt.Rectangle((0, 0), 1, 1, color="lightgrey")]
    fig.legend(handles, ["forward", "backward (ZB-H1: input gradient, B)", "weight gradient (W)",
                         "waiting for its input"], loc="upper center", ncol=4, fontsize=9, bbox_to_anchor=(0.5, 0.97))


def timelines(results):
    """tools/bench/'s five schedules on the same model, P and M, one above the other, as measured."""
    pipeline = optional_result(results, "pipeline.json")
    if pipeline is None:
        return
    schedules = pipeline["schedules"]
    fig, axes = plt.subplots(len(schedules), 1, figsize=(14, 2.2 * len(schedules)), sharex=True)
    for ax, (name, run) in zip(axes, schedules.items()):
        draw_timeline(ax, run["timeline"], f"{TITLES[name]}: measured bubble {run['bubble']:.3f}, formula "
                                           f"{run['formula']:.3f}, step {run['step_s']:.2f} s")
    axes[-1].set_xlabel("seconds since the step's pipeline started (the last step of the last round)")
    timeline_legend(fig)
    fig.suptitle(f"Measured pipeline timelines ({' '.join(pipeline['flags'])}); a lighter box: the second chunk",
                 y=0.995, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(os.path.join(results, "timelines.png"), dpi=90)
    plt.close(fig)


def run_timeline(log_path):
    """The timeline train.py logged (the last step of a pipeline run), drawn beside its log."""
    with open(log_path) as f:
        entry = [json.loads(line) for line in f][-1]
    fig, ax = plt.subplots(figsize=(14, 1 + 0.5 * len(entry["pp_timeline"])))
    draw_timeline(ax, entry["pp_timeline"], f"step {entry['step']}: measured bubble per stage "
                  f"{', '.join(f'{b:.3f}' for b in entry['pp_bubble'])}, formula {entry['pp_bubble_formula']:.3f}")
    ax.set_xlabel("seconds since the step's pipeline started")
    timeline_legend(fig)
    fig.tight_layout(rect=(0, 0, 1, 0.85))
    out = os.path.join(os.path.dirname(log_path), "timeline.png")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def compared_runs(losses_a, losses_b, labels, out, parted_at=None):
    """python -m tools.compare --plot: two runs' losses ({step: loss}) as logged (left; B dashed, so that it
    shows over A where they agree) and B's minus A's on the steps both logged (right), the step where they
    first part marked."""
    fig, (curves, difference) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = (dict(color="black"), dict(color="tab:red", ls="--"))
    for losses, label, style in zip((losses_a, losses_b), labels, styles):
        curves.plot(list(losses), list(losses.values()), lw=1, label=label, **style)
    common = sorted(set(losses_a) & set(losses_b))
    difference.plot(common, [losses_b[s] - losses_a[s] for s in common], color="tab:blue", lw=1)
    difference.axhline(0, color="black", lw=0.5)
    if parted_at is not None:
        for ax in (curves, difference):
            ax.axvline(parted_at, color="grey", ls=":", lw=1, label=f"first parting: step {parted_at}")
    curves.set(xlabel="step", ylabel="loss", title="training loss")
    difference.set(xlabel="step", ylabel="loss B - loss A", title="difference, step by step")
    curves.legend(fontsize=8)
    save(fig, os.path.dirname(out), os.path.basename(out))
    return out


def moe_overlap(results):
    """The experts' all-to-alls of one measured step (the last stage's rank of ep 2 under pp 2, tools/bench's
    moe_overlap), a panel per way of overlapping them (in chunks within a layer; a micro-batch's beside another's,
    combined 1F1B) and a row per exchange (kind, chunk, forward or gradient): light from its start to its wait,
    when the rank computed beside it, dark while the rank waited for it."""
    overlap = optional_result(results, "moe_overlap.json")
    if overlap is None:
        return
    arms = {"overlapped": "in 4 chunks within each layer (--ep-overlap 4)",
            "paired": "each micro-batch's beside another's (--schedule combined)"}
    rows = {arm: sorted({name for name, *_ in overlap[arm]["exchanges"]}, key=lambda n: (n.endswith("grad"), n))
            for arm in arms}
    fig, axes = plt.subplots(len(arms), 1, figsize=(14, 0.3 * sum(map(len, rows.values())) + 3),
                             height_ratios=[len(r) for r in rows.values()])
    for ax, (arm, title) in zip(axes, arms.items()):
        for name, start, wait, end in overlap[arm]["exchanges"]:
            row = rows[arm].index(name)
            ax.barh(row, wait - start, left=start, color="tab:green", alpha=0.5, height=0.7)
            ax.barh(row, end - wait, left=wait, color="tab:red", height=0.7)
        ax.set_yticks(range(len(rows[arm])), rows[arm], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{title}: {overlap[arm]['fraction']:.0%} of the time in flight overlapped, over every rank "
                     f"and round", fontsize=10)
    axes[-1].set_xlabel("seconds since the step started")
    fig.suptitle(f"The experts' all-to-alls of one step, rank {overlap['drawn_rank']}: in flight beside computation "
                 f"(green), waited for (red)", fontsize=11)
    fig.tight_layout()
    fig.savefig(os.path.join(results, "moe_overlap.png"), dpi=90)
    plt.close(fig)


def document_masking(results, lengths=(7, 3, 12, 1, 9), n_ranks=4):
    """Packed documents (model.py's visible): left, which keys each query of one packed sequence attends
    to, cut into cp.py's 2N zigzag chunks; right, ring attention's blocks (query chunk, key chunk) each rank
    computes at each step, plain causal against document masking (a block whose mask is empty is skipped)."""
    import torch
    from model import document_ids, visible
    seq_len = sum(lengths)
    ends = torch.tensor(lengths).cumsum(0) - 1
    idx = torch.ones(1, seq_len, dtype=torch.long)
    idx[0, ends] = 0  # the EOS id: 0
    documents = document_ids(idx, 0)
    everything = torch.arange(seq_len)
    mask = visible(documents, None, everything, everything)[0, 0]
    chunk = seq_len // (2 * n_ranks)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.2))
    left.imshow(mask.numpy(), cmap="Blues", vmin=0, vmax=1.4)
    for edge in range(chunk, seq_len, chunk):
        left.axhline(edge - 0.5, color="grey", lw=0.5)
        left.axvline(edge - 0.5, color="grey", lw=0.5)
    left.set(title=f"documents of {', '.join(map(str, lengths))} tokens: the mask",
             xlabel="key position", ylabel="query position")
    causal, masked = np.zeros((n_ranks, n_ranks)), np.zeros((n_ranks, n_ranks))
    for rank in range(n_ranks):
        for step in range(n_ranks):
            source = (rank - step) % n_ranks
            for q_chunk in (rank, 2 * n_ranks - 1 - rank):
                for k_chunk in (source, 2 * n_ranks - 1 - source):
                    queries = torch.arange(q_chunk * chunk, (q_chunk + 1) * chunk)
                    keys = torch.arange(k_chunk * chunk, (k_chunk + 1) * chunk)
                    causal[rank, step] += k_chunk <= q_chunk
                    masked[rank, step] += bool(visible(documents, None, queries, keys).any())
    right.imshow(masked / np.maximum(causal, 1), cmap="Greens", vmin=0, vmax=1.2)
    for rank in range(n_ranks):
        for step in range(n_ranks):
            right.text(step, rank, f"{masked[rank, step]:.0f} of {causal[rank, step]:.0f}", ha="center", va="center")
    right.set(title=f"ring attention, cp={n_ranks}: blocks computed, of plain causal's",
              xlabel="ring step (the K/V block of rank - step)", ylabel="rank", xticks=range(n_ranks),
              yticks=range(n_ranks))
    fig.tight_layout()
    fig.savefig(os.path.join(results, "documents.png"), dpi=90)
    plt.close(fig)
    return int(causal.sum()), int(masked.sum())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--timeline", metavar="LOG", help="only draw the pipeline timeline a run logged (its "
                                                     "log.jsonl): timeline.png beside it")
    options = p.parse_args()
    if options.timeline:
        print(f"plot.py: {run_timeline(options.timeline)}")
        return
    results = options.results
    rows, logs, floor, comparisons, machine = load(results)
    throughput(rows, results)
    if logs is not None:
        losses(rows, logs, floor, results)
    else:
        print(f"plot.py: no {os.path.join(results, 'runs')} logs of the table's runs (python -m tools.bench writes "
              "them): loss.png, bubble.png and experts.png left as they are")
    memory(rows, results)
    communication(rows, results)
    if logs is not None:
        bubble(rows, logs, results)
        experts(rows, logs, results)
    table(rows, comparisons, machine, results)
    planned_memory(results)
    measured_memory(results)
    timelines(results)
    muon_convergence(results)
    fp8_convergence(results)
    moe_overlap(results)
    document_masking(results)
    print(f"plot.py: figures and results.md written to {results}")


if __name__ == "__main__":
    main()
