"""ZeRO-1, 2 and 3 equal the single device, and shard memory and communication as the article says.

The article counts 16 bytes per parameter (mixed precision: 2 weights, 2
gradients, 12 Adam). These float64 runs hold 8 bytes of weights, 8 of
gradients and 16 of Adam state (two moments) per parameter, and ZeRO divides
them the same way: optimizer state by N from stage 1, gradients from stage
2, parameters from stage 3 (each bucket padded to a multiple of N).
"""
import json
import math

import pytest
import torch
import torch.distributed as dist

from training import cli
import train
from distributed import run_on_ranks
from dp import ZERO_STAGES, ZeRO3, gpt_units
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, reference_run, train_worker

ARGV = EQUIVALENCE
F64 = 8  # bytes per element
STEP_COUNTER = 4  # AdamW keeps a one-element float32 step count per parameter tensor


def tiny_model():
    args = cli.parse_args(ARGV)
    return train.build_model(cli.model_config(args, 64), 0, torch.float64, torch.device("cpu"))


def padded(numel, n_ranks):
    return math.ceil(numel / n_ranks) * n_ranks


def bucket_sizes(stage, n_ranks):
    """Padded element counts of the flat buckets: one bucket for stages 1-2 (25 MiB), one per unit for stage 3."""
    model = tiny_model()
    if stage == 3:
        return [padded(sum(p.numel() for p in unit.parameters()), n_ranks) for unit in gpt_units(model)]
    return [padded(sum(p.numel() for p in model.parameters()), n_ranks)]


