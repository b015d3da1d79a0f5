"""Every file the project reads is checked against what it claims: seeded corruptions of each kind of input.

A Hugging Face folder (its safetensors files, index and config.json, copied by hand or downloaded into
huggingface_hub's cache), a token folder (ids, loss masks, meta.json), a checkpoint (manifest and rank
file) and a tokenizer folder are each cut short at seeded lengths, have bytes flipped in their headers and
their data, and have their length fields set to extremes. Each corruption is read the way train.py and the
tools read it, and must either load exactly what the intact files give or be refused with the project's
one-line error naming the file: never a traceback, never values from nowhere, and (an alarm per test)
never a hang. The one place nothing can tell a changed byte: a tensor's data in a folder copied by hand,
which holds no hash of itself; there the load must be exactly the file's bytes, as the safetensors library
reads them.
"""
import json
import os
import pickle
import random
import shutil
import signal
import hashlib

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import hf_models
import train
from model import GPT
from texts import tokenizer_folder
from tools import convert
from training import checkpoint, cli, hf
from training.data import open_data
from training.integrity import chunk_digests, json_digest
from training.tensorfile import DamagedFile, SafetensorsFile
from training.tokenizer import Tokenizer, TokenizerError

REFUSED = (cli.ConfigError, DamagedFile, checkpoint.BadCheckpoint, TokenizerError)
TINY_LLAMA = dict(hf_models.tiny_config("llama"), vocab_size=40, hidden_size=16, intermediate_size=24,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8)


@pytest.fixture(autouse=True)
def deadline():
    """A corruption that made a reader loop forever fails the test instead of hanging the suite."""
    def hung(signum, frame):
        raise TimeoutError("a reader hung on a corrupted file")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# -- corruptions ---------------------------------------------------------------------------------------

def safetensors_regions(data):
    """(header end, file end) of a safetensors file's bytes: where its header ends and its data begins."""
    return 8 + int.from_bytes(data[:8], "little"), len(data)


def corruptions(data, rng, n, header_end=None):
    """n corrupted copies of data (bytes): cut short, a byte flipped in the header (the first header_end
    bytes: all of a JSON file) or in the data after it, bytes appended, and for a safetensors file its
    8-byte header length set to extremes. Yields (what was done, the bytes)."""
    header_end = header_end or len(data)
    lengths = [0, 1, 7, header_end - 9, header_end - 7, len(data) - 8, len(data), 2**40, 2**63, 2**64 - 1]
    kinds = ["cut", "flip header", "digit", "flip data", "append", "length"] if header_end < len(data) \
        else ["cut", "flip", "digit", "append"]
    digits = [at for at in range(header_end) if chr(data[at]).isdigit()]
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind == "digit" and not digits:  # (ids and masks: bytes, not text)
            kind = "flip"
        if kind == "digit":  # (a number changed, the JSON still valid: a size, an offset, a setting)
            at = rng.choice(digits)
            other = rng.choice(b"0123456789".replace(data[at:at + 1], b""))
            yield f"digit {at} -> {chr(other)}", data[:at] + bytes([other]) + data[at + 1:]
        elif kind == "cut":
            at = rng.randrange(len(data))
            yield f"cut at {at}", data[:at]
        elif kind.startswith("flip"):
            low, high = (header_end, len(data)) if kind == "flip data" else (0, header_end)
            at, mask = rng.randrange(low, high), rng.randrange(1, 256)
            yield f"{kind} byte {at} ^ {mask}", data[:at] + bytes([data[at] ^ mask]) + data[at + 1:]
        elif kind == "append":
            yield "append", data + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        else:
            value = lengths[rng.randrange(len(lengths))]
            yield f"length {value}", value.to_bytes(8, "little") + data[8:]


def outcome(read, where):
    """("refused", message) or ("loaded", what read() gave); a refusal must be one line naming `where`."""
    try:
        return "loaded", read()
    except REFUSED as e:
        message = str(e)
        assert "\n" not in message and where in message, message
        return "refused", message


