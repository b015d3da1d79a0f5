"""Two runs step by step: do they agree, and where do they first part?

    python -m tools.compare runs/before runs/after
    python -m tools.compare runs/before runs/after --assert-equal
    python -m tools.compare runs/gpu1 runs/gpu8 --rtol 1e-5 --plot compare.png

What an operator asks after changing a commit, a flag or a machine. Reads each run folder (train.py --out OUT
--name NAME writes OUT/NAME/): the loss and gradient norm of every step in log.jsonl, and, where both runs saved
a checkpoint at the same step, their weights: every tensor of model.py's state dict read whole
(training/checkpoint.py reads the full tensor whatever layout saved it, so a run on 8 ranks compares with one
on 1): its largest absolute difference, and that relative to the tensor's largest magnitude (as
tools/parity.py's; an element near 0 makes no tiny change look large). A checkpoint that is incomplete or
damaged is left out, and said so.

It prints a row per step (each run's values and B's minus A's), after each common checkpoint the tensors that
part (worst first), and then the first place where the runs part: the step and the quantity (loss, grad_norm,
or a tensor's name), and by how much. Within a step the loss comes first, then the gradient norm, then the
weights after the step's update (checkpoint-<step + 1>), so that the first thing named is the earliest one
the runs computed apart. "Part" means differ in any bit, or with --rtol/--atol differ by more than
atol + rtol times the larger magnitude (of the value, or of the tensor); NaN beside NaN, or the same infinity,
is no difference.

Runs of different lengths are compared on the steps both logged; the longer one is named, and that alone is
no difference (a run stopped early against the whole run agrees on its steps), unless --same-length.

Exit status: 2 for a folder that is not a run (one line saying why); with --assert-equal (bitwise) or
--rtol/--atol, 1 when the runs part and 0 when they agree; without either, 0 (the report alone).
"""
import argparse
import json
import math
import os
import sys
from collections import namedtuple

import torch

from training import checkpoint

PROG = "python -m tools.compare"
QUANTITIES = ("loss", "grad_norm")  # what every log record holds, compared in this order
SHOWN_TENSORS = 10  # rows of a checkpoint's differing tensors printed, worst first
NOT_COMPARED_FLAGS = ("out", "name")  # where a run was written, not what it did

Run = namedtuple("Run", "folder config log checkpoints")
Difference = namedtuple("Difference", "absolute relative parts why")
# events: [(step, quantity, value in A, value in B, Difference)]; first: the first event that parts (or None)
Comparison = namedtuple("Comparison", "a b steps checkpoints left_out events first")


class CompareError(Exception):
    """A folder that is not a run's, or two runs with nothing to compare: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------
# Reading a run
# ---------------------------------------------------------------------------

def read_run(folder):
    """A run folder's config.json, its log ({step: record}) and its checkpoints ({step: path})."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CompareError(f"{folder}: no config.json (not a run folder of train.py's)")
    config = json_file(path)
    log = {}
    try:
        with open(os.path.join(folder, "log.jsonl")) as f:
            for number, line in enumerate(f, 1):
                record = json_line(line, f"{folder}/log.jsonl line {number}")
                log[record["step"]] = record  # (a resumed run logs its steps after the checkpoint once)
    except FileNotFoundError:
        raise CompareError(f"{folder}: no log.jsonl (not a run folder of train.py's)") from None
    if not log:
        raise CompareError(f"{folder}: log.jsonl holds no step (the run stopped before its first)")
    steps = {int(checkpoint.NAME.fullmatch(os.path.basename(p)).group(1)): p for p in checkpoint.checkpoints(folder)}
    return Run(folder, config, log, steps)


def json_file(path):
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise CompareError(f"{path}: not JSON ({e})") from None


def json_line(line, where):
    """A log record, with the step and every quantity compared."""
    try:
        record = json.loads(line)
    except ValueError as e:
        raise CompareError(f"{where}: not JSON ({e})") from None
    missing = [key for key in ("step", *QUANTITIES) if key not in record]
    if missing:
        raise CompareError(f"{where}: no {', '.join(missing)} (not a log of train.py's)")
    return record


