"""Faults: a run stopped or preempted resumes with `--resume auto` to exactly what an uninterrupted run
computes (float64, the oracle); checkpoints are atomic, verified, and a bad one is skipped or refused."""
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from training import checkpoint, cli
import train
from tools.bench import worker_pids
from distributed import REPO, run_on_ranks, torchrun
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, reference_run, train_worker

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

ARGV = [*EQUIVALENCE, "--steps", "6"]
RUN = "gpu2_tp1_pp1_cp1_ep1"


def read_log(run_dir):
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def final_state(run_dir):
    return checkpoint.Checkpoint(checkpoint.checkpoints(run_dir)[0]).model_state()


def assert_resumed_run_matches_oracle(run_dir):
    """One log record per step, in order, with the oracle's losses; the last checkpoint holds its weights."""
    log = read_log(run_dir)
    assert [e["step"] for e in log] == list(range(6))
    assert_matches_oracle(dict(losses=[e["loss"] for e in log], state_dict=final_state(run_dir)), oracle(ARGV))


# -- resuming --------------------------------------------------------------------------

def test_resume_auto_starts_fresh_then_continues_exactly(tmp_path):
    argv = [*ARGV, "--resume", "auto", "--checkpoint-interval", "1", "--out", str(tmp_path)]
    run_on_ranks(2, train_worker, [*argv, "--stop-at", "4"])  # nothing to resume: starts at step 0
    assert len(read_log(tmp_path / RUN)) == 4
    # As if the run had died after logging step 3 but before checkpointing it: the resumed run starts
    # from the checkpoint of step 2, runs step 3 again, and the log keeps one record of it.
    shutil.rmtree(checkpoint.path_for(tmp_path / RUN, 4))
    second = run_on_ranks(2, train_worker, argv)[0]
    assert len(second["losses"]) == 3  # from the checkpoint of step 3
    assert_resumed_run_matches_oracle(tmp_path / RUN)


