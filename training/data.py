"""Training data: a synthetic language with a known loss floor, or real tokens.

Every batch is a pure function of (seed, split, step): any rank, in any
configuration, restarted or not, reads exactly the same global batch for a
given step and takes its own slice of it. That is what lets every parallel
configuration be compared token for token with the single device.

- `MarkovLanguage`: the default, nothing to download. A sparse random Markov
  chain over the vocabulary; its entropy rate H = sum_s pi(s) H(P(.|s)) is
  computed exactly, and it is the lowest mean cross-entropy any model can
  reach on it (the "floor" drawn under every loss curve), even at GPT-2's
  vocabulary of 50304 tokens.
- `TokenFile`: real tokens, from a text file (bytes are tokens, vocabulary
  256, the last tenth held out) or from a directory holding `train.bin` and
  `val.bin`: written by tools/prepare.py, with `meta.json` giving the ids'
  type (uint16 or uint32), the vocabulary and the tokenizer that made them;
  or nanoGPT's, uint16 ids and optionally `meta.pkl` (its "vocab_size").
  The files are mapped, not read: only the windows of each batch are loaded,
  and one scan, shared by the ranks, checks the ids and, against meta.json's
  SHA-256 of each chunk, the bytes (a file cut short is refused by its size).
- `DataInfo`: what is known of the data before any token is read (its
  vocabulary, the ids' type, the EOS id, the tokenizer), from one reading of
  its meta.json; `open_data` opens the data one describes.
"""
import dataclasses
import hashlib
import json
import os
import pickle

import numpy as np
import torch

from training.integrity import CHUNK_BYTES, json_digest_matches, recorded_chunks_problem

SPLITS = {"train": 0, "val": 1}
GPT2_VOCAB_SIZE = 50257  # a token directory without meta.json or meta.pkl: nanoGPT's default
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}  # meta.json's "dtype"; nanoGPT's directories: uint16
MIXTURE_STREAM = 1  # a mixture draws its sources from a random stream apart from the windows' (batch_rng)


def batch_rng(seed, split, step):
    """The random stream of one batch: a pure function of (seed, split, step)."""
    return np.random.default_rng([seed, SPLITS[split], step])


def stationary_distribution(successors, probs, tol=1e-15, max_iters=100_000):
    """pi with pi P = pi and sum(pi) = 1, where token s goes to successors[s, k] with probability probs[s, k].

    Power iteration on the sparse table: a dense P, or a dense solve, would not
    fit GPT-2's vocabulary (V = 50304: 20 GB, O(V^3) time). Each step computes
    pi P in O(V * branching) as a bincount. It iterates the lazy chain
    (I + P) / 2, which has the same stationary distribution but no period, so
    it converges even on a periodic chain. It stops once a step changes pi by
    no more than a few units in the last place of its largest entry (1e-15
    relative; below that, rounding may never settle): pi then matches a dense
    solve to ~1e-13 relative, so the entropy floor is exact to every printed digit.
    """
    vocab_size = len(successors)
    targets = successors.ravel()
    pi = np.full(vocab_size, 1 / vocab_size)
    for _ in range(max_iters):
        pi_P = np.bincount(targets, weights=(pi[:, None] * probs).ravel(), minlength=vocab_size)
        new = (pi + pi_P) / 2
        if np.abs(new - pi).max() <= tol * new.max():
            return new / new.sum()
        pi = new
    raise RuntimeError(f"the stationary distribution did not converge in {max_iters} power iterations "
                       f"(vocabulary {vocab_size}): the chain mixes too slowly")


class Data:
    """What training asks of its data, beyond batch(split, step, n_seqs, length): these defaults say every
    target counts and there is nothing more to log."""

    def loss_mask(self, split, step, n_seqs, length):
        """Beside batch(): True where the token is a target the loss counts; None where every target counts."""
        return None

    def log(self, step, n_seqs, length):
        """What a step's log record carries of the data, beyond tokens_seen."""
        return {}


