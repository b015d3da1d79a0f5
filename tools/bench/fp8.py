"""FP8 beside bfloat16 (python -m tools.bench --only fp8): the small model trained a few hundred steps in
bfloat16 and under each --fp8 recipe, from the same weights on the same batches, their loss curves and the
final losses' differences (fp8.json; plot.py draws fp8.png); on a GPU, where there is one, tokens/s of the
gpt2 preset in bfloat16 and under each recipe, one GPU, the arms alternated over rounds."""
import os
import statistics

from tools.bench.common import read_log, tokens_per_s, torchrun, write_json

RECIPES = ("rowwise", "tensorwise")


def fp8_part(settings, out):
    """'fp8': the convergence runs (and the GPU's speed), written and printed."""
    result = fp8_check(settings, out)
    write_json(os.path.join(out, "fp8.json"), result)
    for arm, run in result["arms"].items():
        difference = "" if arm == "bfloat16" else f", {run['final_loss'] - result['arms']['bfloat16']['final_loss']:+.4f}"
        print(f"fp8 {arm:10s} final loss {run['final_loss']:.4f} (the last {result['final_steps']} steps' mean"
              f"{difference}), validation {run['final_val_loss']:.4f}")
    for arm, row in result.get("cuda", {}).items():
        print(f"fp8 on {row['device']}: {arm} {row['tokens_per_s']:,.0f} tok/s, x{row['ratio']:.2f} of bfloat16's "
              f"({row['range'][0]:.2f}-{row['range'][1]:.2f})")


def fp8_check(settings, out):
    """Each arm's run of settings['fp8'] in bfloat16: its per-step losses, the mean of the last final_steps
    (one step's loss is one batch's; the mean is what the arms differ by), its last validation loss."""
    s = settings["fp8"]
    common = ["--model", s["model"], "--dtype", "bfloat16", "--batch-size", str(s["batch_size"]),
              "--micro-batches", "1", "--steps", str(s["steps"]), "--lr", str(s["lr"]),
              "--eval-interval", str(s["eval_interval"]), "--log-interval", "1"]
    folder = os.path.join(out, "fp8", "runs")
    arms = {}
    for arm, flags in [("bfloat16", []), *[(recipe, ["--fp8", recipe]) for recipe in RECIPES]]:
        print(f"bench: fp8 convergence, {arm}", flush=True)
        torchrun(1, "train.py", *common, *flags, "--out", folder, "--name", arm)
        log = read_log(os.path.join(folder, arm, "log.jsonl"))
        losses = [entry["loss"] for entry in log]
        arms[arm] = dict(losses=losses, final_loss=statistics.mean(losses[-s["final_steps"]:]),
                         final_val_loss=[e["val_loss"] for e in log if "val_loss" in e][-1])
    result = dict(flags=common, final_steps=s["final_steps"], arms=arms)
    cuda = cuda_speed(settings, out)
    if cuda:
        result["cuda"] = cuda
    return result


def cuda_speed(settings, out):
    """{arm: tokens/s, its ratio to bfloat16's and the rounds' range} of the gpt2 preset on one GPU, each arm
    run once a round in an order alternated by round; {} without a GPU."""
    import torch
    if not torch.cuda.is_available():
        return {}
    s = settings["fp8_cuda"]
    common = ["--model", "gpt2", "--dtype", "bfloat16", "--batch-size", str(s["batch_size"]), "--micro-batches", "1",
              "--steps", str(s["steps"]), "--eval-interval", str(s["steps"]), "--log-interval", "1"]
    arms = [("bfloat16", []), *[(recipe, ["--fp8", recipe]) for recipe in RECIPES]]
    speeds = {arm: [] for arm, _ in arms}
    for r in range(s["rounds"]):
        for arm, flags in (arms if r % 2 == 0 else arms[::-1]):
            folder = os.path.join(out, "fp8", "cuda")
            torchrun(1, "train.py", *common, *flags, "--out", folder, "--name", f"{arm}{r}")
            speeds[arm].append(tokens_per_s(read_log(os.path.join(folder, f"{arm}{r}", "log.jsonl"))[s["skip"]:]))
    device = torch.cuda.get_device_name()
    result = {}
    for arm, values in speeds.items():
        ratios = [a / b for a, b in zip(values, speeds["bfloat16"])]
        result[arm] = dict(device=device, tokens_per_s=statistics.median(values), ratio=statistics.median(ratios),
                           range=[min(ratios), max(ratios)])
    return result
