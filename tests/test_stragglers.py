"""The straggler: the rank the others of its pipeline stage wait for, step after step (training/stragglers.py),
named by each step's log record, the run's end and `python -m tools.diagnose`.

The rule on made-up timings first; then runs where one rank sleeps in each block's forward (about 4x a
step's computing of the tiny model, so the slowing decides, not the machine's speed), in groups of 2 and 4
of each kind; a world slowed alike; and rank 1 of two stopped 40% of the time by SIGSTOP and SIGCONT.
"""
import contextlib
import io
import json
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

import model
import train
from distributed import run_on_ranks
from oracle import EQUIVALENCE
from tools import diagnose
from training import cli, stragglers


def step(compute, waits, collectives=None, groups=None):
    """One step's waited_for, from per-rank times in ms (collectives: of the computing, inside collectives)."""
    collectives = collectives or [0] * len(compute)
    return stragglers.waited_for([c / 1e3 for c in compute], [w / 1e3 for w in waits],
                                 [k / 1e3 for k in collectives], groups or [0] * len(compute))


def test_a_rank_its_peer_waits_for_is_named_in_a_group_of_two():
    # 1.5x its peer: only 1.2x a median that counted it (the mean of the two), and unnamed by such a rule
    (found,) = step([100, 150], [55, 5])
    assert found["rank"] == 1 and found["work_s"] == pytest.approx(0.15)
    assert found["peers_work_s"] == pytest.approx(0.1) and found["peers_wait_s"] == pytest.approx(0.055)
    assert step([100, 150], [5, 5]) == []  # slower, but nobody waited for it: not a straggler
    assert step([100, 110], [15, 5]) == []  # 1.1x: within the noise between equal ranks


def test_a_rank_its_peers_wait_for_is_named_in_a_group_of_four_and_within_its_stage():
    assert [f["rank"] for f in step([100, 105, 300, 98], [200, 195, 3, 205])] == [2]
    # two stages of three: stage 1 is slower than stage 0 throughout, and only its rank 4 is waited for
    found = step([100, 102, 99, 200, 300, 201], [5, 4, 6, 105, 5, 104], groups=[0, 0, 0, 1, 1, 1])
    assert [f["rank"] for f in found] == [4] and found[0]["peers_work_s"] == pytest.approx(0.2005)


def test_a_tensor_parallel_partner_waits_inside_its_collectives():
    # both compute for as long (the partner waits in their all-reduces, inside its forward); the collectives say who
    assert [f["rank"] for f in step([100, 100], [0, 0], collectives=[65, 5])] == [1]


def test_a_group_slowed_alike_and_noise_name_no_one():
    assert step([300, 310, 295, 305], [10, 0, 15, 5]) == []
    assert step([100, 112, 95, 108], [12, 0, 17, 4]) == []
    # a stage waiting for another stage's straggler: 1.6x of little work, 6 ms of a 103 ms step, is noise
    assert step([10, 16], [90, 87]) == []


def test_the_report_names_a_rank_waited_for_in_half_the_steps_with_the_evidence():
    slow, healthy = step([100, 150], [55, 5]), []
    assert stragglers.report([slow, healthy, slow, healthy]) == (
        "straggler: rank 1, waited for by the others of its pipeline stage in 2 of 4 steps: it computed 150 ms a "
        "step against their 100 ms (1.50x); they waited 55 ms a step in collectives, it 5 ms")
    assert stragglers.report([slow, healthy, healthy]) is None  # in fewer than half the steps
    assert stragglers.report([slow, slow]) is None  # too few steps to say


def slow_worker(argv, slow_rank, seconds):
    """train.py on this rank, rank slow_rank (every rank, with None) sleeping `seconds` in each block's
    forward (a slow GPU, a busy host); returns what the run printed."""
    original = model.Block.forward

    def forward(self, *args, **kwargs):
        if slow_rank in (None, dist.get_rank()):
            time.sleep(seconds)
        return original(self, *args, **kwargs)
    model.Block.forward = forward
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        train.train(cli.parse_args(argv))
    return printed.getvalue()


