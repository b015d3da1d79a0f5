"""Train the GPT of model.py on any mix of parallel dimensions.

    torchrun --nproc_per_node 2 train.py                 # data parallel on 2 ranks
    python train.py --model tiny --steps 50              # one process

The order of events is the order of the article: flags (training/cli.py) -> rank grid (mesh.py) -> the
model's shapes on the meta device (model.py) -> `parallelize`: the parallel dimensions applied, then
only this rank's share allocated and filled (every initial value is a function of its position, so it
equals the single device's) -> the training loop. Every global batch is a pure function of (seed, step)
(training/data.py) and is split over data ranks and micro-batches, so every configuration trains on
the same tokens and must produce the same losses as one device.

This file reads top to bottom: `train` (the loop), `parallelize` (the five dimensions, one call each, in a
fixed order: "Putting It All Together"), `Trainer` (one step), each dimension's call, what each rank holds
(`Share`), what the step drives the same way whatever the layout (gradient averaging, the micro-batch
runner), then the helpers.

Each run writes runs/<name>/config.json, runs/<name>/log.jsonl (one JSON record per step) and
runs/<name>/checkpoint-<step>/ (sharded: each rank writes the pieces it holds, while training goes on;
any layout resumes from it; see training/checkpoint.py). `--resume auto` continues from the newest good
one, so the same command line serves the first launch and every restart; SIGTERM or SIGINT stops every
rank after the same step, with a checkpoint (training/launch.py).
"""
import json
import math
import os
import sys
import time
from collections import Counter
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

import cp
import ep
import pp
import tp
from dp import (ZERO_STAGES, DataParallel, ReplicatedOptimizer, clip_grad_norm_, gpt_lend, gpt_units,
                ring_bytes_sent, unallocated)
from mesh import Mesh, coordinates
from model import (GPT, IGNORE, apply_recomputation, document_ids, document_targets, end_moe_step, fill_in_chunks,
                   initial_values, tied_name)
from training import checkpoint, flight, fp8, hf, integrity, mfu, muon, stragglers, tensorfile
from training.dashboard import Dashboard, NoDashboard
from training.cli import DTYPES, ConfigError, check_args, check_tokens, describe_data, document_eos, parse_args
from training.count.memory import largest_parameter_bytes
from training.data import open_data
from training.determinism import make_deterministic
from training.flex import FlexAttentionCore
from training.launch import (Preemption, exit_with_error, first_problem, in_collective, init_distributed,
                             rank_and_world, where)
from training.meter import (ActivationMeter, device_memory_bytes, device_peak_bytes, optimizer_bytes,
                            parameter_bytes, peak_resident_bytes, resident_bytes, tensor_bytes)
from training.profile import StepProfiler
from training.tensorfile import DamagedFile

COMM_KINDS = {  # the collectives each dimension issues; logged as comm_<dim>_<kind>_bytes
    "dp": ("all_reduce", "all_gather", "reduce_scatter"),
    "tp": ("all_reduce", "all_gather", "reduce_scatter"),
    "pp": ("send_recv", "all_reduce"),
    "cp": ("send_recv", "all_gather", "reduce_scatter", "all_to_all"),
    "ep": ("all_to_all",),
    "optim": ("all_to_all",),  # Muon's assembly of matrices (training/muon.py)
    "fp8": ("all_reduce",),    # the float8 scales' maxima over the groups splitting a layer (training/fp8.py)
}
COMM_FIELDS = tuple(f"comm_{dim}_{kind}_bytes" for dim, kinds in COMM_KINDS.items() for kind in kinds)
LOG_FIELDS = ("loss", "grad_norm", "stop_requested", "param_bytes", "grad_bytes", "optim_bytes",
              "activation_peak_bytes", "peak_resident_bytes", "device_peak_bytes", "compute_s", "comm_wait_s",
              "collective_s", "pp_bubble", "pp_peak_in_flight", "flops_per_token", "process_bytes") + COMM_FIELDS


class NonFiniteStep(ArithmeticError):
    """A step whose loss or gradient norm is not finite, beyond what --skip-nonfinite-steps allows."""


# ---------------------------------------------------------------------------
# The training loop
# ---------------------------------------------------------------------------

def train(args):
    """Run the training described by args; returns the losses and the trainer (its state.full_state_dict()
    gathers the final weights, a collective: for tests and tools, never done by a run itself). Each rank
    records its collectives meanwhile, and writes the record into the run folder if the run fails
    (training/flight.py; python -m tools.diagnose reads it)."""
    with flight.recording(args.record_collectives) as recorder:
        return run_training(args, recorder)


def run_training(args, recorder):
    rank, world = rank_and_world()
    described = describe_data(args)  # the data's meta.json, read once: the checks and the data opened take it
    config, shape = check_args(args, world, described)  # before any process group exists: a bad launch cannot hang
    check_memory(args, world, config, described)  # and before anything is allocated
    if args.resume not in (None, "auto"):
        checkpoint.complete(args.resume)  # its files' SHA-256 are checked by every rank together, below
    deterministic = make_deterministic(torch.cuda.is_available()) if args.deterministic else None  # (before NCCL)
    if deterministic == {} and rank == 0:
        print("--deterministic: on CPUs a run repeats bit for bit already; nothing to set", flush=True)
    device = init_distributed(timedelta(seconds=args.timeout))
    # Checkpoints are written on a thread of their own, with a group of their own (see checkpoint.Saver).
    saver = checkpoint.Saver(dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout)))
    args.resume = resume_from(args, world, saver.group, report=print if rank == 0 else lambda message: None)
    if args.init_from and not args.resume:
        check_folder(args.init_from, config, saver.group)
    mesh = Mesh(shape, timeout=timedelta(seconds=args.timeout))
    data = open_data(described, seed=args.seed)
    check_tokens(data, rank, world)
    trainer = Trainer(args, config, mesh, data, device)
    log = RunLog(args, world, device, trainer, writes=rank == 0)
    log.begin(shape, data, deterministic)
    recorder.folder = log.folder  # where a failing rank writes its record of collectives
    end, stopped = min(args.steps, args.stop_at or args.steps), False
    last_checkpoint = args.resume  # the newest good one: where a run stopped by bad numbers can go back to
    with Preemption() as preemption, StepProfiler.from_args(args, log.folder, rank, device) as profiler, \
            trainer.collectives:  # (its time inside collectives, each step: training/stragglers.py)
        for step in range(trainer.start_step, end):
            profiler.start(step)  # --profile's steps alone are traced, to profiler.stop; without it, nothing
            recorder.step = step
            timeline = args.pp > 1 and step == end - 1  # the pipeline's timeline, of one step: the last
            record = gather_records(dict(trainer.train_step(step, timeline), stop_requested=preemption.requested))
            if any(record.pop("stop_requested")):  # every rank learns it at the same step: all stop together
                end, stopped = step + 1, True
                recorder.dump("stopped by a signal (SIGTERM or SIGINT)")
            last = step == end - 1
            entry = log.entry(step, record, trainer.timeline if timeline else None)
            problem = nonfinite_problem(step, record, trainer.skipped_steps, args)
            if (step + 1) % args.eval_interval == 0 or last:
                entry["val_loss"] = log.val_losses[step] = trainer.validation_loss()
            log.write(entry, last)  # before the checkpoint, so every step a checkpoint has passed is in the log
            if problem:  # every rank has the same record, so every rank stops here
                saver.wait()  # the save in flight is of a good step: the last good checkpoint, once written
                raise NonFiniteStep(f"{problem}; the last good checkpoint is {last_checkpoint or 'none'}")
            if args.checkpoint_interval and (step + 1) % args.checkpoint_interval == 0 or last:
                last_checkpoint = checkpoint.path_for(log.folder, step + 1)
                trainer.save_checkpoint(saver, last_checkpoint, step + 1, args.keep_checkpoints)
            profiler.stop(step)
            trainer.reset_comm_baseline()
            if stopped:
                break
    saver.wait()  # the run ends with its last checkpoint on the disk
    log.end(gather_peaks(device), f"stopped after step {end - 1} on a signal; checkpoint {last_checkpoint}"
            if stopped else None)
    return dict(losses=log.losses, grad_norms=log.grad_norms, val_losses=log.val_losses,
                entropy_floor=data.entropy_rate, trainer=trainer)


# ---------------------------------------------------------------------------
# parallelize: the model -> this rank's share of it, one dimension at a time
# ---------------------------------------------------------------------------

@dataclass
class Parallelized:
    """What training needs to know of the dimensions `parallelize` applied."""
    moe_layers: list                # every MoE layer (ep.py's), in order; a pipeline stage runs only its own
    tp_layouts: dict                # {parameter name: (dim, blocks)} of those tensor parallelism split
    positions: torch.Tensor | None  # this rank's token positions under context parallelism (None: all)
    chunks: list | None             # this rank's model chunks under pipeline parallelism (None: the model)
    optimizers: list                # dp.py's ZeRO instances, or one ReplicatedOptimizer: the same interface
    grad_sync: "GradientSync"       # the data-parallel averaging of the gradients
    tied: "TiedOutputLayer"         # the sum of a tied output layer's gradients over the pipeline's ends
    share: "Share"                  # what this rank holds of each parameter, as positions in the full tensor


