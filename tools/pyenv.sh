#!/usr/bin/env bash
# Makes (or reuses) the Python environment the oracle checks run in: numpy, ml_dtypes,
# safetensors, openai, jinja2, jsonschema, lm_eval and transformers from PyPI. Prints the path of its python on stdout. Cached outside the checkout in
# ${MOEFLOW_PYENV:-$HOME/.cache/moeflow/pyenv}; a fresh machine builds it anew.
set -euo pipefail
env_dir="${MOEFLOW_PYENV:-$HOME/.cache/moeflow/pyenv}"
py="$env_dir/bin/python"
# Pinned: the oracle checks compare bit patterns, and ml_dtypes' rounding quirks (documented in
# host/formats.h) are matched as of this version.
# openai: the real client tests/py/check_serve.py drives `moeflow serve` with.
# jinja2: the reference tests/py/check_jinja.py holds host/jinja.c's chat templates to.
# jsonschema: validates the server's constrained JSON output (check_serve.py).
# lm_eval[api] + transformers (for its tokenizer; no torch: neither pulls it): the evaluation
# harness tests/py/check_lm_eval.py runs against the server. About 3 min and 0.9 GB the first time
# (datasets' pyarrow and pandas, scikit-learn's scipy: lm_eval's own requirements).
reqs=(numpy==2.4.6 ml_dtypes==0.6.0 safetensors==0.8.0 openai==1.109.1 jinja2==3.1.6 jsonschema==4.26.0
      "lm_eval[api]==0.4.13" transformers==5.23.0)
want=$(printf '%s ' "${reqs[@]}")
if [ "$(cat "$env_dir/.moeflow-reqs" 2>/dev/null)" != "$want" ] ||
   ! "$py" -c 'import numpy, ml_dtypes, safetensors, openai, jinja2, jsonschema, lm_eval, transformers' 2>/dev/null; then
  echo "pyenv: creating $env_dir ($want)" >&2
  python3 -m venv "$env_dir" >&2
  "$py" -m pip install -q --disable-pip-version-check "${reqs[@]}" >&2
  echo "$want" >"$env_dir/.moeflow-reqs"
fi
echo "$py"
