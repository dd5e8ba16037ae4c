"""moeflow's DSpark draft (graphs/layers/layer_dspark.c through graphs/ref/ref_dspark.c, driven by
$MOEFLOW_BUILD/dspark_tool) against NeMo AutoModel 0.7.0's deepseek_v41/dspark.py on CPU, on the
tiny preset's draft (3 stages, block 5, 8 experts top-2, Markov rank 32) written by `moeflow gen`
and randomized as tests/conformance/model's cases are (norms, sinks, biases, hyper-connection
bases, head rows of log-normal scale). docs/dspark.md states what is compared and the measured
margins.

Per case, over a 64-token prompt:
- The features: the mean of the streams entering layers dspark_target_layer_ids, which NeMo's
  DSpark target wrapper captures at each layer's attn_hc input (the model's
  get_dspark_target_feature_modules) and averages over the streams. NeMo runs the backbone twice,
  following moeflow's discrete history (check_model.nemo_run): "NeMo-HF" (rounding at the HF
  port's places, check_model.HfRounding) is the oracle, "NeMo-REF" (as shipped) measures what a
  legitimate rounding choice moves. moeflow's worst per-position max|d|/max|f| against NeMo-HF may
  be LOGIT_FACTOR times NeMo-REF's, or the floor.
- The draft, at anchors ANCHORS (moeflow feeds one state forward and rolls it back between
  them): NeMo's DeepseekV41DSparkModel, loaded from the same checkpoint by its own adapter, runs
  its backbone forward on moeflow's features (rounded to bf16, as its target wrapper hands them
  over) for all anchors at once, with the noise embeddings, positions and window mask it builds
  itself, previous tokens = the anchor and moeflow's candidates, and each stage's router taking
  moeflow's experts where its own pick differs (recorded). Draft logits (its head on the normed
  states + the Markov head's), confidence logits: moeflow's worst against NeMo-HF at most
  LOGIT_FACTOR (CONF_FACTOR) times NeMo-REF's, or the floor; candidates: NeMo-HF's argmax at each
  block position must be moeflow's candidate unless NeMo-HF's margin between the two is within
  the tie band (twice the admitted logit difference); routes: moeflow's far choices (trailing
  NeMo's by more than NEAR of the row's scale) at most FAR_FACTOR x NeMo-REF's + FAR_SLACK.

`--self-test` changes one thing in both NeMo runs (MUTATIONS) and requires the check to fail for
each. Run by tests/conformance/run.sh in its torch venv; exits non-zero on any failure."""
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model"))
import check_model as cm  # noqa: E402  (also silences the libraries' warnings)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from nemo_automodel.components.models.common import BackendConfig  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.dspark import (  # noqa: E402
    DeepseekV41DSparkBackbone, DeepseekV41DSparkModel)
from nemo_automodel.components.speculative.dspark.common import create_noise_embed  # noqa: E402

BUILD = cm.BUILD
N_TOKENS = 64
ANCHORS = [9, 24, 22, 40, 63]   # 24 -> 22: the state rolled back two positions
LOGIT_FACTOR = cm.LOGIT_FACTOR
CONF_FACTOR = 1.5
NEAR, FAR_FACTOR, FAR_SLACK = cm.NEAR, cm.FAR_FACTOR, cm.FAR_SLACK
# name, window, floors of the feature, logit and confidence tolerances (max|d| / max|x|; the
# confidence: absolute)
CASES = [
    ("tiny (Engram at 1 and 3, window 16)", None, 1e-2, 1e-2, 2e-2),
    ("tiny, window 8", 8, 1e-2, 1e-2, 2e-2),
]
MUTATIONS = ("no-markov", "window+1", "no-main-norm", "no-sink", "anchor-as-noise", "confidence-no-markov",
             "features-at-output", "no-route-bias")


def moeflow_run(d, ids, out):
    cm.run(os.path.join(BUILD, "dspark_tool"), d, ",".join(map(str, ids)), ",".join(map(str, ANCHORS)), out)
    c = json.load(open(os.path.join(d, "config.json")))
    T, L, A = len(ids), c["num_hidden_layers"], len(ANCHORS)
    B, S, K = c["dspark_block_size"], c["num_nextn_predict_layers"], c["dspark_num_experts_per_tok"]
    f = lambda ext, dt: np.fromfile(f"{out}.{ext}", dt)  # noqa: E731
    return {"feats": f("feats", np.float32).reshape(T, -1),
            "routes": f("routes", np.int32).reshape(T, L, -1),
            "select": f("select", np.int32).reshape(T, L, -1),
            "cand": f("cand", np.int32).reshape(T, -1) if os.path.exists(out + ".cand") else None,
            "tokens": f("draft_tokens", np.int32).reshape(A, B),
            "conf": f("draft_conf", np.float32).reshape(A, B),
            "logits": f("draft_logits", np.float32).reshape(A, B, -1),
            "droutes": f("draft_routes", np.int32).reshape(A, S, B, K)}


