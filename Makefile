# The two commands of the README. Each installs what it needs first (scripts/setup.sh).
VENV ?= .venv

.PHONY: demo test setup clean

demo: setup
	$(VENV)/bin/sightline demo

test: setup
	$(VENV)/bin/python -m pytest -q

setup:
	@bash scripts/setup.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
