"""Text to token ids and back, with the tokenizer of a Hugging Face model folder.

    tokenizer = Tokenizer.from_folder("Llama-3.2-1B")
    ids = tokenizer.encode("Hello")    # [128000, 9906]: Llama 3 starts every text with its BOS
    tokenizer.decode(ids)              # "Hello"

The `tokenizers` library reads the folder's tokenizer.json and does the work, whatever its kind: byte-level
BPE (GPT-2, Llama 3, Qwen2: every byte has a token, so any text round-trips) or SentencePiece's (Llama 2,
Mistral: "▁" marks a space, and a byte fallback spells out what the vocabulary lacks). What it leaves to
the folder's other files is read here:

- the end of a document, EOS: generation_config.json's eos_token_id, else config.json's, else
  tokenizer_config.json's eos_token (a string) looked up in the vocabulary. Where a document ends is the
  caller's to mark (tools/prepare.py puts an EOS after each): encode never adds one.
- the start, BOS: found the same way (bos_token_id, bos_token). encode puts it first when the model
  expects it: as tokenizer_config.json's add_bos_token says (Llama 2, Mistral), else as tokenizer.json's
  own post-processor does (Llama 3's adds <|begin_of_text|>; GPT-2's and Qwen2's add nothing). The
  post-processor itself is never run, so nothing else is added behind the caller's back.
- special tokens written in the text are text: a document that quotes "<|endoftext|>" is encoded as those
  characters, not as an EOS that would cut it in two. decode skips the special tokens (BOS, EOS,
  padding: those tokenizer.json marks special), so decode(encode(text)) == text for a lossless tokenizer
  (byte-level, or byte fallback; a normalizer such as NFKC, or an unknown token, loses what it changes).
"""
import hashlib
import os

from tokenizers import Tokenizer as Backend

from training.data import tokenizer_of
from training.integrity import hub_problem, json_object

class TokenizerError(ValueError):
    """A folder whose tokenizer cannot be read or used; the message names the folder or file."""


def read_json(folder, name):
    """The folder's JSON file `name`, or {} when it has none (every config file is optional)."""
    path = os.path.join(folder, name)
    return json_object(path, TokenizerError) if os.path.isfile(path) else {}


def fingerprint(folder):
    """SHA-256 of the folder's tokenizer.json, or None when it has none: the same bytes encode the same way,
    so two folders with the same fingerprint make the same ids."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def special_id(kind, backend, id_configs, tokenizer_config):
    """The id of the `kind` ("bos" or "eos") token: the first of id_configs that names `kind`_token_id,
    else tokenizer_config's `kind`_token looked up in the vocabulary; None when no file names one."""
    for config in id_configs:
        value = config.get(f"{kind}_token_id")
        if isinstance(value, list):
            # Llama 3.1's and Qwen2's chat models list every id that ends a generation; any of them stops
            # one, so any serves as the end of a document. The first is the authors' first choice (the one
            # config.json names where it names a single id), and always the same one.
            value = value[0] if value else None
        if value is not None:
            if type(value) is not int or value < 0:
                raise TokenizerError(f"{kind}_token_id {str(value)[:40]!r} is not an id")
            return value
    token = tokenizer_config.get(f"{kind}_token")
    if isinstance(token, dict):  # older files write the AddedToken out: {"content": "<s>", ...}
        token = token.get("content")
    if token is None:
        return None
    if not isinstance(token, str):
        raise TokenizerError(f"tokenizer_config.json's {kind}_token {str(token)[:40]!r} is not a token's text")
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise TokenizerError(f"tokenizer_config.json's {kind}_token {token!r} is not in the vocabulary")
    return token_id


