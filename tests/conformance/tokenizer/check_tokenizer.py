#!/usr/bin/env python3
"""Tokenizer conformance against the `tokenizers` package (Hugging Face).

Trains three small byte-level BPE tokenizers on a generated multilingual text set (CJK, accents,
emoji, whitespace runs, tabs/newlines, digits of many lengths, code, special tokens):
  deepseek  DeepSeek-V3/V4 pre-tokenizer: Split \\p{N}{1,3}, Split CJK, Split main pattern (all
            Isolated), ByteLevel(add_prefix_space=False, use_regex=False); an empty normalizer
            Sequence and a BOS post-processor as DeepSeek's file has; special tokens
            <｜begin▁of▁sentence｜> etc.; merges also rewritten in the old "a b" string form
  gpt2      NFC normalizer, ByteLevel(add_prefix_space=True, use_regex=True), single_word and
            normalized added tokens
  splits    NFKC, Split with Removed / MergedWithPrevious (literal) / MergedWithNext /
            Contiguous / inverted Isolated, then ByteLevel(use_regex=True); ignore_merges
then checks on a held-out text set that moeflow (through $MOEFLOW_BUILD/tok_tool) encodes
exactly as encode(text, add_special_tokens=False), decodes exactly as decode(ids) with and without
skip_special_tokens (also random id sequences, which produce invalid UTF-8), builds the same
Engram token map as the reference CompressedTokenizer, and normalizes text as its normalizer.
Exits non-zero on any mismatch, printing the first few."""
import json
import os
import random
import subprocess
import sys
import tempfile
import unicodedata

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

BUILD = os.environ.get("MOEFLOW_BUILD", "build")
TOOL = os.path.join(BUILD, "tok_tool")
SHOW = 5

# DeepSeek-V3 tokenizer.json pre_tokenizer patterns, as the released file has them.
DS_DIGITS = r"\p{N}{1,3}"
DS_CJK = "[一-龥\u3040-ゟ゠-ヿ]+"
DS_MAIN = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
           "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")

DS_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
              "<|EOT|>", "<｜fim▁hole｜>"]

# ---- the text set ---------------------------------------------------------------------------

WORDS = {
    "en": "the quick brown fox jumps over lazy dog while model tokens are merged by rank and "
          "every byte has its own symbol in the alphabet we test whitespace digits code".split(),
    "fr": "le café où l'élève a déjà façonné une île naïve Noël crème brûlée été hôtel".split(),
    "de": "Größe Straße Übermaß schön Äpfel Öl für Mädchen Fußgänger heißt".split(),
    "es": "niño mañana canción árbol pingüino corazón acción también".split(),
    "ru": "привет мир Ёлка съешь ещё этих мягких французских булок".split(),
    "el": "Καλημέρα κόσμε ΣΟΦΙΑ σοφός Ωραία άνθρωποι".split(),
    "zh": "我们 今天 学习 自然语言处理 中文分词 模型 数据 你好世界 龍 龥".split(),
    "ja": "こんにちは カタカナ ひらがな 日本語 東京タワー テスト ゟ ヿ".split(),
    "ko": "안녕하세요 세계 한국어 토크나이저".split(),
    "ar": "مرحبا بالعالم اللغة العربية".split(),
    "hi": "नमस्ते दुनिया हिन्दी भाषा".split(),
    "vi": "Tiếng Việt người đẹp trường".split(),
    "tr": "İstanbul ılık ŞİŞLİ çığ".split(),
}
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "🚀", "🤖", "✨", "🎉🎉", "🧑🏿‍💻"]
ODD = ["\u00a0", "\u3000", "\u2028", "\u0085", "\u200b", "\u200d", "ﬁ", "ℌ", "①", "Ⅻ", "²",
       "½", "ｆｕｌｌ", "ｗｉｄｔｈ１２３", "e\u0301", "A\u030a", "\u1e9b\u0323", "𝐀𝐁𝐂", "℃",
       "Å", "ǅ", "ß", "ẞ", "\u0130", "'s", "'ll", "'RE", "\x0b", "\x0c", "\x1c", "~~", "--"]
