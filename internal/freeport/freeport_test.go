package freeport

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
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

// TestPickReservesAcrossProcesses: ports a running process picked (and let
// go, as a test does before its child binds them) are not handed to another
// process. Without the reservation, two picks of 300 from the same range of
// about 16,000 ports share about five.
func TestPickReservesAcrossProcesses(t *testing.T) {
	if os.Getenv("FREEPORT_TEST_CHILD") == "1" {
		ports, err := Pick(300)
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		fmt.Println(strings.Trim(fmt.Sprint(ports), "[]"))
		_, _ = io.Copy(io.Discard, os.Stdin) // holds them until the parent is done
		os.Exit(0)
	}
	child := exec.Command(os.Args[0], "-test.run=^TestPickReservesAcrossProcesses$")
	child.Env = append(os.Environ(), "FREEPORT_TEST_CHILD=1")
	stdin, err := child.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = stdin.Close(); _ = child.Wait() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("the child process printed no ports: %v", err)
	}
	theirs := map[int]bool{}
	for _, f := range strings.Fields(line) {
		p, err := strconv.Atoi(f)
		if err != nil {
			t.Fatalf("the child process: %s", line)
		}
		theirs[p] = true
	}
	ours, err := Pick(300)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range ours {
		if theirs[p] {
			t.Fatalf("port %d was handed to this process and to another running one", p)
		}
	}
}
