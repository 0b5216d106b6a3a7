# The Python package and the SGLang plugin (crates/python). Included by the root Makefile.
#
#   make wheel         dist/rootrank-<version>-cp39-abi3-manylinux_2_28_x86_64.whl (any CPython
#                      >= 3.9, glibc >= 2.28), with the `rootrank` command
#   make test-python   the Python API and real-SGLang tests (tests/python), in the cached
#                      SGLang venv (~/.cache/rootrank/sglang-0.5.23, built once)
#   make test-server   the real-server tier: a real SGLang PD deployment (prefill TP=2, decode
#                      TP=1, NIXL, sglang-router) with the plugin, a prefill rank SIGKILLed
#   make bench-python  the plugin's costs (record_failure, poll hook, fallback budget)
#   make demo-sglang   the real-server story for people: a request, then prefill rank 1
#                      SIGKILLed with requests in flight, what clients and `rootrank why` say
#   make bench-server  request latency and throughput through the router, plugin off and on
#   make bench-survival two prefill instances behind the router, one prefill rank SIGKILLed
#                      mid-load: the client requests that failed, SGLang alone and with rootrank

.PHONY: wheel test-python test-server bench-python demo-sglang bench-server bench-survival

wheel:
	@scripts/wheel.sh

test-python: deps
	$(CARGO) build --bin rootrank
	@ROOTRANK_BIN=$(ROOTRANK_DEBUG_BIN) scripts/test-python.sh

test-server: deps
	$(CARGO) build --bin rootrank
	@ROOTRANK_BIN=$(ROOTRANK_DEBUG_BIN) scripts/test-server.sh

demo-sglang: deps
	$(CARGO) build --bin rootrank
	@ROOTRANK_BIN=$(ROOTRANK_DEBUG_BIN) scripts/demo-sglang.sh

bench-server: deps
	$(CARGO) build --bin rootrank
	@ROOTRANK_BIN=$(ROOTRANK_DEBUG_BIN) scripts/demo-sglang.sh --bench

bench-survival: deps
	$(CARGO) build --bin rootrank
	@ROOTRANK_BIN=$(ROOTRANK_DEBUG_BIN) scripts/demo-sglang.sh --survival

bench-python: deps
	$(CARGO) build --release --bin rootrank
	@ROOTRANK_BIN=$(CURDIR)/target/release/rootrank scripts/test-python.sh --bench

# `make test` runs the Python tests first, and the real-server tier last (its recipe, in the
# root Makefile).
test: test-python
