#!/usr/bin/env python3
"""The house's size limits (shared/style.md, "Comments and files"; issue 29), checked.

Prints the longest files and the longest C/CUDA functions of sched/ host/ device/ graphs/ tools/
tests/, then fails (exit 1) when
  - a .c or .cu file in sched/ host/ device/ graphs/ is over FILE_LIMIT (1,200) lines, or
  - any function in those folders, tools/ and tests/ included (.c, .cu, .h), is over FUNC_LIMIT
    (150) lines,
unless it is listed in EXCEPTIONS below with its reason. An exception that no longer applies (the
file or function is back under the limit, or gone) fails too, so the list stays short and true.

A function's length is counted from the line of its opening brace to the line of its closing
brace, both included (what /work/wt/fnlen.py counted). The scanner strips comments, string and
character literals and preprocessor lines (macros included), then takes every brace pair at file
level whose header ends in a parameter list as a function; `extern "C" {` blocks are looked
through. Standard library only.

Usage: python3 tools/house-check.py [--report] [--top N] [--root DIR]
  --report   print the tables and the offenders, exit 0 whatever they are
  --top N    rows of each table (default 15)
  --root DIR the repository root (default: this script's parent folder)
"""
import argparse
import os
import re
import sys

FILE_LIMIT = 1200
FUNC_LIMIT = 150
LIBRARY = ("sched", "host", "device", "graphs")          # the file limit applies here
SCANNED = LIBRARY + ("tools", "tests")                   # the function limit applies everywhere here

# Exceptions, each with its reason (keep this list short; every entry is a debt):
#   "path": "reason"            a file allowed over FILE_LIMIT
#   "path:function": "reason"   a function allowed over FUNC_LIMIT
EXCEPTIONS = {
}

ATTR_WORDS = {"__attribute__", "__declspec", "__launch_bounds__", "alignas", "_Alignas",
              "__align__", "defined", "sizeof"}
NOT_NAMES = {"if", "for", "while", "switch", "return", "sizeof"}


def strip_source(src):
    """Comments, string and character literals and preprocessor lines blanked; newlines kept,
    so line numbers stay."""
    out = []
    i, n = 0, len(src)
    line_start = True          # only blanks since the last newline
    while i < n:
        c = src[i]
        if src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * src.count("\n", i, j))
            i = j
        elif src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        elif c == "#" and line_start:
            # a preprocessor directive, with its continuation lines (comments inside it are
            # rare here; a /* inside a directive would be blanked with the directive)
            j = i
            while j < n:
                k = src.find("\n", j)
                if k < 0:
                    j = n
                    break
                if src[k - 1] == "\\" or (k >= 2 and src[k - 2:k] == "\\\r"):
                    out.append("\n")
                    j = k + 1
                    continue
                j = k
                break
            i = j
        else:
            out.append(c)
            if c == "\n":
                line_start = True
            elif not c.isspace():
                line_start = False
            i += 1
    return "".join(out)


def function_name(header):
    """The name of the function whose header (the text between the previous file-level ';' or
    '}' and its '{') this is, or None when the brace opens no function (struct, enum,
    initializer, extern block)."""
    h = header.strip()
    # trailing attributes after the parameter list: __attribute__((...))
    while True:
        m = re.search(r"(__attribute__|__launch_bounds__)\s*\(\((?:[^()]|\([^()]*\))*\)\)\s*$", h)
        if not m:
            break
        h = h[:m.start()].rstrip()
    if not h.endswith(")"):
        return None
    depth = 0
    for k, ch in enumerate(h):          # '=' at paren depth 0: an initializer, not a function
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "=" and depth == 0:
            return None
    # the first top-level '(' whose preceding word is not an attribute keyword
    depth = 0
    for k, ch in enumerate(h):
        if ch == "(":
            if depth == 0:
                m = re.search(r"([A-Za-z_]\w*)\s*$", h[:k])
                if m and m.group(1) not in ATTR_WORDS:
                    return None if m.group(1) in NOT_NAMES else m.group(1)
            depth += 1
        elif ch == ")":
            depth -= 1
    return None


