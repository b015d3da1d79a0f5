"""Checkpoints to and from the forms other tools read, one tensor at a time.

    python -m tools.convert to-file runs/x/checkpoint-00000100 model.safetensors [--weights-only]
    python -m tools.convert from-file model.safetensors runs/y
    python -m tools.convert to-hf runs/x llama-continued [--dtype bfloat16]

A checkpoint is named by its folder, or by its run's folder for the newest complete, undamaged one.
to-file: a sharded checkpoint of any layout (training/checkpoint.py) as one safetensors file in
model.py's state-dict layout: the weights, for inference and other tools, and unless --weights-only the
optimizer's state too, under "optimizer.<key>.<name>", with the step counts in its metadata.
from-file: such a file back into a checkpoint of a run's folder, to --resume from (a file of weights
alone imports as step 0, a fresh optimizer). Export, import and export again gives the same bytes.
to-hf: a checkpoint of any layout as a Hugging Face model folder (training/hf.py reads such folders):
each of model.py's tensors cut back into the Hugging Face tensors it was made of (and DeepSeek-V3's
routing biases, buffers of model.py's, into e_score_correction_bias), in files of at most
5 GB with their index, the config.json the run started from (or one made for its model), and the
tokenizer's files the run trained with (tokenizer.json and its configs, where the run recorded one).
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import sys
from functools import lru_cache

import torch

from model import GPT, GPTConfig
from training import hf
from training.checkpoint import HASH_CHUNK, BadCheckpoint, Checkpoint, checkpoint_at, path_for, write_manifest
from training.tensorfile import TORCH_DTYPES, DamagedFile, SafetensorsFile, write_safetensors
from training.hf import ARCHITECTURES, UnsupportedModel, hf_from_config
from training.tokenizer import TOKENIZER_FILES, folder_of_run


# ---------------------------------------------------------------------------
# One safetensors file in model.py's state-dict layout, and back
# ---------------------------------------------------------------------------

def export(path, out, weights_only=False):
    """Write the checkpoint at path as one safetensors file, a tensor at a time (see the module's docstring)."""
    saved = Checkpoint(checkpoint_at(path))
    entries = []
    for name, layout in saved.tensors.items():
        keys = ["model"] + ([] if weights_only else saved.optimizer_keys(name))
        for key in keys:
            entry = name if key == "model" else f"optimizer.{key}.{name}"
            shape, dtype = torch.Size(layout["shape"]), TORCH_DTYPES[layout["dtype"]]
            entries.append((entry, (shape, dtype, lambda name=name, key=key: saved.full(name, key))))
    entries.sort(key=lambda e: -e[1][1].itemsize)
    metadata = dict(step=str(saved.step), skipped_steps=str(saved.skipped_steps),
                    args=json.dumps(saved.manifest["args"]))
    if not weights_only:
        metadata["optimizer_steps"] = json.dumps(saved.steps)
    write_safetensors(out, entries, metadata)


def import_file(file, run_dir):
    """Make a checkpoint of run_dir from one safetensors file in model.py's state-dict layout (export's, or
    weights alone: the run then starts at step 0 with a fresh optimizer). Returns its path."""
    plain = SafetensorsFile(file)
    meta = plain.metadata
    try:
        step, skipped = int(meta.get("step", 0)), int(meta.get("skipped_steps", 0))
        run_args, steps = json.loads(meta.get("args", "{}")), json.loads(meta.get("optimizer_steps", "{}"))
    except ValueError as e:
        raise DamagedFile(f"{file}: its metadata's step, args or optimizer_steps cannot be read ({e})") from None
    unread = [entry for entry, info in plain.header.items() if info["dtype"] not in TORCH_DTYPES]
    if unread:
        raise DamagedFile(f"{file}: tensor {unread[0]!r} is {plain.header[unread[0]]['dtype']}, which model.py's "
                          f"state dict never holds")
    folder = path_for(run_dir, step)
    os.makedirs(folder, exist_ok=True)
    copied = "rank-00000.safetensors"
    size, sha256 = copy_hashing(file, os.path.join(folder, copied))
    tensors, pieces = {}, []
    for entry, info in plain.header.items():
        name, key = entry, "model"
        if entry.startswith("optimizer."):
            key, name = entry[len("optimizer."):].split(".", 1)
        numel = torch.Size(info["shape"]).numel()
        pieces.append(dict(name=name, key=key, part=0, start=0, end=numel, file=copied, entry=entry))
        if key == "model":
            tensors[name] = dict(shape=info["shape"], dtype=info["dtype"], split=None)
    record = dict(layouts=tensors, steps=steps, pieces=pieces, files={copied: dict(bytes=size, sha256=sha256)})
    write_manifest(folder, [record], dict(step=step, skipped_steps=skipped, args=run_args))
    return folder


def copy_hashing(source, destination):
    """Copy a file a piece at a time, flushed to the disk; returns (bytes, sha256)."""
    digest, size = hashlib.sha256(), 0
    with open(source, "rb") as f, open(destination + ".tmp", "wb") as g:
        while piece := f.read(HASH_CHUNK):
            g.write(piece)
            digest.update(piece)
            size += len(piece)
        g.flush()
        os.fsync(g.fileno())
    os.replace(destination + ".tmp", destination)
    return size, digest.hexdigest()


# ---------------------------------------------------------------------------
# A Hugging Face model folder
# ---------------------------------------------------------------------------


def export_hf(path, out, dtype=None, max_shard_bytes=5 * 10**9):
    """Write the checkpoint at path as a Hugging Face model folder `out`, a tensor at a time: the weights
    in dtype (default: as saved), in files of at most max_shard_bytes (as save_pretrained names them), and
    config.json (the one the run started from, or one made for its model)."""
    saved = Checkpoint(checkpoint_at(path))
    if not saved.manifest.get("model"):
        raise UnsupportedModel(f"{path} does not record its model's config (saved by an older version, or "
                               f"imported): resume the run from it and save again")
    config = GPTConfig(**saved.manifest["model"])
    hf_config = saved.manifest.get("hf_config") or hf_from_config(config)
    tensors = hf_tensors(saved, config, hf_config, dtype)
    files = shard_files(tensors, max_shard_bytes)
    os.makedirs(out, exist_ok=True)
    for file, entries in files.items():
        write_safetensors(os.path.join(out, file), entries, dict(format="pt"))
    if len(files) > 1:
        total = sum(shape.numel() * dtype_.itemsize for entries in files.values() for _, (shape, dtype_, _) in entries)
        weight_map = {entry: file for file, entries in files.items() for entry, _ in entries}
        write_json(os.path.join(out, "model.safetensors.index.json"),
                   dict(metadata=dict(total_size=total), weight_map=weight_map))
    written = tensors[0][1][1]  # (every tensor is in the master weights' dtype, or in dtype)
    write_json(os.path.join(out, "config.json"),
               dict(hf_config, architectures=[ARCHITECTURES[hf_config["model_type"]]],
                    torch_dtype=str(written).removeprefix("torch.")))
    copy_tokenizer(folder_of_run(saved.manifest["args"]), out)


def copy_tokenizer(folder, out):
    """The tokenizer's files of the run (those of `folder` that exist) into the exported folder, so that other
    tools load the model with the tokenizer it was trained on. None: the run recorded none (the synthetic
    language, bytes, nanoGPT's ids), and the folder holds the model alone."""
    for name in TOKENIZER_FILES if folder else ():
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(out, name))


