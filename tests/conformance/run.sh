#!/usr/bin/env bash
# Conformance checks against reference Python packages, run as a list: each check is a command
# that exits 0 only when everything it compared was exact (or within its stated tolerance).
# Needs a built tree (MOEFLOW_BUILD, default ./build; configured and built here when missing)
# and a venv with the pinned packages, made or reused at
# ${MOEFLOW_CONF_PYENV:-$HOME/.cache/moeflow/conf-pyenv}. The model and DSpark draft checks (NeMo
# AutoModel's DeepSeek-V4.1 port on CPU) use a second venv with torch, made or reused at
# ${MOEFLOW_CONF_TORCH_PYENV:-$HOME/.cache/moeflow/conf-torch-pyenv}: about 5.5 GB, since PyPI's
# torch wheel brings its CUDA libraries (it runs on CPU). Prints a summary; exits 0 only when
# every check passed.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${MOEFLOW_BUILD:-$root/build}
env_dir=${MOEFLOW_CONF_PYENV:-$HOME/.cache/moeflow/conf-pyenv}
py="$env_dir/bin/python"

# Pinned: exact-match checks are against the behaviour of these versions.
reqs=(tokenizers==0.23.3 numpy==2.4.6)
want=$(printf '%s ' "${reqs[@]}")
if [ "$(cat "$env_dir/.moeflow-reqs" 2>/dev/null)" != "$want" ] ||
   ! "$py" -c 'import tokenizers, numpy' 2>/dev/null; then
  echo "conformance: creating $env_dir ($want)" >&2
  python3 -m venv "$env_dir" >&2 &&
    "$py" -m pip install -q --disable-pip-version-check "${reqs[@]}" >&2 &&
    echo "$want" >"$env_dir/.moeflow-reqs" ||
    { echo "conformance: FAILED to make the Python environment $env_dir" >&2; exit 1; }
fi

# NeMo AutoModel goes in with --no-deps: what it declares (megatron-fsdp, torchao, quack-kernels,
# datasets, mistral-common, ...) is for GPU training and is not imported by its deepseek_v41
# model code; that needs torch, transformers (the version nemo-automodel 0.7.0 pins) and pillow.
torch_env=${MOEFLOW_CONF_TORCH_PYENV:-$HOME/.cache/moeflow/conf-torch-pyenv}
torch_py="$torch_env/bin/python"
torch_reqs=(torch==2.15.0 transformers==5.18.0 numpy==2.4.6 safetensors==0.8.0 pillow==13.0.0)
nemo_req=nemo-automodel==0.7.0
torch_want="$(printf '%s ' "${torch_reqs[@]}")$nemo_req"
torch_probe='import torch, transformers; from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM'
if [ "$(cat "$torch_env/.moeflow-reqs" 2>/dev/null)" != "$torch_want" ] ||
   ! "$torch_py" -c "$torch_probe" 2>/dev/null; then
  echo "conformance: creating $torch_env ($torch_want; several GB)" >&2
  if python3 -m venv "$torch_env" >&2 &&
     "$torch_py" -m pip install -q --disable-pip-version-check "${torch_reqs[@]}" >&2 &&
     "$torch_py" -m pip install -q --disable-pip-version-check --no-deps "$nemo_req" >&2 &&
     "$torch_py" -c "$torch_probe" >&2; then
    echo "$torch_want" >"$torch_env/.moeflow-reqs"
  else
    echo "conformance: FAILED to make the torch environment $torch_env; the model checks fail" >&2
    torch_py=false
  fi
fi

# Configure when there is no build system yet; always bring the build up to date (a no-op when
# it is), so the helper programs match the sources the build tree was configured from.
echo "conformance: building $build" >&2
{ [ -f "$build/build.ninja" ] || [ -f "$build/Makefile" ] ||
    cmake -S "$root" -B "$build" -G Ninja >&2; } &&
  cmake --build "$build" -j "$(nproc)" >/dev/null ||
  { echo "conformance: FAILED to build $build" >&2; exit 1; }
build=$(cd "$build" && pwd)

# name | command (run from the repository root with MOEFLOW_BUILD set)
checks=(
  "tokenizer|$py tests/conformance/tokenizer/check_tokenizer.py"
  "gen-tokenizer|$py tests/conformance/tokenizer/check_gen_tokenizer.py"
  "model|$torch_py tests/conformance/model/check_model.py"
  "model-self-test|$torch_py tests/conformance/model/check_model.py --self-test"
  "dspark|$torch_py tests/conformance/dspark/check_dspark.py"
  "dspark-self-test|$torch_py tests/conformance/dspark/check_dspark.py --self-test"
)

passed=() failed=()
for c in "${checks[@]}"; do
  name=${c%%|*} cmd=${c#*|}
  echo "=== conformance: $name"
  start=$(date +%s)
  if (cd "$root" && MOEFLOW_BUILD="$build" $cmd); then
    passed+=("$name ($(( $(date +%s) - start )) s)")
  else
    failed+=("$name")
  fi
done
echo "=== conformance summary: ${#passed[@]} passed, ${#failed[@]} failed"
for p in "${passed[@]}"; do echo "  PASS $p"; done
for f in "${failed[@]}"; do echo "  FAIL $f"; done
[ ${#failed[@]} -eq 0 ]
