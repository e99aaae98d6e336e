# sessionflow — the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
BROKER_PORT ?= 9092
export BROKER_PORT

.PHONY: demo demo-k8s test unit e2e build lint fmt clippy broker broker-stop clean

## demo: the four-stage pipeline (ingest → nlu → llm → delivery), one worker process per stage,
## faults at every stage, verified at the end. The broker is embedded (librdkafka's mock
## cluster) unless BROKERS=host:port names a real one (e.g. after `make broker`: Apache Kafka).
DEMO_RECORDS ?= 120000
DEMO_RATE ?= 2000
DEMO_SESSIONS ?= 1000
BROKERS ?=
demo:
	DEMO_RECORDS=$(DEMO_RECORDS) DEMO_RATE=$(DEMO_RATE) DEMO_SESSIONS=$(DEMO_SESSIONS) \
	  BROKERS=$(BROKERS) CARGO=$(CARGO) scripts/demo.sh

## demo-k8s: the same pipeline on a local Kubernetes control plane (scripts/cluster.sh; built
## once, ~10 min, Go 1.26): Apache Kafka, `helm install` of the chart, `kubectl apply` of
## examples/k8s/conversational.yaml, the workers and the operator run as local processes by a
## test kubelet, a burst of load, the llm stage scaled up and back down live, verified at the
## end (scripts/demo-k8s.sh: its header lists the DEMO_K8S_* settings)
demo-k8s:
	CARGO=$(CARGO) scripts/demo-k8s.sh

## test: build, then unit/property tests and end-to-end tests against Apache Kafka (scripts/kafka.sh:
## one node on BROKER_PORT…+3, started unless one runs there; needs Java 17 and Maven) and (when
## installed: scripts/apiserver.sh install) a real Kubernetes API server for the CRD tests, and
## (when installed: scripts/cluster.sh install) a local control plane for the operator's
## end-to-end tests (tests/tests/cluster)
## (cargo-nextest when installed: per-test processes and timeouts; cargo test otherwise)
test: build
	scripts/with-broker.sh scripts/with-apiserver.sh scripts/with-cluster.sh scripts/run-tests.sh

build:
	$(CARGO) build --workspace --all-targets

## lint: formatting and clippy, as CI checks them
lint: fmt clippy
fmt:
	$(CARGO) fmt --all -- --check
clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## broker / broker-stop: keep the test broker (Apache Kafka, one node on BROKER_PORT) running
## between commands
broker:
	scripts/kafka.sh start --port $(BROKER_PORT)
broker-stop:
	scripts/kafka.sh stop --port $(BROKER_PORT)

clean:
	$(CARGO) clean
	rm -rf .local

.PHONY: images image-test chart-check crd

## crd: regenerate the CRD (crds/ and the chart's copy), its reference and the worker config
## reference from the Rust types
crd:
	$(CARGO) run -q -p sessionflow-operator -- crd > crds/sessionpipeline.yaml
	cp crds/sessionpipeline.yaml charts/sessionflow/crds/sessionpipeline.yaml
	$(CARGO) run -q -p sessionflow-operator -- reference > docs/crd-reference.md
	$(CARGO) run -q -p sessionflow-operator -- reference --worker > docs/worker-config.md

## images: build the worker and operator images, $IMAGE_REGISTRY/sessionflow-{worker,operator}:
## <workspace version> (default ghcr.io/sessionflow; the tag is the chart's appVersion): `docker build` of Dockerfile.worker and
## Dockerfile.operator when a Docker engine answers, otherwise buildah (release binaries built
## once on the host with cargo auditable, packaged with the Dockerfiles' `prebuilt` target onto a
## distroless-equivalent base made from Debian packages: scripts/images.sh, scripts/image-base.sh)
## image-test: build both, then run the worker image as the operator's Deployment does against
## a local broker (builtin, HTTP and HTTPS handlers; SIGTERM, restart, verify), the operator
## image's `crd`, labels, dependency lists, sizes (scripts/image-test.sh; needs buildah, podman,
## runc: apt-get install buildah podman runc)
images:
	scripts/images.sh
image-test:
	scripts/image-test.sh

## chart-check: offline checks of charts/sessionflow (helm lint --strict, helm template |
## kubernetes-validate, CRD copy, dashboard JSON); installs helm 4 and kubernetes-validate
## under ~/.cache/sessionflow on first use
chart-check:
	scripts/chart-check.sh

## cluster-check: a local Kubernetes control plane (scripts/cluster.sh: etcd, kube-apiserver,
## controller-manager, scheduler, kwok fake nodes; built once into ~/.cache/sessionflow), left
## running, then scripts/cluster-check.sh (Deployment → Running pods, GC, SA token + RBAC)
.PHONY: cluster-check
cluster-check:
	scripts/cluster.sh start >/dev/null
	scripts/cluster-check.sh