def same(a, b):
    """Whether two results are equal, tensors bit for bit (a NaN equal to itself)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8),
                                                                        b.view(-1).view(torch.uint8))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def corrupt_each(folder, name, rng, n, read, header_end=None):
    """[(what, outcome)] of reading `folder` (read()) with its file `name` corrupted n ways in turn, each
    time put back as it was afterwards."""
    path = os.path.realpath(os.path.join(folder, name))  # (a link into huggingface_hub's cache: its blob)
    intact = open(path, "rb").read()
    results = []
    try:
        for what, data in corruptions(intact, rng, n, header_end):
            with open(path, "wb") as f:
                f.write(data)
            results.append((f"{name}: {what}", outcome(read, folder), data))
    finally:
        with open(path, "wb") as f:
            f.write(intact)
    return results


def assert_refused_or_intact(results, intact):
    for what, (kind, value), _ in results:
        assert kind == "refused" or same(value, intact), f"{what} loaded other values without a refusal"


# -- a Hugging Face folder -----------------------------------------------------------------------------

def hf_load(folder):
    """What train.py reads of a Hugging Face folder: its config (the checks of the flags), the folder checked
    (train.check_folder) and every tensor's values."""
    args = cli.parse_args(["--init-from", folder, "--seq-len", "16", "--batch-size", "2"])
    config, _ = cli.check_args(args, 1)
    train.check_folder(folder, config, None)
    return config, hf.load_state_dict(folder, config)


def hub_layout(tmp_path, folder):
    """The folder as huggingface_hub's snapshot_download leaves it: each file a link to a blob named by its
    hash (SHA-256 for the safetensors files, kept in Git LFS; git's SHA-1 for the others)."""
    repo = tmp_path / "hub" / "models--tiny--llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in os.listdir(folder):
        data = open(os.path.join(folder, name), "rb").read()
        blob = (hashlib.sha256(data).hexdigest() if name.endswith(".safetensors")
                else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / name)
    return str(snapshot)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama folder in two shards, with its index, and its intact load."""
    folder = str(tmp_path_factory.mktemp("hf") / "llama")
    hf_models.make_folder(folder, "llama", dtype=torch.float32, shards=2, config=TINY_LLAMA)
    return folder, hf_load(folder)


def test_the_table_of_damaged_files_is_refused_in_one_line_each(llama, tmp_path):
    """The cases the issue found: each refused before any step, naming the file and the fault."""
    folder, _ = llama
    cut = str(tmp_path / "cut")
    shutil.copytree(folder, cut)
    first = os.path.join(cut, "model-00001-of-00002.safetensors")
    os.truncate(first, os.path.getsize(first) // 2)
    kind, message = outcome(lambda: hf_load(cut), first)
    assert kind == "refused" and "cut short" in message
    with open(first, "r+b") as f:
        f.write((2**40).to_bytes(8, "little"))
    kind, message = outcome(lambda: hf_load(cut), first)
    assert kind == "refused" and "1,099,511,627,776 bytes" in message
    data = tmp_path / "tokens"
    data.mkdir()
    np.arange(100, dtype=np.uint16).tofile(data / "train.bin")
    (data / "val.bin").write_bytes(np.arange(50, dtype=np.uint16).tobytes() + b"x")
    (data / "meta.json").write_text(json.dumps(dict(dtype="uint16", vocab_size=200)))
    args = cli.parse_args(["--data", str(data), "--seq-len", "8"])
    kind, message = outcome(lambda: cli.check_data(args, cli.describe_data(args)), str(data / "val.bin"))
    assert kind == "refused" and "101 bytes is not a whole number of uint16 tokens" in message


def test_a_model_too_large_for_a_rank_is_refused_before_anything_is_allocated(llama, tmp_path, monkeypatch):
    """config.json's hidden_size of 10^9: tools/plan/'s count of the busiest rank's parameters against the
    device's memory, before any allocation (here the machine's memory, however large, is too small)."""
    folder, _ = llama
    huge = str(tmp_path / "huge")
    shutil.copytree(folder, huge)
    config = json.loads(open(os.path.join(huge, "config.json")).read())
    (tmp_path / "huge" / "config.json").write_text(json.dumps(dict(config, hidden_size=10**9)))
    args = cli.parse_args(["--init-from", huge, "--seq-len", "16", "--batch-size", "2"])
    config, data = cli.check_args(args, 1)[0], cli.describe_data(args)
    with pytest.raises(cli.ConfigError, match=r"parameters alone take [\d,.]+ GiB on the busiest rank") as refused:
        train.check_memory(args, 1, config, data)
    with torch.device("meta"):  # one rank holds every parameter, in float32 (the weights are their master)
        expected = sum(p.numel() for p in GPT(config).parameters()) * 4
    assert expected > 10**12 and f"{expected / 2**30:,.1f} GiB" in str(refused.value)
    monkeypatch.setattr(train, "device_memory_bytes", lambda: expected)
    train.check_memory(args, 1, config, data)  # as large as the device: it fits


def test_a_folder_whose_config_and_weights_disagree_is_refused(llama, tmp_path):
    folder, _ = llama
    wider = str(tmp_path / "wider")
    shutil.copytree(folder, wider)
    config = json.loads(open(os.path.join(wider, "config.json")).read())
    (tmp_path / "wider" / "config.json").write_text(json.dumps(dict(config, hidden_size=32)))
    kind, message = outcome(lambda: hf_load(wider), wider)
    assert kind == "refused" and "model.embed_tokens.weight is [40, 16]" in message and "disagree" in message


def test_corrupted_hugging_face_folders_load_as_intact_or_are_refused(llama):
    """A folder copied by hand: its headers, index and config checked (refused, or loaded as intact); a byte
    changed in a tensor's data is read as the file now holds it, exactly."""
    folder, intact = llama
    rng, results = random.Random(0), []
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        end = safetensors_regions(open(os.path.join(folder, name), "rb").read())[0]
        results += corrupt_each(folder, name, rng, 60, lambda: hf_load(folder), header_end=end)
    for name in ("config.json", "model.safetensors.index.json"):
        results += corrupt_each(folder, name, rng, 30, lambda: hf_load(folder))
    data_flips = [r for r in results if "flip data" in r[0]]
    assert_refused_or_intact([r for r in results if r not in data_flips and "config.json:" not in r[0]], intact)
    for what, (kind, value), data in results:
        if "config.json:" in what and kind == "loaded":  # a setting changed that still makes this model
            assert same(value[1], intact[1]), f"{what}: the weights loaded differ"
    for what, (kind, value), data in data_flips:
        assert kind == "loaded", what  # (nothing in such a folder tells a changed value)
        name = what.split(":")[0]
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            intact_bytes = f.read()
        with open(path, "wb") as f:
            f.write(data)
        try:
            ours = SafetensorsFile(path)
            assert all(same(ours.tensor(entry), tensor) for entry, tensor in load_file(path).items()), what
        finally:
            with open(path, "wb") as f:
                f.write(intact_bytes)
    refused = sum(kind == "refused" for _, (kind, _), _ in results)
    assert len(results) == 180 and refused > 100, refused


