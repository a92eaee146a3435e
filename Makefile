# Two commands for a fresh machine: `make demo` (set up, serve, replay a trace, stop) and `make test`.
.PHONY: setup demo test test-unit test-e2e

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

test: setup
	.venv/bin/python -m pytest tests -q -p no:cacheprovider

test-unit: setup
	.venv/bin/python -m pytest tests/unit -q -p no:cacheprovider

test-e2e: setup
	.venv/bin/python -m pytest tests/e2e -q -p no:cacheprovider
