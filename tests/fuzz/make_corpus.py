#!/usr/bin/env python3
"""Writes the seed corpus for fuzz_st_header: small whole safetensors files, valid_* ones that
must parse and invalid_* ones that must be refused (test_fuzz_replay checks both). Standard
library only; rerun after changing it and commit the files it writes into corpus/."""
import json
import os
import struct

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8,
         "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8}


def image(header, data, pad=True, raw=None):
    text = raw if raw is not None else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def layout(tensors, meta=None):
    """tensors: [(name, dtype, shape)] laid out back to back; returns (header, data)."""
    header, off = {}, 0
    if meta is not None:
        header["__metadata__"] = meta
    for name, dt, shape in tensors:
        n = 1
        for d in shape:
            n *= d
        nb = n * SIZES[dt] if dt != "F4" else n // 2
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + nb]}
        off += nb
    return header, bytes((i * 37 + 11) & 0xFF for i in range(off))


def main():
    os.makedirs(HERE, exist_ok=True)
    files = {}
    h, d = layout([("w", "F32", [2, 3]), ("b", "BF16", [3])], {"format": "pt"})
    files["valid_basic"] = image(h, d)
    h, d = layout([("s", "F32", []), ("e", "F16", [4, 0]), ("z", "U8", [0])])
    files["valid_scalar_empty"] = image(h, d)
    h, d = layout([("t." + k, k, [2, 2]) for k in SIZES] + [("t.F4", "F4", [2, 2])])
    files["valid_all_dtypes"] = image(h, d)
    h, d = layout([("x", "I8", [3])])
    files["valid_unpadded"] = image(h, d, pad=False)
    files["valid_empty"] = image({}, b"")
    h, d = layout([("x", "U8", [1, 1, 1, 1, 1, 1, 1, 1])], {"a": "", "b": "\u00e9"})
    files["valid_8dims_meta"] = image(h, d)

    files["invalid_short"] = b"\x10\x00\x00"
    files["invalid_hdrlen_past_eof"] = struct.pack("<Q", 4096) + b"{}"
    files["invalid_hdr_too_big"] = struct.pack("<Q", 200_000_000) + b"{}"
    files["invalid_json"] = image(None, b"", raw=b'{"a":{"dtype":"U8",,}}')
    files["invalid_dup"] = image(None, b"\0\0", raw=b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                                  b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}')
    h, d = layout([("a", "U8", [4]), ("b", "U8", [4])])
    h["b"]["data_offsets"] = [2, 6]
    files["invalid_overlap"] = image(h, d[:6])
    h, d = layout([("a", "U8", [4]), ("b", "U8", [2])])
    h["b"]["data_offsets"] = [6, 8]
    files["invalid_gap"] = image(h, d + b"\0\0")
    h, d = layout([("a", "U8", [2])])
    h["a"]["dtype"] = "F7"
    files["invalid_dtype"] = image(h, d)
    h, d = layout([("a", "F32", [2, 3])])
    h["a"]["shape"] = [2, 2]
    files["invalid_size"] = image(h, d)
    h, d = layout([("a", "U8", [4])])
    files["invalid_trailing"] = image(h, d + b"xyz")
    h, d = layout([("a", "U8", [4])])
    files["invalid_truncated"] = image(h, d[:3])
    h, d = layout([("a", "U8", [2])])
    h["a"]["dtype"], h["a"]["shape"] = "F4", [3]
    files["invalid_f4_odd"] = image(h, d)
    h, d = layout([("a", "U8", [2])])
    h["a"]["shape"] = [4294967296, 4294967296, 16]
    files["invalid_overflow"] = image(h, d)
    h, d = layout([("a", "U8", [2])], {"k": 5})
    files["invalid_meta"] = image(h, d)
    for name, blob in files.items():
        with open(os.path.join(HERE, name), "wb") as f:
            f.write(blob)
    print(f"wrote {len(files)} files to {HERE}")


if __name__ == "__main__":
    main()
