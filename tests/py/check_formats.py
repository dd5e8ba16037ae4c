"""Oracle check of host/formats.c against ml_dtypes (and numpy for float16).

Runs $MOEFLOW_BUILD/formats_dump and compares: the float32 decode of every code of E2M1, E8M0,
E4M3fn, BF16 and F16 (bit-identical; NaN must be NaN), and the codes produced when encoding a
large set of float32 inputs (every decoded value and its float32 neighbours, every midpoint
between adjacent values and its neighbours, signed zeros, infinities, NaNs with assorted
payloads, huge and tiny values, and 1e6 random float32 bit patterns) with
np.array(x, dtype=np.float32).astype(T). Exits 1 with the first mismatches on any difference.
`--exhaustive` additionally encodes all 2^32 float32 bit patterns (minutes; not run by ctest).
"""
import os
import subprocess
import sys

import ml_dtypes
import numpy as np

FORMATS = [  # name, ml_dtypes/numpy type, number of codes, code storage type
    ("e2m1", ml_dtypes.float4_e2m1fn, 16, np.uint8),
    ("e8m0", ml_dtypes.float8_e8m0fnu, 256, np.uint8),
    ("e4m3", ml_dtypes.float8_e4m3fn, 256, np.uint8),
    ("bf16", ml_dtypes.bfloat16, 65536, np.uint16),
    ("f16", np.float16, 65536, np.uint16),
]
SEED = 20260101
N_RANDOM = 1_000_000
MAX_SHOWN = 10


