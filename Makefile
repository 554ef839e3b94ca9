# pivirt-agent — run `make help` for the targets.
SHELL := /usr/bin/env bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

GO        ?= go
BIN       := bin
PKGS      := ./...
# A hang's bound, not a target: the longest package, cmd/internal/e2e, takes
# about 13 min on 2 idle cores and up to 20 beside the others on cold caches.
TEST_TIMEOUT ?= 30m
BENCHTIME ?= 5s
# The release is cmd/internal/version.Version (CHANGELOG.md); VERSION=…
# overrides it for a packaging build.
VERSION   ?=
REVISION  ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null)
LDFLAGS   := -X pilab.hu/pivirt-agent/cmd/internal/version.Revision=$(REVISION)$(if $(VERSION), -X pilab.hu/pivirt-agent/cmd/internal/version.Version=$(VERSION))

# The pinned Node tools (buf, protoc-gen-es, esbuild, TypeScript) and the
# UI's libraries; Node.js and npm themselves from Debian when missing.
# Defined before the rules that need it: make expands prerequisites as it
# reads them.
NODE_DEPS := node_modules/.package-lock.json

.PHONY: help
help: ## show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: build
build: ui ## build the web UI's assets and pivirt-agent, pvcli, pitrust and pivirtd-sim into bin/
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/ ./cmd/pivirt-agent ./cmd/pvcli ./cmd/pitrust ./cmd/pivirtd-sim

.PHONY: kube-apiserver
kube-apiserver: ## build kube-apiserver from source (kubetest/apiserver) for the operator's tests, once per machine: scripts/kube-apiserver.sh caches it
	scripts/kube-apiserver.sh >/dev/null

.PHONY: test
test: $(NODE_DEPS) kube-apiserver ## run every test with the race detector (real Raft, TCP, bbolt; multi-process tests use the built binaries; the web UI in headless Chromium)
	$(GO) test -race -timeout $(TEST_TIMEOUT) $(PKGS)

.PHONY: docs-run
docs-run: build ## run every sh block of README.md and docs/ against a cluster of make cluster (its fixed ports: nothing else may hold them), checking the outputs the documents show; PIVIRT_DOCS_RUN_PAGES=regexp picks pages
	PIVIRT_DOCS_RUN=1 $(GO) test -count=1 -timeout 40m -run '^TestDocsRun$$' -v ./cmd/internal/docrun/ 2>&1 | grep -v '^=== RUN'

.PHONY: lint
lint: ## gofmt, go vet, staticcheck, the import direction of DESIGN.md (test files too), the documents' citations and that every path and identifier they cite exists
	@out="$$(gofmt -l $$(git ls-files '*.go'))"; if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GO) tool staticcheck $(PKGS)
	scripts/check-imports.sh
	scripts/check-docs.sh
	$(GO) test -count=1 -run '^TestDocsCiteWhatExists$$' ./cmd/internal/docgen

$(NODE_DEPS): package.json package-lock.json
	scripts/node-deps.sh
	npm ci --no-audit --no-fund
	@touch $@

UI_SOURCES := $(shell find ui/src -type f 2>/dev/null) ui/index.html ui/build.mjs
ui/dist/index.html: $(NODE_DEPS) $(UI_SOURCES)
	node ui/build.mjs
	@touch $@

.PHONY: ui
ui: ui/dist/index.html ## build the web UI (ui/src → ui/dist, embedded in pivirt-agent); make build does this

.PHONY: check-ui
check-ui: $(NODE_DEPS) ## type-check the UI's TypeScript, run its unit tests, and fail if the committed ui/dist is stale
	npx tsc -p ui
	node ui/test.mjs
	node ui/build.mjs
	@git diff --exit-code -- ui/dist || { echo "ui/dist is stale: run make ui and commit"; exit 1; }
	@test -z "$$(git status --porcelain -- ui/dist)" || { git status --porcelain -- ui/dist; echo "untracked UI assets: run make ui and commit"; exit 1; }

.PHONY: generate
generate: $(NODE_DEPS) ## regenerate Go and the UI's TypeScript client from proto/ with buf (local plugins only), and the operator's CRD with controller-gen
	find proto -name '*.pb.go' -o -name '*.connect.go' | xargs -r rm -f
	rm -rf ui/src/gen
	npx buf generate
	npx buf lint
	# The ManagedCertificate CRD and its deepcopy functions, from the Go types.
	$(GO) tool controller-gen object paths=./cmd/internal/operator/certz/... crd:crdVersions=v1 output:crd:dir=./deploy/operator/crd