.PHONY: bench bench-sweeps bench-smoke

# The harness's binary (cargo honours CARGO_TARGET_DIR; so does this).
BENCH_BIN = $(or $(CARGO_TARGET_DIR),target)/release/sessionflow-bench
# Runs the harness with $(1) against BROKERS, or against a local broker (started if none answers
# on BROKER_PORT, stopped afterwards if it was started).
define bench_run
	@if [ -n "$(BROKERS)" ]; then \
	  SESSIONFLOW_BENCH_GOAL=$@ $(BENCH_BIN) --brokers "$(BROKERS)" $(1); \
	else \
	  SESSIONFLOW_BENCH_GOAL=$@ scripts/with-broker.sh $(BENCH_BIN) \
	    --broker-pid-file .local/kafka-$(BROKER_PORT)/node-0/pid $(1); \
	fi
endef

## bench: sessionflow against a raw-consumer ceiling, a per-partition sequential consumer and a
## flat worker pool, scenarios P1–P5, then the growth sweeps ("How cost grows": sessions,
## partitions, record size, latency against offered load), on one broker (Apache Kafka on
## BROKER_PORT, or BROKERS=host:port); writes BENCHMARKS.md and bench/results/ (SVG charts,
## results.json); ~10 minutes on 2 cores (the sweeps ~4 of them)
bench:
	$(CARGO) build --release -p sessionflow-bench
	$(call bench_run,)

## bench-sweeps: the growth sweeps alone; replaces only their section of BENCHMARKS.md and their
## part of bench/results/results.json (BENCH_SCALE, default 1, shrinks them); ~4 minutes
BENCH_SCALE ?= 1
bench-sweeps:
	$(CARGO) build --release -p sessionflow-bench
	$(call bench_run,--only sweeps --scale $(BENCH_SCALE))

## bench-smoke: the whole harness (P1–P5 and the sweeps) at --scale 0.02 against the local
## broker, the report in a temporary directory (printed; BENCHMARKS.md is not touched): checks
## that every run works end to end, asserts no times; ~1.5 minutes on 2 cores
bench-smoke:
	$(CARGO) build --release -p sessionflow-bench
	$(eval SMOKE_DIR := $(shell mktemp -d -t sessionflow-bench-smoke.XXXXXX))
	@echo "bench-smoke: report in $(SMOKE_DIR)"
	$(call bench_run,--scale 0.02 --out $(SMOKE_DIR)/BENCHMARKS.md --results-dir $(SMOKE_DIR)/results --log-dir $(SMOKE_DIR)/logs)
	@echo "bench-smoke: report in $(SMOKE_DIR)/BENCHMARKS.md"

## bench-pc: sessionflow, the per-partition sequential consumer and the Confluent Parallel
## Consumer (KEY ordering, bench/parallel-consumer/) side by side, scenarios BENCH_PC_ONLY
## (default p1,p2,p3,p4), on the local Apache Kafka; replaces only its own section of
## BENCHMARKS.md (charts and results.json in bench/results/pc). Needs Java 17 and Maven (the jar
## is built by bench-pc-jar); ~25 minutes on 2 cores (PC drains P1 slowly: 5 rounds, capped)
BENCH_PC_ONLY ?= p1,p2,p3,p4
BENCH_PC_SYSTEMS = sessionflow,sequential,parallel-consumer
bench-pc: bench-pc-jar
	$(CARGO) build --release -p sessionflow-bench
	$(call bench_run,--only $(BENCH_PC_ONLY) --systems $(BENCH_PC_SYSTEMS) --results-dir bench/results/pc)

## bench-pc-jar: the Parallel Consumer's bench main, one jar with its dependencies (mvn package;
## Maven's cache in ~/.m2); rebuilt only when its pom or source changed. The harness does the
## same on first use.
PC_JAR = bench/parallel-consumer/target/sessionflow-bench-pc.jar
bench-pc-jar: $(PC_JAR)
$(PC_JAR): bench/parallel-consumer/pom.xml $(shell find bench/parallel-consumer/src -name '*.java')
	cd bench/parallel-consumer && mvn -q -B package

