"""Training data: the Markov language's exact statistics, and batches as a pure
function of (seed, split, step), for the synthetic language and for token files.

Statistical checks derive their tolerances from the sample itself (standard
errors from counts or from independent sequences), never from hard-coded figures.
"""
import builtins
import dataclasses
import json
import os
import pickle
import re

import numpy as np
import pytest
import torch
from numpy.lib.stride_tricks import sliding_window_view

from training.data import (GPT2_VOCAB_SIZE, DataInfo, MarkovLanguage, TokenFile, load_data, open_data,
                           stationary_distribution, vocab_size_of)


@pytest.fixture(scope="module")
def small():
    """A small language: vocabulary 16, each token has 3 possible successors."""
    return MarkovLanguage(vocab_size=16, branching=3, seed=0)


@pytest.fixture(scope="module")
def small_sample(small):
    """4000 independent sequences of 65 tokens."""
    return small.batch("train", 0, 4000, 64).numpy()


@pytest.fixture(scope="module")
def gpt2_sized():
    """A language over GPT-2's padded vocabulary: its dense P alone would take 20 GB."""
    return MarkovLanguage(vocab_size=50304)


def dense_matrix(successors, probs):
    P = np.zeros((len(successors), len(successors)))
    np.add.at(P, (np.arange(len(successors))[:, None], successors), probs)
    return P


def dense_stationary(P):
    """The balance equations pi P = pi, one of them replaced by sum(pi) = 1, solved densely."""
    A = P.T - np.eye(len(P))
    A[-1] = 1.0
    b = np.zeros(len(P))
    b[-1] = 1.0
    return np.linalg.solve(A, b)


def sparse_pi_P(pi, lang):
    return np.bincount(lang.successors.ravel(), weights=(pi[:, None] * lang.probs).ravel(), minlength=len(pi))


# 1. The chain ------------------------------------------------------------------