.PHONY: docs
docs: ## regenerate docs/: the CLI reference (markdown and man pages), the configuration, metrics and API references; the tests fail when they are stale
	UPDATE_DOCS=1 $(GO) test -count=1 -run '^(TestCLIReference|TestDocsConfigurationReference|TestDocsMetricsReference|TestDocsAPIReference)$$' ./cmd/pvcli ./cmd/pitrust ./cmd/pivirt-agent ./cmd/pivirtd-sim ./cmd/internal/config ./cmd/internal/agent

.PHONY: check-generate
check-generate: generate ## fail if the committed generated code is stale
	@git diff --exit-code -- proto ui/src/gen deploy/operator/crd cmd/internal/operator/certz || { echo "generated code is stale: run make generate and commit"; exit 1; }
	@test -z "$$(git status --porcelain -- proto ui/src/gen deploy/operator/crd cmd/internal/operator/certz)" || { git status --porcelain -- proto ui/src/gen deploy/operator/crd cmd/internal/operator/certz; echo "untracked generated files: run make generate and commit"; exit 1; }

.PHONY: fuzz
FUZZTIME ?= 30s
fuzz: ## run every fuzz target for FUZZTIME each (default 30s); found inputs go to testdata/fuzz
	FUZZTIME=$(FUZZTIME) scripts/fuzz.sh

.PHONY: security
security: ## the security suite: every attack of the threat model (docs/security.md) against real agents (make test runs these too)
	scripts/security.sh

.PHONY: conformance
conformance: ## the ConnectRPC conformance suite (pinned in conformance/go.mod) through a real agent to the suite's reference server as a routed gRPC backend
	scripts/conformance.sh

.PHONY: soak
DURATION ?= 10m
soak: ## mixed traffic through 3 real agents with leader kills for DURATION (default 10m): errors, p99, memory
	PIVIRT_SOAK_DURATION=$(DURATION) $(GO) test -v -count=1 -run '^TestSoak$$' -timeout 0 ./cmd/internal/e2e/ 2>&1 | grep --line-buffered -v '^=== '

.PHONY: restart-matrix
restart-matrix: ## every documented operation x SIGTERM|SIGKILL x all at once|rolling, restarting 3 real agents (Raft and etcd mode)
	PIVIRT_RESTART_MATRIX=1 $(GO) test -race -v -count=1 -run '^Test(Etcd)?RestartMatrix$$' -timeout 40m ./cmd/internal/e2e/ 2>&1 | grep --line-buffered -v '^=== '

.PHONY: scale
AGENTS ?= 100
INSTANCES ?= 100000
scale: ## AGENTS agents (default 100) in one process register INSTANCES instances (default 100000): convergence, promotion, memory
	PIVIRT_SCALE_AGENTS=$(AGENTS) PIVIRT_SCALE_INSTANCES=$(INSTANCES) $(GO) test -v -count=1 -run '^TestScale$$' -timeout 90m ./cmd/internal/agent/ 2>&1 | grep --line-buffered -v '^=== '

.PHONY: bench
bench: ## benchmarks: replicated writes and reads vs a 3-member etcd, snapshots, the gateway vs direct gRPC, a bare relay, HAProxy and nginx (installed when missing); same run
	scripts/bench-deps.sh
	$(GO) test -run '^$$' -bench . -benchtime $(BENCHTIME) -timeout 60m ./cmd/internal/bench/

.PHONY: package package-check
package: ## Debian packages of pivirt-agent, pvcli and pitrust in dist/ (nfpm, pinned in packaging/go.mod)
	scripts/package.sh
package-check: ## build the packages, lintian and systemd-analyze them, install them here (dpkg -i, root), start the installed agent, purge them
	scripts/package-check.sh

.PHONY: cluster demo
cluster: build ## build and start a 3-agent cluster on loopback, print pvcli commands to try
	scripts/cluster.sh start
demo: cluster ## alias of cluster

.PHONY: cluster-stop
cluster-stop: ## stop the local cluster started by make cluster
	scripts/cluster.sh stop

.PHONY: clean
clean: ## remove build output and the local cluster's data
	-scripts/cluster.sh stop
	rm -rf $(BIN) .cluster
