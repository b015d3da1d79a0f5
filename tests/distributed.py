"""What the multi-rank tests share: training/local.py's run_on_ranks (N gloo ranks, each in its own process,
with a deadline, matching messages by order alone as NCCL does), a dimension file's self-check run alone,
and torchrun.
"""
import os
import re
import shutil
import subprocess
import sys

from training.local import run_on_ranks

__all__ = ["REPO", "run_on_ranks", "self_check_alone", "torchrun"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def self_check_alone(filename, n_ranks, folder):
    """Copy one dimension file alone into `folder`, run its self-check under torchrun, and return the
    largest difference from one device that each of its report lines gives."""
    shutil.copy(os.path.join(REPO, filename), folder)
    out = torchrun(n_ranks, filename, cwd=folder)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if f"{filename} self-check" in line]
    return [float(re.search(r"= ([-+0-9.e]+)(;|$)", line).group(1)) for line in lines]


def torchrun(n_ranks, *argv, cwd=REPO, timeout=180):
    """Launch `torchrun --nproc_per_node n_ranks argv...`; returns the CompletedProcess (text output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n_ranks),
           "--standalone", *argv]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
