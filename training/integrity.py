"""What tells a damaged file from an intact one, where a file has something to be checked against.

- A file this project writes to describe others (a checkpoint's manifest.json, a token folder's meta.json)
  carries the SHA-256 of its own contents (`json_digest`): a byte changed since it was written either
  breaks the JSON or changes the contents, and the digest no longer matches.
- A large file it writes (a token folder's train.bin, val.bin and their masks) has the SHA-256 of each of
  its chunks recorded beside it (`chunk_digests`), so that the ranks check it a share of the chunks each,
  in the scan that reads every token once anyway (training/data.py's TokenFile.scan).
- A file huggingface_hub downloaded is a link into its cache's blobs/ folder, where each blob is named by
  its contents' hash: the SHA-256 for the files kept in Git LFS (the weights), git's SHA-1 of the blob for
  the others (config.json, tokenizer.json). `hub_blob_problem` hashes the file and compares.
- A folder copied by hand has nothing of the kind: its safetensors files are still checked against their
  own headers (training/tensorfile.py), which finds a file cut short, but a byte changed inside a tensor's
  data reads as the value it now holds.
"""
import hashlib
import json
import os
import re

CHUNK_BYTES = 64 * 2**20  # a multiple of every token and mask type's size: a chunk holds whole tokens
READ_BYTES = 2**20  # read at a time while hashing


def json_object(path, damaged=ValueError):
    """The JSON object in the file at path, or damaged(a line naming the file) where it holds none."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise damaged(f"{path}: damaged, not JSON ({str(e)[:120]})") from None
    if not isinstance(value, dict):
        raise damaged(f"{path}: damaged, a JSON {type(value).__name__}, not an object")
    return value


def json_digest(contents, field="sha256"):
    """SHA-256 of a JSON object's contents, its keys sorted and its own `field` left out."""
    kept = {key: value for key, value in contents.items() if key != field}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def json_digest_matches(contents, field="sha256"):
    """Whether a JSON object's recorded digest is its contents' (one written before digests were: yes)."""
    return contents.get(field, None) in (None, json_digest(contents, field))


def chunk_digests(path, chunk_bytes=CHUNK_BYTES):
    """{bytes, chunk_bytes, sha256: [one a chunk]} of the file at path, as meta.json records it."""
    size, digests = os.path.getsize(path), []
    with open(path, "rb") as f:
        for start in range(0, size, chunk_bytes):  # read a piece at a time: the memory of a piece, not a chunk
            digest = hashlib.sha256()
            end = min(start + chunk_bytes, size)
            for at in range(start, end, READ_BYTES):
                digest.update(f.read(min(READ_BYTES, end - at)))
            digests.append(digest.hexdigest())
    return dict(bytes=size, chunk_bytes=chunk_bytes, sha256=digests)


def recorded_chunks_problem(record):
    """What is wrong with a chunk_digests record read back (None: nothing)."""
    if not isinstance(record, dict) or type(record.get("bytes")) is not int or type(record.get("chunk_bytes")) is not int:
        return "is not {bytes, chunk_bytes, sha256}"
    if record["chunk_bytes"] < 1 or record["chunk_bytes"] % 8 or record["bytes"] < 0:
        return f"has chunks of {record['chunk_bytes']} bytes, not a positive multiple of 8"
    digests = record.get("sha256")
    if not isinstance(digests, list) or len(digests) != -(-record["bytes"] // record["chunk_bytes"]) \
            or not all(isinstance(d, str) for d in digests):
        return "does not list one SHA-256 a chunk"
    return None


# huggingface_hub's cache: snapshots/<revision>/<file> -> ../../blobs/<the hash of its contents>
SHA256_NAME, GIT_SHA1_NAME = re.compile(r"[0-9a-f]{64}"), re.compile(r"[0-9a-f]{40}")


def hub_blob(path):
    """(algorithm, expected hex digest) of a file that is a link to huggingface_hub's cache blob, else None."""
    if not os.path.islink(path):
        return None
    target = os.readlink(path)
    name, folder = os.path.basename(target), os.path.basename(os.path.dirname(target))
    if folder != "blobs":
        return None
    if SHA256_NAME.fullmatch(name):
        return "sha256", name
    if GIT_SHA1_NAME.fullmatch(name):
        return "git-sha1", name
    return None


def hub_blob_problem(path):
    """What is wrong with a file linked into huggingface_hub's cache (None: its contents are its blob's name,
    or it is not such a link)."""
    blob = hub_blob(path)
    if blob is None:
        return None
    algorithm, expected = blob
    if algorithm == "sha256":
        digest = hashlib.sha256()
    else:  # git names a blob by the SHA-1 of "blob <size>\0" and its bytes
        digest = hashlib.sha1(f"blob {os.path.getsize(path)}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as f:
        while piece := f.read(READ_BYTES):
            digest.update(piece)
    if digest.hexdigest() != expected:
        return (f"{path}: damaged, its bytes do not match the {algorithm.upper()} its download was named by "
                f"({expected[:12]}...): download it again")
    return None


def hub_problem(folder, share=(0, 1), names=None):
    """The first problem of the folder's files linked into huggingface_hub's cache (of `names` alone, where
    given), of share (i, n): the i-th of every n such files, in name order (n ranks hash a folder once between
    them); None where none."""
    linked = [name for name in sorted(os.listdir(folder))
              if (names is None or name in names) and hub_blob(os.path.join(folder, name))]
    index, count = share
    return next((p for name in linked[index::count] if (p := hub_blob_problem(os.path.join(folder, name)))), None)
