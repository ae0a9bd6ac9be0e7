"""Small file-format helpers for the parity test: safetensors and llm.c token files.

Only json, struct and numpy are used (no `safetensors` package).

safetensors layout: 8-byte little-endian u64 header length N, then N bytes of JSON
    {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}
(offsets relative to the first byte after the header), then the raw little-endian data.
The header is padded with spaces to a multiple of 8 bytes, as the reference writer does.

llm.c token file: 256 little-endian int32 (magic 20240520, version 1 = uint16 tokens,
2 = uint32 tokens, token count, rest zero), then the tokens.
"""
import json
import struct

import numpy as np

# safetensors dtype name <-> numpy dtype (little-endian). BF16 is read only (widened to F32).
_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_NAMES = {(v.kind, v.itemsize): k for k, v in _DTYPES.items()}

TOKEN_MAGIC = 20240520
TOKEN_HEADER_INTS = 256


def save_safetensors(path, tensors, metadata=None):
    """Write {name: numpy array} to `path`. Tensors are stored in sorted name order."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])  # tobytes() below writes C order
        key = (a.dtype.kind, a.dtype.itemsize)
        if key not in _NAMES:
            raise ValueError(f"{name}: unsupported dtype {a.dtype}")
        raw = a.astype(_DTYPES[_NAMES[key]], copy=False).tobytes()  # little-endian bytes
        header[name] = {"dtype": _NAMES[key], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for raw in blobs:
            f.write(raw)


def read_header(path):
    """The JSON header of a safetensors file (with "__metadata__" if present)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n).decode("utf-8"))


def load_safetensors(path, with_metadata=False):
    """Read a safetensors file into {name: numpy array} (BF16 widened to float32).

    Checks that the data ranges are in bounds and sized to match dtype and shape."""
    with open(path, "rb") as f:
        buf = f.read()
    if len(buf) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", buf[:8])
    if 8 + n > len(buf):
        raise ValueError(f"{path}: header length {n} exceeds file size {len(buf)}")
    header = json.loads(buf[8:8 + n].decode("utf-8"))
    data = memoryview(buf)[8 + n:]
    meta = header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= begin <= end <= len(data):
            raise ValueError(f"{path}: {name}: data_offsets {begin}..{end} out of range")
        if info["dtype"] == "BF16":
            if end - begin != 2 * count:
                raise ValueError(f"{path}: {name}: {end - begin} bytes for BF16 shape {shape}")
            u16 = np.frombuffer(data[begin:end], dtype="<u2").astype(np.uint32) << 16
            out[name] = u16.view(np.float32).reshape(shape)
            continue
        dt = _DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"{path}: {name}: unsupported dtype {info['dtype']}")
        if end - begin != dt.itemsize * count:
            raise ValueError(f"{path}: {name}: {end - begin} bytes for {info['dtype']} shape {shape}")
        out[name] = np.frombuffer(data[begin:end], dtype=dt).reshape(shape).copy()
    return (out, meta) if with_metadata else out


def write_tokens(path, tokens, version=None):
    """Write an llm.c token file; version 1 (uint16) if every token fits, else 2 (uint32)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise ValueError("tokens must be in [0, 2^32)")
    if version is None:
        version = 1 if tokens.size == 0 or tokens.max() < 2**16 else 2
    if version == 1 and tokens.size and tokens.max() >= 2**16:
        raise ValueError("version 1 stores uint16 tokens; a token is >= 65536")
    header = np.zeros(TOKEN_HEADER_INTS, dtype="<i4")
    header[:3] = (TOKEN_MAGIC, version, tokens.size)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2" if version == 1 else "<u4").tobytes())


def read_tokens(path):
    """Read an llm.c token file; returns the tokens as an int64 numpy array."""
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(4 * TOKEN_HEADER_INTS), dtype="<i4")
        if header.size != TOKEN_HEADER_INTS or header[0] != TOKEN_MAGIC:
            raise ValueError(f"{path}: not an llm.c token file (bad magic)")
        version, count = int(header[1]), int(header[2])
        if version not in (1, 2):
            raise ValueError(f"{path}: unknown token file version {version}")
        dt = "<u2" if version == 1 else "<u4"
        toks = np.frombuffer(f.read(), dtype=dt)
    if toks.size != count:
        raise ValueError(f"{path}: header says {count} tokens, file holds {toks.size}")
    return toks.astype(np.int64)
