"""ZeRO-2 and ZeRO-3 under every pipeline schedule, and hybrid sharding (--dp-shard): each equal to the single
device in float64, under NCCL's matching by order alone (run_on_ranks), and equal to tools/plan/'s counters.

Under a pipeline a rank runs a backward per micro-batch and model chunk; ZeRO-2 and 3 then reduce-scatter
each bucket once per step, after its chunk's last backward (or weight pass), and ZeRO-3 gathers each unit
once per step, at its first forward (dp.py). Hybrid sharding shards within groups of --dp-shard neighbouring
data-parallel ranks and sums each shard across the groups.
"""
from collections import Counter
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.distributed as dist

import dp
from distributed import run_on_ranks
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, reference_run, train_worker
from planned import assert_matches_plan

pytestmark = pytest.mark.full  # the full tier (tests/conftest.py): python -m pytest -q --full

PIPELINE = [*EQUIVALENCE, "--layers", "4", "--micro-batches", "4", "--batch-size", "16"]
MOE = ["--experts", "4", "--top-k", "2"]

# (ZeRO stage, schedule, stages, other flags, model flags): each schedule on 2 and on 4 stages across the two
# ZeRO stages, each composed with one of tp+sp, cp and ep (ZeRO-3 with experts too); dp = 2 everywhere.
LAYOUTS = [
    (2, "gpipe", 2, ["--tp", "2", "--sp"], []),
    (3, "gpipe", 4, [], []),
    (2, "1f1b", 4, [], []),
    (3, "1f1b", 2, ["--tp", "2", "--sp"], ["--optimizer", "muon"]),  # each stage assembles its own matrices
    (2, "interleaved", 2, ["--cp", "2"], []),
    (3, "interleaved", 2, ["--ep", "2"], MOE),
    (2, "zb1", 4, [], []),
    (3, "zb1", 2, ["--cp", "2"], []),
    (2, "zbv", 2, ["--ep", "2"], [*MOE, "--shared-experts", "1", "--balance", "both"]),
    (3, "zbv", 4, [], ["--layers", "8"]),
]


def world_of(stages, flags):
    sizes = dict(zip(flags[::2], flags[1::2]))
    return 2 * stages * int(sizes.get("--tp", 1)) * int(sizes.get("--cp", 1)) * int(sizes.get("--ep", 1))


@pytest.mark.parametrize("zero,schedule,stages,flags,model", LAYOUTS,
                         ids=[f"zero{z}-{s}-pp{p}-{'-'.join(f[::2]).replace('--', '') or 'dp2'}"
                              for z, s, p, f, _ in LAYOUTS])
def test_zero2_and_3_under_every_schedule_match_single_device_and_the_plan(tmp_path, zero, schedule, stages,
                                                                           flags, model):
    world = world_of(stages, flags)
    argv = [*PIPELINE, *model, "--pp", str(stages), "--schedule", schedule, "--zero", str(zero), *flags]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle([*PIPELINE, *model]))
    assert_matches_plan(tmp_path, argv, world)


def counting_worker(argv):
    """Train, counting the reduce-scatters and all-gathers of every ZeRO bucket (the functions dp.py calls for
    each); of the gathers, those made where autograd records (validation's, before each of its forwards,
    which frees behind it, are left out)."""
    reduce_scatters, all_gathers = Counter(), Counter()

    def counted(counter, full, recorded, collective, *args, **kwargs):  # args[full]: the bucket's full buffer
        counter[id(args[full])] += recorded()
        return collective(*args, **kwargs)
    always = lambda: True  # noqa: E731 (a backward runs with grad mode off)
    dp.reduce_scatter_flat = partial(counted, reduce_scatters, 1, always, dp.reduce_scatter_flat)  # (shard, grad)
    dp.all_gather_flat = partial(counted, all_gathers, 0, torch.is_grad_enabled, dp.all_gather_flat)  # (full, shard)
    result = train_worker(argv)
    return result, sorted(reduce_scatters.values()), len(all_gathers), sum(all_gathers.values())


@pytest.mark.parametrize("zero,schedule,flags", [(2, "interleaved", ["--virtual-stages", "2"]), (3, "zbv", []),
                                                 (3, "1f1b", [])])
def test_pipelined_zero_reduces_each_bucket_once_a_step(tmp_path, zero, schedule, flags):
    """One reduce-scatter per bucket (ZeRO-3: per unit) and step, whatever the micro-batches (4) and chunks; and
    under ZeRO-3 one all-gather per unit and step (its first forward), plus the final gather of the weights
    (full_state_dict)."""
    steps = 2
    argv = [*PIPELINE, "--steps", str(steps), "--pp", "2", "--schedule", schedule, "--zero", str(zero), *flags,
            "--eval-interval", "1000", "--out", str(tmp_path)]
    expected = reference_run([*PIPELINE, "--steps", str(steps)])
    for result, reduce_scatters, buffers, gathers in run_on_ranks(4, counting_worker, argv, timeout=300):
        assert reduce_scatters and reduce_scatters == [steps] * len(reduce_scatters)
        if zero == 3:  # each unit's buffer: gathered at the first forward of each step, and once at the end
            assert buffers == len(reduce_scatters) and gathers == (steps + 1) * buffers
        assert_matches_oracle(result, expected)