def parallelize(model, mesh, args, values, device, precision):
    """Apply the parallel dimensions to `model`, built on the meta device, in place, for this rank of `mesh`;
    then allocate this rank's share of it on `device` and fill it from `values` (InitialValues, SavedValues).
    """
    # The article explains data, tensor, pipeline, context (sequence) and expert parallelism in that order;
    # they are applied in another, each rewriting what the one before left: experts are placed first (tensor
    # parallelism then splits the experts this rank holds), tensor and context parallelism rewrite the
    # layers inside every block, the pipeline then keeps this rank's blocks (passing them context
    # parallelism's positions), recomputation wraps what this rank will run, and data parallelism comes
    # last, since it averages, or shards (ZeRO), whatever parameters this rank is left with. Until then the
    # model is on the meta device (shapes without memory): nothing is allocated that this rank will not hold.
    #
    # "Expert Parallelism": each rank keeps E/ep experts of every MoE layer; tokens reach them by all-to-all.
    moe_layers = expert_parallel(model, mesh, args)
    # "Tensor Parallelism" (and "Sequence Parallelism, Flavor 1"): weight matrices split over the tp group,
    # the experts' over the expert-tp group.
    tp_layouts = tensor_parallel(model, mesh, args, moe_layers)
    # "Sequence Parallelism, Flavor 2: Ring Attention": a zigzag shard of the sequence; attention in a ring.
    positions = context_parallel(model, mesh, args, device)
    # "Pipeline Parallelism": this rank keeps its stage's layers (V chunks of them with interleaving).
    chunks = pipeline_parallel(model, mesh, args, positions)
    # Not a dimension: float8 products, compiled blocks, and activation recomputation around what runs (ring
    # attention too).
    if args.fp8:
        fp8.apply_fp8(model, args.fp8)
    if args.compile:
        compile_blocks(model)
    apply_recomputation(model, args.recompute)
    # What this rank holds now exists: allocated on its device and filled (under ZeRO-3 only the shards,
    # which ZeRO-3 fills itself).
    share = Share(tp_layouts, mesh, values, device, precision.master, model.config)
    share.materialize(model, fill=args.zero != 3)
    # "Data Parallelism", then "ZeRO": gradients averaged over the ranks holding the same parameters.
    optimizers, grad_sync, tied = data_parallel(model, mesh, args, moe_layers, share, precision)
    return Parallelized(moe_layers, tp_layouts, positions, chunks, optimizers, grad_sync, tied, share)


# ---------------------------------------------------------------------------
# The run's log
# ---------------------------------------------------------------------------

class RunLog:
    """runs/<name>/: config.json, and log.jsonl with one record per step, written by rank 0 (elsewhere
    `writes` is False: the same calls write nowhere and print nothing); every rank keeps the losses."""

    def __init__(self, args, world, device, trainer, writes):
        self.args, self.world, self.device, self.trainer = args, world, device, trainer
        self.folder = os.path.join(args.out, run_name(args, world))
        self.writes, self.print = writes, print if writes else lambda *_, **__: None
        self.losses, self.grad_norms, self.val_losses, self.wall_s = [], [], {}, 0.0
        # Model FLOPs utilisation: the FLOPs the model needs per token (training/mfu.py) times tokens per
        # second, over every device's peak.
        self.peak_flops, self.peak_kind = mfu.peak_flops(args, device)
        self.waited_for = []  # each step's ranks their peers waited for (training/stragglers.py)

    def begin(self, shape, data, deterministic=None):
        """config.json (with --deterministic what it set: training/determinism.py), and the log kept up to the
        step the run starts at (a resumed run writes those after its checkpoint again: one record per step)."""
        if not self.writes:
            self.file, self.dashboard = open(os.devnull, "w"), NoDashboard()
            return
        os.makedirs(self.folder, exist_ok=True)
        trainer, args = self.trainer, self.args
        with open(os.path.join(self.folder, "config.json"), "w") as f:
            json.dump(dict(args=vars(args), mesh=asdict(shape), model=asdict(trainer.model.config),
                           world=self.world, device=str(self.device), peak_flops=self.peak_flops,
                           peak_kind=self.peak_kind,
                           entropy_floor=data.entropy_rate, deterministic=deterministic), f, indent=2)
        floor = f"{data.entropy_rate:.4f} nats/token" if data.entropy_rate else "unknown (real data)"
        self.print(f"run {self.folder}: {self.world} ranks {shape}, {trainer.n_params:,} parameters, "
                   f"loss floor (entropy rate) {floor}", flush=True)
        path = os.path.join(self.folder, "log.jsonl")
        keep_log_before(path, trainer.start_step if args.resume else 0)
        self.file = open(path, "a")
        self.dashboard = Dashboard(self.folder) if args.tensorboard else NoDashboard()

    def entry(self, step, record, timeline=None):
        """The log record of a step, from every rank's values (lists indexed by rank); with the pipeline's
        timeline per rank: [kind, chunk, micro-batch, waiting from, computing from, until] (seconds)."""
        entry = log_entry(self.args, step, record, self.wall_s, self.trainer)
        if timeline is not None:
            entry["pp_timeline"] = [None] * self.world
            dist.all_gather_object(entry["pp_timeline"], timeline)
        if self.peak_flops:
            entry["mfu"] = entry["flops_per_token"] * entry["tokens_per_s"] / (self.world * self.peak_flops)
            entry["mfu_of"] = self.peak_kind  # the peak it is a fraction of: float8's under --fp8
        self.wall_s = entry["time_s"]
        self.waited_for.append(entry["stragglers"])
        self.losses.append(entry["loss"])
        self.grad_norms.append(entry["grad_norm"])
        return entry

    def write(self, entry, last):
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()
        self.dashboard.write(entry)
        if entry["step"] % self.args.log_interval == 0 or last or "val_loss" in entry:
            self.print(progress_line(entry, self.args), flush=True)

    def end(self, peaks, stopped):
        """The whole run's peak memory per rank (start-up, steps and saves), and why it stopped early, if it did."""
        kind = "GPU" if self.device.type == "cuda" else "resident"
        self.print(f"peak {kind} memory per rank (GiB): " + " ".join(f"{b / 2**30:.2f}" for b in peaks), flush=True)
        straggler = stragglers.report(self.waited_for)
        if straggler:
            self.print(straggler, flush=True)
        if stopped:
            self.print(stopped, flush=True)
        self.file.close()
        self.dashboard.close()


# ---------------------------------------------------------------------------
# One training step
# ---------------------------------------------------------------------------

