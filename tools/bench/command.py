"""The command line (python -m tools.bench): every part in turn, or those --only names, or the soak; and a
worker's side of a launch (--worker NAME, run_worker)."""
import argparse
import json
import os
import platform
import sys

from tools.bench.attention import ATTENTION_ARMS, attention_by_length, worker_attention
from tools.bench.checkpoints import checkpoint_comparison, worker_checkpoint
from tools.bench.common import FULL, QUICK, REPO, read_json, write_json
from tools.bench.comparisons import WORKERS, run_comparisons
from tools.bench.documents import documents_part
from tools.bench.fp8 import fp8_part
from tools.bench.moe_overlap import moe_overlap_check
from tools.bench.muon import muon_check, muon_convergence, worker_muon
from tools.bench.pipeline import pipeline_schedules
from tools.bench.planner import planner_check
from tools.bench.precision import precision_check
from tools.bench.soak import soak
from tools.bench.table import CONFIGS, recomputation_check, run_table, scaling_check, summarise
from tools.bench.zero_pipeline import worker_zero_pipeline, zero_pipeline_check


def machine():
    import torch
    return dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cores=os.cpu_count(), torch=torch.__version__,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)


RUN_ALONE = {"attention": worker_attention, "checkpoint": worker_checkpoint,
             "zero_pipeline": worker_zero_pipeline, "muon": worker_muon}  # run by their own part of main
DEVICE_WORKERS = {"muon"}  # they join the launch's group as train.py does (NCCL on GPUs), on its device


def run_worker(name, settings_json):
    """One rank of a launch of python -m tools.bench --worker NAME: the worker's result, printed by rank 0 after
    "RESULT " (common.worker_result reads it)."""
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


def main():
    description = sys.modules[__package__].__doc__.split("\n")[0]  # (tools/bench/__init__.py's first line)
    p = argparse.ArgumentParser(prog="python -m tools.bench", description=description)
    p.add_argument("--quick", action="store_true", help="a tiny model and few steps: a few minutes")
    p.add_argument("--out", default=os.path.join(REPO, "results"))
    p.add_argument("--only", nargs="*", help="run only these configurations / comparisons (and 'scaling' for the "
                                             "scaling check, 'recompute' for the recomputation modes, 'planner' for "
                                             "tools/plan/figure.py's strategies measured, 'documents' for document "
                                             "masking against plain causal attention, "
                                             "'zero_pipeline' for ZeRO-3 beside ZeRO-1 under 1F1B, "
                                             "'muon' for Muon's step beside AdamW's and its two assemblies, "
                                             "'muon_convergence' for their learning-rate sweeps, "
                                             "'checkpoint' for sharded against "
                                             "consolidated checkpoints, 'pipeline' for the five schedules' "
                                             "timelines, 'precision' for bfloat16 before and after its "
                                             "mixed-precision policy, 'fp8' for each --fp8 recipe beside "
                                             "bfloat16, 'moe_overlap' for the experts' all-to-alls "
                                             "beside their computation, beside another micro-batch's "
                                             "and waited for); the rest "
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
        documents_part(settings, args.out)
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
    if not args.only or "fp8" in args.only:
        fp8_part(settings, args.out)
    if not args.only or "moe_overlap" in args.only:
        overlap = moe_overlap_check(settings, args.out)
        write_json(os.path.join(args.out, "moe_overlap.json"), overlap)
        for arm in ("overlapped", "paired"):
            row = overlap[arm]
            print(f"moe overlap, {arm}: {row['fraction']:.0%} of the all-to-alls' time in flight with computation "
                  f"beside (rounds {row['fraction_range'][0]:.0%}-{row['fraction_range'][1]:.0%}); step time / "
                  f"waited {row['step_time_ratio']:.2f} ({row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f})")
        print(f"moe overlap: largest loss difference from the waited arm {overlap['max_loss_difference']:.2g}")
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