class MarkovLanguage(Data):
    """Each token is followed by one of `branching` successors, with fixed probabilities."""

    def __init__(self, vocab_size=256, branching=4, seed=0):
        if not 2 <= branching <= vocab_size:
            raise ValueError(f"branching={branching} must be between 2 and vocab_size={vocab_size}")
        rng = np.random.default_rng([seed, 12345])
        self.vocab_size = vocab_size
        self.seed = seed
        self.info = DataInfo(None, vocab_size)  # what the configuration knew of it: no files, no documents
        successors = np.stack([rng.choice(vocab_size, branching, replace=False) for _ in range(vocab_size)])
        # Every token can be followed by the next one in the vocabulary: the
        # chain is then irreducible, so its stationary distribution is unique.
        has_next = (successors == (np.arange(vocab_size)[:, None] + 1) % vocab_size).any(1)
        successors[~has_next, 0] = (np.arange(vocab_size)[~has_next] + 1) % vocab_size
        self.successors = successors
        self.probs = rng.dirichlet(np.ones(branching), size=vocab_size)
        self.cumulative = np.cumsum(self.probs, axis=1)
        self.stationary = stationary_distribution(self.successors, self.probs)
        self.entropy_rate = float(-(self.stationary[:, None] * self.probs * np.log(self.probs)).sum())

    def scan(self, part=0, n_parts=1):
        """Its tokens are the vocabulary's by construction: nothing to scan."""
        return {}, None

    def transition_matrix(self):
        """The dense V x V matrix P: for tests on small vocabularies only (20 GB at V = 50304)."""
        P = np.zeros((self.vocab_size, self.vocab_size))
        np.add.at(P, (np.arange(self.vocab_size)[:, None], self.successors), self.probs)
        return P

    def sample(self, rng, n_seqs, length):
        """n_seqs sequences of `length` tokens, each started from the stationary distribution.

        Starting from pi makes every position's next token equally hard, so the
        expected loss of a perfect model is the entropy rate at every position.
        """
        tokens = np.empty((n_seqs, length), dtype=np.int64)
        tokens[:, 0] = rng.choice(self.vocab_size, n_seqs, p=self.stationary)
        uniforms = rng.random((n_seqs, length - 1))
        for t in range(1, length):
            state = tokens[:, t - 1]
            choice = (self.cumulative[state] < uniforms[:, t - 1, None]).sum(1)
            choice = np.minimum(choice, self.successors.shape[1] - 1)  # guards u == 1 - eps rounding
            tokens[:, t] = self.successors[state, choice]
        return tokens

    def batch(self, split, step, n_seqs, length):
        """The global batch: (n_seqs, length + 1) tokens; inputs are [:, :-1], targets [:, 1:]."""
        return torch.from_numpy(self.sample(batch_rng(self.seed, split, step), n_seqs, length + 1))


def read_meta(path):
    """meta.json of the token directory at path (tools/prepare.py's: the ids' dtype, vocab_size, the
    tokenizer's folder and fingerprint, ...), or None where there is none: a text file, nanoGPT's directory."""
    file = os.path.join(path, "meta.json")
    if not os.path.isdir(path) or not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--data {file}: cannot be read as JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("dtype") not in TOKEN_DTYPES:
        raise ValueError(f"--data {file}: its dtype must be one of {', '.join(TOKEN_DTYPES)}")
    if not isinstance(meta.get("vocab_size"), int) or meta["vocab_size"] < 1:
        raise ValueError(f"--data {file}: its vocab_size must be a positive integer")
    if not json_digest_matches(meta):
        raise ValueError(f"--data {file}: damaged, its contents do not match its SHA-256 (edited by hand? then "
                         f"delete its \"sha256\" field)")
    for name, record in (meta.get("files") or {}).items():
        problem = recorded_chunks_problem(record)
        if problem or os.path.basename(name) != name:
            raise ValueError(f"--data {file}: damaged, its record of {name} {problem or 'is outside the folder'}")
    return meta


def tokenizer_in(meta):
    """(folder, SHA-256 of its tokenizer.json) of the tokenizer a meta.json names; None without a meta.json."""
    return (meta.get("tokenizer"), meta.get("tokenizer_sha256")) if meta else None


