# sandbox-broker developer targets. `make test` is the one test command.
GO        ?= go
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X main.version=$(VERSION)
FUZZTIME  ?= 30s
STATICCHECK ?= $(shell command -v staticcheck 2>/dev/null || echo $(HOME)/go/bin/staticcheck)

.PHONY: build run test lint fuzz fuzz-smoke bench bench-agent docs runners image clean

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o bin/ ./cmd/sandbox-broker ./cmd/sandbox-agent

run:
	$(GO) run ./cmd/sandbox-broker serve

test:
	$(GO) test -race -count=1 -timeout 30m ./...

lint:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt: files above need formatting"; exit 1; }
	$(GO) mod tidy -diff # fails, printing the diff, unless go.mod/go.sum are tidy
	$(GO) vet ./...
	@test -x "$(STATICCHECK)" || $(GO) install honnef.co/go/tools/cmd/staticcheck@v0.8.2
	$(STATICCHECK) ./...
	$(GO) run ./cmd/sandbox-broker docs --check

# Each fuzz target runs for FUZZTIME (go test allows one -fuzz target per
# run); FUZZ_SHARD=i/n runs every n-th target from the i-th on.
FUZZ_SHARD ?= 1/1
fuzz:
	GO=$(GO) .ci/fuzz $(FUZZTIME) $(FUZZ_SHARD)

# A few seconds per target: what CI runs on every change.
fuzz-smoke:
	GO=$(GO) .ci/fuzz 2s

# Package micro-benchmarks, then the end-to-end engine figures (p50/p95
# through MCP HTTP, with docker-run, fresh-interpreter and bare Jupyter
# kernel baselines, and get_usage calls/s from 8 clients beside
# resources/templates/list), cold starts, session bursts, warm TypeScript
# and idle memory (beside docker run / docker exec), then signed
# download/upload throughput (MB/s beside http.FileServer), then hosted
# sessions against the CodeSandbox fake with injected latencies (beside
# one API call, one agent call and a bare command through the agent).
bench:
	$(GO) test -run '^$$' -bench . -benchmem -count=1 ./audit/ ./services/quota/ ./services/agent/ ./services/process/ ./services/rootfs/ ./middleware/...
	$(GO) test -run '^$$' -bench 'BenchmarkEngine|BenchmarkNotebook|BenchmarkUsageThroughput' -benchtime 40x -count=1 ./tests/
	$(GO) test -run '^$$' -bench 'BenchmarkColdStart|BenchmarkTypeScriptWarm' -benchtime 20x -count=1 ./tests/
	$(GO) test -run '^$$' -bench 'BenchmarkSessionBurst|BenchmarkIdleMemory' -benchtime 1x -count=1 ./tests/
	$(GO) test -run '^$$' -bench BenchmarkSignedFiles -benchtime 8x -count=1 ./tests/
	$(GO) test -run '^$$' -bench BenchmarkHostedSession -benchtime 20x -count=1 ./services/codesandbox/hosted/

# 100 agent tasks at once (the real Claude Code CLI against the fake model):
# wall time, errors, broker RSS, memory per session; needs the agent runner.
AGENT_BENCH_SESSIONS ?= 100
bench-agent:
	AGENT_BENCH_SESSIONS=$(AGENT_BENCH_SESSIONS) $(GO) test -run '^$$' -bench BenchmarkAgentTasks -benchtime 1x -count=1 -timeout 30m ./tests/

docs:
	$(GO) run ./cmd/sandbox-broker docs

runners:
	runners/build.sh

image: build
	runners/base/build-base.sh
	docker build --network none -t sandbox-broker:$(VERSION) -t sandbox-broker:latest .

clean:
	rm -rf bin