class Tokenizer:
    """A model folder's tokenizer: encode, decode, and the ids and size the data and the model must agree on.

    vocab_size counts every id it can produce, the tokens added on top of the model's vocabulary (special
    ones included) too; a model may have more rows than that (padding), never fewer. source is the
    folder's absolute path, fingerprint its tokenizer.json's SHA-256.
    """

    def __init__(self, backend, source, bos_id=None, eos_id=None, add_bos=False, fingerprint=None):
        if add_bos and bos_id is None:
            raise TokenizerError(f"{source}: the model starts every text with a BOS token, but no file names it "
                                 f"(bos_token_id in generation_config.json or config.json, or "
                                 f"tokenizer_config.json's bos_token)")
        self.backend = backend
        self.backend.encode_special_tokens = True  # "<|endoftext|>" in a document is text (see the docstring)
        self.source = source
        self.fingerprint = fingerprint
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        for name, token_id in (("bos", bos_id), ("eos", eos_id)):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise TokenizerError(f"{source}: the {name} id {token_id} is outside the tokenizer's "
                                     f"{self.vocab_size} ids")
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos

    @classmethod
    def from_folder(cls, folder):
        """The tokenizer of the Hugging Face model folder `folder` (its tokenizer.json, and the ids of BOS
        and EOS from its other files: see the module's docstring). A TokenizerError says what is missing."""
        source = os.path.abspath(folder)
        if not os.path.isdir(source):
            raise TokenizerError(f"{folder}: no such folder")
        path = os.path.join(source, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"{folder}: no tokenizer.json in the folder (a Hugging Face tokenizer; a "
                                 f"tokenizer.model alone is SentencePiece's own format, which transformers' "
                                 f"save_pretrained converts to tokenizer.json)")
        # a download into huggingface_hub's cache: the files read here against their blobs' names (not a model
        # folder's weights, which train.py's check_folder hashes when it reads them)
        problem = hub_problem(source, names=TOKENIZER_FILES + ("config.json",))
        if problem:
            raise TokenizerError(problem)
        try:
            backend = Backend.from_file(path)
        except Exception as e:  # the library's errors are plain Exceptions, saying what it could not parse
            raise TokenizerError(f"{path}: not a tokenizer the tokenizers library reads ({e})") from None
        id_configs = [read_json(source, "generation_config.json"), read_json(source, "config.json")]
        tokenizer_config = read_json(source, "tokenizer_config.json")
        try:
            bos_id = special_id("bos", backend, id_configs, tokenizer_config)
            eos_id = special_id("eos", backend, id_configs, tokenizer_config)
        except TokenizerError as e:
            raise TokenizerError(f"{folder}: {e}") from None
        add_bos = tokenizer_config.get("add_bos_token")
        if add_bos is None:  # tokenizer.json's post-processor decides: what does it put around no text at all?
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(backend, source, bos_id, eos_id, bool(add_bos), fingerprint(source))

    def encode(self, text):
        """The ids of text: BOS first if the model expects it, never EOS, special tokens' names as text."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if self.add_bos else ids

    def encode_rendered(self, text):
        """(ids, [(first, end) character offsets of each]) of a chat template's text: special tokens' names
        are those tokens, and nothing is added (the template writes its own BOS where the model has one)."""
        self.backend.encode_special_tokens = False
        try:
            encoding = self.backend.encode(text, add_special_tokens=False)
        finally:
            self.backend.encode_special_tokens = True
        return encoding.ids, encoding.offsets

    def decode(self, ids):
        """The text of ids (any sequence of ints, a numpy array too), special tokens skipped."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)


# The files of a model folder that describe its tokenizer: what a Hugging Face export carries along.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")  # transformers 4.50 on writes the chat template in a file of its own


def folder_of_run(run_args):
    """The folder of the tokenizer a run trained with, from its flags (a checkpoint's manifest keeps them): the
    one that made its --data (its meta.json names it), else its --init-from folder's, if that has one; None for
    the synthetic language, bytes, and nanoGPT's ids, whose tokenizer nothing records."""
    made_by = tokenizer_of(run_args.get("data"))
    if made_by:
        return made_by[0]
    init_from = run_args.get("init_from")
    return init_from if init_from and fingerprint(init_from) else None
