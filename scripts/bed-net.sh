#!/usr/bin/env bash
# The test bed's node address: an address of this machine that is not loopback, for the kubelet
# API of simulated and virtual nodes. kube-apiserver refuses to proxy `nodes/proxy` (the path
# metrics-server and `kubectl get --raw /api/v1/nodes/NAME/proxy/...` use) to a node whose
# address is not a global unicast one ("address not allowed"), so the bed's nodes cannot sit on
# 127.0.0.1.
#
# The address is the host end of a veth pair whose other end lives in a network namespace the
# bed makes for itself (`tensile-bed`); both ends carry addresses of 198.18.0.0/15, the range
# RFC 2544 sets aside for benchmark networks, which is never routed. Nothing leaves the machine:
# the apiserver dials an address of its own host. Idempotent, under a lock; prints the address.
#
#   TENSILE_NODE_IP     if set, that address is printed as is and nothing is made
#   bed-net.sh --down   removes the namespace and the veth pair
set -euo pipefail

NETNS=tensile-bed
HOST_IF=tensile-bed0
PEER_IF=tensile-bed1
HOST_ADDR=198.18.0.1
PEER_ADDR=198.18.0.2
CACHE="${TENSILE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tensile}"

say() { echo "bed-net: $*" >&2; }
die() { say "FAILED: $1"; [ -n "${2:-}" ] && say "fix: $2"; exit 1; }

if [ -n "${TENSILE_NODE_IP:-}" ]; then
  echo "$TENSILE_NODE_IP"
  exit 0
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || die "not root and no sudo: cannot make the bed's network namespace" \
    "run once as root (it stays until reboot), or set TENSILE_NODE_IP to a non-loopback address of this machine"
  SUDO="sudo -n"
fi
command -v ip >/dev/null || die "no 'ip' command" "apt-get install iproute2"

mkdir -p "$CACHE"
exec 9>"$CACHE/bed-net.lock"
flock 9

if [ "${1:-}" = --down ]; then
  $SUDO ip link del "$HOST_IF" 2>/dev/null || true
  $SUDO ip netns del "$NETNS" 2>/dev/null || true
  exit 0
fi

up() {
  ip -4 -o addr show dev "$HOST_IF" 2>/dev/null | grep -q " $HOST_ADDR/" \
    && ip link show dev "$HOST_IF" 2>/dev/null | grep -q "state UP"
}

if ! up; then
  $SUDO ip link del "$HOST_IF" 2>/dev/null || true
  $SUDO ip netns del "$NETNS" 2>/dev/null || true
  $SUDO ip netns add "$NETNS" || die "ip netns add $NETNS failed" "the bed needs CAP_NET_ADMIN (root), or set TENSILE_NODE_IP"
  $SUDO ip link add "$HOST_IF" type veth peer name "$PEER_IF" netns "$NETNS" \
    || die "ip link add $HOST_IF type veth failed" "the kernel needs veth support, or set TENSILE_NODE_IP"
  $SUDO ip addr add "$HOST_ADDR/30" dev "$HOST_IF"
  $SUDO ip -n "$NETNS" addr add "$PEER_ADDR/30" dev "$PEER_IF"
  $SUDO ip -n "$NETNS" link set lo up
  $SUDO ip -n "$NETNS" link set "$PEER_IF" up
  $SUDO ip link set "$HOST_IF" up
  for _ in $(seq 50); do up && break; sleep 0.1; done
  up || die "$HOST_IF did not come up with $HOST_ADDR" "see 'ip addr show $HOST_IF'"
  say "made network namespace $NETNS with $HOST_IF $HOST_ADDR <-> $PEER_IF $PEER_ADDR"
fi
echo "$HOST_ADDR"