## bench-eos: the cost of exactlyOnce (issue 35): sessionflow, and the same stage at a 100 ms
## commit interval in atLeastOnce and exactlyOnce, P1 and P2 (BENCH_EOS_ONLY); the report goes to
## a temporary folder (printed), not BENCHMARKS.md — its numbers are copied by hand into
## bench/NOTES.md; ~3–5 minutes on 2 cores. Needs Apache Kafka (transactions).
BENCH_EOS_ONLY ?= p1,p2
BENCH_EOS_SYSTEMS = sessionflow,sessionflow-alo100,sessionflow-eos
.PHONY: bench-eos
bench-eos:
	$(CARGO) build --release -p sessionflow-bench
	$(eval EOS_DIR := $(shell mktemp -d -t sessionflow-bench-eos.XXXXXX))
	$(call bench_run,--only $(BENCH_EOS_ONLY) --systems $(BENCH_EOS_SYSTEMS) --out $(EOS_DIR)/BENCHMARKS.md --results-dir $(EOS_DIR)/results --log-dir $(EOS_DIR)/logs)
	@echo "bench-eos: report in $(EOS_DIR)/BENCHMARKS.md"

.PHONY: bench-pc bench-pc-jar callgrind

## callgrind: instructions per record of a fixed workload (50,000 records, 1,000 Zipf sessions,
## 8 partitions, no-op handler, on Apache Kafka on BROKER_PORT or BROKERS=host:port; the
## clients' instructions only, from the system's start to its last record) under valgrind's
## callgrind, for sessionflow, the raw consumer and the per-partition sequential consumer (issue
## 37 compares sessionflow with it); independent of the machine's load.
## Breakdowns in target/callgrind/. Needs valgrind; ~2 minutes
callgrind:
	$(CARGO) build --release -p sessionflow-bench
	$(if $(BROKERS),SESSIONFLOW_BROKERS=$(BROKERS)) scripts/with-broker.sh sh -c \
	  'for s in ceiling sessionflow sequential; do bench/callgrind.sh $$s || exit 1; done'

.PHONY: chaos

## chaos: the randomized nemesis run: worker processes against a cluster (CHAOS_CLUSTER=kafka,
## the default: 3 nodes of Apache Kafka, scripts/kafka.sh on CHAOS_KAFKA_PORT…+11, each behind a
## toxiproxy proxy, API on CHAOS_KAFKA_PORT+12 (scripts/toxiproxy.sh install builds it);
## CHAOS_CLUSTER=mock: librdkafka's mock cluster in the chaos process) under a schedule of
## faults drawn from CHAOS_SEED (default: the time, printed), CHAOS_SECONDS long, load from
## loadgen (CHAOS_DELIVERY=exactlyOnce: the workers in `delivery: exactlyOnce`, Kafka only,
## judged also on 0 stale ends and no duplicate the input lacks, in the committed output);
## ends with verify and committed == end, prints the schedule and a one-line verdict,
## exits 1 unless OK. Logs under .local/chaos/.
## A harness that dies (the mock cluster's own assertions abort it) cannot stop its workers,
## its Kafka nodes or its toxiproxy: they are stopped after it, so none is left running. The
## workers' command lines name their config by its absolute path, so only this checkout's are
## killed (`[.]` keeps the pattern from matching the shell that runs pkill); the nodes are this
## port's (kafka.sh stop), toxiproxy the one whose pid the harness wrote.
CHAOS_SEED ?=
CHAOS_SECONDS ?= 120
CHAOS_CLUSTER ?= kafka
CHAOS_KAFKA_PORT ?= 19300
CHAOS_DELIVERY ?=
chaos:
	$(CARGO) build -p sessionflow-worker --bin sessionflow-worker -p sessionflow-tests --bin sessionflow-chaos
	@if [ "$(CHAOS_CLUSTER)" = kafka ]; then scripts/kafka.sh install && scripts/toxiproxy.sh install; fi
	CHAOS_SEED=$(CHAOS_SEED) CHAOS_SECONDS=$(CHAOS_SECONDS) CHAOS_CLUSTER=$(CHAOS_CLUSTER) \
	  CHAOS_KAFKA_PORT=$(CHAOS_KAFKA_PORT) CHAOS_DELIVERY=$(CHAOS_DELIVERY) \
	  $${CARGO_TARGET_DIR:-target}/debug/sessionflow-chaos; status=$$?; \
	  pkill -KILL -f 'sessionflow-worker run --config $(CURDIR)/[.]local/chaos/' || true; \
	  if [ "$(CHAOS_CLUSTER)" = kafka ]; then \
	    pidf=.local/chaos/toxiproxy-$(CHAOS_KAFKA_PORT).pid; \
	    if [ -f $$pidf ]; then kill -KILL "$$(cat $$pidf)" 2>/dev/null || true; rm -f $$pidf; fi; \
	    scripts/kafka.sh stop --port $(CHAOS_KAFKA_PORT) >/dev/null 2>&1 || true; \
	  fi; exit $$status
