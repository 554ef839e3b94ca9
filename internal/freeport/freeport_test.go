package freeport

import (
	"net"
	"strconv"
	"testing"
)

func TestPickOutsideTheEphemeralRange(t *testing.T) {
	lo, hi := candidateRange()
	ports, err := Pick(20)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if seen[p] {
			t.Fatalf("port %d handed out twice in %v", p, ports)
		}
		seen[p] = true
		if hi > lo && (p < lo || p > hi) {
			t.Fatalf("port %d is outside %d-%d", p, lo, hi)
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Fatalf("port %d is not free: %v", p, err)
		}
		l.Close()
	}
	more, err := Pick(5)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range more {
		if seen[p] {
			t.Fatalf("port %d handed out again by a later pick", p)
		}
	}
}
