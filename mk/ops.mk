# Operator artifacts (dashboards/, docker/): validated by real tools, see ops-tests/README.md.
# Included by the root Makefile (-include mk/*.mk); check.sh installs its tools under .cache/.
#
#   make ops-check                          builds target/debug/rootrank for coordinator-smoke
#   make ops-check ROOTRANK_BIN=/path/bin   uses that binary, builds nothing

.PHONY: ops-check ops-bin

ifeq ($(strip $(ROOTRANK_BIN)),)
OPS_BIN := $(CURDIR)/target/debug/rootrank
ops-check: ops-bin
else
OPS_BIN := $(ROOTRANK_BIN)
endif

# The checks, then the self-test that proves each check can fail.
ops-check:
	@ROOTRANK_BIN="$(OPS_BIN)" bash ops-tests/check.sh
	@ROOTRANK_BIN="$(OPS_BIN)" bash ops-tests/check.sh --self-test

# The coordinator binary only (the image's ENTRYPOINT); `make test` builds it anyway.
ops-bin: deps
	$(CARGO) build --bin rootrank

# `make test` runs the ops checks too (GNU make merges the prerequisites of `test`).
test: ops-check
