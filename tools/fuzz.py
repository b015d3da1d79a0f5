"""Random layouts against one process: the parity command on layouts no one chose.

    python -m tools.fuzz 20 --seed 7
    python -m tools.fuzz 1 --seed 7:13     # draw 13 of seed 7 alone, as a failing draw names it

Draws N layouts of the tiny model from every flag of train.py that changes what is computed (the grid, ZeRO,
the schedule, the experts and their routing, the attention's masks, the architecture, precision, the
optimizer), each within the constraints train.py states (sizes that divide, flags that need one another), and
runs `python -m tools.parity` on each: float64 on this machine's processes against one process, two steps.
Each draw prints one line: equal, refused (train.py's one-line reason), differ or failed (raised, died or
hung), and the command line that reproduces it. The exit status is 1 when any draw differed or failed.

Draw i of seed S is a function of (S, i) alone (random.Random(f"{S}:{i}")), so a line's command stays the
same when N changes. Flags that do not change the computation (logging, checkpoints, the run's folder) or
that the parity command fixes (float64) are not drawn: NOT_DRAWN says why for each, and the tests check that
every flag of train.py is either drawn or named there, so a new flag cannot be left out unseen.
"""
import argparse
import random
import shlex
import subprocess
import sys
import time

from training import cli

PROG = "python -m tools.fuzz"
PARITY = [sys.executable, "-m", "tools.parity"]
STEPS = 2  # two steps: the second starts from the first's update (its optimizer state, biases, balance)

NOT_DRAWN = {
    "--dtype": "the parity command runs float64 (its exactness)",
    "--master-dtype": "a master copy narrower than float64 is another experiment (test_precision)",
    "--reduce-dtype": "a reduction narrower than float64 is another experiment (test_precision)",
    "--init-from": "a Hugging Face folder: test_hf, test_parity's round trips",
    "--data": "the synthetic language; token files are read alike (test_own_text)",
    "--steps": f"{STEPS} steps, the parity command's",
    "--compile": "a compilation a draw, a minute on two cores; compiled blocks against eager in test_train",
    "--out": "the run's folder", "--name": "the run's folder",
    "--eval-interval": "evaluation does not train", "--eval-batches": "evaluation does not train",
    "--log-interval": "logging", "--tensorboard": "logging", "--peak-tflops": "logging (MFU)",
    "--record-collectives": "the flight recorder: logging", "--pp-debug": "printing", "--profile": "tracing",
    "--timeout": "the parity command's own --timeout",
    "--capacity-factor": "what it drops depends on how tokens are split, and one process is dropless: the parity "
                         "command refuses it (ep.py's capacity against its rule written out: test_ep)",
    "--checkpoint-interval": "checkpoints: test_checkpoint, test_faults",
    "--keep-checkpoints": "checkpoints: test_checkpoint, test_faults",
    "--resume": "checkpoints: test_checkpoint, test_faults", "--stop-at": "checkpoints: test_faults",
}


def train_flags():
    """Every option string of train.py's command line, but --help."""
    parser = cli.argument_parser()
    return sorted(option for action in parser._actions for option in action.option_strings
                  if option.startswith("--") and option not in ("--help", "--no-document-mask"))


def divisors(n, among):
    return [d for d in among if n % d == 0]


