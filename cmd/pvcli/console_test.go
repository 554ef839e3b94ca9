package main

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/cmd/internal/sim"
)

// consoleAgent is an agent whose VM API is served by an in-process
// pivirtd-sim; it returns the agent's endpoint.
func consoleAgent(t *testing.T) string {
	t.Helper()
	s, err := sim.Open(sim.Config{DataDir: t.TempDir(), Host: "node1"})
	if err != nil {
		t.Fatal(err)
	}
	addr := "unix://" + filepath.Join(t.TempDir(), "sim.sock")
	ln, err := sim.Listen(addr)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(s.ServerOptions()...)
	s.Register(gs)
	served := make(chan struct{})
	go func() { _ = gs.Serve(ln); close(served) }()
	t.Cleanup(func() { gs.Stop(); <-served; _ = s.Close() })
	c := agenttest.NewExpect(t, 1, func(_ int, cfg *config.Config) {
		cfg.Backends = map[string]config.BackendConfig{"pivirtd": {Endpoint: addr}}
		cfg.Routing.Rules = []config.RouteRule{{Match: config.RouteMatch{Prefix: "/pivirt.vm.v1.VMService"}, Route: config.RouteTarget{Cluster: "pivirtd"}}}
	})
	c.WaitLeader(30 * time.Second)
	return "http://" + c.Node(0).APIAddr()
}

// newRunningVM creates and starts a VM named name through pvcli.
func newRunningVM(t *testing.T, endpoint, name string) string {
	t.Helper()
	out := runCLI(t, endpoint, "vm", "create", name, "--vcpus", "1", "--memory-mib", "256", "-o", "json").mustSucceed(t).stdout
	i := strings.Index(out, `"id": "`)
	if i < 0 {
		t.Fatalf("vm create printed %s", out)
	}
	id := strings.SplitN(out[i+len(`"id": "`):], `"`, 2)[0]
	runCLI(t, endpoint, "vm", "start", id).mustSucceed(t)
	return id
}

func TestConsoleWithoutTTY(t *testing.T) {
	endpoint := consoleAgent(t)
	id := newRunningVM(t, endpoint, "web")

	// A script: stdin piped, the shell's exit status is pvcli's.
	r := cliRun{stdin: "uname -a\nstty size\nexit 3\n"}.run(t, "--endpoint", endpoint, "vm", "console", id)
	if es := exitStatus(0); !errors.As(r.err, &es) || exitCode(r.err) != 3 {
		t.Errorf("pvcli vm console: %v (exit code %d), want the shell's exit status 3", r.err, exitCode(r.err))
	}
	for _, want := range []string{"serial console of web", "uname -a\r\nLinux web 6.1.0-pivirt-sim", "stty size\r\n24 80\r\n", "exit 3\r\nlogout\r\n"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("stdout %q: want %q", r.stdout, want)
		}
	}
	if r.stderr != "" {
		t.Errorf("stderr %q, want nothing (no terminal: no words of pvcli's own)", r.stderr)
	}

	// The end of stdin ends the session: exit status 0.
	cliRun{stdin: "echo hi\n"}.run(t, "--endpoint", endpoint, "vm", "console", id).mustSucceed(t)

	// Interrupted (Ctrl-C is a signal without a terminal) while stdin is
	// still open: pvcli returns at once, without an error.
	ctx, interrupt := context.WithCancel(t.Context())
	defer interrupt()
	stdin, keys := io.Pipe()
	defer keys.Close()
	var stdout, stderr syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--endpoint", endpoint, "vm", "console", id}, func(string) string { return "" }, stdin, &stdout, &stderr)
	}()
	agenttest.Eventually(t, 15*time.Second, "the console's prompt", func() error {
		if !strings.Contains(stdout.String(), "root@web:~# ") {
			return errors.New("not yet")
		}
		return nil
	})
	interrupt()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("interrupted console: %v, want no error", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("pvcli did not return 15 s after the interrupt")
	}

	// A VM that is off: the backend's reason, nothing printed on stdout.
	runCLI(t, endpoint, "vm", "power-off", id).mustSucceed(t)
	r = cliRun{stdin: "uname\n"}.run(t, "--endpoint", endpoint, "vm", "console", id)
	if r.err == nil || !strings.Contains(r.stderr, "needs it running") || r.stdout != "" || exitCode(r.err) != 1 {
		t.Errorf("console of a stopped VM: %v, stdout %q, stderr %q; want the reason on stderr", r.err, r.stdout, r.stderr)
	}
	r = runCLI(t, endpoint, "vm", "console", "vm-nonexistent")
	if r.err == nil || !strings.Contains(r.stderr, "vm-nonexistent") {
		t.Errorf("console of a VM that does not exist: %v, stderr %q", r.err, r.stderr)
	}
}

