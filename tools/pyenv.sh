#!/usr/bin/env bash
# Makes (or reuses) the Python environment the oracle checks run in: numpy, ml_dtypes and
# safetensors from PyPI. Prints the path of its python on stdout. Cached outside the checkout in
# ${MOEFLOW_PYENV:-$HOME/.cache/moeflow/pyenv}; a fresh machine builds it anew.
set -euo pipefail
env_dir="${MOEFLOW_PYENV:-$HOME/.cache/moeflow/pyenv}"
py="$env_dir/bin/python"
if ! "$py" -c 'import numpy, ml_dtypes, safetensors' 2>/dev/null; then
  echo "pyenv: creating $env_dir" >&2
  python3 -m venv "$env_dir" >&2
  "$py" -m pip install -q --disable-pip-version-check numpy ml_dtypes safetensors >&2
fi
echo "$py"
