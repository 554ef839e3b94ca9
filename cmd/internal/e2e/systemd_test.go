package e2e_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSystemdNotify runs the real agent (--dev) as systemd would with
// Type=notify and WatchdogSec=: on a notification socket of the test it
// says READY=1 once serving, pings WATCHDOG=1, says RELOADING=1 then
// READY=1 around a SIGHUP, and STOPPING=1 on SIGTERM, in that order; then
// it exits 0.
func TestSystemdNotify(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	a := startDevAgent(t, dir, []string{"NOTIFY_SOCKET=" + sock, "WATCHDOG_USEC=400000"})

	// next returns the next notification other than a watchdog ping,
	// counting the pings.
	pings := 0
	next := func(what string) string {
		t.Helper()
		buf := make([]byte, 4096)
		for {
			if err := conn.SetReadDeadline(time.Now().Add(60 * time.Second)); err != nil {
				t.Fatal(err)
			}
			n, err := conn.Read(buf)
			if err != nil {
				t.Fatalf("waiting for %s: %v; agent log:\n%s", what, err, a.logTail())
			}
			msg := string(buf[:n])
			if msg == "WATCHDOG=1" {
				pings++
				continue
			}
			return msg
		}
	}
	if m := next("READY=1"); !strings.HasPrefix(m, "READY=1\n") || !strings.Contains(m, "STATUS=serving on "+a.api) {
		t.Fatalf("first notification %q, want READY=1 with a status", m)
	}
	// Pings come every 200 ms (half of WATCHDOG_USEC).
	deadline := time.Now().Add(30 * time.Second)
	for pings < 3 {
		if err := conn.SetReadDeadline(deadline); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 512)
		n, err := conn.Read(buf)
		if err != nil {
			t.Fatalf("%d watchdog pings, want 3: %v", pings, err)
		}
		if string(buf[:n]) != "WATCHDOG=1" {
			t.Fatalf("unexpected notification %q while serving", buf[:n])
		}
		pings++
	}
	if err := a.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	if m := next("RELOADING=1"); !strings.HasPrefix(m, "RELOADING=1\nMONOTONIC_USEC=") {
		t.Errorf("after SIGHUP %q, want RELOADING=1 with MONOTONIC_USEC", m)
	}
	if m := next("READY=1 after the reload"); !strings.HasPrefix(m, "READY=1") {
		t.Errorf("after the reload %q, want READY=1", m)
	}
	if err := a.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if m := next("STOPPING=1"); m != "STOPPING=1" {
		t.Errorf("after SIGTERM %q, want STOPPING=1", m)
	}
	select {
	case <-a.done:
		if a.err != nil {
			t.Errorf("agent exited with %v after SIGTERM", a.err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("agent still running 30 s after SIGTERM")
	}
}

// TestReloadFromFile runs the real agent with a configuration file and
// reloads it over POST /reload: a broken file is refused naming the key
// (the running configuration stays), a valid change is applied live and
// listed, and a key that needs a restart is reported as such.
func TestReloadFromFile(t *testing.T) {
	dir := t.TempDir()
	cfgFile := filepath.Join(dir, "agent.yaml")
	write := func(body string) {
		t.Helper()
		if err := os.WriteFile(cfgFile, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("logging:\n  level: info\n")
	a := startDevAgent(t, dir, nil, "--config", cfgFile)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	reload := func() (int, string) {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+a.metrics+"/reload", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		if code, _ := reload(); code == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent's /reload did not answer 200 within 60 s; log:\n%s", a.logTail())
		}
		time.Sleep(200 * time.Millisecond) // poll, bounded by the deadline
	}
	write("logging:\n  level: loud\n")
	if code, body := reload(); code != http.StatusUnprocessableEntity || !strings.Contains(body, "logging.level") {
		t.Errorf("a broken file: %d %s, want 422 naming logging.level", code, body)
	}
	write("logging:\n  level: debug\nsnapshot:\n  retain: 3\n")
	code, body := reload()
	if code != http.StatusOK || !strings.Contains(body, `"applied":["logging.level"]`) || !strings.Contains(body, `"restart_required":["snapshot.retain"]`) {
		t.Errorf("a valid change: %d %s, want logging.level applied and snapshot.retain needing a restart", code, body)
	}
}

// devAgent is a real agent (--dev, its own free ports) started by a test.
type devAgent struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when it exited; err is its exit error
	err  error
	// api, internal, metrics are its addresses.
	api, internal, metrics string
	log                    string
}

// startDevAgent starts the agent binary with --dev, a data dir of dir,
// free loopback ports, env added to the environment and args; it is
// killed, if still running, when the test ends.
func startDevAgent(t *testing.T, dir string, env []string, args ...string) *devAgent {
	t.Helper()
	bins := buildBinaries(t)
	ports, err := freePorts(5)
	if err != nil {
		t.Fatal(err)
	}
	addr := func(i int) string { return fmt.Sprintf("127.0.0.1:%d", ports[i]) }
	a := &devAgent{done: make(chan struct{}), api: addr(0), internal: addr(1), metrics: addr(2), log: filepath.Join(dir, "agent.log")}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	a.cmd = exec.CommandContext(ctx, bins.agent, append([]string{"--dev", "--data-dir", filepath.Join(dir, "data"),
		"--api-addr", addr(0), "--internal-addr", addr(1), "--metrics-addr", addr(2), "--gossip-addr", addr(3), "--raft-addr", addr(4)}, args...)...)
	a.cmd.Env = append(raceEnv(), env...)
	logf, err := os.Create(a.log)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	a.cmd.Stdout, a.cmd.Stderr = logf, logf
	dieWithTest(a.cmd)
	if err := a.cmd.Start(); err != nil {
		cancel()
		logf.Close()
		t.Fatal(err)
	}
	go func() {
		a.err = a.cmd.Wait()
		logf.Close()
		cancel()
		close(a.done)
	}()
	t.Cleanup(func() {
		select {
		case <-a.done:
		default:
			_ = a.cmd.Process.Kill()
			<-a.done
		}
	})
	return a
}

// logTail is the agent's log, for failures.
func (a *devAgent) logTail() string {
	b, _ := os.ReadFile(a.log)
	return string(b)
}
