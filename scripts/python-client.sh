#!/usr/bin/env bash
# Makes the virtualenv the Python client tests run: the official Kubernetes Python client
# (PyPI `kubernetes`, pinned below) in a venv under the cache, made once with a lock, keyed by
# the client's version. Prints the path of the venv's interpreter on success.
#
#   TENSILE_CACHE_DIR   cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/tensile)
#   PYTHON              the interpreter the venv is made from (default: python3)
#
# `python-client.sh --check` changes nothing: it exits 0 when the venv is in place, 1 otherwise.
set -euo pipefail

CLIENT_VERSION=37.0.2
CACHE="${TENSILE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tensile}"
DIR="$CACHE/python-kubernetes-$CLIENT_VERSION"
OUT="$DIR/bin/python"
# Written last: a venv without it is an interrupted install.
DONE="$DIR/.installed"

say() { echo "python-client: $*" >&2; }
die() { say "FAILED: $1"; [ -n "${2:-}" ] && say "fix: $2"; exit 1; }

if [ "${1:-}" = --check ]; then
  [ -f "$DONE" ] && [ -x "$OUT" ] && exit 0
  exit 1
fi

mkdir -p "$CACHE"
exec 9>"$DIR.lock"
if ! flock -n 9; then
  say "another install holds $DIR.lock; waiting"
  flock 9
fi
if [ -f "$DONE" ] && [ -x "$OUT" ]; then
  echo "$OUT"
  exit 0
fi

PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || die "$PYTHON is not on PATH" "install Python 3.9 or later (apt-get install python3 python3-venv) or set PYTHON"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 9))' \
  || die "$PYTHON is older than 3.9, which kubernetes $CLIENT_VERSION needs" "set PYTHON to a newer interpreter"
if ! "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null; then
  say "installing python3-venv (apt)"
  { apt-get update -qq && apt-get install -y -qq python3-venv; } >&2 \
    || die "$PYTHON has no venv/ensurepip module and python3-venv could not be installed" "apt-get install python3-venv"
fi

rm -rf "$DIR"
say "making a venv with kubernetes==$CLIENT_VERSION (pip install, under a minute)"
"$PYTHON" -m venv "$DIR" || die "$PYTHON -m venv $DIR failed" "check that $PYTHON can make virtualenvs"
"$DIR/bin/python" -m pip install --quiet --disable-pip-version-check "kubernetes==$CLIENT_VERSION" >&2 \
  || { rm -rf "$DIR"; die "pip install kubernetes==$CLIENT_VERSION failed" "check pip's index access (pip config list)"; }
"$OUT" -c 'import kubernetes.stream' || { rm -rf "$DIR"; die "the installed client does not import"; }
touch "$DONE"
say "installed kubernetes $("$OUT" -c 'import kubernetes; print(kubernetes.__version__)') into $DIR"
echo "$OUT"
