#!/usr/bin/env bash
# Tries, on a machine without a GPU, what tools/device-check.sh does on a bare GPU machine: runs it
# with --fake --deps prefix in a private mount namespace (unshare, as root) where the system's
# pkg-config, .pc files, the five libraries' headers and development links are hidden (headers
# replaced by an #error, links by an empty file), so the build succeeds only against the prefix
# unpacked from device-prep/. Then checks that build.ninja names no system copy and that the
# binaries load the prefix's libraries. Needs tools/device-prep.sh run first. Exit 0 when all hold.
set -uo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "device-check-hidden: needs root (unshare -m)" >&2; exit 2; }
ls device-prep/*.deb >/dev/null 2>&1 || { echo "device-check-hidden: run tools/device-prep.sh first" >&2; exit 2; }
OUT="${OUT:-$PWD/device-check-out}"
lib=/usr/lib/x86_64-linux-gnu
unshare -m --propagation private bash -c '
  set -e
  lib='"$lib"'
  err=$(mktemp); echo "#error system header used: the build must use the prefix" >"$err"
  empty=$(mktemp); chmod 644 "$empty"
  for b in /usr/bin/pkg-config /usr/bin/pkgconf /usr/bin/x86_64-linux-gnu-pkg-config; do
    [ -e "$b" ] && mount --bind "$empty" "$b"; done
  mount -t tmpfs none "$lib/pkgconfig"
  [ -d /usr/share/pkgconfig ] && mount -t tmpfs none /usr/share/pkgconfig
  for h in liburing.h hwloc.h jansson.h jansson_config.h utf8proc.h pcre2.h; do
    [ -e "/usr/include/$h" ] && mount --bind "$err" "/usr/include/$h"; done
  for d in liburing hwloc; do [ -d "/usr/include/$d" ] && mount -t tmpfs none "/usr/include/$d"; done
  # the libraries (a bind over a link covers its target), except PCRE2, which grep and mount need:
  # its link path is checked in build.ninja and its loading with ldd below
  for f in $lib/liburing.so* $lib/libhwloc.so* $lib/libjansson.so* $lib/libutf8proc.so* \
           $lib/liburing.a $lib/libhwloc.a $lib/libjansson.a $lib/libutf8proc.a \
           $lib/libpcre2-8.a; do
    [ -e "$f" ] && mount --bind "$empty" "$f"; done
  if pkg-config --version >/dev/null 2>&1; then echo "pkg-config still runs"; exit 1; fi
  rc=0
  OUT='"$OUT"' bash tools/device-check.sh --fake --deps prefix || rc=$?
  echo "device-check.sh --fake --deps prefix: rc $rc"
  b=build-devcheck P=$PWD/build-devcheck/deps
  # every -I and library path of the five libraries points into the prefix
  bad=$(grep -oE "(^| |-I|-isystem )/usr/(include|lib/x86_64-linux-gnu)/(lib)?(uring|hwloc|jansson|utf8proc|pcre2)[^ ]*" $b/build.ninja | sort -u)
  [ -z "$bad" ] || { echo "build.ninja names system copies: $bad"; exit 1; }
  n=$(grep -c "deps/usr/lib/x86_64-linux-gnu/lib\(uring\|hwloc\|jansson\|utf8proc\|pcre2-8\)\.so" $b/build.ninja)
  ni=$(grep -c -- "-I$P/usr/include\|-isystem $P/usr/include" $b/build.ninja)
  echo "build.ninja: $n lines link the prefix copies and $ni compile with its headers; none names the system ones"
  [ "$n" -gt 0 ] && [ "$ni" -gt 0 ] || exit 1
  l=$(env -u LD_LIBRARY_PATH ldd $b/moeflow | grep -E "uring|hwloc|jansson|utf8proc|pcre2")
  echo "$l"
  echo "$l" | grep -vq "$P" && { echo "a library loads from outside the prefix"; exit 1; }
  grep -E "^(PKG_CONFIG_EXECUTABLE|URING_LINK_LIBRARIES|HWLOC_INCLUDE_DIRS|pkgcfg_lib_PCRE2_pcre2-8)" $b/CMakeCache.txt
  exit $rc
'