def pieces_of_shard(stage, n_ranks, rank):
    """(elements, pieces) of this rank's shards that belong to parameters: the optimizer steps each
    parameter's piece on its own (as one device steps each parameter); padding has no state."""
    model = tiny_model()
    if stage == 3:
        buckets = [[p.numel() for p in unit.parameters()] for unit in reversed(gpt_units(model))]
    else:
        buckets = [[p.numel() for p in reversed(list(model.parameters()))]]
    elements = pieces = 0
    for numels in buckets:
        size = padded(sum(numels), n_ranks) // n_ranks
        offset = 0
        for numel in numels:
            overlap = min(offset + numel, (rank + 1) * size) - max(offset, rank * size)
            elements, pieces = elements + max(overlap, 0), pieces + (overlap > 0)
            offset += numel
    return elements, pieces


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_single_device_and_shards_as_the_article_says(tmp_path, stage, world):
    results = run_on_ranks(world, train_worker, [*ARGV, "--zero", str(stage), "--out", str(tmp_path)])
    for result in results:
        assert_matches_oracle(result, oracle(ARGV))

    log = [json.loads(line) for line in (tmp_path / f"gpu{world}_tp1_pp1_cp1_ep1" / "log.jsonl").open()]
    n_params = sum(p.numel() for p in tiny_model().parameters())
    n_tensors = len(list(tiny_model().parameters()))
    sizes = bucket_sizes(stage, world)
    full = sum(sizes) * F64           # the padded flat buffers, in bytes
    shard = full // world              # this rank's 1/N of them
    replicated_optimizer = 2 * n_params * F64 + STEP_COUNTER * n_tensors
    for entry in log:
        # Memory, per rank, counted from the tensors that exist after the step.
        # AdamW's two moments for every element of this rank's pieces, and a step counter per piece.
        assert entry["optim_bytes"] == [2 * elements * F64 + STEP_COUNTER * pieces
                                        for elements, pieces in (pieces_of_shard(stage, world, r) for r in range(world))]
        assert entry["optim_bytes"][0] < replicated_optimizer / world * 1.05   # 1/N, up to padding
        expected_grads = shard if stage >= 2 else full + shard   # stage 1: full gradients + the reduced shard
        assert entry["grad_bytes"] == [expected_grads] * world
        expected_params = shard if stage == 3 else full          # stage 3: only the shard between uses
        assert entry["param_bytes"] == [expected_params] * world

    # Communication, per rank per step: ring collectives send (N-1)/N of the full buffer each.
    one_pass = sum(size * F64 * (world - 1) // world for size in sizes)
    micro_batches = 2
    reduce_scatters = 1 if stage == 1 else micro_batches        # stages 2, 3 reduce every backward
    all_gathers = 1 if stage < 3 else 2 * micro_batches         # stage 3: before forward and before backward
    clip_norm_all_reduce = 2 * (world - 1) * F64 // world       # the global norm: one float64
    for entry in log[:-1]:  # the last step's record is taken before validation gathers again
        assert entry["comm_dp_reduce_scatter_bytes"] == [reduce_scatters * one_pass] * world
        assert entry["comm_dp_all_gather_bytes"] == [all_gathers * one_pass] * world
        assert entry["comm_dp_all_reduce_bytes"] == [clip_norm_all_reduce] * world
    # With one micro-batch that is the article's 2 Psi for stages 1 and 2 (what plain data parallelism's
    # all-reduce sends, 2 (N-1)/N Psi) and 3 Psi for stage 3.


def test_plain_data_parallel_replicates_everything_and_communicates_two_psi(tmp_path):
    results = run_on_ranks(4, train_worker, [*ARGV, "--out", str(tmp_path)])
    assert_matches_oracle(results[0], oracle(ARGV))
    log = [json.loads(line) for line in (tmp_path / "gpu4_tp1_pp1_cp1_ep1" / "log.jsonl").open()]
    params = list(tiny_model().parameters())
    n_params = sum(p.numel() for p in params)
    bucket = bucket_sizes(1, 4)[0] * F64  # the gradient bucket, padded like ZeRO's (here by < 4 elements)
    for entry in log:
        assert entry["param_bytes"] == [n_params * F64] * 4
        assert entry["grad_bytes"] == [bucket] * 4
        assert entry["optim_bytes"] == [2 * n_params * F64 + STEP_COUNTER * len(params)] * 4
        assert entry["comm_dp_all_reduce_bytes"] == [2 * 3 * bucket // 4] * 4  # 2 (N-1)/N Psi


def test_stop_under_zero3_resume_under_zero1_on_more_ranks(tmp_path):
    argv = [*ARGV, "--steps", "4"]
    first = run_on_ranks(2, train_worker, [*argv, "--zero", "3", "--stop-at", "2", "--out", str(tmp_path / "a")])[0]
    checkpoint = tmp_path / "a" / "gpu2_tp1_pp1_cp1_ep1" / "checkpoint-00000002"
    second = run_on_ranks(4, train_worker, [*argv, "--zero", "1", "--resume", str(checkpoint),
                                            "--out", str(tmp_path / "b")])[0]
    assert_matches_oracle(dict(losses=first["losses"] + second["losses"], state_dict=second["state_dict"]),
                          reference_run(argv))


class Recorder(torch.nn.Module):
    """A toy unit that records which units hold full parameters while it computes."""

    def __init__(self, log, index):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6, dtype=torch.float64)
        self.log, self.index = log, index

    def forward(self, x):
        self.log.append((self.index, [unit.linear.weight.untyped_storage().nbytes() > 0 for unit in self.all_units]))
        return torch.tanh(self.linear(x))


def zero3_timeline_worker():
    torch.manual_seed(0)
    log = []
    units = [Recorder(log, i) for i in range(4)]
    for unit in units:
        unit.all_units = units
    model = torch.nn.Sequential(*units)
    zero = ZeRO3(model, None, lambda shards: torch.optim.SGD(shards, lr=0.1), units=units)
    freed_before = [u.linear.weight.untyped_storage().nbytes() for u in units]
    model(torch.randn(2, 6, dtype=torch.float64)).sum().backward()
    zero.finish_grad_sync()
    freed_after = [u.linear.weight.untyped_storage().nbytes() for u in units]
    return log, freed_before, freed_after


def test_zero3_gathers_one_unit_ahead_and_frees_behind():
    for log, freed_before, freed_after in run_on_ranks(2, zero3_timeline_worker):
        assert freed_before == freed_after == [0, 0, 0, 0]  # no full parameter exists between uses
        for index, held in log:
            # While unit i computes: unit i is gathered, unit i+1 is being prefetched, all others are freed.
            assert held == [j in (index, index + 1) for j in range(4)]


def idle_in_a_later_backward_worker(stage):
    """Two units (experts, say) of a ZeRO instance that finds unused parameters: both compute in the step's
    first backward, only the first in its second. Returns (name, start, end, gradient piece) of this rank and
    the gradients one process computes from every rank's inputs (the mean over ranks of their sums)."""
    torch.manual_seed(0)
    units = [torch.nn.Linear(6, 6, bias=False).double() for _ in range(2)]
    expected = [torch.zeros_like(unit.weight) for unit in units]
    model = torch.nn.Sequential(*units)
    zero = ZERO_STAGES[stage](model, None, lambda shards: torch.optim.SGD(shards, lr=0.1), units=units,
                              find_unused_parameters=True)
    n, rank = dist.get_world_size(), dist.get_rank()
    inputs = [[torch.randn(3, 6, dtype=torch.float64) for _ in range(2)] for _ in range(n)]  # (rank, micro-batch)
    reference = [torch.nn.Linear(6, 6, bias=False).double() for _ in range(2)]
    with zero.full_parameters():
        for copy, unit in zip(reference, units):
            copy.weight.data.copy_(unit.weight)
    for per_rank in inputs:  # one process: both micro-batches of every rank, averaged over the ranks
        first, second = per_rank
        grads = torch.autograd.grad(reference[1](reference[0](first)).sum() + reference[0](second).sum(),
                                    [copy.weight for copy in reference])
        for total, grad in zip(expected, grads):
            total += grad / n
    first, second = inputs[rank]
    with zero.between_micro_batches():
        model(first).sum().backward()
    units[0](second).sum().backward()  # unit 1 idle: its reduction must hold zeros, not a freed buffer
    zero.finish_grad_sync()
    names = {"0.weight": expected[0], "1.weight": expected[1]}
    return [(name, start, end, grad.clone(), names[name].flatten()[start:end])
            for name, start, end, grad in zero.gradient_pieces()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_unit_idle_in_a_later_backward_of_the_step_reduces_zeros(stage):
    """A unit reached by an earlier micro-batch of the step but not by this one (an expert no token of this
    micro-batch reached, on any rank): ZeRO-2 and 3 freed its bucket after the earlier backward, so it is
    allocated again as zeros before its reduce-scatter (reducing the freed buffer was a segmentation fault)."""
    held = {}  # name -> elements held by some rank
    for pieces in run_on_ranks(2, idle_in_a_later_backward_worker, stage, timeout=120):
        for name, start, end, got, want in pieces:
            torch.testing.assert_close(got.flatten(), want, rtol=1e-12, atol=1e-14, msg=name)
            held[name] = held.get(name, 0) + end - start
    assert held == {"0.weight": 36, "1.weight": 36}  # every element of both, on one rank or the other


# -- ZeRO with experts: one instance for the dense parameters, one for the experts' --------------------

MOE = [*ARGV, "--experts", "4", "--top-k", "2", "--layers", "4", "--batch-size", "16"]


@pytest.mark.parametrize("world,flags", [(2, ["--zero", "1"]), (4, ["--zero", "2", "--ep", "2"]),
                                         (8, ["--zero", "1", "--ep", "2", "--pp", "2"]),
                                         (8, ["--zero", "2", "--ep", "2", "--tp", "2", "--sp"]),
                                         (4, ["--zero", "3", "--ep", "2"]),
                                         (8, ["--zero", "3", "--ep", "2", "--tp", "2", "--sp"])],
                         ids=lambda f: " ".join(f) if isinstance(f, list) else str(f))
def test_zero_with_experts_matches_single_device(tmp_path, world, flags):
    """Expert parameters sharded over the ranks that hold the same experts, the rest over every rank with
    different tokens; each parameter stepped on its own, so an expert that no token reached in a step is
    skipped as on one device (which happens in these runs: test_ep checks it on purpose)."""
    for result in run_on_ranks(world, train_worker, [*MOE, *flags, "--out", str(tmp_path)]):
        assert_matches_oracle(result, oracle(MOE))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_experts_shards_each_share_over_its_own_group(tmp_path, stage):
    """dp=2 x ep=2: the dense share Psi_d is sharded over the 4 ranks with different tokens, each rank's
    expert share Psi_e (its 2 experts of 4 per layer) over the 2 ranks that hold the same experts. Per
    step each share is reduce-scattered (once per backward from stage 2) and all-gathered over its own
    group: (N-1)/N of it, with N = 4 for the dense share and 2 for the experts'."""
    world, micro_batches = 4, 2
    argv = [*MOE, "--ep", "2", "--zero", str(stage), "--steps", "2", "--out", str(tmp_path)]
    run_on_ranks(world, train_worker, argv)
    log = [json.loads(line) for line in (tmp_path / "gpu4_tp1_pp1_cp1_ep2" / "log.jsonl").open()]
    model = train.build_model(cli.model_config(cli.parse_args(MOE), 64), 0, torch.float64, torch.device("cpu"))
    named = dict(model.named_parameters())
    dense = sum(p.numel() for name, p in named.items() if ".experts." not in name)
    experts = sum(p.numel() for name, p in named.items() if ".experts." in name) // 2  # half of them per rank
    n_expert_tensors = sum(".experts." in name for name in named) // 2
    shares = [(padded(dense, 4), 4), (padded(experts, 2), 2)]
    one_pass = sum(size * F64 * (n - 1) // n for size, n in shares)
    reduce_scatters = 1 if stage == 1 else micro_batches
    # The global norm (one float64 per instance) and the experts' used-mask (a byte per tensor).
    all_reduce = sum(2 * (n - 1) * F64 // n for _, n in shares) + 2 * (2 - 1) * n_expert_tensors // 2
    for entry in log[:-1]:
        assert entry["comm_dp_reduce_scatter_bytes"] == [reduce_scatters * one_pass] * world
        assert entry["comm_dp_all_gather_bytes"] == [one_pass] * world
        assert entry["comm_dp_all_reduce_bytes"] == [all_reduce] * world
        # Parameters: both shares in full (stages 1, 2); gradients: this rank's shards, and the full
        # buffers too at stage 1.
        shards = sum(size // n for size, n in shares) * F64
        assert entry["param_bytes"] == [sum(size for size, _ in shares) * F64] * world
        assert entry["grad_bytes"] == [shards + (sum(size for size, _ in shares) * F64 if stage == 1 else 0)] * world