class Trainer:
    """The model with its parallel dimensions applied, its optimizers, and one training step."""

    def __init__(self, args, config, mesh, data, device):
        self.process_bytes = resident_bytes()  # before it builds anything: the interpreter, PyTorch, its groups
        self.args, self.mesh, self.data, self.device = args, mesh, data, device
        self.packing = packing_of(document_eos(args, data=data.info))
        precision = Precision.from_args(args)
        # The full model's shapes, on the meta device: no memory until parallelize keeps this rank's share.
        with torch.device("meta"):
            self.model = precision.apply(GPT(config))
        self.n_params = sum(p.numel() for p in self.model.parameters())
        saved = checkpoint.Checkpoint(args.resume) if args.resume else None
        if saved:
            same_optimizer(saved, args)
        # The Hugging Face config a run started from, kept in its checkpoints for the Hugging Face export.
        self.hf_config = (saved.manifest.get("hf_config") if saved
                          else hf.with_layers(hf.read_config(args.init_from), config.n_layer) if args.init_from
                          else None)
        parallel = parallelize(self.model, mesh, args, starting_values(args, config, saved), device, precision)
        self.params, self.tp_layouts, self.share = list(self.model.parameters()), parallel.tp_layouts, parallel.share
        self.optimizers, self.grad_sync, self.tied = parallel.optimizers, parallel.grad_sync, parallel.tied
        self.routing, self.moe_layers = RoutingCounts(parallel.moe_layers, config.n_experts), parallel.moe_layers
        self.runner = micro_batch_runner(parallel, self.model, mesh, args, self.forward_context, device)
        self.state = RankState(self.model, self.optimizers, self.share, self.tp_layouts, mesh)
        self.start_step, self.skipped_steps = 0, 0
        if saved:
            self.state.load_optimizer_state(saved)
            self.start_step, self.skipped_steps = saved.step, saved.skipped_steps
        self.meter = ActivationMeter(self.params)
        # Each rank's pipeline stage: the ranks of a stage do the same work (training/stragglers.py)
        self.stage_of = [coordinates(mesh.shape, rank)["pp"] for rank in range(dist.get_world_size())]
        self.collectives = stragglers.CollectiveClock(device, mesh.groups.values())  # counts once installed
        self.reset_comm_baseline()

    def train_step(self, step, timeline=False):
        """One optimizer step over the global batch; returns this rank's log values. With `timeline`, the
        pipeline records when each action waited and ran (self.timeline)."""
        micro_batches, loss_tokens, first_keys = self.batch("train", step)
        self.meter.reset_peak()
        clock = StepClock(self.device, timeline, self.collectives)
        for optimizer in self.optimizers:
            optimizer.zero_grad()
        self.routing.reset()
        contribution = self.runner.train(micro_batches, clock.pipeline, loss_tokens)  # this rank's share of the loss
        with clock.waiting():
            self.grad_sync.finish_grad_sync()
            self.tied.sum_gradients()
        grad_norm = self.update(step)
        for moe in self.moe_layers:  # (only they: a walk of the whole model's modules costs 2% of a small step)
            end_moe_step(moe)  # from the step's tokens per expert, the same on every rank
        self.routing.sum_over_stages(self.runner)
        compute_s, comm_wait_s, collective_s = clock.stop()
        self.timeline = clock.pipeline.timeline() if timeline else None
        return dict(self.rank_record(contribution, compute_s, comm_wait_s, clock.pipeline), grad_norm=grad_norm,
                    collective_s=collective_s, flops_per_token=mfu.flops_per_token(self.model.config, first_keys,
                                                                                   self.args.seq_len))

    def update(self, step):
        """The step's learning rate, the gradients clipped, and the update (ZeRO: of this rank's shards, then
        the parameters gathered); returns the gradient norm. The norm is the same on every rank, so they all
        update, or all skip a step whose gradient is not finite (the weights and AdamW's moments stay as
        they were; train() decides whether to go on)."""
        for group in (group for optimizer in self.optimizers for group in optimizer.optimizer.param_groups):
            group["lr"] = lr_at(step, self.args)
        with torch.profiler.record_function("clip"):  # a range named in --profile's traces
            grad_norm = self.clip_gradients(self.args.grad_clip or math.inf).item()
        update = self.updates(grad_norm)
        self.skipped_steps += not update
        with torch.profiler.record_function("optimizer"):
            for optimizer in self.optimizers if update else ():
                optimizer.step()
        return grad_norm

    @staticmethod
    def updates(grad_norm):
        """Whether a step with this gradient norm updates the weights: not if it is not finite."""
        return math.isfinite(grad_norm)

    def batch(self, split, index):
        """This rank's micro-batches of the global batch `index` of `split` (a pure function of them, so every
        layout reads the same tokens), and what each shard divides its summed loss by: counted on the CPU,
        before the tokens go to the device, so the step waits for no copy back."""
        shape = (split, index, self.args.batch_size, self.args.seq_len)
        tokens = self.data.batch(*shape)
        targets = counted_targets(tokens, self.data.loss_mask(*shape))
        return (self.local_micro_batches(tokens.to(self.device), targets.to(self.device)),
                self.packing.loss_tokens(tokens, targets, self.n_shards), self.packing.first_keys(tokens))

    def local_micro_batches(self, tokens, targets):
        """This rank's (inputs, targets, documents) per micro-batch: its data slice, and its sequence shard
        under cp (documents, the whole sequence's, are not sharded: attention asks about any token's)."""
        mesh = self.mesh
        batches = local_micro_batches(tokens, self.args.micro_batches, mesh.size("dp"), mesh.index("dp"), targets)
        batches = [self.packing.split(inputs, targets) for inputs, targets in batches]
        if mesh.size("cp") == 1:
            return batches
        own_chunks = lambda t: cp.shard_sequence(t, mesh.size("cp"), mesh.index("cp"))  # noqa: E731
        return [(own_chunks(inputs), own_chunks(targets), documents) for inputs, targets, documents in batches]

    @property
    def n_shards(self):
        """The pieces the global batch is cut into, whose losses (and gradients) are averaged: micro-batches,
        data slices, sequence shards."""
        return self.args.micro_batches * self.mesh.size("dp") * self.mesh.size("cp")

    def forward_context(self):
        """Around every forward: count the activations saved for backward."""
        return self.meter

    def clip_gradients(self, max_norm):
        """Clip to the norm of the whole model's gradient, every element counted once; returns the norm.

        After synchronisation, data-parallel replicas hold identical gradients, so every rank sees the
        whole of each element it holds (ZeRO: of its shards, summed over each instance's group). The ranks
        of a pipeline stage hold different pieces of the parameters (tp's slices, ep's experts and
        expert-tp's slices of them) or copies of the same: summing over the stage and the pipeline, with
        each gradient weighted 1/copies, counts every element once.
        """
        weights = {p: 1 / self.copies(name) for name, p in self.model.named_parameters()}
        groups = [self.mesh.groups[g] for g in ("stage", "pp") if self.mesh.size(g) > 1]
        return clip_grad_norm_(self.optimizers, max_norm, weights, groups)

    def copies(self, name):
        """How many ranks of the stage and pipeline hold the same elements of parameter `name` (1: each its own)."""
        pieces = self.share.parts(name) * (self.mesh.size("ep") if ep.is_expert_parameter(name) else 1)
        return self.mesh.size("stage") // pieces * self.tied.copies(name)

    @torch.no_grad()
    def validation_loss(self):
        """Mean cross-entropy over --eval-batches held-out global batches (no MoE auxiliary loss)."""
        args, losses = self.args, []
        for i in range(args.eval_batches):
            # The same micro-batches as training, so a pipeline sees the shapes it was built for.
            micro_batches, loss_tokens, _ = self.batch("val", i)
            losses += self.runner.evaluate(micro_batches, loss_tokens)
        return mean_over_ranks(losses)

    # -- what the log counts -----------------------------------------------------

    def comm_counters(self):
        """Cumulative bytes sent by this rank, per (dimension, collective kind)."""
        sources = {"dp": self.grad_sync.comm_bytes, "tp": tp.comm_bytes,
                   "pp": {"send_recv": self.runner.bytes_sent, "all_reduce": self.tied.bytes_sent},
                   "cp": cp.comm_bytes, "ep": ep.comm_bytes, "optim": muon.comm_bytes, "fp8": fp8.comm_bytes}
        return {f"comm_{dim}_{kind}_bytes": sources[dim].get(kind, 0)
                for dim, kinds in COMM_KINDS.items() for kind in kinds}

    def reset_comm_baseline(self):
        """Count from here (so a step's record leaves out validation and checkpoint traffic)."""
        self.comm_baseline = self.comm_counters()

    def rank_record(self, loss, compute_s, comm_wait_s, pipeline):
        param_shards = [shard for optimizer in self.optimizers for shard in optimizer.param_shards]
        grad_shards = [shard for optimizer in self.optimizers for shard in optimizer.grad_shards]
        record = dict(loss=loss, param_bytes=parameter_bytes(self.params + param_shards),
                      grad_bytes=tensor_bytes([p.grad for p in self.params] + self.grad_sync.buffers + grad_shards),
                      optim_bytes=sum(optimizer_bytes(optimizer.optimizer) for optimizer in self.optimizers),
                      activation_peak_bytes=self.meter.peak, peak_resident_bytes=peak_resident_bytes(),
                      device_peak_bytes=device_peak_bytes(self.device), compute_s=compute_s, comm_wait_s=comm_wait_s,
                      pp_bubble=pipeline.bubble(), pp_peak_in_flight=pipeline.peak_in_flight,
                      process_bytes=self.process_bytes)
        counters = self.comm_counters()  # bytes sent during this step
        record.update({field: counters[field] - self.comm_baseline[field] for field in COMM_FIELDS})
        self.comm_baseline = counters
        return record

    # -- checkpoints: the rank's pieces (RankState), and where the run stands ------------------------

    def save_checkpoint(self, saver, folder, step, keep):
        """Start saving the state after `step` steps into folder (every rank must call this)."""
        pieces, layouts, steps = self.state.checkpoint_pieces()
        meta = dict(step=step, skipped_steps=self.skipped_steps, args=vars(self.args), steps=steps,
                    model=asdict(self.model.config), hf_config=self.hf_config)
        saver.save(folder, pieces, layouts, meta, keep)


