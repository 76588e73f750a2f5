# The README's commands. `make test` is what CI runs.
.PHONY: run test test-fast test-deploy lint bench hotspots soak dashboard

run:            ## the main job: install, model, Redis, a demo key, engine supervisor + gateway
	scripts/run

test:           ## the whole suite from a fresh clone: venv, install, ruff, mypy, pytest (all tiers)
	scripts/test

test-fast:      ## the suite without the real-vLLM tier
	scripts/test -m "not engine"

test-deploy:    ## the shipped units under a real systemd (a booted Debian container; root, minutes): install.sh, restart under load
	scripts/bootstrap
	scripts/deploy-root
	.venv/bin/pytest tests/deploy -m deploy -v

lint:
	scripts/bootstrap && .venv/bin/ruff check gateway engine_patches loadtest tests tools deploy && .venv/bin/mypy

bench:          ## gateway overhead vs the engine directly and vs nginx (the reference proxy): default settings, lean, tracing
	scripts/bootstrap
	@# nginx is the reference (its rows and the per-chunk ratio); as root it comes from Debian's packages, as for make test
	@command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light; } >/dev/null
	@command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || echo "== nginx is not installed (apt-get install nginx-light): its reference rows are left out"
	mkdir -p loadtest/results
	@echo "== default settings: access log on, NEMOTRON_WORKERS unset, an API key with limits on every request"
	.venv/bin/python -m loadtest.overhead --json loadtest/results/overhead-default.json
	@echo "== lean: access log off, one worker, no keys"
	.venv/bin/python -m loadtest.overhead --lean --json loadtest/results/overhead-lean.json
	@echo "== tracing: off, on sampled at 100 % and at 1 % (default settings, an OTLP sink), in the same rounds"
	.venv/bin/python -m loadtest.overhead --tracing --no-nginx --json loadtest/results/overhead-tracing.json
	@# the run's small summaries for the performance page (docs/performance.md: python -m tools.perf_doc renders them)
	.venv/bin/python -m loadtest.summary overhead loadtest/results/overhead-default.json loadtest/results/overhead-lean.json
	.venv/bin/python -m loadtest.summary tracing loadtest/results/overhead-tracing.json

hotspots:       ## where the gateway's CPU goes under the bench's load (py-spy, default settings; HOTSPOTS_ARGS="--lean")
	scripts/bootstrap
	.venv/bin/python -m loadtest.hotspots $(HOTSPOTS_ARGS)

soak:           ## a bounded soak (3 min; SOAK_ARGS="--duration 900" for longer, "--engine-url URL" for a real engine)
	scripts/bootstrap
	mkdir -p loadtest/results
	.venv/bin/python -m loadtest.soak $(SOAK_ARGS)
	.venv/bin/python -m loadtest.summary soak loadtest/results/soak.json

dashboard:      ## redraw deploy/grafana/nemotron-gateway.png from the monitoring test's Prometheus (a real prometheus; ~3 min)
	scripts/bootstrap
	NEMOTRON_TEST_DASHBOARD_PNG=deploy/grafana/nemotron-gateway.png .venv/bin/pytest tests/integration/test_monitoring.py -k dashboard_png
