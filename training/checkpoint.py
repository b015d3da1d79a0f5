"""Sharded checkpoints: every rank writes only what it holds, all at once, and any layout reads them back.

A checkpoint is a folder, runs/<name>/checkpoint-<step>/, named by the step it resumes at:

    rank-<r>.safetensors   the pieces rank r wrote, in the safetensors format (an 8-byte little-endian
                           header length, a JSON header {entry: {dtype, shape, data_offsets}}, the raw
                           bytes), which any safetensors reader opens
    manifest.json          written last, by rank 0, once every rank's file is on the disk (written to a
                           temporary name, flushed with fsync and renamed: a rename is atomic). Its
                           presence marks the checkpoint complete; it holds
        step, skipped_steps, args   where the run resumes
        model, hf_config   model.py's config of the run, and the Hugging Face config.json it started from
                  (--init-from; else null), for the Hugging Face export (tools/convert.py)
        tensors   {name: {shape, dtype, split}}: every tensor of model.py's state dict, at full size (dtype
                  as safetensors names it: F32, BF16...);
                  split (tensor parallelism, tp.shard): {dim, blocks, parts}: along dim, each block (their
                  full sizes; null: one block) is cut into `parts` equal parts, part t taking the t-th
                  part of every block, in order; null: the tensor is whole on every rank
        steps     {name: the optimizer's step count} of the parameters it has state for
        pieces    [{name, key, part, start, end, file, entry}]: elements [start, end) of the flattened
                  part `part` (0 when not split) of tensor `name`'s `key` ("model": the weights, or an
                  optimizer state such as "exp_avg"), in `file` under `entry`
        files     {file: {bytes, sha256}}: what tells a damaged file apart
        sha256    of the manifest's own contents (training/integrity.py): what tells a damaged manifest apart

Why not torch.distributed.checkpoint: it describes each piece as a rectangular block of the full tensor
(offsets and lengths per dimension). ZeRO's pieces are ranges of a flattened tensor-parallel slice, which
cut rows in two, and a slice of a fused q | k | v weight is several blocks of the full tensor; each piece
would be many rectangles. Here a piece is what a rank holds, and `Checkpoint.read` finds the pieces
holding any elements of the full tensor.

A rank replicated elsewhere (data parallelism without ZeRO, a weight every tp rank holds whole) writes
what no lower rank holds already, so the folder holds each element once. Saving copies the rank's pieces
aside and writes them on a background thread while training goes on (Saver), at most one save in
flight; resuming, each rank reads from the files only the ranges of pieces that hold elements it takes.
`python -m tools.convert` turns a checkpoint into one file in model.py's layout, or a Hugging Face
folder, and back.
"""
import bisect
import hashlib
import json
import os
import re
import shutil
import threading
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from training.integrity import json_digest, json_digest_matches
from training.launch import first_problem
from training.tensorfile import TORCH_DTYPES, SafetensorsFile, planned, write_safetensors

NAME = re.compile(r"checkpoint-(\d+)")
MANIFEST = "manifest.json"
HASH_CHUNK = 64 * 2**20
READ_CHUNK = 2**22  # elements of a whole tensor converted at a time


class BadCheckpoint(ValueError):
    """A checkpoint that is missing, incomplete (its write never finished) or damaged."""


def path_for(run_dir, step):
    return os.path.join(run_dir, f"checkpoint-{step:08d}")


def checkpoints(run_dir):
    """The checkpoints in run_dir, newest (largest step) first."""
    found = [(int(m.group(1)), name) for name in os.listdir(run_dir) if (m := NAME.fullmatch(name))] \
        if os.path.isdir(run_dir) else []
    return [os.path.join(run_dir, name) for _, name in sorted(found, reverse=True)]


