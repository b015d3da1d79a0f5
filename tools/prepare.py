"""Your own text as the token directory train.py reads (--data DIR), with a Hugging Face model's tokenizer.

    python -m tools.prepare --tokenizer Llama-3.2-1B --out data/notes notes/ letters.jsonl
    torchrun --nproc_per_node 2 train.py --init-from Llama-3.2-1B --data data/notes

Inputs are .txt files (a document each), .jsonl files (a document a line: its "text" field, or --field's),
the same compressed (.jsonl.gz: gzip, .jsonl.zst: zstd), .parquet files (a document a row: its "text"
column, or --field's, read a row group at a time) and folders of them, searched recursively in sorted order
(other files ignored; blank lines, null values and empty documents skipped). Each document becomes its
ids (training/tokenizer.py: BOS first if the model expects one) and then the tokenizer's EOS, which tells
the model where a text ends and generation stops. The documents go one after another, in input order, into
DIR/train.bin and DIR/val.bin: uint16 ids where the vocabulary fits in 16 bits, else uint32. DIR/meta.json
describes them (training/data.py reads it):

    dtype, vocab_size                   the ids' type, and how many ids the tokenizer has
    eos_id, bos_id, add_bos             its special ids (bos_id null if it has none)
    tokenizer, tokenizer_sha256         its folder, and its tokenizer.json's SHA-256
    documents, tokens                   per split: {"train": ..., "val": ...}
    field, val, seed, inputs_sha256     how the inputs were read and split, and their files' SHA-256 (the
                                        bytes as stored: compressed ones compressed)
    files                               per file written: its bytes and the SHA-256 of each 64 MiB chunk,
                                        which training checks, the ranks a share of the chunks each
    sha256                              of meta.json's own contents (training/integrity.py)

The validation split takes whole documents, never part of one: --val is a fraction of them (rounded to the
nearest count) or a count, picked by a shuffle seeded by --seed.

Two passes over the inputs. The first checks and counts every document (a bad line fails before anything
is written; the count places the split). The second tokenizes them in chunks (--chunk-docs documents or
--chunk-bytes characters, whichever comes first) over --workers processes, with at most two chunks a
worker in flight, and appends each chunk's tokens to the files in input order. Memory is then bounded by
the chunks in flight, whatever the size of the corpus (only a single document must fit), and any number
of workers writes the same bytes.
"""
import argparse
import collections
import contextlib
import gzip
import hashlib
import io
import json
import math
import multiprocessing
import os
import sys
import time
import zlib

import numpy as np

from training import hub
from training.chat import ChatError, ChatTemplate, end_ids
from training.integrity import chunk_digests, json_digest
from training.tokenizer import Tokenizer, TokenizerError

PROG = "python -m tools.prepare"
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
INPUT_KINDS = (".txt files (a document each), .jsonl files (a document a line; compressed: .jsonl.gz, .jsonl.zst) "
               "or .parquet files (a document a row), or folders of them")
PARQUET_BATCH_ROWS = 1024  # rows made Python values at a time: memory holds these and a row group's column
SPLITS = ("train", "val")
CHUNKS_A_WORKER = 2  # one being tokenized, one waiting: a worker never idles while the writer catches up


class PrepareError(Exception):
    """Bad input or flags: printed as one line, and the command exits with status 2."""


# ---------------------------------------------------------------------------
# Reading: input paths -> documents, lazily
# ---------------------------------------------------------------------------

def input_files(inputs):
    """The files to read, in order: each input file as given, each folder's input files (by SUFFIXES) sorted."""
    files = []
    for path in inputs:
        if os.path.isdir(path):
            found = sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                           for name in names if name.endswith(SUFFIXES))
            if not found:
                raise PrepareError(f"{path}: a folder with no {', '.join(SUFFIXES[:-1])} or {SUFFIXES[-1]} "
                                   f"files in it")
            files += found
        elif not os.path.exists(path):
            raise PrepareError(f"{path}: no such file or folder")
        elif not path.endswith(SUFFIXES):
            raise PrepareError(f"{path}: not an input: {INPUT_KINDS}")
        else:
            files.append(path)
    return files


