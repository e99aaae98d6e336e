# sessionflow — the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
BROKER_PORT ?= 9092
export BROKER_PORT

.PHONY: demo test unit e2e build lint fmt clippy broker broker-stop clean

## demo: a whole stage locally against a local broker, with faults, verified at the end
demo: build
	scripts/with-broker.sh scripts/demo.sh

## test: build, then unit/property tests and end-to-end tests against a real broker
## (cargo-nextest when installed: per-test processes and timeouts; cargo test otherwise)
test: build
	scripts/with-broker.sh scripts/run-tests.sh

build:
	$(CARGO) build --workspace --all-targets

## lint: formatting and clippy, as CI checks them
lint: fmt clippy
fmt:
	$(CARGO) fmt --all -- --check
clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## broker / broker-stop: keep a broker running between commands
broker:
	scripts/broker.sh start
broker-stop:
	scripts/broker.sh stop

clean:
	$(CARGO) clean
	rm -rf .local
