# Two commands for a fresh machine: `make demo` (set up, serve, replay a trace, stop) and `make test`.
.PHONY: setup demo lint test test-unit test-e2e lock

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

lint: setup
	.venv/bin/ruff check .

test: lint
	.venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=25

test-unit: lint
	.venv/bin/python -m pytest tests/unit -q -p no:cacheprovider

test-e2e: setup
	.venv/bin/python -m pytest tests/e2e -q -p no:cacheprovider --durations=25

# re-pin constraints.txt to what .venv now holds (after changing a dependency and running setup)
lock:
	.venv/bin/python -m baton.tools.lock