def tokenizer_of(path):
    """(folder, SHA-256 of its tokenizer.json) of the tokenizer that made the data at path, from its
    meta.json; None where unknown (no path: the synthetic language; a text file; nanoGPT's directory).
    training/tokenizer.py's fingerprint(folder) gives the same SHA-256 for a model folder, to compare. A
    mixture's sources share one tokenizer (DataInfo.mixture checks it): its first source's."""
    if path is None:
        return None
    weights = mixture_weights(path)
    return tokenizer_of(weights[0][0]) if weights else tokenizer_in(read_meta(path))


@dataclasses.dataclass(frozen=True)
class DataInfo:
    """What is known of the data before any token is read, from one reading of its meta.json (or meta.pkl).

    Training's configuration builds it once (training/cli.py's describe_data) and passes it to everything
    after: the checks, the model's vocabulary, the documents' EOS id, and the data opened (open_data).
    """
    path: str | None  # None: the synthetic language
    vocab_size: int
    dtype: np.dtype | None = None  # the ids' type in the files: meta.json's, nanoGPT's uint16, a text's bytes
    eos_id: int | None = None  # the id that ends each document, where meta.json declares one
    tokenizer: tuple | None = None  # (folder, SHA-256) of the tokenizer that made the ids: meta.json's
    loss_mask: bool = False  # train.mask and val.mask beside the ids: which tokens the loss counts (meta.json's)
    sources: tuple = ()  # a weighted mixture's ((DataInfo, weight), ...): --data A:0.7,B:0.3 or a JSON file
    files: dict | None = None  # meta.json's {file: its size and its chunks' SHA-256} (training/integrity.py)

    @classmethod
    def read(cls, path=None, vocab_size=None):
        """The data at path (None: the synthetic language of vocab_size).

        Reads no tokens and builds nothing: it is read before any process group
        exists, to shape the model. A token directory's vocabulary comes from
        its meta.json or meta.pkl, else from vocab_size, else GPT-2's; never
        from a scan of the files.
        """
        if path is None:
            if vocab_size is None:
                raise ValueError("the synthetic language needs a vocab_size")
            return cls(None, vocab_size)
        weights = mixture_weights(path)
        if weights:
            return cls.mixture(path, [(cls.read(source, vocab_size), weight) for source, weight in weights])
        if not os.path.exists(path):
            raise FileNotFoundError(f"--data {path}: no such file or directory")
        if not os.path.isdir(path):
            return cls(path, 256, np.dtype(np.uint8))  # a text file: bytes are tokens
        meta = read_meta(path)
        if meta is None:  # nanoGPT's directory: uint16 ids
            return cls(path, nanogpt_vocab_size(path, vocab_size), np.dtype(np.uint16))
        return cls(path, meta["vocab_size"], np.dtype(TOKEN_DTYPES[meta["dtype"]]), meta.get("eos_id"),
                   tokenizer_in(meta), bool(meta.get("loss_mask")), files=meta.get("files"))

    @classmethod
    def mixture(cls, spec, sources):
        """The mixture of sources [(DataInfo, weight)]: they must read as one vocabulary (the same size, the
        same tokenizer where known, the same EOS), or a sequence's ids would mean different tokens."""
        first = sources[0][0]
        for info, _ in sources[1:]:
            for what, mine, theirs in [("vocabulary", info.vocab_size, first.vocab_size),
                                       ("EOS id", info.eos_id, first.eos_id),
                                       ("tokenizer", info.tokenizer and info.tokenizer[1],
                                        first.tokenizer and first.tokenizer[1])]:
                if mine != theirs:
                    raise ValueError(f"--data {spec}: {info.path}'s {what} ({mine}) is not {first.path}'s "
                                     f"({theirs}): a mixture's sources must be made by the same tokenizer")
        return cls(spec, first.vocab_size, None, first.eos_id, first.tokenizer,
                   any(info.loss_mask for info, _ in sources), tuple(sources))

    def split_lengths(self):
        """Tokens in each split, from the files' sizes alone (nothing is read); of a mixture, its smallest
        source's (each source must hold a sequence)."""
        if self.sources:
            lengths = [info.split_lengths() for info, _ in self.sources]
            return {split: min(length[split] for length in lengths) for split in SPLITS}
        if os.path.isdir(self.path):
            lengths = {split: token_count(os.path.join(self.path, f"{split}.bin"), self.dtype, self.files)
                       for split in SPLITS}
            for split, n_tokens in lengths.items() if self.loss_mask else ():
                read_mask(self.path, split, n_tokens, self.files)  # (its length checked: a flag a token)
            return lengths
        size = os.path.getsize(self.path)
        return {"train": int(size * 0.9), "val": size - int(size * 0.9)}  # the last tenth held out, as TokenFile does