# ---------------------------------------------------------------------------
# Writing: each rank its pieces, rank 0 the manifest
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of the flattened part `part` of tensor `name`'s `key` (see the module's docstring)."""
    name: str
    key: str
    part: int
    start: int
    end: int

    @property
    def entry(self):
        return f"{self.name}/{self.key}/{self.part}/{self.start}"


class Saver:
    """Saves checkpoints with every rank, on a background thread, at most one in flight.

    `group`: a gloo group of every rank, used by that thread alone (a collective of the main thread's
    groups could interleave with the training's, which NCCL matches by order alone).
    """

    def __init__(self, group):
        self.group, self.rank = group, dist.get_rank(group)
        self.thread, self.error = None, None

    def save(self, folder, pieces, layouts, meta, keep):
        """Start saving this rank's pieces [(Piece, tensor)] into folder; layouts {name: {shape, dtype,
        split}} of their tensors at full size, meta {step, skipped_steps, args, steps}; then delete all but
        the newest `keep` checkpoints of its run. Returns once the pieces are copied aside."""
        self.wait()
        if self.rank == 0:
            os.makedirs(folder, exist_ok=True)
            if os.path.exists(os.path.join(folder, MANIFEST)):  # saved again (a resumed run): not complete
                os.remove(os.path.join(folder, MANIFEST))     # until this save is
        owners = self._owners([piece for piece, _ in pieces])  # collective: after the manifest is gone
        mine = [(piece, tensor.detach().to("cpu", copy=True)) for piece, tensor in pieces
                if owners[piece] == self.rank]  # copied aside: training goes on changing the originals
        self.thread = threading.Thread(target=self._write, args=(folder, mine, layouts, meta, keep), daemon=True)
        self.thread.start()

    def wait(self):
        """Until the save in flight (if any) is complete, on every rank; re-raises what went wrong in it."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _owners(self, pieces):
        """{piece: the lowest rank holding it}: ranks holding copies of a piece write it once."""
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, pieces, group=self.group)
        owners = {}
        for rank, held in enumerate(everyone):
            for piece in held:
                owners.setdefault(piece, rank)
        return owners

    def _write(self, folder, mine, layouts, meta, keep):
        try:
            record = dict(layouts=layouts, steps=meta["steps"], pieces=[], files={})
            if mine:
                file = f"rank-{self.rank:05d}.safetensors"
                size, sha256 = write_safetensors(os.path.join(folder, file),
                                                 planned([(piece.entry, t) for piece, t in mine]))
                record["files"][file] = dict(bytes=size, sha256=sha256)
                record["pieces"] = [dict(asdict(piece), file=file, entry=piece.entry) for piece, _ in mine]
            everyone = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, record, group=self.group)  # every file is on the disk
            outcome = [None]
            if self.rank == 0:
                try:
                    write_manifest(folder, everyone, meta)
                    delete_all_but_newest(os.path.dirname(folder), keep)
                except OSError as e:
                    outcome = [f"{folder}: {e}"]
            dist.broadcast_object_list(outcome, src=dist.get_global_rank(self.group, 0), group=self.group)
            if outcome[0]:  # every rank learns that the checkpoint is complete, or that it is not
                raise OSError(f"the checkpoint was not completed: {outcome[0]}")
        except BaseException as e:  # noqa: BLE001 (raised again by wait(), on the training's thread)
            self.error = e


def write_manifest(folder, records, meta):
    """The manifest from every rank's record: what makes the checkpoint complete (once the ranks' files,
    flushed already, are in the folder for good)."""
    manifest = dict(step=meta["step"], skipped_steps=meta["skipped_steps"], args=meta["args"],
                    model=meta.get("model"), hf_config=meta.get("hf_config"), tensors={}, steps={}, pieces=[],
                    files={})
    for record in records:
        manifest["tensors"].update(record["layouts"])
        manifest["steps"].update(record["steps"])
        manifest["pieces"] += record["pieces"]
        manifest["files"].update(record["files"])
    manifest["sha256"] = json_digest(manifest)
    fsync_directory(folder)  # the files' renames reach the disk before the manifest can
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))
    fsync_directory(folder)


def fsync_directory(folder):
    """Make the renames inside folder durable (a rename is written to the disk with its directory)."""
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def delete_all_but_newest(run_dir, keep):
    for old in checkpoints(run_dir)[keep:]:
        if os.path.exists(os.path.join(old, MANIFEST)):  # the mark first: a half-deleted one is incomplete
            os.remove(os.path.join(old, MANIFEST))
        shutil.rmtree(old)


# ---------------------------------------------------------------------------
# Checking: complete (its manifest and files there), undamaged (their SHA-256)
# ---------------------------------------------------------------------------

def complete(path):
    """The manifest of the checkpoint at path if it is complete (every file there, of its size), else
    BadCheckpoint."""
    if not os.path.isdir(path):
        raise BadCheckpoint(f"{path}: no such checkpoint")
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        raise BadCheckpoint(f"{path}: incomplete, its write never finished (no {MANIFEST})")
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (ValueError, RecursionError) as e:  # written whole (renamed into place), so damaged later
        raise BadCheckpoint(f"{path}: damaged, its {MANIFEST} is not readable ({str(e)[:120]})") from None
    if not isinstance(manifest, dict) or not json_digest_matches(manifest):
        raise BadCheckpoint(f"{path}: damaged, its {MANIFEST} does not match its SHA-256")
    problem = manifest_problem(manifest)  # (a manifest written before it had a SHA-256 is checked field by field)
    if problem:
        raise BadCheckpoint(f"{path}: damaged, its {MANIFEST} {problem}")
    for file, info in manifest["files"].items():
        if not os.path.isfile(os.path.join(path, file)):
            raise BadCheckpoint(f"{path}: damaged, {file} is missing")
        if os.path.getsize(os.path.join(path, file)) != info["bytes"]:
            raise BadCheckpoint(f"{path}: damaged, {file} is not of its size")
    return manifest


