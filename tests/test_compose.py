"""All five dimensions composed: the benchmark table's configurations, 16 and 32 ranks, resharding, refusals;
in each, every logged memory and traffic counter as tools/plan/ predicts it."""
import os
import subprocess
import sys

import pytest

from training.checkpoint import Checkpoint
from distributed import REPO, run_on_ranks
from oracle import EQUIVALENCE, assert_matches_oracle, oracle, reference_run, train_worker
from planned import assert_matches_plan

# 4 layers (two pipeline stages of two), batch 16 (8 data ranks x 2 micro-batches), two steps.
BASE = [*EQUIVALENCE, "--layers", "4", "--steps", "2", "--batch-size", "16"]
MOE = ["--experts", "4", "--top-k", "2"]
# The Llama-style block: rotary positions, grouped-query attention (the tiny preset's 4 query heads share 2
# key/value heads; 1 where tensor parallelism does not split them), RMSNorm, SwiGLU, no biases; its MoE
# layers add a shared expert and balance with both the auxiliary loss and the routing bias.
LLAMA = ["--arch", "llama"]
LLAMA_MOE = ["--shared-experts", "1", "--balance", "both", "--bias-update-rate", "0.01"]


# The Llama twins train with Muon (training/muon.py), whose matrices each layout cuts its own way and must
# assemble whole; their recomputed runs below keep AdamW.
MUON = ["--optimizer", "muon"]


def llama(flags, model, optimizer=MUON):
    """A configuration's Llama-style twin: (flags, model flags)."""
    kv_heads = [] if "--tp" in flags else ["--kv-heads", "1"]
    return flags, (*LLAMA, *kv_heads, *model, *(LLAMA_MOE if model else ()), *optimizer)



def check(tmp_path, world, flags, model=(), timeout=300):
    """The run equals the single device, and logs the memory and traffic tools/plan/ predicts for it."""
    argv = [*BASE, *model, *flags]
    results = run_on_ranks(world, train_worker, [*argv, "--out", str(tmp_path)], timeout=timeout)
    for result in results:
        assert_matches_oracle(result, oracle([*BASE, *model]))
    assert_matches_plan(tmp_path, argv, world)


# The ten rows of the benchmark table the article reproduces (gpuN_tpX_ppY_cpZ_epW, dp the rest);
# the expert-parallel rows train a mixture of experts.
TABLE = [
    (1, [], ()), (2, [], ()), (4, [], ()), (8, [], ()),
    (8, ["--tp", "2"], ()), (8, ["--pp", "2"], ()), (8, ["--cp", "2"], ()),
    (8, ["--ep", "4"], MOE), (8, ["--tp", "2", "--pp", "2", "--ep", "2"], MOE), (8, ["--tp", "2", "--cp", "2"], ()),
]


def row_name(world, flags):
    return f"gpu{world}_" + "_".join(flags[i][2:] + flags[i + 1] for i in range(0, len(flags), 2))


LLAMA_TABLE = [(world, *llama(flags, model)) for world, flags, model in TABLE]


@pytest.mark.full
@pytest.mark.parametrize("world,flags,model", TABLE, ids=[row_name(w, f) for w, f, _ in TABLE])
def test_benchmark_table_configurations(tmp_path, world, flags, model):
    check(tmp_path, world, flags, model)


@pytest.mark.full
@pytest.mark.parametrize("world,flags,model", LLAMA_TABLE, ids=[row_name(w, f) for w, f, _ in LLAMA_TABLE])
def test_benchmark_table_configurations_llama(tmp_path, world, flags, model):
    check(tmp_path, world, flags, model)


# The Llama twins again with activation recomputation, full and selective in turn: a recomputed block
# communicates again (tp's collectives, ring attention, the all-to-all) and must route as it did.
RECOMPUTED = [(world, [*flags, "--recompute", ("full", "selective")[i % 2]], model)
              for i, (world, flags, model) in enumerate((w, *llama(f, m, optimizer=())) for w, f, m in TABLE)]


@pytest.mark.full
@pytest.mark.parametrize("world,flags,model", RECOMPUTED, ids=[f"{row_name(w, f[:-2])}-{f[-1]}" for w, f, _ in RECOMPUTED])
def test_benchmark_table_configurations_recomputed(tmp_path, world, flags, model):
    check(tmp_path, world, flags, model)


@pytest.mark.full
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_tp2_pp2_cp2_ep2_on_16_ranks(tmp_path, arch):
    flags = ["--tp", "2", "--pp", "2", "--cp", "2", "--ep", "2", "--sp"]
    check(tmp_path, 16, *(llama(flags, MOE) if arch == "llama" else (flags, MOE)), timeout=600)