def file_records(path, field, digest=None):
    """(where, value) for each record of one input file, in order, read as they are asked for. A .txt file is
    one record, its text; each line of a .jsonl file (blank lines skipped) or row of a Parquet file (nulls
    skipped) is one, its `field` as JSON or Parquet gives it: a str, list, dict or number. `where` names the
    file, and the line (path:17) or row (path: row 17), for messages. digest, if given, is fed the file's
    bytes as stored (compressed, for .jsonl.gz and .jsonl.zst)."""
    try:
        with open(path, "rb", buffering=0) as raw:
            if path.endswith(".parquet"):
                if digest:  # a Parquet file is read from its footer, a column at a time: hashed beforehand
                    hash_rest(raw, digest)
                    raw.seek(0)
                yield from parquet_records(path, raw, field)
                return
            stream = io.BufferedReader(Hashing(raw, digest) if digest else raw)
            if path.endswith(".txt"):
                yield path, utf8_text(path, stream.read())
                return
            for number, line in jsonl_lines(path, stream):
                if line.strip():
                    where = f"{path}:{number}"
                    yield where, jsonl_field(line, field, where)
            if digest:  # bytes a decompressor left after its end (gzip and zstd read to the end: a safeguard)
                hash_rest(raw, digest)
    except OSError as e:
        raise PrepareError(f"{path}: cannot be read ({e.strerror})") from None


def hash_rest(file, digest):
    """Feed digest the bytes of file from where it is to its end."""
    for block in iter(lambda: file.read(1 << 20), b""):
        digest.update(block)


class Hashing(io.RawIOBase):
    """A binary file that feeds digest each byte read from it: the bytes as stored, whatever decodes them."""

    def __init__(self, file, digest):
        self.file, self.digest = file, digest

    def readable(self):
        return True

    def readinto(self, buffer):
        count = self.file.readinto(buffer)
        self.digest.update(memoryview(buffer)[:count])
        return count


def utf8_text(path, data):
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path}: not UTF-8 text (byte {e.start})") from None


def jsonl_lines(path, stream):
    """(line number, line) of a .jsonl file's stream, decompressed as its suffix says: gzip for .gz, zstd
    for .zst."""
    kind = "gzip" if path.endswith(".gz") else "zstd" if path.endswith(".zst") else "text"
    if kind == "gzip":
        stream = gzip.GzipFile(fileobj=stream, mode="rb")
    elif kind == "zstd":
        import pyarrow  # here, not above: only .zst and .parquet inputs need it (and the spawned workers never)
        stream = io.BufferedReader(pyarrow.CompressedInputStream(stream, "zstd"))
    try:
        yield from enumerate(stream, 1)
    except (OSError, EOFError, zlib.error) as e:
        raise_invalid(path, kind, e)


def jsonl_field(line, field, where):
    """The value of `field` in one .jsonl line, as JSON gives it."""
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        raise PrepareError(f"{where}: not UTF-8 text") from None
    except ValueError as e:
        raise PrepareError(f"{where}: not JSON ({e})") from None
    if not isinstance(record, dict) or field not in record:
        raise PrepareError(f"{where}: no {field!r} field (--field names the field holding the text)")
    return record[field]


def parquet_records(path, file, field):
    """(where, value) for each row of a Parquet file whose `field` is not null, PARQUET_BATCH_ROWS rows at a
    time: memory holds a row group's column, never the file."""
    import pyarrow.parquet  # here, not above: only .zst and .parquet inputs need it (and the spawned workers never)
    try:
        parquet = pyarrow.parquet.ParquetFile(file)
        columns = parquet.schema_arrow.names
        if field not in columns:  # pyarrow would read no rows at all, silently
            raise PrepareError(f"{path}: no {field!r} column (--field names the column holding the text; its "
                               f"columns are {', '.join(columns)})")
        row = 0
        for batch in parquet.iter_batches(PARQUET_BATCH_ROWS, columns=[field]):
            for value in batch.column(0).to_pylist():
                row += 1
                if value is not None:
                    yield f"{path}: row {row}", value
    except (OSError, pyarrow.ArrowException) as e:
        raise_invalid(path, "Parquet", e)


