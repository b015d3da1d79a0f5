"""train.py --tensorboard: the logged scalars written for TensorBoard, where the tensorboard package is installed.

tensorboard is not a dependency, and this machine may not have it: the worker puts a stand-in for
torch.utils.tensorboard in its own process, recording what train.py writes, and the test checks it against
the run's log.jsonl. Without the package, the flag is refused before anything runs.
"""
import importlib.machinery
import json
import os
import sys
import types

import pytest

import train
from distributed import run_on_ranks
from oracle import EQUIVALENCE
from training import cli, dashboard


class RecordingWriter:
    """torch.utils.tensorboard.SummaryWriter's add_scalar and close, kept in memory."""
    made = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.closed = log_dir, [], False
        RecordingWriter.made.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        self.closed = True


def with_a_stand_in_tensorboard(argv):
    """train.py on this rank with a stand-in tensorboard package; returns what rank 0's writer got."""
    package = types.ModuleType("tensorboard")
    package.__spec__ = importlib.machinery.ModuleSpec("tensorboard", None)
    sys.modules["tensorboard"] = package
    sys.modules["torch.utils.tensorboard"] = types.SimpleNamespace(SummaryWriter=RecordingWriter)
    train.train(cli.parse_args(argv))
    return [(w.log_dir, w.scalars, w.closed) for w in RecordingWriter.made]


def test_the_logged_scalars_reach_tensorboard(tmp_path):
    argv = [*EQUIVALENCE, "--steps", "3", "--tensorboard", "--eval-interval", "2", "--out", str(tmp_path)]
    written = run_on_ranks(2, with_a_stand_in_tensorboard, argv)
    assert written[1] == []  # only the rank that writes the log
    ((log_dir, scalars, closed),) = written[0]
    (run,) = os.listdir(tmp_path)
    assert log_dir == os.path.join(tmp_path, run, "tensorboard") and closed
    with open(tmp_path / run / "log.jsonl") as f:
        log = [json.loads(line) for line in f]
    for entry in log:
        step = entry["step"]
        for name in ("loss", "lr", "grad_norm", "tokens_per_s", "step_s"):
            assert (name, entry[name], step) in scalars
        for rank in range(2):
            assert (f"compute_s/rank{rank}", entry["compute_s"][rank], step) in scalars
            assert (f"peak_resident_bytes/rank{rank}", entry["peak_resident_bytes"][rank], step) in scalars
    assert [(tag, step) for tag, _, step in scalars if tag == "val_loss"] == [("val_loss", 1), ("val_loss", 2)]


@pytest.mark.skipif(dashboard.available(), reason="tensorboard is installed here: nothing to refuse")
def test_without_tensorboard_the_flag_is_refused_in_one_line():
    with pytest.raises(cli.ConfigError, match=r"--tensorboard needs the tensorboard package \(pip install"):
        cli.check_args(cli.parse_args([*EQUIVALENCE, "--tensorboard"]), 1)
