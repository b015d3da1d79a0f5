"""One rank of a large run, run alone on this machine: its share built, one training step taken, its
memory measured beside tools/plan/'s prediction.

    python -m tools.dryrun --world 64 --rank 5 --model llama3-8b --arch llama --tp 8 --zero 3 \\
        --seq-len 256 --batch-size 8

The other ranks are simulated by PyTorch's fake process group (`torch.testing`'s fake_pg, which
torchtitan once used to estimate memory): every collective and point-to-point message completes at once
and delivers nothing. So the values are meaningless and no loss is reported, while the shapes, what this
rank allocates and the traffic it counts are the real run's. Nothing is written (no log, no checkpoint):
the report goes to standard output, a table or, with --json, the measured and predicted fields.

Measured: the counters of train.py's log (parameter, gradient, optimizer and activation bytes, traffic
per dimension and collective) and the process's peak resident memory (Linux's VmHWM: the interpreter,
PyTorch's libraries and the allocator's caches too; on a GPU, the allocator's peak beside it).

The arithmetic that dominates a step is skipped (`SkipArithmetic`; --compute keeps it): matrix products
and the fused attention kernels, forward and backward, answer with zeros of their output's shape, dtype,
strides and device. The step allocates what it would and counts the same traffic (the
values were meaningless already), in seconds, where a large layout's bfloat16 products on a CPU without
bfloat16 instructions would take the better part of an hour in software. What is skipped: aten's mm, addmm,
bmm and baddbmm (every linear layer and written-out attention), _scaled_mm (--fp8's) and the scaled-dot-product
attention kernels of CPUs and CUDA with their backwards; everything else (norms, activations, the optimizer, the
collectives' bookkeeping) runs.

Muon (--optimizer muon) gathers every rank's pieces of the matrices once, at start-up, to choose who
assembles each: a fake peer would answer with this rank's own, so each peer's are given as tools/plan/
lays them out (muon_held), this rank's own checked against the planner's on the way. Who assembles what,
and so the traffic and the step's buffers, are then the real run's.

Experts are routed as tools/plan/ assumes, balanced (`balanced_experts`): each rank hands its tokens'
(token, expert) assignments to the experts in turn, so each expert gets the same share, and its peers,
which never say how many rows they send it (--ep) or received for the experts it splits with them
(--expert-tp), are answered for as balanced peers: with this rank's own counts. The router still runs (its
products skipped), and what it keeps for backward is the real run's; only its choice is replaced.
"""
import argparse
import json
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from training import cli, muon
from training.data import open_data
from tools import plan
import ep
import train
from mesh import Mesh

MEMORY = ("param_bytes", "grad_bytes", "optim_bytes", "activation_peak_bytes")
MEASURED_ONLY = ("peak_resident_bytes", "device_peak_bytes", "process_bytes")  # predicted: the first


class DryRunTrainer(train.Trainer):
    """Every step updates the weights: the fake peers deliver nothing, so a gradient may hold anything,
    even a non-finite norm, and the update's memory (AdamW makes its state) is what is measured."""

    @staticmethod
    def updates(grad_norm):
        return True


def _arithmetic_operators():
    """The aten operators SkipArithmetic answers without computing: those of this PyTorch among the names."""
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_mm"] + [
        f"_scaled_dot_product_{kernel}_attention{part}" for kernel in ("flash", "efficient", "cudnn")
        for part in ("", "_backward")] + ["_scaled_dot_product_flash_attention_for_cpu",
                                          "_scaled_dot_product_flash_attention_for_cpu_backward"]
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


try:  # an internal module of PyTorch (torch.utils._python_dispatch, in every release from 2.0 to today's)
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # then the arithmetic runs: slower, the same memory and traffic
    TorchDispatchMode = None


class SkipArithmetic(TorchDispatchMode or object):
    """While active, the matrix products and attention kernels (`_arithmetic_operators`) return zeros shaped as
    their outputs: each operator runs on the meta device to learn its outputs' shapes, dtypes and strides,
    and the real device gets an allocation of each, zeroed (written, as the kernel would write it, so its
    pages are resident as they would be: filling is linear in the output, a product's work is not)."""

    operators = _arithmetic_operators()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.operators:
            return func(*args, **kwargs)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        on_meta = tree_map(lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a, (args, kwargs))
        shapes = func(*on_meta[0], **on_meta[1])
        return tree_map(lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device).zero_()
                        if isinstance(m, torch.Tensor) else m, shapes)


