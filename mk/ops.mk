# Operator artifacts (dashboards/, docker/): validated by real tools, see ops-tests/README.md.
# Included by the root Makefile (-include mk/*.mk); installs its tools under .cache/ itself.

.PHONY: ops-check

# The checks, then the self-test that proves each check can fail.
ops-check:
	@bash ops-tests/check.sh
	@bash ops-tests/check.sh --self-test

# `make test` runs the ops checks too (GNU make merges the prerequisites of `test`).
test: ops-check