class RankState:
    """What this rank holds of the training state (its share of the weights, its optimizers' pieces of them
    and of their state, the buffers): gathered whole, for tests and tools, or saved in pieces and read back
    under any layout."""

    def __init__(self, model, optimizers, share, tp_layouts, mesh):
        self.model, self.optimizers, self.share, self.tp_layouts, self.mesh = model, optimizers, share, tp_layouts, mesh

    # -- the whole model gathered, for tests and tools (a run never does this) ----------------------

    def full_state_dict(self):
        """model.py's state dict, whole, on every rank, on the CPU (collectives under ZeRO-3, tp, pp, ep)."""
        with ExitStack() as stack:
            for optimizer in self.optimizers:  # ZeRO-3 gathers the parameters it shards
                stack.enter_context(optimizer.full_parameters())
            mine = {name: self.unshard(name, t).detach().cpu().clone() for name, t in self.model.state_dict().items()}
        return self.merge_stages(mine)

    def unshard(self, name, tensor):
        """A tensor laid out like parameter `name`, gathered to the single device's shape (collective under tp,
        or expert-tp for an expert's)."""
        if name not in self.tp_layouts:
            return tensor
        dim, blocks = self.tp_layouts[name]
        return tp.unshard(tensor, dim, self.mesh.groups[self.share.split_group(name)], blocks)

    def merge_stages(self, by_name):
        """{name: value} merged over pipeline stages and expert-parallel ranks, which hold different names
        (besides replicated ones, identical everywhere)."""
        for group in ("pp", "ep"):
            if self.mesh.size(group) > 1:
                everyone = [None] * self.mesh.size(group)
                dist.all_gather_object(everyone, by_name, group=self.mesh.groups[group])
                by_name = {name: value for part in everyone for name, value in part.items()}
        return by_name

    # -- checkpoints: each rank saves its pieces and reads back those it holds ----------------------

    def checkpoint_pieces(self):
        """This rank's pieces of the training state, [(checkpoint.Piece, tensor)]: its piece of every
        parameter and of its optimizer state, and the buffers; the layouts of their tensors {name: ...};
        the optimizer's step count {name: count} of the parameters it has state for."""
        pieces, layouts, steps = [], {}, {}
        params = dict(self.model.named_parameters())
        for optimizer in self.optimizers:
            for held_as, start, end, piece in optimizer.pieces():  # of the master weights, in their dtype
                name = self.share.name(held_as)  # (a tied output layer: the embedding's)
                layouts[name] = self.share.layout(held_as, params[held_as].shape, piece.dtype)
                state = dict(optimizer.optimizer.state.get(piece, {}))
                if "step" in state:
                    steps[name] = state.pop("step").item()
                for key, value in [("model", piece), *state.items()]:
                    part = self.share.part(held_as)
                    pieces.append((checkpoint.Piece(name, key, part, start, end), value.reshape(-1)))
        saved = self.model.state_dict(keep_vars=True)
        for name, buffer in self.model.named_buffers():  # whole on every rank
            if name in saved:
                layouts[name] = self.share.layout(name, buffer.shape, buffer.dtype)
                pieces.append((checkpoint.Piece(name, "model", 0, 0, buffer.numel()), buffer.reshape(-1)))
        return pieces, layouts, steps

    def load_optimizer_state(self, saved):
        """The optimizer state of this rank's pieces, read from a checkpoint saved under any layout."""
        shapes = {name: p.shape for name, p in self.model.named_parameters()}
        for optimizer in self.optimizers:
            for held_as, start, end, piece in optimizer.pieces():
                name, state = self.share.name(held_as), {}
                for key in saved.optimizer_keys(name):
                    state[key] = torch.empty_like(piece)
                    self.share.fill(state[key].view(-1), held_as, shapes[held_as], start, partial(saved.read, name, key))
                if state:  # the step count goes to the parameter's device too (fused AdamW wants it there)
                    state["step"] = torch.tensor(saved.steps[name], dtype=torch.float32, device=piece.device)
                    optimizer.optimizer.state[piece] = state


# ---------------------------------------------------------------------------
# parallelize's steps: one function a dimension
# ---------------------------------------------------------------------------

def expert_parallel(model, mesh, args):
    """ep.py's MoE layers in place of the model's; returns them. The experts are folded over the stage's ranks
    (mesh.py): every rank of the stage routes tokens of its own, so the load-balancing statistics span
    the stage (per sequence, the loss's span the cp and tp ranks holding parts of the same sequences); under
    tensor parallelism the tokens arrive shared with the tp group (ep.py's ShardedTokens with sequence
    parallelism, ReplicatedTokens without), and --expert-tp splits the experts."""
    if not model.config.n_experts:
        return []
    tp_group = mesh.groups["tp"]
    tokens = (ep.OwnTokens() if mesh.size("tp") == 1 else ep.ShardedTokens(tp_group) if args.sp
              else ep.ReplicatedTokens(tp_group))
    expert_tp = ep.SplitExperts(mesh.groups["expert_tp"]) if mesh.size("expert_tp") > 1 else ep.WholeExperts()
    balance = {"batch": None, "sequence": ep.SequenceBalance(mesh.groups["sequence"]),
               "global": ep.GlobalBalance(mesh.groups["stage"])}[model.config.aux_loss_scope]
    in_flight = pp.pass_turn if args.schedule == "combined" else None  # the paired micro-batch computes meanwhile
    ep.apply_expert_parallel(model, mesh.groups["ep"], mesh.groups["stage"], args.capacity_factor, args.ep_overlap,
                             in_flight, tokens=tokens, expert_tp=expert_tp, balance=balance)
    layers = [m for m in model.modules() if isinstance(m, ep.ExpertParallelMoE)]
    if args.schedule == "combined":  # what a forward leaves on its layer, each half of a pair its own
        for layer in layers:
            pp.per_thread(layer, "aux_loss", "tokens_per_expert", "dropped", "recomputing")
    return layers


def tensor_parallel(model, mesh, args, moe_layers):
    """Megatron's split of the weight matrices, optionally of the sequence too, and the experts' own split
    over expert-tp; returns how each split parameter is laid out."""
    if mesh.size("tp") > 1:
        tp.apply_tensor_parallel(model, mesh.groups["tp"], sequence_parallel=args.sp)
    if mesh.size("expert_tp") > 1:
        for moe in moe_layers:
            tp.split_experts(moe, mesh.groups["expert_tp"])
    return tp.sharded_layouts(model)


def context_parallel(model, mesh, args, device):
    """Ring attention (or --cp-mode's way) in every block; returns the positions of this rank's tokens in the
    sequence. Without context parallelism, cp.py's one-device core: like ring attention's, it computes only
    the tiles of keys a query sees within its document and window, on CUDA by FlexAttention's block masks
    (training/flex.py; model.py's causal_attention is the readable reference, holding a (seq, seq) mask)."""
    if mesh.size("cp") == 1:
        for block in model.blocks:
            block.attn.core = FlexAttentionCore()
        return None
    cp.apply_context_parallel(model, mesh.groups["cp"], args.cp_mode)
    return cp.zigzag_positions(args.seq_len, mesh.size("cp"), mesh.index("cp"), device)


def runs_schedule(args):
    """Whether the micro-batches run through pp.py's schedules: under a pipeline, and without one (a single
    stage) combined 1F1B's pairs, one micro-batch's all-to-alls beside another's computation."""
    return args.pp > 1 or args.schedule in pp.ONE_STAGE_TOO


def pipeline_parallel(model, mesh, args, positions):
    """Only this rank's stage of layers kept; returns its model chunks (None: no schedule runs them)."""
    if not runs_schedule(args):
        return None
    if positions is None:  # every token of a training sequence (the model may know longer ones)
        positions = torch.arange(args.seq_len)
    return pp.apply_pipeline_parallel(model, mesh.groups["pp"], pipeline_placement(args), positions)


def pipeline_placement(args):
    """Which pipeline rank holds which model chunk: in a loop, or in a V (--schedule zbv)."""
    return pp.Placement.of(args.schedule, args.pp, args.virtual_stages)


def tied_across_stages(config, args):
    """Whether a tied output layer's two ends (the embedding in the first model chunk, the output layer in the
    last) are on two pipeline ranks, each holding a copy; in a V (ZB-V) rank 0 holds both, one weight."""
    return config.tie_embeddings and pipeline_placement(args).ends_apart()


def compile_blocks(model):
    """torch.compile the forward of every block this rank runs, in place (parameter names unchanged).

    The compiler fuses a block's element-wise work around its matrix products. What communicates or plans
    on the host inside a block stays eager, as one graph break each: the attention core (which tiles a query
    sees, decided from the document ids; ring attention's point-to-point, whose shape of work changes block
    by block, and the other modes' collectives) and
    the expert-parallel MoE layer (token counts known only at run time). Module hooks (ZeRO-3 gathering a block's weights) stay outside the compiled forward.
    """
    for block in model.blocks:
        if isinstance(block, torch.nn.Identity):  # another pipeline stage's
            continue
        if isinstance(block.attn.core, (cp.AttentionCore, cp.ContextParallelCore)):
            block.attn.core = torch.compiler.disable(block.attn.core)
        if isinstance(block.mlp, ep.ExpertParallelMoE):
            block.mlp.forward = torch.compiler.disable(block.mlp.forward)
        block.forward = torch.compile(block.forward)