def test_resume_auto_skips_a_damaged_newest_checkpoint(tmp_path):
    argv = [*ARGV, "--resume", "auto", "--checkpoint-interval", "1", "--out", str(tmp_path)]
    run_on_ranks(2, train_worker, [*argv, "--stop-at", "4"])
    newest = os.path.join(checkpoint.path_for(tmp_path / RUN, 4), "rank-00000.safetensors")
    with open(newest, "r+b") as f:  # truncated, as by a full disk
        f.truncate(os.path.getsize(newest) // 2)
    second = run_on_ranks(2, train_worker, argv)[0]
    assert len(second["losses"]) == 3  # from step 3, the previous checkpoint
    assert_resumed_run_matches_oracle(tmp_path / RUN)


def test_resume_from_a_bad_checkpoint_is_one_clear_error_on_every_rank(tmp_path):
    bad = tmp_path / "checkpoint-00000002"
    bad.mkdir()
    (bad / "rank-00000.safetensors").write_bytes(b"not a checkpoint")
    out = torchrun(2, "train.py", *ARGV, "--resume", str(bad), "--out", str(tmp_path), timeout=120)
    assert out.returncode != 0
    for rank in range(2):
        assert f"[rank {rank}] train.py: error: {bad}: incomplete, its write never finished" in out.stderr


def test_resume_from_a_damaged_checkpoint_stops_every_rank_after_they_hash_it_together(tmp_path):
    """A complete checkpoint whose file no longer matches its SHA-256: found by the rank that hashes that
    file, and every rank stops with the same message."""
    run_on_ranks(2, train_worker, [*ARGV, "--steps", "1", "--out", str(tmp_path)])
    saved = checkpoint.path_for(tmp_path / RUN, 1)
    file = os.path.join(saved, "rank-00000.safetensors")
    data = bytearray(open(file, "rb").read())
    data[-1] ^= 0xFF
    open(file, "wb").write(bytes(data))
    out = torchrun(2, "train.py", *ARGV, "--resume", saved, "--out", str(tmp_path / "b"), timeout=120)
    assert out.returncode != 0
    for rank in range(2):
        assert (f"[rank {rank}] train.py: error: {saved}: damaged, the bytes of rank-00000.safetensors do not "
                f"match its SHA-256") in out.stderr


# -- preemption --------------------------------------------------------------------------

def test_sigterm_stops_every_rank_with_a_checkpoint_and_resume_auto_continues_exactly(tmp_path):
    """SIGTERM to torchrun (as a scheduler sends it) is passed to every worker: each finishes its step, all
    agree on the last one, write a checkpoint and exit; the same command with --resume auto finishes."""
    argv = [*ARGV, "--steps", "400", "--resume", "auto", "--checkpoint-interval", "1000", "--out", str(tmp_path)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py", *argv]
    launch = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = tmp_path / RUN / "log.jsonl"
    deadline = time.monotonic() + 120
    while not (log.exists() and len(log.read_text().splitlines()) >= 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    launch.send_signal(signal.SIGTERM)
    output, _ = launch.communicate(timeout=120)
    stopped = len(read_log(tmp_path / RUN))
    assert 3 <= stopped < 400, output[-3000:]
    assert "stopped after step" in output
    assert checkpoint.checkpoints(tmp_path / RUN) == [checkpoint.path_for(tmp_path / RUN, stopped)]
    resumed = run_on_ranks(2, train_worker, argv)[0]
    assert len(resumed["losses"]) == 400 - stopped
    log = read_log(tmp_path / RUN)
    assert [e["step"] for e in log] == list(range(400))
    reference = reference_run([*ARGV, "--steps", "400"])
    assert_matches_oracle(dict(losses=[e["loss"] for e in log], state_dict=final_state(tmp_path / RUN)), reference)


# -- bad numbers ----------------------------------------------------------------------------

def poisoned_train_worker(argv, poisoned_step, poisoned_rank):
    """train.py's training, with one weight of one rank made NaN during one step (its own value again
    after it): that rank's loss, then every rank's gradient, is not finite at that step alone."""
    train_step = train.Trainer.train_step

    def poisoned(trainer, step, *options):
        if (step, dist.get_rank()) != (poisoned_step, poisoned_rank):
            return train_step(trainer, step, *options)
        weight = trainer.params[0].detach()
        kept = weight.clone()
        weight.view(-1)[0] = float("nan")
        try:
            return train_step(trainer, step, *options)
        finally:
            weight.copy_(kept)

    train.Trainer.train_step = poisoned
    try:
        return train_worker(argv)
    except train.NonFiniteStep as e:
        return str(e)


def test_a_nonfinite_step_is_skipped_when_allowed_and_the_run_ends_as_if_it_made_no_update(tmp_path):
    argv = [*ARGV, "--skip-nonfinite-steps", "1", "--out", str(tmp_path)]
    result = run_on_ranks(2, poisoned_train_worker, argv, 2, 1)[0]
    reference = reference_run(ARGV, skipped_steps={2})
    assert math.isnan(result["losses"][2]) and math.isnan(result["grad_norms"][2])
    del result["losses"][2], reference["losses"][2], result["grad_norms"][2], reference["grad_norms"][2]
    assert_matches_oracle(result, reference)
    torch.testing.assert_close(result["grad_norms"], reference["grad_norms"], rtol=1e-9, atol=0)
    assert [e["skipped_steps"] for e in read_log(tmp_path / RUN)] == [0, 0, 1, 1, 1, 1]


def test_a_nonfinite_step_stops_every_rank_naming_it_and_resume_auto_goes_on_from_the_last_good_checkpoint(
        tmp_path):
    argv = [*ARGV, "--checkpoint-interval", "1", "--resume", "auto", "--out", str(tmp_path)]
    stopped = run_on_ranks(2, poisoned_train_worker, argv, 2, 1)
    good = checkpoint.path_for(tmp_path / RUN, 2)
    assert stopped == [f"step 2: a non-finite loss on rank 1, gradient norm nan (non-finite steps so far: 1; "
                       f"--skip-nonfinite-steps 0); the last good checkpoint is {good}"] * 2
    assert checkpoint.checkpoints(tmp_path / RUN)[0] == good
    run_on_ranks(2, train_worker, argv)  # the fault was transient: the same command goes on from step 2
    assert_resumed_run_matches_oracle(tmp_path / RUN)


def test_a_diverging_run_exits_with_the_message_on_every_rank(tmp_path):
    """A learning rate of 1e300 makes the weights overflow after one update: train.py itself (under
    torchrun) stops at step 1, each rank saying why, and exits with status 1."""
    out = torchrun(2, "train.py", *ARGV, "--lr", "1e300", "--checkpoint-interval", "1", "--out", str(tmp_path),
                   timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    for rank in range(2):
        assert (f"[rank {rank}] train.py: error: step 1: a non-finite loss on ranks 0, 1, gradient norm nan "
                f"(non-finite steps so far: 1; --skip-nonfinite-steps 0); the last good checkpoint is "
                f"{checkpoint.path_for(tmp_path / RUN, 1)}") in out.stderr


# -- workers killed: torchrun restarts them, --resume auto continues ------------------------

# (steps: enough that the second kill lands mid-run; 8 ranks on 2 cores step about ten times slower)
@pytest.mark.parametrize("world,flags,steps", [(2, [], 300), (8, ["--tp", "2", "--pp", "2", "--ep", "2", "--experts",
                                                                  "4"], 100)], ids=["dp2", "tp2-pp2-ep2"])
def test_workers_killed_twice_restart_and_end_as_if_never_killed(tmp_path, world, flags, steps):
    """SIGKILL to a worker mid-step, twice: torchrun --max-restarts brings every worker up again, the
    process group forms again, and --resume auto continues from the last checkpoint; the log and the final
    weights equal an uninterrupted run's."""
    argv = [*EQUIVALENCE, *flags, "--steps", str(steps), "--checkpoint-interval", "7", "--resume", "auto"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "3",
           "--nproc_per_node", str(world), "train.py", *argv, "--out", str(tmp_path)]
    launch = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 400
    for lines in (20, 60):  # kill a worker once 20 steps are logged, and again at 60 (after the restart)
        while time.monotonic() < deadline:
            logs = list(tmp_path.glob("*/log.jsonl"))
            if logs and len(logs[0].read_text().splitlines()) >= lines:
                break
            time.sleep(0.05)
        os.kill(worker_pids(launch.pid)[-1], signal.SIGKILL)
    output, _ = launch.communicate(timeout=max(1, deadline - time.monotonic()))
    assert launch.returncode == 0, output[-3000:]
    assert output.count("run ") >= 3  # three launches of the workers: the first and two restarts
    (run,) = [p.parent for p in tmp_path.glob("*/log.jsonl")]
    entries = read_log(run)
    assert [e["step"] for e in entries] == list(range(steps))
    reference = reference_run([*EQUIVALENCE, *flags, "--steps", str(steps)])
    assert_matches_oracle(dict(losses=[e["loss"] for e in entries], state_dict=final_state(run)), reference)


def test_a_stalled_rank_stops_the_others_within_the_timeout(tmp_path):
    """A worker frozen mid-run (SIGSTOP): the other stops after --timeout, saying where it waited, instead
    of hanging; torchrun then ends the job (after its own grace period for the frozen worker)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py",
           *EQUIVALENCE, "--steps", "100000", "--timeout", "5", "--out", str(tmp_path)]
    launch = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("*/log.jsonl")) or len(next(tmp_path.glob("*/log.jsonl")).read_text()) < 100:
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.05)
    frozen = worker_pids(launch.pid)[-1]
    os.kill(frozen, signal.SIGSTOP)
    try:  # a hang would pass 120 s (the timeout, 5 s, then torchrun's 30 s grace): the test's deadline
        output, _ = launch.communicate(timeout=120)
    finally:
        os.kill(frozen, signal.SIGKILL) if os.path.exists(f"/proc/{frozen}") else None
    assert launch.returncode != 0
    assert "train.py: error: a collective failed while waiting in" in output
    assert "Timed out" in output and "--timeout 5 s" in output


# -- a node lost for good: the survivors go on as a smaller world ----------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def elastic_node(endpoint, address, hosts_rendezvous, last_call_s, argv, output, env=()):
    """One torchrun "node" of 2 ranks of an elastic launch (--nnodes 1:2) joined by the c10d rendezvous at
    `endpoint` (served by the node that hosts it), its output into the file `output`. The node's address
    orders the nodes (the lower is rank 0); a node is dead after 3 missed heartbeats 1 s apart, and a round
    closes last_call_s after it has its first node (the one that joins first sets it)."""
    conf = (f"join_timeout=60,last_call_timeout={last_call_s},keep_alive_interval=1,keep_alive_max_attempt=3,"
            f"is_host={int(hosts_rendezvous)}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "shrink", "--rdzv-conf", conf,
           "--local-addr", address, "--max-restarts", "3", "--monitor-interval", "0.5", "train.py", *argv]
    return subprocess.Popen(cmd, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **dict(env)})


def kill_nodes(*nodes):
    """On a failure, no process of the test outlives it: every node still running, agent and workers, killed."""
    for node in nodes:
        if node and node.poll() is None:
            for pid in [*worker_pids(node.pid), node.pid]:
                os.kill(pid, signal.SIGKILL)
            node.wait()


def wait_for(condition, deadline, what):
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def complete_checkpoints(run_dir):
    """The steps of run_dir's checkpoints whose write finished (their manifest is written last)."""
    return [int(path.rsplit("-", 1)[1]) for path in checkpoint.checkpoints(run_dir)
            if os.path.exists(os.path.join(path, checkpoint.MANIFEST))]


def test_a_node_lost_for_good_leaves_a_smaller_world_that_goes_on_exactly(tmp_path):
    """Two torchrun "nodes" of 2 ranks under --nnodes 1:2, tp=2 in each node and dp=2 across them. Once a
    checkpoint of step 2 is written, the second node dies whole (its agent and its workers, SIGKILL). The
    first node's workers fail (their peers are gone), its agent forms the rendezvous again as the one node
    left, and its 2 ranks (dp=1, the same global batch in larger micro-batches) resume with --resume auto
    from the newest checkpoint the 4 ranks wrote: the log holds every step once, with the losses of a run
    never interrupted, and the last checkpoint its weights."""
    steps = 20
    argv = [*EQUIVALENCE, "--tp", "2", "--steps", str(steps), "--checkpoint-interval", "1", "--resume", "auto",
            "--timeout", "10", "--out", str(tmp_path / "runs")]
    run = tmp_path / "runs" / "gpu4_tp2_pp1_cp1_ep1"  # named by the first world; the smaller one goes on in it
    endpoint = f"127.0.0.1:{free_port()}"
    deadline = time.monotonic() + 150
    with open(tmp_path / "lost.txt", "w") as lost_output, open(tmp_path / "survivor.txt", "w") as survivor_output:
        # The node to be lost starts first, and is waiting to connect to the rendezvous (torchrun says so at
        # INFO) when the survivor starts: whichever joins first, the other is about to, and the lost node's
        # last call (60 s) would wait for the survivor. The survivor hosts the rendezvous (its store must
        # outlive the other node), is rank 0 (its address sorts first), and its last call is short: alone
        # again, it starts 3 s after it rejoins.
        lost = elastic_node(endpoint, "localhost", False, 60, argv, lost_output, env={"LOGLEVEL": "INFO"})
        survivor = None
        try:
            wait_for(lambda: "Starting elastic_operator" in (tmp_path / "lost.txt").read_text(), deadline,
                     "the node to be lost did not start")
            survivor = elastic_node(endpoint, "127.0.0.1", True, 3, argv, survivor_output)
            wait_for(lambda: any(step >= 2 for step in complete_checkpoints(run)), deadline,
                     "the 4 ranks wrote no checkpoint of step 2")
            for pid in [lost.pid, *worker_pids(lost.pid)]:  # the whole node at once, as by a power cut
                os.kill(pid, signal.SIGKILL)
            written_by_four = max(complete_checkpoints(run))
            assert written_by_four < steps, "the run ended before the node was lost"
            survivor.wait(timeout=max(1, deadline - time.monotonic()))
        finally:
            kill_nodes(lost, survivor)
    output = (tmp_path / "survivor.txt").read_text()
    assert survivor.returncode == 0, output[-3000:]
    assert f"run {run}: 4 ranks MeshShape(dp=2" in output
    assert f"run {run}: 2 ranks MeshShape(dp=1" in output  # the smaller world, in the same run folder
    resumed = int(re.search(r"resuming from .*checkpoint-(\d+)", output).group(1))
    assert resumed >= written_by_four >= 2  # a checkpoint the 4 ranks finished (the 2 write none before)
    entries = read_log(run)
    assert [e["step"] for e in entries] == list(range(steps))
    reference = reference_run([*EQUIVALENCE, "--steps", str(steps)])
    assert_matches_oracle(dict(losses=[e["loss"] for e in entries], state_dict=final_state(run)), reference)


# torchrun's agents share the rendezvous's store with the workers, and its rank 0 publishes the workers' master
# address in it only at its first round (DynamicRendezvousHandler.next_rendezvous): a node that joins later
# waits for that round's address forever. Growing a job needs the store unshared (docs/gpus.md).
GROWING = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.mark.full
def test_a_node_that_joins_grows_the_world_which_goes_on_exactly(tmp_path):
    """The other way: one torchrun "node" of 2 ranks (tp=2) starts alone under --nnodes 1:2 and hosts the
    rendezvous (in its agent, not in a trainer: a trainer that dies does not take it down). Once it has written
    the checkpoint of step 2 a second node joins: the first node's agent sees a node waiting, stops its
    workers (a membership change, not one of --max-restarts; SIGTERM, so they finish their step and write
    its checkpoint), and both nodes start as 4 ranks (dp=2), which resume with --resume auto from the newest
    checkpoint the 2 wrote: every step logged once, the losses and final weights of a run never interrupted."""
    steps = 120  # (the first node alone runs a few dozen steps a second: enough that it cannot finish first)
    argv = [*EQUIVALENCE, "--tp", "2", "--steps", str(steps), "--checkpoint-interval", "1", "--resume", "auto",
            "--timeout", "20", "--out", str(tmp_path / "runs")]
    run = tmp_path / "runs" / "gpu2_tp2_pp1_cp1_ep1"  # named by the first world; the larger one goes on in it
    endpoint = f"127.0.0.1:{free_port()}"
    deadline = time.monotonic() + 200
    with open(tmp_path / "first.txt", "w") as first_output, open(tmp_path / "joining.txt", "w") as joining_output:
        first = elastic_node(endpoint, "127.0.0.1", True, 1, argv, first_output, env=GROWING)
        joining = None
        try:
            wait_for(lambda: any(step >= 2 for step in complete_checkpoints(run)), deadline,
                     "the first node alone wrote no checkpoint of step 2")
            joining = elastic_node(endpoint, "localhost", False, 1, argv, joining_output, env=GROWING)
            for node in (first, joining):
                node.wait(timeout=max(1, deadline - time.monotonic()))
        finally:
            kill_nodes(first, joining)
    output = (tmp_path / "first.txt").read_text()
    assert first.returncode == joining.returncode == 0, output[-3000:] + (tmp_path / "joining.txt").read_text()[-3000:]
    assert f"run {run}: 2 ranks MeshShape(dp=1" in output
    assert f"run {run}: 4 ranks MeshShape(dp=2" in output  # the larger world, in the same run folder
    resumed = int(re.search(r"resuming from .*checkpoint-(\d+)", output).group(1))
    assert 2 <= resumed < steps
    entries = read_log(run)
    assert [e["step"] for e in entries] == list(range(steps))
    assert_matches_oracle(dict(losses=[e["loss"] for e in entries], state_dict=final_state(run)),
                          reference_run([*EQUIVALENCE, "--steps", str(steps)]))


def test_resume_auto_on_another_number_of_ranks_goes_on_in_the_run_folder_those_ranks_wrote(tmp_path):
    """The default run name counts the ranks (gpu4_...), so --resume auto on 2 ranks looks in gpu2_...: with
    nothing there, it goes on in the one folder of its layout that another world wrote, and refuses to guess
    between two."""
    run_on_ranks(1, train_worker, [*ARGV, "--steps", "1", "--out", str(tmp_path)])  # gpu1_tp1_pp1_cp1_ep1
    args = cli.parse_args([*ARGV, "--resume", "auto", "--out", str(tmp_path)])
    assert train.resume_from(args, 2, None, report=lambda message: None) == checkpoint.path_for(
        tmp_path / "gpu1_tp1_pp1_cp1_ep1", 1)
    assert args.name == "gpu1_tp1_pp1_cp1_ep1"  # its log and its checkpoints go on there
    shutil.copytree(tmp_path / "gpu1_tp1_pp1_cp1_ep1", tmp_path / "gpu8_tp1_pp1_cp1_ep1")
    (tmp_path / "gpu2_tp2_pp1_cp1_ep1").mkdir()  # another layout: not this run
    args = cli.parse_args([*ARGV, "--resume", "auto", "--out", str(tmp_path)])
    with pytest.raises(cli.ConfigError, match=r"gpu2_tp1_pp1_cp1_ep1 has no checkpoint, and several runs of its "
                                              r"layout on other numbers of ranks have: .*gpu1_tp1_pp1_cp1_ep1/"
                                              r"checkpoint-00000001, .*gpu8_tp1_pp1_cp1_ep1/checkpoint-00000001; "
                                              r"name the run to continue with --name"):
        train.resume_from(args, 2, None, report=lambda message: None)
    named = cli.parse_args([*ARGV, "--resume", "auto", "--out", str(tmp_path), "--name", "gpu8_tp1_pp1_cp1_ep1"])
    assert train.resume_from(named, 2, None, report=lambda message: None) == checkpoint.path_for(
        tmp_path / "gpu8_tp1_pp1_cp1_ep1", 1)


@pytest.mark.parametrize("world,flags,message", [
    (2, ["--tp", "2", "--pp", "2"],
     "--resume auto on 2 ranks: the resumed world is too small for the layout (tp x pp x cp = 2 x 2 x 1 = 4 ranks "
     "hold a copy of the model, and --batch-size 8 splits over --micro-batches 2 x the data ranks); the smallest "
     "that holds it is 4 ranks (dp 1)"),
    (6, ["--tp", "2", "--pp", "2"],
     "--resume auto on 6 ranks: the resumed world is too small for the layout, or of a size it does not divide "
     "into (tp x pp x cp = 2 x 2 x 1 = 4 ranks hold a copy of the model, and --batch-size 8 splits over "
     "--micro-batches 2 x the data ranks); smaller worlds that hold it: 4 ranks (dp 1)"),
    (6, ["--tp", "2"],  # dp 3 does not split the batch of 8 into 2 micro-batches
     "--resume auto on 6 ranks: the resumed world is too small for the layout, or of a size it does not divide "
     "into (tp x pp x cp = 2 x 1 x 1 = 2 ranks hold a copy of the model, and --batch-size 8 splits over "
     "--micro-batches 2 x the data ranks); smaller worlds that hold it: 4 ranks (dp 2), 2 ranks (dp 1)"),
], ids=["fewer-than-a-copy", "not-a-multiple", "batch-does-not-split"])
def test_a_resumed_world_that_cannot_hold_the_layout_is_refused_saying_what_would(world, flags, message):
    """A node lost for good leaves a world that may not hold the layout: one line says so, and which worlds
    would; the same flags without --resume keep the plain message."""
    argv = [*ARGV, *flags]
    with pytest.raises(cli.ConfigError) as refused:
        cli.check_args(cli.parse_args([*argv, "--resume", "auto"]), world)
    assert str(refused.value) == message
    with pytest.raises(cli.ConfigError) as plain:
        cli.check_args(cli.parse_args(argv), world)
    assert "resume" not in str(plain.value)
