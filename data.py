"""Training data: a synthetic language with a known loss floor, or real tokens.

Every batch is a pure function of (seed, split, step): any rank, in any
configuration, restarted or not, reads exactly the same global batch for a
given step and takes its own slice of it. That is what lets every parallel
configuration be compared token for token with the single device.

- `MarkovLanguage`: the default, nothing to download. A sparse random Markov
  chain over the vocabulary; its entropy rate H = sum_s pi(s) H(P(.|s)) is
  computed exactly, and it is the lowest mean cross-entropy any model can
  reach on it (the "floor" drawn under every loss curve).
- `TokenFile`: real tokens, from a text file (bytes are tokens, vocabulary
  256, the last tenth held out) or from a nanoGPT-style directory holding
  `train.bin` and `val.bin` (uint16 token ids).
"""
import os

import numpy as np
import torch

SPLITS = {"train": 0, "val": 1}


def batch_rng(seed, split, step):
    """The random stream of one batch: a pure function of (seed, split, step)."""
    return np.random.default_rng([seed, SPLITS[split], step])


class MarkovLanguage:
    """Each token is followed by one of `branching` successors, with fixed probabilities."""

    def __init__(self, vocab_size=256, branching=4, seed=0):
        if not 2 <= branching <= vocab_size:
            raise ValueError(f"branching={branching} must be between 2 and vocab_size={vocab_size}")
        rng = np.random.default_rng([seed, 12345])
        self.vocab_size = vocab_size
        self.seed = seed
        successors = np.stack([rng.choice(vocab_size, branching, replace=False) for _ in range(vocab_size)])
        # Every token can be followed by the next one in the vocabulary: the
        # chain is then irreducible, so its stationary distribution is unique.
        has_next = (successors == (np.arange(vocab_size)[:, None] + 1) % vocab_size).any(1)
        successors[~has_next, 0] = (np.arange(vocab_size)[~has_next] + 1) % vocab_size
        self.successors = successors
        self.probs = rng.dirichlet(np.ones(branching), size=vocab_size)
        self.cumulative = np.cumsum(self.probs, axis=1)
        self.stationary = self._stationary_distribution()
        self.entropy_rate = float(-(self.stationary[:, None] * self.probs * np.log(self.probs)).sum())

    def transition_matrix(self):
        P = np.zeros((self.vocab_size, self.vocab_size))
        np.add.at(P, (np.arange(self.vocab_size)[:, None], self.successors), self.probs)
        return P

    def _stationary_distribution(self):
        """pi with pi P = pi and sum(pi) = 1, solved as one linear system."""
        A = self.transition_matrix().T - np.eye(self.vocab_size)
        A[-1] = 1.0  # replace one (redundant) balance equation by the normalisation
        b = np.zeros(self.vocab_size)
        b[-1] = 1.0
        return np.linalg.solve(A, b)

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


class TokenFile:
    """Random windows of a token stream; a window never crosses into the other split."""

    entropy_rate = None  # unknown for real data

    def __init__(self, path, seed=0):
        self.seed = seed
        if os.path.isdir(path):
            self.tokens = {split: np.memmap(os.path.join(path, f"{split}.bin"), dtype=np.uint16, mode="r")
                           for split in SPLITS}
            self.vocab_size = int(max(t.max() for t in self.tokens.values())) + 1
        else:
            data = np.fromfile(path, dtype=np.uint8)
            cut = int(len(data) * 0.9)
            self.tokens = {"train": data[:cut], "val": data[cut:]}
            self.vocab_size = 256

    def batch(self, split, step, n_seqs, length):
        tokens = self.tokens[split]
        if len(tokens) < length + 1:
            raise ValueError(f"the {split} split has {len(tokens)} tokens, too few for windows of {length + 1}")
        starts = batch_rng(self.seed, split, step).integers(0, len(tokens) - length, n_seqs)  # last start included
        return torch.from_numpy(np.stack([tokens[s:s + length + 1].astype(np.int64) for s in starts]))


def load_data(path=None, vocab_size=256, seed=0):
    """The synthetic language when path is None, else the text file or token directory at path."""
    if path is None:
        return MarkovLanguage(vocab_size, seed=seed)
    if not os.path.exists(path):
        raise FileNotFoundError(f"--data {path}: no such file or directory")
    return TokenFile(path, seed=seed)