CODE = [
    "def f(x):\n    return x**2 + 1\n",
    "for (int i = 0; i < n; i++) {\n\tsum += a[i];\n}\n",
    "if x != None and y >= 10:\n        print(f\"{x!r}\")",
    "#include <stdio.h>\r\nint main(void) { return 0; }\r\n",
    "SELECT id, name FROM users WHERE age > 42;",
    "    \t  indented\t\ttabs   and    runs",
    "x = [1, 22, 333, 4444, 55555, 666666]  # digits",
    "http://example.com/path?q=1&r=2#frag",
    "a+=b;c-=d;e*=f;g/=h; // ops",
    "λx.x → ∀y∃z (y ≠ z) ∧ ¬p",
]


def rand_number(r):
    n = r.choice([1, 2, 3, 4, 5, 6, 7, 9, 12, 16, 20])
    s = "".join(r.choice("0123456789") for _ in range(n))
    if r.random() < 0.2:
        s += r.choice([".", ",", "e-", "%"]) + str(r.randint(0, 99999))
    if r.random() < 0.1:
        s = "".join(chr(ord(c) - ord("0") + 0xFF10) if r.random() < 0.5 else c for c in s)
    if r.random() < 0.05:
        s = "".join(chr(ord(c) - ord("0") + 0x0660) for c in s)   # Arabic-Indic digits
    return s


def rand_space(r):
    return r.choice([" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\t\t ",
                     "        ", " \u3000", "\u00a0"])


def rand_line(r, specials):
    parts = []
    for _ in range(r.randint(1, 14)):
        x = r.random()
        if x < 0.45:
            lang = r.choice(list(WORDS))
            w = r.choice(WORDS[lang])
            if r.random() < 0.15:
                w = w.upper() if r.random() < 0.5 else w.capitalize()
            parts.append(w)
        elif x < 0.58:
            parts.append(rand_number(r))
        elif x < 0.66:
            parts.append(r.choice(EMOJI))
        elif x < 0.74:
            parts.append(r.choice(ODD))
        elif x < 0.80:
            parts.append(r.choice(CODE))
        elif x < 0.88:
            parts.append(r.choice(specials))
        else:
            parts.append(r.choice(".,;:!?()[]{}\"'-_/\\|@#$%^&*+=<>`~") * r.randint(1, 3))
        parts.append(rand_space(r) if r.random() < 0.8 else "")
    s = "".join(parts)
    if r.random() < 0.1:
        s = rand_space(r) + s
    return s


def edge_lines(specials):
    return ["", " ", "  ", "\n", "\t", "\r\n\r\n", "a", "1", "12345678901234567890",
            "x" * 300, " " * 100, "\n" * 20, "😀" * 20, "中" * 200, "ab" * 150,
            "".join(specials), specials[0] + " " + specials[0], " " + specials[-1] + " ",
            "<think> in </think> out", "x<think>y", "hello_world hello_worlds a hello_world.",
            "café CAFÉ cafe\u0301", "ＡＢＣ１２３ ﬁne", "\u0085\u2028x\u2029", "'s 'S 've 'd",
            "\x00zero\x00byte", "end with space ", "trailing\n", "1 22 333 4444", "-a-b- c.d,e"]


def texts(seed, n, specials):
    r = random.Random(seed)
    return [rand_line(r, specials) for _ in range(n)]


# ---- the tokenizers --------------------------------------------------------------------------