def draw(rng):
    """(world, [train.py's flags]): a random layout of the tiny model (always: eight ranks of a larger one take
    minutes on two cores), mostly one train.py accepts."""
    pick = rng.choice
    flags = ["--model", "tiny", "--lr", "1e-2", "--warmup", "1", "--grad-clip", pick(["0.05", "1.0"]),
             "--seed", str(rng.randrange(4))]
    arch = pick(["gpt", "llama", "llama", "deepseek", "gpt-oss", "gemma3", "olmo2"])
    layers = pick([2, 4, 4])
    world = pick([1, 2, 2, 4, 4, 8])
    flags += ["--arch", arch, "--layers", str(layers)]
    # the grid: tp fastest, then cp, pp; dp what is left
    tp = pick(divisors(world, (1, 1, 2)))
    cp = pick(divisors(world // tp, (1, 1, 2)))
    pp = pick([p for p in divisors(world // (tp * cp), (1, 1, 2, 4)) if p <= layers])
    dp = world // (tp * cp * pp)
    flags += ["--tp", str(tp), "--cp", str(cp), "--pp", str(pp)]
    if tp > 1 and rng.random() < 0.6:
        flags.append("--sp")
    if cp > 1:
        flags += ["--cp-mode", pick(["ring", "allgather", "alltoall"])]
    # the model's shape and attention
    if arch != "gpt" and arch != "deepseek" and rng.random() < 0.5:  # whole key/value heads on each tp rank,
        split = tp * (cp if "alltoall" in flags else 1)               # and on each cp rank of an all-to-all
        flags += ["--kv-heads", str(pick([k for k in (1, 2, 4) if k % split == 0]))]
    if rng.random() < 0.15:
        flags += pick([["--d-model", "48"], ["--head-dim", "16"], ["--d-ff", "64"],
                       ["--heads", "2"] if arch in ("gpt", "deepseek") else ["--d-model", "64"]])
    if arch in ("llama", "olmo2") and rng.random() < 0.2:
        flags.append("--qk-norm")
    if arch != "gpt" and arch != "deepseek" and rng.random() < 0.35:
        flags += ["--sliding-window", str(pick([4, 8])), "--window-layers", pick(["1:1", "0", "3:1"])]
    if arch in ("llama", "gemma3", "olmo2") and rng.random() < 0.2:
        flags.append("--attention-sinks")
    seq_len = 16
    if rng.random() < 0.3:  # packed documents: the tiny language's frequent id ends one every ~12 tokens
        seq_len = 32
        flags += ["--seq-len", "32", "--document-mask", "--eos-id", "16"]
    # the batch: every micro-batch's sequences over the data ranks
    micro_batches = pick([m for m in (1, 2, 4) if m >= min(pp, 2)])
    batch_size = micro_batches * dp * pick([1, 2])
    batch_size *= 2 if batch_size < 4 else 1
    flags += ["--batch-size", str(batch_size), "--micro-batches", str(micro_batches)]
    # experts, folded over the stage's dp x cp x tp ranks
    experts = pick([0, 0, 4, 8]) if arch != "gpt-oss" else pick([4, 8])
    stage, ep, expert_tp = dp * cp * tp, 1, 1
    if experts:
        top_k = pick([1, 2, 2])
        flags += ["--experts", str(experts), "--top-k", str(top_k)]
        ep = pick(divisors(stage, (1, 2, 4)))
        ep = ep if experts % ep == 0 else 1
        expert_tp = pick([e for e in (1, 1, 2) if stage % (ep * e) == 0])
        flags += ["--ep", str(ep), "--expert-tp", str(expert_tp)]
        if rng.random() < 0.3:
            flags += ["--shared-experts", "1"]
        if rng.random() < 0.15 and experts % 2 == 0:
            flags += ["--expert-groups", "2", "--group-top-k", "1"]
        flags += ["--balance", pick(["aux", "aux", "bias", "both"]),
                  "--aux-loss-scope", pick(["batch", "batch", "sequence", "global"])]
        if rng.random() < 0.2:
            flags += ["--aux-loss-coef", pick(["0.1", "0"]), "--bias-update-rate", pick(["1e-2", "0.1"])]
        if rng.random() < 0.3:
            flags += ["--ep-overlap", pick(["1", "2"])]
    # the schedule
    schedules = ["1f1b", "gpipe", "zb1"] if pp > 1 else ["1f1b"]
    if pp > 1 and layers >= 2 * pp:  # two chunks a rank, of a layer at least
        schedules += ["zbv", "interleaved"]
    if experts:
        schedules += ["combined"] * 2
    schedule = pick(schedules)
    if schedule == "combined" and "--ep-overlap" not in flags:
        flags += ["--ep-overlap", "1"]
    if schedule == "combined" and "2" == flags[flags.index("--ep-overlap") + 1]:
        flags[flags.index("--ep-overlap") + 1] = "1"
    flags += ["--schedule", schedule]
    if schedule == "interleaved" and layers % (2 * pp) == 0 and rng.random() < 0.3:
        flags += ["--virtual-stages", "2"]
    if schedule not in ("zb1", "zbv"):
        flags += ["--recompute", pick(["none", "none", "selective", "full"])]
    # data parallelism: ZeRO, hybrid sharding, buckets
    zero = pick([0, 0, 1, 2, 3]) if dp * cp > 1 else 0
    if zero:
        flags += ["--zero", str(zero)]
        if dp >= 4 and (2 * cp * tp) % (ep * expert_tp) == 0 and rng.random() < 0.4:  # experts within a shard
            flags += ["--dp-shard", "2"]
    if rng.random() < 0.3:
        flags += ["--bucket-mb", "0.001"]  # many buckets, one a parameter or so
    # precision and the optimizer
    if rng.random() < 0.15:  # tensorwise maxima span the tokens: equal only where no rank splits them
        flags += ["--fp8", "rowwise" if stage // tp > 1 or experts else pick(["rowwise", "tensorwise"])]
    if rng.random() < 0.2:
        flags += ["--optimizer", "muon", "--muon-assembly", pick(["owner", "gather"])]
    flags += ["--weight-decay", pick(["0.1", "0"]), "--min-lr-ratio", pick(["0.1", "0.5"])]
    if rng.random() < 0.1:
        flags += ["--skip-nonfinite-steps", "1"]
    if rng.random() < 0.1:
        flags.append("--deterministic")
    if rng.random() < 0.1:
        flags += ["--vocab-size", "96"]
    if seq_len == 16 and rng.random() < 0.1:
        flags += ["--seq-len", "24" if cp == 1 else "32"]
    return world, flags


def draws(seed, n):
    """[(name, world, flags)] of draws 0..n-1 of `seed`, or the one draw a "S:i" seed names."""
    if ":" in str(seed):
        return [(str(seed), *draw(random.Random(str(seed))))]
    return [(f"{seed}:{i}", *draw(random.Random(f"{seed}:{i}"))) for i in range(n)]


def command(world, flags):
    return ["python", "-m", "tools.parity", "--world", str(world), "--steps", str(STEPS), *flags]


def refusal(world, flags):
    """train.py's one-line reason for refusing the layout, or None (checked here, before any process starts)."""
    try:
        cli.check_args(cli.parse_args([*flags, "--steps", str(STEPS), "--dtype", "float64"]), world)
    except cli.ConfigError as e:
        return str(e)
    return None


OUTCOMES = {0: "equal", 1: "differ", 2: "refused", 3: "failed"}


def try_draw(world, flags, timeout):
    """(outcome, detail): the parity command's verdict on the layout and its last line (or the refusal)."""
    refused = refusal(world, flags)
    if refused:
        return "refused", refused
    argv = [*PARITY, "--world", str(world), "--steps", str(STEPS), "--timeout", str(timeout), *flags]
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 120)
    except subprocess.TimeoutExpired:
        return "failed", f"no verdict within {timeout + 120:.0f} s"
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    outcome = OUTCOMES.get(run.returncode, "failed")
    if outcome == "failed":  # the first line naming an error says most
        errors = [line for line in lines if "Error" in line or "error" in line]
        return outcome, (errors or lines or [f"exit status {run.returncode}"])[-1][:300]
    return outcome, lines[-1][:300] if lines else ""


def fuzz(n, seed, timeout=300, out=None):
    """Run the draws; returns {outcome: count} and prints a line each (to out, default stdout), then a summary."""
    out = out or sys.stdout
    counts = {outcome: 0 for outcome in ("equal", "refused", "differ", "failed")}
    for name, world, flags in draws(seed, n):
        start = time.monotonic()
        outcome, detail = try_draw(world, flags, timeout)
        counts[outcome] += 1
        print(f"draw {name}: {outcome} ({time.monotonic() - start:.0f} s): {shlex.join(command(world, flags))}",
              file=out, flush=True)
        if outcome != "equal":
            print(f"    {detail}", file=out, flush=True)
    print(f"{PROG}: {len(draws(seed, n))} draws of seed {seed}: " +
          ", ".join(f"{count} {outcome}" for outcome, count in counts.items()), file=out, flush=True)
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("n", type=int, metavar="N", help="layouts to draw")
    p.add_argument("--seed", default="0", help="the draws' seed (any text); S:i is draw i of seed S alone")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a draw's hung layout is stopped")
    own = p.parse_args(argv)
    counts = fuzz(own.n, own.seed, own.timeout)
    return 1 if counts["differ"] or counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