def data_parallel(model, mesh, args, moe_layers, share, precision):
    """The optimizers of this rank's parameters, the averaging of their gradients, and the sum of a tied output
    layer's: (optimizers, sync, tied).

    Dense gradients are averaged over the dense-gradient group, expert gradients over the expert-gradient
    group (divided by the dense group's size, see ep.py). With --zero, one ZeRO instance shards the dense
    parameters and one the experts' (DeepSeek-V3's layout), each with the optimizer of its shards; without,
    DataParallel averages, and one optimizer, the same on every replica, updates every parameter. On a
    single data rank too: its buckets are where the micro-batches' gradients accumulate, in the policy's
    reduce dtype. Nothing is broadcast: every replica filled its share from the same values.

    A tied output layer held by two pipeline stages (the embedding on the first, the output layer on the
    last) is averaged by an instance of its own, so that its gradients (under ZeRO its shards of them) are
    the same elements on both stages, which TiedOutputLayer then sums.
    """
    group, bucket_bytes = mesh.groups["dense"], int(args.bucket_mb * 2**20)
    named = list(model.named_parameters())
    tied_names = {name for name, _ in named if tied_across_stages(model.config, args)
                  and share.name(name) == "tok_emb.weight"}
    dense = [p for name, p in named if not ep.is_expert_parameter(name) and name not in tied_names]
    tied = [p for name, p in named if name in tied_names]
    experts = [p for name, p in named if ep.is_expert_parameter(name)]
    expert_group = dict(group=mesh.groups["expert"], divide_by=mesh.size("dense"))
    if args.zero:
        # ZeRO-3 fills its shards itself, the parameters it shards being left unfilled (see Share); every
        # stage fills a master shard kept apart from the weights from the values, not from bfloat16 weights.
        # Under a pipeline ZeRO-3 keeps a unit gathered from its first forward of a step to its last backward
        # (dp.ZeRO3). Hybrid sharding (--dp-shard): each shards over its part of its group (mesh.zero_groups).
        held_through_step = dict(reshard_after_forward=False) if args.zero == 3 and runs_schedule(args) else {}

        def make_zero(params, units, averaged_over, **options):
            group, replicas = mesh.zero_groups(averaged_over)
            return ZERO_STAGES[args.zero](
                model, group, lambda shards: make_optimizer(shards, args), units=units, bucket_bytes=bucket_bytes,
                broadcast=False, params=params, master_dtype=precision.master, reduce_dtype=precision.reduce,
                initial_values=share.elements, replicate_group=replicas, **held_through_step, **options)
        tied_zero = make_zero(tied, gpt_units(model), "dense") if tied else None
        zeros = [make_zero(dense, gpt_units(model), "dense"), *([tied_zero] if tied else [])]
        gpt_lend(zeros[0], model)  # (a tied output layer beside its embedding: one weight, ZeRO-3's one unit)
        if experts:
            zeros.append(make_zero(experts, moe_layers, "expert", find_unused_parameters=True,
                                   divide_by=mesh.size("dense")))
        with_muon(zeros, model, mesh, share, args, precision)
        return zeros, GradientSync(zeros), TiedOutputLayer(tied_zero, tied_names, mesh)
    average = partial(DataParallel, bucket_bytes=bucket_bytes, broadcast=False, reduce_dtype=precision.reduce)
    tied_sync = average(tied, group) if tied else None
    syncs = [average(dense, group), *([tied_sync] if tied else [])]
    if experts:
        syncs.append(average(experts, find_unused_parameters=True, **expert_group))
    grad_sync = GradientSync(syncs)
    # bfloat16 weights with a float32 master (Megatron-LM's Float16Optimizer): the master copies are filled
    # from the values, not from the rounded weights.
    fill_master = lambda name, master: share.fill(master.view(-1), name, master.shape)  # noqa: E731
    optimizer = ReplicatedOptimizer(model.named_parameters(), partial(make_optimizer, args=args), grad_sync,
                                    precision.master, fill_master)
    with_muon([optimizer], model, mesh, share, args, precision)
    return [optimizer], grad_sync, TiedOutputLayer(tied_sync, tied_names, mesh)


def with_muon(optimizers, model, mesh, share, args, precision):
    """Under --optimizer muon, each ZeRO instance's (or the replicated) optimizer becomes training/muon.py's,
    over the same pieces (the AdamW each was built with holds no state before its first step, and goes):
    Muon's matrices are assembled over the stage's ranks, each copy among its own (a data-parallel replica's
    without ZeRO, hybrid sharding's replica's with it)."""
    if args.optimizer != "muon":
        return
    shapes = {name: p.shape for name, p in model.named_parameters()}
    group = mesh.groups["stage"] if mesh.size("stage") > 1 else None

    def split_of(name):
        return (share.tp_layouts[name][0], share.parts(name), share.part(name)) if name in share.tp_layouts else None

    def copy_of(name):
        if args.zero:
            return mesh.index("dp_replicate") if mesh.shape.hybrid else 0
        return mesh.index("expert" if ep.is_expert_parameter(name) else "dense")
    for optimizer in optimizers:
        pieces = muon.held_segments(optimizer.pieces(), shapes, model.config, split_of, copy_of)
        held = [s for _, found in pieces for s in found]
        assembly = muon.Assembly(held, group, args.muon_assembly == "gather", precision.weights, share.device)
        optimizer.optimizer = muon.Muon(pieces, assembly, partial(make_optimizer, args=args), args.lr,
                                        args.weight_decay)


class TiedOutputLayer:
    """A tied output layer under pipeline parallelism (Megatron-LM's embedding group): the first stage holds
    the embedding, the last the output layer, two copies of one weight, each of whose gradients holds its
    own stage's part. Once data parallelism has averaged them, one all-reduce over the two stages sums
    them, so both copies take the same step. With no such copies here (sync None) it does nothing.
    """

    def __init__(self, sync, names, mesh):
        self.names, self.bytes_sent = names, 0
        self.gradients = sync.averaged_gradients if sync else []
        if names:
            mesh.add_pipeline_ends()
        self.group = mesh.groups.get("pp_ends")

    def sum_gradients(self):
        for grad in self.gradients:
            dist.all_reduce(grad, group=self.group)
            self.bytes_sent += ring_bytes_sent("all_reduce", grad.nbytes, 2)

    def copies(self, name):
        """How many pipeline stages hold parameter `name`."""
        return 2 if name in self.names else 1


# ---------------------------------------------------------------------------
# What each rank holds, and where its values come from
# ---------------------------------------------------------------------------

def starting_values(args, config, saved):
    """Where the weights come from: the checkpoint resumed, else the Hugging Face folder --init-from names,
    else model.py's initial values."""
    if saved:
        return SavedValues(saved)
    if args.init_from:
        return hf.HuggingFaceValues(args.init_from, config)
    return InitialValues(config, args.seed)


class InitialValues:
    """model.py's initial values: each a pure function of (seed, parameter name, position in the full
    tensor), so every rank fills its slice alone and equals the single device's."""

    def __init__(self, config, seed):
        self.n_layer, self.seed, self.norm_weight = config.n_layer, seed, config.norm_weight

    def parameter(self, name, positions):
        return initial_values(name, positions, self.n_layer, self.seed, self.norm_weight)

    def buffer(self, name, empty):
        return torch.zeros_like(empty)  # the routing biases and the step's expert loads start at zero


class SavedValues:
    """A checkpoint's weights (checkpoint.Checkpoint), read at the positions a rank holds, whatever layout
    saved them."""

    def __init__(self, saved):
        self.saved = saved

    def parameter(self, name, positions):
        return self.saved.read(name, "model", positions)

    def buffer(self, name, empty):
        return (self.saved.full(name).to(empty.device, empty.dtype) if name in self.saved.tensors
                else torch.zeros_like(empty))


class Share:
    """This rank's share of every parameter, as positions in the full tensor: how it is filled from values
    (InitialValues, SavedValues, hf.HuggingFaceValues) without the full tensor ever existing.

    Of the dimensions, tensor parallelism alone cuts a parameter (along one dim, block by block: tp_layouts);
    the pipeline, experts and ZeRO keep or drop whole parameters under their full names, and ZeRO-3 cuts
    the flattened local tensor into ranges (elements()). A tied output layer goes by the embedding's name
    (model.tied_name) in values and checkpoints, wherever it is held.
    """

    def __init__(self, tp_layouts, mesh, values, device, master_dtype, config):
        self.tp_layouts, self.values, self.device, self.master_dtype = tp_layouts, values, device, master_dtype
        self.mesh = mesh
        self.name = partial(tied_name, config=config)

    def split_group(self, name):
        """The group a split parameter is split over: expert-tp for an expert's, else tp."""
        return "expert_tp" if ep.is_expert_parameter(name) else "tp"

    def parts(self, name):
        """How many parts parameter `name` is split into (1: whole)."""
        return self.mesh.size(self.split_group(name)) if name in self.tp_layouts else 1

    def full_shape(self, name, shape):
        """The full tensor's shape, of `name` whose slice here has `shape`."""
        full_shape = list(shape)
        if name in self.tp_layouts:
            dim, _ = self.tp_layouts[name]
            full_shape[dim] *= self.parts(name)
        return full_shape

    def positions(self, name, shape, start, end):
        """The flat positions in the full tensor of elements [start, end) of this rank's flattened `name`."""
        flat = torch.arange(start, end, device=self.device)
        if name not in self.tp_layouts:  # held whole: the same positions
            return flat
        index = list(torch.unravel_index(flat, shape))
        full_shape = self.full_shape(name, shape)
        dim, blocks = self.tp_layouts[name]  # index along dim: which of the full tensor's rows this rank holds
        rows = tp.shard(torch.arange(full_shape[dim], device=self.device), 0, self.part(name), self.parts(name), blocks)
        index[dim] = rows[index[dim]]
        strides = torch.empty(full_shape, device="meta").stride()
        return sum(i * stride for i, stride in zip(index, strides))

    def layout(self, name, shape, dtype):
        """How tensor `name` (of `shape` here) is laid out, as a checkpoint's manifest records it: its full
        shape and dtype, and tensor parallelism's split of it (None: whole on every rank)."""
        split = None
        if name in self.tp_layouts:
            dim, blocks = self.tp_layouts[name]
            split = dict(dim=dim, blocks=list(blocks) if blocks else None, parts=self.parts(name))
        return dict(shape=self.full_shape(name, shape), dtype=tensorfile.DTYPES[dtype], split=split)

    def part(self, name):
        """Which of a tensor's parts this rank holds (see layout): its tp (expert-tp) rank if it is split,
        else 0."""
        return self.mesh.index(self.split_group(name)) if name in self.tp_layouts else 0

    def fill(self, flat, name, shape, start=0, values=None):
        """flat = elements [start, start + len(flat)) of this rank's flattened `name` (of local `shape`), from
        values(positions) (default: the share's values of the parameter), rounded to the master weights'
        dtype first: bfloat16 weights are then their float32 master's rounding, whichever fills them."""
        values = values or partial(self.values.parameter, self.name(name))
        fill_in_chunks(flat, lambda positions: values(positions).to(self.master_dtype),
                       lambda a, b: self.positions(name, shape, start + a, start + b))

    def elements(self, name, shape, start, end):
        """Elements [start, end) of this rank's flattened `name`, made alone (ZeRO-3's shards)."""
        flat = torch.empty(end - start, dtype=torch.float64, device=self.device)  # drawn where it is kept
        self.fill(flat, name, shape, start)
        return flat

    def _real(self, name, p, fill):
        """Meta parameter p, allocated on the run's device (and filled)."""
        if fill:
            tensor = torch.empty(p.shape, dtype=p.dtype, device=self.device)
            self.fill(tensor.view(-1), name, p.shape)
        else:
            tensor = unallocated(p.shape, p.dtype, self.device)
        real = torch.nn.Parameter(tensor, requires_grad=p.requires_grad)
        # Gradient hooks a dimension put on the meta parameter go with it (sequence parallelism's norms
        # sum their gradients over the tp group); PyTorch keeps a tensor's hooks in this dict.
        real._backward_hooks = p._backward_hooks
        return real

    def materialize(self, model, fill=True):
        """Every meta parameter and buffer of `model` allocated on the run's device; the parameters filled,
        or (fill False: ZeRO-3 fills its shards) left without memory. A parameter held under two names (a
        tied output layer) stays one."""
        made = {}
        for name, p in list(model.named_parameters(remove_duplicate=False)):
            if p not in made:
                made[p] = self._real(name, p, fill)
            set_tensor(model, "_parameters", name, made[p])
        for name, b in list(model.named_buffers()):
            set_tensor(model, "_buffers", name, self.values.buffer(name, torch.empty_like(b, device=self.device)))


