# mmnanhook: the two README commands are `make demo` and `make test`.
SHELL := /bin/bash
# One torch thread: on 2 shared cores, two threads stall tiny-detector
# iterations for seconds (tests, demo, benchmarks alike).
export OMP_NUM_THREADS ?= 1
PYTEST_ARGS ?= -ra

.PHONY: setup setup-modern setup-dota setup-browser device-wheels device-check test test-modern test-dota lint demo demo-dota

setup: setup-modern setup-dota setup-browser

setup-modern:
	scripts/setup_leg.sh modern

setup-dota:
	scripts/setup_leg.sh dota

## setup-browser: headless Chromium for the report.html tests (skip without).
setup-browser:
	scripts/setup_browser.sh

lint:
	scripts/lint.sh

## test: both legs, the whole suite in each (sets them up first).
test: setup lint
	scripts/test_leg.sh modern $(PYTEST_ARGS)
	scripts/test_leg.sh dota $(PYTEST_ARGS)

test-modern: setup-modern setup-browser
	scripts/test_leg.sh modern $(PYTEST_ARGS)

test-dota: setup-dota
	scripts/test_leg.sh dota $(PYTEST_ARGS)

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
## or here as a CPU dry run with the modern leg (CUDA tests skip).
device-check: device-wheels
	DEVICE_PYTHON=$${DEVICE_PYTHON:-.venv/bin/python} scripts/device_check.sh
