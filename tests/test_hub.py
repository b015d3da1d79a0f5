"""A Hugging Face hub id where a folder is expected (training/hub.py): --init-from openai/gpt-oss-20b in
train.py, tools/sample.py, and tools/prepare.py's --tokenizer.

Nothing is downloaded: each test lays out huggingface_hub's cache in tmp_path as huggingface_hub does
(models--OWNER--NAME/refs/main holding the commit, snapshots/COMMIT/FILE a link to ../../blobs/HASH, a
blob named by the SHA-256 of a file kept in Git LFS, the weights, else by git's SHA-1 of the blob), with
HF_HUB_OFFLINE=1: huggingface_hub finds the snapshot there, or says it is not there. Where huggingface_hub
is not installed those tests are skipped; the refusal without it is tested everywhere (its import made to
fail), and so is a folder path, returned as it is.
"""
import hashlib
import os
import subprocess
import sys

import pytest

import hf_models
from distributed import run_on_ranks
from oracle import train_worker
from texts import tokenizer_folder
from tools import prepare, sample
from training import cli, hf, hub, integrity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "openai/gpt-oss-20b"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
QUICK = ["--seq-len", "16", "--batch-size", "2"]
VOCAB = 300  # the tokenizer's (a byte-level BPE's 256 bytes and some merges), and the model's


