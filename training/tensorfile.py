"""The safetensors format, written and read here a tensor (or a range of one) at a time, every file checked
against what its header claims before a byte of it is used.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
{entry: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data section,
whose bytes [begin, end) hold each entry. The safetensors library refuses a file whose header does not
describe its data exactly; this project reads the files itself (for the memory figures below), so it makes
the library's checks itself (`check_header`): the header's length within the file and within 100 MB (the
library's bound), valid JSON of that shape, every dtype known, every tensor's bytes its shape times its
dtype's size, the ranges in order without gaps or overlaps, and the data section covered exactly. A file cut
short (the download that stopped half way) fails the last check before anything is read, and every read is
checked for its full count besides (a file cut while it is open). A file that fails is a DamagedFile, whose
one line names the file, the tensor and the fault.

Not with the safetensors library (the tests check these files with it): it costs memory here. Measured with
safetensors 0.8 on a 1 GiB file of four 256 MiB F32 pieces, each way in a process of its own, alternated
three times:
- a rank resuming, 3 pieces read into tensors allocated beforehand: SafetensorsFile peaks (VmHWM) 257 MiB
  above them, in 0.5-0.7 s. safe_open maps the file, and the pages read stay in the process's resident
  memory while the file is open (836 MiB peak, 772 MiB held; 0.1 s): a rank would hold all it reads. Opened
  afresh for each read, 515 MiB; its backend="pread" reads whole tensors: 513 MiB, and 386 MiB for half of
  each piece, where SafetensorsFile takes 130 MiB.
- tools/convert.py's export, eight 128 MiB tensors each computed when written: save_file wants them all at
  once, 1026 MiB, where write_safetensors peaks at 259 MiB: it holds a tensor at a time, not a model.
The Saver's files (training/checkpoint.py) are written by write_safetensors too: save_file, then an fsync
and a second pass to hash the file, took as long (1.8-6.7 s for 1 GiB, against 1.6-5.6 s, eight runs each)
and leaves the file readable by its owner alone (mode 0600: safetensors 0.8 writes through a temporary file).
"""
import hashlib
import json
import math
import os
import struct

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
TORCH_DTYPES = {code: dtype for dtype, code in DTYPES.items()}
# Every dtype of the format a whole number of bytes wide, with its size: a file may hold tensors this
# project does not read (a quantised model's float8 weights), and their bytes are checked all the same.
ITEM_BYTES = dict(BOOL=1, U8=1, I8=1, F8_E5M2=1, F8_E4M3=1, F8_E8M0=1, I16=2, U16=2, F16=2, BF16=2, I32=4,
                  U32=4, F32=4, F64=8, I64=8, U64=8)
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's bound: a larger length is a damaged field


class DamagedFile(ValueError):
    """A file that is not what it says it is (cut short, its header inconsistent): the message names the
    file and the fault."""


