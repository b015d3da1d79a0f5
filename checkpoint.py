"""Checkpoints that survive a crash at any instant, and the newest good one of a run.

A checkpoint holds the whole training state consolidated to model.py's
layout (train.py gathers it from every rank; rank 0 writes it). It is
written to a temporary file, flushed to the disk (fsync) and renamed into
place: a rename is atomic, so a reader sees the old file or the new one,
never part of one. Its SHA-256 is written beside it the same way, last: that
file marks the checkpoint complete, and tells a damaged one apart. A run's
folder keeps the newest few, each named by the step it resumes at.
"""
import hashlib
import io
import os
import re

import torch

NAME = re.compile(r"checkpoint-(\d+)\.pt")
HASH_CHUNK = 64 * 2**20


class BadCheckpoint(ValueError):
    """A checkpoint that is missing, incomplete (its write never finished) or damaged."""


def path_for(run_dir, step):
    return os.path.join(run_dir, f"checkpoint-{step:08d}.pt")


def checkpoints(run_dir):
    """The checkpoints in run_dir, newest (largest step) first."""
    found = [(int(m.group(1)), name) for name in os.listdir(run_dir) if (m := NAME.fullmatch(name))] \
        if os.path.isdir(run_dir) else []
    return [os.path.join(run_dir, name) for _, name in sorted(found, reverse=True)]


def save(run_dir, step, state, keep):
    """Write state as the checkpoint of `step`, then delete all but the newest `keep`."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = path_for(run_dir, step)
    _write_atomically(path, data)
    _write_atomically(path + ".sha256", hashlib.sha256(data).hexdigest().encode())
    for old in checkpoints(run_dir)[keep:]:
        for name in (old + ".sha256", old):  # the mark first: a half-deleted checkpoint is incomplete, not good
            if os.path.exists(name):
                os.remove(name)
    return path


def load(path):
    """The state saved at path, or BadCheckpoint saying what is wrong with it. Its tensors are mapped
    from the file, not read: a rank reads only the pages of the elements it then takes."""
    verify(path)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def verify(path):
    """Check that the checkpoint at path is complete and undamaged (else BadCheckpoint), reading it in
    pieces of HASH_CHUNK bytes."""
    if not os.path.isfile(path):
        raise BadCheckpoint(f"{path}: no such checkpoint")
    if not os.path.isfile(path + ".sha256"):
        raise BadCheckpoint(f"{path}: incomplete, its write never finished (no {os.path.basename(path)}.sha256)")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(HASH_CHUNK):
            digest.update(piece)
    with open(path + ".sha256") as f:
        if digest.hexdigest() != f.read().strip():
            raise BadCheckpoint(f"{path}: damaged, its bytes do not match its SHA-256")


def newest_good(run_dir, report=print):
    """The path of the newest complete, undamaged checkpoint in run_dir, or None; each bad one is reported."""
    for path in checkpoints(run_dir):
        try:
            verify(path)
            return path
        except BadCheckpoint as e:
            report(f"skipping checkpoint {e}")
    return None


def _write_atomically(path, data):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself reaches the disk
    finally:
        os.close(folder)
