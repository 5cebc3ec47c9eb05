#!/bin/sh
# test/build/check.sh — the build rebuilds exactly what a change affects.
#
# Works on a copy of the tree in a temporary directory (the checkout is not
# touched) and checks, after a full build:
#   - nothing is rebuilt when nothing changed;
#   - touching a header rebuilds the objects that include it, and not the
#     others (dependencies come from the compiler, -MMD);
#   - a changed make variable (CFLAGS, PREFIX) rebuilds what uses it: the
#     objects, devpickle.pc (an install to another PREFIX installs a .pc that
#     points there);
#   - the version is written once (include/devpickle/base.h): the CLI and the
#     .pc follow a change of it;
#   - with the packages installed, `make test` runs as a non-root user (only
#     when this runs as root and setpriv and the user nobody exist).
# Usage: sh test/build/check.sh [TREE]   (or `make check-build`)
#   TREE: the source tree to check (default: the one holding this script).
#   KEEP_GOING=1: report every failing check, not only the first.
set -eu

src=$(cd "${1:-$(dirname "$0")/../..}" && pwd)
[ -f "$src/Makefile" ] && [ -f "$src/include/devpickle.h" ] || { echo "check-build: $src is not a devpickle tree" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -C "$src" --exclude=./build --exclude=./.git -cf - . | tar -C "$work" -xf -

m() { make --no-print-directory -C "$work" -j2 "$@"; }
failed=0
fail() { echo "check-build: FAIL: $*" >&2; failed=1; [ -n "${KEEP_GOING:-}" ] || exit 1; }
# The files `make -n` says it would write with -o (compiles and links).
would_build() { m -n "$@" 2>/dev/null | sed -n 's/.* -o \([^ ]*\).*/\1/p' | sort -u; }

m all >/dev/null
[ -z "$(would_build all)" ] || fail "a second 'make all' rebuilds: $(would_build all | tr '\n' ' ')"
echo "check-build: nothing rebuilt when nothing changed"

# A header of the CLI only: the CLI objects that include it, no library object.
sleep 1; touch "$work/tools/vjson.h"
out=$(would_build all)
echo "$out" | grep -qx 'build/obj/tools/vjson.o' || fail "touching tools/vjson.h does not rebuild vjson.o"
! echo "$out" | grep -q '^build/obj/\(core\|value\|pickler\|device\|cache\|future\)/' ||
  fail "touching tools/vjson.h rebuilds library objects: $(echo "$out" | tr '\n' ' ')"
m all >/dev/null
# A private header included by a test: the test is rebuilt.
m build/test_value >/dev/null
sleep 1; touch "$work/value/gc.h"
would_build build/test_value | grep -qx 'build/test_value' || fail "touching value/gc.h does not rebuild test_value"
m all build/test_value >/dev/null
echo "check-build: a touched header rebuilds the objects that include it, and only those"

# A changed variable rebuilds what uses it.
would_build all CFLAGS=-DDP_CHECK_BUILD | grep -qx 'build/obj/value/value.o' ||
  fail "a changed CFLAGS does not rebuild the objects"
echo "check-build: a changed CFLAGS rebuilds the objects"

stage="$work/stage"
m install DESTDIR="$stage" PREFIX=/usr/local >/dev/null
m install DESTDIR="$stage" PREFIX=/opt/x >/dev/null
pc="$stage/opt/x/lib/pkgconfig/devpickle.pc"
grep -qx 'prefix=/opt/x' "$pc" || fail "install PREFIX=/opt/x after PREFIX=/usr/local installs: $(grep '^prefix=' "$pc")"
grep -qx 'prefix=/usr/local' "$stage/usr/local/lib/pkgconfig/devpickle.pc" || fail "the first install's .pc is wrong"
echo "check-build: an install to another PREFIX installs a .pc that points there"

# The version, written once: the CLI and the .pc follow the header.
sed -i 's/^#define DP_VERSION_MAJOR .*/#define DP_VERSION_MAJOR 9/; s/^#define DP_VERSION_MINOR .*/#define DP_VERSION_MINOR 8/; s/^#define DP_VERSION_PATCH .*/#define DP_VERSION_PATCH 7/' \
  "$work/include/devpickle/base.h"
m install DESTDIR="$stage" PREFIX=/opt/x >/dev/null
v=$("$work/build/devpickle" --version)
[ "$v" = "devpickle 9.8.7 (frame format version 1)" ] || fail "devpickle --version after the header says 9.8.7: $v"
grep -qx 'Version: 9.8.7' "$pc" || fail "devpickle.pc after the header says 9.8.7: $(grep '^Version' "$pc")"
echo "check-build: the version comes from include/devpickle/base.h alone"

# The suites' OK() shows the library's message when a call fails: a test that
# fails on purpose, built here only (never part of the suites).
printf '%s\n' '#include "helpers.h"' 'Test(check_build, fails_on_purpose) {' \
  '  dp_value_t l = t_list();' '  OK(dp_seq_set(l, 5, dp_int(1), T_ERR));' '}' > "$work/failing_ok.c"
libs=$(sed -n 's/^Libs.private: //p' "$pc")
# shellcheck disable=SC2086 # $libs is a list of flags
(cd "$work" && cc -std=c11 -D_POSIX_C_SOURCE=200809L -Iinclude -Itest -o failing_ok failing_ok.c build/libdevpickle.a -lcriterion $libs) ||
  fail "the failing test does not build"
out=$("$work/failing_ok" 2>&1 || true)
echo "$out" | grep -qF 'failed: DP_EINVAL: dp_seq_set: index 5 out of range (length 0)' ||
  fail "a failing OK() does not show the library's message: $out"
echo "check-build: a failing OK() shows the library's message"

if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && id nobody >/dev/null 2>&1; then
  rm -rf "$work/build" "$stage"
  chown -R nobody "$work"
  # Criterion's runner binds /tmp/criterion_<pid>.sock and replaces a stale
  # one, but nobody cannot replace root's: a socket left by a runner that was
  # killed, whose pid a runner of nobody's then gets, fails the run ("Could
  # not initialize the message server: Address already in use"). Those of
  # processes no longer alive go first.
  for s in /tmp/criterion_*.sock; do
    p=${s#/tmp/criterion_}; p=${p%.sock}
    case $p in '' | *[!0-9]*) continue ;; esac
    [ -S "$s" ] && ! kill -0 "$p" 2>/dev/null && rm -f "$s"
  done
  setpriv --reuid="$(id -u nobody)" --regid="$(id -g nobody)" --clear-groups env HOME="$work" \
    make --no-print-directory -C "$work" -j2 test >"$work.log" 2>&1 ||
    { grep -E '^\[(FAIL|----)\]|Synthesis|criterion:' "$work.log" | grep -v '^\[----\] Criterion' | head -60
      tail -15 "$work.log"; rm -f "$work.log"; fail "'make test' as the user nobody"; }
  rm -f "$work.log"
  echo "check-build: make test runs as a non-root user"
else
  echo "check-build: skipped 'make test' as a non-root user (needs root, setpriv and the user nobody)"
fi
[ "$failed" = 0 ] || exit 1
echo "check-build: ok"
