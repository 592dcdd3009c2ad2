# Set-up and checks for a fresh machine. `make test` and `make demo` create .venv/ themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# CPU build of torch, from local disk on the CI/dev machines; an unpinned `torch` pulls a multi-GB
# CUDA build. GPU machines install their own torch.
TORCH_CPU := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: venv system-tools test test-fast demo bench clean

# Debian tools the tests call, as TOOL:PACKAGE: systemd-analyze/sysusers/tmpfiles (unit checks),
# unshare (a private mount namespace), fio (bench io), strace (stretches expertd's mlock so a test
# can SIGTERM inside it; skipped without). Only the packages of missing tools are installed, and
# --no-upgrade leaves an installed package as it is.
SYSTEM_TOOLS := systemd-analyze:systemd systemd-sysusers:systemd systemd-tmpfiles:systemd unshare:util-linux \
                fio:fio strace:strace

system-tools:
	@missing=; for tp in $(SYSTEM_TOOLS); do \
	    command -v "$${tp%%:*}" >/dev/null && continue; \
	    case " $$missing " in *" $${tp#*:} "*) ;; *) missing="$$missing $${tp#*:}";; esac; \
	done; \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" != 0 ]; then \
	    echo "make: the tests need Debian packages that are not installed:$$missing" >&2; \
	    echo "make: installing them needs root: sudo apt-get install --no-upgrade$$missing (or sudo make system-tools)" >&2; \
	    exit 1; \
	fi; \
	echo "make: installing$$missing with apt-get (missing tools only; nothing installed is upgraded)"; \
	apt-get update -qq && apt-get install -y -qq --no-upgrade$$missing

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# On every core (pytest-xdist), a test module's tests on one worker, so that its fixtures (models,
# packs, daemons) are built once: about 19 minutes on 2 cores (BENCHMARKS.md, "CPU tests").
test: system-tools $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadscope tests

test-fast: system-tools $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadscope -m "not slow" tests

# The main job end to end on a tiny built-in model, on the CPU: synth, pack, expertd, expert-worker,
# one chat request over HTTP (scripts/demo.sh says what it does).
demo: $(STAMP)
	scripts/demo.sh

bench: $(STAMP)
	$(PY) bench/build_throughput.py

clean:
	rm -rf demo-out bench-out build dist *.egg-info