MANIFEST_FIELDS = dict(step=int, skipped_steps=int, args=dict, tensors=dict, steps=dict, pieces=list, files=dict)
PIECE_FIELDS = dict(name=str, key=str, part=int, start=int, end=int, file=str, entry=str)


def manifest_problem(manifest):
    """What is wrong with a manifest's fields (None: nothing): each of the types the module's docstring gives,
    every piece in a file the manifest lists, every file with its size and SHA-256."""
    for field, kind in MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(field), kind):
            return f"has no {field} (a {kind.__name__})"
    for file, info in manifest["files"].items():
        if os.path.basename(file) != file or not isinstance(info, dict) or type(info.get("bytes")) is not int \
                or not isinstance(info.get("sha256"), str):
            return f"misstates file {file!r}"
    for piece in manifest["pieces"]:
        if not isinstance(piece, dict) or any(not isinstance(piece.get(f), kind) for f, kind in PIECE_FIELDS.items()) \
                or piece["file"] not in manifest["files"] or piece["name"] not in manifest["tensors"] \
                or not 0 <= piece["start"] <= piece["end"]:
            return f"misstates a piece ({str(piece)[:80]})"
    for name, layout in manifest["tensors"].items():
        if not isinstance(layout, dict) or not isinstance(layout.get("shape"), list) \
                or layout.get("dtype") not in TORCH_DTYPES or not isinstance(layout.get("split"), (dict, type(None))):
            return f"misstates tensor {name!r}"
    return None


def verify(path, share=(0, 1)):
    """Check that the checkpoint at path is complete and undamaged (else BadCheckpoint). Of its files,
    those of share (i, n) are hashed, i-th of every n: n ranks hash the checkpoint once between them."""
    manifest = complete(path)
    index, count = share
    for file in sorted(manifest["files"])[index::count]:
        digest = hashlib.sha256()
        with open(os.path.join(path, file), "rb") as f:
            while piece := f.read(HASH_CHUNK):
                digest.update(piece)
        if digest.hexdigest() != manifest["files"][file]["sha256"]:
            raise BadCheckpoint(f"{path}: damaged, the bytes of {file} do not match its SHA-256")


def verify_together(path, group=None):
    """verify(path), the files hashed by the ranks of `group` (None: this process alone) a share each; every
    rank raises the same BadCheckpoint, or none does."""
    share = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    problem = None
    try:
        verify(path, share)
    except BadCheckpoint as e:
        problem = str(e)
    problem = first_problem(problem, group)
    if problem:
        raise BadCheckpoint(problem)


def newest_good(run_dir, report=print, group=None):
    """The newest complete, undamaged checkpoint in run_dir, or None; each bad one is reported."""
    for path in checkpoints(run_dir):
        try:
            verify_together(path, group)
            return path
        except BadCheckpoint as e:
            report(f"skipping checkpoint {e}")
    return None


def checkpoint_at(path, report=print):
    """The checkpoint `path` names, verified: itself (a checkpoint-* folder, or any folder with a manifest), or
    a run folder's newest complete, undamaged one; else BadCheckpoint, saying why."""
    if not os.path.isdir(path):
        raise BadCheckpoint(f"{path}: no such folder")
    if os.path.isfile(os.path.join(path, MANIFEST)) or NAME.fullmatch(os.path.basename(os.path.normpath(path))):
        verify(path)
        return path
    if not checkpoints(path):
        raise BadCheckpoint(f"{path}: neither a checkpoint (no {MANIFEST}) nor a run folder (no checkpoint-* in it)")
    newest = newest_good(path, report)
    if newest is None:
        raise BadCheckpoint(f"{path}: none of its checkpoints is complete and undamaged")
    return newest


# ---------------------------------------------------------------------------
# Reading: any elements of any tensor, from the pieces holding them
# ---------------------------------------------------------------------------

