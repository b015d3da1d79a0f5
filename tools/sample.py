"""Text from a trained model: a prompt's continuations, from a checkpoint or a Hugging Face model folder.

    python -m tools.sample --checkpoint runs/x --prompt "Once upon a time" --max-new-tokens 100
    python -m tools.sample --checkpoint runs/x/checkpoint-00000300 --prompt "The" --temperature 0
    python -m tools.sample --init-from llama-continued --prompt "Hello" --top-k 50 --device cuda
    python -m tools.sample --checkpoint runs/chats --chat --system "Be brief." --prompt "What is a GPU?"

One process, no process group: the model is built on the meta device, allocated on the chosen device (the
CPU or one GPU) and filled a chunk of a tensor at a time, so the CPU never holds more than a chunk of what
belongs on the GPU. A checkpoint of any layout (tp, pp, ep, cp, ZeRO) gives model.py's full tensors
(training/checkpoint.py reads any elements of them); a run folder gives its newest complete, undamaged
checkpoint; a Hugging Face folder is read through training/hf.py's name tables. The weights keep the dtype
they were saved in (--dtype changes it).

The tokenizer is --tokenizer's folder, else the one the model records: a Hugging Face folder's own, or for
a checkpoint the one that prepared its --data (the token directory's meta.json), else its --init-from
folder's. A run trained on a text file (bytes are tokens) is read and written as UTF-8 bytes; one trained
on the synthetic language has no text, and nothing records a nanoGPT directory's tokenizer: those need
--tokenizer.

Generation is model.py's GPT.generate: greedy with --temperature 0, else sampled at that temperature among
the --top-k most likely tokens, stopping at the tokenizer's EOS, from a generator seeded by --seed on the
model's device, so that the same command prints the same text. Only the continuation is printed (special
tokens left out), each of --samples continuations followed by a line "---" when there are several. It keeps
a key/value cache: the prompt runs through the model once, then each new token alone, so n new tokens cost
O(n) token-passes. The context is the last max_seq_len tokens: once prompt and continuation outgrow them, the
window slides, every position changes and the cache no longer holds, so each further token runs the whole
window again (the text is the same as without a cache).

With --chat the prompt is a user's message (after --system's, if given), rendered by the tokenizer folder's
chat template with its generation prompt (training/chat.py, in Jinja2's sandbox), and the reply stops at the
end of the assistant's turn (the template's end-of-turn token: <|im_end|>, <|eot_id|>, ...).
"""
import argparse
import os
import sys
from functools import partial

import torch

from model import GPT, GPTConfig, fill_in_chunks, tied_name
from training import hf, hub
from training.chat import ChatError, ChatTemplate
from training.checkpoint import TORCH_DTYPES, BadCheckpoint, Checkpoint, checkpoint_at
from training.data import tokenizer_of
from training.hf import UnsupportedModel
from training.tensorfile import DamagedFile
from training.tokenizer import Tokenizer, TokenizerError, fingerprint, folder_of_run

PROG = "python -m tools.sample"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


class SampleError(ValueError):
    """Bad input or flags: printed as one line, and the command exits with status 1."""


def note(message):
    """What the command found (which checkpoint, a cropped context): on stderr, so stdout is the text alone."""
    print(message, file=sys.stderr)


# ---------------------------------------------------------------------------
# The model: on the meta device, then allocated where it runs and filled a chunk at a time
# ---------------------------------------------------------------------------

def allocate(config, dtype, device):
    """model.py's GPT of config, its memory on device in dtype, every value still to fill (buffers zero)."""
    with torch.device("meta"):
        model = GPT(config)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()  # to_empty makes the parameter held twice (a tied output layer) into two
    for buffer in model.buffers():
        buffer.zero_()
    return model.eval()


@torch.no_grad()
def fill(model, names, values_at):
    """The model's tensors `names` (of its state dict) from values_at(name, flat positions), a chunk of a
    tensor at a time: read on the CPU in the chunk's size, then copied to the model's device and dtype."""
    tensors = model.state_dict(keep_vars=True)
    for name in names:
        fill_in_chunks(tensors[name].detach().view(-1), partial(values_at, name), torch.arange)


def from_checkpoint(path, given):
    """(config, tokenizer, load(dtype, device) -> model) of a checkpoint or run folder (its newest good one) and
    `given` (--tokenizer): the tokenizer is found, and checked, before any weight is read."""
    saved = Checkpoint(checkpoint_at(path, report=note))
    if not saved.manifest.get("model"):
        raise SampleError(f"{saved.path} does not record its model's config (saved by an older version, or "
                          f"imported from a file): resume the run from it and save again")
    config = GPTConfig(**saved.manifest["model"])
    tokenizer = tokenizer_of_run(saved.manifest["args"], config.vocab_size, given)
    return config, tokenizer, partial(load_checkpoint, saved, config)