def set_tensor(model, kind, name, tensor):
    """Put tensor in place of model's parameter or buffer `name` (kind: "_parameters" or "_buffers")."""
    owner, _, leaf = name.rpartition(".")
    getattr(model.get_submodule(owner), kind)[leaf] = tensor


# ---------------------------------------------------------------------------
# What the training step drives, the same with or without ZeRO or a pipeline
# ---------------------------------------------------------------------------

class GradientSync:
    """Several data-parallel gradient averagers (dense and expert parameters) driven as one; with none (a
    single data-parallel rank) it does nothing."""

    def __init__(self, syncs):
        self.syncs = syncs

    @contextmanager
    def _each(self, context):
        """Enter the context manager method `context` of every averager."""
        with ExitStack() as stack:
            for sync in self.syncs:
                stack.enter_context(getattr(sync, context)())
            yield

    def no_sync(self):
        return self._each("no_sync")

    def between_micro_batches(self):
        return self._each("between_micro_batches")

    def keep_incomplete_buckets(self):
        return self._each("keep_incomplete_buckets")

    def finish_grad_sync(self):
        for sync in self.syncs:
            sync.finish_grad_sync()

    @property
    def grads(self):
        """{parameter: its averaged gradient, or None if no rank used it}, after finish_grad_sync."""
        return {p: grad for sync in self.syncs for p, grad in sync.grads.items()}

    @property
    def buffers(self):
        """The gradient buckets (those ZeRO-2 and 3 freed hold no memory)."""
        return [bucket.grad for sync in self.syncs for bucket in sync.buckets]

    @property
    def comm_bytes(self):
        return sum((sync.comm_bytes for sync in self.syncs), Counter())


class GradientAccumulation:
    """No pipeline: the micro-batches one after the other through the whole model, their gradients summed."""

    bytes_sent = 0  # no pipeline messages

    def __init__(self, model, positions, grad_sync, forward_context):
        self.model, self.positions, self.grad_sync = model, positions, grad_sync
        self.forward_context = forward_context

    def train(self, micro_batches, stats, loss_tokens):
        """Forward and backward of every micro-batch; returns the mean of their losses, each summed and divided
        by loss_tokens. (`stats`, a pipeline's measurements, stays empty.)"""
        losses = []
        for m, (inputs, targets, documents) in enumerate(micro_batches):
            last = m == len(micro_batches) - 1
            # Gradients are reduced during the last micro-batch's backward (ZeRO-2 and 3: during each).
            with self.grad_sync.between_micro_batches() if not last else nullcontext():
                with self.forward_context(), torch.profiler.record_function(f"forward micro {m}"):
                    _, loss = self.model(inputs, targets, self.positions, documents, loss_tokens)
                with torch.profiler.record_function(f"backward micro {m}"):
                    (loss / len(micro_batches)).backward()  # the mean over micro-batches, as on one device
            losses.append(loss.item())
        return sum(losses) / len(losses)

    def evaluate(self, micro_batches, loss_tokens):
        """The loss of every micro-batch, forward only."""
        losses = []
        for inputs, targets, documents in micro_batches:
            logits, _ = self.model(inputs, pos=self.positions, documents=documents)
            losses.append(self.model.loss_fn(logits, targets, tokens=loss_tokens).item())
        return losses

    def sum_over_stages(self, counts):
        return counts  # a single stage: it counted every layer


class PipelineStage:
    """Pipeline parallelism: this rank's stage runs its part of a schedule on its model chunks (pp.py),
    the micro-batches flowing from stage to stage."""

    def __init__(self, chunks, model, mesh, args, grad_sync, forward_context, device):
        self.chunks, self.model, self.args, self.device = chunks, model, args, device
        self.group, self.n_stages = mesh.groups["pp"], mesh.size("pp")
        self.grad_sync, self.forward_context = grad_sync, forward_context
        # What passes between stages: one micro-batch's activations, of this rank's shard of the sequence.
        seq = args.seq_len // mesh.size("cp")
        seq = seq // mesh.size("tp") if args.sp else seq  # sequence parallelism sends a shard
        micro = args.batch_size // (args.micro_batches * mesh.size("dp"))
        self.shape, self.dtype = (micro, seq, model.config.d_model), next(model.parameters()).dtype
        self.bytes_sent = 0

    def train(self, micro_batches, stats, loss_tokens):
        """Forward and backward of every micro-batch on the --schedule; returns this stage's share of the
        step's loss: the cross-entropy (last stage, each divided by loss_tokens) and its layers' side losses."""
        schedules = self.schedules(partial(pp.make_schedule, self.args.schedule))
        losses, side_losses = self.run(schedules, micro_batches, stats, loss_tokens)
        return (sum(losses) + sum(side_losses)) / self.args.micro_batches

    def evaluate(self, micro_batches, loss_tokens):
        """The loss of every micro-batch, forward only, on the last stage (elsewhere, none)."""
        return self.run(self.schedules(pp.forward_only), micro_batches, pp.PipelineStats(self.device),
                        loss_tokens)[0]

    def schedules(self, make):
        """Every stage's actions, make(micro-batches, stages, rank, chunks): each rank runs its own, placed
        on one timeline with the others'."""
        args = self.args
        return [make(args.micro_batches, self.n_stages, r, args.virtual_stages) for r in range(self.n_stages)]

    def run(self, schedules, micro_batches, stats, loss_tokens):
        """Run a pipeline schedule on this rank's chunks: (last stage's micro-batch losses, side losses)."""
        loss_fn = partial(self.model.loss_fn, tokens=loss_tokens)
        losses = pp.run_schedule(schedules, self.chunks, micro_batches, loss_fn, self.group,
                                 self.shape, self.dtype, self.device, grad_sync=self.grad_sync, stats=stats,
                                 debug=self.args.pp_debug, forward_context=self.forward_context,
                                 placement=pipeline_placement(self.args))
        self.bytes_sent += stats.bytes_sent
        return losses

    def sum_over_stages(self, counts):
        """Integers each stage counted for its own layers (zero for the others'), summed over the stages."""
        counts = torch.tensor(counts, dtype=torch.long, device=self.device)
        dist.all_reduce(counts, group=self.group)
        return counts.tolist()


def micro_batch_runner(parallel, model, mesh, args, forward_context, device):
    """Chosen once: the micro-batches run through this rank's pipeline stage, or through the whole model."""
    if parallel.chunks:
        return PipelineStage(parallel.chunks, model, mesh, args, parallel.grad_sync, forward_context, device)
    return GradientAccumulation(model, parallel.positions, parallel.grad_sync, forward_context)


