"""tools/dryrun.py: one rank of a large world, alone, its peers PyTorch's fake ones, counts what the real run
would (tools/plan.py's prediction, exactly) and writes nothing."""
import json
import os
import subprocess
import sys

import pytest

from distributed import REPO

TINY = ["--model", "tiny", "--batch-size", "32", "--dtype", "float32"]


def dry_run(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "tools.dryrun", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("rank,flags", [
    (37, ["--tp", "2", "--zero", "3"]),
    (13, ["--tp", "2", "--sp", "--pp", "2", "--layers", "4", "--micro-batches", "2", "--zero", "1"]),
    (62, ["--cp", "2", "--tp", "2", "--arch", "llama", "--recompute", "full", "--zero", "2"]),
], ids=["tp2-zero3", "tp2-sp-pp2-zero1", "llama-cp2-tp2-recomputed-zero2"])
def test_one_rank_of_64_counts_what_plan_predicts_and_writes_nothing(tmp_path, rank, flags):
    out = dry_run("--world", "64", "--rank", str(rank), "--json", *TINY, *flags, "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    measured, predicted = report["measured"], report["predicted"]
    assert predicted["param_bytes"] > 0 and any(v for f, v in predicted.items() if f.startswith("comm_"))
    peak = predicted.pop("peak_resident_bytes")
    for field, value in predicted.items():
        assert measured[field] == value, field
    # A tiny model: the peak is mostly the interpreter and PyTorch themselves (plan.PROCESS_BYTES).
    assert abs(measured["peak_resident_bytes"] / peak - 1) < 0.15
    assert "loss" not in measured
    assert os.listdir(tmp_path) == []  # no log, no checkpoint


@pytest.mark.parametrize("flags,message", [
    (["--rank", "64"], "--rank 64: a rank of --world 64 is between 0 and 63"),
    (["--rank", "3", "--experts", "4", "--ep", "2"], "--ep 2: a dry run cannot know the tokens"),
    (["--rank", "3", "--tp", "3"], "not divisible by tp*pp*cp*ep = 3*1*1*1"),
])
def test_a_layout_it_cannot_run_is_refused_with_the_reason(flags, message):
    out = dry_run("--world", "64", *TINY, "--batch-size", "64", *flags)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-3000:]