def raise_invalid(path, kind, error):
    """Raise what gzip, zlib or pyarrow raised reading path as `kind` as one line; but an OSError with an errno
    as it is: the system's (permissions, a failing disk), which file_records reports as such."""
    if isinstance(error, OSError) and error.errno is not None:
        raise error
    reason = str(error).strip().splitlines() or [type(error).__name__]
    raise PrepareError(f"{path}: not a valid {kind} file ({reason[0]})") from None


def document_text(where, value, field):
    """The text of a record's value: a string (empty ones are skipped by the caller)."""
    if not isinstance(value, str):
        raise PrepareError(f"{where}: {field!r} is a {type(value).__name__}, not a string")
    return value


def file_documents(path, field, digest=None, kind=None):
    """The non-empty documents of one input file, read as they are asked for (see file_records), each
    checked by kind (Texts: a string; Conversations: a list of messages its template renders)."""
    kind = kind or Texts()
    for where, value in file_records(path, field, digest):
        document = kind.document(where, value, field)
        if document:
            yield document


def documents(files, field, kind=None):
    """Every document of the files, in order, each read when it is asked for."""
    for path in files:
        yield from file_documents(path, field, kind=kind)


def survey(files, field, progress, kind=None):
    """The first pass: every document read and checked. Returns (documents, the inputs' SHA-256): the
    field's name, then each file's SHA-256 in order, hashed."""
    inputs = hashlib.sha256(field.encode() + b"\0")
    count = 0
    for path in files:
        digest = hashlib.sha256()
        for _ in file_documents(path, field, digest, kind):
            count += 1
            progress.show(lambda: f"read {count:,} documents")
        inputs.update(digest.digest())
    return count, inputs.hexdigest()


# ---------------------------------------------------------------------------
# What a document is: a text, or a conversation (--chat) with the tokens its loss counts
# ---------------------------------------------------------------------------

class Texts:
    """Documents of text: each a string, its ids (BOS first if the model expects one) and then EOS."""
    loss_mask = False

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.separator = tokenizer and tokenizer.eos_id  # ends each document in the token files

    def document(self, where, value, field):
        return document_text(where, value, field)

    def size(self, text):
        return len(text)

    def encode(self, text):
        """(ids, None: every token counts)."""
        return self.tokenizer.encode(text), None


class Conversations(Texts):
    """Documents that are conversations (a list of {role, content}), rendered by the model folder's chat
    template (training/chat.py, in Jinja2's sandbox): their ids as the template writes them, and a loss
    mask that counts the assistant's turns. Each ends with a separator: the first of the tokenizer's ends
    (EOS, the other ids that end a generation, the padding token) that the template never writes, so that
    document masking splits the token files between conversations, never inside one."""
    loss_mask = True

    def __init__(self, tokenizer, folder):
        super().__init__(tokenizer)
        try:
            self.chat = ChatTemplate.from_folder(folder, tokenizer)
            self.separator = self.chat.document_end(end_ids(folder, tokenizer))
        except ChatError as e:
            raise PrepareError(f"--tokenizer {e}") from None
        self.separator_text = tokenizer.backend.id_to_token(self.separator)

    def document(self, where, messages, field):
        try:
            text, _ = self.chat.assistant_spans(messages)
        except ChatError as e:
            raise PrepareError(f"{where}: {e}") from None
        if self.separator_text in text:
            raise PrepareError(f"{where}: the conversation writes {self.separator_text!r}, the token that ends "
                               f"each conversation in the token files")
        return messages

    def size(self, messages):
        return sum(len(message["content"]) for message in messages)

    def encode(self, messages):
        return self.chat.encode(messages)


def document_kind(tokenizer, chat):
    """Texts, or with --chat Conversations rendered by the tokenizer folder's template."""
    return Conversations(tokenizer, tokenizer.source) if chat else Texts(tokenizer)


