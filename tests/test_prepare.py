"""Your own text in: training/tokenizer.py reads a model folder's tokenizer, tools/prepare.py turns text files
into the token directory training/data.py reads.

The tokenizers are trained here, with the tokenizers library's own trainer (nothing is downloaded), in the
layouts of released models: a byte-level BPE as GPT-2's, the same with 66,000 tokens added on top (over
65,536 ids: uint32, as Llama 3's and Qwen2's vocabularies need), and SentencePiece's layout as Llama 2's
(a "▁" for each space, byte fallback, a BOS before every text). Every document is checked to come back,
decoded, exactly as written, in its split, in order.
"""
import errno
import gzip
import hashlib
import json
import multiprocessing
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

import hf_models
from tools import convert, prepare
from tools.prepare import CHUNKS_A_WORKER, PrepareError, Texts, encode_chunk, encoded_chunks
from training import cli
from training.data import TokenFile, load_data, read_meta, split_lengths, tokenizer_of, vocab_size_of
from training.integrity import json_digest
from training.tokenizer import TOKENIZER_FILES, Tokenizer, TokenizerError, fingerprint

REPO = Path(__file__).resolve().parent.parent
EOT = "<|endoftext|>"
WIDE_EXTRA = 66_000  # tokens added to the byte-level BPE: its ids then go past 65,535


def words(seed=0, n=400):
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9))) for _ in range(n)]


WORDS = words()


def training_text(n=300):
    rng = random.Random(1)
    return [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(n)]


def model_folder(path, backend, **configs):
    """A Hugging Face model folder's tokenizer files: tokenizer.json, and `name`.json for each config."""
    path.mkdir(parents=True)
    backend.save(str(path / "tokenizer.json"))
    for name, value in configs.items():
        (path / f"{name}.json").write_text(json.dumps(value))
    return path


def byte_level_bpe(vocab_size=600):
    """GPT-2's layout: bytes mapped to printable characters before BPE, and back after."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.train_from_iterator(training_text(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return backend


def sentencepiece_bpe(vocab_size=300):
    """Llama 2's layout: "▁" for a space (and one put first), <0xNN> tokens for the bytes of what the
    vocabulary lacks, <s> and </s>."""
    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.train_from_iterator(training_text(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # the trainer makes no byte tokens: SentencePiece's are in the vocabulary
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return Backend.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: a model folder holding a tokenizer}, each naming its special tokens as released models do."""
    root = tmp_path_factory.mktemp("tokenizers")
    gpt2 = byte_level_bpe()
    eot = gpt2.token_to_id(EOT)
    found = {"gpt2": model_folder(root / "gpt2", gpt2, tokenizer_config=dict(bos_token=EOT, eos_token=EOT),
                                  generation_config=dict(bos_token_id=eot, eos_token_id=eot))}
    wide = byte_level_bpe()
    wide.add_tokens([f"<w{i}>" for i in range(WIDE_EXTRA)])
    # A list of ids that end generation, as Llama 3.1's chat models give: the first ends a document.
    found["wide"] = model_folder(root / "wide", wide, generation_config=dict(eos_token_id=[eot, eot + 1]))
    sentencepiece = sentencepiece_bpe()
    found["sentencepiece"] = model_folder(root / "sentencepiece", sentencepiece,
                                          tokenizer_config=dict(add_bos_token=True, bos_token="<s>",
                                                                eos_token="</s>"),
                                          config=dict(bos_token_id=1, eos_token_id=2))
    return {name: str(path) for name, path in found.items()}


def make_documents(n, seed=0, extras=()):
    """n distinct documents (each starts with its number): words, and what a tokenizer may trip on: accents,
    CJK and emoji (bytes the test tokenizers never saw), blank lines, CRLF, runs of spaces, a tab, a
    leading space, and the names of special tokens, which must stay text."""
    rng = random.Random(seed)
    oddities = ["é à ü", "日本語", "🙂", "\n\n", "\r\n", "  ", "\t", EOT, "<s>", "</s>", *extras]
    documents = []
    for i in range(n):
        parts = [f"document {i}:"] + [rng.choice(WORDS) for _ in range(rng.randint(1, 60))]
        for _ in range(rng.randint(0, 3)):
            parts.insert(rng.randrange(1, len(parts) + 1), rng.choice(oddities))
        documents.append((" " if rng.random() < 0.2 else "") + " ".join(parts))
    return documents


