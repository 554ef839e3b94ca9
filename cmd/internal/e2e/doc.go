// Package e2e holds the multi-process end-to-end tests of the agent: they
// build the real pivirt-agent and pvcli binaries with the race detector,
// start three agents as separate processes on 127.0.0.1, with mutual TLS on
// every port from a PiTrust PKI made per cluster, and drive them with pvcli
// (operator certificate) the way an operator does. The package has no
// non-test code; run it
// with
//
//	go test -race -count=1 ./cmd/internal/e2e/
//
// and skip it with -short.
package e2e
