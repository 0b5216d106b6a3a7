# The benchmark suite (crates/bench). Included by the root Makefile: `include mk/bench.mk`.
#
#   make bench         every part at full size (tens of minutes on 2 cores); writes
#                      bench-results/results.json, results.md and latency.svg; then
#                      `make bench-survival` (a real SGLang PD server, ~30 min: bench-results/survival.json)
#   make bench-smoke   every part at tiny sizes (seconds), same outputs in bench-results/smoke
#
# One part alone, with smaller sizes:
#   $(BENCH_BIN) verdicts --conns 16 --duration 5s
#   $(BENCH_BIN) ingest --rates 1000,5000 --duration 3s
#   $(BENCH_BIN) detection --kills 10 --ttls 1
#   $(BENCH_BIN) scale --groups 200 --records 100000
#   $(BENCH_BIN) agent --calls 100000
#   $(BENCH_BIN) burst --bursts 3
#   $(BENCH_BIN) keepalive --variants 5:2000
#   $(BENCH_BIN) node-memory --records 100000
#   $(BENCH_BIN) events --readers 200 --rate 1000
#
# Needs etcd and wrk on PATH (Debian: etcd-server, wrk). The suite starts its own etcd and
# coordinators on loopback; coordinators and ranks are the rootrank-bench binary itself
# (hidden `serve-coordinator` and `rank` subcommands), so no build order matters for them.
# `rootrank` is built only so detection can find `rootrank node-watch` when it exists, and
# the transfer crate's nixl_bench example for the 64 KiB NIXL WRITE next to record_failure.
# The builds run one after another (never two cargo builds at once).

BENCH_TARGET_DIR ?= $(if $(CARGO_TARGET_DIR),$(CARGO_TARGET_DIR),target)
BENCH_BIN ?= $(BENCH_TARGET_DIR)/release/rootrank-bench
BENCH_OUT ?= bench-results

.PHONY: bench bench-smoke bench-build bench-deps

bench-deps:
	@command -v etcd >/dev/null || { echo "bench: etcd not on PATH (apt-get install etcd-server)"; exit 1; }
	@command -v wrk >/dev/null || { echo "bench: wrk not on PATH (apt-get install wrk)"; exit 1; }

bench-build: bench-deps
	cargo build --release -p rootrank-bench --bin rootrank-bench
	cargo build --release --bin rootrank
	cargo build --release -p rootrank-transfer --example nixl_bench
	bash scripts/fetch-nixl.sh || echo "bench: NIXL not fetched; the NIXL figure will say not available"

bench: bench-build
	$(BENCH_BIN) all --out $(BENCH_OUT)
	$(MAKE) bench-survival

bench-smoke: bench-deps
	cargo build --release -p rootrank-bench --bin rootrank-bench
	$(BENCH_BIN) all --smoke --out $(BENCH_OUT)/smoke
