#!/usr/bin/env bash
# Makes (or reuses) the Python environment the oracle checks run in: numpy, ml_dtypes,
# safetensors, openai and jinja2 from PyPI. Prints the path of its python on stdout. Cached outside the checkout in
# ${MOEFLOW_PYENV:-$HOME/.cache/moeflow/pyenv}; a fresh machine builds it anew.
set -euo pipefail
env_dir="${MOEFLOW_PYENV:-$HOME/.cache/moeflow/pyenv}"
py="$env_dir/bin/python"
# Pinned: the oracle checks compare bit patterns, and ml_dtypes' rounding quirks (documented in
# host/formats.h) are matched as of this version.
# openai: the real client tests/py/check_serve.py drives `moeflow serve` with.
# jinja2: the reference tests/py/check_jinja.py holds host/jinja.c's chat templates to.
reqs=(numpy==2.4.6 ml_dtypes==0.6.0 safetensors==0.8.0 openai==1.109.1 jinja2==3.1.6)
want=$(printf '%s ' "${reqs[@]}")
if [ "$(cat "$env_dir/.moeflow-reqs" 2>/dev/null)" != "$want" ] ||
   ! "$py" -c 'import numpy, ml_dtypes, safetensors, openai, jinja2' 2>/dev/null; then
  echo "pyenv: creating $env_dir ($want)" >&2
  python3 -m venv "$env_dir" >&2
  "$py" -m pip install -q --disable-pip-version-check "${reqs[@]}" >&2
  echo "$want" >"$env_dir/.moeflow-reqs"
fi
echo "$py"
