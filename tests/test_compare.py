"""python -m tools.compare (tools/compare.py): two runs of the same command agree bit for bit; runs one flag apart
part where they first compute apart, named; runs of different lengths compare on their common steps; weights that
part where the logs agree are named by tensor; a checkpoint of another layout compares as the full tensors; a
damaged checkpoint is left out; a folder that is not a run is refused.

The runs are train.py's (tiny model, float64, 3 steps, a checkpoint after every step), all trained once for the
module on one rank in a process of its own."""
import os
import shutil

import pytest
import torch

from distributed import run_on_ranks
from oracle import EQUIVALENCE, train_worker
from tools import compare
from training import checkpoint, cli
import train

# --min-lr-ratio 0 and 0.5 (below) give step 1 the same learning rate to the bit, min + (lr - min) = lr; the
# default, 0.1, does not (it rounds): that run would part from step 1 on, by 1e-17.
FLAGS = [*EQUIVALENCE, "--steps", "3", "--checkpoint-interval", "1", "--keep-checkpoints", "3", "--min-lr-ratio", "0"]
RUNS = {"a": [], "again": [], "lr": ["--lr", "2e-2"],
        "stopped": ["--stop-at", "2"],          # the same run, stopped after 2 of its 3 steps
        "min_lr": ["--min-lr-ratio", "0.5"]}   # step 2's learning rate alone differs: the logs agree, the weights not


