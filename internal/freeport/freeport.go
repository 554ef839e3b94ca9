// Package freeport picks loopback ports for processes that a test starts
// and that bind the ports themselves.
//
// A port asked of the kernel with port 0 comes from the ephemeral range
// (net.ipv4.ip_local_port_range), the same range the kernel hands to
// outgoing connections: between the moment the picker lets the port go
// and the moment the child binds it, any connection made on the machine
// may take it ("bind: address already in use" under load). Ports picked
// here lie below that range, where the kernel never puts an outgoing
// connection, and are free for TCP and UDP (the gossip port is both).
//
// Several processes pick at once (go test runs packages in parallel; the
// conformance suite runs up to four servers under test): a port one of
// them let go may look free to another before the first one's child binds
// it. Each port picked is therefore also reserved across processes, by an
// exclusive lock on a file named after it in a directory of the user's
// temporary directory, held until the picking process exits.
package freeport

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

var (
	mu   sync.Mutex
	used = map[int]bool{} // handed out by this process: never twice
)

// Pick returns n distinct ports of 127.0.0.1 that were free for TCP and
// UDP when picked, outside the ephemeral range where the machine allows.
func Pick(n int) ([]int, error) {
	mu.Lock()
	defer mu.Unlock()
	lo, hi := candidateRange()
	var closers []io.Closer
	defer func() {
		for _, c := range closers {
			_ = c.Close()
		}
	}()
	ports := make([]int, 0, n)
	for attempt := 0; len(ports) < n; attempt++ {
		if attempt > 50*n+100 {
			return nil, fmt.Errorf("freeport: found only %d of %d free TCP+UDP ports on 127.0.0.1 in %d-%d", len(ports), n, lo, hi)
		}
		port := 0 // the kernel's choice where no range is left outside its own
		if hi > lo {
			port = lo + rand.IntN(hi-lo+1)
			if used[port] {
				continue
			}
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		closers = append(closers, l) // held until all are picked: no duplicates
		port = l.Addr().(*net.TCPAddr).Port
		u, err := net.ListenPacket("udp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		closers = append(closers, u)
		used[port] = true // not tried again here, whether reserved or not
		if !reserve(port) {
			continue // another process picked it and may not have bound it yet
		}
		ports = append(ports, port)
	}
	return ports, nil
}

// candidateRange is the span below the ephemeral range (its lower half,
// away from well-known service ports), or above it when that is larger;
// lo > hi when neither holds a thousand ports.
func candidateRange() (lo, hi int) {
	elo, ehi := 32768, 60999 // Linux's default
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			a, err1 := strconv.Atoi(f[0])
			z, err2 := strconv.Atoi(f[1])
			if err1 == nil && err2 == nil && a <= z {
				elo, ehi = a, z
			}
		}
	}
	below := [2]int{max(elo/2, 10000), elo - 1}
	above := [2]int{ehi + 1, 65535}
	best := below
	if above[1]-above[0] > below[1]-below[0] {
		best = above
	}
	if best[1]-best[0] < 1000 {
		return 1, 0
	}
	return best[0], best[1]
}