def hf_tensors(saved, config, hf_config, dtype):
    """[(Hugging Face name, (shape, dtype, a function giving the tensor))] of a checkpoint, in model.py's
    order: each of model.py's tensors cut back into the Hugging Face tensors it was made of (rows put back in
    the folder's order, hf.row_order; gpt-oss's experts stacked into one tensor of each kind a layer, at the
    first expert), then the buffers the folder holds (DeepSeek-V3's routing biases, in their own dtype, the
    master weights': DeepSeek's inference code keeps them in float32, and a bfloat16 export would round away
    steps of the bias update)."""
    model_type = hf_config["model_type"]
    with torch.device("meta"):
        model = GPT(config)
    kept = hf.saved_buffers(model, model_type)
    for name in dict(model.named_buffers()):
        if name not in kept and name in saved.tensors and saved.full(name).count_nonzero():
            raise UnsupportedModel(f"{name} is not zero, and {model_type} has no such tensor: it would be lost")
    full = lru_cache(maxsize=1)(saved.full)  # one read of a tensor for its q, k and v
    entries = []
    for name, p in model.named_parameters():  # a tied output layer once, as the embedding
        parts = hf.source(model_type, name, config)
        if parts.stacked and parts.expert:
            continue  # (written with the first expert)
        as_dtype = dtype or TORCH_DTYPES[saved.tensors[name]["dtype"]]
        to_folder_order = folder_order(parts, hf_config, config)
        start = 0
        for hf_name, rows in zip(parts.names, part_rows(name, p.shape, config, len(parts.names))):
            shape = (p.shape[1], rows) if parts.transposed else (rows, *p.shape[1:])

            def tensor(name=name, start=start, rows=rows, transposed=parts.transposed, as_dtype=as_dtype,
                       order=to_folder_order):
                t = full(name)[start:start + rows][order]
                return (t.t() if transposed else t).contiguous().to(as_dtype)
            if parts.stacked:
                shape, tensor = (config.n_experts, *shape), stacked(tensor, name, config.n_experts)
            entries.append((hf_name, (torch.Size(shape), as_dtype, tensor)))
            start += rows
    for name in kept:
        hf_name, = hf.source(model_type, name, config).names
        layout = saved.tensors[name]
        entries.append((hf_name, (torch.Size(layout["shape"]), TORCH_DTYPES[layout["dtype"]],
                                  lambda name=name: saved.full(name).contiguous())))
    return entries


