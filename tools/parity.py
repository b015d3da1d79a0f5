"""A layout against one process, gradient by gradient: is this layout (or my change) training the same model?

    python -m tools.parity --world 4 --model tiny --tp 2 --pp 2
    python -m tools.parity --world 8 --init-from Llama-3.2-1B --layers 2 --seq-len 64 --tp 2 --cp 2 --zero 1 --steps 2
    python -m tools.parity --world 4 --init-from Qwen3-30B-A3B --layers 2 --seq-len 64 --tp 2 --ep 2 --hf-roundtrip
    python -m tools.fuzz 20 --seed 7                # 20 random layouts, each as above (tools/fuzz.py)

Takes train.py's flags and --world, the number of ranks. Runs --steps steps (default 1) of that layout on
--world processes of this machine (gloo, so no GPU is needed; point-to-point messages matched by their order
alone, as NCCL matches them) and the same steps on one process, both in float64, from the same initial
weights (model.py's, or the --init-from folder's) and on the same batches. It prints the loss of each step
side by side, then one row per parameter (its name, shape and the dimensions that split or shard it): the
largest difference of its gradient (synchronised, before clipping) and of its weight after the update, as
an absolute figure and relative to the parameter's largest magnitude, and the first step at which either
left the tolerance; the worst rows first.

It exits with status 1 when any element is off by more than atol + rtol |expected| (float64: the order of
a sum alone moves a value by about 1e-16 of its magnitude, hence rtol 1e-9), naming the dimensions whose
groups touch the worst parameter; 2 for flags train.py refuses; 3 when the layout raised, died or hung on
some rank (its error printed). A piece of a gradient that two ranks hold (replicas of data parallelism, the
copies of tensor parallelism) must be the same on both; where it is not, that is reported too.

With --hf-roundtrip the layout also saves its checkpoint after the steps (each rank its pieces, as train.py
does), tools/convert.py exports it as a Hugging Face folder, and training/hf.py reads it back: every tensor
must equal one process's (the same tolerance), none missing and none extra, and config.json must be the
folder's the run started from (or the one its model implies) and read back as the same model; each tensor
off is named (model.py's name and the Hugging Face ones), and the exit status is 1. A converter that drops
or misplaces experts under ep, expert-tp or folding, or writes a tied output layer twice, fails here.

The dimension files are imported from the working tree, so an edit to one of them is what is checked. The
one process is `reference_steps`, the single device's training written out (the tests' oracle is it too).
"""
import argparse
import dataclasses
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import ep
import model as model_lib
import train
from mesh import Mesh
from tools import convert
from training import checkpoint, cli, fp8, hf
from training.data import open_data
from training.local import run_on_ranks

PROG = "python -m tools.parity"
RTOL, ATOL = 1e-9, 1e-12


# ---------------------------------------------------------------------------
# One process: the single device's training, written out
# ---------------------------------------------------------------------------

