#!/usr/bin/env python3
"""lm-evaluation-harness (PyPI lm_eval) against `moeflow serve`: its `local-completions` model scores
a small multiple-choice task kept in the repo (tests/py/lm_eval/moeflow_mc.jsonl, loaded by the
`datasets` json builder from disk: no download) by loglikelihood, which needs `echo` with `logprobs`
on /v1/completions. Each choice's loglikelihood that lm_eval reports must equal, within 1e-4, the
sum over the continuation's tokens of the log-softmax of moeflow's own logits for the same token
ids, computed by $MOEFLOW_BUILD/ref_tool on the scheduled engine (one prefill; not by the server).
The token ids are lm_eval's own (its _encode_pair with the checkpoint's tokenizer through
transformers). A tiny checkpoint on 127.0.0.1, a free port. Exits non-zero on any mismatch."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import lm_eval  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

BIN = os.environ.get("MOEFLOW_BIN", "build/moeflow")
BUILD = os.environ.get("MOEFLOW_BUILD", "build")
TMP = os.path.join(os.environ.get("MOEFLOW_TMP", "/tmp"), f"check_lm_eval_{os.getpid()}")
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval", "moeflow_mc.jsonl")


def log_softmax_rows(logits):
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def reference(ckpt, ids, vocab, tmp):
    """log-softmax of ref_tool's logits (scheduled engine, one prefill) at every position."""
    out = os.path.join(tmp, "ref")
    subprocess.run([os.path.join(BUILD, "ref_tool"), ckpt, ",".join(map(str, ids)), out, "0", "tok", "0", "step"],
                   check=True, stdout=subprocess.DEVNULL)
    lg = np.fromfile(out + ".logits", dtype=np.float32).reshape(len(ids), vocab)
    return log_softmax_rows(lg)


def main():
    os.makedirs(TMP, exist_ok=True)
    ckpt = os.path.join(TMP, "tiny")
    subprocess.run([BIN, "gen", "--preset", "tiny", "--out", ckpt, "--quiet"], check=True)
    vocab = json.load(open(os.path.join(ckpt, "config.json")))["vocab_size"]
    # the tokenizer alone (transformers' AutoTokenizer would read config.json as a model config)
    tokdir = os.path.join(TMP, "tokenizer")
    os.makedirs(tokdir, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ckpt, f), tokdir)
    srv = subprocess.Popen([BIN, "serve", "--checkpoint", ckpt, "--host", "127.0.0.1", "--port", "0", "--threads", "2",
                            "--quiet"], stderr=subprocess.PIPE, text=True)
    port = None
    for line in srv.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    threading.Thread(target=lambda: [None for _ in srv.stderr], daemon=True).start()
    failures = []
    try:
        if port is None:
            sys.exit("check_lm_eval: the server did not start")
        task_dir = tempfile.mkdtemp(dir=TMP)
        with open(os.path.join(task_dir, "moeflow_mc.yaml"), "w") as f:
            f.write(f"""task: moeflow_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
        lm = get_model("local-completions")(model="tiny", base_url=f"http://127.0.0.1:{port}/v1/completions",
                                            tokenizer=tokdir, tokenizer_backend="huggingface", tokenized_requests=True,
                                            num_concurrent=1, max_retries=1, batch_size=1)
        res = lm_eval.simple_evaluate(model=lm, tasks=["moeflow_mc"], task_manager=TaskManager(include_path=task_dir),
                                      log_samples=True, bootstrap_iters=0)
        samples = res["samples"]["moeflow_mc"]
        n = 0
        worst = 0.0
        for s in samples:
            for (context, continuation), resp in zip(s["arguments"], s["resps"]):
                ll = float(resp[0][0])
                ctx_enc, cont_enc = lm._encode_pair(context, continuation)
                whole = ctx_enc + cont_enc
                lsm = reference(ckpt, whole, vocab, task_dir)
                want = sum(lsm[i - 1, whole[i]] for i in range(len(ctx_enc), len(whole)))
                worst = max(worst, abs(ll - want))
                n += 1
                if abs(ll - want) > 1e-4:
                    failures.append(f"{context!r} + {continuation!r}: lm_eval {ll} vs moeflow's logits {want}")
        acc = res["results"]["moeflow_mc"].get("acc,none")
        print(f"check_lm_eval: {len(samples)} questions, {n} choices scored through lm_eval local-completions; "
              f"worst |loglikelihood - reference| {worst:.2e}; acc {acc}")
        if n != sum(len(json.loads(l)["choices"]) for l in open(DATA)):
            failures.append(f"{n} choices scored")
    finally:
        srv.terminate()
        srv.wait(timeout=30)
    for f in failures:
        print("MISMATCH:", f, file=sys.stderr)
    print(f"check_lm_eval: {'FAILED' if failures else 'ok'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
