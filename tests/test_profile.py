"""train.py --profile STEPS: a Chrome trace per rank of the named steps alone, the article's phases named in it;
the numbers the same as without it; nothing started or written without it; a bad value refused in one line.

(On CUDA --profile also records the allocator's history, through private functions of PyTorch that need a GPU:
here they are stood in for, and only the order of the calls is checked.)
"""
import json
from collections import Counter

import pytest
import torch

from distributed import run_on_ranks
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, train_worker
from training import cli
from training.profile import StepProfiler

PIPELINE = [*EQUIVALENCE, "--layers", "4", "--steps", "4"]  # two micro-batches; steps 0 to 3


def named_ranges(path):
    """Counter of the names of the ranges the code marks (torch.profiler.record_function) in a Chrome trace."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return Counter(e["name"] for e in events if e.get("cat") == "user_annotation" and not e["name"].startswith("gloo"))


def test_tp2_pp2_traces_each_ranks_pipeline_actions_of_the_named_steps_alone(tmp_path):
    result = run_on_ranks(4, train_worker, [*PIPELINE, "--tp", "2", "--pp", "2", "--profile", "1-2",
                                            "--out", str(tmp_path)], timeout=150)[0]
    assert_matches_oracle(result, oracle(PIPELINE))  # the profiler changes no number
    run = tmp_path / "gpu4_tp2_pp2_cp1_ep1"
    assert sorted(p.name for p in (run / "traces").iterdir()) == [f"rank{r}.json" for r in range(4)]
    assert not (run / "memory").exists()  # the allocator's history: CUDA's alone
    for rank in range(4):
        names = named_ranges(run / "traces" / f"rank{rank}.json")
        # Steps 1 and 2 alone (counted from 0), each rank's one chunk on both micro-batches in each: 1F1B's
        # forward and backward of every micro-batch, then the clipping and the optimizer's step.
        assert {name for name in names if name.startswith("step ")} == {"step 1", "step 2"}
        assert {name: n for name, n in names.items() if name.startswith("pp.")} == {
            f"pp.{kind} chunk 0 micro {m}": 2 for kind in ("forward", "backward") for m in (0, 1)}
        assert names["clip"] == names["optimizer"] == 2, names


def test_cp_ep_zero3_name_ring_steps_all_to_alls_gathers_and_reductions(tmp_path):
    """cp=2 (a ring of 2 steps), its 2 ranks the experts' ep=2 and ZeRO-3's shards, tiny's 2 layers each an MoE."""
    argv = [*EQUIVALENCE, "--steps", "2", "--cp", "2", "--experts", "4", "--ep", "2", "--zero", "3", "--profile", "0"]
    run_on_ranks(2, train_worker, [*argv, "--out", str(tmp_path)], timeout=120)
    for rank in range(2):
        names = named_ranges(tmp_path / "gpu2_tp1_pp1_cp2_ep2" / "traces" / f"rank{rank}.json")
        layers_x_micro = 2 * 2
        for step in (0, 1):  # each ring step, forward and backward, of each layer's attention on each micro-batch
            assert names[f"cp.ring step {step} forward"] == names[f"cp.ring step {step} backward"] == layers_x_micro
        assert names["ep.dispatch"] == names["ep.combine"] == layers_x_micro
        assert [names[f"{kind} micro {m}"] for kind in ("forward", "backward") for m in (0, 1)] == [1] * 4
        assert names["step 0"] == 1 and "step 1" not in names
        assert any(name.startswith("dp.gather unit ") for name in names)
        assert any(name.startswith("dp.reduce bucket ") for name in names)


def test_a_run_without_profile_starts_no_profiler_and_writes_no_trace(tmp_path):
    run_on_ranks(1, train_worker, ["--model", "tiny", "--steps", "1", "--batch-size", "4", "--eval-batches", "1",
                                   "--out", str(tmp_path)])
    run = tmp_path / "gpu1_tp1_pp1_cp1_ep1"
    assert (run / "log.jsonl").exists()
    assert not (run / "traces").exists() and not (run / "memory").exists()
    unnamed = StepProfiler.from_args(cli.parse_args(["--model", "tiny"]), str(tmp_path), 0, torch.device("cpu"))
    unnamed.start(0)  # what train.py's loop calls at every step
    assert unnamed.steps is None and unnamed.profiler is None and not torch.autograd._profiler_enabled()


def test_a_run_that_ends_early_writes_the_steps_it_traced(tmp_path):
    """A resumed run starts within the named steps (they are absolute); one that stops before their last (a signal,
    an error) still writes what it traced."""
    with pytest.raises(KeyboardInterrupt), StepProfiler((2, 5), str(tmp_path), 3, torch.device("cpu")) as profiler:
        for step in (3, 4):  # resumed at step 3
            profiler.start(step)
            with torch.profiler.record_function("work"):
                torch.ones(4).sum()
            profiler.stop(step)
        profiler.start(5)
        raise KeyboardInterrupt  # in step 5
    assert not torch.autograd._profiler_enabled()
    names = named_ranges(tmp_path / "traces" / "rank3.json")
    assert {name: n for name, n in names.items() if name.startswith(("step", "work"))} == \
        {"step 3": 1, "step 4": 1, "step 5": 1, "work": 2}


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_on_cuda_the_allocators_history_is_recorded_and_dumped_even_at_out_of_memory(tmp_path, monkeypatch, capsys):
    """The order of the calls to the allocator's private functions, stood in for here (the real ones need a GPU):
    recording from the first named step, a dump at out-of-memory, then the last step's, then recording off; a
    PyTorch without them writes the trace all the same, with a line saying so."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **options: calls.append(options))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(path))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with StepProfiler((1, 2), str(tmp_path), 3, torch.device("cuda")) as profiler:
            profiler.start(1)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    memory = tmp_path / "memory"
    assert calls == [dict(max_entries=100000), str(memory / "rank3-oom.pickle"), str(memory / "rank3.pickle"),
                     dict(enabled=None)]
    monkeypatch.delattr(torch.cuda.memory, "_dump_snapshot")
    with StepProfiler((0, 0), str(tmp_path / "b"), 0, torch.device("cuda")) as profiler:
        profiler.start(0)
        profiler.stop(0)
    assert (tmp_path / "b" / "traces" / "rank0.json").exists()
    assert "[rank 0] --profile: torch.cuda.memory._dump_snapshot" in capsys.readouterr().err


@pytest.mark.parametrize("value,message", [
    ("x", "--profile x: give a step or a range of steps, counted from 0, e.g. 3 or 5-7"),
    ("3-1", "--profile 3-1: give a step or a range of steps"),
    ("-1", "--profile -1: give a step or a range of steps"),
    ("1-2-3", "--profile 1-2-3: give a step or a range of steps"),
    ("2-5", "--profile 2-5: the run has --steps 4, steps 0 to 3"),
    ("4", "--profile 4: the run has --steps 4, steps 0 to 3"),
])
def test_a_bad_profile_is_refused_in_one_line(value, message):
    with pytest.raises(cli.ConfigError) as refusal:
        cli.check_args(cli.parse_args(["--model", "tiny", "--steps", "4", "--profile", value]), 1)
    assert message in str(refusal.value) and "\n" not in str(refusal.value)

