#!/usr/bin/env python3
"""The C reference forward (graphs/ref_*.c) against an independent numpy port of the same
formulas (docs/reference.md), on the tiny preset: weights decoded here with ml_dtypes (E4M3,
E8M0, E2M1 by table, low nibble first), fake quantization through ml_dtypes casts, Engram
multipliers from numpy's own default_rng, primes searched here; the sequence computed in the
Hugging Face port's shape (whole-sequence projections, window and visibility masks) rather than
the C code's token-by-token caches. Compares logits of every position, routed experts and the
compressed entries each layer attends. Exits non-zero on any mismatch past the stated tolerance."""
import json
import math
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import safetensors

BIN = os.environ.get("MOEFLOW_BIN", "build/moeflow")
BUILD = os.environ.get("MOEFLOW_BUILD", "build")
TMP = os.path.join(os.environ.get("MOEFLOW_TMP", "/tmp"), f"check_ref_{os.getpid()}")
F32, F64 = np.float32, np.float64
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], F32)
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print("MISMATCH:", msg, file=sys.stderr)


def bf(x):
    return np.asarray(x, F32).astype(ml_dtypes.bfloat16).astype(F32)


def load(dirname):
    cfg = json.load(open(os.path.join(dirname, "config.json")))
    index = json.load(open(os.path.join(dirname, "model.safetensors.index.json")))
    raw = {}
    for shard in sorted(set(index["weight_map"].values())):
        for name, t in safetensors.deserialize(open(os.path.join(dirname, shard), "rb").read()):
            raw[name] = t
    return cfg, raw


class W:
    """Dequantized weights (float64) by base name."""

    def __init__(self, raw, bo, bi):
        self.raw, self.bo, self.bi, self.cache = raw, bo, bi, {}

    def arr(self, name):
        t = self.raw[name]
        d, s = t["dtype"], t["shape"]
        if d == "F8_E4M3":
            return np.frombuffer(t["data"], ml_dtypes.float8_e4m3fn).astype(F64).reshape(s)
        if d == "F8_E8M0":
            return np.frombuffer(t["data"], ml_dtypes.float8_e8m0fnu).astype(F64).reshape(s)
        if d == "BF16":
            return np.frombuffer(t["data"], ml_dtypes.bfloat16).astype(F64).reshape(s)
        if d == "F32":
            return np.frombuffer(t["data"], F32).astype(F64).reshape(s)
        if d == "I8":
            b = np.frombuffer(t["data"], np.uint8).reshape(s)
            out = np.empty((s[0], s[1] * 2), F64)
            out[:, 0::2] = E2M1[b & 15]
            out[:, 1::2] = E2M1[b >> 4]
            return out
        raise ValueError(d)

    def __call__(self, base):
        if base in self.cache:
            return self.cache[base]
        if base + ".weight" in self.raw and base + ".scale" in self.raw:
            w, s = self.arr(base + ".weight"), self.arr(base + ".scale")
            if self.raw[base + ".weight"]["dtype"] == "I8":   # one scale per 32 along K
                v = w * np.repeat(s, 32, axis=1)
            else:   # 32x32 tiles
                v = w * np.repeat(np.repeat(s, self.bo, 0), self.bi, 1)[: w.shape[0], : w.shape[1]]
        else:
            v = self.arr(base)
        self.cache[base] = v
        return v


def lin(x, w):
    return (np.asarray(x, F64) @ w.T).astype(F32)


def rmsnorm(x, w, eps):
    x = np.asarray(x, F32)
    ms = (x.astype(F64) ** 2).mean(-1, keepdims=True)
    rs = (1.0 / np.sqrt(ms + eps)).astype(F32)
    return bf(w.astype(F32) * bf(x * rs))