def train_runs(out, runs):
    """train.py's training of each run {name: flags} in turn, on this one rank."""
    for name, flags in runs.items():
        train.train(cli.parse_args([*FLAGS, *flags, "--out", out, "--name", name]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    run_on_ranks(1, train_runs, str(out), RUNS, timeout=180)
    return out


def compared(capsys, *argv):
    """(exit status, printed lines) of python -m tools.compare argv."""
    status = compare.main([str(arg) for arg in argv])
    return status, capsys.readouterr().out.splitlines()


def verdict(lines):
    (line,) = [line for line in lines if line.startswith(f"{compare.PROG}: the runs ")]
    return line


def first_tensor(run):
    """The first tensor of model.py's state dict, as the checkpoints list them."""
    return next(iter(checkpoint.Checkpoint(checkpoint.path_for(run, 1)).tensors))


def test_two_runs_of_the_same_command_agree_bit_for_bit(runs, capsys):
    status, lines = compared(capsys, runs / "a", runs / "again", "--assert-equal")
    assert status == 0
    assert verdict(lines) == f"{compare.PROG}: the runs agree (bitwise) on 3 steps and 3 checkpoints"
    n_tensors = len(checkpoint.Checkpoint(checkpoint.path_for(runs / "a", 3)).tensors)
    for step in (1, 2, 3):
        assert f"      checkpoint {step} (the weights after step {step - 1}): all {n_tensors} tensors agree" in lines
    assert not any(line.startswith("launched differently") for line in lines)


def test_runs_one_flag_apart_part_at_the_first_thing_they_compute_apart(runs, capsys, tmp_path):
    # Step 0's loss and gradient norm come before its update, which --lr changes: its weights part first.
    status, lines = compared(capsys, runs / "a", runs / "lr", "--assert-equal", "--plot", tmp_path / "compare.png")
    assert status == 1
    assert "launched differently: --lr 0.01 against 0.02" in lines
    assert verdict(lines).startswith(f"{compare.PROG}: the runs part (bitwise) first at step 0, the weights after it "
                                     f"(checkpoint 1), tensor {first_tensor(runs / 'a')}: a difference of ")
    assert f"{compare.PROG}: the figure: {tmp_path / 'compare.png'}" in lines
    with open(tmp_path / "compare.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # Without the checkpoints, the logs alone: step 1's loss is the first value apart.
    logs_only = tmp_path / "lr_logs"
    os.makedirs(logs_only)
    for name in ("config.json", "log.jsonl"):
        shutil.copy(runs / "lr" / name, logs_only)
    status, lines = compared(capsys, runs / "a", logs_only, "--assert-equal")
    assert status == 1
    assert "      checkpoint" not in "\n".join(lines)
    (row_0,) = [line for line in lines if line.startswith("    0 ")]
    (row_1,) = [line for line in lines if line.startswith("    1 ")]
    assert row_0.count("+0.00e+00") == 2 and row_1.endswith("<- loss")
    assert " first at step 1, loss: " in verdict(lines)
    # Asked for no verdict, the report alone exits 0.
    assert compared(capsys, runs / "a", logs_only)[0] == 0


def test_runs_of_different_lengths_compare_on_their_common_steps(runs, capsys):
    status, lines = compared(capsys, runs / "a", runs / "stopped", "--assert-equal")
    assert status == 0
    assert ("A logged 3 steps, B 2: A is longer by 1 (steps only in A: 2; only in B: none); compared: the 2 steps "
            "both logged, the 2 checkpoints both saved") in lines
    assert verdict(lines) == f"{compare.PROG}: the runs agree (bitwise) on 2 steps and 2 checkpoints"
    status, lines = compared(capsys, runs / "stopped", runs / "a", "--assert-equal", "--same-length")
    assert status == 1
    assert "B is longer by 1" in verdict(lines)


def test_weights_that_part_where_the_logs_agree_are_named_with_their_difference(runs, capsys):
    status, lines = compared(capsys, runs / "a", runs / "min_lr", "--assert-equal")
    assert status == 1
    rows = [line for line in lines if line[:5].strip().isdigit()]
    assert len(rows) == 3 and all(row.count("+0.00e+00") == 2 for row in rows)  # every logged value the same
    name = first_tensor(runs / "a")
    a, b = (checkpoint.Checkpoint(checkpoint.path_for(runs / run, 3)).full(name) for run in ("a", "min_lr"))
    largest = (a - b).abs().max().item()
    assert largest > 0
    assert verdict(lines) == (f"{compare.PROG}: the runs part (bitwise) first at step 2, the weights after it "
                              f"(checkpoint 3), tensor {name}: a difference of {largest:.3e} "
                              f"({largest / max(a.abs().max(), b.abs().max()).item():.2e} of the larger magnitude)")
    assert compared(capsys, runs / "a", runs / "min_lr", "--rtol", "0.1")[0] == 0  # a tenth of each tensor's size
    assert compared(capsys, runs / "a", runs / "min_lr", "--rtol", "1e-9")[0] == 1


def test_a_damaged_checkpoint_is_left_out_and_said_so(runs, capsys, tmp_path):
    shutil.copytree(runs / "a", tmp_path / "a")
    damaged = os.path.join(checkpoint.path_for(tmp_path / "a", 2), "rank-00000.safetensors")
    with open(damaged, "r+b") as f:  # a byte of a tensor's data changed: the file's size is the same
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    status, lines = compared(capsys, tmp_path / "a", runs / "again", "--assert-equal")
    assert status == 0
    assert (f"checkpoint 2 not compared: {checkpoint.path_for(tmp_path / 'a', 2)}: damaged, the bytes of "
            "rank-00000.safetensors do not match its SHA-256") in lines
    assert verdict(lines) == f"{compare.PROG}: the runs agree (bitwise) on 3 steps and 2 checkpoints"


def test_values_part_bitwise_or_beyond_the_tolerance():
    x = torch.tensor([1.0, -2.0, float("nan"), float("inf")], dtype=torch.float64)
    assert not compare.difference(x, x.clone(), None).parts  # NaN beside NaN, the same infinity: no difference
    assert compare.difference(x, x.float(), None).why == "dtype torch.float64 against torch.float32"
    assert not compare.difference(x, x.float(), (0.0, 0.0)).parts  # the same values, in another dtype
    y = x + torch.tensor([0.0, 1e-6, 0.0, 0.0], dtype=torch.float64)
    assert compare.difference(x, y, None).parts
    assert not compare.difference(x, y, (1e-6, 0.0)).parts  # 1e-6 of the largest finite magnitude, 2
    assert compare.difference(x, y, (1e-7, 0.0)).parts
    assert compare.difference(x, x[:3], (1.0, 1.0)).why == "shape [4] against [3]"


def test_a_checkpoint_of_another_layout_compares_as_the_full_tensors(runs, tmp_path, capsys):
    argv = [*FLAGS, "--out", str(tmp_path), "--name", "tp2"]
    run_on_ranks(2, train_worker, [*argv, "--tp", "2"], timeout=180)
    saved = checkpoint.Checkpoint(checkpoint.path_for(tmp_path / "tp2", 3))
    assert any(layout["split"] for layout in saved.tensors.values())  # tensor parallelism's parts, not whole
    status, lines = compared(capsys, runs / "a", tmp_path / "tp2", "--rtol", "1e-9")
    assert status == 0
    assert "launched differently: --tp 1 against 2" in lines and "launched differently: world 1 against 2" in lines
    n_tensors = len(checkpoint.Checkpoint(checkpoint.path_for(runs / "a", 3)).tensors)
    assert verdict(lines) == f"{compare.PROG}: the runs agree (beyond rtol 1e-09, atol 0) on 3 steps and 3 checkpoints"
    assert f"      checkpoint 3 (the weights after step 2): all {n_tensors} tensors agree" in lines


@pytest.mark.parametrize("make,message", [
    (lambda folder: None, "no config.json (not a run folder of train.py's)"),
    (lambda folder: (folder / "config.json").write_text("{}"), "no log.jsonl (not a run folder of train.py's)"),
    (lambda folder: [(folder / "config.json").write_text("{}"), (folder / "log.jsonl").write_text('{"step": 0}\n')],
     "log.jsonl line 1: no loss, grad_norm (not a log of train.py's)"),
])
def test_a_folder_that_is_not_a_run_is_refused_in_one_line(runs, tmp_path, capsys, make, message):
    make(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        compare.main([str(runs / "a"), str(tmp_path)])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{compare.PROG}: error: {tmp_path}") and line.endswith(message)