def test_corrupted_downloads_in_the_hub_cache_are_refused(llama, tmp_path):
    """Downloaded by huggingface_hub, every file is checked against the hash its blob is named by: any
    corruption of the weights, the index or config.json is refused."""
    folder, intact = llama
    snapshot = hub_layout(tmp_path, folder)
    assert same(hf_load(snapshot), intact)
    rng, results = random.Random(1), []
    for name in sorted(os.listdir(snapshot)):
        header_end = safetensors_regions(open(os.path.join(snapshot, name), "rb").read())[0] \
            if name.endswith(".safetensors") else None
        results += corrupt_each(snapshot, name, rng, 12, lambda: hf_load(snapshot), header_end)
    for what, (kind, _), _ in results:
        assert kind == "refused", f"{what} loaded without a refusal"
    assert len(results) == 48


# -- a token folder ------------------------------------------------------------------------------------

def token_folder(path, n=700, vocab_size=300, chunk_bytes=256):
    """ids, loss masks and meta.json as tools/prepare.py writes them (chunks of 256 bytes: several a file)."""
    rng = np.random.default_rng(0)
    path.mkdir()
    meta = dict(dtype="uint16", vocab_size=vocab_size, eos_id=0, loss_mask=True, files={})
    for split, length in (("train", n), ("val", n // 3)):
        rng.integers(0, vocab_size, length).astype(np.uint16).tofile(path / f"{split}.bin")
        (rng.random(length) < 0.7).astype(np.uint8).tofile(path / f"{split}.mask")
        for suffix in ("bin", "mask"):
            meta["files"][f"{split}.{suffix}"] = chunk_digests(path / f"{split}.{suffix}", chunk_bytes)
    meta["sha256"] = json_digest(meta)
    (path / "meta.json").write_text(json.dumps(meta, indent=2))
    return str(path)


def token_load(folder):
    """What train.py reads of a token folder: the checks of the flags, the ranks' scan, a few batches."""
    args = cli.parse_args(["--data", folder, "--seq-len", "16", "--document-mask"])
    info = cli.describe_data(args)
    cli.check_data(args, info)
    data = open_data(info)
    cli.check_tokens(data)
    return [(data.batch(split, step, 4, 16), data.loss_mask(split, step, 4, 16))
            for split in ("train", "val") for step in range(3)]


def test_corrupted_token_folders_load_as_intact_or_are_refused(tmp_path):
    """meta.json carries the SHA-256 of its contents and of every chunk of the files: any changed byte
    is refused, and so is a file cut short or grown."""
    folder = token_folder(tmp_path / "tokens")
    intact, rng, results = token_load(folder), random.Random(2), []
    for name in ("train.bin", "val.bin", "train.mask", "val.mask", "meta.json"):
        results += corrupt_each(folder, name, rng, 20, lambda: token_load(folder))
    assert_refused_or_intact(results, intact)
    assert sum(kind == "refused" for _, (kind, _), _ in results) > 90 and len(results) == 100
    pickled = tmp_path / "nanogpt"  # nanoGPT's meta.pkl holds no hash: never a traceback, whatever it holds
    pickled.mkdir()
    for split in ("train", "val"):
        np.arange(100, dtype=np.uint16).tofile(pickled / f"{split}.bin")
    (pickled / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 300, "itos": {0: "a"}}))
    results = corrupt_each(str(pickled), "meta.pkl", rng, 20, lambda: token_load(str(pickled)))  # (anything but
    assert len(results) == 20  # a one-line refusal or a load, a traceback above all, fails `outcome`)


