# rootrank: the two commands a new user needs are `make demo` and `make test`.
# Every target installs what it needs first (scripts/deps.sh, scripts/fetch-nixl.sh), idempotently.

CARGO ?= cargo
# The debug binary the Python tiers start as the coordinator (cargo's target dir, wherever it is).
ROOTRANK_DEBUG_BIN ?= $(if $(CARGO_TARGET_DIR),$(abspath $(CARGO_TARGET_DIR)),$(CURDIR)/target)/debug/rootrank

.PHONY: all deps deps-build nixl nixl-build build test lint demo serve clean

all: build

deps:
	@scripts/deps.sh

# What building and running needs, without the test tools (Chromium, Prometheus, ...).
deps-build:
	@scripts/deps.sh build

nixl: deps
	@scripts/fetch-nixl.sh

nixl-build: deps-build
	@scripts/fetch-nixl.sh

build: deps
	$(CARGO) build --workspace --all-targets

lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Every test: the verdict core (tables and properties), the crates' own tests, and the
# end-to-end tests on real etcd, real rank processes and real NIXL.
# Last, the real-server tier (mk/python.mk): a real SGLang PD server with the wheel the
# Python tests installed (~10 minutes here, ~7 GB of RAM).
HOST_LEASE_TESTS = --test node_watch --test node_restarts --test node_run --test node_oom \
	--test node_containers --test mass_death --test partitions --test security

test: nixl lint
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace --no-fail-fast
	# The node-watch tests again, every node-watch holding a host lease (v5): each rule they
	# check must hold with the ranks on their host's lease too.
	ROOTRANK_TEST_HOST_LEASE_TTL_MS=2000 $(CARGO) test --no-fail-fast $(HOST_LEASE_TESTS)
	ROOTRANK_SKIP_WHEEL=1 ROOTRANK_BIN=$(ROOTRANK_DEBUG_BIN) scripts/test-server.sh

# The whole story on one machine: private etcd, coordinator, simulated PD deployment with
# real NIXL transfers, a rank death and a transfer failure, narrated.
demo: nixl-build
	$(CARGO) run --release --bin rootrank -- demo

# A coordinator with its own private etcd, on 127.0.0.1:9750.
serve: deps-build
	$(CARGO) run --release --bin rootrank -- serve

clean:
	$(CARGO) clean

-include mk/*.mk
