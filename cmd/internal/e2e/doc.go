// Package e2e holds the multi-process end-to-end tests of the agent: they
// build the real pivirt-agent and pvcli binaries with the race detector,
// start three agents as separate processes on 127.0.0.1, with mutual TLS on
// every port from a PiTrust PKI made per cluster, and drive them with pvcli
// (operator certificate) the way an operator does.
//
// Fault tests: TestFaults (the leader SIGSTOPped past the election timeout,
// the leader and a follower SIGKILLed during writes, a follower's data dir
// full on a tmpfs the test mounts), TestPartitions (agents in network
// namespaces the test creates, cut apart with blackhole routes: the leader
// isolated, an asymmetric cut, a follower isolated) and
// TestCrashDuringSnapshots (SIGKILLs at random points of the snapshot and
// compaction cycle). The first two record histories with lincheck's
// clients and check them with porcupine. Mounting and namespaces need root:
// without it those parts skip, except in CI (CI set), where they fail.
// TestSoak runs only with PIVIRT_SOAK_DURATION (make soak).
//
// The package has no non-test code; run it
// with
//
//	go test -race -count=1 ./cmd/internal/e2e/
//
// and skip it with -short.
package e2e