def stacked(tensor, name, n_experts):
    """A function giving every expert's tensor(name) stacked, name being the first expert's."""
    return lambda: torch.stack([tensor(re.sub(r"experts\.0\.", f"experts.{e}.", name)) for e in range(n_experts)])


def folder_order(parts, hf_config, config):
    """The index that puts model.py's rows of a tensor in the folder's order (the inverse of hf.row_order), or
    every row as it is."""
    order = hf.row_order(parts, hf_config, config)
    return slice(None) if order is None else torch.argsort(order)


def part_rows(name, shape, config, n_parts):
    """The rows of model.py's `name` that each of its n_parts Hugging Face tensors holds, in order (the
    vocabulary tables' padding rows in none)."""
    if name in ("tok_emb.weight", "lm_head.weight"):
        return [config.vocab_size]
    if name.endswith(("qkv.weight", "qkv.bias")) and n_parts == 3:  # q's heads | k's | v's
        return [shape[0] - 2 * config.kv_dim, config.kv_dim, config.kv_dim]
    if ".fc." in name and n_parts == 2:  # SwiGLU's gate | up, of any MLP's width (dense, expert, shared)
        return [shape[0] // 2, shape[0] // 2]
    return [shape[0]]


def shard_files(tensors, max_shard_bytes):
    """{file: its tensors}: in order, a new file when the next tensor would pass max_shard_bytes."""
    shards, size = [[]], 0
    for entry in tensors:
        nbytes = entry[1][0].numel() * entry[1][1].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    return {f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors": s for k, s in enumerate(shards)}


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


CHECKPOINT_HELP = "a checkpoint folder (runs/NAME/checkpoint-STEP), or a run folder (runs/NAME) for its newest good one"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tools.convert",
                                     description="Convert a sharded checkpoint to one safetensors file in model.py's "
                                                 "layout and back, or to a Hugging Face model folder.")
    commands = parser.add_subparsers(dest="command", required=True)
    to_file = commands.add_parser("to-file", help="a checkpoint (any layout) -> one .safetensors file")
    to_file.add_argument("checkpoint", help=CHECKPOINT_HELP)
    to_file.add_argument("file")
    to_file.add_argument("--weights-only", action="store_true", help="the weights alone, no optimizer state")
    from_file = commands.add_parser("from-file", help="one .safetensors file -> a checkpoint of a run's folder")
    from_file.add_argument("file")
    from_file.add_argument("run_dir")
    to_hf = commands.add_parser("to-hf", help="a checkpoint (any layout) -> a Hugging Face model folder")
    to_hf.add_argument("checkpoint", help=CHECKPOINT_HELP)
    to_hf.add_argument("folder")
    to_hf.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"), default=None,
                       help="the weights' dtype in the folder (default: as the checkpoint holds them)")
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0, help="the largest safetensors file, in GB")
    args = parser.parse_args(argv)
    try:
        if args.command == "to-file":
            export(args.checkpoint, args.file, args.weights_only)
            print(f"wrote {args.file}")
        elif args.command == "from-file":
            print(f"wrote {import_file(args.file, args.run_dir)}")
        else:
            export_hf(args.checkpoint, args.folder, args.dtype and getattr(torch, args.dtype),
                      int(args.max_shard_gb * 10**9))
            print(f"wrote {args.folder}")
    except (BadCheckpoint, UnsupportedModel, DamagedFile) as e:
        sys.exit(f"python -m tools.convert: error: {e}")


if __name__ == "__main__":
    main()
