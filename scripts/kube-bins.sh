#!/usr/bin/env bash
# Builds one Kubernetes version's kube-apiserver, kube-scheduler, kube-controller-manager and a
# version-matched kubectl from the published Go modules (`k8s.io/kubernetes` and its staging
# modules), and etcd from `go.etcd.io/etcd/server/v3`, with the machine's Go. Idempotent and
# cached outside the repository, one directory per version; a lock per version makes concurrent
# callers wait for one build. Prints the binary directory on success.
#
#   kube-bins.sh [VERSION]      VERSION: newest (default), oldest, 1.MINOR (the pinned patch of a
#                               supported minor) or an exact v1.MINOR.PATCH
#   kube-bins.sh --etcd         builds etcd only; prints the path of the etcd binary
#   kube-bins.sh --check [VER]  changes nothing: exits 0 when that version and etcd are built
#   kube-bins.sh --versions     prints the supported range: one line per minor, "1.MINOR vX.Y.Z"
#
#   TENSILE_CACHE_DIR   cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/tensile)
#   KUBE_BIN_DIR        if set and complete, nothing is built; it is printed as is
#   ETCD_BIN            if set, that etcd is used and none is built
#
# The Go module cache and build cache are Go's own (GOMODCACHE, GOCACHE), outside the repository
# and reused by every version. The supported range is docs/testbed.md's support matrix; moving it
# means editing SUPPORTED below and that table together.
set -euo pipefail

# The supported minors, oldest first, each pinned to the patch the suite is tested on.
SUPPORTED=(v1.33.13 v1.34.4 v1.35.4 v1.36.3 v1.37.2)
ETCD_VERSION=v3.6.16
BINS=(kube-apiserver kube-scheduler kube-controller-manager kubectl)
CACHE="${TENSILE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tensile}"

say() { echo "kube-bins: $*" >&2; }
die() { say "FAILED: $1"; [ -n "${2:-}" ] && say "fix: $2"; exit 1; }

# Resolves newest/oldest/1.N/v1.N.P to an exact v1.N.P.
resolve() {
  local want=${1#v}
  case "$want" in
    newest | "") echo "${SUPPORTED[-1]}" ;;
    oldest) echo "${SUPPORTED[0]}" ;;
    1.*.*) echo "v$want" ;;
    1.*)
      local v
      for v in "${SUPPORTED[@]}"; do
        [[ $v == "v$want".* ]] && { echo "$v"; return; }
      done
      die "Kubernetes $want is outside the supported range ${SUPPORTED[0]}..${SUPPORTED[-1]}" \
        "name a supported minor, or an exact v1.MINOR.PATCH to build any version the Go module proxy serves"
      ;;
    *) die "cannot read the version '$1'" "use newest, oldest, 1.MINOR or v1.MINOR.PATCH" ;;
  esac
}

complete() {
  local d=$1 b
  for b in "${BINS[@]}"; do [ -x "$d/$b" ] || return 1; done
}

etcd_path() { echo "$CACHE/etcd-$ETCD_VERSION/bin/etcd"; }

ensure_go() {
  # Go's own installer puts it in /usr/local/go, which a login shell may not have on PATH.
  command -v go >/dev/null || { [ -x /usr/local/go/bin/go ] && export PATH="$PATH:/usr/local/go/bin"; }
  command -v go >/dev/null || die "no go on PATH" "install Go 1.25 or newer (Kubernetes 1.37 needs it)"
  export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
}

# Builds etcd from its Go module into the cache (once).
build_etcd() {
  local out dir mod log
  out=$(etcd_path)
  [ -x "$out" ] && return 0
  dir=$(dirname "$(dirname "$out")")
  mod="$dir/mod"
  log="$dir/build.log"
  mkdir -p "$mod"
  exec 8>"$dir.lock"
  flock 8
  [ -x "$out" ] && return 0
  ensure_go
  say "building etcd $ETCD_VERSION from its Go module (first run only: about 2 minutes); log: $log"
  cat >"$mod/go.mod" <<EOF
module tensile.invalid/etcd-build

go 1.24

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
EOF
  : >"$log"
  (cd "$mod" && go mod download go.etcd.io/etcd/server/v3 >>"$log" 2>&1 && go get go.etcd.io/etcd/server/v3@$ETCD_VERSION >>"$log" 2>&1 \
    && go build -trimpath -ldflags "-s -w" -o "$out.tmp" go.etcd.io/etcd/server/v3 >>"$log" 2>&1) \
    || { tail -n 20 "$log" >&2; die "go build of etcd $ETCD_VERSION failed (see $log)" "read the log tail above"; }
  mv "$out.tmp" "$out"
}

