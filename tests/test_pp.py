"""Pipeline parallelism: every schedule equals the single device; schedules are valid; memory and traffic."""
import json
import re

import pytest

import pp
import train
from distributed import run_on_ranks, self_check_alone
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker

# 8 layers, so that 4 stages x 2 virtual stages each hold one; two steps.
BASE = [*EQUIVALENCE, "--layers", "8", "--steps", "2"]



def read_log(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").open()]


CASES = [(stages, schedule, micro) for stages in (2, 4) for schedule in ("gpipe", "1f1b", "interleaved")
         for micro in (stages, 2 * stages)]  # m = p and m > p


@pytest.mark.parametrize("stages,schedule,micro", CASES, ids=lambda v: str(v))
def test_pipeline_matches_single_device(tmp_path, stages, schedule, micro):
    argv = [*BASE, "--micro-batches", str(micro), "--pp", str(stages), "--schedule", schedule, "--out", str(tmp_path)]
    results = run_on_ranks(stages, train_worker, argv, timeout=180)
    for result in results:  # every stage reports the full losses and the merged state dict
        assert_matches_oracle(result, oracle([*BASE, "--micro-batches", str(micro)]))

    chunks = 2 if schedule == "interleaved" else 1
    micro_bytes = (8 // micro) * 16 * 32 * 8  # one micro-batch's activations: b * s * h float64 values
    for entry in read_log(tmp_path / f"gpu{stages}_tp1_pp{stages}_cp1_ep1"):
        for rank in range(stages):
            # Point-to-point: b*s*h per micro-batch and chunk boundary, each way.
            sends_forward = micro * (chunks - (rank == stages - 1))  # the last model chunk sends no activation
            sends_backward = micro * (chunks - (rank == 0))           # the first sends no gradient
            assert entry["comm_pp_send_recv_bytes"][rank] == (sends_forward + sends_backward) * micro_bytes
            # Micro-batches whose activations are alive at once.
            peak = entry["pp_peak_in_flight"][rank]
            if schedule == "gpipe":
                assert peak == micro
            elif schedule == "1f1b":
                assert peak == min(stages - rank, micro) <= stages
            assert 0 <= entry["pp_bubble"][rank] <= 1
        assert entry["pp_bubble_formula"] == pytest.approx((stages - 1) / (chunks * micro + stages - 1))


def test_pipeline_with_data_parallel(tmp_path):
    argv = [*BASE, "--micro-batches", "2", "--pp", "2", "--out", str(tmp_path)]
    for result in run_on_ranks(4, train_worker, argv, timeout=180):
        assert_matches_oracle(result, oracle([*BASE, "--micro-batches", "2"]))


def test_pipeline_with_tensor_and_sequence_parallel(tmp_path):
    argv = [*BASE, "--micro-batches", "4", "--pp", "2", "--tp", "2", "--sp", "--out", str(tmp_path)]
    for result in run_on_ranks(4, train_worker, argv, timeout=180):
        assert_matches_oracle(result, oracle([*BASE, "--micro-batches", "4"]))


# -- the schedules themselves, without processes ---------------------------------------

def simulate(schedule, n_micro, n_stages, n_chunks):
    """Run every rank's action list against the data dependencies; fail on a deadlock.

    A forward of model chunk k needs the forward of chunk k-1 done; a backward needs its own
    forward and the backward of chunk k+1. Sends never block, so a rank only waits for inputs.
    """
    lists = [pp.make_schedule(schedule, n_micro, n_stages, r, n_chunks) for r in range(n_stages)]
    n_model = n_stages * n_chunks
    done, position = set(), [0] * n_stages
    while any(position[r] < len(lists[r]) for r in range(n_stages)):
        progressed = False
        for r in range(n_stages):
            if position[r] == len(lists[r]):
                continue
            kind, c, m = lists[r][position[r]]
            k = c * n_stages + r
            needs = ([("forward", k - 1, m)] if k > 0 else []) if kind == "forward" else \
                [("forward", k, m)] + ([("backward", k + 1, m)] if k < n_model - 1 else [])
            if all(need in done for need in needs):
                done.add((kind, k, m))
                position[r] += 1
                progressed = True
        assert progressed, f"{schedule} deadlocks at {position}"
    return lists


@pytest.mark.parametrize("schedule,n_chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("n_stages", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_schedules_run_everything_once_and_never_deadlock(schedule, n_chunks, n_stages, groups):
    n_micro = groups * n_stages
    for rank, actions in enumerate(simulate(schedule, n_micro, n_stages, n_chunks)):
        expected = {(kind, c, m) for kind in ("forward", "backward") for c in range(n_chunks) for m in range(n_micro)}
        assert sorted(actions) == sorted(expected)
        if schedule == "1f1b":  # warm-up of P-1-rank forwards before the first backward
            assert [kind for kind, _, _ in actions].index("backward") == min(n_stages - rank - 1, n_micro) + 1


def test_forward_only_runs_each_forward_once_in_schedule_order():
    assert pp.forward_only(4, 2, 0, 1) == [("forward", 0, m) for m in range(4)]
    interleaved = [a for a in pp.interleaved_1f1b(4, 2, 0, 2) if a[0] == "forward"]
    assert pp.forward_only(4, 2, 0, 2) == interleaved


def test_split_layers_is_as_even_as_possible():
    assert pp.split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert pp.split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline chunks"):
        pp.split_layers(3, 4)
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        pp.make_schedule("interleaved", 3, 2, 0, 2)


@pytest.mark.parametrize("flags,message", [
    (["--pp", "2", "--zero", "2"], "--zero 2 with --pp is not supported"),
    (["--pp", "2", "--schedule", "interleaved", "--micro-batches", "3"], "multiple of the pipeline size"),
    (["--pp", "2", "--schedule", "interleaved", "--micro-batches", "2"], "2 layers cannot fill 4 pipeline chunks"),
    (["--schedule", "interleaved"], "need pipeline parallelism (--pp > 1)"),
])
def test_refused_pipeline_flags(flags, message):
    with pytest.raises(train.ConfigError, match=re.escape(message)):
        train.check_args(train.parse_args(["--model", "tiny", "--batch-size", "12", *flags]), 2)


def test_self_check_runs_alone_in_an_empty_folder(tmp_path):
    differences = self_check_alone("pp.py", 4, tmp_path)  # GPipe, 1F1B, interleaved
    assert len(differences) == 3 and max(differences) < 1e-12
