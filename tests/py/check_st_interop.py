#!/usr/bin/env python3
"""safetensors interoperability with the Python package, both ways, through tests/py/st_tool.c.
Files written by safetensors.numpy.save_file (every dtype numpy and ml_dtypes can hold, scalars,
zero-size tensors, metadata, and a sharded checkpoint with an index) must read here with the same
names, dtypes, shapes and bytes; files written here must load in safetensors (safe_open, and
deserialize for raw bytes of dtypes numpy cannot hold) with the contents st_tool says it wrote.
Exits non-zero on any mismatch."""
import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import safetensors
from safetensors import safe_open
from safetensors.numpy import save_file

BUILD = os.environ.get("MOEFLOW_BUILD", "build")
TMP = os.path.join(os.environ.get("MOEFLOW_TMP", "/tmp"), f"st_interop_{os.getpid()}")
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print("MISMATCH:", msg, file=sys.stderr)


def tool_path():
    for p in (os.path.join(BUILD, "st_tool"), os.path.join(BUILD, "tests", "st_tool")):
        if os.access(p, os.X_OK):
            return p
    sys.exit(f"check_st_interop: st_tool not found under {BUILD} (set MOEFLOW_BUILD)")


TOOL = tool_path()


def dump(path, keys=()):
    out = subprocess.run([TOOL, "dump", path, *keys], capture_output=True, text=True)
    if out.returncode != 0:
        fail(f"st_tool dump {path} failed: {out.stderr.strip()}")
        return None
    return json.loads(out.stdout)


# ---- Python writes, moeflow reads -------------------------------------------------------------

def python_tensors():
    rng = np.random.default_rng(1234)
    t = {}
    for name, dt in [("f64", np.float64), ("f32", np.float32), ("f16", np.float16),
                     ("bf16", ml_dtypes.bfloat16), ("f8_e4m3", ml_dtypes.float8_e4m3fn),
                     ("f8_e5m2", ml_dtypes.float8_e5m2)]:
        t[f"x.{name}"] = (rng.standard_normal((3, 5)) * 4).astype(dt)
    if hasattr(ml_dtypes, "float8_e8m0fnu"):
        t["x.f8_e8m0"] = (2.0 ** rng.integers(-20, 20, size=(7,))).astype(ml_dtypes.float8_e8m0fnu)
    for name, dt in [("i8", np.int8), ("u8", np.uint8), ("i16", np.int16), ("u16", np.uint16),
                     ("i32", np.int32), ("u32", np.uint32), ("i64", np.int64), ("u64", np.uint64)]:
        info = np.iinfo(dt)
        t[f"x.{name}"] = rng.integers(info.min, info.max, size=(2, 3, 4), dtype=dt, endpoint=True)
    t["x.bool"] = rng.integers(0, 2, size=(9,)).astype(bool)
    t["scalar.f32"] = np.array(3.25, dtype=np.float32)
    t["empty.bf16"] = np.zeros((4, 0), dtype=ml_dtypes.bfloat16)
    t["empty.i64"] = np.zeros((0,), dtype=np.int64)
    return t


NP_TO_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
            "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
            "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16", "int32": "I32",
            "uint32": "U32", "int64": "I64", "uint64": "U64", "bool": "BOOL"}


def compare_dump(label, d, expected, shard_of=None):
    """expected: name -> numpy array; d: st_tool dump output."""
    got = {t["name"]: t for t in d["tensors"]}
    if sorted(got) != sorted(expected):
        fail(f"{label}: tensor names {sorted(got)} != {sorted(expected)}")
    names = [t["name"] for t in d["tensors"]]
    if names != sorted(names, key=lambda s: s.encode()):
        fail(f"{label}: tensors not sorted by name: {names}")
    for name, arr in expected.items():
        t = got.get(name)
        if t is None:
            continue
        want_dt = NP_TO_ST[arr.dtype.name]
        if t["dtype"] != want_dt:
            fail(f"{label}: {name}: dtype {t['dtype']} != {want_dt}")
        if tuple(t["shape"]) != arr.shape:
            fail(f"{label}: {name}: shape {t['shape']} != {list(arr.shape)}")
        if t["hex"] != np.ascontiguousarray(arr).tobytes().hex():
            fail(f"{label}: {name}: bytes differ")
        if shard_of and t["shard"] != shard_of[name]:
            fail(f"{label}: {name}: shard {t['shard']} != {shard_of[name]}")