def reference_steps(argv, skipped_steps=(), record=False):
    """Train on one process in float64 from train.py's flags argv: {losses, grad_norms (before clipping),
    state_dict (after the last step)}, and with `record` each step's gradients and state dict ({name: tensor}).
    It shares with train.py only the definition of the experiment (the flags, the initial weights, the
    optimizer's hyper-parameters, the learning-rate schedule, the batches); the loop is written out here, as
    simply as it can be, so that a bug in train.py cannot hide in both. The steps in skipped_steps make no
    update (as train.py skips a step whose gradient is not finite)."""
    args = cli.parse_args([*argv, "--dtype", "float64"])
    data = train.load_training_data(args)
    config = cli.model_config(args, data.vocab_size)
    model = train.build_model(config, args.seed, torch.float64, torch.device("cpu"))
    if args.init_from:  # a Hugging Face folder's weights (read whole, as one device can)
        model.load_state_dict(hf.load_state_dict(args.init_from, config))
    if args.fp8:  # the same float8 products, on the one device's tensors
        fp8.apply_fp8(model, args.fp8)
    optimizer = train.single_device_optimizer(model, args)
    eos_id = cli.document_eos(args, data=data.info)  # packed documents, each ended by it (None: one sequence each)
    result = dict(losses=[], grad_norms=[], gradients=[], weights=[])
    for step in range(args.steps):
        tokens = data.batch("train", step, args.batch_size, args.seq_len)
        counted = data.loss_mask("train", step, args.batch_size, args.seq_len)  # None: every target counts
        if counted is None:
            counted = torch.ones_like(tokens, dtype=torch.bool)
        step_loss = 0.0
        for micro, micro_counted in zip(tokens.chunk(args.micro_batches), counted.chunk(args.micro_batches)):
            loss = micro_batch_loss(model, micro, micro_counted, eos_id, tokens, counted) / args.micro_batches
            loss.backward()
            step_loss += loss.item()
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(step, args)
        if record:
            result["gradients"].append({name: p.grad.clone() for name, p in model.named_parameters()
                                        if p.grad is not None})
        result["grad_norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item())
        if step not in skipped_steps:
            optimizer.step()
        optimizer.zero_grad()  # to None: a parameter without a gradient next step (an unused expert) is skipped
        model_lib.end_moe_step(model)  # MoE routing biases move towards balance (--balance bias)
        result["losses"].append(step_loss)
        if record:
            result["weights"].append({name: t.clone() for name, t in model.state_dict().items()})
    result["state_dict"] = model.state_dict()
    return result


def micro_batch_loss(model, micro, counted, eos_id, batch, batch_counted):
    """The loss of one micro-batch of tokens `micro`, times the micro-batches: its summed loss over the targets
    that count (those the data's loss mask `counted` keeps and, with packed documents, not predicted at an
    EOS), divided by those of the whole `batch` over the micro-batches (so the step's loss is the mean over
    every counted target of the batch; without a mask or documents, the mean over its targets)."""
    if eos_id is None and batch_counted.all():
        return model(micro[:, :-1], micro[:, 1:])[1]
    inputs, targets = micro[:, :-1], micro[:, 1:].masked_fill(~counted[:, 1:], model_lib.IGNORE)
    counts = batch_counted[:, 1:]
    documents = None
    if eos_id is not None:
        targets = targets.masked_fill(inputs == eos_id, model_lib.IGNORE)
        counts = counts & (batch[:, :-1] != eos_id)
        documents = model_lib.document_ids(inputs, eos_id)
    micro_batches = len(batch) // len(inputs)
    return model(inputs, targets, documents=documents, loss_tokens=max(1, counts.sum().item()) / micro_batches)[1]


# ---------------------------------------------------------------------------
# The layout: train.py's Trainer on local ranks, each step's gradients gathered whole
# ---------------------------------------------------------------------------

class ParityTrainer(train.Trainer):
    """train.py's Trainer, keeping each step's gradients (this rank's pieces, synchronised, before clipping)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gradient_pieces = []

    def update(self, step):
        self.gradient_pieces.append(self.held_gradients())
        return super().update(step)

    def held_gradients(self):
        """[(name, full shape, flat positions in the full tensor, values)] of every gradient piece held here."""
        shapes, held = {name: p.shape for name, p in self.model.named_parameters()}, []
        for optimizer in self.optimizers:
            for held_as, start, end, grad in optimizer.gradient_pieces():
                if grad is not None:  # an expert no token reached on any rank: no gradient, as on one device
                    positions = self.share.positions(held_as, shapes[held_as], start, end)
                    held.append((self.share.name(held_as), self.share.full_shape(held_as, shapes[held_as]),
                                 positions.cpu(), grad.detach().reshape(-1).to("cpu", torch.float64).clone()))
        return held

    def splits(self):
        """{parameter name: the dimensions that split, shard or place it on this rank (tp-copies: whole on each
        tensor-parallel rank, as norms and routers are, whose gradients are summed over them; expert-tp: an
        expert's slice, whole otherwise; stageS: the pipeline stage holding it; hybrid: ZeRO's shards summed
        across their copies)}."""
        labels = {}
        for name, _ in self.model.named_parameters():
            group = self.share.split_group(name)  # tp, or expert_tp for an expert's
            split_by = group.replace("_", "-")
            labels[self.share.name(name)] = {dim for dim, applies in [
                (split_by, name in self.tp_layouts),
                (f"{split_by}-copies", name not in self.tp_layouts and self.mesh.size(group) > 1),
                ("ep", ep.is_expert_parameter(name) and self.mesh.size("ep") > 1),
                (f"stage{self.mesh.index('pp')}", self.mesh.size("pp") > 1),
                (f"zero{self.args.zero}", self.args.zero > 0),
                ("hybrid", self.mesh.shape.hybrid),  # (ZeRO's shards over --dp-shard ranks, copies across)
                ("tied", self.share.name(name) != name)] if applies}
        return labels


def layout_worker(argv, steps, save_to=None):
    """The layout of train.py's flags argv on this rank's process group, `steps` steps: on rank 0 {losses,
    gradients, weights (per step), splits, disagreements}, elsewhere None; with save_to (a folder), its
    checkpoint after the steps saved there, as train.py saves one."""
    args = cli.parse_args([*argv, "--dtype", "float64"])
    described = cli.describe_data(args)  # the data's meta.json, read once
    config, shape = cli.check_args(args, dist.get_world_size(), described)
    trainer = ParityTrainer(args, config, Mesh(shape), open_data(described, args.seed), torch.device("cpu"))
    losses, weights = [], []
    for step in range(steps):
        every_rank = [None] * dist.get_world_size()  # each rank's share of the step's loss
        dist.all_gather_object(every_rank, trainer.train_step(step)["loss"])
        losses.append(train.step_loss(args, every_rank))
        weights.append(trainer.state.full_state_dict())
    if save_to:
        saver = checkpoint.Saver(dist.new_group(backend="gloo"))
        trainer.save_checkpoint(saver, checkpoint.path_for(save_to, steps), steps, keep=1)
        saver.wait()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (trainer.gradient_pieces, trainer.splits()))
    if dist.get_rank():
        return None
    gradients, disagreements = assemble([pieces for pieces, _ in everyone], steps)
    splits = {}
    for _, labels in everyone:
        for name, dims in labels.items():
            splits.setdefault(name, set()).update(dims)
    return dict(losses=losses, gradients=gradients, weights=weights, splits=splits, disagreements=disagreements)


def assemble(pieces_of_ranks, steps):
    """(per step {name: full gradient}, [(step, name, largest difference)] where two ranks' copies of the same
    elements differ), from every rank's pieces."""
    gradients, disagreements = [], []
    for step in range(steps):
        full, written = {}, {}
        for pieces in pieces_of_ranks:
            for name, shape, positions, values in pieces[step]:
                flat = full.setdefault(name, torch.zeros(shape, dtype=torch.float64)).view(-1)
                seen = written.setdefault(name, torch.zeros(flat.numel(), dtype=torch.bool))
                again = seen[positions]
                if again.any():
                    gap = (flat[positions][again] - values[again]).abs().max().item()
                    if gap > ATOL + RTOL * values[again].abs().max().item():
                        disagreements.append((step, name, gap))
                flat[positions] = values
                seen[positions] = True
        gradients.append(full)
    return gradients, disagreements


# ---------------------------------------------------------------------------
# The comparison, a row per parameter
# ---------------------------------------------------------------------------

def difference(got, expected):
    """(largest |got - expected|, that relative to expected's largest magnitude, whether any element is off by
    more than ATOL + RTOL |expected|)."""
    gap = (got - expected).abs()
    scale = expected.abs().max().item() or 1.0
    within = gap <= ATOL + RTOL * expected.abs()  # (a NaN is not within)
    return gap.max().item(), gap.max().item() / scale, not bool(within.all())


def compare(layout, reference):
    """[row] of every tensor: {name, shape, splits, gradient (abs, rel), weight (abs, rel), diverged: first
    step off (None)}, worst first."""
    rows = []
    for name, expected in reference["weights"][-1].items():
        row = dict(name=name, shape=tuple(expected.shape), splits=sorted(layout["splits"].get(name, ())),
                   gradient=(0.0, 0.0), weight=(0.0, 0.0), diverged=None)
        for step, (gradients, weights) in enumerate(zip(reference["gradients"], reference["weights"])):
            for kind, got, want in [("gradient", layout["gradients"][step].get(name), gradients.get(name)),
                                    ("weight", layout["weights"][step].get(name), weights.get(name))]:
                if want is None and got is None:  # an expert no token reached, on both sides
                    continue
                if want is None or got is None:  # a gradient one side has and the other has not
                    absolute, relative, off = math.inf, math.inf, True
                else:
                    absolute, relative, off = difference(got, want)
                row[kind] = max(row[kind], (absolute, relative), key=lambda pair: pair[1])
                if off and row["diverged"] is None:
                    row["diverged"] = step
        rows.append(row)
    return sorted(rows, key=lambda r: (r["diverged"] is None, -max(r["gradient"][1], r["weight"][1])))


def report(layout, reference, rows, steps):
    """Print the losses and the rows; returns whether every row is within the tolerance."""
    print(f"{'step':>4s} {'loss, layout':>22s} {'loss, one process':>22s} {'difference':>12s}")
    for step in range(steps):
        a, b = layout["losses"][step], reference["losses"][step]
        print(f"{step:4d} {a:22.15f} {b:22.15f} {abs(a - b):12.3e}")
    print(f"\n{'parameter':44s} {'shape':16s} {'split by':22s} {'grad abs':>9s} {'grad rel':>9s} "
          f"{'weight abs':>10s} {'weight rel':>10s}  diverged")
    for r in rows:
        print(f"{r['name']:44s} {str(list(r['shape'])):16s} {','.join(r['splits']) or '-':22s} "
              f"{r['gradient'][0]:9.1e} {r['gradient'][1]:9.1e} {r['weight'][0]:10.1e} {r['weight'][1]:10.1e}  "
              f"{'step ' + str(r['diverged']) if r['diverged'] is not None else '-'}")
    for step, name, gap in layout["disagreements"]:
        print(f"step {step}: ranks holding the same elements of {name}'s gradient disagree by up to {gap:.3e}")
    off = [r for r in rows if r["diverged"] is not None]
    if off:
        worst = off[0]
        held = ", ".join(worst["splits"]) or "whole on every rank"
        print(f"\n{PROG}: {len(off)} of {len(rows)} tensors differ beyond rtol {RTOL:g}, atol {ATOL:g}; the worst, "
              f"{worst['name']}, from step {worst['diverged']}, is held as: {held}; look there first")
    else:
        print(f"\n{PROG}: every tensor within rtol {RTOL:g}, atol {ATOL:g} of one process, at every step")
    return not off and not layout["disagreements"]


# ---------------------------------------------------------------------------
# The round trip through a Hugging Face folder
# ---------------------------------------------------------------------------

def roundtrip(saved, folder, expected_state):
    """Export checkpoint `saved` as a Hugging Face folder and read it back: ([(what, problem)] of every tensor or
    config setting that did not come back as one process has it (expected_state: its final state dict), the
    number of Hugging Face tensors read)."""
    manifest = checkpoint.Checkpoint(saved).manifest
    config, source = model_lib.GPTConfig(**manifest["model"]), manifest["args"].get("init_from")
    try:
        convert.export_hf(saved, folder)
    except hf.UnsupportedModel as e:  # (a routing bias moved by --balance bias: no Hugging Face tensor holds it)
        return [("the export", str(e))], 0
    exported = hf.read_config(folder)
    expected_config = hf.with_layers(hf.read_config(source), config.n_layer) if source else hf.hf_from_config(config)
    problems = config_problems(exported, expected_config, config)
    values, names = hf.HuggingFaceValues(folder, config), set()
    with torch.device("meta"):
        model = model_lib.GPT(config)
    # the parameters, and the buffers the folder holds (DeepSeek-V3's routing biases; the others' have no Hugging
    # Face tensor, and export refuses nonzero ones)
    parameters = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    parameters += hf.saved_buffers(model, exported["model_type"])
    for name in parameters:
        try:
            parts = hf.source(exported["model_type"], model_lib.tied_name(name, config), config)
        except hf.UnsupportedModel as e:  # the exported model_type has no such tensor
            problems.append((name, str(e)))
            continue
        names.update(parts.names)
        problem = tensor_problem(values, name, expected_state[name][:real_rows(name, config)])
        if problem:
            problems.append((f"{name} ({', '.join(parts.names)})", problem))
    problems += [(entry, "in the folder, but no tensor of the model is made of it (written twice, or stray)")
                 for entry in sorted(set(values.folder.file_of) - names)]
    return problems, len(names)


def real_rows(name, config):
    """The rows a folder holds of model.py's tensor: the vocabulary tables' without their padding rows."""
    return config.vocab_size if name in ("tok_emb.weight", "lm_head.weight") else None


def tensor_problem(values, name, expected):
    """Why model.py's `name`, read back from the folder, is not `expected` (None: it is, to the tolerance)."""
    try:
        got = values.parameter(name, torch.arange(expected.numel())).view(expected.shape)
    except hf.UnsupportedModel as e:  # a Hugging Face tensor it is made of is not in the folder
        return f"missing: {e}"
    except (RuntimeError, ValueError) as e:  # its parts are shaped otherwise than model.py's tensor
        return f"unreadable as {list(expected.shape)}: {e}"
    absolute, relative, off = difference(got, expected.to(torch.float64))
    return f"differs by up to {absolute:.3e} ({relative:.1e} of its largest magnitude)" if off else None


def config_problems(exported, expected, config):
    """[(what, problem)] where the exported config.json is not `expected` (the folder's the run started from, or
    the one its model implies), beside the architecture and the dtype, or does not read back as `config`."""
    written_apart = ("architectures", "torch_dtype", "dtype")
    problems = [(f"config.json's {key}", f"{exported.get(key)!r}, where {expected.get(key)!r} was expected")
                for key in sorted(set(exported) | set(expected))
                if key not in written_apart and exported.get(key) != expected.get(key)]
    architecture = [hf.ARCHITECTURES.get(exported.get("model_type"))]
    if exported.get("architectures") != architecture:
        problems.append(("config.json's architectures", f"{exported.get('architectures')}, not {architecture}"))
    training = {field: getattr(config, field) for field in ("aux_loss_coef", "bias_update_rate")}
    try:
        read_back = hf.config_from_hf(exported, config.seq_len, **training)
    except (hf.UnsupportedModel, KeyError) as e:
        return problems + [("config.json", f"does not read back: {e}")]
    fields = dataclasses.asdict(read_back)
    problems += [(f"config.json as model.py's {field}", f"{fields[field]!r}, where the run had {value!r}")
                 for field, value in dataclasses.asdict(config).items() if fields[field] != value]
    return problems


def report_roundtrip(problems, read, steps):
    """Print the round trip's outcome; returns whether every tensor and setting came back."""
    print(f"\nHugging Face round trip: the layout's checkpoint after step {steps - 1}, exported (tools/convert.py "
          f"to-hf) and read back (training/hf.py)")
    for what, problem in problems:
        print(f"  {what}: {problem}")
    if problems:
        print(f"{PROG}: the round trip lost or changed {len(problems)} tensors or settings; the first: "
              f"{problems[0][0]}")
    else:
        print(f"{PROG}: every tensor came back within rtol {RTOL:g}, atol {ATOL:g} of one process ({read} Hugging "
              f"Face tensors, none missing, none extra), and config.json as expected")
    return not problems


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                epilog="Every other flag is train.py's (python train.py --help).")
    p.add_argument("--world", type=int, required=True, help="ranks of the layout, processes of this machine")
    p.add_argument("--steps", type=int, default=1, help="steps compared (each one's gradients and weights)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a hung layout is stopped")
    p.add_argument("--hf-roundtrip", action="store_true",
                   help="also export the layout's checkpoint after the steps as a Hugging Face folder, read it back "
                        "and compare every tensor and config.json with one process's")
    own, rest = p.parse_known_args(argv)
    argv = [*rest, "--steps", str(own.steps)]
    try:
        config, _ = cli.check_args(cli.parse_args([*argv, "--dtype", "float64"]), own.world)
        if cli.parse_args(argv).capacity_factor:
            raise cli.ConfigError("--capacity-factor drops the tokens past a rank's capacity, which depend on how "
                                  "the layout splits them; the one process it is compared with is dropless (ep.py's "
                                  "capacity is tested on its own, tests/test_ep.py)")
        if own.hf_roundtrip and not cli.parse_args(argv).init_from:
            hf.hf_from_config(config)  # a model no Hugging Face architecture here has: refused before the run
    except (cli.ConfigError, hf.UnsupportedModel) as e:
        p.exit(2, f"{PROG}: error: {e}\n")
    with tempfile.TemporaryDirectory(prefix="parity-") as scratch:
        save_to = scratch if own.hf_roundtrip else None
        try:
            layout = run_on_ranks(own.world, layout_worker, argv, own.steps, save_to, timeout=own.timeout)[0]
        except (RuntimeError, TimeoutError) as e:  # a rank raised, died or hung: no comparison to make
            print(f"{PROG}: the layout did not finish its steps:\n{e}", file=sys.stderr)
            return 3
        reference = reference_steps(argv, record=True)
        same = report(layout, reference, compare(layout, reference), own.steps)
        if save_to:
            problems, read = roundtrip(checkpoint.path_for(save_to, own.steps), os.path.join(scratch, "hf"),
                                       reference["state_dict"])
            same = report_roundtrip(problems, read, own.steps) and same
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