def functions(path):
    """(name, first line, last line) of every function in the file; the brace lines."""
    with open(path, encoding="utf-8", errors="replace") as f:
        s = strip_source(f.read())
    found = []
    depth = 0
    line = 1
    header_start = 0
    start_line = None
    name = None
    transparent = []      # depths of extern "C" { blocks
    for i, ch in enumerate(s):
        if ch == "\n":
            line += 1
        elif ch == "{":
            if depth == len(transparent):
                header = s[header_start:i]
                if re.fullmatch(r"\s*extern\s*\"\"\s*", header):
                    transparent.append(depth + 1)
                    depth += 1
                    header_start = i + 1
                    continue
                name = function_name(header)
                start_line = line
            depth += 1
        elif ch == "}":
            depth -= 1
            if transparent and depth + 1 == transparent[-1]:
                transparent.pop()
                header_start = i + 1
            elif depth == len(transparent):
                if name:
                    found.append((name, start_line, line))
                name = None
                header_start = i + 1
        elif ch == ";" and depth == len(transparent):
            header_start = i + 1
    if depth != 0:
        print(f"house-check: {path}: braces do not balance after stripping comments, strings and "
              f"preprocessor lines (depth {depth} at the end); its functions may be miscounted",
              file=sys.stderr)
    return found


def count_lines(path):
    with open(path, "rb") as f:
        data = f.read()
    return data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)


def scan(root):
    files, funcs = [], []
    for top in SCANNED:
        base = os.path.join(root, top)
        for dp, dn, fn in os.walk(base):
            dn.sort()
            for f in sorted(fn):
                if not f.endswith((".c", ".cu", ".h", ".cuh")):
                    continue
                p = os.path.join(dp, f)
                rel = os.path.relpath(p, root)
                files.append((count_lines(p), rel))
                for name, a, b in functions(p):
                    funcs.append((b - a + 1, rel, a, name))
    return files, funcs


def main():
    ap = argparse.ArgumentParser(description="the house's file and function length limits")
    ap.add_argument("--report", action="store_true", help="print only; exit 0 whatever is found")
    ap.add_argument("--top", type=int, default=15, help="rows of each table (default 15)")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = ap.parse_args()

    files, funcs = scan(a.root)
    files.sort(key=lambda r: (-r[0], r[1]))
    funcs.sort(key=lambda r: (-r[0], r[1], r[2]))

    def mark(over, key):
        return "" if not over else (f"  (excepted: {EXCEPTIONS[key]})" if key in EXCEPTIONS else "  OVER")

    print(f"Longest files of {', '.join(s + '/' for s in SCANNED)} (limit {FILE_LIMIT} lines for "
          f".c/.cu in {', '.join(s + '/' for s in LIBRARY)}):")
    for n, rel in files[:a.top]:
        limited = rel.split(os.sep)[0] in LIBRARY and rel.endswith((".c", ".cu"))
        print(f"  {n:6d}  {rel}{mark(limited and n > FILE_LIMIT, rel)}")
    print(f"\nLongest functions (limit {FUNC_LIMIT} lines, brace to brace):")
    for n, rel, ln, name in funcs[:a.top]:
        print(f"  {n:6d}  {rel}:{ln} {name}{mark(n > FUNC_LIMIT, rel + ':' + name)}")

    problems = []
    used = set()
    for n, rel in files:
        if rel.split(os.sep)[0] in LIBRARY and rel.endswith((".c", ".cu")) and n > FILE_LIMIT:
            if rel in EXCEPTIONS:
                used.add(rel)
            else:
                problems.append(f"{rel}: {n} lines (limit {FILE_LIMIT})")
    for n, rel, ln, name in funcs:
        if n > FUNC_LIMIT:
            key = f"{rel}:{name}"
            if key in EXCEPTIONS:
                used.add(key)
            else:
                problems.append(f"{rel}:{ln} {name}: {n} lines (limit {FUNC_LIMIT})")
    for key in sorted(set(EXCEPTIONS) - used):
        problems.append(f"exception '{key}' no longer needed (under the limit, or gone): remove it "
                        f"from EXCEPTIONS in tools/house-check.py")
    print()
    if problems:
        print(f"house-check: {len(problems)} over the limits:")
        for p in problems:
            print(f"  {p}")
        if a.report:
            print("house-check: --report: not failing")
            return 0
        return 1
    print(f"house-check: every file and function within the limits"
          f"{f' ({len(used)} excepted)' if used else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
