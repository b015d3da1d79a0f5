"""Part 2: each dimension beside PyTorch's built-in, alternately in the same processes (run under torchrun:
python -m tools.bench --worker NAME): dp.py and DDP, ZeRO-3 and FSDP2, tp.py and DTensor, pp.py and pipelining."""
import copy
import json
import statistics
import time

from tools.bench.common import paired_ratio, torchrun, worker_result


def _gpt(settings, seed=0):
    import torch
    from training import cli
    import train
    args = cli.parse_args(["--model", settings["model"]])
    config = cli.model_config(args, cli.PRESETS[settings["model"]]["vocab_size"])
    return train.build_model(config, seed, torch.float32, torch.device("cpu")), args


def _batches(settings, args, n, rank, world):
    from training.data import MarkovLanguage
    from training import cli
    import train
    data = MarkovLanguage(cli.PRESETS[settings["model"]]["vocab_size"])
    for step in range(n):
        tokens = data.batch("train", step, settings["batch_size"], args.seq_len)
        yield next(train.local_micro_batches(tokens, 1, world, rank))


def _alternate(settings, arms):
    """Time `rounds` rounds of k steps of each arm, rotating their order every round.

    arms: {name: step}, where step(i) trains on batch i and returns the loss. The machine's speed
    drifts, so timings taken back to back in the same round are set against each other (see
    paired_ratio). A first, untimed round warms every arm up. Returns ({name: seconds per step, a list
    over rounds}, {name: losses, in step order}).
    """
    import torch.distributed as dist
    names = list(arms)
    times = {name: [] for name in names}
    losses = {name: [] for name in names}
    for r in range(settings["rounds"] + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            for i in range(settings["k"]):
                losses[name].append(arms[name](r * settings["k"] + i))
            dist.barrier()
            if r:
                times[name].append((time.perf_counter() - start) / settings["k"])
    return times, losses


def _against_builtin(settings, ours, theirs):
    """ours and theirs alternated: their median step times, the ratio, the largest loss difference."""
    times, losses = _alternate(settings, {"ours": ours, "builtin": theirs})
    return _report(times, losses)


def _report(times, losses):
    ratio, ratio_range = paired_ratio(times)
    return dict(ours_step_s=statistics.median(times["ours"]), builtin_step_s=statistics.median(times["builtin"]),
                ratio=ratio, ratio_range=ratio_range,
                max_loss_difference=max(abs(a - b) for a, b in zip(losses["ours"], losses["builtin"])))


def n_batches(settings):
    return (settings["rounds"] + 1) * settings["k"]


def _sgd_step(model, optimizer, inputs, targets, sync=None):
    _, loss = model(inputs, targets)
    loss.backward()
    if sync:
        sync()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return loss.item()


def worker_ddp(settings):
    """dp.py's DataParallel against DistributedDataParallel, and against the same ranks not communicating.

    The third arm trains a copy on each rank's share of the batch with no gradient exchange at all
    (each rank drifts its own way): what dp.py's step costs beyond it is the whole price of data
    parallelism on these ranks, apart from waiting for the slower one.
    """
    import torch
    import torch.distributed as dist
    from dp import DataParallel
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, args = _gpt(settings)
    theirs, alone = copy.deepcopy(ours), copy.deepcopy(ours)
    data = list(_batches(settings, args, n_batches(settings), rank, world))
    sync = DataParallel(ours.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(theirs)
    opt_ours, opt_theirs, opt_alone = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs, alone))
    times, losses = _alternate(settings, {
        "ours": lambda i: _sgd_step(ours, opt_ours, *data[i], sync.finish_grad_sync),
        "builtin": lambda i: _sgd_step(ddp, opt_theirs, *data[i]),
        "no_communication": lambda i: _sgd_step(alone, opt_alone, *data[i])})
    result = _report(times, losses)
    result["no_communication_step_s"] = statistics.median(times["no_communication"])
    over = paired_ratio(times, theirs="no_communication")
    result["over_no_communication"], result["over_no_communication_range"] = over
    return result


def _zero_step(model, zero, inputs, targets):
    _, loss = model(inputs, targets)
    loss.backward()
    zero.finish_grad_sync()
    zero.step()
    zero.zero_grad()
    return loss.item()


