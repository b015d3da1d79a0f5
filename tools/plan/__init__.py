"""Predict what a run of train.py would hold and send, per rank, without running it.

    python -m tools.plan --world 8 --tp 2 --pp 2 --ep 2 --experts 8 --micro-batches 4
    python -m tools.plan --model llama3-405b --arch llama --world 16384 --tp 8 --pp 16 --zero 1 ...
    python -m tools.plan --model llama3-8b --arch llama --world 64 --memory 80GiB --search

It takes train.py's own flags, plus the number of ranks (`--world`), and
predicts per rank the four memory figures and the traffic that train.py logs
(`log.jsonl`'s `param_bytes`, `grad_bytes`, `optim_bytes`,
`activation_peak_bytes` and `comm_<dim>_<kind>_bytes`). `--json` prints them
under those names, as lists indexed by rank; tests/test_plan.py runs
train.py and checks that every counter equals its prediction.

Where the numbers come from:
- Parameter shapes are model.py's own: the model is built on PyTorch's
  "meta" device (shapes without memory), so the planner cannot drift from it.
- How the dimensions split them is written out in parameters.py, one rule per dimension
  (tensor: by the rules of tp.py; pipeline: pp.py's stage split; expert:
  E/ep experts per rank, each split over expert-tp as tp.py splits an MLP),
  and so are the buckets data parallelism and ZeRO pack them into (buckets.py:
  padded to a multiple of the group, as dp.py pads them).
- Experts are folded over each pipeline stage's dp x cp x tp ranks
  (mesh.py): ep and expert-tp do not multiply the world, the world is
  dp x pp x cp x tp and dp is also the number of data ranks. The MoE layers
  read a stage's ranks as expert_dp x ep x expert_tp: expert gradients are
  averaged (and ZeRO shards them) over the expert_dp ranks holding the same
  expert shard, dense gradients over dp x cp. Every rank of a stage routes
  tokens of its own (under tp without sp its 1/tp of the tokens the tp
  ranks share), and the rows ep.py moves (dispatch and combine over ep,
  the token split over tp, expert-tp's gather and reduce-scatter) are all
  logged as ep's all-to-all.
- Memory per parameter follows the article's accounting (params, grads,
  AdamW's two moments; ZeRO-1/2/3 divide them by the data-parallel size),
  in the dtypes of train.Precision: under bfloat16, 18 bytes a parameter
  without ZeRO (2 for the bf16 weights, 4 for their float32 master copy,
  4 for the float32 gradient buckets, 8 for the moments): the article's 16
  with float32 gradients, as Megatron-LM's main_grad keeps them.
- ZeRO's collectives per step (dp.py): ZeRO-2 and 3 reduce-scatter in every
  backward without a pipeline (M times for M micro-batches; ZeRO-3 gathers
  each unit before its forward and before its backward, 2M times), but once
  under one (--pp > 1: the pipeline defers the reduction to each chunk's last
  backward, and ZeRO-3 keeps a unit gathered from its first forward to it,
  one all-gather). Under a pipeline a stage therefore holds its full
  gradient buckets (ZeRO-2 and 3) and full weights (ZeRO-3) through the
  step's backwards, which the step's peak counts.
- Hybrid sharding (--dp-shard N): ZeRO shards over N of the dp ranks (with
  cp for the dense parameters, as without it; the experts over their
  expert_dp ranks of one copy) and the dp/N groups hold copies; each reduction
  of a shard group is followed by an all-reduce of the shard over the copies
  ("dense_replicas", "expert_replicas" in the traffic, logged under dp, which
  `--search` counts across nodes when the copies are on other nodes).
- Muon (--optimizer muon, training/muon.py): for each optimizer (ZeRO's
  dense, tied and expert instances, or the one without ZeRO) the planner
  lays out every rank's pieces as the optimizer holds them (the buckets and
  shards above, tp's and expert-tp's bands, each expert under its ep rank's
  name, each copy numbered as train.with_muon numbers it) and hands them to
  muon.held_segments, muon.assign_owners and muon.bytes_sent, the functions
  the run itself calls: the owners, and each rank's bytes in the two
  all-to-alls over its stage ("optim", in the weights' dtype), are the
  run's. The matrices' pieces keep one momentum where AdamW keeps two
  moments; the step's working set (the look-ahead U, the all-to-alls'
  buffers, the matrices an owner assembles and their orthogonalised
  copies, Newton-Schulz's temporaries) counts in the step's peak, which
  stands for its stage at the rank holding most.
- Traffic counts what each collective sends as a ring algorithm does, as
  the runs count it: an all-reduce of n bytes over N ranks sends 2(N-1)/N n,
  a reduce-scatter or an all-gather (N-1)/N n; point-to-point and
  all-to-all what leaves the rank.
- Activations are the tensors autograd saves for backward, modelled per
  token and layer from what model.py's operators save (Korthikanti et al.,
  2022, count them the same way for Megatron's block), per attention kind
  (attention_of: CausalSelfAttention's grouped heads, DeepSeek's latent
  attention; cp.py's cores keep what a fused kernel keeps on every
  device). Mixture-of-experts traffic and activations assume
  balanced routing (each expert gets its fair share of every rank's tokens).

- Peak resident memory (`predict_peaks`, the last line of the table, and
  `--json`'s `*_peak_bytes`): of start-up, of a step, of a checkpoint's save
  and of its load, as a process on the CPU holds them: the state above,
  plus what each phase holds for a while (ZeRO-3's units gathered, the
  gradient norm's float64 squares, a checkpoint's pieces copied aside to be written, the
  chunks initial values are drawn and checkpoints read in) and the
  interpreter and PyTorch themselves (PROCESS_BYTES). On a GPU the
  interpreter stays on the host and so does a save's copy.

`--search` lists the layouts of `--world` ranks whose every GPU's peak
fits `--memory`, with their traffic inside a node and across nodes
(`--gpus-per-node`, ranks laid out as mesh.py lays them: tp fastest, then
cp, pp, dp, dp read as (copies, shards) under hybrid sharding; the experts'
groups folded over each stage's ranks, expert-tp fastest, then ep; an
all-to-all sending each peer as much, ep's, split by where the peers are;
the stage sending most across standing for the layout), hybrid
ones among them (ZeRO's shard group no larger than a node). With experts it
tries every ep dividing both the experts and a stage's ranks, with experts
whole (expert-tp 1) or split as tp splits the dense layers (expert-tp = tp).
Under Muon it plans each candidate's assembly as above, save those that
cannot fit whatever it holds and those whose stages hold too many pieces to
assign here (MUON_SEARCH_PIECES), which it counts.

The modules, each a section of the planner, in the order each builds on the ones before it (the first four
in training/count/, which train.py's check of the parameters' memory uses too, before anything is allocated):
    layout.py       the Layout train.py's flags make (layout_of), and where a rank sits in its grid
    parameters.py   which parameters a rank holds, and how many elements of each (model.py's shapes)
    buckets.py      dp.py's gradient buckets and ZeRO-3's units, padded to a multiple of the group
    memory.py       a set of parameters' weights, gradients and optimizer state, and dp/ZeRO's traffic
    muon.py         --optimizer muon: each rank's pieces as training/muon.py's Segments, and its owners
    attention.py    what each kind of attention saves for backward, and what tp sums or moves of it
    traffic.py      tp's, cp's, the MoE layers' and pp's bytes per micro-batch
    activations.py  what a block and the model's edges save for backward, and its peak under a schedule
    prediction.py   every rank's figures under log.jsonl's names (predict, predict_stage)
    peak.py         peak resident memory of start-up, a step, a checkpoint's save and load (predict_peaks)
    figure.py       the playbook's figure: each strategy alone, by sequence length (planner.json's, for plot.py)
    nodes.py        which traffic stays inside a node and which crosses nodes
    search.py       --search: the layouts that fit --memory, least traffic across nodes first
    command.py      the command line: the table, --json, --search (python -m tools.plan runs its main)
The names other files use are imported here (`from tools import plan; plan.predict(...)`); each is defined in
the module its import below names.
"""
from tools.plan.activations import block_activations
from tools.plan.attention import attention_of
from tools.plan.command import main, parse_args
from tools.plan.figure import EXPERTS, STRATEGIES, busiest_memory, planned_memory, predicted_for, strategy_argv
from training.count.layout import Layout, coordinates, first_of_stage, layout_of, stage_place
from training.count.memory import largest_parameter_bytes
from tools.plan.muon import muon_held
from tools.plan.nodes import TRAFFIC_GROUPS, ExpertNodes, crosses_nodes, expert_nodes, group_members, node_split
from training.count.parameters import config_key, model_parameters, rank_parameters, tp_sharded
from tools.plan.peak import PROCESS_BYTES, predict_peaks
from tools.plan.prediction import predict, predict_stage
from tools.plan.search import candidate_layouts, search
from training import cli

__all__ = [
    "EXPERTS", "PROCESS_BYTES", "STRATEGIES", "TRAFFIC_GROUPS", "ExpertNodes", "Layout", "attention_of",
    "block_activations", "busiest_memory", "candidate_layouts", "cli", "config_key", "coordinates",
    "crosses_nodes", "expert_nodes", "first_of_stage", "group_members", "largest_parameter_bytes", "layout_of",
    "main", "model_parameters", "muon_held", "node_split", "parse_args", "planned_memory", "predict",
    "predict_peaks", "predict_stage", "predicted_for", "rank_parameters", "search", "stage_place",
    "strategy_argv", "tp_sharded",
]
