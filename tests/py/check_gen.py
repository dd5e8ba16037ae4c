#!/usr/bin/env python3
"""`moeflow gen --preset tiny` checked by the Python safetensors package and ml_dtypes: every
shard deserializes; the index maps each tensor to the shard holding it and its total_size is the
sum of tensor bytes; config.json names the same geometry as the shapes; every fp8 / fp4 / BF16
linear, decoded independently here (E4M3, E8M0 via ml_dtypes, E2M1 by table, low nibble first),
is finite with rows of ~unit gain on unit-RMS inputs (rms * sqrt(in) within 2x of 1). Exits
non-zero on any mismatch."""
import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import safetensors

BIN = os.environ.get("MOEFLOW_BIN", "build/moeflow")
TMP = os.path.join(os.environ.get("MOEFLOW_TMP", "/tmp"), f"check_gen_{os.getpid()}")
FAILURES = []
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def fail(msg):
    FAILURES.append(msg)
    print("MISMATCH:", msg, file=sys.stderr)


def as_f32(dtype, shape, data):
    if dtype == "F8_E4M3":
        return np.frombuffer(data, ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(shape)
    if dtype == "F8_E8M0":
        return np.frombuffer(data, ml_dtypes.float8_e8m0fnu).astype(np.float32).reshape(shape)
    if dtype == "BF16":
        return np.frombuffer(data, ml_dtypes.bfloat16).astype(np.float32).reshape(shape)
    if dtype == "F32":
        return np.frombuffer(data, np.float32).reshape(shape)
    if dtype == "I8":   # packed e2m1, low nibble = lower K index
        b = np.frombuffer(data, np.uint8).reshape(shape)
        out = np.empty((shape[0], shape[1] * 2), np.float32)
        out[:, 0::2] = E2M1[b & 15]
        out[:, 1::2] = E2M1[b >> 4]
        return out
    raise ValueError(dtype)


def main():
    shutil.rmtree(TMP, ignore_errors=True)
    subprocess.run([BIN, "gen", "--preset", "tiny", "--out", TMP, "--seed", "3", "--quiet"], check=True)
    cfg = json.load(open(os.path.join(TMP, "config.json")))
    index = json.load(open(os.path.join(TMP, "model.safetensors.index.json")))
    tensors, total = {}, 0
    for shard in sorted(set(index["weight_map"].values())):
        raw = open(os.path.join(TMP, shard), "rb").read()
        for name, t in safetensors.deserialize(raw):
            if index["weight_map"].get(name) != shard:
                fail(f"{name}: index says {index['weight_map'].get(name)}, found in {shard}")
            tensors[name] = as_f32(t["dtype"], t["shape"], t["data"])
            total += len(t["data"])
    if set(tensors) != set(index["weight_map"]):
        fail(f"index names {len(index['weight_map'])} tensors, shards hold {len(tensors)}")
    if index["metadata"]["total_size"] != total:
        fail(f"total_size {index['metadata']['total_size']} != {total}")

    H, E, L = cfg["hidden_size"], cfg["n_routed_experts"], cfg["num_hidden_layers"]
    if tensors["embed.weight"].shape != (cfg["vocab_size"], H):
        fail(f"embed shape {tensors['embed.weight'].shape}")
    for l in range(L):
        if tensors[f"layers.{l}.ffn.gate.weight"].shape != (E, H):
            fail(f"layer {l} gate shape")
        for x in range(E):
            if f"layers.{l}.ffn.experts.{x}.w2.weight" not in tensors:
                fail(f"layer {l} expert {x} missing")
    for l in cfg["engram_layer_ids"]:
        if f"layers.{l}.engram.embed.weight" not in tensors:
            fail(f"Engram layer {l} has no table")

    for name, v in tensors.items():
        if not np.all(np.isfinite(v)):
            fail(f"{name}: non-finite values")
    n_checked = 0
    for name in tensors:
        if not name.endswith(".weight") or name.endswith("embed.weight"):
            continue
        w = tensors[name]
        scale = tensors.get(name[:-len(".weight")] + ".scale")
        if w.ndim != 2:
            continue
        if scale is not None:
            if ".experts." in name:   # routed experts: one scale per 32 along K
                w = w * np.repeat(scale, 32, axis=1)[:, : w.shape[1]]
            else:   # 32x32 tiles
                w = w * np.repeat(np.repeat(scale, 32, 0), 32, 1)[: w.shape[0], : w.shape[1]]
        gain = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)) * np.sqrt(w.shape[1]))
        if not 0.5 < gain < 2.0:
            fail(f"{name}: rms * sqrt(in) = {gain:.3f}, want ~1")
        n_checked += 1
    print(f"check_gen: {len(tensors)} tensors, {n_checked} linears checked, {len(FAILURES)} mismatches")
    shutil.rmtree(TMP, ignore_errors=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