def validation_documents(val, n_documents, seed):
    """A boolean per document, True for the val split: --val's count of them (a fraction of n_documents
    rounded to the nearest count), chosen by a shuffle seeded by seed."""
    count = val if isinstance(val, int) else math.floor(val * n_documents + 0.5)
    if count < 1 or count >= n_documents:
        empty = "val" if count < 1 else "train"
        raise PrepareError(f"--val {val} of {n_documents:,} documents leaves the {empty} split empty (each split "
                           f"takes whole documents, and a .txt file is one: --val is a fraction between 0 and 1 or "
                           f"a count below {n_documents:,})")
    in_val = np.zeros(n_documents, dtype=bool)
    in_val[np.random.default_rng(seed).choice(n_documents, count, replace=False)] = True
    return in_val


def chunks(texts, in_val, chunk_docs, chunk_bytes, size_of=len):
    """(documents, their in_val flags): consecutive runs of at most chunk_docs documents, each closed once it
    holds chunk_bytes characters (size_of(document); a long document closes the chunk it joins)."""
    chunk, size, start = [], 0, 0
    for text in texts:
        chunk.append(text)
        size += size_of(text)
        if len(chunk) == chunk_docs or size >= chunk_bytes:
            yield chunk, in_val[start:start + len(chunk)]
            chunk, size, start = [], 0, start + len(chunk)
    if chunk:
        yield chunk, in_val[start:start + len(chunk)]


# ---------------------------------------------------------------------------
# Tokenizing: chunks -> token arrays, in order, over worker processes
# ---------------------------------------------------------------------------

def token_dtype(vocab_size):
    """The narrowest unsigned type that holds every id below vocab_size (the largest is vocab_size - 1)."""
    return "uint16" if vocab_size - 1 <= np.iinfo(np.uint16).max else "uint32"


def encode_chunk(kind, texts, in_val):
    """(train tokens, val tokens, documents, train mask, val mask): each document's ids and then the
    separator (EOS), in order, in its split; with a loss mask (kind.loss_mask: conversations), a uint8 a
    token, 1 where the loss counts it (never the separator), else the masks are None."""
    splits, masks = ([], []), ([], [])
    for text, val in zip(texts, in_val):
        ids, counted = kind.encode(text)
        splits[int(val)].extend([*ids, kind.separator])
        masks[int(val)].extend([*(counted or ()), False])
    dtype = token_dtype(kind.tokenizer.vocab_size)
    train_mask, val_mask = (np.array(m, dtype=np.uint8) if kind.loss_mask else None for m in masks)
    return np.array(splits[0], dtype=dtype), np.array(splits[1], dtype=dtype), len(texts), train_mask, val_mask


worker_kind = None  # a worker process's own, loaded once by start_worker


def start_worker(folder, chat):
    global worker_kind
    worker_kind = document_kind(Tokenizer.from_folder(folder), chat)


def encode_chunk_in_worker(texts, in_val):
    return encode_chunk(worker_kind, texts, in_val)


def encoded_chunks(tasks, kind, workers, deadline):
    """encode_chunk of each (texts, in_val) of tasks, in order. With more than one worker, tasks are drawn
    only as results are taken (at most CHUNKS_A_WORKER a worker in flight: bounded memory) and a result not
    ready within `deadline` seconds (a worker killed, or stuck) stops everything."""
    if workers == 1:
        for texts, in_val in tasks:
            yield encode_chunk(kind, texts, in_val)
        return
    # Spawned, not forked: a fork would copy this process's tokenizer threads' locks in whatever state.
    context = multiprocessing.get_context("spawn")
    initargs = (kind.tokenizer.source, kind.loss_mask)
    with context.Pool(workers, initializer=start_worker, initargs=initargs) as pool:  # exit: terminate
        pending = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(encode_chunk_in_worker, task))
            if len(pending) == CHUNKS_A_WORKER * workers:
                yield result_within(pending.popleft(), deadline)
        while pending:
            yield result_within(pending.popleft(), deadline)


def result_within(result, deadline):
    try:
        return result.get(timeout=deadline)
    except multiprocessing.TimeoutError:
        raise PrepareError(f"a chunk took a worker more than --timeout {deadline:g} s (the worker was killed, or "
                           f"is stuck): stopped") from None


