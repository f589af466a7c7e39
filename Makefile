# Two commands do everything on a fresh machine:
#   make lab    create .venv if needed, install the course, start JupyterLab in the course folder
#   make test   the same set-up, then every test: unit, real 2-rank launches, notebooks in smoke mode
#   make test-scale     every lesson and exercise check at 4 CPU ranks, launch tests at 3 (CI runs it)
#   make test-repeat    the lessons that kill, time out or restart ranks, 10 runs in a row
#   make test-browser   the lessons in a real JupyterLab, driven by headless Chromium (CI runs it too)
#   make test-gpu       on a machine with a CUDA GPU: every GPU path of the course, with plain python3
# Run again, each skips the set-up that is already done.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The PyTorch the course is tested with. pyproject.toml accepts any torch >= 2.6; without
# this pin pip would fetch the newest release. Other wheels of the same release, e.g. the
# CPU-only ones for laptops without an NVIDIA GPU (a fraction of the download), or another
# CUDA build for a GPU box whose driver wants it:
#   make lab TORCH="torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cpu"
#   make lab TORCH="torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cu126"
TORCH  ?= torch==2.14.1 torchvision==0.29.1
# A room on one connection: `make wheelhouse` downloads every wheel the set-up installs, once,
# into wheelhouse/ (on a machine like the seats: same system, same Python). Copy that folder to
# each seat, where `make lab WHEELS=wheelhouse` installs from it alone, without the network.
WHEELS ?=
PIP_FROM = $(if $(WHEELS),--no-index --find-links $(WHEELS))
# Every package the set-up installs, at the version the tests passed with (pip's constraints), so
# that every seat of a room gets the same: `make lock` writes it from .venv (tools/lock.py). A
# TORCH with its own --index-url takes torch's wheels, and their dependencies, from that index,
# whose versions differ from PyPI's: the lock then applies from the next step on, which brings
# every other package to its locked version (torch's own line, 2.14.1, fits its +cpu builds too).
LOCK   := requirements.lock
PIN     = $(if $(wildcard $(LOCK)),-c $(LOCK))
PIN_TORCH = $(if $(findstring --index-url,$(TORCH)),,$(PIN))

.PHONY: lab test test-fast test-full test-scale test-repeat test-browser test-slurm test-gpu gpu-wheels exercises restore doctor bench clean-runs handout wheelhouse lock

# The set-up runs again when what it installs changes: the content of pyproject.toml, the lock or TORCH.
# The stamp holds their checksum (not a time: a fresh clone next to an existing .venv looks
# newer than it, yet needs nothing installed).
SETUP := $(shell { printf '%s\n' '$(TORCH)'; cat pyproject.toml $(wildcard $(LOCK)); } | cksum)
ifneq ($(SETUP),$(shell cat $(STAMP) 2>/dev/null))
.PHONY: $(STAMP)
endif
$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade $(PIP_FROM) pip >/dev/null
	$(PY) -m pip install $(PIP_FROM) $(PIN_TORCH) $(TORCH)
	$(PY) -m pip install $(PIP_FROM) $(PIN) -e ".[test]"
	@echo '$(SETUP)' > $(STAMP)

# The course folder is the root, so that notebooks/, exercises/ and solutions/ are all in reach.
# JupyterLab refuses to run as root (common in containers) unless told to: it is told, with a warning.
AS_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
lab: $(STAMP)
	@$(if $(AS_ROOT),echo "warning: running JupyterLab as root (a container?); prefer an ordinary user.")
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=. $(AS_ROOT)

# LABKIT_SMOKE=1: notebooks run their smoke mode (tiny data, 2 CPU ranks at most). Two passes, each
# to its end: every test but the lessons' own runs, in JOBS pytest workers at once (a launch is
# mostly waiting on start-up, rendezvous and timeouts: on 2 cores the tests without notebooks took
# 18 minutes in two workers, 33 in one), then the lessons (marked `alone`) one at a time, each timed
# against its one-minute bar with nothing beside it. JOBS=0 runs the first pass in one process.
JOBS ?= 2
test: $(STAMP)
	LABKIT_SMOKE=1 $(PY) -m pytest -n $(JOBS) -m "not alone"; rest=$$?; \
	LABKIT_SMOKE=1 $(PY) -m pytest -m alone; lessons=$$?; \
	test $$rest = 0 && test $$lessons = 0