def nemo_features(model, c, ids, mf, at_output=False):
    """NeMo's backbone over ids following moeflow's history; the features of every position
    ([T, n_target x hidden], float32 of NeMo's bf16): each target layer's attn_hc input (at_output:
    the layer's output instead, the HF hidden-state convention: a self-test mutation) averaged
    over the streams, as NeMo's DSpark target wrapper does."""
    got, hooks = {}, []
    layers = c["dspark_target_layer_ids"]
    for L in layers:
        y = model.model.layers[str(L)]
        if at_output:
            hooks.append(y.register_forward_hook(
                lambda mod, a, out, L=L: got.__setitem__(L, (out[0] if isinstance(out, tuple) else out).detach())))
        else:
            hooks.append(y.attn_hc.register_forward_pre_hook(lambda mod, a, L=L: got.__setitem__(L, a[0].detach())))
    try:
        cm.nemo_run(model, c, ids, mf["routes"], mf["select"], mf["cand"])
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[L].mean(dim=2) for L in layers], dim=-1)[0].float().numpy()


def draft_load(d, c):
    text = {k: v for k, v in c.items() if k not in ("architectures", "model_type", "quantization_config")}
    if text.get("candidate_source_layer_id") is None:
        text["candidate_source_layer_id"] = -1
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch",
                            dispatcher="torch", enable_hf_state_dict_adapter=True)
    dm = DeepseekV41DSparkModel(DeepseekV41TextConfig(**text), backend, num_anchors=len(ANCHORS),
                                enable_confidence_head=True)
    sd = {}
    for f in sorted(glob.glob(os.path.join(d, "model-*.safetensors"))):
        sd.update({k: v for k, v in load_file(f).items()
                   if k.startswith("mtp.") or k in ("embed.weight", "head.weight")})
    dm.load_state_dict(dm.state_dict_adapter.from_hf(sd), strict=True)
    return dm.eval()


def nemo_draft(dm, ids, feats, mf):
    """NeMo's draft at every anchor on the features feats [T, n_target x hidden], previous tokens
    the anchor and moeflow's candidates, moeflow's experts imposed where NeMo picks others.
    Returns draft logits [A, B, V], confidence logits [A, B] and per stage (scores [A x B, E],
    NeMo's picks, moeflow's picks)."""
    cfg, A = dm.config, len(ANCHORS)
    B, S, T = cfg.dspark_block_size, cfg.num_nextn_predict_layers, len(ids)
    anchors = torch.tensor([ANCHORS])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    input_ids = torch.tensor([ids])
    decisions = {}
    for s in range(S):
        gate = dm.mtp[s].ffn.gate
        orig = gate._route_scores
        want = torch.as_tensor(mf["droutes"][:, s].reshape(A * B, -1))

        def f(scores, s=s, gate=gate, orig=orig, want=want):
            w, idx, sc = orig(scores)
            score = torch.sqrt(torch.nn.functional.softplus(scores.float()))
            biased = score + gate.e_score_correction_bias.float()
            decisions[s] = (biased.numpy(), idx.tolist(), want.tolist())
            differ = [t for t in range(A * B) if set(idx[t].tolist()) != set(want[t].tolist())]
            if differ:
                idx = idx.clone()
                idx[differ] = want[differ].to(idx.dtype)
                w2 = score.gather(1, idx.long())
                w2 = w2 / (w2.sum(-1, keepdim=True) + 1e-20) * gate.route_scale
                w = w.clone()
                w[differ] = w2[differ].to(w.dtype)
            return w, idx, sc
        gate._route_scores = f
    try:
        with torch.no_grad():
            noise = create_noise_embed(dm.embed_tokens, input_ids, anchors, keep, mask_token_id=cfg.dspark_noise_token_id,
                                       block_size=B)
            prev = np.concatenate([np.array(ANCHORS)[:, None] * 0 + np.array(ids)[ANCHORS][:, None],
                                   mf["tokens"][:, :-1]], axis=1)
            out = DeepseekV41DSparkBackbone.forward(
                dm, noise, torch.as_tensor(feats, dtype=torch.bfloat16)[None],
                position_ids=dm.build_position_ids(anchors, T),
                attention_mask=dm.build_attention_mask(anchors, keep, T, noise.dtype),
                previous_token_ids=torch.as_tensor(prev.reshape(1, -1), dtype=torch.long))
            logits = dm.compute_logits(out.normalized_hidden_states) + out.transition_logits.float()
    finally:
        for s in range(S):
            del dm.mtp[s].ffn.gate._route_scores
    return (logits[0].reshape(A, B, -1).numpy(), out.confidence_pred[0].reshape(A, B).numpy(),
            [decisions[s] for s in range(S)])