class RoutingCounts:
    """The tokens routed to each expert of each MoE layer by a step's training forwards, and those dropped
    (capacity factor): the log's view of the experts' balance."""

    def __init__(self, moe_layers, n_experts):
        self.n_layers, self.n_experts = len(moe_layers), n_experts
        for index, layer in enumerate(moe_layers):  # (a pipeline stage runs only its own)
            layer.register_forward_hook(partial(self.count, index))
        self.reset()

    def reset(self):
        self.tokens_per_expert = [[0] * self.n_experts for _ in range(self.n_layers)]
        self.dropped_tokens = 0

    def count(self, index, layer, inputs, output):
        """After MoE layer `index`'s forward: add its tokens per expert (summed over all ranks already) to this
        step's, if it was a training forward (not evaluation, not a recomputation for backward)."""
        if torch.is_grad_enabled() and not layer.recomputing:
            total = self.tokens_per_expert[index]
            total[:] = [a + b for a, b in zip(total, layer.tokens_per_expert)]
            self.dropped_tokens += layer.dropped

    def sum_over_stages(self, runner):
        """Every MoE layer's counts in this step's log: each pipeline stage counted only its own layers (the
        others' lists stay zero), so one sum over the stages gives them all."""
        if not self.n_layers:
            return
        *counts, self.dropped_tokens = runner.sum_over_stages([*sum(self.tokens_per_expert, []),
                                                               self.dropped_tokens])
        self.tokens_per_expert = [counts[i:i + self.n_experts] for i in range(0, len(counts), self.n_experts)]

    def log(self):
        """Tokens routed to each expert of each MoE layer, and those dropped (capacity factor); nothing
        without experts."""
        if not self.n_layers:
            return {}
        return dict(tokens_per_expert=self.tokens_per_expert, dropped_tokens=self.dropped_tokens)


class StepClock:
    """A step's wall time, split into computing and waiting for communication: the gradients' reduction
    after backward (device time, not host time: pp.Stopwatch) and the pipeline's waits for its
    neighbours (pp.PipelineStats, which stays empty without pipeline parallelism; with `timeline`, it
    records when each action waited and ran). Of the computing, the time inside the step's other
    collectives (`collectives`, a stragglers.CollectiveClock)."""

    def __init__(self, device, timeline, collectives):
        self.device, self.start, self.collectives = device, time.perf_counter(), collectives
        self.pipeline = pp.PipelineStats(device, record=timeline)
        self.reduction = pp.Stopwatch(device)
        collectives.start()

    @contextmanager
    def waiting(self):
        begin = self.reduction.now()
        with self.collectives.paused():  # the reduction's collectives: its waiting, counted once
            yield
        self.reduction.add(begin, self.reduction.now())

    def stop(self):
        """(computing, waiting, of the computing the time in collectives) seconds since the start."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels have run: the host clock now spans them
        elapsed = time.perf_counter() - self.start
        waiting = self.reduction.seconds() + self.pipeline.wait_s
        return elapsed - waiting, waiting, self.collectives.stop()


# ---------------------------------------------------------------------------
# Helpers: precision, the model and its optimizer, batches, the schedule, checkpoints, the log
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Precision:
    """Which dtype holds what: --dtype bfloat16 trains as Megatron-LM and PyTorch's FSDP2 (torchtitan's
    MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)) do.

    weights: the parameters, so every activation, and every message of tp, sp, cp, ep and pp and
        ZeRO's gathers of the weights; no weight is cast again per micro-batch (as autocast would).
    master: the optimizer's copy of the weights and AdamW's moments (sharded by ZeRO where it is on),
        kept where the weights are narrower: a bfloat16 update of 1e-4 of a weight would round to 0.
    reduce: the gradients' buckets, where micro-batches accumulate and data ranks average them.

    What the code computes wider than the weights whatever this policy says, as the anchors do, is
    where it happens: norms' statistics (PyTorch's kernels), softmax and ring attention's log-sum-exp
    merge (cp.py), the router's probabilities (ep.py), the loss (model.py, tp.py), the gradient norm
    (float64). With all three float64 this is the exact contract of every test; with float32 weights
    and a float64 master, the structure alone is checked, to float32's rounding.
    """
    weights: torch.dtype
    master: torch.dtype
    reduce: torch.dtype

    @classmethod
    def from_args(cls, args):
        return cls(DTYPES[args.dtype], DTYPES[args.master_dtype], DTYPES[args.reduce_dtype])

    def apply(self, model):
        """model's parameters in the weights' dtype; its floating buffers (MoE routing biases, moved by a
        small rate every step) in the master's."""
        model.to(self.master)
        for p in model.parameters():
            p.data = p.data.to(self.weights)
        return model


def build_model(config, seed, dtype, device):
    """The whole model on one device (the single-device reference): built on the meta device, then
    allocated where it runs and filled with its initial values (nothing made first on the CPU)."""
    with torch.device("meta"):
        model = GPT(config).to(dtype)
    model.to_empty(device=device)
    model.tie_weights()
    model.reset_parameters(seed)
    return model


def single_device_optimizer(model, args):
    """The optimizer of a whole model on one device (tools/parity.py's reference)."""
    if args.optimizer == "muon":
        return muon.single_device(model, partial(make_optimizer, args=args), args.lr, args.weight_decay,
                                 next(model.parameters()).dtype)
    return make_optimizer(model.parameters(), args)


def make_optimizer(params, args):
    # fused: one kernel for every parameter instead of a loop of small ops per tensor; on CPU as on GPU
    # it is several times faster, which matters most when data parallelism shrinks the rest of the step.
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True)


def load_training_data(args):
    """The data the flags name, opened (train() opens the DataInfo its configuration read instead)."""
    return open_data(describe_data(args), seed=args.seed)


def counted_targets(tokens, loss_mask=None):
    """The targets of the global batch `tokens` (each token's next): IGNORE where the data's loss mask says
    the loss does not count it (a chat's system and user turns), so every layout leaves out the same ones."""
    targets = tokens[:, 1:]
    return targets if loss_mask is None else targets.masked_fill(~loss_mask[:, 1:], IGNORE)


def local_micro_batches(tokens, n_micro, n_data, data_rank, targets=None):
    """This rank's (inputs, targets) for each micro-batch of the global batch (targets: counted_targets').

    Micro-batch m is sequences [m*B/M, (m+1)*B/M) of the global batch, exactly as
    the single device accumulates them; data rank r reads the r-th slice of it.
    """
    targets = tokens[:, 1:] if targets is None else targets
    for micro, micro_targets in zip(tokens.chunk(n_micro), targets.chunk(n_micro)):
        yield micro.chunk(n_data)[data_rank][:, :-1], micro_targets.chunk(n_data)[data_rank]


class OneSequence:
    """Each training sequence is one causal sequence (the synthetic language, bytes, --no-document-mask)."""

    def split(self, inputs, targets):
        """(inputs, targets, documents) of a micro-batch: no documents."""
        return inputs, targets, None

    def loss_tokens(self, tokens, targets, n_shards):
        """What each of the n_shards pieces of the global batch `tokens` divides its summed loss by: the
        batch's counted targets (every one, the mean, where the data has no loss mask) over n_shards."""
        return max(1, (targets != IGNORE).sum().item()) / n_shards

    def first_keys(self, tokens):
        """The first token of each token's document in the global batch `tokens` (for its attention's FLOPs,
        training/mfu.py): None, one document a row."""
        return None


class PackedDocuments:
    """Sequences packed with documents, each ended by eos_id: attention and positions stop at each document's
    end, and the prediction across it (made at the EOS) is not trained (model.py's document_ids and
    document_targets)."""

    def __init__(self, eos_id):
        self.eos_id = eos_id

    def split(self, inputs, targets):
        return inputs, document_targets(inputs, targets, self.eos_id), document_ids(inputs, self.eos_id)

    def loss_tokens(self, tokens, targets, n_shards):
        """What each of the n_shards pieces of the global batch `tokens` divides its summed loss by: the batch's
        counted targets (those not predicted at an EOS, nor left out by the data's loss mask) over n_shards.
        Shards count different numbers, and their losses average (over micro-batches, data and sequence
        shards) to the mean over the whole batch's counted targets, on every layout alike."""
        return max(1, ((tokens[:, :-1] != self.eos_id) & (targets != IGNORE)).sum().item()) / n_shards

    def first_keys(self, tokens):
        # cp.first_keys uncached (lru_cache's __wrapped__): the cache would hold the last 8 global batches
        return cp.first_keys.__wrapped__(document_ids(tokens[:, :-1], self.eos_id))


def packing_of(eos_id):
    """How the training sequences are read: packed documents ended by eos_id, or (None) one sequence each."""
    return OneSequence() if eos_id is None else PackedDocuments(eos_id)


