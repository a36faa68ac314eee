# Tally: two commands work on a fresh machine: `make run` and `make test`.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: run test lint unit unit-suites check-deploy bench soak fleet load clean

## Serve the API on 127.0.0.1:8080 with the embedded store.
run:
	$(CARGO) run --release --bin tally

## Everything CI checks: formatting, lints, every test, the deploy/ validation.
test: lint unit check-deploy

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets --locked -- -D warnings

unit:
	bash scripts/with-postgres.sh $(MAKE) --no-print-directory unit-suites

# The Postgres projection (issue 14): every suite runs inside one throwaway Postgres cluster
# (scripts/with-postgres.sh: installs Debian's postgresql when missing, exports
# TALLY_TEST_POSTGRES_URL, tears the cluster down after). tests/postgres.rs uses it, and the
# API and fleet suites run a second time on the Postgres projection.
unit-suites:
	$(CARGO) test --locked
	TALLY_TEST_PROJECTION=postgres $(CARGO) test --locked --test api --test fleet

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