def mutate(model, dm, name):
    """Self-test: one change in NeMo's runs (the backbone model or the draft dm) that a bug in
    moeflow would amount to. Returns the undo."""
    undo = []

    def set_undo(obj, attr, value):
        undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)
    last = dm.mtp[-1]
    if name == "no-markov":
        real = last.markov_head.forward
        set_undo(last.markov_head, "forward", lambda t: (lambda lg, e: (torch.zeros_like(lg), e))(*real(t)))
    elif name == "window+1":
        set_undo(dm.config, "sliding_window", dm.config.sliding_window + 1)
    elif name == "no-main-norm":
        set_undo(dm.mtp[0], "main_norm", torch.nn.Identity())
    elif name == "no-sink":
        for y in dm.mtp:
            w = y.attn.sinks_param.weight
            undo.append((w, "data", w.data))
            w.data = torch.zeros_like(w.data)
    elif name == "anchor-as-noise":   # the block's first slot the noise token, not the anchor
        real = create_noise_embed

        def noise(emb, ids, anchors, keep, **kw):
            return real(emb, ids, anchors, torch.zeros_like(keep), **kw)
        set_undo(sys.modules[__name__], "create_noise_embed", noise)
    elif name == "confidence-no-markov":
        real = last.confidence_head.forward
        set_undo(last.confidence_head, "forward", lambda h, e: real(h, torch.zeros_like(e)))
    elif name == "features-at-output":
        set_undo(sys.modules[__name__], "FEATURES_AT_OUTPUT", True)
    elif name == "no-route-bias":
        for y in dm.mtp:
            b = y.ffn.gate.e_score_correction_bias
            undo.append((b, "data", b.data))
            b.data = torch.zeros_like(b.data)
    else:
        raise ValueError(name)

    def restore():
        for obj, attr, value in reversed(undo):
            setattr(obj, attr, value)
    return restore


FEATURES_AT_OUTPUT = False


def rel_rows(a, b):
    """max|a - b| / max|b| over the last axis, per row."""
    return np.abs(a - b).max(-1) / np.maximum(np.abs(b).max(-1), 1e-30)


def route_far(dec, picks):
    """Far (and masked) choices of picks under NeMo-HF's decisions dec (per stage)."""
    far = 0
    for s, (scores, own, _) in enumerate(dec):
        for t in range(len(own)):
            cls, gap = cm.classify(scores[t], own[t], picks[s][t])
            far += cls == "mismatch"
    return far


