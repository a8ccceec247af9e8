#!/usr/bin/env bash
# Builds kube-apiserver, kube-scheduler and kube-controller-manager from Debian's own
# `kubernetes` source package (v1.20.2) with Debian's Go, and installs etcd from
# `etcd-server`. Idempotent and cached outside the repository; a lock makes concurrent
# callers wait for one build. Prints the binary directory on success.
#
#   TENSILE_CACHE_DIR   cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/tensile)
#   KUBE_BIN_DIR        if set and complete, nothing is built; it is printed as is
#
# `kube-bins.sh --check` changes nothing: it exits 0 when everything is in place, 1 when a
# run would build or install something.
set -euo pipefail

VERSION=v1.20.2
BINS=(kube-apiserver kube-scheduler kube-controller-manager)
CACHE="${TENSILE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tensile}"
OUT="$CACHE/kube-$VERSION/bin"
WORK="$CACHE/kube-$VERSION/src"
LOG="$CACHE/kube-$VERSION/build.log"

say() { echo "kube-bins: $*" >&2; }
die() { say "FAILED: $1"; [ -n "${2:-}" ] && say "fix: $2"; exit 1; }

complete() {
  local d=$1
  for b in "${BINS[@]}"; do [ -x "$d/$b" ] || return 1; done
}

if [ "${1:-}" = --check ]; then
  complete "${KUBE_BIN_DIR:-$OUT}" || exit 1
  if [ -n "${ETCD_BIN:-}" ]; then [ -x "$ETCD_BIN" ] && exit 0; exit 1; fi
  command -v etcd >/dev/null && exit 0
  exit 1
fi

if [ -n "${KUBE_BIN_DIR:-}" ]; then
  complete "$KUBE_BIN_DIR" || die "KUBE_BIN_DIR=$KUBE_BIN_DIR lacks one of ${BINS[*]}" \
    "point KUBE_BIN_DIR at a directory holding all three binaries, or unset it to build $VERSION"
  echo "$KUBE_BIN_DIR"
  exit 0
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || die "not root and no sudo: cannot install apt packages" \
    "run as root once, or install: golang-1.19-go dpkg-dev rsync golang-github-modern-go-reflect2-dev etcd-server"
  SUDO=sudo
fi

ensure_etcd() {
  if [ -n "${ETCD_BIN:-}" ]; then
    [ -x "$ETCD_BIN" ] || die "ETCD_BIN=$ETCD_BIN is not an executable" "point ETCD_BIN at an etcd binary or unset it"
    return
  fi
  if ! command -v etcd >/dev/null; then
    say "installing etcd-server (apt)"
    $SUDO apt-get update -qq >&2 || die "apt-get update failed" "check the apt sources and network access to Debian's archive"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends etcd-server >&2 \
      || die "apt-get install etcd-server failed" "run it by hand to see apt's message"
  fi
  # Debian may start a system etcd; the test bed uses its own ports, so it is harmless.
}

mkdir -p "$CACHE"
exec 9>"$CACHE/kube-$VERSION.lock"
if ! flock -n 9; then
  say "another build holds $CACHE/kube-$VERSION.lock; waiting"
  flock 9
fi

ensure_etcd
if complete "$OUT"; then
  echo "$OUT"
  exit 0
fi

start=$(date +%s)
say "building $VERSION control-plane binaries (first run only: about 5-10 minutes on 2 cores); log: $LOG"
mkdir -p "$(dirname "$LOG")"
: >"$LOG"

need=(golang-1.19-go dpkg-dev rsync golang-github-modern-go-reflect2-dev)
missing=()
for p in "${need[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (apt)"
  $SUDO apt-get update -qq >>"$LOG" 2>&1 || die "apt-get update failed (see $LOG)" "check the apt sources"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$LOG" 2>&1 \
    || die "apt-get install ${missing[*]} failed (see $LOG)" "run the install by hand to see apt's message"
fi

rm -rf "$WORK"
mkdir -p "$WORK"
if ! ls "$CACHE"/kubernetes_*.orig.tar.* >/dev/null 2>&1; then
  say "fetching Debian's kubernetes source package"
  SRCLIST=/etc/apt/sources.list.d/tensile-deb-src.sources
  [ -f /etc/apt/sources.list.d/debian.sources ] || die "no /etc/apt/sources.list.d/debian.sources to derive deb-src entries from" \
    "add a deb-src entry for bookworm main by hand, then rerun"
  sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources | $SUDO tee "$SRCLIST" >/dev/null
  cleanup_src() { $SUDO rm -f "$SRCLIST"; $SUDO apt-get update -qq >/dev/null 2>&1 || true; }
  trap cleanup_src EXIT
  $SUDO apt-get update -qq >>"$LOG" 2>&1 || die "apt-get update with deb-src entries failed (see $LOG)" "check the apt sources"
  (cd "$CACHE" && apt-get source --download-only kubernetes >>"$LOG" 2>&1) \
    || die "apt-get source kubernetes failed (see $LOG)" "check that Debian's archive serves source packages"
  cleanup_src
  trap - EXIT
fi
dsc=$(ls "$CACHE"/kubernetes_*.dsc | head -1)
(cd "$WORK" && dpkg-source --no-check -x "$dsc" tree >>"$LOG" 2>&1) || die "dpkg-source -x $dsc failed (see $LOG)" "delete $CACHE/kubernetes_* and rerun"
TREE="$WORK/tree"

# The vendored reflect2 v1.0.1 crashes under Go 1.19; Debian's packaged copy does not.
R2SRC=/usr/share/gocode/src/github.com/modern-go/reflect2
R2DST="$TREE/vendor/github.com/modern-go/reflect2"
[ -d "$R2SRC" ] || die "missing $R2SRC" "apt-get install golang-github-modern-go-reflect2-dev"
rm -f "$R2DST"/*.go "$R2DST"/*.s
cp "$R2SRC"/*.go "$R2DST"/
cp "$R2SRC"/*.s "$R2DST"/ 2>/dev/null || true
rm -f "$R2DST"/*_test.go

say "compiling (log: $LOG)"
export HOME="$CACHE/home"; mkdir -p "$HOME"
(cd "$TREE" && env PATH=/usr/lib/go-1.19/bin:$PATH GOPROXY=off CGO_ENABLED=0 KUBE_BUILD_PLATFORMS=linux/amd64 \
   GOFLAGS=-tags=providerless GOLDFLAGS="-s -w" \
   make WHAT="cmd/kube-apiserver cmd/kube-scheduler cmd/kube-controller-manager" >>"$LOG" 2>&1) \
  || { tail -n 30 "$LOG" >&2; die "make of the control-plane binaries failed (see $LOG)" "read the log tail above; delete $WORK and rerun"; }

mkdir -p "$OUT.tmp"
for b in "${BINS[@]}"; do cp "$TREE/_output/local/bin/linux/amd64/$b" "$OUT.tmp/"; done
rm -rf "$OUT"; mv "$OUT.tmp" "$OUT"
rm -rf "$WORK"   # 1.6 GB tree; the binaries are all we keep
say "built in $(( $(date +%s) - start )) s into $OUT"
echo "$OUT"