def join_fake_world(rank, world):
    """Join a process group of `world` ranks as `rank`, alone: the peers are PyTorch's fake ones."""
    try:  # an internal module of PyTorch's tests (in every release from 2.1 to today's)
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise cli.ConfigError(f"this PyTorch has no fake process group ({e})") from e
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def check_dry_run(args, rank, world, data=None):
    """The run's (model config, mesh shape), or a ConfigError: train.py's checks, and what a dry run cannot do
    (data: the data's DataInfo, as check_args takes it)."""
    checked = cli.check_args(args, world, data)
    if not 0 <= rank < world:
        raise cli.ConfigError(f"--rank {rank}: a rank of --world {world} is between 0 and {world - 1}")
    if args.resume:
        raise cli.ConfigError("--resume: a dry run starts from the initial values and writes nothing")
    return checked


@contextmanager
def planned_peers(args, rank, world):
    """Under --optimizer muon, muon.Assembly's all-gather of each optimizer's pieces over the stage (one an
    optimizer, at start-up) answered with every peer's, as tools/plan/ lays them out; this rank's own must
    be the planner's (a RuntimeError if not). An all-to-all this rank sends nothing in is left out: the fake
    process group refuses one that receives all the same (and its peers would deliver nothing)."""
    if args.optimizer != "muon":
        yield
        return
    layout = plan.layout_of(args, world)
    config = cli.model_config(args, cli.data_vocab_size(args))
    where = plan.coordinates(layout, rank)
    place, optimizers = plan.stage_place(layout, where), iter(plan.muon_held(config, layout, where["pp"]))
    fake_gather, fake_all_to_all = dist.all_gather_object, dist.all_to_all_single

    def gathered(everyone, held, group=None):
        if not (isinstance(held, list) and all(isinstance(s, muon.Segment) for s in held)):
            return fake_gather(everyone, held, group=group)  # (not Muon's)
        planned = next(optimizers)
        if planned[place] != held:
            raise RuntimeError(f"rank {rank}'s pieces of the matrices are not tools/plan/'s: {held} != "
                               f"{planned[place]}")
        everyone[:] = [planned[r] for r in range(len(everyone))]

    def all_to_all(output, input, *args, **kwargs):
        return fake_all_to_all(output, input, *args, **kwargs) if input.numel() else None
    dist.all_gather_object, dist.all_to_all_single = gathered, all_to_all
    try:
        yield
    finally:
        dist.all_gather_object, dist.all_to_all_single = fake_gather, fake_all_to_all


def balanced_choice(experts, n_experts):
    """A router's choice (tokens, top_k) replaced by balanced routing's: the rank's assignments handed to the
    experts in turn, (token i, choice j) to expert (i top_k + j) mod n_experts, so each expert gets the same
    share (exactly, where the experts divide the assignments) and a token's top_k experts differ."""
    return torch.arange(experts.numel(), device=experts.device).remainder(n_experts).view_as(experts)