@pytest.mark.full
@pytest.mark.parametrize("mode", ["allgather", "alltoall"])
def test_tp2_pp2_cp2_ep2_on_16_ranks_by_the_other_ways_of_cp(tmp_path, mode):
    """The same 16 ranks with cp's all-gather or all-to-all (each tp rank's 2 heads split over cp)."""
    flags = ["--tp", "2", "--pp", "2", "--cp", "2", "--ep", "2", "--sp", "--cp-mode", mode]
    check(tmp_path, 16, flags, MOE, timeout=600)


@pytest.mark.parametrize("arch", [pytest.param("gpt", marks=pytest.mark.full), "llama"])  # (llama: the fast tier's)
def test_all_five_dimensions_on_32_ranks(tmp_path, arch):
    """dp=4 tp=2 pp=2 cp=2 and ep=2 (folded over the tp ranks): every dimension above one in the same run."""
    flags = ["--tp", "2", "--pp", "2", "--cp", "2", "--ep", "2"]
    check(tmp_path, 32, *(llama(flags, MOE) if arch == "llama" else (flags, MOE)), timeout=900)


@pytest.mark.full
@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("flags", [["--zero", "1", "--tp", "2"], ["--zero", "3", "--tp", "2", "--sp"],
                                   ["--zero", "1", "--tp", "2", "--pp", "2"]], ids=lambda f: " ".join(f))
def test_zero_with_tensor_parallel(tmp_path, flags, arch):
    world = 8 if "--pp" in flags else 4
    check(tmp_path, world, *(llama(flags, ()) if arch == "llama" else (flags, ())))


@pytest.mark.full
def test_stop_under_tp_pp_ep_resume_under_dp8(tmp_path):
    argv = [*BASE, *MOE, "--steps", "4"]
    first = run_on_ranks(8, train_worker, [*argv, "--tp", "2", "--pp", "2", "--ep", "2", "--stop-at", "2",
                                           "--out", str(tmp_path / "a")], timeout=300)
    checkpoint = tmp_path / "a" / "gpu8_tp2_pp2_cp1_ep2" / "checkpoint-00000002"
    saved = Checkpoint(checkpoint)
    assert saved.step == 2 and set(saved.tensors) == set(oracle([*BASE, *MOE])["state_dict"])  # model.py's layout
    second = run_on_ranks(8, train_worker, [*argv, "--resume", str(checkpoint), "--out", str(tmp_path / "b")],
                          timeout=300)
    for result in second:
        assert_matches_oracle(dict(losses=first[0]["losses"] + result["losses"], state_dict=result["state_dict"]),
                              reference_run(argv))


# Every combination train.py refuses, launched for real: each rank prints why, and the launch ends promptly.
REFUSED = [
    (["--dp-shard", "2"], "--dp-shard 2 shards ZeRO's state within groups of data-parallel ranks: it needs --zero"),
    (["--sp"], "--sp (sequence parallelism) splits the sequence over the tensor-parallel group"),
    (["--ep", "2"], "--ep spreads the experts of MoE layers: it needs --experts"),
    (["--schedule", "interleaved"], "--schedule interleaved and --virtual-stages need pipeline parallelism"),
    (["--cp", "2", "--seq-len", "6"], "--cp 2: --seq-len 6 must divide into 2 x 2 chunks"),
    (["--cp", "2", "--cp-mode", "alltoall", "--arch", "llama", "--kv-heads", "1"],
     "--cp-mode alltoall gives each of --cp 2 ranks whole heads: 4 query and 1 key/value heads"),
    (["--tp", "4"], "world size 2 is not divisible by tp*pp*cp = 4*1*1 = 4"),
    (["--tp", "2", "--arch", "llama", "--kv-heads", "1"],
     "--tp 2: key/value heads 1 does not divide by the tensor-parallel size 2"),
    (["--shared-experts", "1"], "--shared-experts, --balance and --aux-loss-scope shape mixture-of-experts layers: "
                                "they need --experts"),
]


@pytest.mark.full
def test_every_refused_combination_fails_fast_on_every_rank(tmp_path):
    launches = []
    for i, (flags, message) in enumerate(REFUSED):  # all at once: they only parse flags and exit
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "train.py", "--model", "tiny", "--out", str(tmp_path / str(i)), *flags]
        launches.append((subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}), message))
    for process, message in launches:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode != 0
        for rank in range(2):
            assert f"[rank {rank}] train.py: error: {message}" in stderr, stderr[-2000:]
    assert not any(p.is_file() for p in tmp_path.rglob("*")), "a refused launch writes nothing"
