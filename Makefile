# The two commands of the README. Each installs what it needs first (scripts/setup.sh).
VENV ?= .venv

.PHONY: demo test setup up load clean

demo: setup
	$(VENV)/bin/sightline demo

test: setup
	$(VENV)/bin/python -m pytest -q

up: setup
	$(VENV)/bin/sightline up

load:
	$(VENV)/bin/sightline load --url http://127.0.0.1:8000

setup:
	@bash scripts/setup.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