def worker_fsdp(settings):
    """dp.py's ZeRO-3 against FSDP2's fully_shard, one unit per block (and the rest)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from dp import ZeRO3, gpt_units
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, args = _gpt(settings)
    theirs = copy.deepcopy(ours)
    data = list(_batches(settings, args, n_batches(settings), rank, world))
    zero = ZeRO3(ours, None, lambda shards: torch.optim.AdamW(shards, lr=1e-3), units=gpt_units(ours))
    mesh = init_device_mesh("cpu", (world,))
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    return _against_builtin(settings, lambda i: _zero_step(ours, zero, *data[i]),
                            lambda i: _sgd_step(theirs, opt_theirs, *data[i]))


def worker_tp(settings):
    """tp.py's column/row-parallel blocks against DTensor's parallelize_module with the same plan."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import tp
    world = dist.get_world_size()
    ours, args = _gpt(settings)
    theirs = copy.deepcopy(ours)
    data = list(_batches(settings, args, n_batches(settings), 0, 1))  # tp ranks share data
    plan = tp.TensorParallel(None)  # the default group, without sequence parallelism
    for block in ours.blocks:
        block.attn.qkv = tp.ColumnParallelLinear(block.attn.qkv, plan, blocks=[ours.config.d_model] * 3)
        block.attn.proj = tp.RowParallelLinear(block.attn.proj, plan)
        block.mlp.fc = tp.ColumnParallelLinear(block.mlp.fc, plan)
        block.mlp.proj = tp.RowParallelLinear(block.mlp.proj, plan)
    mesh = init_device_mesh("cpu", (world,))
    for block in theirs.blocks:
        # ColwiseParallel splits the output features contiguously: lay each rank's q, k and v heads side by side.
        with torch.no_grad():
            for t in (block.attn.qkv.weight, block.attn.qkv.bias):
                t.copy_(t.view(3, world, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape))
        parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                         "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    opt_ours, opt_theirs = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs))
    return _against_builtin(settings, lambda i: _sgd_step(ours, opt_ours, *data[i]),
                            lambda i: _sgd_step(theirs, opt_theirs, *data[i]))


def worker_pp(settings, schedule):
    """pp.py's schedule against torch.distributed.pipelining's, on the same split: one stage a rank, or (ZB-V)
    two in a V."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
    import pp
    rank, world = dist.get_rank(), dist.get_world_size()
    n_micro, n_chunks = settings["micro_batches"], 2 if schedule == "zbv" else 1
    ours, args = _gpt(settings)
    theirs = copy.deepcopy(ours)
    data = list(_batches(settings, args, n_batches(settings), 0, 1))  # stages share data
    placement = pp.Placement.of(schedule, world, n_chunks)
    our_chunks = pp.apply_pipeline_parallel(ours, None, placement)
    their_chunks = pp.apply_pipeline_parallel(theirs, None, placement)

    class Stage(torch.nn.Module):  # a PipelineStage runs a module holding its own weights
        def __init__(self, chunk):
            super().__init__()
            self.held, self.chunk = torch.nn.ModuleList(chunk.modules()), chunk

        def forward(self, x):
            return self.chunk(x)

    model_chunks = placement.model_chunks(rank)
    stages = [PipelineStage(Stage(chunk), k, placement.n_model_chunks, torch.device("cpu"))
              for k, chunk in zip(model_chunks, their_chunks)]
    if schedule == "zbv":
        builtin = ScheduleZBVZeroBubble(stages, n_micro, loss_fn=theirs.loss_fn)
    elif schedule == "zb1":  # PyTorch's zero-bubble schedule for one stage per rank: ZB-H1's (a list of stages)
        builtin = ScheduleInterleavedZeroBubble(stages, n_micro, loss_fn=theirs.loss_fn)
    else:
        builtin = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule](stages[0], n_micro, loss_fn=theirs.loss_fn)
    schedules = [pp.make_schedule(schedule, n_micro, world, r, n_chunks) for r in range(world)]
    micro = settings["batch_size"] // n_micro
    shape = (micro, args.seq_len, ours.config.d_model)
    opt_ours, opt_theirs = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs))

    def shared_loss(losses):  # the last stage's mean loss, on every rank
        t = torch.tensor([sum(losses) / n_micro if losses else 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        return t.item()

    def ours_step(i):
        inputs, targets = data[i]
        micro_batches = list(zip(inputs.chunk(n_micro), targets.chunk(n_micro)))
        losses, _ = pp.run_schedule(schedules, our_chunks, micro_batches, ours.loss_fn, None, shape,
                                    torch.float32, torch.device("cpu"), placement=placement)
        opt_ours.step()
        opt_ours.zero_grad()
        return shared_loss(losses)

    def theirs_step(i):
        inputs, targets = data[i]
        losses = []
        first, last = 0 in model_chunks, placement.n_model_chunks - 1 in model_chunks
        builtin.step(*([inputs] if first else []), **(dict(target=targets, losses=losses) if last else {}))
        opt_theirs.step()
        opt_theirs.zero_grad()
        return shared_loss([loss.item() for loss in losses])
    return _against_builtin(settings, ours_step, theirs_step)


WORKERS = {  # name: (ranks, worker)
    "ddp": (2, worker_ddp),
    "fsdp": (2, worker_fsdp),
    "tp": (2, worker_tp),
    "pp_1f1b": (2, lambda settings: worker_pp(settings, "1f1b")),
    "pp_gpipe": (2, lambda settings: worker_pp(settings, "gpipe")),
    "pp_zb1": (2, lambda settings: worker_pp(settings, "zb1")),
    "pp_zbv": (2, lambda settings: worker_pp(settings, "zbv")),
}


def run_comparisons(settings, out, names=None):
    results = {}
    for name, (world, _) in WORKERS.items():
        if names and name not in names:
            continue
        print(f"bench: {name} against the built-in ({world} ranks)", flush=True)
        stdout = torchrun(world, "-m", "tools.bench", "--worker", name, "--settings", json.dumps(settings))
        results[name] = worker_result(stdout)
    return results