class PlainValues(pickle.Unpickler):
    """An unpickler of plain values only (dict, list, tuple, str, int, float, bool, None, bytes): a pickle is
    a program, and one naming anything else (a function, a class: `os.system`, say) is refused before it
    runs. nanoGPT's meta.pkl is a dict of strings, ints and dicts of them."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and a data folder's meta.pkl may hold plain "
                                     f"values only (a pickle that names a function would run it)")


def read_plain_pickle(path):
    """The plain values pickled in the file at path; anything else is a ValueError naming the file."""
    try:
        with open(path, "rb") as f:
            return PlainValues(f).load()
    except Exception as e:  # noqa: BLE001 (a damaged pickle fails in any way: a length of 2^60 is a MemoryError)
        raise ValueError(f"--data {path}: refused ({str(e)[:160] or type(e).__name__})") from None


def nanogpt_vocab_size(path, vocab_size=None):
    """The vocabulary of nanoGPT's token directory at path: its meta.pkl's, else vocab_size, else GPT-2's."""
    pickled = os.path.join(path, "meta.pkl")
    if os.path.exists(pickled):
        meta = read_plain_pickle(pickled)
        if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int):
            raise ValueError(f"--data {pickled}: no integer vocab_size in it")
        return meta["vocab_size"]
    return GPT2_VOCAB_SIZE if vocab_size is None else vocab_size


def vocab_size_of(path, vocab_size=None):
    """The vocabulary of the data at path (None: the synthetic language of vocab_size); see DataInfo.read."""
    return DataInfo.read(path, vocab_size).vocab_size


def split_lengths(path):
    """Tokens in each split of the data at path, from the files' sizes alone (nothing is read)."""
    return DataInfo.read(path).split_lengths()


def token_count(file, dtype, files=None):
    """The tokens of `dtype` in the file (its size divided by theirs), or a ValueError naming the file where its
    size is not a whole number of them, or not the size its meta.json records (`files`)."""
    if not os.path.isfile(file):
        raise FileNotFoundError(2, "No such file or directory", file)
    size, recorded = os.path.getsize(file), (files or {}).get(os.path.basename(file))
    if recorded is not None and size != recorded["bytes"]:
        raise ValueError(f"--data {file}: damaged, {size:,} bytes where its meta.json records {recorded['bytes']:,}"
                         f"{' (cut short?)' if size < recorded['bytes'] else ''}")
    if size % dtype.itemsize:
        raise ValueError(f"--data {file}: damaged, {size:,} bytes is not a whole number of {dtype.name} tokens "
                         f"({dtype.itemsize} bytes each): cut short, or not of meta.json's dtype")
    return size // dtype.itemsize


def mapped(file, dtype, files=None):
    """The tokens of the file, mapped (only what is read is loaded), its size checked first (token_count)."""
    n = token_count(file, dtype, files)
    return np.memmap(file, dtype=dtype, mode="r") if n else np.zeros(0, dtype=dtype)


def read_mask(path, split, n_tokens, files=None):
    """The loss mask of a split (`split`.mask: one uint8 a token, 1 where the loss counts it), mapped."""
    file = os.path.join(path, f"{split}.mask")
    if not os.path.isfile(file):
        raise ValueError(f"--data {path}: its meta.json says it has a loss mask, and {split}.mask is missing")
    mask = mapped(file, np.dtype(np.uint8), files)
    if len(mask) != n_tokens:
        raise ValueError(f"--data {file}: {len(mask):,} flags for {n_tokens:,} tokens in {split}.bin")
    return mask