def python_to_moeflow():
    tensors = python_tensors()
    meta = {"format": "np", "note": "written by safetensors.numpy"}
    path = os.path.join(TMP, "py_single.safetensors")
    save_file(tensors, path, metadata=meta)
    d = dump(path, ["format", "note", "absent"])
    if d:
        compare_dump("py->moeflow single", d, tensors)
        want_meta = dict(meta, absent=None)
        if d["metadata"] != want_meta:
            fail(f"py->moeflow single: metadata {d['metadata']} != {want_meta}")

    # a sharded checkpoint as transformers writes it: shards plus model.safetensors.index.json
    sdir = os.path.join(TMP, "py_sharded")
    os.makedirs(sdir)
    names = sorted(tensors)
    parts = [names[0::3], names[1::3], names[2::3]]
    shard_of, total = {}, 0
    for k, part in enumerate(parts):
        fname = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(sdir, fname),
                  metadata={"format": "np"} if k == 1 else None)
        for n in part:
            shard_of[n] = fname
            total += tensors[n].nbytes
    with open(os.path.join(sdir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": shard_of}, f, indent=2)
    d = dump(sdir, ["format"])
    if d:
        compare_dump("py->moeflow sharded", d, tensors, shard_of)
        if d["n_shards"] != 3:
            fail(f"py->moeflow sharded: {d['n_shards']} shards")
        if d["metadata"] != {"format": "np"}:
            fail(f"py->moeflow sharded: metadata {d['metadata']}")
    print(f"python -> moeflow: {len(tensors)} tensors, single file and 3 shards")


# ---- moeflow writes, Python reads -------------------------------------------------------------

ST_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "U16": 16, "I16": 16, "U32": 32, "I32": 32, "U64": 64,
           "I64": 64, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4, "BF16": 16, "F16": 16,
           "F32": 32, "F64": 64}
TOOL_WRITES = {f"t.{k}": (k, [3, 4]) for k in ST_BITS}
TOOL_WRITES.update({"scalar.f32": ("F32", []), "empty.bf16": ("BF16", [2, 0, 5]),
                    "deep.i8": ("I8", [1, 2, 1, 2, 1, 2, 1, 3])})
TOOL_SHARDED = {"model.embed": ("BF16", [8, 4], "model-00001-of-00002.safetensors"),
                "model.layers.0.w": ("F8_E4M3", [4, 8], "model-00001-of-00002.safetensors"),
                "model.layers.0.scale": ("F8_E8M0", [4], "model-00002-of-00002.safetensors"),
                "model.norm": ("F32", [4], "model-00002-of-00002.safetensors")}


def known_bytes(name, dtype, shape):
    n = int(np.prod(shape, dtype=np.int64)) * ST_BITS[dtype] // 8
    s = sum(name.encode())
    v = (s + 7 * np.arange(n, dtype=np.int64)) & 0xFF
    if dtype == "BOOL":
        v = (v >> 1) & 1
    return v.astype(np.uint8).tobytes()


def check_python_reads(label, path, expected):
    """expected: name -> (dtype, shape). safe_open must accept the file; bytes via deserialize
    (every dtype) and, where numpy can hold the dtype, via get_tensor too."""
    with open(path, "rb") as f:
        raw = {name: v for name, v in safetensors.deserialize(f.read())}
    with safe_open(path, framework="numpy") as f:
        keys = set(f.keys())
        for name, (dtype, shape) in expected.items():
            if name not in keys or name not in raw:
                fail(f"{label}: {name} missing in Python")
                continue
            sl = f.get_slice(name)
            if sl.get_dtype() != dtype or list(sl.get_shape()) != shape:
                fail(f"{label}: {name}: Python sees {sl.get_dtype()} {sl.get_shape()}, "
                     f"wrote {dtype} {shape}")
            want = known_bytes(name, dtype, shape)
            if bytes(raw[name]["data"]) != want:
                fail(f"{label}: {name}: bytes differ (deserialize)")
            if dtype not in ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"):
                arr = f.get_tensor(name)
                if arr.tobytes() != want or list(arr.shape) != shape:
                    fail(f"{label}: {name}: get_tensor gives other bytes or shape")
        if keys != set(expected):
            fail(f"{label}: Python sees tensors {sorted(keys)}, wrote {sorted(expected)}")
        return f.metadata()


def moeflow_to_python():
    path = os.path.join(TMP, "mf_single.safetensors")
    r = subprocess.run([TOOL, "write", path], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"st_tool write: {r.stderr.strip()}")
        return
    meta = check_python_reads("moeflow->py single", path, TOOL_WRITES)
    if meta != {"writer": "moeflow st_tool", "format": "np"}:
        fail(f"moeflow->py single: metadata {meta}")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
    body = header.rstrip(b" ")
    if n % 8 != 0 or not body.endswith(b"}") or len(header) - len(body) >= 8:
        fail(f"moeflow->py single: header length {n} not padded with spaces to a multiple of 8")
    if list(json.loads(header))[0] != "__metadata__":
        fail("moeflow->py single: __metadata__ is not first")

    sdir = os.path.join(TMP, "mf_sharded")
    os.makedirs(sdir)
    r = subprocess.run([TOOL, "write-sharded", sdir], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"st_tool write-sharded: {r.stderr.strip()}")
        return
    with open(os.path.join(sdir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    want_map = {k: v[2] for k, v in TOOL_SHARDED.items()}
    if index.get("weight_map") != want_map:
        fail(f"moeflow->py sharded: weight_map {index.get('weight_map')}")
    if index.get("metadata", {}).get("total_size") != 116:
        fail(f"moeflow->py sharded: metadata {index.get('metadata')}")
    for fname in sorted(set(want_map.values())):
        part = {k: (v[0], v[1]) for k, v in TOOL_SHARDED.items() if v[2] == fname}
        check_python_reads(f"moeflow->py {fname}", os.path.join(sdir, fname), part)
    print(f"moeflow -> python: {len(TOOL_WRITES)} tensors, single file and 2 shards")


def main():
    os.makedirs(TMP)
    print(f"safetensors {safetensors.__version__}, numpy {np.__version__}, "
          f"ml_dtypes {ml_dtypes.__version__}")
    python_to_moeflow()
    moeflow_to_python()
    if FAILURES:
        print(f"check_st_interop: {len(FAILURES)} mismatches", file=sys.stderr)
        return 1
    shutil.rmtree(TMP)
    print("check_st_interop: all match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
