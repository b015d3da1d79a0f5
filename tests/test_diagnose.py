"""When a run hangs: every rank's record of its collectives written into the run folder on a failure, and
`python -m tools.diagnose` naming the first collective the ranks disagree on and the rank out of step (the
straggler of a run that slows: tests/test_stragglers.py).

The faults are injected here, through the functions the ranks run (not a flag a user sees): one rank skips
one tensor-parallel all-reduce in step 2; one rank freezes in its forward.
"""
import collections
import json
import os
import time

import pytest
import torch.distributed as dist

import model
import tp
import train
from distributed import run_on_ranks
from oracle import EQUIVALENCE
from tools import diagnose

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

SKIP_RANK, SKIP_STEP = 1, 2


def current_step_kept(state):
    """Trainer.train_step keeping the step it runs in state["step"] (for the faults to pick theirs)."""
    original = train.Trainer.train_step

    def train_step(self, step, timeline=False):
        state["step"] = step
        return original(self, step, timeline)
    train.Trainer.train_step = train_step


def skipping_worker(argv):
    """train.py's main on this rank, where rank SKIP_RANK leaves out its last tp all-reduce of step SKIP_STEP
    (a rank-parity bug: it goes on without it). The last, so that no later call of its pairs with its
    partner's with other shapes: gloo would abort both processes then, and neither could write its record.
    Returns (exit status, seconds taken)."""
    state = {"step": None, "calls": collections.Counter()}
    current_step_kept(state)
    original = tp.all_reduce

    def all_reduce(x, group, op=dist.ReduceOp.SUM):
        state["calls"][state["step"]] += 1
        last_of_step = state["calls"][state["step"]] == state["calls"][SKIP_STEP - 1]  # as many as a step makes
        if dist.get_rank() == SKIP_RANK and state["step"] == SKIP_STEP and last_of_step:
            return x.clone()
        return original(x, group, op)
    tp.all_reduce = all_reduce
    try:
        train.main(argv)
        return 0
    except RuntimeError:  # a collective timed out, or failed: main wrote why and raised
        return 1


def run_folder(out):
    (name,) = os.listdir(out)
    return os.path.join(out, name)


def test_a_skipped_collective_is_named_with_its_group_number_and_the_rank_that_did_not_arrive(tmp_path, capsys):
    argv = [*EQUIVALENCE, "--steps", "4", "--tp", "2", "--timeout", "6", "--out", str(tmp_path)]
    results = run_on_ranks(4, skipping_worker, argv, timeout=120)  # a hang would pass the deadline
    assert results == [1, 1, 1, 1]  # every rank fails, none hangs
    folder = run_folder(tmp_path)
    assert sorted(os.listdir(os.path.join(folder, "collectives"))) == [f"rank{r}.json" for r in range(4)]
    # The collective rank 1 skipped: its partner's last call of tp.all_reduce in step 2, on their tp group
    with open(os.path.join(folder, "collectives", "rank0.json")) as f:
        partner = json.load(f)
    skipped = [e for e in partner["entries"] if e["step"] == SKIP_STEP and e["group"] == [0, 1]
               and e["site"][0].startswith("tp.py:") and e["site"][0].endswith(" all_reduce")][-1]
    assert skipped["returned"] is None  # its partner waited in it until the timeout
    lines = diagnose.diagnose(folder)
    report = "\n".join(lines)
    assert "records from 4 of 4 ranks" in report
    assert f"first disagreement: tp group [0, 1], collective #{skipped['seq']}" in report, report
    assert f"reached by rank 0: all_reduce #{skipped['seq']} of tp [0, 1]" in report, report
    assert "rank 1 did not arrive: its call there is" in report, report
    assert "rank 1 failed:" in report and "rank 0 did not arrive" not in report

    # A rank that froze (stopped by a signal, a lost node) writes nothing: its silence is named
    os.remove(os.path.join(folder, "collectives", "rank3.json"))
    diagnose.main([folder])
    assert "none from rank 3: frozen or killed before it could write" in capsys.readouterr().out


def freezing_worker(argv):
    """train.py's main on this rank, where rank 3 (pipeline stage 1) freezes in its forward of step 2 and later
    vanishes without a word (as a process stopped by a signal, or a node lost, writes nothing)."""
    state = {"step": None}
    current_step_kept(state)
    original = model.Block.forward

    def forward(self, *args, **kwargs):
        if dist.get_rank() == 3 and state["step"] == SKIP_STEP:
            time.sleep(15)  # longer than the others' --timeout and their records' writing
            os._exit(0)
        return original(self, *args, **kwargs)
    model.Block.forward = forward
    try:
        train.main(argv)
    except RuntimeError:
        return 1
    return 0


def test_a_frozen_rank_is_named_by_its_silence_and_the_ranks_left_waiting_for_it(tmp_path):
    argv = [*EQUIVALENCE, "--steps", "4", "--pp", "2", "--layers", "4", "--timeout", "5", "--out", str(tmp_path)]
    with pytest.raises(RuntimeError, match=r"rank 3 ---\nexited with code 0 and no result"):
        run_on_ranks(4, freezing_worker, argv, timeout=90)
    folder = run_folder(tmp_path)
    assert sorted(os.listdir(os.path.join(folder, "collectives"))) == [f"rank{r}.json" for r in range(3)]
    report = "\n".join(diagnose.diagnose(folder))
    assert "records from 3 of 4 ranks; none from rank 3: frozen or killed before it could write" in report
    # its pipeline neighbour (stage 0's rank 2 of the same data-parallel copy) waited for its message
    assert "rank 2 was left waiting for it: last in irecv" in report and "of pp [2, 3] with rank 3" in report