def write_safetensors(path, entries, metadata=None):
    """Write entries [(entry, (shape, dtype, tensor))] as a safetensors file, to a temporary name, flushed
    and renamed into place; returns (bytes, sha256). A tensor is on the CPU, or a function giving it when it
    is written, so that a converter holds one tensor at a time."""
    header = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for entry, (shape, dtype, _) in entries:
        nbytes = shape.numel() * dtype.itemsize
        header[entry] = dict(dtype=DTYPES[dtype], shape=list(shape), data_offsets=[offset, offset + nbytes])
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data begins 8-byte aligned, as readers that map the file want it
    digest = hashlib.sha256()
    with open(path + ".tmp", "wb") as f:
        for chunk in (struct.pack("<Q", len(text)), text):
            f.write(chunk)
            digest.update(chunk)
        for _, (_, _, tensor) in entries:
            data = memoryview((tensor() if callable(tensor) else tensor).contiguous().view(-1).view(torch.uint8)
                              .numpy())
            f.write(data)
            digest.update(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return 8 + len(text) + offset, digest.hexdigest()


def planned(entries):
    """[(entry, tensor)] as write_safetensors wants them: largest elements first (each tensor then starts
    aligned to its element size), with its shape and dtype beside it."""
    entries = sorted(entries, key=lambda e: -e[1].dtype.itemsize)
    return [(entry, (t.shape, t.dtype, t)) for entry, t in entries]


# ---------------------------------------------------------------------------
# Reading: the header checked against the file, then any range of any tensor
# ---------------------------------------------------------------------------

def read_header(path, file_size):
    """(the header's JSON text, where the data section starts) of the file at path, or DamagedFile."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise DamagedFile(f"{path}: damaged, {file_size} bytes: too short for a safetensors file's 8-byte "
                              f"header length (cut short?)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise DamagedFile(f"{path}: damaged, its header claims {length:,} bytes, more than the format's bound "
                              f"of {MAX_HEADER_BYTES:,} (not a safetensors file, or its first bytes changed)")
        if length > file_size - 8:
            raise DamagedFile(f"{path}: damaged, its header claims {length:,} bytes, and {file_size - 8:,} follow "
                              f"its length (cut short, or not a safetensors file)")
        text = f.read(length)
    if len(text) < length:  # (the file shrank since its size was taken)
        raise DamagedFile(f"{path}: damaged, cut short inside its header")
    return text, 8 + length


def parse_header(path, text):
    """The header's JSON object, or DamagedFile."""
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DamagedFile(f"{path}: damaged, its header is not JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(header, dict):
        raise DamagedFile(f"{path}: damaged, its header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DamagedFile(f"{path}: damaged, its __metadata__ is not an object of strings")
    return header, metadata


def check_entry(path, entry, info):
    """(begin, end) of one entry's bytes, checked against its dtype and shape; or DamagedFile."""
    fault = None
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        fault = "is not {dtype, shape, data_offsets}"
    elif info["dtype"] not in ITEM_BYTES:
        fault = f"has dtype {str(info['dtype'])[:40]!r}, not one of the format's ({', '.join(ITEM_BYTES)})"
    elif not is_list_of_sizes(info["shape"]):
        fault = f"has shape {str(info['shape'])[:60]}, not a list of sizes"
    elif not is_list_of_sizes(info["data_offsets"]) or len(info["data_offsets"]) != 2 \
            or info["data_offsets"][0] > info["data_offsets"][1]:
        fault = f"has data_offsets {str(info['data_offsets'])[:60]}, not [begin, end] with begin <= end"
    else:
        (begin, end), nbytes = info["data_offsets"], math.prod(info["shape"]) * ITEM_BYTES[info["dtype"]]
        if end - begin != nbytes:
            fault = (f"holds {end - begin:,} bytes, where its shape {info['shape']} of {info['dtype']} takes "
                     f"{nbytes:,}")
    if fault:
        raise DamagedFile(f"{path}: damaged, tensor {entry!r} {fault}")
    return tuple(info["data_offsets"])


def is_list_of_sizes(value):
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def check_header(path, header, data_bytes):
    """The entries' byte ranges must follow each other from 0 to the end of the data section, as the
    safetensors library requires: no gap, no overlap, nothing past the end, nothing left over."""
    ranges = sorted((check_entry(path, entry, info), entry) for entry, info in header.items())
    reached, last = 0, None
    for (begin, end), entry in ranges:
        if begin != reached:
            where = f"after {last!r}'s end at {reached:,}" if last else "at its start"
            raise DamagedFile(f"{path}: damaged, tensor {entry!r} begins at byte {begin:,} of the data, "
                              f"{'overlapping' if begin < reached else 'leaving a gap'} {where}")
        reached, last = end, entry
    if reached != data_bytes:
        fault = (f"its tensors end at byte {reached:,} of the data, and the file holds {data_bytes:,} after its "
                 f"header: cut short "
                 f"(an interrupted download or copy?)" if reached > data_bytes else
                 f"its tensors end at byte {reached:,} of the data, and {data_bytes - reached:,} bytes follow them")
        raise DamagedFile(f"{path}: damaged, {fault}")


class SafetensorsFile:
    """A safetensors file, checked when opened (see the module's docstring), then read a range of elements
    at a time (read from the file, not mapped: a process that maps a file counts every page it touches as
    its own until it lets the mapping go; figures above)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        text, self.data_start = read_header(self.path, size)
        self.header, self.metadata = parse_header(self.path, text)
        check_header(self.path, self.header, size - self.data_start)

    def read(self, entry, start=0, end=None):
        """Elements [start, end) of the flattened tensor `entry` (end None: to its end)."""
        info = self.header[entry]
        if info["dtype"] not in TORCH_DTYPES:
            raise DamagedFile(f"{self.path}: tensor {entry!r} is {info['dtype']}, which this project does not read")
        dtype, numel = TORCH_DTYPES[info["dtype"]], math.prod(info["shape"])
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise IndexError(f"{self.path}: elements [{start}, {end}) of tensor {entry!r}, of {numel}")
        values = torch.empty(end - start, dtype=dtype)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + info["data_offsets"][0] + start * dtype.itemsize)
            got = f.readinto(memoryview(values.view(torch.uint8).numpy()))
        if got != values.numel() * dtype.itemsize:  # (the file was cut since it was opened)
            raise DamagedFile(f"{self.path}: damaged, cut short inside tensor {entry!r} ({got:,} of "
                              f"{values.numel() * dtype.itemsize:,} bytes read)")
        return values

    def tensor(self, entry):
        return self.read(entry).view(self.header[entry]["shape"])