# ---------------------------------------------------------------------------
# Writing: train.bin and val.bin appended chunk by chunk, then meta.json
# ---------------------------------------------------------------------------

class Progress:
    """One line on stderr, at most once a second: rewritten in place on a terminal, else a line every 10 s."""

    def __init__(self, enabled=True, stream=sys.stderr):
        self.enabled, self.stream = enabled, stream
        self.in_place = enabled and stream.isatty()
        self.interval = 1.0 if self.in_place else 10.0
        self.last = time.monotonic()
        self.shown = False

    def show(self, line, final=False):
        """line: a function making the text, called only when it is shown."""
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.interval and not final):
            return
        self.last = now
        self.stream.write(f"\r{line()}\033[K" if self.in_place else f"{line()}\n")
        self.shown = True
        if final and self.in_place:
            self.stream.write("\n")
        self.stream.flush()


def written_files(loss_mask):
    """The files prepare writes per split: the ids, and with a loss mask the mask beside them."""
    return [f"{split}.{suffix}" for suffix in ("bin", "mask")[:1 + loss_mask] for split in SPLITS]


def write_splits(out, encoded, n_documents, progress, loss_mask=False):
    """Append each chunk's tokens to out's train.bin and val.bin (and their masks to train.mask and val.mask),
    under .partial names until prepare has them all. Returns the tokens in each split."""
    tokens, done, start = {split: 0 for split in SPLITS}, 0, time.monotonic()
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(os.path.join(out, name + ".partial"), "wb"))
                 for name in written_files(loss_mask)]
        for train_tokens, val_tokens, n_docs, *masks in encoded:
            for file, values in zip(files, [train_tokens, val_tokens, *masks]):
                values.tofile(file)
            tokens["train"] += len(train_tokens)
            tokens["val"] += len(val_tokens)
            done += n_docs
            progress.show(lambda: f"tokenized {done:,}/{n_documents:,} documents ({done / n_documents:.0%}), "
                                  f"{sum(tokens.values()):,} tokens, {time.monotonic() - start:.0f} s",
                          final=done == n_documents)
    return tokens


