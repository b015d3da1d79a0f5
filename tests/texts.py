"""What the text tests share: documents, a tokenizer trained on them, the commands run as a user types them,
and model.py's greedy decoding written out.

The tokenizer is a byte-level BPE in GPT-2's layout, trained here by the tokenizers library's own trainer
(nothing is downloaded), saved as a Hugging Face folder's tokenizer.json with its EOS in
generation_config.json.
"""
import json
import random
import subprocess
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from model import GPT

REPO = Path(__file__).resolve().parent.parent
EOT = "<|endoftext|>"


def documents(n=40, seed=0):
    """n documents of 50 words, drawn from 60 made-up words and the few of the tests' prompt."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 6))) for _ in range(60)]
    return [" ".join(rng.choice(vocabulary + ["the", "cat", "sat", "on"]) for _ in range(50)) for _ in range(n)]


def write_documents(folder, texts):
    """texts as a folder of .txt files, a document each, named in their order."""
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"{i:03d}.txt").write_text(text)
    return folder


def tokenizer_folder(path, vocab_size=300):
    """GPT-2's layout (byte-level BPE, <|endoftext|> its BOS and EOS) as a Hugging Face folder's files."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(documents(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    eot = backend.token_to_id(EOT)
    (path / "generation_config.json").write_text(json.dumps(dict(bos_token_id=eot, eos_token_id=eot)))
    return str(path)


def run(module, *args, timeout=300):
    """`python -m module args...` from the repository's folder, as docs/own-text.md types it."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def greedy(config, state, ids, max_new_tokens, eos_id):
    """The argmax at every step, the context cropped to the positions the model has, up to EOS (left out)."""
    model = GPT(config)
    model.load_state_dict(state)
    idx, new = torch.tensor([ids]), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = model(idx[:, -config.max_seq_len:])[0][0, -1, :config.vocab_size].argmax().item()
            if token == eos_id:
                break
            new.append(token)
            idx = torch.cat([idx, torch.tensor([[token]])], dim=1)
    return new