def load_checkpoint(saved, config, dtype, device):
    """The model of a Checkpoint (any layout), in dtype (default: as saved)."""
    model = allocate(config, dtype or TORCH_DTYPES[saved.tensors["tok_emb.weight"]["dtype"]], device)
    names = [name for name in model.state_dict() if tied_name(name, config) == name]  # a tied layer once
    missing = [name for name in names if name not in saved.tensors]
    if missing:
        raise BadCheckpoint(f"{saved.path}: no tensor {', '.join(missing)} of the model its manifest describes")
    fill(model, names, lambda name, positions: saved.read(name, "model", positions))
    return loaded(model, f"{saved.path} (step {saved.step})")


def from_hugging_face(folder, given):
    """(config, tokenizer, load(dtype, device) -> model) of a Hugging Face folder and `given` (--tokenizer)."""
    hf_config = hf.read_config(folder)
    positions = hf_config.get("n_positions") or hf_config.get("max_position_embeddings")
    config = hf.config_from_hf(hf_config, positions)  # as long a context as the model has positions for
    stored = DTYPES.get(hf_config.get("torch_dtype") or hf_config.get("dtype"), torch.float32)
    if not given and not fingerprint(folder):
        raise SampleError(f"{folder} holds no tokenizer.json: pass --tokenizer FOLDER")
    return config, Tokenizer.from_folder(given or folder), partial(load_hugging_face, folder, config, stored)


def load_hugging_face(folder, config, stored, dtype, device):
    """The model of a Hugging Face folder, in dtype (default: `stored`, its config's)."""
    model = allocate(config, dtype or stored, device)
    values = hf.HuggingFaceValues(folder, config)
    values.check_shapes()
    # the weights, and the buffers the folder holds (DeepSeek-V3's routing biases; the others' stay zero)
    names = [name for name, _ in model.named_parameters()] + hf.saved_buffers(model, values.model_type)
    fill(model, names, values.parameter)
    return loaded(model, folder)


def loaded(model, what):
    """model, once stderr says what it is and where it runs."""
    weight = next(model.parameters())
    note(f"{PROG}: {what}, {sum(p.numel() for p in model.parameters()):,} parameters in {weight.dtype} on "
         f"{weight.device}")
    return model


# ---------------------------------------------------------------------------
# The tokenizer: the one given, or the one the model records
# ---------------------------------------------------------------------------

class Bytes:
    """The tokens of a run trained on a text file (--data FILE.txt): its bytes (training/data.py's TokenFile)."""
    vocab_size, eos_id = 256, None

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")  # a character may be cut short


def tokenizer_of_run(run_args, vocab_size, given):
    """The tokenizer of a checkpoint's run (its flags run_args), or `given` (a folder, --tokenizer); refuses one
    that did not make the run's data (another tokenizer.json: its ids are other tokens)."""
    data, init_from = run_args.get("data"), run_args.get("init_from")
    made_by = tokenizer_of(data)  # (folder, SHA-256) from a prepared directory's meta.json, else None
    recorded = folder_of_run(run_args)
    if given:
        tokenizer = Tokenizer.from_folder(given)
    elif recorded:
        what = f"the tokenizer that prepared its --data {data}" if made_by else "its --init-from folder"
        tokenizer = from_recorded_folder(recorded, what)
    elif data and not os.path.isdir(data) and vocab_size == 256:
        return Bytes()
    else:
        raise SampleError(f"{unrecorded(data, init_from)}: pass --tokenizer FOLDER, a Hugging Face folder whose "
                          f"tokenizer.json reads and writes the model's ids")
    if made_by and made_by[1] and tokenizer.fingerprint != made_by[1]:
        raise SampleError(f"{tokenizer.source}'s tokenizer.json is not the one that prepared the run's --data "
                          f"{data} (SHA-256 {made_by[1][:12]}..., not {str(tokenizer.fingerprint)[:12]}...): its "
                          f"ids mean other tokens")
    return tokenizer


def unrecorded(data, init_from):
    """Why a run records no tokenizer."""
    if data:
        return f"the run trained on --data {data}, which records no tokenizer (nanoGPT's ids, or the folder moved)"
    if init_from:
        return f"the run started from --init-from {init_from}, which holds no tokenizer.json"
    return "the run trained on the synthetic language, whose ids are no text's: it has no tokenizer"


def from_recorded_folder(folder, what):
    try:
        return Tokenizer.from_folder(folder)
    except TokenizerError as e:
        raise SampleError(f"{what}, {folder}, cannot be read ({e}): pass --tokenizer FOLDER") from None


class PlainPrompt:
    """A prompt continued as it is written: its ids, and generation stops at the tokenizer's EOS."""

    def __init__(self, tokenizer):
        self.tokenizer, self.stop_id = tokenizer, tokenizer.eos_id

    def ids(self, prompt):
        return self.tokenizer.encode(prompt)


