"""On a GPU: the same code on CUDA and NCCL; skipped, with the reason, where there is none.

These are one-rank checks: the GPU machines this project can borrow have one GPU, and NCCL refuses
two ranks on one GPU, so multi-rank NCCL runs cannot be made there (the CPU tests prove every
layout under NCCL's matching rule instead, see distributed.py).
"""
import json

import pytest
import torch

from checkpoint import Checkpoint
from distributed import self_check_alone, torchrun
from oracle import EQUIVALENCE, assert_matches_oracle, oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: GPU checks need one")


def read_run(run_dir):
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "config.json").read_text()), log


def test_one_rank_on_cuda_in_float64_equals_the_cpu_oracle(tmp_path):
    out = torchrun(1, "train.py", *EQUIVALENCE, "--out", str(tmp_path))  # NCCL, world 1
    assert out.returncode == 0, out.stderr
    run = tmp_path / "gpu1_tp1_pp1_cp1_ep1"
    config, log = read_run(run)
    assert config["device"].startswith("cuda")
    state_dict = Checkpoint(run / "checkpoint-00000003").model_state()
    # CUDA's kernels sum in another order than the CPU's: float64 agrees to that order's rounding.
    assert_matches_oracle(dict(losses=[e["loss"] for e in log], state_dict=state_dict), oracle(EQUIVALENCE))


def test_bfloat16_training_runs_and_its_loss_falls(tmp_path):
    out = torchrun(1, "train.py", "--model", "small", "--dtype", "bfloat16", "--steps", "40", "--lr", "1e-2",
                   "--eval-interval", "1000", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    config, log = read_run(tmp_path / "gpu1_tp1_pp1_cp1_ep1")
    losses = [e["loss"] for e in log]
    floor = config["entropy_floor"]
    # From about ln(256) = 5.5 towards the floor (1.09): at least half the way in 40 steps.
    assert losses[-1] - floor < 0.5 * (losses[0] - floor)
    if "mfu" in log[-1]:  # a GPU of the table (train.PEAK_TFLOPS)
        assert 0 < log[-1]["mfu"] < 1


@pytest.mark.parametrize("filename", ["dp.py", "tp.py", "pp.py", "cp.py", "ep.py"])
def test_every_self_check_runs_on_one_gpu_with_nccl(tmp_path, filename):
    differences = self_check_alone(filename, 1, tmp_path)
    assert differences and max(differences) < 1e-12


def test_initial_values_drawn_on_cuda_equal_the_cpu_ones():
    """The draw by position on the GPU where a rank fills its share, against the CPU's (the oracle's): the
    hash is integer arithmetic, exact on both; the normal's inverse distribution function is each device's
    own float64 kernel, so they agree to float64's last bits."""
    from model import initial_values
    positions = torch.arange(2**40 - 50_000, 2**40 + 50_000)
    cpu = initial_values("blocks.3.mlp.fc.weight", positions, n_layer=4, seed=7)
    cuda = initial_values("blocks.3.mlp.fc.weight", positions.cuda(), n_layer=4, seed=7)
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-14, atol=0)
