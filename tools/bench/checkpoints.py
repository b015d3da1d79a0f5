"""Checkpoints, sharded (training/checkpoint.py) against consolidated (one file, as before): save and load,
their time and peak resident memory, beside the planner's predicted peaks."""
import json
import math
import os
import shutil
import statistics
import time

from tools.bench.common import reset_peak, status_kib, torchrun, worker_result


CHECKPOINT_RUN = ["--model", "gpt2-medium", "--zero", "3", "--batch-size", "4", "--seq-len", "32", "--steps", "1"]


def _phase(run):
    """(run's result, its seconds on the slowest rank, every rank's peak resident bytes during it)."""
    import torch
    import torch.distributed as dist
    dist.barrier()
    reset_peak()
    start = time.perf_counter()
    result = run()
    dist.barrier()
    seconds = time.perf_counter() - start
    peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([status_kib("VmHWM") * 1024.0], dtype=torch.float64))
    return result, seconds, [int(p.item()) for p in peaks]


class ConsolidatedFile:
    """The consolidated checkpoint (one torch.save file of model.py's state dict and the optimizer's state by
    parameter name), read through the interface train.py reads a sharded one by (checkpoint.Checkpoint)."""

    def __init__(self, path):
        import torch
        self.state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        self.step, self.skipped_steps, self.tensors = self.state["step"], 0, self.state["model"]
        self.steps = {name: state["step"].item() for name, state in self.state["optimizer"].items()}
        # A sharded checkpoint's also names the Hugging Face config a run began from (none here) and the run's
        # flags, of which train.py reads the optimizer: none named, AdamW's state, as this file's
        self.manifest = {"args": {}}

    def optimizer_keys(self, name):
        return sorted(key for key in self.state["optimizer"].get(name, {}) if key != "step")

    def read(self, name, key, positions):
        tensor = self.state["model"][name] if key == "model" else self.state["optimizer"][name][key]
        return tensor.reshape(-1)[positions.cpu()]

    def full(self, name):
        return self.state["model"][name]