# Unit tests only (no launches, no notebooks): seconds, for the edit-run loop.
test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not launch and not notebook"

# The sizes learners run: every lesson and every exercise's check (the solutions) in smoke mode at
# LABKIT_RANKS=4 CPU ranks (two nodes of two, a 2 x 2 mesh, four pipeline stages; 1 thread each on
# 2 cores), then the launch tests whose claim holds at any world size at 3 ranks (an odd size finds
# what assumes 2). Both parts run; it fails if either did.
test-scale: $(STAMP)
	LABKIT_SMOKE=1 $(PY) -m pytest --ranks 4 tests/test_notebooks.py::test_executes_in_smoke_mode \
		tests/test_exercises.py::test_a_solution_passes_every_check; lessons=$$?; \
	LABKIT_SMOKE=1 $(PY) -m pytest -n $(JOBS) --ranks 3 -m ranks tests; launches=$$?; \
	test $$lessons = 0 && test $$launches = 0

# A lesson that kills, times out or restarts ranks must not flake: before a change to one lands, it
# passes REPEAT (10) smoke runs in a row, the lessons taking turns as a learner's would follow each
# other. It stops at the first failure and says which run it was. LESSONS picks others; RANKS=4
# runs them at 4 CPU ranks (about 27 minutes for the three at 2 ranks on 2 cores, 29 at 4 ranks).
LESSONS ?= 05_checkpointing 09_multinode 10_faults
REPEAT  ?= 10
RANKS   ?=
test-repeat: $(STAMP)
	@for i in $$(seq $(REPEAT)); do for lesson in $(LESSONS); do \
		echo "=== run $$i of $(REPEAT): $$lesson"; \
		LABKIT_SMOKE=1 $(PY) -m pytest -q $(if $(RANKS),--ranks $(RANKS)) \
			"tests/test_notebooks.py::test_executes_in_smoke_mode[$$lesson]" || \
			{ echo "$$lesson failed in run $$i of $(REPEAT)" >&2; exit 1; }; \
	done; done; echo "$(LESSONS): $(REPEAT) runs in a row, every one passed"

# Every lesson in full mode as well, as a learner runs it by default (tens of minutes on a laptop).
test-full: $(STAMP)
	LABKIT_SMOKE=1 $(PY) -m pytest --full

# The course as a learner uses it: JupyterLab (smoke mode, a copy of the course under /tmp) driven
# by headless Chromium through Playwright: Run All, the live chart, interrupt, restart, a check.
# Installs what is missing: Playwright into .venv, Debian's chromium with apt when run as root
# (Playwright cannot fetch its own browsers offline); without chromium the tests skip and say why.
# Screenshots of every step: build/browser/<test>/.
test-browser: $(STAMP)
	@$(PY) -c "import playwright" 2>/dev/null || $(PY) -m pip install $(PIP_FROM) playwright
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    { apt-get update -qq && apt-get install -y -qq chromium; } || \
	      echo "apt-get could not install chromium: the browser tests will skip"; \
	  else echo "no chromium, and not root to install it: the browser tests will skip (apt-get install chromium)"; fi
	LABKIT_SMOKE=1 $(PY) -m pytest --browser tests/test_browser.py

# Lesson 09's Slurm part on a real cluster of one machine: munged, slurmctld and two slurmd
# (nodes n1 and n2, ports 17000-17002), config in a temporary folder. As root it installs the
# Debian packages first if they are missing (slurmctld slurmd slurm-client munge); elsewhere it
# says why it skips. Every daemon it started is stopped, by pid, whatever happens.
test-slurm: $(STAMP)
	LABKIT_SMOKE=1 $(PY) tools/slurm_cluster.py run --install -- \
		$(PY) -m pytest tests/test_slurm.py tests/test_slurm_cluster.py

