# Tally: two commands work on a fresh machine: `make run` and `make test`.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: run test lint unit check-deploy bench soak fleet load clean

## Serve the API on 127.0.0.1:8080 with the embedded store.
run:
	$(CARGO) run --release --bin tally

## Everything CI checks: formatting, lints, every test, the deploy/ validation.
test: lint unit check-deploy

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets --locked -- -D warnings

unit:
	$(CARGO) test --locked

## Validate deploy/ (k8s schemas, nginx -t, dashboard, alert rules). Installs what it needs.
check-deploy:
	bash deploy/check.sh

## Criterion benches (store, fold, index, write loop).
bench:
	$(CARGO) bench --locked

## The deterministic simulation over thousands of seeds.
soak:
	TALLY_SIM_SEEDS=$${TALLY_SIM_SEEDS:-5000} $(CARGO) test --release --locked --test simulation -- --nocapture

## A local fleet of Tally processes behind nginx, against CELERIANT_ADDRESS.
fleet:
	$(CARGO) build --release --locked --bin tally
	bash deploy/fleet.sh

clean:
	$(CARGO) clean