def train(name, lines, specials):
    if name == "deepseek":
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.Sequence([])   # as DeepSeek's file has it
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(DS_DIGITS), behavior="isolated", invert=False),
            pre_tokenizers.Split(Regex(DS_CJK), behavior="isolated", invert=False),
            pre_tokenizers.Split(Regex(DS_MAIN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        vocab = 3000
    elif name == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
        vocab = 2000
    else:
        tok = Tokenizer(models.BPE(ignore_merges=True))
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"),
            pre_tokenizers.Split("-", behavior="merged_with_previous"),
            pre_tokenizers.Split(Regex(r"[.,;:!?]"), behavior="merged_with_next"),
            pre_tokenizers.Split(Regex(r"\d"), behavior="contiguous"),
            pre_tokenizers.Split(Regex(r"\p{L}+"), behavior="isolated", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        vocab = 1200
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials[:4],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)
    if name == "deepseek":   # the BOS template DeepSeek's file has; unused without special tokens
        tok.post_processor = processors.TemplateProcessing(
            single=f"{specials[0]} $A", special_tokens=[(specials[0], tok.token_to_id(specials[0]))])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials[4:]])
    tok.add_tokens([AddedToken("<think>", lstrip=True, rstrip=True, normalized=False),
                    AddedToken("</think>", lstrip=False, rstrip=True, normalized=False),
                    AddedToken("hello_world", single_word=True, normalized=True),
                    AddedToken("café", normalized=True)])
    return tok


def merges_as_strings(path_in, path_out):
    with open(path_in, encoding="utf-8") as f:
        j = json.load(f)
    j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
    with open(path_out, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)


# ---- the Engram reference --------------------------------------------------------------------

SENTINEL = "\uE000"
ENGRAM_NORM = normalizers.Sequence([
    normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
    normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), SENTINEL),
    normalizers.Strip(), normalizers.Replace(SENTINEL, " "),
])


def engram_reference(tok):
    """The reference CompressedTokenizer._build_lookup_table, on a tokenizers.Tokenizer."""
    key2new, ids = {}, []
    for tid in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid)
        else:
            norm = ENGRAM_NORM.normalize_str(text)
            key = norm if norm else text
        ids.append(key2new.setdefault(key, len(key2new)))
    return ids, list(key2new)


# ---- running moeflow -------------------------------------------------------------------------

def tool(*args):
    p = subprocess.run([TOOL, *args], capture_output=True)
    if p.returncode != 0:
        sys.exit(f"check_tokenizer: tok_tool {' '.join(args)} failed ({p.returncode}): "
                 f"{p.stderr.decode(errors='replace')}")
    return p.stdout.decode("utf-8").split("\n")[:-1]


