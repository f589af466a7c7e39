# Two commands do everything on a fresh machine:
#   make lab    create .venv if needed, install the course, start JupyterLab in the course folder
#   make test   the same set-up, then every test: unit, real 2-rank launches, notebooks in smoke mode
# Run again, each skips the set-up that is already done.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The PyTorch the course is tested with. pyproject.toml accepts any torch >= 2.6; without
# this pin pip would fetch the newest release. A GPU box whose driver wants another CUDA
# build can choose its wheels, e.g.
#   make lab TORCH="torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cu126"
TORCH  ?= torch==2.14.1 torchvision==0.29.1

.PHONY: lab test test-fast test-full test-slurm exercises restore doctor bench clean-runs

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install $(TORCH)
	$(PY) -m pip install -e ".[test]"
	@touch $(STAMP)

# The course folder is the root, so that notebooks/, exercises/ and solutions/ are all in reach.
# JupyterLab refuses to run as root (common in containers) unless told to: it is told, with a warning.
AS_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
lab: $(STAMP)
	@$(if $(AS_ROOT),echo "warning: running JupyterLab as root (a container?); prefer an ordinary user.")
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=. $(AS_ROOT)

# LABKIT_SMOKE=1: notebooks run their smoke mode (tiny data, 2 CPU ranks at most).
test: $(STAMP)
	LABKIT_SMOKE=1 $(PY) -m pytest

# Unit tests only (no launches, no notebooks): seconds, for the edit-run loop.
test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not launch and not notebook"

# Every lesson in full mode as well, as a learner runs it by default (tens of minutes on a laptop).
test-full: $(STAMP)
	LABKIT_SMOKE=1 $(PY) -m pytest --full

# Lesson 08's Slurm part on a real cluster of one machine: munged, slurmctld and two slurmd
# (nodes n1 and n2, ports 17000-17002), config in a temporary folder. As root it installs the
# Debian packages first if they are missing (slurmctld slurmd slurm-client munge); elsewhere it
# says why it skips. Every daemon it started is stopped, by pid, whatever happens.
test-slurm: $(STAMP)
	LABKIT_SMOKE=1 $(PY) -m labkit._slurm_cluster run --install -- \
		$(PY) -m pytest tests/test_slurm.py tests/test_slurm_cluster.py

# Regenerate exercises/ from solutions/ (a changed exercise is backed up to exercises/backup/).
exercises: $(STAMP)
	$(PY) -m labkit.exercises generate

# Put one exercise back as it was handed out: make restore EX=02 (your version goes to exercises/backup/).
restore: $(STAMP)
	@test -n "$(EX)" || { echo "usage: make restore EX=02   (the exercise's number, name or id)" >&2; exit 2; }
	$(PY) -m labkit.exercises restore "$(EX)"

# The set-up check for one seat of a workshop: the report and a first 2-rank launch; fails on a warning.
doctor: $(STAMP)
	$(PY) -c "import labkit, sys; report = labkit.doctor(launch=True); print(report); sys.exit(0 if report.ok else 1)"

bench: $(STAMP)
	$(PY) benchmarks/launch_overhead.py
	$(PY) benchmarks/metrics_cost.py

clean-runs:
	find . -path ./$(VENV) -prune -o -type d -name runs -prune -exec rm -rf {} +