def run(tmp_path, world, layout, slow_rank):
    """(rank 0's printed lines, the log's records, tools.diagnose's lines) of a run of the tiny model where
    slow_rank sleeps 20 ms in each block's forward: 80 ms a step, some 4x a step's computing."""
    printed = run_on_ranks(world, slow_worker, [*EQUIVALENCE, "--steps", "4", *layout, "--out", str(tmp_path)],
                           slow_rank, 0.02, timeout=120)[0]
    (name,) = os.listdir(tmp_path)
    with open(os.path.join(tmp_path, name, "log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    return printed.splitlines(), log, diagnose.diagnose(os.path.join(tmp_path, name))


def named(lines):
    return [line for line in lines if line.startswith("straggler:")]


@pytest.mark.parametrize("world, layout, slow_rank", [
    pytest.param(2, [], 1, id="data-parallel pair"),
    pytest.param(2, ["--tp", "2"], 1, id="tensor-parallel pair", marks=pytest.mark.full),
    pytest.param(4, ["--pp", "2", "--layers", "4"], 2, id="pipeline stage of 2", marks=pytest.mark.full),
    pytest.param(4, [], 2, id="data-parallel 4", marks=pytest.mark.full),
    pytest.param(4, ["--tp", "2"], 1, id="tensor-parallel 2 x data-parallel 2", marks=pytest.mark.full),
])
def test_a_slow_rank_is_named_by_every_step_the_runs_end_and_diagnose(tmp_path, world, layout, slow_rank):
    printed, log, report = run(tmp_path, world, layout, slow_rank)
    assert all(slow_rank in [found["rank"] for found in e["stragglers"]] for e in log)
    for found in (found for e in log for found in e["stragglers"] if found["rank"] == slow_rank):
        assert found["work_s"] > stragglers.SLOW * found["peers_work_s"]
        assert found["peers_wait_s"] > found["wait_s"]
    (line,) = named(printed)
    assert line.startswith(f"straggler: rank {slow_rank}, waited for by the others of its pipeline stage in 4 of "
                           "4 steps: it computed"), line
    assert named(report) == [line]
    assert "no record of collectives" in report[1]  # the run did not fail: nothing was written


@pytest.mark.full
def test_a_world_slowed_alike_names_no_straggler(tmp_path):
    printed, _, report = run(tmp_path, 4, [], None)
    assert named(printed) == [] and stragglers.NONE in report


def stopped_worker(argv, pid_file):
    """train.py on this rank; rank 1 first says its process id (for the test to stop it)."""
    if dist.get_rank() == 1:
        with open(pid_file + ".partial", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".partial", pid_file)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        train.train(cli.parse_args(argv))
    return printed.getvalue()


def stop_now_and_then(pid_file, done):
    """SIGSTOP for 40 ms in every 100 ms to the process named in pid_file, until it ends or `done`; it is left
    running. (Through a pidfd: a process id freed when it ends and taken by another is not signalled.)"""
    while not os.path.exists(pid_file):
        if done.wait(0.01):
            return
    with open(pid_file) as f:
        process = os.pidfd_open(int(f.read()))
    try:
        while not done.is_set():
            signal.pidfd_send_signal(process, signal.SIGSTOP)
            time.sleep(0.04)
            signal.pidfd_send_signal(process, signal.SIGCONT)
            time.sleep(0.06)
    except ProcessLookupError:  # it ended
        pass
    finally:
        os.close(process)


@pytest.mark.full
def test_a_rank_stopped_40_percent_of_the_time_is_named(tmp_path):
    """Rank 1 of two data-parallel ranks of the small model, stopped 40 ms in every 100 ms: a step computes
    for longer than 100 ms here, so every one of rank 1's has a stop in it, and rank 0 waits for it."""
    pid_file, done = str(tmp_path / "rank1.pid"), threading.Event()
    stopper = threading.Thread(target=stop_now_and_then, args=(pid_file, done))
    stopper.start()
    argv = ["--model", "small", "--steps", "12", "--eval-interval", "1000", "--log-interval", "1000",
            "--out", str(tmp_path / "runs")]
    try:
        printed = run_on_ranks(2, stopped_worker, argv, pid_file, timeout=180)[0]
    finally:
        done.set()
        stopper.join()
    (name,) = os.listdir(tmp_path / "runs")
    (line,) = named(printed.splitlines())
    assert line.startswith("straggler: rank 1, waited for by the others of its pipeline stage in "), line
    assert named(diagnose.diagnose(str(tmp_path / "runs" / name))) == [line]