def fail(msg):
    print(f"check_formats: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def dump_path():
    build = os.environ.get("MOEFLOW_BUILD")
    if not build:
        fail("MOEFLOW_BUILD is not set (expected the build directory holding formats_dump)")
    path = os.path.join(build, "formats_dump")
    if not os.access(path, os.X_OK):
        fail(f"{path}: expected the formats_dump helper program, not found or not executable")
    return path


def run_dump(dump, args, stdin_bytes=None):
    proc = subprocess.run([dump] + args, input=stdin_bytes, capture_output=True)
    if proc.returncode != 0:
        fail(f"formats_dump {' '.join(args)} exited {proc.returncode}: "
             f"{proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout


def ml_decode(t, n_codes, store):
    return np.arange(n_codes, dtype=np.uint32).astype(store).view(t).astype(np.float32)


def check_decode(dump):
    raw = run_dump(dump, ["decode"])
    expected_len = sum(n for _, _, n, _ in FORMATS) * 4
    if len(raw) != expected_len:
        fail(f"formats_dump decode: expected {expected_len} bytes, got {len(raw)}")
    ours_all = np.frombuffer(raw, dtype=np.float32)
    pos, total = 0, 0
    for name, t, n, store in FORMATS:
        ours = ours_all[pos:pos + n]
        pos += n
        ref = ml_decode(t, n, store)
        ours_nan, ref_nan = np.isnan(ours), np.isnan(ref)
        same_bits = ours.view(np.uint32) == ref.view(np.uint32)
        ok = np.where(ref_nan, ours_nan, same_bits & ~ours_nan)
        bad = np.flatnonzero(~ok)
        if bad.size:
            lines = [f"  code 0x{c:x}: ours {ours[c]!r} (0x{ours.view(np.uint32)[c]:08x}), "
                     f"ml_dtypes {ref[c]!r} (0x{ref.view(np.uint32)[c]:08x})"
                     for c in bad[:MAX_SHOWN]]
            fail(f"decode {name}: {bad.size} of {n} codes differ\n" + "\n".join(lines))
        print(f"check_formats: decode {name}: {n} codes identical ({int(ref_nan.sum())} NaN)")
        total += n
    return total


def bits_to_f32(bits):
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def encode_inputs():
    """The structured inputs plus N_RANDOM random bit patterns, as float32."""
    parts = []
    for name, t, n, store in FORMATS:
        vals = ml_decode(t, n, store)
        parts.append(vals)
        finite = np.unique(vals[np.isfinite(vals)].astype(np.float64))
        pos = finite[finite > 0]
        # One step past the largest value: where rounding up overflows.
        beyond = 2 * pos[-1] if name == "e8m0" else pos[-1] + (pos[-1] - pos[-2])
        with np.errstate(over="ignore"):
            beyond_fits = np.isfinite(np.float32(beyond))
        if beyond_fits:
            pos = np.append(pos, beyond)
        mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
        mids = np.concatenate([mids, [np.float32(pos[0] / 2), np.float32(pos[0] / 4)]])
        near = np.concatenate([mids, pos.astype(np.float32)])
        with np.errstate(over="ignore"):
            neigh = np.concatenate([np.nextafter(near, np.float32(np.inf)),
                                    np.nextafter(near, np.float32(0))])
        parts += [mids, neigh]
    specials = bits_to_f32([
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,              # zeros, infinities
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF,  # NaNs: quiet, signalling,
        0x7FA00000, 0x7F802000, 0x7F801FFF, 0xFFE00001, 0x7FC02000,  # assorted payloads
        0x00000001, 0x80000001, 0x007FFFFF, 0x00400000, 0x00400001,  # float32 subnormals
        0x003FFFFF, 0x00600000, 0x00200000, 0x00800000, 0x80400000,
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F000000, 0x7F400000, 0x7F3FFFFF,  # huge
        0x7F7F8000, 0x7F7F7FFF,
    ])
    tiny_huge = np.float32([1e-45, 1e-40, 1e-38, 1e-30, 1e-10, 1e10, 1e30, 1e38, 3e38])
    parts += [specials, tiny_huge]
    structured = np.concatenate(parts).astype(np.float32)
    structured = np.concatenate([structured, -structured])
    rng = np.random.default_rng(SEED)
    random = rng.integers(0, 2**32, size=N_RANDOM, dtype=np.uint64).astype(np.uint32)
    return structured, random.view(np.float32)


def ml_encode(x, t, store):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(t).view(store)


def compare_encode(dump_out, x, label):
    n = x.size
    expected_len = n * (1 + 1 + 1 + 2 + 2)
    if len(dump_out) != expected_len:
        fail(f"formats_dump {label}: expected {expected_len} bytes, got {len(dump_out)}")
    pos = 0
    for name, t, _, store in FORMATS:
        width = np.dtype(store).itemsize
        ours = np.frombuffer(dump_out, dtype=store, count=n, offset=pos)
        pos += n * width
        ref = ml_encode(x, t, store)
        bad = np.flatnonzero(ours != ref)
        if bad.size:
            xb = x.view(np.uint32)
            lines = [f"  x = {x[i]!r} (0x{xb[i]:08x}): ours 0x{int(ours[i]):0{2 * width}x}, "
                     f"ml_dtypes 0x{int(ref[i]):0{2 * width}x}" for i in bad[:MAX_SHOWN]]
            fail(f"encode {name} ({label}): {bad.size} of {n} inputs differ\n" + "\n".join(lines))


def check_encode(dump):
    structured, random = encode_inputs()
    for x, label in ((structured, "structured"), (random, "random")):
        compare_encode(run_dump(dump, ["encode"], x.tobytes()), x, label)
        print(f"check_formats: encode {label}: {x.size} float32 inputs x {len(FORMATS)} formats "
              "identical")
    return structured.size + random.size


def check_exhaustive(dump):
    chunk = 1 << 24
    for lo in range(0, 1 << 32, chunk):
        x = np.arange(lo, lo + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
        compare_encode(run_dump(dump, ["encode-range", str(lo), str(chunk)]), x,
                       f"bit patterns 0x{lo:08x}..")
        print(f"check_formats: exhaustive: 0x{lo:08x} + 2^24 done", flush=True)
    print(f"check_formats: exhaustive: all 2^32 float32 inputs x {len(FORMATS)} formats identical")


def main():
    dump = dump_path()
    n_codes = check_decode(dump)
    n_inputs = check_encode(dump)
    if "--exhaustive" in sys.argv[1:]:
        check_exhaustive(dump)
    print(f"check_formats: OK: {n_codes} codes decoded, {n_inputs} inputs encoded into each of "
          f"{len(FORMATS)} formats, all identical to ml_dtypes {ml_dtypes.__version__} / "
          f"numpy {np.__version__}")


if __name__ == "__main__":
    main()