def write_texts(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        for s in lines:
            f.write(json.dumps(s) + "\n")


class Report:
    def __init__(self):
        self.failed = 0
        self.lines = []

    def compare(self, what, got, want, inputs):
        bad = [i for i in range(len(want)) if i >= len(got) or got[i] != want[i]]
        ok = len(want) - len(bad)
        self.lines.append(f"{what}: {ok}/{len(want)} exact")
        if bad or len(got) != len(want):
            self.failed += 1
            print(f"MISMATCH {what}: {len(bad)} of {len(want)} (tool gave {len(got)} results)")
            for i in bad[:SHOW]:
                print(f"  input  {inputs[i]!r}\n  want   {want[i]!r}\n  got    "
                      f"{got[i] if i < len(got) else None!r}")


def known_code_points():
    """Code points both this Python's unicodedata and moeflow's PCRE2 call assigned. The reference
    regex engine (Oniguruma inside tokenizers) has newer tables than PCRE2 10.42 (Unicode 14):
    text with characters PCRE2 does not know yet may split differently, and is left out."""
    pcre_cn = []
    for l in tool("unassigned"):
        a, b = map(int, l.split())
        pcre_cn.append((a, b))
    cn = set()
    for a, b in pcre_cn:
        cn.update(range(a, b + 1))
    return [c for c in range(0x20, 0x110000) if c not in cn and not (0xD800 <= c < 0xE000)
            and unicodedata.category(chr(c)) not in ("Cn", "Cs", "Co")]


def fuzz_lines(seed, n, cps, specials):
    r = random.Random(seed)
    pieces = [" ", "  ", "\t", "\n", "\r\n", "a", "Z", "1", "22", "333", ".", "'s", "中", "\u3000",
              "\u0301", "😀"] + specials
    return ["".join(chr(r.choice(cps)) if r.random() < 0.6 else r.choice(pieces)
                    for _ in range(r.randint(1, 40))) for _ in range(n)]


def check_one(name, rep, tmp, train_lines, held_out, specials):
    tok = train(name, train_lines, specials)
    path = os.path.join(tmp, f"{name}.json")
    tok.save(path)
    paths = [path]
    if name == "deepseek":   # the same tokenizer with merges as "a b" strings
        spath = os.path.join(tmp, f"{name}-string-merges.json")
        merges_as_strings(path, spath)
        paths.append(spath)
        if Tokenizer.from_file(spath).encode(held_out[0]).ids != tok.encode(held_out[0]).ids:
            sys.exit("check_tokenizer: tokenizers reads the string-merges file differently")
    tpath = os.path.join(tmp, f"{name}-texts.jsonl")
    write_texts(tpath, held_out)
    want = [tok.encode(s, add_special_tokens=False).ids for s in held_out]
    for p in paths:
        tag = name + (" (string merges)" if p != path else "")
        got = [[int(x) for x in l.split()] if not l.startswith("ERR") else l
               for l in tool("encode", p, tpath)]
        rep.compare(f"{tag} encode", got, want, held_out)

    r = random.Random(7)
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    id_lists = want + [[r.randrange(n_vocab) for _ in range(r.randint(1, 12))] for _ in range(300)]
    ipath = os.path.join(tmp, f"{name}-ids.txt")
    with open(ipath, "w") as f:
        for ids in id_lists:
            f.write(" ".join(map(str, ids)) + "\n")
    for skip in (True, False):
        wantd = [tok.decode(ids, skip_special_tokens=skip) for ids in id_lists]
        got = [json.loads(l) if not l.startswith("ERR") else l
               for l in tool("decode", path, ipath, *(["skip"] if skip else []))]
        rep.compare(f"{name} decode (skip_special_tokens={skip})", got, wantd, id_lists)
    roundtrip = sum(tok.decode(w, skip_special_tokens=False) == s for w, s in zip(want, held_out))
    rep.lines.append(f"{name}: decode(encode(text)) == text for {roundtrip}/{len(held_out)} "
                     f"(informational: normalizers, prefix spaces, lstrip/rstrip change text)")

    ref_ids, ref_keys = engram_reference(tok)
    got = json.loads(tool("engram", path)[0])
    rep.compare(f"{name} engram map ids", got["ids"], ref_ids, list(range(len(ref_ids))))
    rep.compare(f"{name} engram map keys", got["keys"], ref_keys, list(range(len(ref_keys))))
    rep.lines.append(f"{name}: vocabulary {n_vocab}, engram unique keys moeflow "
                     f"{got['n_unique']} reference {len(ref_keys)}")
    return tok


# Measured with tokenizers 0.23.3 and Debian's utf8proc: 546 code points normalize differently,
# every one a character whose Unicode data changed after 9.0 (see check_all_code_points). The
# check fails when more differ, which a real fault (say in case mapping or whitespace) would do.
MAX_TABLE_AGE_DIFFS = 700


def check_all_code_points(rep, tmp):
    """Every code point alone and between letters through both normalizers. tokenizers' NFKC,
    NFD and StripAccents use Unicode 9.0 data (unicode-normalization-alignments), its Lowercase
    Rust's current case tables, utf8proc its own version: characters assigned or recategorized
    since 9.0 (new combining marks, Latin Extended-F, U+32FF, Vedic U+1CF2..) differ. They are
    counted and listed; more than MAX_TABLE_AGE_DIFFS fails."""
    cps = [c for c in range(0x110000) if not (0xD800 <= c < 0xE000)]
    lines = [x for c in cps for x in (chr(c), "a" + chr(c) + "B")]
    path = os.path.join(tmp, "all.jsonl")
    write_texts(path, lines)
    got = [json.loads(l) if not l.startswith("ERR") else l for l in tool("normalize", path)]
    diff = sorted({ord(s if len(s) == 1 else s[1]) for i, s in enumerate(lines)
                   if got[i] != ENGRAM_NORM.normalize_str(s)})
    ranges = []
    for c in diff:
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    ok = len(diff) <= MAX_TABLE_AGE_DIFFS
    rep.lines.append(f"engram normalize, all {len(cps)} code points alone and in 'a?B': "
                     f"{len(cps) - len(diff)} agree, {len(diff)} differ (Unicode table ages; "
                     f"at most {MAX_TABLE_AGE_DIFFS} allowed): {'ok' if ok else 'FAILED'}")
    rep.lines.append("    they are: " + " ".join(f"{a:04X}" + (f"-{b:04X}" if b != a else "")
                                                for a, b in ranges))
    if not ok:
        rep.failed += 1
        print(f"MISMATCH engram normalize over all code points: {len(diff)} differ")


def main():
    if not os.access(TOOL, os.X_OK):
        sys.exit(f"check_tokenizer: {TOOL} not found (set MOEFLOW_BUILD to a built tree)")
    rep = Report()
    specials = DS_SPECIAL
    train_lines = texts(1, 3000, specials)
    held_out = edge_lines(specials) + texts(2, 600, specials)
    with tempfile.TemporaryDirectory(prefix="moeflow-tok-") as tmp:
        toks = [check_one(n, rep, tmp, train_lines, held_out, specials)
                for n in ("deepseek", "gpt2", "splits")]
        # random characters from all of Unicode (those PCRE2 knows) through the DeepSeek shape,
        # which has no normalizer; the NFC/NFKC ones would show the normalizer tables' ages
        fuzz = fuzz_lines(3, 3000, known_code_points(), specials)
        fpath = os.path.join(tmp, "fuzz.jsonl")
        write_texts(fpath, fuzz)
        got = [[int(x) for x in l.split()] if not l.startswith("ERR") else l
               for l in tool("encode", os.path.join(tmp, "deepseek.json"), fpath)]
        rep.compare("deepseek encode, random Unicode", got,
                    [toks[0].encode(t, add_special_tokens=False).ids for t in fuzz], fuzz)
        # the Engram normalizer on held-out text, every vocabulary string and the odd characters
        norm_in = held_out + ODD + [w for ws in WORDS.values() for w in ws] + EMOJI
        for t in toks:
            norm_in += [t.decode([i], skip_special_tokens=False)
                        for i in range(t.get_vocab_size(with_added_tokens=True))]
        norm_in += ["", " ", "  ", " \n\t ", "\x0b", "\u2028", " \u2028", "x\u2028",
                    "\ue000", " \ue000 ", "\u0301", " \u0301", "Ǆ", "ΣΑΣ", "ﬃ ǲ"]
        norm_in = [s for s in norm_in if "\ufffd" not in s]
        npath = os.path.join(tmp, "norm.jsonl")
        write_texts(npath, norm_in)
        got = [json.loads(l) if not l.startswith("ERR") else l for l in tool("normalize", npath)]
        rep.compare("engram normalize", got, [ENGRAM_NORM.normalize_str(s) for s in norm_in],
                    norm_in)
        check_all_code_points(rep, tmp)
    print("\n".join("  " + l for l in rep.lines))
    if rep.failed:
        print(f"check_tokenizer: FAILED ({rep.failed} comparisons with mismatches)")
        return 1
    print("check_tokenizer: all comparisons exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