class Checkpoint:
    """A complete checkpoint: read(name, key, positions) gives any elements of a full
    tensor, from whatever pieces hold them, whatever layout saved them."""

    def __init__(self, path):
        self.path, self.manifest = os.fspath(path), complete(path)
        self.step, self.skipped_steps = self.manifest["step"], self.manifest["skipped_steps"]
        self.tensors, self.steps = self.manifest["tensors"], self.manifest["steps"]
        self.files = {}
        self.pieces = {}  # (name, key): (starts, ends, pieces), ordered by where they are in the parts
        for piece in self.manifest["pieces"]:
            self.pieces.setdefault((piece["name"], piece["key"]), []).append(piece)
        for where, pieces in self.pieces.items():
            numel = torch.Size(self.tensors[where[0]]["shape"]).numel()
            parts = (self.tensors[where[0]]["split"] or {}).get("parts", 1)
            at = lambda piece, i: piece["part"] * (numel // parts) + piece[i]  # noqa: E731
            pieces.sort(key=lambda piece: at(piece, "start"))
            self.pieces[where] = (torch.tensor([at(p, "start") for p in pieces]),
                                  torch.tensor([at(p, "end") for p in pieces]), pieces)

    def optimizer_keys(self, name):
        """The optimizer's state tensors saved for parameter `name` (none before its first step)."""
        return sorted(key for n, key in self.pieces if n == name and key != "model")

    def read(self, name, key, positions):
        """The elements at flat `positions` of the full tensor `name`'s `key`, on the CPU, as saved."""
        layout = self.tensors[name]
        where = in_parts(positions.cpu(), layout["shape"], layout["split"])
        dtype = TORCH_DTYPES[layout["dtype"]]
        starts, ends, pieces = self.pieces[(name, key)]
        if consecutive(where):  # (as when a layout resumes its own checkpoint)
            i = bisect.bisect_right(starts.tolist(), where[0].item()) - 1
            if i >= 0 and where[-1] < ends[i]:  # one range of one piece: read into place
                first = where[0].item() - starts[i].item()
                return self.piece_range(pieces[i], first, first + where.numel()).to(dtype)
        index = torch.searchsorted(starts, where, right=True) - 1
        lowest, highest = index.min().item(), index.max().item()
        if lowest < 0 or (where >= ends[index]).any():
            raise BadCheckpoint(f"{self.path}: damaged, no piece holds some elements of {name} ({key})")
        values = torch.empty(where.shape, dtype=dtype)
        for i in [lowest] if lowest == highest else index.unique().tolist():
            mask = slice(None) if lowest == highest else index == i
            wanted = where[mask] - starts[i]
            first = wanted.min().item()  # read only the range of the piece that holds them
            values[mask] = self.piece_range(pieces[i], first, wanted.max().item() + 1)[wanted - first].to(dtype)
        return values

    def piece_range(self, piece, start, end):
        """Elements [start, end) of a piece (of the manifest's)."""
        if piece["file"] not in self.files:
            self.files[piece["file"]] = SafetensorsFile(os.path.join(self.path, piece["file"]))
        return self.files[piece["file"]].read(piece["entry"], start, end)

    def full(self, name, key="model"):
        """The whole tensor (for tools and tests: a run reads only what it holds)."""
        shape = torch.Size(self.tensors[name]["shape"])
        flat = torch.empty(shape.numel(), dtype=TORCH_DTYPES[self.tensors[name]["dtype"]])
        for start in range(0, flat.numel(), READ_CHUNK):
            end = min(start + READ_CHUNK, flat.numel())
            flat[start:end] = self.read(name, key, torch.arange(start, end))
        return flat.view(shape)

    def model_state(self):
        """model.py's state dict, whole (for tools and tests)."""
        return {name: self.full(name) for name in self.tensors}


def consecutive(positions):
    """Whether positions are n consecutive integers, in order."""
    n = positions.numel()
    return n > 0 and positions[-1] - positions[0] == n - 1 and bool((positions.diff() == 1).all())


def in_parts(positions, shape, split):
    """Where the elements at flat `positions` of a full tensor are kept: part * (the part's numel) + the flat
    index in the part (see `split` in the module's docstring)."""
    if split is None:
        return positions
    dim, parts = split["dim"], split["parts"]
    blocks = torch.tensor(split["blocks"] or [shape[dim]])
    block_ends = blocks.cumsum(0)
    index = list(torch.unravel_index(positions, shape))
    row = index[dim].contiguous()
    block = torch.searchsorted(block_ends, row, right=True)
    block_start = block_ends[block] - blocks[block]
    offset, part_rows = row - block_start, blocks[block] // parts
    index[dim] = block_start // parts + offset % part_rows  # the part holds its share of every block, in order
    part_shape = list(shape)
    part_shape[dim] //= parts
    strides = torch.empty(part_shape, device="meta").stride()
    return offset // part_rows * torch.Size(part_shape).numel() + sum(i * s for i, s in zip(index, strides))
