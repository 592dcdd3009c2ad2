# Set-up and checks for a fresh machine. `make test` and `make demo` create .venv/ themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# CPU build of torch, from local disk on the CI/dev machines; an unpinned `torch` pulls a multi-GB
# CUDA build. GPU machines install their own torch.
TORCH_CPU := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: venv system-tools test test-fast demo bench clean

# Debian tools the tests call: systemd-analyze/sysusers/tmpfiles (unit checks), unshare (util-linux),
# fio (bench io), strace (stretches expertd's mlock so a test can SIGTERM inside it; skipped without).
SYSTEM_TOOLS := systemd-analyze systemd-sysusers systemd-tmpfiles unshare fio strace

system-tools:
	@for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq systemd util-linux fio strace; fi

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# On every core (pytest-xdist), a test module's tests on one worker, so that its fixtures (models,
# packs, daemons) are built once: 19 minutes on 2 cores, where one process took 36.
test: $(STAMP) system-tools
	$(PY) -m pytest -q -n auto --dist loadscope tests

test-fast: $(STAMP) system-tools
	$(PY) -m pytest -q -n auto --dist loadscope -m "not slow" tests

# The main job end to end on a tiny built-in model, on the CPU: synth, pack, expertd, expert-worker,
# one chat request over HTTP (scripts/demo.sh says what it does).
demo: $(STAMP)
	scripts/demo.sh

bench: $(STAMP)
	$(PY) bench/build_throughput.py

clean:
	rm -rf demo-out bench-out build dist *.egg-info