# ---------------------------------------------------------------------------
# Comparing values: scalars and tensors alike
# ---------------------------------------------------------------------------

def difference(a, b, tolerance):
    """How far tensor b is from tensor a: Difference(largest |a - b|, that over the largest finite magnitude of
    either (an element near 0 makes no tiny change look large), whether they part (bitwise with tolerance None, else
    the largest |a - b| beyond atol + rtol times that magnitude), why they cannot be compared element by
    element, if so). NaN beside NaN, or the same infinity, is no difference."""
    if a.shape != b.shape:
        return Difference(math.nan, math.nan, True, f"shape {list(a.shape)} against {list(b.shape)}")
    x, y = a.to(torch.float64), b.to(torch.float64)
    same = (x == y) | (x.isnan() & y.isnan())
    absolute = torch.where(same, 0.0, (x - y).abs()).max().item()  # (NaN where only one is NaN)
    larger = torch.maximum(x.abs(), y.abs())
    scale = torch.where(larger.isfinite(), larger, 0.0).max().item()  # the largest finite magnitude
    relative = absolute / scale if scale else absolute  # (no finite value but 0: nothing to be relative to)
    if tolerance is None:
        parts = a.dtype != b.dtype or not torch.equal(as_bytes(a), as_bytes(b))
        why = f"dtype {a.dtype} against {b.dtype}" if a.dtype != b.dtype else None
        return Difference(absolute, relative, parts, why)
    rtol, atol = tolerance
    return Difference(absolute, relative, not absolute <= atol + rtol * scale, None)


def as_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def scalar(value):
    """A logged value as a tensor, compared as the checkpoints' are."""
    return torch.tensor(value, dtype=torch.float64)


# ---------------------------------------------------------------------------
# Comparing two runs
# ---------------------------------------------------------------------------

def compare_checkpoint(path_a, path_b, tolerance):
    """[(tensor name, Difference)] of every tensor of either checkpoint's model state, in A's order."""
    a, b = checkpoint.Checkpoint(path_a), checkpoint.Checkpoint(path_b)
    rows = []
    for name in [*a.tensors, *(n for n in b.tensors if n not in a.tensors)]:
        if name in a.tensors and name in b.tensors:
            rows.append((name, difference(a.full(name), b.full(name), tolerance)))
        else:
            rows.append((name, Difference(math.nan, math.nan, True, f"only in {'A' if name in a.tensors else 'B'}")))
    return rows


def common_checkpoints(a, b, tolerance):
    """({checkpoint step: [(tensor name, Difference)]} of the checkpoints both runs saved complete and
    undamaged, [why each other one at a common step was left out])."""
    compared, left_out = {}, []
    for step in sorted(set(a.checkpoints) & set(b.checkpoints)):
        try:
            for run in (a, b):
                checkpoint.verify(run.checkpoints[step])
        except checkpoint.BadCheckpoint as e:
            left_out.append(f"checkpoint {step} not compared: {e}")
            continue
        compared[step] = compare_checkpoint(a.checkpoints[step], b.checkpoints[step], tolerance)
    return compared, left_out


def timeline(a, b, steps, checkpoints, tolerance):
    """[(step, quantity, value in A, value in B, Difference)] in the order the runs computed them: each step's
    loss, its gradient norm, then the weights after its update (checkpoint step + 1; values None)."""
    events, logged = [], set(steps)
    for step in sorted(logged | {s - 1 for s in checkpoints}):
        if step in logged:
            for quantity in QUANTITIES:
                x, y = a.log[step][quantity], b.log[step][quantity]
                events.append((step, quantity, x, y, difference(scalar(x), scalar(y), tolerance)))
        for name, diff in checkpoints.get(step + 1, []):
            events.append((step, name, None, None, diff))
    return events