def blob_name(path):
    """The name huggingface_hub's cache gives a file's blob: its etag, the SHA-256 of an LFS file (the
    weights), else git's SHA-1 of the blob."""
    data = open(path, "rb").read()
    if path.endswith(".safetensors"):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lay_out_cache(cache, repo, source, commit=COMMIT):
    """huggingface_hub's cache of `repo` at `commit` (refs/main), holding the files of the folder `source`;
    returns the snapshot's folder."""
    storage = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(storage, "snapshots", commit)
    os.makedirs(os.path.join(storage, "blobs"))
    os.makedirs(os.path.join(storage, "refs"))
    os.makedirs(snapshot)
    for name in sorted(os.listdir(source)):
        blob = blob_name(os.path.join(source, name))
        os.replace(os.path.join(source, name), os.path.join(storage, "blobs", blob))
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    with open(os.path.join(storage, "refs", "main"), "w") as f:
        f.write(commit)  # (no newline, as huggingface_hub writes it)
    return snapshot


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """huggingface_hub's cache (empty) in tmp_path, offline: the environment variables, and the constants
    huggingface_hub read from them when it was imported (in this process, perhaps by another test)."""
    constants = pytest.importorskip("huggingface_hub.constants", reason="huggingface_hub is not installed (optional)")
    cache = str(tmp_path / "hub-cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    return cache


@pytest.fixture
def cached(offline, tmp_path):
    """The snapshot folder of REPO in the offline cache: a tiny Llama, with a tokenizer of its vocabulary."""
    source = tmp_path / "source"
    tokenizer_folder(source, vocab_size=VOCAB)
    hf_models.make_folder(str(source), "llama", config=dict(hf_models.tiny_config("llama"), vocab_size=VOCAB))
    return lay_out_cache(offline, REPO, str(source))


@pytest.fixture
def without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` raises ImportError


def one_line_error(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


# 1. Found in the cache ------------------------------------------------------------------------------------

def test_a_hub_id_is_its_snapshot_folder_in_the_cache(cached):
    assert hub.resolve(REPO) == cached
    assert hub.resolve(REPO, "tokenizer") == cached
    assert hub.resolve(f"{REPO}@main") == cached
    assert hub.resolve(f"{REPO}@{COMMIT}") == cached
    assert sorted(os.listdir(cached)) == ["config.json", "generation_config.json", "model.safetensors",
                                          "tokenizer.json"]
    assert integrity.hub_problem(cached) is None  # each file hashes to its blob's name, as downloaded ones do


def test_init_from_a_hub_id_reads_the_snapshot(cached):
    args = cli.parse_args(["--init-from", REPO, *QUICK])
    assert args.init_from == REPO  # (parsing reads nothing)
    config, _ = cli.check_args(args, 1)
    assert args.init_from == cached  # once, as the flags' first file is read: every later use reads the folder
    assert (config.n_layer, config.d_model, config.vocab_size) == (4, 32, VOCAB)  # tests/hf_models.py's tiny Llama
    assert config == cli.check_args(cli.parse_args(["--init-from", cached, *QUICK]), 1)[0]
    hf.HuggingFaceValues(args.init_from, config).check_shapes()


def offline_train_worker(cache, argv):
    """train_worker with huggingface_hub offline on `cache`: the ranks fork from a server started before this
    test set its environment (distributed.run_on_ranks), so each sets it for itself, and for huggingface_hub's
    constants where it was imported already."""
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache)
    if sys.modules.get("huggingface_hub.constants"):
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True
        sys.modules["huggingface_hub.constants"].HF_HUB_CACHE = cache
    return train_worker(argv)


def test_train_py_trains_from_a_hub_id(cached, offline, tmp_path):
    """Each rank resolves it (offline: from the cache) before its first read, and starts from the folder's
    weights: its first loss is the one of a run given the snapshot's folder itself."""
    runs = []
    for name, source in [("hub", REPO), ("folder", cached)]:
        argv = [*QUICK, "--init-from", source, "--steps", "1", "--out", str(tmp_path / name), "--tp", "2"]
        runs.append(run_on_ranks(2, offline_train_worker, offline, argv, timeout=120)[0]["losses"])
    assert runs[0] == runs[1]


def test_prepare_and_sample_take_a_hub_id(cached, tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    for name, text in [("cat", "the cat sat on the mat"), ("dog", "the dog sat on the log")]:
        (tmp_path / "notes" / f"{name}.txt").write_text(text)
    meta = prepare.prepare([str(tmp_path / "notes")], REPO, str(tmp_path / "data"), val=1)
    assert meta["tokenizer"] == cached
    sample.main(["--init-from", REPO, "--prompt", "the cat", "--max-new-tokens", "3", "--temperature", "0",
                 "--device", "cpu"])
    assert capsys.readouterr().out.strip()  # (what a tiny random model continues with: something)


# 2. Not found: one line -----------------------------------------------------------------------------------

def test_offline_and_not_in_the_cache_is_one_line(offline, capsys):
    with pytest.raises(hub.HubError, match=r"^openai/gpt-oss-20b: not in huggingface_hub's cache \(.*hub-cache\), "
                                           r"and HF_HUB_OFFLINE is set$"):
        hub.resolve(REPO)
    with pytest.raises(cli.ConfigError, match=f"^--init-from {REPO}: not in huggingface_hub's cache"):
        cli.check_args(cli.parse_args(["--init-from", REPO, *QUICK]), 1)
    with pytest.raises(SystemExit) as exit:
        prepare.main(["--tokenizer", REPO, "--out", str(offline), "notes.txt"])
    assert exit.value.code == 2
    assert one_line_error(capsys).startswith(f"python -m tools.prepare: error: --tokenizer {REPO}: not in")
    with pytest.raises(SystemExit, match=f"^python -m tools.sample: error: {REPO}: not in huggingface_hub's cache"):
        sample.main(["--init-from", REPO, "--prompt", "the cat", "--device", "cpu"])


def test_the_hub_out_of_reach_is_one_line(offline, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import LocalEntryNotFoundError

    def unreachable(*args, **kwargs):
        raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub.\nMore.")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(hub.HubError, match=r"^openai/gpt-oss-20b: not in huggingface_hub's cache \(.*\), and the "
                                           r"hub cannot be reached \(An error happened .* on the Hub\.\)$"):
        hub.resolve(REPO)


def test_without_huggingface_hub_a_hub_id_is_refused_in_one_line(without_huggingface_hub, capsys):
    with pytest.raises(hub.HubError, match=r"^openai/gpt-oss-20b: no such folder, and a Hugging Face hub id needs "
                                           r"huggingface_hub: pip install huggingface_hub$"):
        hub.resolve(REPO)
    with pytest.raises(cli.ConfigError, match=f"^--init-from {REPO}: no such folder, and a Hugging Face hub id "
                                              f"needs huggingface_hub: pip install huggingface_hub$"):
        cli.check_args(cli.parse_args(["--init-from", REPO, *QUICK]), 1)


# 3. A folder is a folder ----------------------------------------------------------------------------------

def test_an_existing_path_is_returned_as_it_is(tmp_path, monkeypatch, without_huggingface_hub):
    """Even named like owner/name, and without huggingface_hub (never imported for it)."""
    monkeypatch.chdir(tmp_path)
    os.makedirs(REPO)
    assert hub.resolve(REPO) == REPO
    (tmp_path / "openai" / "notes").write_text("")  # a file: the caller says what is wrong with it
    assert hub.resolve("openai/notes") == "openai/notes"
    args = cli.parse_args(["--init-from", REPO, *QUICK])
    with pytest.raises(cli.ConfigError):  # (an empty folder: no config.json; not a hub id)
        cli.check_args(args, 1)
    assert args.init_from == REPO


@pytest.mark.parametrize("name", [None, "", "Llama-3.2-1B", "/no/such/folder", "./no/such", "../no/such", "a/b/c",
                                  "a--b/c", "a/b..c", "-a/b", "a/.b", "a/b@"])
def test_what_is_no_hub_id_keeps_the_callers_error(name, without_huggingface_hub):
    assert hub.resolve(name) == name


def test_huggingface_hub_is_imported_only_for_a_hub_id():
    """training/hub.py imports it when a hub id is resolved, never when imported (it is optional)."""
    imports = "import sys, train, training.hub, tools.prepare, tools.sample; print('huggingface_hub' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", imports], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout == "False\n", out.stderr[-2000:]
