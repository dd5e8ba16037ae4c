#!/usr/bin/env bash
# Prepares, on a machine with a package registry, what tools/device-check.sh needs to build on a
# bare GPU machine that has nvcc, CMake and ninja but no pkg-config and none of the libraries'
# development packages: downloads the Debian .deb files (runtime and -dev of liburing, hwloc,
# jansson, utf8proc and PCRE2-8, and pkgconf) into device-prep/ (ignored by git, ~2 MB), which the
# device tool carries (carry: ["device-prep"]). device-check.sh unpacks them into a private prefix
# under its build folder, never over /. Nothing is installed here. docs/device.md "Measuring a card".
set -euo pipefail
cd "$(dirname "$0")/.."
dir=device-prep
[ "$(dpkg --print-architecture)" = amd64 ] || { echo "device-prep: this machine is not amd64; the GPU machine is" >&2; exit 1; }
pkgs=(liburing2 liburing-dev libhwloc15 libhwloc-dev libjansson4 libjansson-dev libutf8proc2
      libutf8proc-dev libpcre2-8-0 libpcre2-dev pkgconf pkgconf-bin libpkgconf3
      libudev1)   # libudev1: hwloc's one runtime need, unpacked there only when the machine lacks it
rm -rf "$dir"
mkdir -p "$dir"
# apt-get download fetches as user _apt: let it write the folder
chmod 777 "$dir"
if ! (cd "$dir" && apt-get download "${pkgs[@]}" >/dev/null 2>&1); then
  echo "device-prep: apt-get download failed; updating the package lists once and retrying" >&2
  apt-get update -qq
  (cd "$dir" && apt-get download "${pkgs[@]}" >/dev/null)
fi
chmod 755 "$dir"
for p in "${pkgs[@]}"; do
  ls "$dir/${p}_"*.deb >/dev/null 2>&1 || { echo "device-prep: $p was not downloaded" >&2; exit 1; }
done
{ echo "# downloaded $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME") ($(uname -m))"
  for f in "$dir"/*.deb; do dpkg-deb -W --showformat='${Package} ${Version} ${Architecture}\n' "$f"; done
} >"$dir/MANIFEST"
echo "device-prep: ${#pkgs[@]} packages, $(du -sh "$dir" | cut -f1) in $dir/ (carry: [\"$dir\"])"