def write_inputs(root, documents, field="text"):
    """The first third of documents as .txt files in two nested folders, the rest a line each of two .jsonl
    files in a third, with what must be skipped (a blank line, an empty text, a file of another kind).
    Returns the inputs, in an order whose sorted walk gives back the documents' order."""
    third = len(documents) // 3
    for i, text in enumerate(documents[:third]):
        path = root / "texts" / str(i * 2 // third) / f"{i:04d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode())  # bytes: no newline translation
    (root / "texts" / "notes.md").write_text("not an input")
    records = root / "records"
    records.mkdir()
    rest = documents[third:]
    for name, part in (("a.jsonl", rest[:len(rest) // 2]), ("b.jsonl", rest[len(rest) // 2:])):
        lines = [json.dumps({"id": i, field: text}) for i, text in enumerate(part)]
        lines.insert(1, "")
        lines.insert(2, json.dumps({field: ""}))
        (records / name).write_text("\n".join(lines) + "\n")
    return [str(root / "texts"), str(records)]


def write_records(path, texts, field="text"):
    """texts as the records of path's kind, by its suffix: a .jsonl line each (compressed with gzip for .gz,
    zstd for .zst), or a Parquet row each, in row groups of 7 rows. A None is a blank line, or a null."""
    path = Path(path)
    if path.suffix == ".parquet":
        table = pyarrow.table({"id": list(range(len(texts))), field: texts})
        pyarrow.parquet.write_table(table, path, row_group_size=7)
        assert pyarrow.parquet.ParquetFile(path).num_row_groups == -(-len(texts) // 7)
        return path
    lines = "".join("\n" if text is None else json.dumps({field: text}) + "\n" for text in texts).encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(lines))
    elif path.suffix == ".zst":
        with pyarrow.CompressedOutputStream(str(path), "zstd") as f:
            f.write(lines)
    else:
        path.write_bytes(lines)
    return path


def zstd(data):
    with pyarrow.BufferOutputStream() as buffer, pyarrow.CompressedOutputStream(buffer, "zstd") as f:
        f.write(data)
    return buffer.getvalue().to_pybytes()


def read_splits(out):
    """{split: the documents decoded}, checking the layout: each document its ids (after a BOS when the
    tokenizer adds one) and then one EOS, the files ending with an EOS."""
    meta = read_meta(out)
    tokenizer = Tokenizer.from_folder(meta["tokenizer"])
    splits = {}
    for split in ("train", "val"):
        tokens = np.fromfile(os.path.join(out, f"{split}.bin"), dtype=meta["dtype"])
        assert len(tokens) == meta["tokens"][split] and tokens[-1] == meta["eos_id"]
        ends = np.flatnonzero(tokens == meta["eos_id"])
        pieces = np.split(tokens, ends + 1)[:-1]
        assert len(pieces) == meta["documents"][split]
        if meta["add_bos"]:
            assert all(piece[0] == meta["bos_id"] for piece in pieces)
        splits[split] = [tokenizer.decode(piece[:-1]) for piece in pieces]
    return splits


# 1. The tokenizer -----------------------------------------------------------------------------------------

def test_the_special_ids_come_from_the_folders_files(folders):
    gpt2, wide, sentencepiece = (Tokenizer.from_folder(folders[name]) for name in ("gpt2", "wide", "sentencepiece"))
    eot = gpt2.backend.token_to_id(EOT)
    assert (gpt2.eos_id, gpt2.bos_id, gpt2.add_bos) == (eot, eot, False)  # GPT-2 starts a text with nothing
    assert (wide.eos_id, wide.bos_id) == (eot, None)  # the first of generation_config.json's list
    assert (sentencepiece.eos_id, sentencepiece.bos_id, sentencepiece.add_bos) == (2, 1, True)
    assert gpt2.vocab_size == gpt2.backend.get_vocab_size(with_added_tokens=True)
    assert wide.vocab_size == gpt2.vocab_size + WIDE_EXTRA  # the added tokens count
    assert gpt2.source == os.path.abspath(folders["gpt2"]) and os.path.isabs(gpt2.source)
    assert gpt2.fingerprint == fingerprint(folders["gpt2"]) != wide.fingerprint


@pytest.mark.parametrize("name", ["gpt2", "wide", "sentencepiece"])
def test_decode_inverts_encode(folders, name):
    tokenizer = Tokenizer.from_folder(folders[name])
    for text in make_documents(40, seed=1, extras=["<w65999>"]):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert tokenizer.eos_id not in ids  # a special token's name in the text stays text
        assert (ids[0] == tokenizer.bos_id) == tokenizer.add_bos
        assert tokenizer.decode(np.array(ids)) == text
    if name == "wide":
        assert max(tokenizer.encode("<w65999>")) > 65535


def test_the_ids_fall_back_from_file_to_file(tmp_path):
    backend = byte_level_bpe(300)
    eot = backend.token_to_id(EOT)
    def special_ids(**configs):
        folder = model_folder(tmp_path / str(len(list(tmp_path.iterdir()))), backend, **configs)
        tokenizer = Tokenizer.from_folder(folder)
        return tokenizer.bos_id, tokenizer.eos_id
    assert special_ids() == (None, None)
    assert special_ids(config=dict(eos_token_id=eot, bos_token_id=eot)) == (eot, eot)
    assert special_ids(generation_config=dict(eos_token_id=[7, eot]), config=dict(eos_token_id=eot)) == (None, 7)
    assert special_ids(tokenizer_config=dict(eos_token=EOT)) == (None, eot)
    assert special_ids(tokenizer_config=dict(eos_token={"content": EOT, "special": True})) == (None, eot)
    with pytest.raises(TokenizerError, match="'<nope>' is not in the vocabulary"):
        special_ids(tokenizer_config=dict(eos_token="<nope>"))
    with pytest.raises(TokenizerError, match="outside the tokenizer's"):
        special_ids(config=dict(eos_token_id=backend.get_vocab_size() + 5))


def test_bos_is_added_as_the_folder_says(tmp_path):
    """tokenizer_config.json's add_bos_token decides; without it, tokenizer.json's post-processor (Llama 3's
    puts <|begin_of_text|> first); with neither, nothing is added."""
    backend = byte_level_bpe(300)
    backend.add_special_tokens(["<|begin_of_text|>"])
    bos = backend.token_to_id("<|begin_of_text|>")
    ids = dict(bos_token_id=bos, eos_token_id=backend.token_to_id(EOT))
    plain = Tokenizer.from_folder(model_folder(tmp_path / "plain", backend, config=ids))
    backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", bos)])
    llama3 = Tokenizer.from_folder(model_folder(tmp_path / "llama3", backend, config=ids))
    told_not_to = Tokenizer.from_folder(model_folder(tmp_path / "told", backend, config=ids,
                                                     tokenizer_config=dict(add_bos_token=False)))
    assert (plain.add_bos, llama3.add_bos, told_not_to.add_bos) == (False, True, False)
    assert llama3.encode("hello")[0] == bos and llama3.encode("hello")[1:] == plain.encode("hello")
    assert told_not_to.encode("hello") == plain.encode("hello")
    assert llama3.decode(llama3.encode("hello")) == "hello"


def test_a_folder_without_tokenizer_json_is_named(tmp_path):
    with pytest.raises(TokenizerError, match=f"{tmp_path}: no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    with pytest.raises(TokenizerError, match="no such folder"):
        Tokenizer.from_folder(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="tokenizer.json: not a tokenizer"):
        Tokenizer.from_folder(tmp_path)


# 2. Prepare: every document back, whole, in one split, in order ----------------------------------------------

@pytest.mark.parametrize("name", ["gpt2", "wide", "sentencepiece"])
def test_every_document_comes_back_whole_in_one_split_in_input_order(folders, tmp_path, name):
    documents = make_documents(60, extras=["<w65999>", "<w3>"] if name == "wide" else ())
    inputs = write_inputs(tmp_path, documents, field="body")
    out = tmp_path / "data"
    meta = prepare.prepare(inputs, folders[name], str(out), val=0.2, seed=3, field="body", chunk_docs=7)
    splits = read_splits(str(out))
    val = set(splits["val"])
    assert len(splits["val"]) == len(val) == 12  # 0.2 of 60, whole documents
    assert splits["val"] == [d for d in documents if d in val]
    assert splits["train"] == [d for d in documents if d not in val]
    tokenizer = Tokenizer.from_folder(folders[name])
    assert meta == read_meta(str(out))
    assert meta["documents"] == {"train": 48, "val": 12}
    assert meta["vocab_size"] == tokenizer.vocab_size and meta["eos_id"] == tokenizer.eos_id
    assert (meta["bos_id"], meta["add_bos"]) == (tokenizer.bos_id, tokenizer.add_bos)
    assert (meta["tokenizer"], meta["tokenizer_sha256"]) == (tokenizer.source, tokenizer.fingerprint)
    # uint16 exactly when every id fits in 16 bits; the wide tokenizer's ids do not, and are written.
    assert meta["dtype"] == ("uint32" if tokenizer.vocab_size > 65536 else "uint16")
    largest = max(np.fromfile(out / f"{split}.bin", dtype=meta["dtype"]).max() for split in ("train", "val"))
    assert (largest > 65535) == (name == "wide")


def test_the_validation_split_is_a_seeded_choice_of_whole_documents(folders, tmp_path):
    documents = make_documents(40)
    inputs = write_inputs(tmp_path, documents)
    def val_documents(out, **flags):
        prepare.prepare(inputs, folders["gpt2"], str(tmp_path / out), **flags)
        return read_splits(str(tmp_path / out))["val"]
    three = val_documents("a", val=3, seed=0)
    assert len(three) == 3 and val_documents("b", val=3, seed=0) == three
    assert val_documents("c", val=3, seed=1) != three  # another seed, another choice
    assert len(val_documents("d", val=0.1)) == 4
    assert len(val_documents("e", val=39)) == 39


def test_the_inputs_hash_covers_the_contents_and_the_field(folders, tmp_path):
    documents = make_documents(12)
    (tmp_path / "one").mkdir()
    inputs = write_inputs(tmp_path / "one", documents)
    first = prepare.prepare(inputs, folders["gpt2"], str(tmp_path / "a"), val=2)
    moved = tmp_path / "moved"
    os.rename(tmp_path / "one", moved)
    again = prepare.prepare([str(moved / "texts"), str(moved / "records")], folders["gpt2"], str(tmp_path / "b"),
                            val=2)
    assert again["inputs_sha256"] == first["inputs_sha256"]  # the contents, not where they are
    with open(moved / "records" / "a.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    changed = prepare.prepare([str(moved / "texts"), str(moved / "records")], folders["gpt2"],
                              str(tmp_path / "c"), val=2)
    assert changed["inputs_sha256"] != first["inputs_sha256"]


RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


def test_every_kind_of_records_file_prepares_the_same_bytes(folders, tmp_path):
    """The same texts as .jsonl, .jsonl.gz, .jsonl.zst and .parquet (seven row groups) give the same train.bin,
    val.bin and meta.json, but for inputs_sha256: the hash of each file's bytes as stored. The Parquet file
    is tokenized by two workers, the others by one: the same bytes whatever the number."""
    documents = make_documents(45)
    records = documents[:1] + [None, ""] + documents[1:]  # a blank line (or a null), an empty text: skipped
    outputs = {}
    for suffix in RECORD_SUFFIXES:
        path = write_records(tmp_path / f"records{suffix}", records)
        out = tmp_path / f"out{suffix}"
        meta = prepare.prepare([str(path)], folders["gpt2"], str(out), val=5, chunk_docs=4,
                               workers=2 if suffix == ".parquet" else 1)
        stored = hashlib.sha256(b"text\0" + hashlib.sha256(path.read_bytes()).digest())
        assert meta.pop("sha256") == json_digest(meta)  # (of the whole of meta.json: inputs_sha256 differs)
        assert meta.pop("inputs_sha256") == stored.hexdigest()
        outputs[suffix] = meta, (out / "train.bin").read_bytes(), (out / "val.bin").read_bytes()
    assert all(output == outputs[".jsonl"] for output in outputs.values())
    assert outputs[".jsonl"][0]["documents"] == {"train": 40, "val": 5}
    splits = read_splits(str(tmp_path / "out.parquet"))
    assert splits["train"] == [d for d in documents if d not in splits["val"]]


def test_a_folder_is_searched_for_every_kind_of_input(folders, tmp_path):
    documents = make_documents(24)
    folder = tmp_path / "corpus"
    (folder / "c").mkdir(parents=True)
    (folder / "a.txt").write_text(documents[0])
    write_records(folder / "b.jsonl.gz", documents[1:6])
    write_records(folder / "c" / "d.jsonl.zst", documents[6:12])
    write_records(folder / "e.parquet", documents[12:])
    (folder / "f.gz").write_bytes(gzip.compress(b"not an input"))
    (folder / "g.json").write_text(json.dumps({"text": "not an input"}))
    prepare.prepare([str(folder)], folders["gpt2"], str(tmp_path / "out"), val=4)
    splits = read_splits(str(tmp_path / "out"))
    assert splits["train"] == [d for d in documents if d not in splits["val"]] and len(splits["val"]) == 4


def test_a_records_value_reaches_the_caller_as_the_value_it_is(tmp_path):
    """file_records gives a field's value as JSON or Parquet holds it (a chat's messages: a list of dicts),
    with where it was; the text check is apart, in file_documents."""
    chats = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
             for i in range(9)]
    parquet = tmp_path / "chats.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"messages": chats[:4] + [None] + chats[4:]}), parquet,
                                row_group_size=4)
    lines = tmp_path / "chats.jsonl.gz"
    lines.write_bytes(gzip.compress("".join(json.dumps({"messages": chat}) + "\n\n" for chat in chats).encode()))
    assert list(prepare.file_records(str(parquet), "messages")) == [
        (f"{parquet}: row {row}", chat) for row, chat in zip([1, 2, 3, 4, 6, 7, 8, 9, 10], chats)]
    assert list(prepare.file_records(str(lines), "messages")) == [
        (f"{lines}:{2 * i + 1}", chat) for i, chat in enumerate(chats)]
    with pytest.raises(PrepareError, match="chats.parquet: row 1: 'messages' is a list, not a string"):
        next(prepare.file_documents(str(parquet), "messages"))


# 3. Chunks, processes, memory ---------------------------------------------------------------------------------

def run_prepare(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tools.prepare", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_one_and_two_workers_write_the_same_bytes(folders, tmp_path):
    documents = make_documents(90, extras=["<w65999>"])
    inputs = write_inputs(tmp_path, documents)
    outputs = {}
    for workers in (1, 2):
        out = tmp_path / f"workers{workers}"
        result = run_prepare("--tokenizer", folders["wide"], "--out", out, "--workers", workers,
                             "--chunk-docs", 4, "--val", 0.1, *inputs)
        assert result.returncode == 0, result.stderr
        meta = read_meta(str(out))
        assert result.stdout.splitlines()[:2] == [
            f"{split}: {meta['documents'][split]:,} documents, {meta['tokens'][split]:,} tokens"
            for split in ("train", "val")]
        assert "tokenized 90/90 documents (100%)" in result.stderr  # the progress line's last state
        outputs[workers] = {name: (out / name).read_bytes() for name in ("train.bin", "val.bin", "meta.json")}
    assert outputs[1] == outputs[2]
    splits = read_splits(str(tmp_path / "workers2"))
    assert sorted(splits["train"] + splits["val"]) == sorted(documents)


def test_workers_draw_chunks_only_as_results_are_taken(folders):
    """However long the corpus, at most CHUNKS_A_WORKER chunks a worker are read ahead of the writer: the
    documents are drawn from the reader lazily, so memory holds a few chunks, never the corpus."""
    kind = Texts(Tokenizer.from_folder(folders["gpt2"]))
    documents = make_documents(60)
    tasks = [(documents[i:i + 3], np.arange(i, i + 3) % 4 == 0) for i in range(0, 60, 3)]
    drawn = []
    def lazily():
        for task in tasks:
            drawn.append(task)
            yield task
    workers = 2
    for taken, result in enumerate(encoded_chunks(lazily(), kind, workers, deadline=120)):
        assert len(drawn) <= taken + CHUNKS_A_WORKER * workers
        expected = encode_chunk(kind, *tasks[taken])
        assert all(np.array_equal(a, b) for a, b in zip(result[:2], expected[:2])) and result[2] == 3
    assert taken == len(tasks) - 1


def test_a_worker_past_the_deadline_stops_everything(folders):
    """A result not ready in time (a worker killed or stuck; here, one still starting) ends the run with an
    error, and the pool's processes with it."""
    kind = Texts(Tokenizer.from_folder(folders["gpt2"]))
    tasks = [(["a document"], np.array([False]))] * 8
    with pytest.raises(PrepareError, match="more than --timeout 0.001 s"):
        list(encoded_chunks(iter(tasks), kind, workers=2, deadline=0.001))
    assert multiprocessing.active_children() == []


# VmHWM, as training/meter.py reads it (not getrusage's ru_maxrss, which a process keeps across exec from the
# parent it was forked from: here pytest, with PyTorch loaded).
PEAK_RSS = """
import sys
from tools.prepare import main
main(sys.argv[1:])
with open("/proc/self/status") as f:
    print(next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")))
"""


def peak_resident_bytes(*args):
    result = subprocess.run([sys.executable, "-c", PEAK_RSS, *map(str, args)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return int(result.stdout.splitlines()[-1])


def test_memory_is_bounded_by_the_chunk_not_the_corpus(folders, tmp_path):
    """Prepare's peak resident memory over a corpus of 96 chunks (6 MiB) is within half the corpus's size of
    its peak over a corpus of one chunk. Holding the corpus would cost at least its size (its text alone: a
    byte a character) and its ids several times more (a Python list: an 8-byte pointer and a 28-byte int an
    id, an id every 4 characters or so); streaming holds one chunk's text (64 KiB) and ids (under 1 MiB),
    which the one-chunk run holds too, so the difference is the allocator's noise, well under the half."""
    chunk_bytes = 64 << 10
    rng = random.Random(2)
    def corpus(path, n_bytes):
        with open(path, "w") as f:
            written = 0
            while written < n_bytes:
                line = json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(800))}) + "\n"
                f.write(line)
                written += len(line)
        return written
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    corpus(small, chunk_bytes)
    large_bytes = corpus(large, 96 * chunk_bytes)
    peaks = [peak_resident_bytes("--tokenizer", folders["gpt2"], "--out", tmp_path / name, "--workers", 1,
                                 "--chunk-bytes", chunk_bytes, "--val", 1, path)
             for name, path in (("small", small), ("large", large))]
    assert np.fromfile(tmp_path / "large" / "train.bin", dtype=np.uint16).size > 90 * chunk_bytes // 8  # all read
    assert peaks[1] - peaks[0] < large_bytes / 2, (peaks, large_bytes)


# 4. Bad input: one clear line, nothing written --------------------------------------------------------------

def test_errors_are_one_line_with_status_2(folders, tmp_path):
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    result = run_prepare("--tokenizer", folders["gpt2"], "--out", tmp_path / "out", records)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"python -m tools.prepare: error: {records}:2: no 'text' field "
                                          f"(--field names the field holding the text)"]
    assert not (tmp_path / "out").exists()


@pytest.fixture
def one_document(tmp_path):
    (tmp_path / "one.txt").write_text("a document")
    return str(tmp_path / "one.txt")


def bad_inputs(tmp_path, one_document):
    """{case: (inputs, what the error says)}."""
    def file(name, content):
        path = tmp_path / name
        path.write_bytes(content)
        return str(path)
    def parquet(name, **columns):
        path = tmp_path / name
        pyarrow.parquet.write_table(pyarrow.table(columns), path, row_group_size=5)
        return str(path)
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "readme.md").write_text("no inputs here")
    lines = b'{"text": "ok"}\n' * 40
    return {
        "missing": ([one_document, str(tmp_path / "gone.txt")], "gone.txt: no such file or folder"),
        "not utf-8": ([file("latin1.txt", "café".encode("latin-1")), one_document], "latin1.txt: not UTF-8 text"),
        "not json": ([file("bad.jsonl", b'{"text": "ok"}\n{"text": "ok"}\n{"text": \n')], "bad.jsonl:3: not JSON"),
        "not a string": ([file("list.jsonl", b'{"text": ["a"]}\n')], "list.jsonl:1: 'text' is a list, not a string"),
        "other kind": ([file("notes.md", b"text")], "notes.md: not an input: .txt files"),
        "no inputs in the folder": ([str(tmp_path / "nothing")],
                                    "a folder with no .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet files"),
        "no column": ([parquet("body.parquet", body=["a", "b"])],
                      "body.parquet: no 'text' column \\(--field names the column holding the text; its "
                      "columns are body\\)"),
        "not a string in a row": ([parquet("ids.parquet", text=[None] * 16 + [17, 18])],  # rows in 4 groups
                                  "ids.parquet: row 17: 'text' is a int, not a string"),
        "not parquet": ([file("fake.parquet", b"PAR1 a text file")],
                        "fake.parquet: not a valid Parquet file \\(Parquet magic bytes not found"),
        "not gzip": ([file("plain.jsonl.gz", lines)], "plain.jsonl.gz: not a valid gzip file \\(Not a gzipped"),
        "cut gzip": ([file("cut.jsonl.gz", gzip.compress(lines)[:-12])],
                     "cut.jsonl.gz: not a valid gzip file \\(Compressed file ended"),
        "cut zstd": ([file("cut.jsonl.zst", zstd(lines)[:-6])], "cut.jsonl.zst: not a valid zstd file"),
        "not zstd": ([file("plain.jsonl.zst", lines)], "plain.jsonl.zst: not a valid zstd file"),
        "not json, compressed": ([file("bad.jsonl.zst", zstd(lines + b'{"text": \n'))], "bad.jsonl.zst:41: not JSON"),
        "empty": ([file("empty.txt", b""), file("blank.jsonl", b'\n{"text": ""}\n')], "no documents in"),
    }


@pytest.mark.parametrize("case", ["missing", "not utf-8", "not json", "not a string", "other kind",
                                  "no inputs in the folder", "empty", "no column", "not a string in a row",
                                  "not parquet", "not gzip", "cut gzip", "cut zstd", "not zstd",
                                  "not json, compressed"])
def test_bad_inputs_are_named(folders, tmp_path, one_document, case, monkeypatch):
    monkeypatch.setattr(prepare, "PARQUET_BATCH_ROWS", 3)  # rows counted across batches and row groups
    inputs, message = bad_inputs(tmp_path, one_document)[case]
    with pytest.raises(PrepareError, match=message) as error:
        prepare.prepare(inputs, folders["gpt2"], str(tmp_path / "out"))
    assert "\n" not in str(error.value)  # one line
    assert not (tmp_path / "out").exists()


def test_an_unreadable_file_is_named(folders, tmp_path, one_document, monkeypatch):
    locked = tmp_path / "locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    if os.geteuid() == 0:  # root reads it anyway: refuse it as the kernel refuses anyone else
        def refusing_open(path, *args, **kwargs):
            if str(path) == str(locked):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return open(path, *args, **kwargs)
        monkeypatch.setattr(prepare, "open", refusing_open, raising=False)
    with pytest.raises(PrepareError, match="locked.txt: cannot be read \\(Permission denied\\)"):
        prepare.prepare([one_document, str(locked)], folders["gpt2"], str(tmp_path / "out"))


def test_a_val_that_leaves_a_split_empty_is_refused(folders, tmp_path):
    inputs = write_inputs(tmp_path, make_documents(12))
    for val, empty in ((12, "train"), (40, "train"), (0.01, "val"), (0.99, "train")):
        with pytest.raises(PrepareError, match=f"--val {val} of 12 documents leaves the {empty} split empty"):
            prepare.prepare(inputs, folders["gpt2"], str(tmp_path / "out"), val=val)
    result = run_prepare("--tokenizer", folders["gpt2"], "--out", tmp_path / "out", "--val", "1.5", *inputs)
    assert result.returncode == 2 and "--val: '1.5' is neither a fraction" in result.stderr


def test_an_existing_train_bin_is_kept_without_force(folders, tmp_path):
    inputs = write_inputs(tmp_path, make_documents(12))
    out = tmp_path / "out"
    prepare.prepare(inputs, folders["gpt2"], str(out), val=2)
    before = (out / "train.bin").read_bytes()
    with pytest.raises(PrepareError, match="already holds train.bin"):
        prepare.prepare(inputs, folders["sentencepiece"], str(out), val=2)
    assert (out / "train.bin").read_bytes() == before
    meta = prepare.prepare(inputs, folders["sentencepiece"], str(out), val=2, force=True)
    assert read_meta(str(out)) == meta and meta["add_bos"]
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]  # no .partial file left