# Every GPU path one CUDA GPU can run, without Jupyter (CONTRIBUTING: Commands): doctor, the tests
# marked gpu, and each lesson's GPU path from its committed script, in under 8 minutes, then a
# summary of what ran, skipped and failed, with torch, CUDA and the GPU named (also in
# build/gpu-check/summary.md). It uses $(PYTHON) as it is (torch with CUDA, pytest, pandas,
# matplotlib) and sets nothing up. Without a GPU it lists every step as skipped, says why, and exits
# 0; a GPU this Python cannot use exits 2 with a HINT. REHEARSE=1 runs every step's plumbing on CPU
# ranks with small sizes (PYTHON=.venv/bin/python here), to find a slip before the GPU machine does.
test-gpu:
	PYTHONPATH=. $(PYTHON) tools/gpu_check.py $(if $(REHEARSE),--rehearse)

# The wheels test-gpu needs beyond torch, pytest, pandas and matplotlib (psutil), for a GPU machine
# without network: downloaded here into gpu-wheels/, copied there with the course folder; the check
# unpacks them itself. GPU_PLATFORM names the GPU machine's system (aarch64: manylinux2014_aarch64).
GPU_PLATFORM ?= manylinux2014_x86_64
gpu-wheels:
	$(PYTHON) -m pip download --only-binary=:all: --no-deps --platform $(GPU_PLATFORM) \
		-d gpu-wheels $(PIN) psutil

# Regenerate exercises/ from solutions/ (a changed exercise is backed up to exercises/backup/).
exercises: $(STAMP)
	$(PY) -m labkit.exercises generate

# Put one exercise back as it was handed out: make restore EX=02 (your version goes to exercises/backup/).
restore: $(STAMP)
	@test -n "$(EX)" || { echo "usage: make restore EX=02   (the exercise's number, name or id)" >&2; exit 2; }
	$(PY) -m labkit.exercises restore "$(EX)"

# The set-up check for one seat of a workshop: the report and a first 2-rank launch; fails on a warning.
# Before a launch on several nodes, `make doctor NODES=2` runs labkit.preflight instead, on that
# many loopback nodes here (SLURM=1: on the nodes of a Slurm job; PORT= the rendezvous port,
# CKPT= the checkpoint folder every node must share): what will break, each with its fix.
doctor: $(STAMP)
ifeq ($(NODES),)
	$(PY) -c "import labkit, sys; report = labkit.doctor(launch=True); print(report); sys.exit(0 if report.ok else 1)"
else
	$(PY) -m labkit._diagnose.preflight --nnodes "$(NODES)" $(if $(SLURM),--slurm) \
		$(if $(PORT),--port "$(PORT)") $(if $(CKPT),--checkpoint-dir "$(CKPT)")
endif

bench: $(STAMP)
	$(PY) benchmarks/launch_overhead.py
	$(PY) benchmarks/metrics_cost.py

# A workshop's hand-out: the branch `handout`, the course without its answers, made from the
# last commit (README: For instructors). It needs git and Python's standard library only.
handout:
	$(PYTHON) -m labkit.handout

# Every wheel the set-up installs, for the seats of a room: see WHEELS above. TORCH's own
# options (an --index-url) apply to its wheels only; the rest come from PyPI.
wheelhouse:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip download -d $(or $(WHEELS),wheelhouse) $(PIN_TORCH) $(TORCH)
	$(PY) -m pip download -d $(or $(WHEELS),wheelhouse) --find-links $(or $(WHEELS),wheelhouse) \
		$(PIN) pip "setuptools>=77" $(filter torch%,$(TORCH)) ".[test]"

# Pin the tested set-up: after the tests pass in .venv, write the version of every package it
# installed for the course to requirements.lock (commit it; the set-up above installs through it).
lock:
	@test -x $(PY) || { echo "no $(VENV) yet: run make test first, then make lock" >&2; exit 2; }
	$(PY) tools/lock.py $(LOCK)

clean-runs:
	find . -path ./$(VENV) -prune -o -type d -name runs -prune -exec rm -rf {} +
