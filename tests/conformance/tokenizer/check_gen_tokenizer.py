"""The tokenizer.json that `moeflow gen` writes for synthetic models, checked against the
`tokenizers` package: it loads there, has exactly the config's vocabulary, and moeflow's encode and
decode (through $MOEFLOW_BUILD/tok_tool) equal tokenizers' on a text set and on random id lists.
Exits non-zero on any difference."""
import json
import os
import random
import subprocess
import sys
import tempfile

from tokenizers import Tokenizer

BUILD = os.environ.get("MOEFLOW_BUILD", "build")
MOEFLOW = os.path.join(BUILD, "moeflow")
TOOL = os.path.join(BUILD, "tok_tool")


def run(*args):
    p = subprocess.run(list(args), capture_output=True)
    if p.returncode != 0:
        sys.exit(f"check_gen_tokenizer: {' '.join(args)} failed ({p.returncode}): "
                 f"{p.stderr.decode(errors='replace')}")
    return p.stdout.decode("utf-8").split("\n")[:-1]


def main():
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "tiny")
        run(MOEFLOW, "gen", "--preset", "tiny", "--out", ckpt, "--quiet")
        path = os.path.join(ckpt, "tokenizer.json")
        config = json.load(open(os.path.join(ckpt, "config.json")))
        tok = Tokenizer.from_file(path)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        if vocab != config["vocab_size"]:
            print(f"vocab: tokenizers sees {vocab}, config says {config['vocab_size']}")
            failures += 1
        r = random.Random(7)
        words = ["the", "cat", "sat", "on", "mat", "tea", "eat", "note", "stone", "zebra", "Quick"]
        lines = ["the cat sat on the mat", "  two  spaces\tand a tab\n", "digits 12345 and 7",
                 "caf\u00e9 \u00fcber na\u00efve", "\u4f60\u597d\u4e16\u754c", "emoji \U0001F600!",
                 "<\uff5cbegin\u2581of\u2581sentence\uff5c>hello<\uff5cend\u2581of\u2581sentence\uff5c>"]
        for _ in range(300):
            lines.append(" ".join(r.choice(words) for _ in range(r.randint(1, 12))))
        texts = os.path.join(tmp, "texts.jsonl")
        with open(texts, "w", encoding="utf-8") as f:
            for s in lines:
                f.write(json.dumps(s) + "\n")
        got = run(TOOL, "encode", path, texts)
        for s, g in zip(lines, got):
            want = " ".join(map(str, tok.encode(s, add_special_tokens=False).ids))
            if g != want:
                failures += 1
                if failures <= 5:
                    print(f"encode {s!r}: moeflow [{g}] tokenizers [{want}]")
        id_lists = [[r.randrange(vocab) for _ in range(r.randint(1, 20))] for _ in range(300)]
        ids_path = os.path.join(tmp, "ids.txt")
        with open(ids_path, "w") as f:
            for ids in id_lists:
                f.write(" ".join(map(str, ids)) + "\n")
        got = run(TOOL, "decode", path, ids_path, "skip")
        for ids, g in zip(id_lists, got):
            want = tok.decode(ids, skip_special_tokens=True)
            if json.loads(g) != want:
                failures += 1
                if failures <= 10:
                    print(f"decode {ids}: moeflow {g} tokenizers {want}")
        print(f"check_gen_tokenizer: vocab {vocab}, {len(lines)} encodes, {len(id_lists)} decodes, "
              f"{failures} differences")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
