"""The benchmark: the ten configurations of the seed table, and each dimension against PyTorch's built-in.

    python -m tools.bench            # everything, about twenty minutes on 2 CPU cores
    python -m tools.bench --quick    # the same on a tiny model, a few minutes
    python -m tools.bench --arch llama --out results/llama  # the table with the Llama-style block
    python plot.py             # figures and results/results.md from what this wrote

Part 1 runs train.py under torchrun for each configuration (one model, one
global batch, so every row trains on the same tokens) and summarises its
log: steady-state throughput (steps after the first few, validation
excluded), final validation loss, per-rank memory, bytes per dimension, and
where the time went (compute, waiting on communication, pipeline bubble).
Each configuration is also set against the compute-bound ceiling: the
single-rank throughput times min(ranks, cores). Because this machine's speed
drifts, the 2-rank data-parallel efficiency is measured once more on its
own, alternating one rank and two in a few rounds (`scaling_check`).

Part 2 times this repository's implementation of a dimension and the
PyTorch built-in that does the same job, alternately, in the same processes,
on the same model and data: dp.py against DistributedDataParallel, ZeRO-3
against FSDP2's fully_shard, tp.py against DTensor's parallelize_module,
pp.py's 1F1B and GPipe against torch.distributed.pipelining. Each reports
the median step time of both, the median and range of their per-round
ratios, and the largest difference of their losses (they compute the same
thing).

Everything is written to results/: runs/<name>/ and scaling/ (train.py's
logs), summary.json, comparisons.json, machine.json (with the scaling check).

Beside them are parts of their own, each also run alone by `--only NAME` (see
--help), among them 'zero_pipeline': ZeRO-3 beside ZeRO-1 under 1F1B (train.py
--pp 2 --zero 1 and --zero 3 on 4 ranks, dp 2: the same model, ranks and batch,
the two runs in turn in each round in the same processes, the order rotated):
the median and range of the per-round step-time ratios, each rank's peak
resident memory and logged parameter, gradient and optimizer bytes, and the
bytes each rank sent per step by dp's reduce-scatter, all-gather and all-reduce
and by pp's sends (results/zero_pipeline.json; a table in results.md); 'muon':
train.py --optimizer muon beside AdamW on one rank, on 4 ranks with --zero 1 and
with --zero 3 --tp 2, and there Muon's two assemblies (--muon-assembly owner and
gather), all stepped in turn in each round in the same processes: the whole step's
and the optimizer step's time (medians and ranges of per-round ratios), the
optimizer state and the bytes Muon's all-to-alls sent per step
(comm_optim_all_to_all_bytes) by rank (results/muon.json; a table in results.md);
'muon_convergence': a learning-rate sweep of each optimizer on the synthetic
language, the best final validation loss of each (results/muon_convergence.json;
plot.py draws muon_convergence.png).

Part 3, run alone with `--soak` (about half an hour), is about reliability,
not speed: every dimension file's self-check and a composed launch of
train.py, twenty times each in a row, must never fail; and a run whose
workers are killed every few dozen steps under `torchrun --max-restarts`
must end with exactly the weights of the same run uninterrupted
(results/soak.json).

The modules, one a part of the benchmark:
    common.py         what the parts share: FULL and QUICK, torchrun launches, logs and results, paired ratios
    table.py          Part 1: the table's configurations (CONFIGS), the scaling check, the recomputation modes
    documents.py      'documents': document masking and windows against plain causal attention, long sequences
    planner.py        'planner': tools/plan/figure.py's strategies, measured
    pipeline.py       'pipeline': the five schedules' bubbles and timelines, ZB-V beside PyTorch's
    precision.py      'precision': bfloat16 before and after its mixed-precision policy
    comparisons.py    Part 2: each dimension beside PyTorch's built-in (the --worker launches)
    attention.py      'attention': cp.py's ways of attending over a long sequence, memory and time by length
    checkpoints.py    'checkpoint': sharded against consolidated checkpoints
    zero_pipeline.py  'zero_pipeline': ZeRO-3 beside ZeRO-1 under 1F1B
    muon.py           'muon' and 'muon_convergence': Muon beside AdamW, its two assemblies, its sweeps
    soak.py           Part 3: the soak
    command.py        the command line (python -m tools.bench runs its main) and a worker's side of a launch
The names other files use are imported here (`from tools import bench; bench.QUICK`).
"""
from tools.bench.checkpoints import ConsolidatedFile, fingerprint, save_consolidated
from tools.bench.command import main
from tools.bench.common import QUICK
from tools.bench.muon import worker_muon
from tools.bench.soak import worker_pids
from tools.bench.table import CONFIGS

__all__ = ["CONFIGS", "ConsolidatedFile", "QUICK", "fingerprint", "main", "save_consolidated", "worker_muon",
           "worker_pids"]