def compare(name, mf, hf, ref, floors):
    """The four comparisons of one case; returns the set of those that failed."""
    f_floor, l_floor, c_floor = floors
    failed = set()
    # features
    mrel, nrel = rel_rows(mf["feats"], hf["feats"]), rel_rows(ref["feats"], hf["feats"])
    lim = max(LOGIT_FACTOR * nrel.max(), f_floor)
    print(f"  features: moeflow vs NeMo-HF worst {mrel.max():.2e} (position {int(mrel.argmax())}), "
          f"NeMo-REF {nrel.max():.2e}; limit {lim:.2e}: moeflow at {mrel.max() / lim:.2f}")
    if mrel.max() > lim:
        failed.add("features")
        print(f"  FAIL features: {mrel.max():.2e} > {lim:.2e}")
    # draft logits
    mrel, nrel = rel_rows(mf["logits"], hf["logits"]), rel_rows(ref["logits"], hf["logits"])
    lim = max(LOGIT_FACTOR * nrel.max(), l_floor)
    at = np.unravel_index(int(mrel.argmax()), mrel.shape)
    print(f"  draft logits: moeflow vs NeMo-HF worst {mrel.max():.2e} (anchor {ANCHORS[at[0]]}, slot {at[1]}), "
          f"median {np.median(mrel):.2e}, NeMo-REF {nrel.max():.2e}; limit {lim:.2e}: moeflow at "
          f"{mrel.max() / lim:.2f}")
    if mrel.max() > lim:
        failed.add("logits")
        print(f"  FAIL draft logits: {mrel.max():.2e} > {lim:.2e}")
    # candidates: NeMo-HF's argmax (with moeflow's previous tokens) against moeflow's
    equal = near = bad = 0
    for a in range(len(ANCHORS)):
        for i in range(mf["tokens"].shape[1]):
            row, g = hf["logits"][a, i], int(mf["tokens"][a, i])
            top = int(row.argmax())
            band = 2 * lim * float(np.abs(row).max())
            if top == g:
                equal += 1
            elif row[top] - row[g] <= band:
                near += 1
            else:
                bad += 1
                print(f"  FAIL candidates: anchor {ANCHORS[a]} slot {i}: NeMo-HF's argmax {top}, moeflow's {g} "
                      f"(margin {row[top] - row[g]:.3e} > band {band:.3e})")
    print(f"  candidates: {equal} equal, {near} near ties, {bad} mismatches of {equal + near + bad}: "
          f"moeflow {mf['tokens'].tolist()}")
    if bad:
        failed.add("candidates")
    # confidence logits (absolute)
    md, nd = np.abs(mf["conf"] - hf["conf"]).max(), np.abs(ref["conf"] - hf["conf"]).max()
    lim = max(CONF_FACTOR * nd, c_floor)
    print(f"  confidence logits: moeflow vs NeMo-HF worst |d| {md:.2e}, NeMo-REF {nd:.2e}; limit {lim:.2e}: "
          f"moeflow at {md / lim:.2f} (moeflow {np.round(mf['conf'][0], 3).tolist()} at anchor {ANCHORS[0]})")
    if md > lim:
        failed.add("confidence")
        print(f"  FAIL confidence: {md:.2e} > {lim:.2e}")
    # the draft's routes
    m_far = route_far(hf["dec"], [d[2] for d in hf["dec"]])
    n_far = route_far(hf["dec"], [d[1] for d in ref["dec"]])
    differ = sum(set(a) != set(b) for d in hf["dec"] for a, b in zip(d[1], d[2]))
    print(f"  draft routes: {differ} of {sum(len(d[1]) for d in hf['dec'])} differ from NeMo-HF's own picks, "
          f"{m_far} far (NeMo-REF: {n_far}; allowed {FAR_FACTOR * n_far + FAR_SLACK})")
    if m_far > FAR_FACTOR * n_far + FAR_SLACK:
        failed.add("routes")
    return failed


def check(mutation=None, seed=41):
    moeflow = os.path.join(BUILD, "moeflow")
    rng = np.random.default_rng(seed)
    failed = set()
    with tempfile.TemporaryDirectory(dir=os.environ.get("MOEFLOW_TMP")) as tmp:
        tiny = os.path.join(tmp, "tiny")
        cm.run(moeflow, "gen", "--preset", "tiny", "--out", tiny, "--quiet")
        vocab = json.load(open(os.path.join(tiny, "config.json")))["vocab_size"]
        ids = rng.integers(3, vocab, N_TOKENS).tolist()
        ids[40:48] = ids[8:16]
        for n, (name, window, *floors) in enumerate(CASES):
            d = os.path.join(tmp, f"case{n}")
            cm.make_case(tiny, d, None, True, window)
            model, c, _ = cm.nemo_load(d)
            dm = draft_load(d, c)
            mf = moeflow_run(d, ids, os.path.join(tmp, f"mf{n}"))
            restore = mutate(model, dm, mutation) if mutation else (lambda: None)
            try:
                runs = []
                for hf_rounding in (True, False):
                    with cm.HfRounding() if hf_rounding else open(os.devnull):
                        feats = nemo_features(model, c, ids, mf, FEATURES_AT_OUTPUT)
                        logits, conf, dec = nemo_draft(dm, ids, mf["feats"], mf)
                    runs.append({"feats": feats, "logits": logits, "conf": conf, "dec": dec})
            finally:
                restore()
            print(f"--- {name}{' (mutated: ' + mutation + ')' if mutation else ''}: draft of "
                  f"{c['num_nextn_predict_layers']} stages, block {c['dspark_block_size']}, target layers "
                  f"{c['dspark_target_layer_ids']}, window {c['sliding_window']}, anchors {ANCHORS}")
            bad = compare(name, mf, runs[0], runs[1], floors)
            failed |= {f"{name}: {b}" for b in bad}
    return failed


def main():
    if sys.argv[1:] == ["--self-test"]:
        ok = True
        for mutation in MUTATIONS:
            print(f"=== self-test: NeMo mutated by {mutation}; the check must fail")
            failed = check(mutation)
            print(f"=== self-test: {mutation}: " + ("caught by " + "; ".join(sorted(failed)) if failed else "NOT CAUGHT"))
            ok &= bool(failed)
        print("check_dspark self-test:", "PASS" if ok else "FAIL")
        return 0 if ok else 1
    if sys.argv[1:]:
        sys.exit("usage: check_dspark.py [--self-test]")
    failed = check()
    print("check_dspark:", "FAIL " + "; ".join(sorted(failed)) if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
