# mmnanhook: the two README commands are `make demo` and `make test`.
SHELL := /bin/bash
# One torch thread: on 2 shared cores, two threads stall tiny-detector
# iterations for seconds (tests, demo, benchmarks alike).
export OMP_NUM_THREADS ?= 1
# The slowest tests of each leg at the end of its log: where the time goes.
PYTEST_ARGS ?= -ra --durations=15

.PHONY: setup setup-modern setup-dota setup-codebases setup-browser device-wheels device-check test test-modern test-dota test-codebases test-zoo test-zoo-modern test-zoo-dota test-zoo-codebases test-all test-mmengine test-wheel lint demo demo-dota

## setup: the three legs and the browser, at the same time.
setup:
	scripts/setup_all.sh

setup-modern:
	scripts/setup_leg.sh modern

setup-dota:
	scripts/setup_leg.sh dota

## setup-codebases: the third leg (mmpretrain, mmpose, mmagic; scripts/leg.sh).
setup-codebases:
	scripts/setup_leg.sh codebases

## setup-browser: headless Chromium for the report.html tests (skip without).
setup-browser:
	scripts/setup_browser.sh

lint:
	scripts/lint.sh

# The tiers are one suite split by a marker (pytest.ini): `zoo_full` tests run
# in `make test-zoo` only; every other test runs in `make test`.
EVERYDAY := -m 'not zoo_full'
ZOO := -m zoo_full
# Seconds a leg of a tier may run before it is stopped and fails (a hang):
# about 3x what each takes here (11 and 24 min, docs/development.md).
export EVERYDAY_BOUND := 1800
export ZOO_BOUND := 3600

## test: the everyday tier, every leg, two at a time (sets them up first); each
## leg's log in test-logs/, printed whole at the end.
test: setup lint
	MMNANHOOK_LEG_TIMEOUT=$(EVERYDAY_BOUND) scripts/test_all.sh $(EVERYDAY) $(PYTEST_ARGS)

test-modern: setup-modern setup-browser
	scripts/test_leg.sh modern $(EVERYDAY) $(PYTEST_ARGS)

test-dota: setup-dota
	scripts/test_leg.sh dota $(EVERYDAY) $(PYTEST_ARGS)

test-codebases: setup-codebases
	scripts/test_leg.sh codebases $(EVERYDAY) $(PYTEST_ARGS)

## test-zoo: the full zoo tier, every leg, two at a time; logs in test-logs/zoo/.
test-zoo: setup
	MMNANHOOK_TEST_LOGS=test-logs/zoo MMNANHOOK_LEG_TIMEOUT=$(ZOO_BOUND) scripts/test_all.sh $(ZOO) $(PYTEST_ARGS)

test-zoo-modern: setup-modern
	scripts/test_leg.sh modern $(ZOO) $(PYTEST_ARGS)

test-zoo-dota: setup-dota
	scripts/test_leg.sh dota $(ZOO) $(PYTEST_ARGS)

test-zoo-codebases: setup-codebases
	scripts/test_leg.sh codebases $(ZOO) $(PYTEST_ARGS)

## test-all: make test, make test-zoo, make test-mmengine and make test-wheel,
## each timed (scripts/test_tiers.sh); what .ci/run runs.
test-all: setup lint
	scripts/test_tiers.sh $(PYTEST_ARGS)

## test-mmengine: a core subset on older mmengine releases (0.7.1, 0.9.1), each
## laid over both legs (scripts/test_mmengine.sh); .ci/run runs it after make test.
test-mmengine: setup-modern setup-dota
	scripts/test_mmengine.sh $(PYTEST_ARGS)

## test-wheel: the built wheel and sdist, installed non-editable into fresh
## venvs of both legs' pins and used from an empty directory (demo, a zoo
## config through tools/train.py with the mmnanhook:: base, replay);
## logs in test-logs/wheel/.
test-wheel:
	scripts/test_wheel.sh

## demo: the main job, on the modern leg (mmdet).
demo: setup-modern
	.venv/bin/mmnan demo

## demo-dota: the same on the DOTA leg (mmrotate, rotated RetinaNet).
demo-dota: setup-dota
	.venv-dota/bin/mmnan demo --dota

## device-wheels: what the device machine lacks (mmengine ...), into .device/wheels.
device-wheels:
	scripts/device_wheels.sh

## device-check: the CUDA checks; on a device machine (run tool, carry .device),
## or here as a CPU dry run with the modern leg (the toy's CUDA tests skip; the
## zoo R50's tests and benchmark run on the CPU, small: MMNAN_DEVICE_DRYRUN=cpu).
device-check: device-wheels
	DEVICE_PYTHON=$${DEVICE_PYTHON:-.venv/bin/python} MMNAN_DEVICE_DRYRUN=$${MMNAN_DEVICE_DRYRUN-cpu} scripts/device_check.sh