class TokenFile(Data):
    """Random windows of a token stream; a window never crosses into the other split."""

    entropy_rate = None  # unknown for real data

    def __init__(self, path, seed=0, vocab_size=None, info=None):
        """info: the data's DataInfo where it has been read already (else it is read here, from path)."""
        self.info = info or DataInfo.read(path, vocab_size)
        self.path = path
        self.seed = seed
        self.vocab_size = self.info.vocab_size
        self.masks = None  # per split, where the data has a loss mask: which tokens the loss counts as targets
        if os.path.isdir(path):
            # Mapped, not read: only the windows of each batch are ever loaded.
            self.tokens = {split: mapped(os.path.join(path, f"{split}.bin"), self.info.dtype, self.info.files)
                           for split in SPLITS}
            if self.info.loss_mask:
                self.masks = {split: read_mask(path, split, len(self.tokens[split]), self.info.files)
                              for split in SPLITS}
        else:
            data = np.fromfile(path, dtype=np.uint8)
            cut = int(len(data) * 0.9)
            self.tokens = {"train": data[:cut], "val": data[cut:]}

    def window_starts(self, split, step, n_seqs, length):
        """Where the n_seqs windows of length + 1 tokens of batch `step` start: a pure function of them."""
        n_tokens = len(self.tokens[split])
        if n_tokens < length + 1:
            raise ValueError(f"the {split} split has {n_tokens} tokens, too few for windows of {length + 1}")
        return batch_rng(self.seed, split, step).integers(0, n_tokens - length, n_seqs)  # last start included

    def batch(self, split, step, n_seqs, length):
        tokens = self.tokens[split]
        starts = self.window_starts(split, step, n_seqs, length)
        return torch.from_numpy(np.stack([tokens[s:s + length + 1].astype(np.int64) for s in starts]))

    def loss_mask(self, split, step, n_seqs, length):
        """Beside batch(): True where the token is a target the loss counts (tools/prepare.py --chat's mask:
        an assistant's tokens); None where every target counts."""
        if self.masks is None:
            return None
        mask = self.masks[split]
        starts = self.window_starts(split, step, n_seqs, length)
        return torch.from_numpy(np.stack([mask[s:s + length + 1] != 0 for s in starts]))

    def files(self):
        """{file: (its tokens or mask values, mapped; whether they are ids)} of what the scan reads."""
        if not os.path.isdir(self.path):
            return {self.path: (np.concatenate(list(self.tokens.values())), True)}
        files = {os.path.join(self.path, f"{split}.bin"): (self.tokens[split], True) for split in SPLITS}
        return files | {os.path.join(self.path, f"{split}.mask"): (mask, False) for split, mask in (self.masks or {}).items()}

    def scan(self, part=0, n_parts=1, chunk_bytes=CHUNK_BYTES):
        """({file: the largest id in this part's share of it}, the first damaged chunk's problem or None): the
        share is chunks part, part + n_parts, ... of each file (so ranks share the scan; read chunk by chunk,
        so a file larger than memory is fine), each hashed where meta.json records its chunks' SHA-256 (and
        then of the size it records, else of chunk_bytes)."""
        largest, problem = {}, None
        for file, (values, ids) in self.files().items():
            record = (self.info.files or {}).get(os.path.basename(file))
            step = (record or {}).get("chunk_bytes", chunk_bytes) // values.dtype.itemsize
            for index in range(part, -(-len(values) // step), n_parts):
                chunk = values[index * step:(index + 1) * step]
                if ids:
                    largest[file] = max(largest.get(file, 0), int(chunk.max()))
                if record and problem is None and hashlib.sha256(chunk).hexdigest() != record["sha256"][index]:
                    problem = (f"--data {file}: damaged, bytes {index * step * values.dtype.itemsize:,} to "
                               f"{(index * step + len(chunk)) * values.dtype.itemsize:,} do not match the SHA-256 "
                               f"its meta.json records")
        return largest, problem


def mixture_weights(spec):
    """[(source, weight)] where --data names a weighted mixture, else None (one source: the path itself).

    A mixture is written `A:0.7,B:0.3` (weights need not sum to 1: they are normalised), or is a JSON file
    {"A": 0.7, "B": 0.3} whose relative paths are read from the file's folder."""
    if spec.endswith(".json") and os.path.isfile(spec):
        try:
            with open(spec) as f:
                named = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--data {spec}: cannot be read as JSON ({e})") from None
        if not isinstance(named, dict) or not named:
            raise ValueError(f"--data {spec}: not a JSON object of data folders and their weights")
        folder = os.path.dirname(spec)
        pairs = [(os.path.join(folder, source), weight) for source, weight in named.items()]
    elif os.path.exists(spec) or ":" not in spec:
        return None
    else:
        pairs = [part.rpartition(":")[::2] for part in spec.split(",")]
    weights = []
    for source, weight in pairs:
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            weight = -1.0
        if not source or not 0 < weight < float("inf"):
            raise ValueError(f"--data {spec}: {source or '(no folder)'}'s weight {weight} is not a positive "
                             f"number (a mixture is FOLDER:WEIGHT,FOLDER:WEIGHT or a JSON file of them)")
        weights.append((source, weight))
    return weights


class Mixture(Data):
    """Sources drawn by weight: each sequence of a batch comes from the source its draw picks, a pure function
    of (seed, split, step, the sequence's index), so every layout and every resume reads the same tokens.
    Each source gives its sequences as it would alone (its own windows of its own splits)."""

    entropy_rate = None

    def __init__(self, info, seed=0):
        self.info, self.seed, self.vocab_size, self.path = info, seed, info.vocab_size, info.path
        self.sources = [TokenFile(source.path, seed, info=source) for source, _ in info.sources]
        self.names = [source.path for source, _ in info.sources]
        weights = np.array([weight for _, weight in info.sources])
        self.weights = weights / weights.sum()
        self.seen = (-1, np.zeros(len(self.sources), dtype=np.int64))  # (through step, sequences per source)

    def picks(self, split, step, n_seqs):
        """The source of each of the batch's n_seqs sequences (a stream of its own, apart from the windows')."""
        rng = np.random.default_rng([self.seed, SPLITS[split], step, MIXTURE_STREAM])
        return rng.choice(len(self.sources), n_seqs, p=self.weights)

    def gathered(self, read, split, step, n_seqs, length):
        """Each source's rows of the batch, read by read(source, n) for the n sequences it gives, in place."""
        picks, out = self.picks(split, step, n_seqs), None
        for k, source in enumerate(self.sources):
            mine = torch.from_numpy(picks == k)
            if mine.any():
                rows = read(source, int(mine.sum()))
                out = torch.empty((n_seqs, length + 1), dtype=rows.dtype) if out is None else out
                out[mine] = rows
        return out

    def batch(self, split, step, n_seqs, length):
        return self.gathered(lambda source, n: source.batch(split, step, n, length), split, step, n_seqs, length)

    def loss_mask(self, split, step, n_seqs, length):
        if not self.info.loss_mask:
            return None
        def read(source, n):  # a source without a mask counts every target
            mask = source.loss_mask(split, step, n, length)
            return torch.ones((n, length + 1), dtype=torch.bool) if mask is None else mask
        return self.gathered(read, split, step, n_seqs, length)

    def log(self, step, n_seqs, length):
        """tokens_seen_by_source: {source: tokens read from it} through `step`, a pure function of it (as
        tokens_seen is), kept as a running sum and counted again from step 0 only after a jump (a resume)."""
        last, counts = self.seen
        if step <= last:
            last, counts = -1, np.zeros_like(counts)
        for s in range(last + 1, step + 1):
            counts = counts + np.bincount(self.picks("train", s, n_seqs), minlength=len(self.sources))
        self.seen = (step, counts)
        return {"tokens_seen_by_source": {name: int(n) * length for name, n in zip(self.names, counts)}}

    def scan(self, part=0, n_parts=1):
        scans = [source.scan(part, n_parts) for source in self.sources]
        return {f: i for largest, _ in scans for f, i in largest.items()}, next((p for _, p in scans if p), None)


def open_data(info, seed=0):
    """The data a DataInfo describes: the synthetic language when its path is None, a weighted mixture of
    sources, or the text file or token directory at its path (its meta.json is not read again)."""
    if info.path is None:
        return MarkovLanguage(info.vocab_size, seed=seed)
    if info.sources:
        return Mixture(info, seed)
    return TokenFile(info.path, seed, info=info)


def load_data(path=None, vocab_size=None, seed=0):
    """The synthetic language of vocab_size when path is None, else the text file or token directory at path."""
    return open_data(DataInfo.read(path, vocab_size), seed)