# -- a checkpoint --------------------------------------------------------------------------------------

def test_corrupted_checkpoints_load_as_intact_or_are_refused(tmp_path):
    """The manifest holds the SHA-256 of its contents and of every file: any corruption is refused."""
    values = {"tok_emb.weight": torch.randn(8, 4, dtype=torch.float64), "norm.weight": torch.ones(4)}
    from training.tensorfile import planned, write_safetensors
    write_safetensors(str(tmp_path / "plain.safetensors"), planned(list(values.items())), dict(step="3"))
    saved = convert.import_file(str(tmp_path / "plain.safetensors"), str(tmp_path / "run"))

    def load():
        return checkpoint.Checkpoint(checkpoint.checkpoint_at(saved)).model_state()
    intact, rng = load(), random.Random(3)
    assert same(intact, values)
    rank_file = os.path.join(saved, "rank-00000.safetensors")
    results = corrupt_each(saved, "rank-00000.safetensors", rng, 40, load,
                           header_end=safetensors_regions(open(rank_file, "rb").read())[0])
    results += corrupt_each(saved, "manifest.json", rng, 40, load)
    assert_refused_or_intact(results, intact)
    assert sum(kind == "refused" for _, (kind, _), _ in results) > 70


# -- a tokenizer folder --------------------------------------------------------------------------------

def tokenizer_load(folder):
    tokenizer = Tokenizer.from_folder(folder)
    return tokenizer.fingerprint, tokenizer.encode("the cat sat on it"), tokenizer.bos_id, tokenizer.eos_id


def test_corrupted_tokenizer_folders_are_refused_or_tell_themselves_apart(tmp_path):
    """tokenizer.json is what the data's meta.json records the fingerprint of: a corrupted one that still
    loads has another fingerprint, so that data made by the intact one is refused beside it (training/cli.py's
    check_tokenizer); its other files either read as intact or are refused. Downloaded into huggingface_hub's
    cache, every corruption is refused."""
    folder = tokenizer_folder(tmp_path / "tokenizer")
    intact, rng = tokenizer_load(folder), random.Random(4)
    results = corrupt_each(folder, "tokenizer.json", rng, 30, lambda: tokenizer_load(folder))
    for what, (kind, value), _ in results:
        assert kind == "refused" or value[0] != intact[0], what
    results = corrupt_each(folder, "generation_config.json", rng, 20, lambda: tokenizer_load(folder))
    for what, (kind, value), _ in results:
        assert kind == "refused" or value[1] == intact[1], what  # (an id it names may change: what the file says)
    snapshot = hub_layout(tmp_path, folder)
    assert tokenizer_load(snapshot)[1:] == intact[1:]
    for name in ("tokenizer.json", "generation_config.json"):
        for what, (kind, _), _ in corrupt_each(snapshot, name, rng, 10, lambda: tokenizer_load(snapshot)):
            assert kind == "refused", what