def config_differences(a, b):
    """["--flag A's against B's"] of the flags (and world size) the two runs were launched with differently."""
    flags_a, flags_b = a.config.get("args", {}), b.config.get("args", {})
    lines = [f"--{key.replace('_', '-')} {flags_a.get(key)} against {flags_b.get(key)}"
             for key in sorted(set(flags_a) | set(flags_b))
             if key not in NOT_COMPARED_FLAGS and flags_a.get(key) != flags_b.get(key)]
    if a.config.get("world") != b.config.get("world"):
        lines.append(f"world {a.config.get('world')} against {b.config.get('world')}")
    return lines


def lengths(a, b):
    """Which run logged more steps, and the steps only one logged (None: both logged the same steps)."""
    only_a, only_b = sorted(set(a.log) - set(b.log)), sorted(set(b.log) - set(a.log))
    if not only_a and not only_b:
        return None
    counts = f"A logged {len(a.log)} steps, B {len(b.log)}"
    if len(a.log) != len(b.log):
        longer = "A" if len(a.log) > len(b.log) else "B"
        counts += f": {longer} is longer by {abs(len(a.log) - len(b.log))}"
    return f"{counts} (steps only in A: {spans(only_a)}; only in B: {spans(only_b)})"


def spans(steps):
    """Steps as ranges: [0, 1, 2, 5] -> '0-2, 5' (or 'none')."""
    if not steps:
        return "none"
    runs, start = [], steps[0]
    for previous, step in zip(steps, steps[1:] + [None]):
        if step != previous + 1:
            runs.append(f"{start}-{previous}" if previous > start else f"{start}")
            start = step
    return ", ".join(runs)


def compare(folder_a, folder_b, tolerance=None):
    """The Comparison of two run folders, under tolerance (rtol, atol), or bitwise with None."""
    a, b = read_run(folder_a), read_run(folder_b)
    steps = sorted(set(a.log) & set(b.log))
    if not steps:
        raise CompareError(f"{folder_a} and {folder_b} logged no step in common: nothing to compare")
    checkpoints, left_out = common_checkpoints(a, b, tolerance)
    events = timeline(a, b, steps, checkpoints, tolerance)
    first = next((event for event in events if event[4].parts), None)
    return Comparison(a, b, steps, checkpoints, left_out, events, first)


# ---------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------

def report(c, criterion, same_length):
    """Print the comparison; returns whether the runs agree (and, with same_length, logged the same steps)."""
    print(f"A: {c.a.folder}\nB: {c.b.folder}")
    for line in config_differences(c.a, c.b):
        print(f"launched differently: {line}")
    length = lengths(c.a, c.b)
    print(f"{length or 'both logged the same steps'}; compared: the {counted(len(c.steps), 'step')} both logged, "
          f"the {counted(len(c.checkpoints), 'checkpoint')} both saved")
    for line in c.left_out:
        print(line)
    print_table(c.events, c.first)
    print()
    if c.first is not None:
        print(verdict(c.first, criterion))
    elif length and same_length:
        print(f"{PROG}: the runs agree on their common steps ({criterion}), but --same-length: {length}")
    else:
        print(f"{PROG}: the runs agree ({criterion}) on {counted(len(c.steps), 'step')} and "
              f"{counted(len(c.checkpoints), 'checkpoint')}")
    return c.first is None and not (length and same_length)


def print_table(events, first):
    """A row per step (both runs' loss and gradient norm, B's minus A's), the first place the runs part marked;
    after each common checkpoint a line, and the tensors that part, worst first."""
    print(f"\n{'step':>5s} {'loss A':>20s} {'loss B':>20s} {'B - A':>10s} {'grad_norm A':>20s} "
          f"{'grad_norm B':>20s} {'B - A':>10s}")
    by_step = {}
    for event in events:
        by_step.setdefault(event[0], []).append(event)
    for step, rows in by_step.items():
        logged = [(x, y) for _, quantity, x, y, _ in rows if quantity in QUANTITIES]
        if logged:
            cells = " ".join(f"{x:20.15g} {y:20.15g} {y - x:+10.2e}" for x, y in logged)
            mark = f"  <- {first[1]}" if first and first[0] == step and first[1] in QUANTITIES else ""
            print(f"{step:5d} {cells}{mark}")
        tensors = [(name, diff) for _, name, _, _, diff in rows if name not in QUANTITIES]
        if tensors:
            print_checkpoint(step, tensors, first)