def test_a_tokenizer_without_eos_is_refused(folders, tmp_path, one_document):
    folder = model_folder(tmp_path / "no-eos", byte_level_bpe(300))
    with pytest.raises(PrepareError, match="no file names an EOS token"):
        prepare.prepare([one_document], str(folder), str(tmp_path / "out"))
    with pytest.raises(PrepareError, match="--tokenizer .*: no tokenizer.json"):
        prepare.prepare([one_document], str(tmp_path), str(tmp_path / "out"))


# 5. training/data.py reads it --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt2", "wide"])
def test_load_data_reads_the_prepared_directory(folders, tmp_path, name):
    inputs = write_inputs(tmp_path, make_documents(60, extras=["<w65999>"] if name == "wide" else ()))
    out = str(tmp_path / "data")
    meta = prepare.prepare(inputs, folders[name], out, val=0.2)
    data = load_data(out, vocab_size=1000, seed=0)  # meta.json's vocabulary wins over the one given
    assert isinstance(data, TokenFile)
    assert data.vocab_size == vocab_size_of(out, 1000) == Tokenizer.from_folder(folders[name]).vocab_size
    assert split_lengths(out) == meta["tokens"]
    assert tokenizer_of(out) == (os.path.abspath(folders[name]), fingerprint(folders[name]))
    for split in ("train", "val"):
        tokens = np.fromfile(os.path.join(out, f"{split}.bin"), dtype=meta["dtype"])
        assert data.tokens[split].dtype == np.dtype(meta["dtype"])
        np.testing.assert_array_equal(data.tokens[split], tokens)
        windows = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.int64), 17)
        for row in data.batch(split, 0, 4, 16).numpy():
            assert (windows == row).all(1).any()
    assert data.scan() == ({os.path.join(out, f"{s}.bin"): np.fromfile(os.path.join(out, f"{s}.bin"),
                                                                        dtype=meta["dtype"]).max()
                            for s in ("train", "val")}, None)


