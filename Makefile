# Tally: two commands work on a fresh machine: `make run` and `make test`.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: run test lint unit check-deploy bench soak fleet load clean browser

## Serve the API on 127.0.0.1:8080 with the embedded store.
run:
	$(CARGO) run --release --bin tally

## Everything CI checks: formatting, lints, every test, the deploy/ validation.
test: lint browser unit check-deploy

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets --locked -- -D warnings

unit:
	TALLY_REQUIRE_BROWSER=1 $(CARGO) test --locked

# Console and watch stream (issue 16): the console's browser test drives headless Debian
# Chromium through chromedriver; install both when missing (Debian/Ubuntu, as root or
# with sudo). Without them `cargo test` skips that one test; `make test` requires it.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	else \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends chromium chromium-driver; \
	fi

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