@contextmanager
def balanced_experts():
    """While a dry run steps: ep.py's routing balanced (balanced_choice; the router's gates and probabilities,
    and what they keep for backward, are its own) and the collectives whose answers decide the shapes of
    what travels answered as balanced peers would: the all-to-all of tokens per expert (ep) and expert-tp's
    all-gather of them, the counts' integer tensors, with this rank's own."""
    route, all_to_all, all_gather = ep.route, dist.all_to_all_single, dist.all_gather

    def balanced_route(router_logits, top_k, *args, **kwargs):
        gates, experts, probs = route(router_logits, top_k, *args, **kwargs)
        return gates, balanced_choice(experts, router_logits.shape[-1]), probs

    def counts_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        if output_split_sizes is None and not input.is_floating_point():  # tokens per (source rank, expert)
            output.copy_(input)
            return None
        return all_to_all(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    def counts_all_gather(tensors, tensor, *args, **kwargs):
        if tensor.is_floating_point():
            return all_gather(tensors, tensor, *args, **kwargs)
        for received in tensors:  # rows per (source rank, expert) of each rank splitting the same experts
            received.copy_(tensor)
        return None
    ep.route, dist.all_to_all_single, dist.all_gather = balanced_route, counts_all_to_all, counts_all_gather
    try:
        yield
    finally:
        ep.route, dist.all_to_all_single, dist.all_gather = route, all_to_all, all_gather


def dry_run(args, rank, world, compute=False):
    """Build `rank`'s share of the run train.py would make of args on `world` ranks, take one step (the
    first: AdamW makes its state there), its arithmetic skipped unless `compute`; returns (measured,
    predicted): {field: value} of this rank, the prediction's peak_resident_bytes being tools/plan/'s peak
    of start-up and step (a dry run saves nothing). measured["process_bytes"] is the process's resident memory
    before the trainer builds anything (train.Trainer's): its own figure for what the plan's PROCESS_BYTES
    stands for, a typical value."""
    described = cli.describe_data(args)  # the data's meta.json, read once
    config, shape = check_dry_run(args, rank, world, described)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    join_fake_world(rank, world)
    try:
        with planned_peers(args, rank, world), balanced_experts():
            trainer = DryRunTrainer(args, config, Mesh(shape), open_data(described, args.seed), device)
            with nullcontext() if compute or TorchDispatchMode is None else SkipArithmetic():
                record = trainer.train_step(0)
    finally:
        dist.destroy_process_group()
    predicted = {field: values[rank] for field, values in plan.predict(args, world).items()
                 if field in MEMORY or field.startswith("comm_")}
    measured = {field: record[field] for field in (*predicted, *MEASURED_ONLY)}
    peaks = plan.predict_peaks(args, world)
    predicted["peak_resident_bytes"] = max(peaks["startup_peak_bytes"][rank], peaks["step_peak_bytes"][rank])
    return measured, predicted


def print_report(measured, predicted, rank, world):
    unit, size = ("GiB", 2**30) if measured["peak_resident_bytes"] >= 2**30 else ("MiB", 2**20)
    row = lambda name, *values: print(f"{name:30s}" + "".join(f"{v / size:12.3f}" for v in values))  # noqa: E731
    print(f"rank {rank} of {world} (its peers simulated: values meaningless, memory and traffic real)")
    print(f"{unit:30s}{'measured':>12s}{'tools/plan/':>12s}")
    for field in (*MEMORY, *(f for f in predicted if f.startswith("comm_") and (predicted[f] or measured[f]))):
        row(field, measured[field], predicted[field])
    row("sum of the four", sum(measured[f] for f in MEMORY), sum(predicted[f] for f in MEMORY))
    row("peak_resident_bytes", measured["peak_resident_bytes"], predicted["peak_resident_bytes"])
    row("  of which before building", measured["process_bytes"], plan.PROCESS_BYTES)  # (the plan's: typical)
    if measured["device_peak_bytes"]:
        row("device_peak_bytes", measured["device_peak_bytes"])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.dryrun", description=__doc__.split("\n")[0],
                                epilog="Every other flag is train.py's (python train.py --help).")
    p.add_argument("--world", type=int, required=True, help="ranks of the run")
    p.add_argument("--rank", type=int, default=0, help="the rank to run")
    p.add_argument("--json", action="store_true", help="print {measured: {...}, predicted: {...}}")
    p.add_argument("--compute", action="store_true",
                   help="compute the matrix products and attention too (slower; the same memory and traffic)")
    own, rest = p.parse_known_args(argv)
    args = cli.parse_args(rest)
    try:
        measured, predicted = dry_run(args, own.rank, own.world, own.compute)
    except cli.ConfigError as e:
        p.exit(2, f"python -m tools.dryrun: error: {e}\n")
    if own.json:
        print(json.dumps(dict(measured=measured, predicted=predicted)))
    else:
        print_report(measured, predicted, own.rank, own.world)


if __name__ == "__main__":
    main()