def freqs_of(cfg, ratio):
    rd = cfg["qk_rope_head_dim"]
    base = cfg["compress_rope_theta"] if ratio else cfg["rope_theta"]
    f = np.array([base ** (-2.0 * j / rd) for j in range(rd // 2)], F64)
    # no rope_scaling (or null): the released YaRN, as NeMo AutoModel's config applies it
    rs = cfg.get("rope_scaling") or {"factor": 16, "original_max_position_embeddings": 65536}
    factor = rs.get("factor", 0)
    if ratio and factor:
        orig = rs["original_max_position_embeddings"]
        cd = lambda r: rd * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(cd(rs.get("beta_fast", 32))), 0)
        high = min(math.ceil(cd(rs.get("beta_slow", 1))), rd - 1)
        if high == low:
            high += 0.001
        ramp = np.clip((np.arange(rd // 2) - low) / (high - low), 0, 1)
        f = f / factor * ramp + f * (1 - ramp)
    return f.astype(F32)


def rope(x, pos, fr, inverse=False):
    """interleaved pairs over the last 2*len(fr) dims of x [..., n]; pos broadcast over rows"""
    x = np.array(x, F32)
    n = 2 * len(fr)
    ang = (np.asarray(pos, F32)[..., None] * fr).astype(F32)
    c, s = np.cos(ang.astype(F64)).astype(F32), np.sin(ang.astype(F64)).astype(F32)
    if inverse:
        s = -s
    a, b = x[..., -n::2].copy(), x[..., -n + 1::2].copy()
    x[..., -n::2] = a * c - b * s
    x[..., -n + 1::2] = a * s + b * c
    return x


def pow2_ceil(v):
    return np.exp2(np.ceil(np.log2(v.astype(F64)))).astype(F32)


def fq_e4m3_pow2(x, blk):
    x = np.asarray(x, F32)
    y = x.reshape(-1, blk)
    amax = np.abs(y).max(-1, keepdims=True)
    s = pow2_ceil(np.maximum(amax, F32(1e-4)) * F32(1 / 448))
    q = np.clip(y / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(F32)
    return (q * s).reshape(x.shape)


def fq_e2m1_pow2(x, blk):
    x = np.asarray(x, F32)
    y = x.reshape(-1, blk)
    amax = np.abs(y).max(-1, keepdims=True)
    s = pow2_ceil(np.maximum(amax, F32(6 * 2.0 ** -126)) / F32(6))
    q = np.clip(y / s, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(F32)
    return (q * s).reshape(x.shape)


def fq_e2m1_e4m3(x, blk):
    x = np.asarray(x, F32)
    y = x.reshape(-1, blk)
    amax = np.abs(y).max(-1, keepdims=True)
    s = np.minimum(np.maximum(amax, F32(6 * 2.0 ** -9)) / F32(6), F32(448))
    s = s.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    q = np.clip(y / s, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(F32)
    return (q * s).reshape(x.shape)


def sigmoid32(x):
    return F32(1.0 / (1.0 + math.exp(-float(x))))


def hc_split(m, sc, base, hc, eps, iters):
    m, sc, base, eps = m.astype(F32), sc.astype(F32), base.astype(F32), F32(eps)
    pre = [sigmoid32(m[i] * sc[0] + base[i]) + eps for i in range(hc)]
    post = [F32(2) * sigmoid32(m[hc + i] * sc[1] + base[hc + i]) for i in range(hc)]
    comb = [[F32(0)] * hc for _ in range(hc)]
    for i in range(hc):
        row = [m[2 * hc + i * hc + j] * sc[2] + base[2 * hc + i * hc + j] for j in range(hc)]
        mx = max(row)
        e = [F32(math.exp(float(v - mx))) for v in row]
        tot = F32(0)
        for v in e:
            tot = F32(tot + v)
        for j in range(hc):
            comb[i][j] = F32(e[j] / tot + eps)
    for it in range(iters):
        if it > 0:
            for i in range(hc):
                tot = F32(0)
                for j in range(hc):
                    tot = F32(tot + comb[i][j])
                for j in range(hc):
                    comb[i][j] = F32(comb[i][j] / (tot + eps))
        for j in range(hc):
            tot = F32(0)
            for i in range(hc):
                tot = F32(tot + comb[i][j])
            for i in range(hc):
                comb[i][j] = F32(comb[i][j] / (tot + eps))
    return np.array(pre, F32), np.array(post, F32), np.array(comb, F32)


def is_prime(n):
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def engram_params(cfg):
    ng, nh = cfg["engram_max_ngram_size"], cfg["engram_n_heads"]
    cv, vs = cfg["engram_compressed_vocab_size"], cfg["engram_vocab_size"]
    seen, out = set(), []
    for L in cfg["engram_layer_ids"]:
        bound = (2 ** 63 - 1) // cv // 2
        mult = [int(v) * 2 + 1 for v in np.random.default_rng(10007 * L).integers(0, bound, ng, np.int64)]
        primes = []
        for _ in range(ng - 1):
            start = vs - 1
            for _ in range(nh):
                c = start + 1
                while not is_prime(c) or c in seen:
                    c += 1
                seen.add(c)
                primes.append(c)
                start = c
        offs = [sum(primes[:i]) for i in range(len(primes))]
        out.append((mult, primes, offs))
    return out


def forward(cfg, w, toks):
    T, H, hc = len(toks), cfg["hidden_size"], cfg["hc_mult"]
    D, nh, rd = cfg["head_dim"], cfg["num_attention_heads"], cfg["qk_rope_head_dim"]
    ih, idd = cfg["index_n_heads"], cfg["index_head_dim"]
    Wn, eps = cfg["sliding_window"], cfg["rms_norm_eps"]
    ratios, nl = cfg["compress_ratios"], cfg["num_hidden_layers"]
    kv_src, idx_src = cfg["kv_source_layer_ids"], cfg["index_source_layer_ids"]
    cand_l, bs, cand_k = cfg["candidate_source_layer_id"], cfg["candidate_block_size"], cfg["candidate_topk_blocks"]
    topk_n, k_exp = cfg["index_topk"], cfg["num_experts_per_tok"]
    pos = np.arange(T)
    fr_main, fr_comp = freqs_of(cfg, 0), freqs_of(cfg, 1)
    cv = cfg["engram_compressed_vocab_size"]
    tmap = [t % cv for t in range(cfg["vocab_size"])]
    pad = tmap[cfg.get("engram_pad_token_id", 2)]
    eg = engram_params(cfg)

    X = np.repeat(bf(w("embed.weight")[toks])[:, None, :], hc, axis=1)   # [T, hc, H]
    carry = np.zeros((T, hc), F32)
    carry[:, 0] = 1
    sel = {}        # (t, layer) -> list of entries
    last_sel = [None] * T
    last_cand = [None] * T
    routes = {}
    caches = {}

    def mixes(X, fn):
        xf = X.reshape(T, hc * H)
        rs = (1.0 / np.sqrt((xf.astype(F64) ** 2).mean(-1, keepdims=True) + eps)).astype(F32)
        return lin(xf * rs, fn)

    def collapse(X, pre):
        return bf((pre.astype(F64)[:, :, None] * X.astype(F64)).sum(1).astype(F32))

    def expand(X, out, post, comb):
        y = post.astype(F64)[:, :, None] * out.astype(F64)[:, None, :]
        y = y + np.einsum("tij,tid->tjd", comb.astype(F64), X.astype(F64))
        return bf(y.astype(F32))

    for L in range(nl):
        p = f"layers.{L}."
        if L in cfg["engram_layer_ids"]:
            slot = cfg["engram_layer_ids"].index(L)
            mult, primes, offs = eg[slot]
            ng, ehn, d = cfg["engram_max_ngram_size"], cfg["engram_n_heads"], cfg["engram_head_dim"]
            codes = np.frombuffer(w.raw[p + "engram.embed.weight"]["data"], ml_dtypes.float8_e4m3fn)
            codes = codes.astype(F32).reshape(-1, d)
            scl = np.frombuffer(w.raw[p + "engram.embed.scale"]["data"], ml_dtypes.float8_e8m0fnu)
            scl = scl.astype(F32).reshape(-1, d // 32)
            emb = np.zeros((T, (ng - 1) * ehn * d), F32)
            for t in range(T):
                cid, blocked = [], False
                for k in range(ng):
                    blocked = blocked or t - k < 0
                    cid.append(pad if blocked else tmap[toks[t - k]])
                h = cid[0] * mult[0]
                for i in range(1, ng):
                    h ^= cid[i] * mult[i]
                    for hd in range(ehn):
                        j = (i - 1) * ehn + hd
                        row = h % primes[j] + offs[j]
                        emb[t, j * d:(j + 1) * d] = codes[row] * np.repeat(scl[row], 32)
            kv = lin(emb, w(p + "engram.wkv"))
            value = kv[:, hc * H:]
            wq = (w(p + "engram.q_weight").astype(F32) * w(p + "engram.k_weight").astype(F32))
            for s in range(hc):
                x, key = X[:, s, :], kv[:, s * H:(s + 1) * H]
                sx = (x.astype(F64) ** 2).sum(-1)
                sk = (key.astype(F64) ** 2).sum(-1)
                dot = (x.astype(F64) * (wq[s].astype(F64) * key.astype(F64))).sum(-1)
                rstd = 1.0 / np.sqrt(sx / H + eps) / np.sqrt(sk / H + eps)
                g = dot * rstd / math.sqrt(H)
                for t in range(T):
                    a = max(abs(g[t]), 1e-6)
                    gate = sigmoid32(F32(math.copysign(math.sqrt(a), g[t])))
                    X[t, s] = bf(X[t, s] + gate * value[t])

        # ---- attention sublayer
        pre_a, post, comb = zip(*[hc_split(mm, w(p + "hc_attn_scale"), w(p + "hc_attn_base"), hc,
                                           cfg["hc_eps"], cfg["hc_sinkhorn_iters"])
                                  for mm in mixes(X, w(p + "hc_attn_fn"))])
        pre_a, post, comb = np.array(pre_a), np.array(post), np.array(comb)
        x = rmsnorm(collapse(X, carry), w(p + "attn_norm.weight"), eps)
        ratio = ratios[L]
        fr = fr_comp if ratio else fr_main
        qr = rmsnorm(bf(lin(x, w(p + "attn.wq_a"))), w(p + "attn.q_norm.weight"), eps)
        q = bf(rope(bf(lin(qr, w(p + "attn.wq_b"))).reshape(T, nh, D), pos[:, None], fr))
        kv = rmsnorm(bf(lin(x, w(p + "attn.wkv"))), w(p + "attn.kv_norm.weight"), eps)
        kv = fq_e4m3_pow2(bf(rope(kv, pos, fr)), 32)
        if L in kv_src:
            kvc = lin(x, w(p + "attn.compressor.wkv.weight"))
            if ratio == 2:
                sc = lin(x, w(p + "attn.compressor.wgate.weight"))
                G = T // 2
                a, b = sc[0:2 * G:2].astype(F64), sc[1:2 * G:2].astype(F64)
                m = np.maximum(a, b)
                ea, eb = np.exp(a - m), np.exp(b - m)
                lat = ((kvc[0:2 * G:2] * ea + kvc[1:2 * G:2] * eb) / (ea + eb)).astype(F32)
            else:
                G, lat = T, kvc
            lat = rmsnorm(bf(lat), w(p + "attn.compressor.norm.weight"), eps)
            gpos = np.arange(G) * ratio
            key = rmsnorm(bf(lin(lat, w(p + "attn.indexer.wk.weight"))), w(p + "attn.indexer.k_norm.weight"), eps)
            key = fq_e2m1_pow2(bf(rope(key, gpos, fr_comp)), 32)
            ent = fq_e2m1_e4m3(bf(rope(lat, gpos, fr_comp)), 16)
            caches[L] = (ent, key)
        src = max([s for s in kv_src if s <= L], default=-1) if ratio else -1
        if ratio and L in idx_src:
            ent, key = caches[src]
            qi = bf(lin(qr, w(p + "attn.indexer.wq_b"))).reshape(T, ih, idd)
            qi = fq_e2m1_pow2(bf(rope(qi, pos[:, None], fr_comp)), 32)
            wscale = F32(1.0 / math.sqrt(idd) / math.sqrt(ih))
            wts = bf(lin(x, w(p + "attn.indexer.weights_proj.weight"))) * wscale
            for t in range(T):
                nv = (t + 1) // ratio
                if nv == 0:
                    last_sel[t] = (src, [])
                    continue
                dots = (qi[t].astype(F64) @ key[:nv].T.astype(F64)).astype(F32)   # [ih, nv]
                contrib = (wts[t][:, None] * np.maximum(dots, F32(0))).astype(F64)
                score = contrib.sum(0).astype(F32).astype(F64)
                if L == cand_l:
                    nb = (nv + bs - 1) // bs
                    bsc = [max(score[b * bs:min((b + 1) * bs, nv)]) for b in range(nb)]
                    bsc[(nv - 1) // bs] = math.inf
                    order = sorted(range(nb), key=lambda b: (-bsc[b], b))[:min(cand_k, nb)]
                    last_cand[t] = (src, sorted(b for b in order if bsc[b] != -math.inf))
                elif 0 <= cand_l < L and last_cand[t] and last_cand[t][0] == src:
                    keep = set(last_cand[t][1])
                    score = np.array([score[j] if j // bs in keep else -math.inf for j in range(nv)])
                k = min(topk_n, nv)
                order = sorted(range(nv), key=lambda j: (-score[j], j))[:k]
                last_sel[t] = (src, sorted(j for j in order if score[j] != -math.inf))
        attn = np.zeros((T, nh, D), F32)
        sink = w(p + "attn.attn_sink")
        for t in range(T):
            keys = [kv[j] for j in range(max(0, t - Wn + 1), t + 1)]
            entries = []
            if ratio and last_sel[t] and last_sel[t][0] == src:
                entries = last_sel[t][1]
                keys += [caches[src][0][j] for j in entries]
            if ratio:
                sel[(t, L)] = entries
            K = np.array(keys, F64)
            s = (q[t].astype(F64) @ K.T) / math.sqrt(D)   # [nh, n]
            mx = np.maximum(s.max(-1), sink)
            e = np.exp(s - mx[:, None])
            den = e.sum(-1) + np.exp(sink - mx)
            attn[t] = bf(((e @ K) / den[:, None]).astype(F32))
        attn = bf(rope(attn, pos[:, None], fr, inverse=True))
        G_, R = cfg["o_groups"], cfg["o_lora_rank"]
        gs = nh * D // G_
        wo_a = w(p + "attn.wo_a")
        flat = attn.reshape(T, nh * D)
        z = np.concatenate([lin(flat[:, g * gs:(g + 1) * gs], wo_a[g * R:(g + 1) * R]) for g in range(G_)], 1)
        out = bf(lin(bf(z), w(p + "attn.wo_b")))
        X = expand(X, out, post, comb)

        # ---- MoE sublayer
        pre_f, post, comb = zip(*[hc_split(mm, w(p + "hc_ffn_scale"), w(p + "hc_ffn_base"), hc,
                                           cfg["hc_eps"], cfg["hc_sinkhorn_iters"])
                                  for mm in mixes(X, w(p + "hc_ffn_fn"))])
        pre_f, post, comb = np.array(pre_f), np.array(post), np.array(comb)
        x = rmsnorm(collapse(X, pre_a), w(p + "ffn_norm.weight"), eps)
        logits = lin(x, w(p + "ffn.gate.weight"))
        bias = w(p + "ffn.gate.bias").astype(F32)
        lim = F32(cfg["swiglu_limit"])

        def expert(base, weight, x):
            g, u = bf(lin(x, w(base + ".w1"))), bf(lin(x, w(base + ".w3")))
            u, g = np.clip(u, -lim, lim), np.minimum(g, lim)
            silu = (g.astype(F64) / (1 + np.exp(-g.astype(F64)))).astype(F32)
            return bf(lin(bf(F32(weight) * (silu * u)), w(base + ".w2")))

        out = np.zeros((T, H), F32)
        for t in range(T):
            sp = np.array([F32(v) if v > 20 else F32(math.log1p(math.exp(float(v)))) for v in logits[t]], F32)
            s = np.sqrt(sp)
            order = sorted(range(len(s)), key=lambda e: (-(s[e] + bias[e]), e))[:k_exp]
            routes[(t, L)] = order
            denom = F32(sum(float(s[e]) for e in order)) + F32(1e-20)
            acc = np.zeros(H, F64)
            for e in order:
                acc += expert(p + f"ffn.experts.{e}", s[e] / denom * F32(cfg["routed_scaling_factor"]), x[t:t + 1])[0]
            acc += expert(p + "ffn.shared_experts", 1.0, x[t:t + 1])[0]
            out[t] = bf(acc.astype(F32))
        X = expand(X, out, post, comb)
        carry = pre_f
    h = rmsnorm(collapse(X, carry), w("norm.weight"), eps)
    return lin(h, w("head.weight")), routes, sel


def main():
    shutil.rmtree(TMP, ignore_errors=True)
    subprocess.run([BIN, "gen", "--preset", "tiny", "--out", TMP, "--seed", "5", "--quiet"], check=True)
    cfg, raw = load(TMP)
    w = W(raw, cfg["quantization_config"]["weight_block_size"][0], cfg["quantization_config"]["weight_block_size"][1])
    T = 44   # 2.75 windows; 22 ratio-2 and 44 ratio-1 entries (11 blocks > 8 candidate blocks)
    toks = [(i * 131 + 7 * (i % 5) + 3) % cfg["vocab_size"] for i in range(T)]
    prefix = os.path.join(TMP, "out")
    subprocess.run([os.path.join(BUILD, "ref_tool"), TMP, ",".join(map(str, toks)), prefix], check=True)
    c_logits = np.fromfile(prefix + ".logits", F32).reshape(T, -1)
    nl, k = cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
    c_routes = np.fromfile(prefix + ".routes", np.int32).reshape(T, nl, k)
    c_sel = np.fromfile(prefix + ".select", np.int32).reshape(T, nl, cfg["index_topk"])
    py_logits, routes, sel = forward(cfg, w, toks)
    scale = np.abs(py_logits).max()
    rel = np.abs(py_logits.astype(F64) - c_logits).max() / scale
    n_route = sum(list(c_routes[t, L]) == routes[(t, L)] for t in range(T) for L in range(nl))
    n_sel = sum([int(v) for v in c_sel[t, L] if v >= 0] == sel[(t, L)] for (t, L) in sel)
    print(f"check_ref: {T} positions, logits max |C - numpy| / max |logit| = {rel:.3g}; routes equal "
          f"{n_route}/{T * nl}; selections equal {n_sel}/{len(sel)}")
    if not rel < 1e-4:
        fail(f"logits differ by {rel:.3g} relative (tolerance 1e-4)")
    if n_route != T * nl:
        fail(f"{T * nl - n_route} routing decisions differ")
    if n_sel != len(sel):
        fail(f"{len(sel) - n_sel} selections differ")
    if max(len(v) for v in sel.values()) != cfg["index_topk"]:
        fail("no position selected index_topk entries: the sequence is too short to test selection")
    shutil.rmtree(TMP, ignore_errors=True)
    if FAILURES:
        print(f"check_ref: {len(FAILURES)} mismatches", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
