"""Training data: the Markov language's exact statistics, and batches as a pure
function of (seed, split, step), for the synthetic language and for token files.

Statistical checks derive their tolerances from the sample itself (standard
errors from counts or from independent sequences), never from hard-coded figures.
"""
import re

import numpy as np
import pytest
import torch
from numpy.lib.stride_tricks import sliding_window_view

from data import MarkovLanguage, TokenFile, load_data


@pytest.fixture(scope="module")
def small():
    """A small language: vocabulary 16, each token has 3 possible successors."""
    return MarkovLanguage(vocab_size=16, branching=3, seed=0)


@pytest.fixture(scope="module")
def small_sample(small):
    """4000 independent sequences of 65 tokens."""
    return small.batch("train", 0, 4000, 64).numpy()


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


def test_branching_out_of_range_raises():
    for branching in (1, 17):
        with pytest.raises(ValueError):
            MarkovLanguage(vocab_size=16, branching=branching)


# 2. The entropy rate -------------------------------------------------------------

def test_entropy_rate_equals_formula_from_transition_matrix(small):
    P, pi = small.transition_matrix(), small.stationary
    plogp = np.where(P > 0, P * np.log(np.where(P > 0, P, 1)), 0)
    expected = -(pi * plogp.sum(1)).sum()
    assert small.entropy_rate == pytest.approx(expected, rel=1e-12)
    assert 0 < small.entropy_rate < np.log(3)  # below the uniform-over-3-successors bound


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


def test_token_directory_of_uint16_bins(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 1000, 500).astype(np.uint16)
    val = rng.integers(0, 1000, 100).astype(np.uint16)
    val[17] = 1233  # the largest token lives in val
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    tf = TokenFile(str(tmp_path))
    assert tf.vocab_size == 1234
    assert_windows_are_slices(tf.batch("train", 0, 6, 32), train, 32)
    assert_windows_are_slices(tf.batch("val", 0, 6, 32), val, 32)


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
