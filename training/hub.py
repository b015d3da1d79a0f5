"""A Hugging Face hub id where a model folder is expected: train.py's --init-from, tools/prepare.py's
--tokenizer, tools/sample.py's --init-from and --tokenizer.

A hub id names a repository on huggingface.co: `owner/name` (openai/gpt-oss-20b), optionally with a
revision, `owner/name@revision` (a branch, a tag or a commit). A string is read as one only where it is not
an existing path: a folder (even one named like owner/name) is used as it is, and a string that is neither
a path nor of that form keeps the error the caller gives a missing folder.

A hub id is resolved by huggingface_hub (`pip install huggingface_hub`; optional: without it a hub id is
refused in one line saying so) into the folder of its snapshot in huggingface_hub's cache
(HF_HUB_CACHE, by default ~/.cache/huggingface/hub), downloading what is not there yet, or with
HF_HUB_OFFLINE=1 finding it there without a connection. Only the top-level files the caller reads come:
for a model its config.json, its safetensors files and their index, its tokenizer's files and chat
template and its generation_config.json; for a tokenizer all of these but the weights (not gpt-oss's
original/ nor any other subfolder). The files are links into the cache's blobs, named by their contents'
hashes, which training/integrity.py checks them against.
"""
import os
import re

from training.tokenizer import TOKENIZER_FILES

# What each caller reads from the folder: huggingface_hub's allow_patterns (fnmatch's; "*" matches "/" too,
# hence SUBFOLDERS among the ignored).
FILES = {"tokenizer": ["config.json", *TOKENIZER_FILES],
         "model": ["config.json", "*.safetensors", "model.safetensors.index.json", *TOKENIZER_FILES]}
SUBFOLDERS = "*/*"
# owner/name[@revision], as the hub spells them: letters, digits, "-", "_" and "." (neither "--" nor ".."),
# each part starting with a letter or digit, at most 96 characters.
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[\w./-]+))?")


class HubError(Exception):
    """A hub id that cannot be resolved: one line saying why."""


def hub_id(name):
    """(repository, revision or None) where `name` reads as a hub id (not an existing path), else None."""
    match = HUB_ID.fullmatch(name or "")
    if not match or os.path.exists(name) or "--" in match["repo"] or ".." in match["repo"]:
        return None
    return match["repo"], match["revision"]


def resolve(name, what="model", error=HubError):
    """The local folder `name` stands for: a hub id's snapshot in huggingface_hub's cache, its files of
    `what` ("model" or "tokenizer", FILES) downloaded where missing; anything else (an existing folder, None,
    a string that is no hub id) unchanged. A hub id that cannot be resolved: error(a line saying why),
    raised (or, for a callable that exits, such as argparse's parser.exit, called).

    Under torchrun every rank calls this, before any process group exists: huggingface_hub's file locks
    (a lock per file in the cache's .locks/) let one rank of those sharing a cache download each file while
    the others wait and then find it, and each file is written under a temporary name then renamed into
    place, so that concurrent calls are safe and download a model once per cache (once per node where each
    node has its own)."""
    parsed = hub_id(name)
    if parsed is None:
        return name
    repo, revision = parsed
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                           RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:
        raise error(f"{name}: no such folder, and a Hugging Face hub id needs huggingface_hub: "
                    f"pip install huggingface_hub") from None
    try:
        return snapshot_download(repo, revision=revision, allow_patterns=FILES[what], ignore_patterns=[SUBFOLDERS])
    except LocalEntryNotFoundError as e:  # (offline, or the hub out of reach: and not in the cache)
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else
               f"the hub cannot be reached ({first_line(e)})")
        wholly = " wholly" if type(e).__name__ == "IncompleteSnapshotError" else ""  # (some files cached, not all)
        problem = f"not{wholly} in huggingface_hub's cache ({constants.HF_HUB_CACHE}), and {why}"
    except GatedRepoError:
        problem = "a gated model: accept its terms on huggingface.co, then log in (HF_TOKEN, or hf auth login)"
    except RepositoryNotFoundError:
        problem = "no such folder, nor a model on the Hugging Face hub (a private one needs a login: HF_TOKEN)"
    except RevisionNotFoundError:
        problem = f"no revision {revision} on the Hugging Face hub"
    except HfHubHTTPError as e:
        problem = f"the Hugging Face hub answered {first_line(e)}"
    raise error(f"{name}: {problem}") from None


def first_line(e):
    """huggingface_hub's errors run over several lines: the first (or the error's kind, where it has none)."""
    return (str(e).splitlines() or [type(e).__name__])[0]