func TestConsoleOnATerminal(t *testing.T) {
	endpoint := consoleAgent(t)
	id := newRunningVM(t, endpoint, "web")

	ptmx, tty, err := pty.Open()
	if err != nil {
		t.Skipf("no pseudo-terminal: %v", err)
	}
	defer ptmx.Close()
	defer tty.Close()
	if err := pty.Setsize(ptmx, &pty.Winsize{Rows: 30, Cols: 100}); err != nil {
		t.Fatal(err)
	}
	before, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	// What the terminal shows, drained from the master side.
	var shown syncBuffer
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := ptmx.Read(buf)
			_, _ = shown.Write(buf[:n])
			if err != nil {
				return
			}
		}
	}()

	session := func() (stderr *syncBuffer, done chan error) {
		stderr, done = &syncBuffer{}, make(chan error, 1)
		go func() {
			done <- run(t.Context(), []string{"--endpoint", endpoint, "vm", "console", id}, func(string) string { return "" }, tty, tty, stderr)
		}()
		return stderr, done
	}
	waitShown := func(what string, mark int, keys string) {
		t.Helper()
		agenttest.Eventually(t, 15*time.Second, "the terminal to show "+strings.TrimSpace(what), func() error {
			if keys != "" {
				if _, err := ptmx.WriteString(keys); err != nil {
					return err
				}
			}
			if !strings.Contains(shown.String()[mark:], what) {
				return errors.New("not yet")
			}
			return nil
		})
	}

	stderr, done := session()
	waitShown("root@web:~# ", 0, "")
	// Raw mode: every key goes to the VM, which echoes it; the window
	// size went with the first request.
	mark := len(shown.String())
	if _, err := ptmx.WriteString("stty size\r"); err != nil {
		t.Fatal(err)
	}
	waitShown("stty size\r\n30 100\r\n", mark, "")
	// A resize is passed on (SIGWINCH, as the terminal sends it).
	if err := pty.Setsize(ptmx, &pty.Winsize{Rows: 40, Cols: 120}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGWINCH); err != nil {
		t.Fatal(err)
	}
	waitShown("\r\n40 120\r\n", len(shown.String()), "stty size\r")
	// Ctrl-C goes to the VM, not to pvcli.
	mark = len(shown.String())
	if _, err := ptmx.WriteString("sleep\x03"); err != nil {
		t.Fatal(err)
	}
	waitShown("sleep^C\r\n", mark, "")
	// Ctrl-] detaches: pvcli ends with status 0 and the terminal is as it was.
	if _, err := ptmx.WriteString("\x1d"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("detach: %v", err)
		}
	case <-time.After(15 * time.Second):
		_ = pprof.Lookup("goroutine").WriteTo(os.Stderr, 1)
		t.Fatal("pvcli did not return 15 s after Ctrl-]")
	}
	if !strings.Contains(stderr.String(), "Connected to the console of "+id) || !strings.Contains(stderr.String(), "Detached from the console of "+id) {
		t.Errorf("stderr %q: want the connect and detach notes", stderr.String())
	}
	after, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	if after.Lflag != before.Lflag || after.Iflag != before.Iflag || after.Oflag != before.Oflag {
		t.Errorf("terminal modes after detach %+v, want those before %+v", after, before)
	}

	// The shell's exit closes the session with its status, said on stderr.
	stderr, done = session()
	mark = len(shown.String())
	waitShown("root@web:~# ", mark, "")
	if _, err := ptmx.WriteString("exit 5\r"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if exitCode(err) != 5 {
			t.Errorf("exit 5: pvcli returned %v, want exit status 5", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("pvcli did not return 15 s after exit")
	}
	if !strings.Contains(stderr.String(), "closed: the shell exited (exit status 5)") {
		t.Errorf("stderr %q: want why the console closed", stderr.String())
	}
}