def test_a_nanogpt_directory_still_loads_as_uint16(tmp_path):
    tokens = np.arange(300, dtype=np.uint16) * 200  # ids up to 59,800: read as uint32 they would be other ids
    for split in ("train", "val"):
        tokens.tofile(tmp_path / f"{split}.bin")
    data = load_data(str(tmp_path))
    assert data.tokens["train"].dtype == np.uint16 and data.vocab_size == 50257
    np.testing.assert_array_equal(data.tokens["val"], tokens)
    assert split_lengths(str(tmp_path)) == {"train": 300, "val": 300}
    assert tokenizer_of(str(tmp_path)) is None and tokenizer_of(None) is None and read_meta(str(tmp_path)) is None


def test_a_broken_meta_json_is_named(tmp_path):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "int8", "vocab_size": 10}))
    with pytest.raises(ValueError, match="meta.json: its dtype must be one of uint16, uint32"):
        load_data(str(tmp_path))
    (tmp_path / "meta.json").write_text("{")
    with pytest.raises(ValueError, match="meta.json: cannot be read as JSON"):
        vocab_size_of(str(tmp_path))


# -- train.py refuses data whose ids another tokenizer made ------------------------------------------

def released_model(path, tokenizer_folder, vocab_size):
    """A Hugging Face model folder as check_args reads it (config.json; weights are read only at build time),
    with tokenizer_folder's tokenizer."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(hf_models.tiny_config("llama"), vocab_size=vocab_size)))
    (path / "tokenizer.json").write_bytes((Path(tokenizer_folder) / "tokenizer.json").read_bytes())
    return str(path)


def test_train_checks_that_the_data_was_tokenized_by_the_models_tokenizer(folders, tmp_path):
    inputs = write_inputs(tmp_path, make_documents(40))
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    prepare.prepare(inputs, folders["gpt2"], ours, val=0.25)
    prepare.prepare(inputs, folders["sentencepiece"], theirs, val=0.25)
    model = released_model(tmp_path / "model", folders["gpt2"], Tokenizer.from_folder(folders["gpt2"]).vocab_size)
    flags = ["--init-from", model, "--seq-len", "16", "--batch-size", "2"]
    config, _ = cli.check_args(cli.parse_args([*flags, "--data", ours]), 1)
    assert config.vocab_size == Tokenizer.from_folder(folders["gpt2"]).vocab_size
    with pytest.raises(cli.ConfigError, match="was tokenized by .*sentencepiece's tokenizer.json, not by --init-from"):
        cli.check_args(cli.parse_args([*flags, "--data", theirs]), 1)
    text = tmp_path / "notes.txt"
    text.write_text(" ".join(make_documents(10)))
    with pytest.raises(cli.ConfigError, match="is a text file, read as bytes .* python -m tools.prepare --tokenizer"):
        cli.check_args(cli.parse_args([*flags, "--data", str(text)]), 1)


def test_the_hugging_face_export_carries_the_tokenizer_the_run_trained_with(folders, tmp_path):
    data = str(tmp_path / "data")
    prepare.prepare(write_inputs(tmp_path, make_documents(40)), folders["gpt2"], data, val=0.25)
    run = subprocess.run([sys.executable, "train.py", "--model", "tiny", "--arch", "llama", "--data", data,
                          "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--out", str(tmp_path / "runs"),
                          "--name", "r"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = tmp_path / "exported"
    convert.export_hf(str(tmp_path / "runs" / "r" / "checkpoint-00000001"), str(out))
    copied = sorted(name for name in os.listdir(folders["gpt2"]) if name in TOKENIZER_FILES)
    assert copied == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in copied:
        assert (out / name).read_bytes() == (Path(folders["gpt2"]) / name).read_bytes()
    assert Tokenizer.from_folder(str(out)).fingerprint == fingerprint(folders["gpt2"])