def save_consolidated(trainer, path):
    """The checkpoint as one file, as this repository wrote it before sharded checkpoints (then gathered to
    every rank; here to rank 0 alone, the least a consolidated file needs): each rank in turn sends rank 0
    its pieces, which places them in the whole tensors and writes the file."""
    import torch
    import torch.distributed as dist
    from training import checkpoint
    pieces, layouts, steps = trainer.state.checkpoint_pieces()
    if dist.get_rank():
        for rank in range(1, dist.get_world_size()):
            dist.barrier()
            if rank == dist.get_rank():
                dist.send_object_list([[(p, t.detach().cpu()) for p, t in pieces], layouts, steps], dst=0)
        dist.barrier()
        return
    whole = {}

    def place(received):
        for piece, tensor in received:
            shape, split = layouts[piece.name]["shape"], layouts[piece.name]["split"]
            flat = whole.setdefault((piece.name, piece.key), torch.empty(math.prod(shape), dtype=tensor.dtype))
            if split is None:
                flat[piece.start:piece.end] = tensor
                continue
            where = checkpoint.in_parts(torch.arange(flat.numel()), shape, split)  # (tensor parallelism)
            lo = piece.part * (flat.numel() // split["parts"]) + piece.start
            mine = (where >= lo) & (where < lo + piece.end - piece.start)
            flat[mine] = tensor[where[mine] - lo]
    place([(p, t.detach().cpu()) for p, t in pieces])
    for rank in range(1, dist.get_world_size()):
        dist.barrier()
        received = [None, None, None]
        dist.recv_object_list(received, src=rank)
        layouts.update(received[1])
        steps.update(received[2])
        place(received[0])
        del received
    dist.barrier()
    model = {name: flat.view(layouts[name]["shape"]) for (name, key), flat in whole.items() if key == "model"}
    optimizer = {}
    for (name, key), flat in whole.items():
        if key != "model":
            optimizer.setdefault(name, {"step": torch.tensor(steps[name])})[key] = flat.view(layouts[name]["shape"])
    torch.save(dict(model=model, optimizer=optimizer, step=1), path)


def fingerprint(trainer):
    """The SHA-256 of this rank's pieces of the training state (weights and optimizer state), in order."""
    import hashlib
    import torch
    digest = hashlib.sha256()
    for piece, tensor in trainer.state.checkpoint_pieces()[0]:
        digest.update(repr(piece).encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def worker_checkpoint(settings):
    """gpt2-medium under ZeRO-3 on this launch's ranks, after one step: save and load its checkpoint,
    sharded (training/checkpoint.py) and consolidated (one file), alternately for a few rounds; per round, the
    slowest rank's seconds and every rank's peak resident memory, for each. The sharded save's time is
    until the files are complete; `blocking` is what training waits (the copy aside)."""
    import gc
    import torch
    import torch.distributed as dist
    from training import checkpoint
    from training import cli
    from training.data import open_data
    from tools import plan
    import train
    from mesh import Mesh
    world, device = dist.get_world_size(), torch.device("cpu")
    args = cli.parse_args([*CHECKPOINT_RUN, "--out", settings["out"]])
    described = cli.describe_data(args)
    config, shape = cli.check_args(args, world, described)
    mesh = Mesh(shape)
    data = open_data(described, args.seed)
    trainer, startup_s, startup_peaks = _phase(lambda: train.Trainer(args, config, mesh, data, device))
    _, step_s, step_peaks = _phase(lambda: trainer.train_step(0))
    saver = checkpoint.Saver(dist.new_group(backend="gloo"))
    sharded = os.path.join(settings["out"], "checkpoint-00000001")
    consolidated = os.path.join(settings["out"], "consolidated.pt")
    rounds = {kind: [] for kind in ("sharded save", "consolidated save", "sharded load", "consolidated load")}
    blocking = []
    for _ in range(settings["rounds"]):
        def save_sharded():
            start = time.perf_counter()
            trainer.save_checkpoint(saver, sharded, 1, keep=1)
            blocking.append(time.perf_counter() - start)
            saver.wait()
        rounds["sharded save"].append(_phase(save_sharded)[1:])
        rounds["consolidated save"].append(_phase(lambda: save_consolidated(trainer, consolidated))[1:])
    saved = fingerprint(trainer)
    trainer = None  # (its saves' closures above keep the name: dropped, not deleted)
    gc.collect()
    resumed = {}
    for _ in range(settings["rounds"]):
        for kind, path in (("sharded load", sharded), ("consolidated load", consolidated)):
            args.resume = path
            original = checkpoint.Checkpoint
            checkpoint.Checkpoint = original if kind == "sharded load" else ConsolidatedFile
            loaded, seconds, peaks = _phase(lambda: train.Trainer(args, config, mesh, data, device))
            checkpoint.Checkpoint = original
            rounds[kind].append((seconds, peaks))
            exact = torch.tensor([float(fingerprint(loaded) == saved)])
            dist.all_reduce(exact, op=dist.ReduceOp.MIN)
            resumed[kind] = bool(exact.item())
            del loaded
            gc.collect()
    predicted = plan.predict_peaks(cli.parse_args(CHECKPOINT_RUN), world)
    return dict(ranks=world, run=CHECKPOINT_RUN, rounds=settings["rounds"], startup=(startup_s, startup_peaks),
                step=(step_s, step_peaks), blocking_s=blocking, measured=rounds, resumed_exactly=resumed,
                bytes=dict(sharded=sum(os.path.getsize(os.path.join(sharded, f)) for f in os.listdir(sharded)),
                           consolidated=os.path.getsize(consolidated)),
                predicted={k: v for k, v in predicted.items()})


def checkpoint_comparison(out, rounds=2, ranks=4):
    """worker_checkpoint on `ranks` ranks, summarised: per kind the median seconds over rounds and the largest
    peak over ranks and rounds, beside tools/plan/'s predicted peaks."""
    print(f"bench: checkpoints, sharded and consolidated, {ranks} ranks", flush=True)
    settings = dict(out=os.path.join(out, "checkpoint"), rounds=rounds)
    os.makedirs(settings["out"], exist_ok=True)
    stdout = torchrun(ranks, "-m", "tools.bench", "--worker", "checkpoint", "--settings", json.dumps(settings))
    result = worker_result(stdout)
    summary = {kind: dict(seconds=statistics.median(s for s, _ in values), seconds_range=[
        min(s for s, _ in values), max(s for s, _ in values)], peak_bytes=max(max(p) for _, p in values))
        for kind, values in result["measured"].items()}
    summary["sharded save"]["blocking_seconds"] = statistics.median(result["blocking_s"])
    for phase in ("startup", "step"):
        summary[phase] = dict(seconds=result[phase][0], peak_bytes=max(result[phase][1]))
    shutil.rmtree(settings["out"], ignore_errors=True)
    return dict(result, summary=summary)
