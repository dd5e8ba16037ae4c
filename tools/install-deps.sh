#!/usr/bin/env bash
# Installs what moeflow builds and tests with, from Debian packages (run as root; idempotent).
# Skips apt entirely when everything is already present.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config liburing-dev libhwloc-dev libjansson-dev
      libutf8proc-dev libpcre2-dev libmicrohttpd-dev clang libclang-rt-14-dev python3-venv
      openmpi-bin libopenmpi-dev   # Open MPI: the pipeline over several hosts (--ranks-layers)
      iproute2)                    # ip and tc: tests/py/check_mpi.py's two namespaces as two hosts
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# python3-venv is only needed when the system python lacks venv (pyenv builds have it)
if python3 -c 'import venv, ensurepip' 2>/dev/null; then
  missing=("${missing[@]/python3-venv}")
fi
missing=($(printf '%s\n' "${missing[@]}" | grep -v '^$' || true))
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all Debian packages present"
fi