@pytest.mark.parametrize("vocab_size, branching, seed", [(16, 3, 0), (64, 4, 1), (256, 4, 0), (5, 5, 2)])
def test_transition_matrix_is_stochastic_irreducible_and_pi_is_stationary(vocab_size, branching, seed):
    lang = MarkovLanguage(vocab_size, branching, seed)
    P = lang.transition_matrix()
    assert P.shape == (vocab_size, vocab_size)
    assert (P >= 0).all()
    np.testing.assert_allclose(P.sum(1), 1, rtol=1e-12)
    assert ((P > 0).sum(1) == branching).all()  # exactly `branching` distinct successors
    states = np.arange(vocab_size)
    assert (P[states, (states + 1) % vocab_size] > 0).all()  # s -> s+1 always possible: irreducible

    pi = lang.stationary
    assert pi.shape == (vocab_size,) and (pi > 0).all()
    np.testing.assert_allclose(pi.sum(), 1, rtol=1e-12)
    np.testing.assert_allclose(pi @ P, pi, rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("vocab_size, branching, seed", [(16, 3, 0), (64, 4, 1), (256, 4, 0), (5, 5, 2), (16, 2, 3)])
def test_sparse_stationary_distribution_equals_the_dense_solve(vocab_size, branching, seed):
    lang = MarkovLanguage(vocab_size, branching, seed)
    np.testing.assert_allclose(lang.stationary, dense_stationary(lang.transition_matrix()), rtol=1e-12, atol=0)


def test_stationary_distribution_of_a_periodic_chain():
    """{0, 1} -> {2, 3, 4} -> {0, 1}: period 2, with classes of unequal size."""
    successors = np.array([[2, 3], [3, 4], [0, 1], [0, 1], [0, 1]])
    probs = np.random.default_rng(0).dirichlet(np.ones(2), size=5)
    P = dense_matrix(successors, probs)
    # Plain power iteration from uniform never settles: the mass on {0, 1} swaps 2/5 <-> 3/5.
    uniform = np.full(5, 1 / 5)
    assert (uniform @ P)[:2].sum() == pytest.approx(3 / 5) and (uniform @ P @ P)[:2].sum() == pytest.approx(2 / 5)
    np.testing.assert_allclose(stationary_distribution(successors, probs), dense_stationary(P), rtol=1e-12, atol=0)


def test_gpt2_sized_language_has_a_stationary_distribution(gpt2_sized):
    pi = gpt2_sized.stationary
    assert pi.shape == (50304,) and (pi > 0).all()
    assert pi.sum() == pytest.approx(1, rel=1e-12)
    np.testing.assert_allclose(sparse_pi_P(pi, gpt2_sized), pi, rtol=1e-12, atol=0)
    assert 0 < gpt2_sized.entropy_rate < np.log(4)


def test_gpt2_sized_batches_use_only_allowed_successors(gpt2_sized):
    tokens = gpt2_sized.batch("train", 0, 8, 1024).numpy()
    assert tokens.shape == (8, 1025) and ((tokens >= 0) & (tokens < 50304)).all()
    assert (gpt2_sized.successors[tokens[:, :-1]] == tokens[:, 1:, None]).any(-1).all()


def test_branching_out_of_range_raises():
    for branching in (1, 17):
        with pytest.raises(ValueError):
            MarkovLanguage(vocab_size=16, branching=branching)


# 2. The entropy rate -------------------------------------------------------------

@pytest.mark.parametrize("vocab_size, branching, seed", [(16, 3, 0), (64, 4, 1), (256, 4, 0)])
def test_entropy_rate_equals_formula_from_transition_matrix(vocab_size, branching, seed):
    lang = MarkovLanguage(vocab_size, branching, seed)
    P = lang.transition_matrix()
    plogp = np.where(P > 0, P * np.log(np.where(P > 0, P, 1)), 0)
    expected = -(dense_stationary(P) * plogp.sum(1)).sum()
    assert lang.entropy_rate == pytest.approx(expected, rel=1e-12)
    assert 0 < lang.entropy_rate < np.log(branching)  # below the uniform-over-successors bound


def test_mean_true_nll_of_samples_matches_entropy_rate(small, small_sample):
    """The loss of the perfect model (true transition probabilities) averages to H."""
    P = small.transition_matrix()
    nll = -np.log(P[small_sample[:, :-1], small_sample[:, 1:]])
    per_sequence = nll.mean(1)  # sequences are independent; positions within one are not
    standard_error = per_sequence.std(ddof=1) / np.sqrt(len(per_sequence))
    assert standard_error > 0
    assert abs(per_sequence.mean() - small.entropy_rate) < 4 * standard_error


# 3. Sampled transitions ------------------------------------------------------------

def test_sampled_transitions_use_only_allowed_successors(small, small_sample):
    P = small.transition_matrix()
    assert (P[small_sample[:, :-1], small_sample[:, 1:]] > 0).all()


def test_empirical_transition_frequencies_match_probs(small, small_sample):
    counts = np.zeros((small.vocab_size, small.vocab_size))
    np.add.at(counts, (small_sample[:, :-1].ravel(), small_sample[:, 1:].ravel()), 1)
    visits = counts.sum(1)
    assert (visits > 1000).all()
    for s in range(small.vocab_size):
        p = small.probs[s]
        freq = counts[s, small.successors[s]] / visits[s]
        sigma = np.sqrt(p * (1 - p) / visits[s])
        assert (np.abs(freq - p) < 5 * sigma + 1e-12).all(), s


def test_first_tokens_follow_the_stationary_distribution(small, small_sample):
    n = len(small_sample)
    freq = np.bincount(small_sample[:, 0], minlength=small.vocab_size) / n
    sigma = np.sqrt(small.stationary * (1 - small.stationary) / n)
    assert (np.abs(freq - small.stationary) < 5 * sigma).all()


# 4. Batches are a pure function of (seed, split, step) -------------------------------

def test_markov_batch_shape_dtype_and_range():
    lang = MarkovLanguage(vocab_size=32, seed=0)
    b = lang.batch("train", 3, 5, 20)
    assert b.shape == (5, 21) and b.dtype == torch.int64
    assert ((b >= 0) & (b < 32)).all()


def test_markov_batch_is_a_pure_function_of_seed_split_step():
    a, b = MarkovLanguage(vocab_size=32, seed=0), MarkovLanguage(vocab_size=32, seed=0)
    reference = a.batch("train", 3, 5, 20)
    assert torch.equal(reference, a.batch("train", 3, 5, 20))
    assert torch.equal(reference, b.batch("train", 3, 5, 20))  # a separately built object
    assert not torch.equal(reference, a.batch("train", 4, 5, 20))
    assert not torch.equal(reference, a.batch("val", 3, 5, 20))
    assert not torch.equal(reference, MarkovLanguage(vocab_size=32, seed=1).batch("train", 3, 5, 20))


# 5. Token files and load_data -----------------------------------------------------

def assert_windows_are_slices(batch, tokens, length):
    """Every row of batch is tokens[s:s + length + 1] for some s."""
    assert batch.shape[1] == length + 1 and batch.dtype == torch.int64
    windows = sliding_window_view(np.asarray(tokens).astype(np.int64), length + 1)
    for row in batch.numpy():
        assert (windows == row).all(1).any(), row


@pytest.fixture
def text_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
    path = tmp_path / "corpus.txt"
    path.write_bytes(data.tobytes())
    return path, data


def test_text_file_tokens_are_bytes_split_at_ninety_percent(text_file):
    path, data = text_file
    tf = TokenFile(str(path))
    assert tf.vocab_size == 256
    np.testing.assert_array_equal(tf.tokens["train"], data[:900])
    np.testing.assert_array_equal(tf.tokens["val"], data[900:])


def test_text_file_windows_are_contiguous_slices_of_their_split(text_file):
    path, data = text_file
    tf = TokenFile(str(path))
    for step in range(3):
        assert_windows_are_slices(tf.batch("train", step, 8, 16), data[:900], 16)
        assert_windows_are_slices(tf.batch("val", step, 8, 16), data[900:], 16)


def test_text_file_windows_are_deterministic_per_seed_split_step(text_file):
    path, _ = text_file
    a, b = TokenFile(str(path), seed=0), TokenFile(str(path), seed=0)
    reference = a.batch("train", 2, 8, 16)
    assert torch.equal(reference, b.batch("train", 2, 8, 16))
    assert not torch.equal(reference, a.batch("train", 3, 8, 16))
    assert not torch.equal(reference, TokenFile(str(path), seed=1).batch("train", 2, 8, 16))
    assert not torch.equal(a.batch("val", 2, 8, 16), b.batch("val", 3, 8, 16))


def write_token_dir(path, train, val, meta_vocab_size=None):
    """A nanoGPT-style directory: train.bin, val.bin and, if given, meta.pkl."""
    np.asarray(train, dtype=np.uint16).tofile(path / "train.bin")
    np.asarray(val, dtype=np.uint16).tofile(path / "val.bin")
    if meta_vocab_size is not None:
        (path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": meta_vocab_size}))
    return str(path)


def test_token_directory_of_uint16_bins(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 1000, 500).astype(np.uint16)
    val = rng.integers(0, 1000, 100).astype(np.uint16)
    tf = TokenFile(write_token_dir(tmp_path, train, val))
    assert tf.vocab_size == GPT2_VOCAB_SIZE == 50257  # no meta.pkl, none given: GPT-2's
    assert_windows_are_slices(tf.batch("train", 0, 6, 32), train, 32)
    assert_windows_are_slices(tf.batch("val", 0, 6, 32), val, 32)


# The token ids below stay under 40: the vocabulary is never what the files hold, but what they are declared to.

def test_meta_pkl_sets_the_vocabulary_over_the_one_given(tmp_path):
    path = write_token_dir(tmp_path, np.arange(40), np.arange(40), meta_vocab_size=65)
    assert vocab_size_of(path, 1000) == TokenFile(path, vocab_size=1000).vocab_size == 65
    assert load_data(path, vocab_size=1000).vocab_size == 65


class CallsAFunction:
    """Pickled, it tells the unpickler to call os.system: what a downloaded meta.pkl could do to every rank."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_meta_pkl_that_would_call_a_function_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = write_token_dir(tmp_path, np.arange(40), np.arange(40))
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "x": CallsAFunction(marker)}))
    with pytest.raises(ValueError, match=r"meta.pkl: refused \(it names \w+\.system"):
        vocab_size_of(path)
    assert not marker.exists()
    # nanoGPT's own meta.pkl (shakespeare_char's: its vocabulary and the two character tables) is read
    chars = sorted(set("hello world"))
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "itos": dict(enumerate(chars)),
                                                      "stoi": {c: i for i, c in enumerate(chars)}}))
    assert vocab_size_of(path) == 65


def test_the_vocabulary_given_is_used_without_meta_pkl(tmp_path):
    path = write_token_dir(tmp_path, np.arange(40), np.arange(40))
    assert vocab_size_of(path, 1000) == TokenFile(path, vocab_size=1000).vocab_size == 1000
    assert load_data(path, vocab_size=1000).vocab_size == 1000


def test_the_default_vocabulary_is_gpt2s(tmp_path):
    path = write_token_dir(tmp_path, np.arange(40), np.arange(40))
    assert vocab_size_of(path) == TokenFile(path).vocab_size == load_data(path).vocab_size == 50257


def forbid_token_reads(monkeypatch):
    """From now on, any read of a token file, through numpy or open(), fails the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a token file was read")
    real_open = builtins.open
    def open_but_not_bins(file, *args, **kwargs):
        if str(file).endswith(".bin"):
            forbidden()
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(np, "memmap", forbidden)
    monkeypatch.setattr(np, "fromfile", forbidden)
    monkeypatch.setattr(builtins, "open", open_but_not_bins)


def test_the_vocabulary_is_found_without_reading_the_token_files(tmp_path, monkeypatch):
    (tmp_path / "with_meta").mkdir(), (tmp_path / "without_meta").mkdir()
    with_meta = write_token_dir(tmp_path / "with_meta", np.arange(40), np.arange(40), meta_vocab_size=65)
    without_meta = write_token_dir(tmp_path / "without_meta", np.arange(40), np.arange(40))
    forbid_token_reads(monkeypatch)
    assert vocab_size_of(with_meta, 1000) == 65
    assert vocab_size_of(without_meta, 1000) == 1000
    assert vocab_size_of(without_meta) == 50257


def test_the_scan_of_ids_is_shared_by_parts_that_cover_each_file(tmp_path):
    """Ranks share the scan of the token files: part r of n reads chunks r, r + n, ... of every file, the parts
    together cover all of it, and each file's largest id is found (here chunks of 7 tokens, so that a split
    has several)."""
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 1000, 103), rng.integers(0, 1000, 50)
    tf = TokenFile(write_token_dir(tmp_path, train, val))
    files = {str(tmp_path / "train.bin"): train, str(tmp_path / "val.bin"): val}
    assert tf.scan() == ({file: ids.max() for file, ids in files.items()}, None)
    for n_parts in (1, 2, 3, 5):
        parts = [tf.scan(part, n_parts, chunk_bytes=7 * 2)[0] for part in range(n_parts)]
        for part, largest in enumerate(parts):
            mine = {file: [ids[i:i + 7].max() for i in range(7 * part, len(ids), 7 * n_parts)]
                    for file, ids in files.items()}
            assert largest == {file: max(chunks) for file, chunks in mine.items() if chunks}


def test_a_text_file_has_the_byte_vocabulary_whatever_is_given(text_file):
    path, _ = text_file
    assert vocab_size_of(str(path), 1000) == load_data(str(path), vocab_size=1000).vocab_size == 256


def test_the_synthetic_language_needs_a_vocab_size():
    assert vocab_size_of(None, 64) == 64
    with pytest.raises(ValueError):
        vocab_size_of(None)
    with pytest.raises(ValueError):
        load_data(None)


def test_split_too_short_for_the_window_raises(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(bytes(range(40)))  # val holds the last 4 bytes
    tf = TokenFile(str(path))
    assert tf.batch("train", 0, 2, 8).shape == (2, 9)
    with pytest.raises(ValueError):
        tf.batch("val", 0, 2, 8)


def test_load_data_default_is_the_markov_language():
    lang = load_data(None, vocab_size=64, seed=3)
    assert isinstance(lang, MarkovLanguage)
    assert lang.vocab_size == 64 and lang.seed == 3


def test_load_data_missing_path_raises_with_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "data.txt"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_data(str(missing))
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        vocab_size_of(str(missing))


def test_load_data_on_a_file_is_a_token_file(text_file):
    path, _ = text_file
    assert isinstance(load_data(str(path)), TokenFile)


def test_a_split_exactly_one_window_long_is_used_whole(tmp_path):
    for split in ("train", "val"):
        np.arange(10, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    tf = TokenFile(str(tmp_path))
    assert tf.batch("train", 0, 2, 9).tolist() == [list(range(10))] * 2
    # Every start, including the last one, is drawn: the final token is reachable.
    assert max(int(tf.batch("train", s, 4, 4)[:, -1].max()) for s in range(200)) == 9


# 6. DataInfo: what the configuration knows of the data, its meta.json read once -------------------

def count_opens(monkeypatch, name):
    """From now on, every open() of a file called `name` is listed in the list returned."""
    opens, real_open = [], builtins.open

    def counting_open(file, *args, **kwargs):
        opens.extend([file] if str(file).endswith(name) else [])
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", counting_open)
    return opens


def test_data_info_reads_meta_json_once_and_the_data_opened_from_it_reads_it_no_more(tmp_path, monkeypatch):
    tokens = np.arange(100, dtype=np.uint32) * 1000  # ids past uint16's: read as uint16 they would be other ids
    for split in ("train", "val"):
        tokens.tofile(tmp_path / f"{split}.bin")
    (tmp_path / "meta.json").write_text(json.dumps(dict(dtype="uint32", vocab_size=100_000, eos_id=7,
                                                        tokenizer="/a/folder", tokenizer_sha256="ab12")))
    opens = count_opens(monkeypatch, "meta.json")
    info = DataInfo.read(str(tmp_path), vocab_size=1000)  # meta.json's vocabulary wins over the one given
    assert info == DataInfo(str(tmp_path), 100_000, np.dtype(np.uint32), 7, ("/a/folder", "ab12"))
    assert info.split_lengths() == {"train": 100, "val": 100}
    data = open_data(info, seed=3)
    assert data.info is info and data.vocab_size == 100_000 and data.seed == 3
    np.testing.assert_array_equal(data.tokens["val"], tokens)
    assert len(opens) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.vocab_size = 1


def test_data_info_of_a_text_file_a_nanogpt_directory_and_the_synthetic_language(tmp_path, text_file):
    path, _ = text_file
    assert DataInfo.read(str(path), 1000) == DataInfo(str(path), 256, np.dtype(np.uint8))  # bytes, no documents
    assert DataInfo.read(str(path)).split_lengths() == {"train": 900, "val": 100}
    (tmp_path / "nanogpt").mkdir()
    nanogpt = write_token_dir(tmp_path / "nanogpt", np.arange(40), np.arange(30), meta_vocab_size=65)
    assert DataInfo.read(nanogpt, 1000) == DataInfo(nanogpt, 65, np.dtype(np.uint16))
    assert DataInfo.read(nanogpt).split_lengths() == {"train": 40, "val": 30}
    synthetic = open_data(DataInfo.read(None, 64), seed=3)
    assert isinstance(synthetic, MarkovLanguage) and synthetic.vocab_size == 64 and synthetic.seed == 3
    assert synthetic.info == DataInfo(None, 64)  # no files, no EOS id