def lr_at(step, args):
    """Linear warm-up to --lr, then cosine decay to --lr * --min-lr-ratio at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    min_lr = args.lr * args.min_lr_ratio
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (args.lr - min_lr)


def run_name(args, world):
    split_experts = f"_etp{args.expert_tp}" if args.expert_tp > 1 else ""  # (names from before it stay the same)
    return args.name or f"gpu{world}_tp{args.tp}_pp{args.pp}_cp{args.cp}_ep{args.ep}{split_experts}"


def check_memory(args, world, config, data):
    """A model whose parameters alone cannot fit a rank's device is refused before anything is allocated, by
    training/count/'s count of the busiest rank's param_bytes under this layout (tools/plan/'s; every rank
    counts the same)."""
    need, have = largest_parameter_bytes(args, world, config, data), device_memory_bytes()
    if need > have:
        device = "its GPU" if torch.cuda.is_available() else "its share of the machine's memory"
        raise ConfigError(f"the model's parameters alone take {need / 2**30:,.1f} GiB on the busiest rank of this "
                          f"layout (tools/plan/'s param_bytes), and a rank has {have / 2**30:,.1f} GiB ({device}): "
                          f"split them over more ranks (--tp, --pp, --zero 3) or train a smaller model")


def check_folder(folder, config, group):
    """The --init-from folder checked by every rank before training: each of its safetensors files against its
    header and its tensors' shapes against its config.json (hf.HuggingFaceValues), and the files downloaded
    into huggingface_hub's cache against the hashes their blobs are named by and MXFP4 scales against the
    format, checked by the ranks of a node a share each (training/integrity.py, hf.Folder). Every rank raises
    the same DamagedFile, or none does."""
    share = (int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    try:
        values = hf.HuggingFaceValues(folder, config)
        values.check_shapes()
        problem = integrity.hub_problem(folder, share) or values.folder.mxfp4_problem(share)
    except (DamagedFile, hf.UnsupportedModel) as e:
        problem = f"--init-from {e}"
    problem = first_problem(problem, group)
    if problem:
        raise DamagedFile(problem)


def same_optimizer(saved, args):
    """A checkpoint resumes under the optimizer whose state it holds (Muon's momentum is not AdamW's moments)."""
    theirs = saved.manifest["args"].get("optimizer", "adamw")
    if theirs != args.optimizer:
        raise ConfigError(f"--resume {saved.path}: its optimizer state is {theirs}'s; resume it with --optimizer "
                          f"{theirs}, or start --optimizer {args.optimizer} from its weights alone (python -m "
                          f"tools.convert to-file ... --weights-only, then from-file)")


def resume_from(args, world, group, report=print):
    """The checkpoint this run starts from, checked by every rank of `group` together: --resume PATH (a
    bad one raises BadCheckpoint), or under --resume auto the newest good checkpoint of the run's folder
    (None: there is none yet, start afresh). Without --name, a run whose folder has none goes on in the
    folder of its layout that another number of ranks wrote (see same_run_on_other_ranks)."""
    if args.resume != "auto":
        if args.resume:
            checkpoint.verify_together(args.resume, group)
        return args.resume
    found = checkpoint.newest_good(os.path.join(args.out, run_name(args, world)), report, group)
    if found is None and args.name is None:
        found = same_run_on_other_ranks(args, world, group, report)
        if found:
            args.name = os.path.basename(os.path.dirname(found))  # the run goes on in that folder, its log there
    if found:
        report(f"resuming from {found}")
    return found


def same_run_on_other_ranks(args, world, group, report):
    """The newest good checkpoint of this run written on another number of ranks, or None.

    The default name counts the ranks (gpu4_tp2_...), the run does not: under torchrun --nnodes MIN:MAX a
    node lost for good restarts the survivors as a smaller world (a node that joins, as a larger one), and
    with the same command line they must find the checkpoints the larger world wrote. Two such runs with
    checkpoints are two runs: which to continue is refused as ambiguous rather than guessed."""
    own = run_name(args, world)
    layout = own[len(f"gpu{world}"):]  # _tp2_pp1_cp1_ep1
    names = sorted(name for name in (os.listdir(args.out) if os.path.isdir(args.out) else [])
                   if name != own and name.startswith("gpu") and name.endswith(layout)
                   and name[3:len(name) - len(layout)].isdigit())
    found = [path for path in (checkpoint.newest_good(os.path.join(args.out, name), report, group) for name in names)
             if path]
    if len(found) > 1:
        raise ConfigError(f"--resume auto: {os.path.join(args.out, own)} has no checkpoint, and several runs of its "
                          f"layout on other numbers of ranks have: {', '.join(found)}; name the run to continue with "
                          f"--name (or the checkpoint with --resume PATH)")
    return found[0] if found else None


def keep_log_before(path, step):
    """Drop the records of `step` and later from a run's log: those of a run that died after its last
    checkpoint, which the resumed run writes again."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if json.loads(line)["step"] < step]
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def gather_records(record):
    """Every rank's record, as {field: [value of rank 0, rank 1, ...]} (one small all-gather)."""
    mine = torch.tensor([float(record[f]) for f in LOG_FIELDS], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    as_number = lambda f, x: int(x) if f.endswith("_bytes") else x  # bytes are exact integers in float64
    return {f: [as_number(f, t[i].item()) for t in everyone] for i, f in enumerate(LOG_FIELDS)}


def mean_over_ranks(values):
    """The mean of every rank's values (ranks without any, like early pipeline stages, add nothing)."""
    t = torch.tensor([sum(values), len(values)], dtype=torch.float64)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def gather_peaks(device):
    """Every rank's peak resident memory so far, or on a GPU its device's peak (a small all-gather)."""
    mine = torch.tensor([float(device_peak_bytes(device) or peak_resident_bytes())], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [int(t.item()) for t in everyone]


def nonfinite_problem(step, record, skipped_steps, args):
    """What is wrong with a step whose loss or gradient norm is not finite, unless it may be skipped
    (--skip-nonfinite-steps: its update was not made, see Trainer.train_step); None for a good step."""
    bad_ranks = [r for r, loss in enumerate(record["loss"]) if not math.isfinite(loss)]
    grad_norm = record["grad_norm"][0]  # the same on every rank
    if not bad_ranks and math.isfinite(grad_norm):
        return None
    if not math.isfinite(grad_norm) and skipped_steps <= args.skip_nonfinite_steps:
        return None
    losses = (f"a non-finite loss on rank{'s' * (len(bad_ranks) > 1)} {', '.join(map(str, bad_ranks))}"
              if bad_ranks else "every loss finite")
    return (f"step {step}: {losses}, gradient norm {grad_norm} (non-finite steps so far: {skipped_steps}; "
            f"--skip-nonfinite-steps {args.skip_nonfinite_steps})")


def step_loss(args, losses):
    """The step's loss from every rank's (losses, indexed by rank): each reported its stage's share of its
    data's loss, so the mean over ranks, times the stages."""
    return args.pp * sum(losses) / len(losses)


def log_entry(args, step, record, wall, trainer):
    """The log record of a step, from every rank's values (lists indexed by rank)."""
    step_s = max(c + w for c, w in zip(record["compute_s"], record["comm_wait_s"]))
    entry = dict(step=step, loss=step_loss(args, record["loss"]), lr=lr_at(step, args), grad_norm=record["grad_norm"][0],
                 skipped_steps=trainer.skipped_steps, step_s=step_s, time_s=wall + step_s,
                 tokens_per_s=args.batch_size * args.seq_len / step_s,
                 tokens_seen=(step + 1) * args.batch_size * args.seq_len,  # every step reads one global batch
                 flops_per_token=record["flops_per_token"][0],  # the same on every rank: of the global batch
                 **{k: v for k, v in record.items() if k not in ("loss", "grad_norm", "flops_per_token")})
    entry.update(trainer.routing.log())
    entry["stragglers"] = stragglers.waited_for(record["compute_s"], record["comm_wait_s"], record["collective_s"],
                                                trainer.stage_of)
    entry.update(trainer.data.log(step, args.batch_size, args.seq_len))  # a mixture's tokens_seen_by_source
    if args.pp > 1:  # the measured idle fraction of each stage (pp_bubble) beside the ideal one
        entry["pp_bubble_formula"] = pp.bubble_formula(args.pp, args.micro_batches, args.virtual_stages, args.schedule)
    return entry


def progress_line(entry, args):
    """The line a step prints: its loss, validation loss, throughput, MFU and pipeline bubble, as known."""
    val = f"  val {entry['val_loss']:.4f}" if "val_loss" in entry else ""
    utilisation = f"  MFU {entry['mfu']:.1%}" + (" of FP8's peak" if entry["mfu_of"] == "float8" else "") \
        if "mfu" in entry else ""
    bubble = (f"  bubble {max(entry['pp_bubble']):.2f} (ideal {entry['pp_bubble_formula']:.2f})"
              if args.pp > 1 else "")
    return f"step {entry['step']:5d}  loss {entry['loss']:.4f}{val}  {entry['tokens_per_s']:,.0f} tok/s{utilisation}{bubble}"


def main(argv=None):
    args = parse_args(argv)
    rank, world = rank_and_world()
    try:
        train(args)
    except (ConfigError, checkpoint.BadCheckpoint, DamagedFile) as e:  # found before training, by every rank alike
        exit_with_error(str(e), rank, world, status=2)
    except NonFiniteStep as e:
        exit_with_error(str(e), rank, world, status=1)
    except RuntimeError as e:  # in a collective, a peer died or stalled: say where this rank waited, then fail
        if not in_collective(e):
            raise
        sys.stderr.write(f"[rank {rank}] train.py: error: a collective failed while waiting in {where(e)}, "
                         f"{str(e).splitlines()[0]} (a rank that died or stalled; --timeout {args.timeout:g} s)\n")
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