# -- Hybrid sharding -------------------------------------------------------------------------------------

HYBRID = [*EQUIVALENCE, "--layers", "4", "--batch-size", "16"]


@pytest.mark.parametrize("world,flags,model", [
    (4, ["--zero", "1", "--dp-shard", "2"], []),
    (4, ["--zero", "2", "--dp-shard", "2"], []),
    # (--dp-shard counts every data rank, ep's folded ones too: the dense shards over the ep pair, 2 copies, as
    # "--dp-shard 1 --ep 2" meant when ep was an axis of its own)
    (4, ["--zero", "3", "--dp-shard", "2", "--ep", "2"], MOE),
    (8, ["--zero", "1", "--dp-shard", "1", "--tp", "2", "--cp", "2"], []),  # shards over the cp pair, 2 copies
    (8, ["--zero", "2", "--dp-shard", "2", "--pp", "2", "--schedule", "zb1"], []),
    (8, ["--zero", "3", "--dp-shard", "2", "--tp", "2", "--sp"], ["--optimizer", "muon"]),  # each copy its own
    (8, ["--zero", "3", "--dp-shard", "2", "--pp", "2", "--ep", "2"], MOE),
], ids=lambda v: " ".join(v).replace("--", "") if isinstance(v, list) else str(v))
def test_hybrid_sharding_matches_single_device_and_the_plan(tmp_path, world, flags, model):
    argv = [*HYBRID, *model, *flags]
    for result in run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=300):
        assert_matches_oracle(result, oracle([*HYBRID, *model]))
    assert_matches_plan(tmp_path, argv, world)


@pytest.mark.parametrize("first,second,model", [
    ((4, ["--zero", "3", "--dp-shard", "2"]), (2, ["--zero", "1"]), []),
    ((2, ["--zero", "2"]), (8, ["--zero", "3", "--dp-shard", "2", "--pp", "2"]), []),
    # Muon's momentum, saved in tp's and ZeRO-1's pieces, read back into ZeRO-3's over 4 data ranks
    ((2, ["--tp", "2", "--zero", "1"]), (4, ["--zero", "3"]), ["--arch", "llama", "--optimizer", "muon"]),
], ids=["hybrid-to-plain", "plain-to-hybrid", "muon-tp2-zero1-to-zero3"])
def test_checkpoint_saved_under_one_sharding_resumes_exactly_under_another(tmp_path, first, second, model):
    argv = [*HYBRID, *model, "--steps", "4"]
    (world_a, flags_a), (world_b, flags_b) = first, second
    a = run_on_ranks(world_a, train_worker, [*argv, *flags_a, "--stop-at", "2", "--out", str(tmp_path / "a")])[0]
    (run,) = (tmp_path / "a").iterdir()
    b = run_on_ranks(world_b, train_worker, [*argv, *flags_b, "--resume", str(run / "checkpoint-00000002"),
                                             "--out", str(tmp_path / "b")], timeout=300)[0]
    assert_matches_oracle(dict(losses=a["losses"] + b["losses"], state_dict=b["state_dict"]), reference_run(argv))


# -- dp.py alone: ZeRO-3 held through a pipeline's micro-batches ------------------------------------------

def held_worker():
    """Two micro-batches under no_sync then one outside it, as a pipeline stage runs them, with
    reshard_after_forward=False: which units hold full weights after each forward and backward."""
    torch.manual_seed(0)
    units = [torch.nn.Linear(6, 6, dtype=torch.float64) for _ in range(3)]
    model = torch.nn.Sequential(*units)
    zero = dp.ZeRO3(model, None, lambda shards: torch.optim.SGD(shards, lr=0.1), units=units,
                    reshard_after_forward=False)
    held = lambda: [unit.weight.untyped_storage().nbytes() > 0 for unit in units]  # noqa: E731
    timeline = []
    for m in range(3):
        loss = model(torch.randn(2, 6, dtype=torch.float64)).square().sum()
        timeline.append(("forward", m, held()))
        with zero.no_sync() if m < 2 else nullcontext():
            loss.backward()
        timeline.append(("backward", m, held()))
    zero.finish_grad_sync()
    with torch.no_grad():  # a forward without backward (evaluation) frees as it goes
        model(torch.randn(2, 6, dtype=torch.float64))
    timeline.append(("no_grad", 0, held()))
    return timeline, dict(zero.comm_bytes), dist.get_world_size()


def test_zero3_held_through_the_step_gathers_and_reduces_each_unit_once():
    for timeline, comm_bytes, world in run_on_ranks(2, held_worker):
        every, none = [True] * 3, [False] * 3
        assert timeline == [("forward", 0, every), ("backward", 0, every), ("forward", 1, every),
                            ("backward", 1, every), ("forward", 2, every), ("backward", 2, none),
                            ("no_grad", 0, none)]
        one_pass = 3 * (6 * 6 + 6) * 8 * (world - 1) // world  # three units of 42 float64, (N-1)/N of each
        assert comm_bytes == dict(reduce_scatter=one_pass, all_gather=2 * one_pass)  # the second: no_grad's