# Builds the four Kubernetes binaries of one exact version into the cache (once).
build_kube() {
  local version=$1 minor dir out mod log gomod start staging
  minor=$(echo "$version" | cut -d. -f2)
  dir="$CACHE/kube-$version"
  out="$dir/bin"
  mod="$dir/mod"
  log="$dir/build.log"
  mkdir -p "$dir"
  exec 9>"$dir.lock"
  if ! flock -n 9; then
    say "another build holds $dir.lock; waiting"
    flock 9
  fi
  complete "$out" && return 0
  ensure_go
  start=$(date +%s)
  say "building Kubernetes $version (kube-apiserver, kube-scheduler, kube-controller-manager, kubectl) from its Go modules (first run only: about 8 minutes on 2 cores); log: $log"
  : >"$log"
  gomod=$(go mod download -json "k8s.io/kubernetes@$version" 2>>"$log" | sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p')
  [ -f "$gomod" ] || { tail -n 20 "$log" >&2; die "the Go module proxy does not serve k8s.io/kubernetes@$version (see $log)" \
    "name a version that 'go list -m -versions k8s.io/kubernetes' shows"; }
  # k8s.io/kubernetes points each staging module at ./staging/src/...; a module depending on it
  # replaces each with the staging module published at v0.MINOR.PATCH.
  staging=$(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\1#p' "$gomod")
  [ -n "$staging" ] || die "no staging replaces in $gomod" "the module layout of $version is not the one this script knows"
  rm -rf "$mod"
  mkdir -p "$mod"
  {
    echo "module tensile.invalid/kube-build"
    echo
    echo "go 1.24"
    echo
    echo "require k8s.io/kubernetes $version"
    echo
    echo "replace ("
    for m in $staging; do echo "	$m => $m v0.${version#v1.}"; done
    echo ")"
  } >"$mod/go.mod"
  # A blank import of each command lets `go mod tidy` pull exactly what they need.
  cat >"$mod/tools.go" <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
EOF
  (cd "$mod" && go mod tidy >>"$log" 2>&1) \
    || { tail -n 20 "$log" >&2; die "go mod tidy for Kubernetes $version failed (see $log)" "read the log tail above"; }
  local ldflags="-s -w"
  local pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  rm -rf "$out.tmp"
  mkdir -p "$out.tmp"
  (cd "$mod" && go build -trimpath -tags providerless -ldflags "$ldflags" -o "$out.tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl >>"$log" 2>&1) \
    || { tail -n 30 "$log" >&2; die "go build of Kubernetes $version failed (see $log)" "read the log tail above"; }
  local reported
  reported=$("$out.tmp/kube-apiserver" --version 2>&1 || true)
  [ "$reported" = "Kubernetes $version" ] || die "the built kube-apiserver reports '$reported', not 'Kubernetes $version'" \
    "the version stamp did not take; check the ldflags in this script"
  rm -rf "$out"
  mv "$out.tmp" "$out"
  say "built Kubernetes $version in $(($(date +%s) - start)) s into $out"
}

case "${1:-}" in
  --versions)
    for v in "${SUPPORTED[@]}"; do echo "$(echo "$v" | cut -d. -f1-2 | tr -d v) $v"; done
    exit 0
    ;;
  --etcd)
    if [ -n "${ETCD_BIN:-}" ]; then
      [ -x "$ETCD_BIN" ] || die "ETCD_BIN=$ETCD_BIN is not an executable" "point ETCD_BIN at an etcd 3.5+ binary or unset it"
      echo "$ETCD_BIN"
      exit 0
    fi
    mkdir -p "$CACHE"
    build_etcd
    etcd_path
    exit 0
    ;;
  --check)
    version=$(resolve "${2:-newest}")
    if [ -n "${KUBE_BIN_DIR:-}" ]; then complete "$KUBE_BIN_DIR" || exit 1; else complete "$CACHE/kube-$version/bin" || exit 1; fi
    if [ -n "${ETCD_BIN:-}" ]; then [ -x "$ETCD_BIN" ] || exit 1; else [ -x "$(etcd_path)" ] || exit 1; fi
    exit 0
    ;;
esac

version=$(resolve "${1:-newest}")
if [ -n "${KUBE_BIN_DIR:-}" ]; then
  complete "$KUBE_BIN_DIR" || die "KUBE_BIN_DIR=$KUBE_BIN_DIR lacks one of ${BINS[*]}" \
    "point KUBE_BIN_DIR at a directory holding all four binaries, or unset it to build $version"
  echo "$KUBE_BIN_DIR"
  exit 0
fi
mkdir -p "$CACHE"
build_kube "$version"
echo "$CACHE/kube-$version/bin"