def print_checkpoint(step, tensors, first):
    parting = sorted(((name, d) for name, d in tensors if d.parts), key=lambda row: -magnitude(row[1].relative))
    print(f"      checkpoint {step + 1} (the weights after step {step}): " +
          (f"{len(parting)} of {len(tensors)} tensors part" if parting else f"all {len(tensors)} tensors agree"))
    for name, d in parting[:SHOWN_TENSORS]:
        mark = "  <- first" if first and first[0] == step and first[1] == name else ""
        print(f"        {name:44s} " + (d.why or f"abs {d.absolute:9.2e}  rel {d.relative:9.2e}") + mark)
    if len(parting) > SHOWN_TENSORS:
        print(f"        ... ({len(parting) - SHOWN_TENSORS} more)")


def counted(n, noun):
    return f"{n} {noun}{'s' * (n != 1)}"


def magnitude(x):
    """A difference to sort by, a NaN (unlike values, or nothing to compare with) the largest."""
    return math.inf if math.isnan(x) else x


def verdict(first, criterion):
    """The line naming where the runs first part, and by how much."""
    step, quantity, x, y, diff = first
    if quantity in QUANTITIES:
        what = f"step {step}, {quantity}: {x:.15g} (A) against {y:.15g} (B)"
    else:
        what = f"step {step}, the weights after it (checkpoint {step + 1}), tensor {quantity}"
    how = diff.why or f"a difference of {diff.absolute:.3e} ({diff.relative:.2e} of the larger magnitude)"
    return f"{PROG}: the runs part ({criterion}) first at {what}: {how}"


def plot_losses(c, path):
    """--plot: the two loss curves and their difference (plot.py's figure; matplotlib is imported for it alone)."""
    import plot
    losses = [{step: record["loss"] for step, record in sorted(run.log.items())} for run in (c.a, c.b)]
    labels = (f"A: {c.a.folder}", f"B: {c.b.folder}")
    return plot.compared_runs(*losses, labels, path, c.first[0] if c.first else None)


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("run_a", metavar="RUN_A", help="a run's folder (OUT/NAME of train.py's --out and --name)")
    p.add_argument("run_b", metavar="RUN_B", help="the run to compare with it")
    p.add_argument("--assert-equal", action="store_true",
                   help="exit 1 unless every value compared is the same, bit for bit")
    p.add_argument("--rtol", type=float, help="exit 1 unless every value (every tensor) differs by at most "
                                              "atol + rtol times its largest magnitude")
    p.add_argument("--atol", type=float, help="the absolute tolerance beside --rtol (default 0)")
    p.add_argument("--same-length", action="store_true",
                   help="runs that logged different steps part too (else their common steps are compared)")
    p.add_argument("--plot", metavar="PNG", help="draw the two loss curves and their difference into this file")
    args = p.parse_args(argv)
    tolerance = None if args.rtol is None and args.atol is None else (args.rtol or 0.0, args.atol or 0.0)
    if args.assert_equal and tolerance is not None:
        p.error("--assert-equal is bitwise: not with --rtol or --atol")
    try:
        c = compare(args.run_a, args.run_b, tolerance)
    except CompareError as e:
        p.exit(2, f"{PROG}: error: {e}\n")
    criterion = "bitwise" if tolerance is None else f"beyond rtol {tolerance[0]:g}, atol {tolerance[1]:g}"
    agree = report(c, criterion, args.same_length)
    if args.plot:
        print(f"{PROG}: the figure: {plot_losses(c, args.plot)}")
    return 1 if (args.assert_equal or tolerance is not None) and not agree else 0


if __name__ == "__main__":
    sys.exit(main())