def write_json(path, value):
    with open(path + ".partial", "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
    os.replace(path + ".partial", path)


def check_out(out, force):
    if os.path.exists(out) and not os.path.isdir(out):
        raise PrepareError(f"--out {out}: a file, not a folder")
    if os.path.exists(os.path.join(out, "train.bin")) and not force:
        raise PrepareError(f"--out {out} already holds train.bin (--force writes over it)")


def prepare(inputs, tokenizer_folder, out, val=0.1, seed=0, field="text", workers=1, chunk_docs=1024,
            chunk_bytes=4 << 20, deadline=600.0, force=False, progress=None, chat=False):
    """Tokenize the documents of inputs into out/{train,val}.bin and out/meta.json (see the module's
    docstring). Returns meta.json's contents; raises PrepareError on bad input, before writing anything."""
    progress = progress or Progress(enabled=False)
    check_out(out, force)
    try:  # (a hub id, openai/gpt-oss-20b: its tokenizer's files, in huggingface_hub's cache; training/hub.py)
        tokenizer = Tokenizer.from_folder(hub.resolve(tokenizer_folder, "tokenizer", TokenizerError))
    except TokenizerError as e:
        raise PrepareError(f"--tokenizer {e}") from None
    if tokenizer.eos_id is None:
        raise PrepareError(f"--tokenizer {tokenizer_folder}: no file names an EOS token (eos_token_id in "
                           f"generation_config.json or config.json, or tokenizer_config.json's eos_token), "
                           f"and every document ends with one")
    kind = document_kind(tokenizer, chat)
    files = input_files(inputs)
    n_documents, inputs_sha256 = survey(files, field, progress, kind)
    if n_documents == 0:
        raise PrepareError(f"no documents in {', '.join(inputs)}: only empty files, lines or fields")
    in_val = validation_documents(val, n_documents, seed)

    os.makedirs(out, exist_ok=True)
    encoded = encoded_chunks(chunks(documents(files, field, kind), in_val, chunk_docs, chunk_bytes, kind.size),
                             kind, workers, deadline)
    tokens = write_splits(out, encoded, n_documents, progress, kind.loss_mask)
    n_val = int(in_val.sum())
    meta = dict(dtype=token_dtype(tokenizer.vocab_size), vocab_size=tokenizer.vocab_size,
                eos_id=kind.separator, bos_id=tokenizer.bos_id, add_bos=tokenizer.add_bos,
                tokenizer=tokenizer.source, tokenizer_sha256=tokenizer.fingerprint,
                documents={"train": n_documents - n_val, "val": n_val}, tokens=tokens,
                field=field, val=val, seed=seed, inputs_sha256=inputs_sha256, chat=chat, loss_mask=kind.loss_mask)
    # Until here everything went under .partial names: an interrupted run leaves the directory as it was.
    for name in written_files(kind.loss_mask):
        meta.setdefault("files", {})[name] = chunk_digests(os.path.join(out, name + ".partial"))
        os.replace(os.path.join(out, name + ".partial"), os.path.join(out, name))
    meta["sha256"] = json_digest(meta)  # (training/integrity.py: what tells them damaged from intact)
    write_json(os.path.join(out, "meta.json"), meta)
    return meta


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------

def fraction_or_count(text):
    """--val: an integer of at least 1 is a count of documents, else a fraction strictly between 0 and 1."""
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            value = None
    if isinstance(value, int) and value >= 1 or isinstance(value, float) and 0 < value < 1:
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is neither a fraction between 0 and 1 nor a count of at least 1")


def positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not positive")
        return value
    return parse


def parser():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=INPUT_KINDS)
    p.add_argument("--tokenizer", required=True, metavar="FOLDER",
                   help="a Hugging Face model folder holding tokenizer.json (the --init-from folder), or a hub "
                        "id (owner/name: huggingface_hub downloads its tokenizer)")
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="where train.bin, val.bin, meta.json go")
    p.add_argument("--val", type=fraction_or_count, default=0.1,
                   help="the validation split: a fraction of the documents, or a count (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the choice of the validation documents (default %(default)s)")
    p.add_argument("--field", default=None,
                   help="the field of each .jsonl line, or the column of each .parquet file, holding its text, or "
                        "with --chat its messages (default: text; with --chat, messages)")
    p.add_argument("--chat", action="store_true",
                   help="each record is a conversation (a list of {role, content}), rendered with the --tokenizer "
                        "folder's chat template; train.mask and val.mask mark the assistant's tokens, which alone "
                        "the loss counts")
    p.add_argument("--workers", type=positive(int), default=min(os.cpu_count() or 1, 8),
                   help="tokenizing processes (default: the CPUs, at most 8: %(default)s)")
    p.add_argument("--chunk-docs", type=positive(int), default=1024,
                   help="the most documents a chunk holds (default %(default)s)")
    p.add_argument("--chunk-bytes", type=positive(int), default=4 << 20,
                   help="a chunk is closed once it holds this many characters (default %(default)s)")
    p.add_argument("--timeout", type=positive(float), default=600.0,
                   help="the most seconds a worker may take over a chunk before all stops (default %(default)s)")
    p.add_argument("--force", action="store_true", help="write over an --out that already holds train.bin")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        field = args.field or ("messages" if args.chat else "text")
        meta = prepare(args.inputs, args.tokenizer, args.out, val=args.val, seed=args.seed, field=field,
                       workers=args.workers, chunk_docs=args.chunk_docs, chunk_bytes=args.chunk_bytes,
                       deadline=args.timeout, force=args.force, progress=Progress(), chat=args.chat)
    except PrepareError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    for split in SPLITS:
        print(f"{split}: {meta['documents'][split]:,} documents, {meta['tokens'][split]:,} tokens")
    masks = " and their loss masks (train.mask, val.mask)" if meta["loss_mask"] else ""
    print(f"wrote {os.path.join(args.out, 'train.bin')} and val.bin ({meta['dtype']}){masks}, and meta.json")


if __name__ == "__main__":
    main()