class ChatPrompt:
    """--chat: the prompt as a user's turn (after --system's, if given), rendered by the tokenizer folder's
    chat template with its generation prompt; the reply stops at the end of the assistant's turn."""

    def __init__(self, tokenizer, system=None):
        if not isinstance(tokenizer, Tokenizer):
            raise SampleError("--chat needs a tokenizer folder with a chat template: the run's tokens are bytes")
        try:
            self.template = ChatTemplate.from_folder(tokenizer.source, tokenizer)
        except ChatError as e:
            raise SampleError(f"--chat: {e}") from None
        self.tokenizer, self.system = tokenizer, system
        self.stop_id = self.template.end_of_turn_id() or tokenizer.eos_id

    def ids(self, prompt):
        system = [{"role": "system", "content": self.system}] if self.system else []
        try:
            return self.template.prompt_ids([*system, {"role": "user", "content": prompt}])
        except ChatError as e:
            raise SampleError(f"--chat: {e}") from None


def prompt_ids(prompter, config, prompt):
    """The prompt's ids, once the tokenizer is known to fit the model's vocabulary."""
    tokenizer = prompter.tokenizer
    if tokenizer.vocab_size > config.vocab_size:
        raise SampleError(f"the tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary {config.vocab_size}: "
                          f"they are not the same vocabulary (pass the --tokenizer the model was trained with)")
    ids = prompter.ids(prompt)
    if not ids:
        raise SampleError(f"the prompt {prompt!r} has no tokens: give some text (the tokenizer adds no BOS to "
                          f"start from)")
    return ids


# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------

def continuations(model, ids, eos_id=None, samples=1, max_new_tokens=100, temperature=1.0, top_k=None, seed=0):
    """[the ids of each of `samples` continuations of the prompt's ids], each up to its first eos_id (left out)
    or max_new_tokens."""
    if len(ids) + max_new_tokens > model.config.max_seq_len:
        note(f"{PROG}: the model attends to {model.config.max_seq_len} tokens: past them, each new token sees "
             f"the last {model.config.max_seq_len} alone (the prompt has {len(ids)})")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    prompts = torch.tensor([ids] * samples, device=device)
    rows = model.generate(prompts, max_new_tokens, temperature, top_k, generator, eos_id)[:, len(ids):].tolist()
    return [row[:row.index(eos_id)] if eos_id in row else row for row in rows]


def device_of(name):
    if name == "cuda" and not torch.cuda.is_available():
        raise SampleError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    return torch.device(name)


def parser():
    p = argparse.ArgumentParser(prog=PROG, description="Continue a prompt with a trained model: a checkpoint (any "
                                "layout) or a Hugging Face model folder, on the CPU or one GPU.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="PATH",
                        help="a checkpoint folder (runs/NAME/checkpoint-STEP), or a run folder (runs/NAME) for its "
                             "newest complete one")
    source.add_argument("--init-from", metavar="FOLDER",
                        help="a Hugging Face model folder, or a hub id (owner/name: huggingface_hub downloads it)")
    p.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt as a user's turn with the tokenizer folder's chat template and print the "
                        "assistant's reply, up to the end of its turn")
    p.add_argument("--system", default=None, help="with --chat, a system message before the user's")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens generated at most (fewer at an EOS)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0: greedy (the argmax)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (default: all)")
    p.add_argument("--samples", type=int, default=1, help="continuations, sampled together (one batch)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    p.add_argument("--tokenizer", metavar="FOLDER", default=None,
                   help="a Hugging Face folder with tokenizer.json, or a hub id (default: the one the model records)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="the weights' dtype (default: as saved)")
    return p


def check_flags(p, args):
    if args.system is not None and not args.chat:
        p.error("--system is a chat's system message: it needs --chat")
    for flag, value, least in [("--max-new-tokens", args.max_new_tokens, 0), ("--samples", args.samples, 1),
                               ("--top-k", args.top_k, 1), ("--temperature", args.temperature, 0)]:
        if value is not None and value < least:
            p.error(f"{flag} {value}: must be at least {least}")


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    check_flags(p, args)
    try:
        device = device_of(args.device)
        # a hub id (openai/gpt-oss-20b) as its folder in huggingface_hub's cache (training/hub.py)
        args.init_from, args.tokenizer = (hub.resolve(args.init_from, "model", SampleError),
                                          hub.resolve(args.tokenizer, "tokenizer", SampleError))
        if args.checkpoint:
            config, tokenizer, load = from_checkpoint(args.checkpoint, args.tokenizer)
        else:
            config, tokenizer, load = from_hugging_face(args.init_from, args.tokenizer)
        prompter = ChatPrompt(tokenizer, args.system) if args.chat else PlainPrompt(tokenizer)
        ids = prompt_ids(prompter, config, args.prompt)  # before minutes go into reading the weights
        model = load(DTYPES.get(args.dtype), device)
        texts = [tokenizer.decode(new) for new in continuations(
            model, ids, prompter.stop_id, args.samples, args.max_new_tokens, args.temperature, args.top_k, args.seed)]
    except (SampleError, BadCheckpoint, UnsupportedModel, TokenizerError, DamagedFile) as e:
        sys.exit(f"{PROG}: error: {e}")
    print("\n---\n".join(texts))


if __name__ == "__main__":
    main()
