package e2e_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/internal/freeport"
)

const (
	// termGrace is how long a stopped agent gets between SIGTERM and SIGKILL.
	termGrace = 5 * time.Second
	// pollInterval is the pause between two attempts of a polled condition.
	pollInterval = 150 * time.Millisecond
	// pvcliBackstop bounds one pvcli run whatever its --timeout says.
	pvcliBackstop = 60 * time.Second
	// raceMarker starts every report of the race detector.
	raceMarker = "WARNING: DATA RACE"
)

// raceEnv is the environment of every process started. A binary built with
// -race sleeps GORACE's atexit_sleep_ms (1s by default) before a zero exit,
// to let running goroutines report; a tenth of that keeps the test fast.
func raceEnv() []string {
	return append(os.Environ(), "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=100"))
}

// --- binaries ---------------------------------------------------------------

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// TestMain removes the binaries built by buildBinaries.
func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		_ = os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// binaries are the paths of the built executables.
type binaries struct {
	agent   string
	pvcli   string
	sim     string
	pitrust string
	// grpcurl is the go tool of the module, built without -race.
	grpcurl string
}

// buildBinaries builds pivirt-agent and pvcli with the race detector, once per
// test binary, so that races inside the processes are reported too.
func buildBinaries(t testing.TB) binaries {
	t.Helper()
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "pivirt-e2e-bin-")
		if buildErr != nil {
			return
		}
		var out []byte
		out, buildErr = exec.Command("go", "env", "GOMOD").Output()
		if buildErr != nil {
			buildErr = fmt.Errorf("go env GOMOD: %w", buildErr)
			return
		}
		gomod := strings.TrimSpace(string(out))
		if gomod == "" || gomod == os.DevNull {
			buildErr = fmt.Errorf("go env GOMOD = %q: not inside the module", gomod)
			return
		}
		for _, args := range [][]string{
			{"build", "-race", "-o", binDir + string(filepath.Separator), "./cmd/pivirt-agent", "./cmd/pvcli", "./cmd/pivirtd-sim", "./cmd/pitrust"},
			{"build", "-o", binDir + string(filepath.Separator), "github.com/fullstorydev/grpcurl/cmd/grpcurl"},
		} {
			cmd := exec.Command("go", args...)
			cmd.Dir = filepath.Dir(gomod)
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("%s: %w\n%s", strings.Join(cmd.Args, " "), err, out)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatalf("build binaries: %v", buildErr)
	}
	return binaries{
		agent:   filepath.Join(binDir, "pivirt-agent"),
		pvcli:   filepath.Join(binDir, "pvcli"),
		sim:     filepath.Join(binDir, "pivirtd-sim"),
		pitrust: filepath.Join(binDir, "pitrust"),
		grpcurl: filepath.Join(binDir, "grpcurl"),
	}
}

// --- processes ----------------------------------------------------------------

// proc is one started agent process.
type proc struct {
	cmd    *exec.Cmd
	cancel context.CancelFunc // SIGTERM, then SIGKILL after termGrace
	done   chan struct{}      // closed once Wait returned
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// state describes how the process ended; call it after done is closed.
func (p *proc) state() string { return p.cmd.ProcessState.String() }

// node is one agent: its addresses and files stay the same across restarts.
type node struct {
	name    string
	dataDir string
	config  string
	log     string
	api     string
	intern  string
	metrics string
	gossip  string
	raft    string
	// netns is the network namespace the agent runs in ("" none).
	netns string

	// bin is the agent binary the node runs, when not the built one (a
	// previous release's).
	bin string

	proc *proc // the running process; nil while the node is meant to be down
	// sim is the node's pivirtd-sim (pivirtd and iscsiman), at simAddr.
	sim     *proc
	simAddr string
	simLog  string
}

// cluster is three agent processes on 127.0.0.1.
type cluster struct {
	// beforeBoot, when set, runs before each start attempt (a test whose
	// certificates live seconds issues them there).
	beforeBoot func(t *testing.T)
	bins       binaries
	dir        string // holds a directory per start attempt
	nodes      []*node
	// certs is the cluster's PiTrust PKI: every port runs (mutual) TLS.
	// Set before the start, it is used as it is (with makePKI's file
	// names); else makePKI makes one.
	certs string
	// extra is YAML appended to every agent's configuration file.
	extra string
	// name is cluster.name: each test cluster has one of its own, so
	// that gossip refuses agents of another cluster (another test package
	// runs at the same time) instead of merging with them when an address
	// a node still knows has been taken by one of theirs.
	name string
	// tlsExtra is YAML added to the tls block of every agent's
	// configuration file, indented by two spaces; {certs} stands for the
	// certificate directory.
	tlsExtra string
	// tokens lets the API port take a bearer token without a client
	// certificate (require_client_cert: false), as make cluster runs it
	// for browsers and pvcli login.
	tokens bool
	// authExtra is YAML added to the auth block of every agent's
	// configuration file, indented by two spaces (auth.oidc,
	// auth.rbac_policy).
	authExtra string
	// net, when set, runs node i in network namespace net.names[i] on
	// address net.ips[i] (startClusterIn); else every node is on 127.0.0.1.
	net *netnsEnv
	// agents, when set, is the agent binary each node starts with (a
	// previous release's); compat then writes the configuration that
	// release reads too (no key it does not know, explicit routes).
	agents []string
	compat bool

	mu    sync.Mutex
	procs []*proc  // every process started, for the cleanup
	logs  []string // every log file written, for the failure report
}

// errPortTaken is a start that failed because another process grabbed a
// port between freePorts and the agent's listen.
var errPortTaken = errors.New("a port picked for an agent was taken meanwhile")

// startCluster starts three agents with --bootstrap-expect 3 and waits until
// they agree on a leader. A start that fails because a port was taken is
// retried once with new ports.
func startCluster(t *testing.T, bins binaries) *cluster {
	t.Helper()
	return startClusterWith(t, bins, "")
}

// startClusterWith is startCluster with extra YAML in every agent's
// configuration file (e.g. a service_discovery block).
func startClusterWith(t *testing.T, bins binaries, extra string) *cluster {
	t.Helper()
	return startClusterOn(t, &cluster{bins: bins, dir: t.TempDir(), extra: extra})
}

// startClusterIn starts the three agents each in its network namespace of
// env (see netns_test.go).
func startClusterIn(t *testing.T, bins binaries, env *netnsEnv) *cluster {
	t.Helper()
	return startClusterOn(t, &cluster{bins: bins, dir: t.TempDir(), net: env})
}

func startClusterOn(t *testing.T, c *cluster) *cluster {
	if c.name == "" {
		c.name = fmt.Sprintf("e2e-%08x", mrand.Uint32())
	}
	t.Helper()
	var ips []net.IP
	if c.net != nil {
		for _, ip := range c.net.ips {
			ips = append(ips, net.ParseIP(ip))
		}
	}
	if c.certs == "" {
		c.certs = makePKI(t, filepath.Join(c.dir, "certs"), ips...)
	}
	// Cleanups run last-in first-out. report is registered after
	// t.TempDir's removal and before stopAll, so it runs once every process
	// has stopped and while the logs still exist.
	t.Cleanup(func() { c.report(t) })
	t.Cleanup(c.stopAll)

	for attempt := 1; ; attempt++ {
		if c.beforeBoot != nil {
			c.beforeBoot(t)
		}
		err := c.boot(t, filepath.Join(c.dir, fmt.Sprintf("attempt%d", attempt)))
		if err == nil {
			return c
		}
		if attempt == 2 || !errors.Is(err, errPortTaken) {
			t.Fatalf("start cluster: %v", err)
		}
		t.Logf("start cluster, attempt %d: %v; retrying with new ports", attempt, err)
		c.stopAll()
	}
}

// boot picks ports and data directories, starts the three agents and waits
// for an agreed leader.
func (c *cluster) boot(t *testing.T, dir string) error {
	t.Helper()
	if err := os.Mkdir(dir, 0o700); err != nil {
		return err
	}
	ports, err := freePorts(3 * 5)
	if err != nil {
		return err
	}
	c.nodes = nil
	for i := range 3 {
		host, ns := "127.0.0.1", ""
		if c.net != nil {
			host, ns = c.net.ips[i], c.net.names[i]
		}
		addr := func(k int) string { return net.JoinHostPort(host, strconv.Itoa(ports[k])) }
		name := fmt.Sprintf("node%d", i+1)
		n := &node{
			netns:   ns,
			name:    name,
			dataDir: filepath.Join(dir, name),
			config:  filepath.Join(dir, name+".yaml"),
			log:     filepath.Join(dir, name+".log"),
			api:     addr(5 * i),
			intern:  addr(5*i + 1),
			metrics: addr(5*i + 2),
			gossip:  addr(5*i + 3),
			raft:    addr(5*i + 4),
			simAddr: filepath.Join(dir, name+"-sim.sock"),
			simLog:  filepath.Join(dir, name+"-sim.log"),
		}
		// Mutual TLS on every port, as scripts/cluster.sh runs it.
		cfg := fmt.Sprintf(`tls:
  enabled: true
  ca_file: %[1]s/ca-chain.pem
  cert_file: %[1]s/pivirt-agent-%[2]s.crt
  key_file: %[1]s/pivirt-agent-%[2]s.key
  verify_peer: true
  require_client_cert: %[5]t
%[4]sserver:
  connectrpc:
    tls:
      cert_file: %[1]s/%[2]s-server.crt
      key_file: %[1]s/%[2]s-server.key
      client_ca_file: %[1]s/ca-chain.pem
auth:
  certificate_roles:
    operator: [admin]
%[6]slogging:
  format: text
  level: info
backends:
  pivirtd:
    endpoint: unix://%[3]s
    timeout: 10s
    retry:
      max_attempts: 3
      backoff: 50ms
  iscsiman:
    endpoint: unix://%[3]s
`, c.certs, name, n.simAddr, strings.ReplaceAll(c.tlsExtra, "{certs}", c.certs), !c.tokens, c.authExtra)
		if c.compat {
			cfg += `routing:
  rules:
    - match:
        prefix: /pivirt.vm.v1.VMService
      route:
        cluster: pivirtd
    - match:
        prefix: /pivirt.network.v1.NetworkService
      route:
        cluster: pivirtd
    - match:
        prefix: /pivirt.storage.v1.StorageService
      route:
        cluster: iscsiman
`
		}
		cfg += withClusterName(c.extra, c.name)
		if i < len(c.agents) {
			n.bin = c.agents[i]
		}
		if i == 0 && !c.compat {
			// node1 keeps its Raft log in raft-boltdb, node2 and node3 in
			// the WAL (the default): every end-to-end test runs on both
			// log stores, in one cluster, as a data dir made by an older
			// version does beside new ones.
			cfg = withRaftKey(cfg, "log_store: boltdb")
		}
		if err := os.WriteFile(n.config, []byte(cfg), 0o600); err != nil {
			return err
		}
		c.nodes = append(c.nodes, n)
	}
	for _, n := range c.nodes {
		if err := c.startSim(n, dir); err != nil {
			return err
		}
		if err := c.start(t, n, true); err != nil {
			return err
		}
	}

	deadline := time.Now().Add(45 * time.Second)
	for {
		for _, n := range c.nodes {
			if n.proc.exited() {
				b, _ := os.ReadFile(n.log)
				if bytes.Contains(b, []byte("address already in use")) {
					return fmt.Errorf("%s: %w (%s)", n.name, errPortTaken, n.proc.state())
				}
				return fmt.Errorf("%s exited during start (%s); log tail:\n%s", n.name, n.proc.state(), tail(n.log, 30))
			}
		}
		_, err := c.agreedLeader(t, c.nodes...)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no agreed leader 45s after start: %w", err)
		}
		time.Sleep(pollInterval)
	}
}

// start starts n's agent. The first start of a cluster passes
// --bootstrap-expect 3; a restart keeps every other flag.
func (c *cluster) start(t testing.TB, n *node, bootstrap bool) error {
	t.Helper()
	args := []string{
		"--config", n.config,
		"--node-name", n.name,
		"--data-dir", n.dataDir,
		"--api-addr", n.api,
		"--internal-addr", n.intern,
		"--metrics-addr", n.metrics,
		"--gossip-addr", n.gossip,
		"--raft-addr", n.raft,
		"--retry-interval", "200ms",
	}
	if bootstrap {
		args = append(args, "--bootstrap-expect", "3")
	}
	for _, o := range c.nodes {
		if o != n {
			args = append(args, "--retry-join", o.gossip)
		}
	}

	bin := c.bins.agent
	if n.bin != "" {
		bin = n.bin
	}
	if n.netns != "" {
		args = append([]string{"netns", "exec", n.netns, bin}, args...)
		bin = "ip"
	}
	p, err := c.spawn(n.log, bin, args)
	if err != nil {
		return fmt.Errorf("start %s: %w", n.name, err)
	}
	n.proc = p
	return nil
}

// startSim starts n's pivirtd-sim on its unix socket.
func (c *cluster) startSim(n *node, dir string) error {
	p, err := c.spawn(n.simLog, c.bins.sim, []string{"--listen", "unix://" + n.simAddr, "--data-dir", filepath.Join(dir, n.name+"-sim"),
		"--host", n.name, "--log-format", "text"})
	if err != nil {
		return fmt.Errorf("start %s's simulator: %w", n.name, err)
	}
	n.sim = p
	return nil
}

// spawn starts a process logging into logPath, stopped (SIGTERM, then
// SIGKILL) by stopAll.
func (c *cluster) spawn(logPath, bin string, args []string) (*proc, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close() // the child holds its own descriptor
	fmt.Fprintf(logf, "=== e2e %s: starting %s %s\n", time.Now().UTC().Format(time.RFC3339Nano),
		filepath.Base(bin), strings.Join(args, " "))

	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = raceEnv()
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = termGrace
	dieWithTest(cmd)
	if err := cmd.Start(); err != nil {
		cancel()
		return nil, err
	}
	p := &proc{cmd: cmd, cancel: cancel, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait() // the exit status is read from cmd.ProcessState
		close(p.done)
	}()

	c.mu.Lock()
	defer c.mu.Unlock()
	c.procs = append(c.procs, p)
	if !slices.Contains(c.logs, logPath) {
		c.logs = append(c.logs, logPath)
	}
	return p, nil
}

// mustStart is start that fails the test.
func (c *cluster) mustStart(t testing.TB, n *node, bootstrap bool) {
	t.Helper()
	if err := c.start(t, n, bootstrap); err != nil {
		t.Fatal(err)
	}
}

// restart starts n's agent again with the same flags except
// --bootstrap-expect, the same ports and the same data dir, and waits until
// its API answers. One of its ports may have been taken meanwhile as the
// source port of an outgoing connection; such a start is retried.
func (c *cluster) restart(t testing.TB, n *node) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var offset int64
		if fi, err := os.Stat(n.log); err == nil {
			offset = fi.Size()
		}
		c.mustStart(t, n, false)
		for {
			if n.proc.exited() {
				b, _ := os.ReadFile(n.log)
				if !bytes.Contains(b[min(offset, int64(len(b))):], []byte("address already in use")) ||
					time.Now().After(deadline) {
					t.Fatalf("%s exited after a restart (%s); log tail:\n%s", n.name, n.proc.state(), tail(n.log, 40))
				}
				t.Logf("restart %s: a port is taken (%s); trying again", n.name, n.proc.state())
				time.Sleep(500 * time.Millisecond)
				break
			}
			if c.pvcli(t, n, "--timeout", "2s", "cluster", "members").code == 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: API not answering 30s after a restart; log tail:\n%s", n.name, tail(n.log, 40))
			}
			time.Sleep(pollInterval)
		}
	}
}

// kill SIGKILLs n's agent and waits until it is gone.
func (c *cluster) kill(t testing.TB, n *node) {
	t.Helper()
	p := n.proc
	if p == nil {
		t.Fatalf("kill %s: not running", n.name)
	}
	if err := p.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		t.Fatalf("kill %s: %v", n.name, err)
	}
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s still running 10s after SIGKILL", n.name)
	}
	n.proc = nil
}

// stop sends SIGTERM to n's agent and checks that it exits with status 0
// within the grace period (it is SIGKILLed after it).
func (c *cluster) stop(t testing.TB, n *node) {
	t.Helper()
	p := n.proc
	n.proc = nil
	p.cancel()
	<-p.done // at most termGrace plus the kill
	if code := p.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("%s after SIGTERM: %s, want exit status 0 within %s", n.name, p.state(), termGrace)
	}
}

// stopAll stops every process still running: SIGTERM to all, SIGKILL to
// those still alive after termGrace, and waits for all of them.
func (c *cluster) stopAll() {
	c.mu.Lock()
	procs := c.procs
	c.mu.Unlock()
	for _, p := range procs {
		p.cancel()
	}
	for _, p := range procs {
		<-p.done
	}
	for _, n := range c.nodes {
		n.proc = nil
	}
}

// report fails the test if a process hit a data race, and prints the tail of
// every agent log when the test failed.
func (c *cluster) report(t testing.TB) {
	for _, path := range c.logs {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Errorf("read agent log: %v", err)
			continue
		}
		if i := bytes.Index(b, []byte(raceMarker)); i >= 0 {
			end := min(len(b), i+4000)
			t.Errorf("%s: the race detector reported a race:\n%s", filepath.Base(path), b[i:end])
		}
	}
	if !t.Failed() {
		return
	}
	for _, path := range c.logs {
		t.Logf("--- last lines of %s ---\n%s", filepath.Base(path), tail(path, 40))
		// Audit lines crowd out the rest under client load.
		t.Logf("--- last warnings and errors of %s ---\n%s", filepath.Base(path), tailMatching(path, 60, "level=WARN", "level=ERROR"))
	}
}

// check fails the test if an agent that should run has exited.
func (c *cluster) check(t testing.TB) {
	t.Helper()
	for _, n := range c.nodes {
		if n.proc != nil && n.proc.exited() {
			t.Fatalf("%s exited unexpectedly (%s); log tail:\n%s", n.name, n.proc.state(), tail(n.log, 40))
		}
	}
}

// others returns the nodes other than except.
func (c *cluster) others(except ...*node) []*node {
	var out []*node
	for _, n := range c.nodes {
		skip := false
		for _, e := range except {
			skip = skip || n == e
		}
		if !skip {
			out = append(out, n)
		}
	}
	return out
}

// byAPI returns the node whose API address is addr.
func (c *cluster) byAPI(t testing.TB, addr string) *node {
	t.Helper()
	for _, n := range c.nodes {
		if n.api == addr {
			return n
		}
	}
	t.Fatalf("no node has API address %q", addr)
	return nil
}

// byName returns the node called name.
func (c *cluster) byName(t testing.TB, name string) *node {
	t.Helper()
	for _, n := range c.nodes {
		if n.name == name {
			return n
		}
	}
	t.Fatalf("no node is called %q", name)
	return nil
}

// --- pvcli ----------------------------------------------------------------------

// result is the outcome of one pvcli run.
type result struct {
	args   []string
	stdout string
	stderr string
	code   int
}

func (r result) String() string {
	return fmt.Sprintf("pvcli %s: exit status %d\nstdout: %s\nstderr: %s",
		strings.Join(r.args, " "), r.code, strings.TrimSpace(r.stdout), strings.TrimSpace(r.stderr))
}

// pvcli runs the pvcli binary against n's API address.
func (c *cluster) pvcli(t testing.TB, n *node, args ...string) result {
	t.Helper()
	return c.pvcliEnv(t, c.operatorEnv(), append([]string{"--endpoint", "https://" + n.api}, args...)...)
}

// operatorEnv is the quick start's exports: the CA chain and the operator's
// client certificate.
func (c *cluster) operatorEnv() []string {
	return []string{
		"PVCLI_CA_FILE=" + filepath.Join(c.certs, identity.ChainFile),
		"PVCLI_CERT_FILE=" + filepath.Join(c.certs, "operator.crt"),
		"PVCLI_KEY_FILE=" + filepath.Join(c.certs, "operator.key"),
	}
}

// pvcliEnv runs the pvcli binary with args and env added to the test's
// environment, a pvcli configuration file of the user's own excepted.
func (c *cluster) pvcliEnv(t testing.TB, env []string, args ...string) result {
	t.Helper()
	return c.runPVCLI(t, env, "", args...)
}

// pvcliInput runs pvcli through n as the operator with input on its stdin.
func (c *cluster) pvcliInput(t testing.TB, n *node, input string, args ...string) result {
	t.Helper()
	return c.runPVCLI(t, c.operatorEnv(), input, append([]string{"--endpoint", "https://" + n.api}, args...)...)
}

// runPVCLI runs the pvcli binary: pvcliEnv with input on stdin (none when
// empty).
func (c *cluster) runPVCLI(t testing.TB, env []string, input string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), pvcliBackstop)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.bins.pvcli, args...)
	var stdout, stderr bytes.Buffer
	cmd.Env = append(raceEnv(), "PVCLI_CONFIG="+filepath.Join(c.certs, "no-pvcli-config.yaml"), "PVCLI_ENDPOINT=", "PVCLI_CONTEXT=", "PVCLI_TOKEN=")
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if input != "" {
		cmd.Stdin = strings.NewReader(input)
	}
	cmd.WaitDelay = time.Second
	dieWithTest(cmd)
	err := cmd.Run()
	r := result{args: args, stdout: stdout.String(), stderr: stderr.String()}
	var exit *exec.ExitError
	switch {
	case ctx.Err() != nil:
		t.Fatalf("pvcli %s: still running after %s", strings.Join(args, " "), pvcliBackstop)
	case err == nil:
	case errors.As(err, &exit):
		r.code = exit.ExitCode()
	default:
		t.Fatalf("pvcli %s: %v", strings.Join(args, " "), err)
	}
	if strings.Contains(r.stderr, raceMarker) {
		t.Errorf("the race detector reported a race in pvcli:\n%s", r)
	}
	return r
}

// ok runs pvcli and fails the test unless it exits with status 0.
func (c *cluster) ok(t testing.TB, n *node, args ...string) result {
	t.Helper()
	r := c.pvcli(t, n, args...)
	if r.code != 0 {
		t.Fatalf("%s\nwant exit status 0", r)
	}
	return r
}

// okJSON runs pvcli with -o json, fails the test unless it succeeds, and
// decodes its output into v.
func (c *cluster) okJSON(t testing.TB, n *node, v any, args ...string) {
	t.Helper()
	r := c.ok(t, n, append(args, "-o", "json")...)
	if err := json.Unmarshal([]byte(r.stdout), v); err != nil {
		t.Fatalf("%s\ndecode JSON output: %v", r, err)
	}
}

// tryJSON is okJSON for polling: it returns the failure instead.
func (c *cluster) tryJSON(t testing.TB, n *node, v any, args ...string) error {
	t.Helper()
	r := c.pvcli(t, n, append(args, "-o", "json")...)
	if r.code != 0 {
		return fmt.Errorf("via %s: exit status %d: %s", n.name, r.code, strings.TrimSpace(r.stderr))
	}
	if err := json.Unmarshal([]byte(r.stdout), v); err != nil {
		return fmt.Errorf("via %s: decode %q: %w", n.name, r.stdout, err)
	}
	return nil
}

// eventually polls cond until it returns nil, failing the test with the last
// error once timeout has passed or if an agent dies meanwhile.
func (c *cluster) eventually(t testing.TB, timeout time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		c.check(t)
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			// Reported first: the diagnosis may fail the test itself.
			t.Errorf("%s: not within %s: %v", what, timeout, err)
			c.diagnose(t)
			t.FailNow()
		}
		time.Sleep(pollInterval)
	}
}

// diagnose logs the Raft peers (state, applied index, how far each
// trails) as every running agent reports them, for a failure's record.
func (c *cluster) diagnose(t testing.TB) {
	t.Helper()
	for _, n := range c.nodes {
		if n.proc == nil || n.proc.exited() {
			continue
		}
		r := c.pvcli(t, n, "--timeout", "2s", "cluster", "peers")
		t.Logf("cluster peers via %s (exit %d):\n%s%s", n.name, r.code, r.stdout, r.stderr)
	}
}

// --- JSON output of pvcli (protojson: lowerCamelCase, 64-bit integers quoted) --

type leaderOut struct {
	NodeID  string `json:"nodeId"`
	Name    string `json:"name"`
	APIAddr string `json:"apiAddr"`
	Term    uint64 `json:"term,string"`
}

type peerOut struct {
	NodeID       string `json:"nodeId"`
	Name         string `json:"name"`
	State        string `json:"state"`
	Voter        bool   `json:"voter"`
	AppliedIndex uint64 `json:"appliedIndex,string"`
	Trailing     uint64 `json:"trailing,string"`
}

type peersOut struct {
	Peers []peerOut `json:"peers"`
}

// voters returns the names of the voters.
func (p peersOut) voters() []string {
	var names []string
	for _, peer := range p.Peers {
		if peer.Voter {
			names = append(names, peer.Name)
		}
	}
	return names
}

type memberOut struct {
	Name   string `json:"name"`
	NodeID string `json:"nodeId"`
	Status string `json:"status"`
}

type membersOut struct {
	Members []memberOut `json:"members"`
}

type instanceOut struct {
	Service    string            `json:"service"`
	InstanceID string            `json:"instanceId"`
	Node       string            `json:"node"`
	Address    string            `json:"address"`
	Port       uint32            `json:"port"`
	Tags       []string          `json:"tags"`
	Meta       map[string]string `json:"meta"`
	Health     string            `json:"health"`
}

type registerOut struct {
	Instance instanceOut `json:"instance"`
	Index    uint64      `json:"index,string"`
}

type instancesOut struct {
	Instances []instanceOut `json:"instances"`
}

// ids returns the "service/instance" IDs in output order.
func (o instancesOut) ids() []string {
	var ids []string
	for _, in := range o.Instances {
		ids = append(ids, in.Service+"/"+in.InstanceID)
	}
	return ids
}

type configEntryOut struct {
	Key      string `json:"key"`
	Value    string `json:"value"`
	Revision uint64 `json:"revision,string"`
}

type setConfigOut struct {
	Entry configEntryOut `json:"entry"`
}

type historyOut struct {
	Entries []configEntryOut `json:"entries"`
}

// --- cluster-level queries --------------------------------------------------------

// agreedLeader asks every node in nodes for the leader and returns it if they
// all name the same one.
func (c *cluster) agreedLeader(t testing.TB, nodes ...*node) (leaderOut, error) {
	t.Helper()
	var first leaderOut
	for i, n := range nodes {
		var l leaderOut
		if err := c.tryJSON(t, n, &l, "--timeout", "2s", "cluster", "leader"); err != nil {
			return first, err
		}
		if l.NodeID == "" || l.APIAddr == "" {
			return first, fmt.Errorf("via %s: leader without node ID or API address: %+v", n.name, l)
		}
		if i == 0 {
			first = l
		} else if l.NodeID != first.NodeID {
			return first, fmt.Errorf("nodes disagree on the leader: %s says %s, %s says %s",
				nodes[0].name, first.Name, n.name, l.Name)
		}
	}
	return first, nil
}

// --- small helpers ------------------------------------------------------------------

func tail(path string, lines int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	all := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(all[max(0, len(all)-lines):], "\n")
}

// tailMatching is the last lines of path that contain one of the words.
func tailMatching(path string, lines int, words ...string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	var keep []string
	for line := range strings.SplitSeq(strings.TrimRight(string(b), "\n"), "\n") {
		for _, w := range words {
			if strings.Contains(line, w) {
				keep = append(keep, line)
				break
			}
		}
	}
	return strings.Join(keep[max(0, len(keep)-lines):], "\n")
}

// needTools skips the test when one of the tools is not installed, and
// fails it in CI, where .ci/run installs them.
func needTools(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") != "" {
				t.Fatalf("%s is not installed (.ci/run installs it)", tool)
			}
			t.Skipf("%s is not installed", tool)
		}
	}
}

// freePorts returns n distinct loopback ports, free for TCP and UDP when
// picked, outside the range the kernel gives outgoing connections.
func freePorts(n int) ([]int, error) { return freeport.Pick(n) }

// --- PKI ------------------------------------------------------------------------

// makePKI creates a PiTrust CA in dir with, for node1..node3, a server
// certificate for 127.0.0.1 and an agent client certificate, and an
// operator certificate for pvcli and the test's own clients.
func makePKI(t testing.TB, dir string, ips ...net.IP) string {
	t.Helper()
	if _, err := identity.InitCA(dir, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 3; i++ {
		name := fmt.Sprintf("node%d", i)
		if _, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: name + "-server",
			DNS: []string{"localhost"}, IPs: append([]net.IP{net.ParseIP("127.0.0.1")}, ips...)}); err != nil {
			t.Fatal(err)
		}
		if _, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-" + name}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: "operator"}); err != nil {
		t.Fatal(err)
	}
	return dir
}

// startDevIssuer starts the development OIDC issuer (pitrust dev-issuer,
// as make cluster runs it) on a free port of 127.0.0.1, its key in dir,
// and returns its URL once it has recorded it there (dev-oidc.issuer).
func (c *cluster) startDevIssuer(t *testing.T, dir string) string {
	t.Helper()
	log := filepath.Join(c.dir, "dev-issuer.log")
	if _, err := c.spawn(log, c.bins.pitrust, []string{"dev-issuer", "--dir", dir, "--addr", "127.0.0.1:0"}); err != nil {
		t.Fatal(err)
	}
	var issuer string
	c.eventually(t, 20*time.Second, "the dev issuer records its URL", func() error {
		b, err := os.ReadFile(filepath.Join(dir, "dev-oidc.issuer"))
		if err != nil || len(strings.TrimSpace(string(b))) == 0 {
			return fmt.Errorf("no dev-oidc.issuer yet (%v); log:\n%s", err, tail(log, 10))
		}
		issuer = strings.TrimSpace(string(b))
		return nil
	})
	return issuer
}

// clientTLS is a TLS client configuration with the cluster's CA and the
// operator certificate.
func (c *cluster) clientTLS(t testing.TB) *tls.Config {
	t.Helper()
	pem, err := os.ReadFile(filepath.Join(c.certs, identity.ChainFile))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	op, err := tls.LoadX509KeyPair(filepath.Join(c.certs, "operator.crt"), filepath.Join(c.certs, "operator.key"))
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{op}, MinVersion: tls.VersionTLS12}
}

// httpClient is an HTTPS client of the cluster's API, closed with the test.
func (c *cluster) httpClient(t testing.TB) *http.Client {
	t.Helper()
	tr := &http.Transport{TLSClientConfig: c.clientTLS(t), ForceAttemptHTTP2: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// withRaftKey puts line into the cluster.raft block of the YAML cfg, which
// has a cluster block (withClusterName).
func withRaftKey(cfg, line string) string {
	i := strings.Index(cfg, "\ncluster:\n")
	if j := strings.Index(cfg[i:], "\n  raft:\n"); j >= 0 {
		at := i + j + len("\n  raft:\n")
		return cfg[:at] + "    " + line + "\n" + cfg[at:]
	}
	at := i + len("\ncluster:\n")
	return cfg[:at] + "  raft:\n    " + line + "\n" + cfg[at:]
}

// withClusterName puts cluster.name into the YAML extra, in its cluster
// block when it has one.
func withClusterName(extra, name string) string {
	line := "  name: " + name + "\n"
	switch i := strings.Index("\n"+extra, "\ncluster:\n"); {
	case i >= 0:
		at := i + len("cluster:\n")
		return extra[:at] + line + extra[at:]
	case extra != "" && !strings.HasSuffix(extra, "\n"):
		extra += "\n"
	}
	return extra + "cluster:\n" + line
}

// agreeReplicas runs pvcli operator raft verify until the leader answers
// (it may be changing, a node may be catching up) and fails the test as
// soon as a server's replicated state differs from the leader's, or if no
// check covering every server agrees within a minute. Raft mode only.
func (c *cluster) agreeReplicas(t testing.TB, what string) {
	t.Helper()
	if strings.Contains(c.extra, "type: etcd") {
		return
	}
	c.eventually(t, 60*time.Second, what+": every replica holds the leader's state", func() error {
		var last error
		for _, n := range c.nodes {
			if n.proc == nil {
				continue
			}
			r := c.pvcli(t, n, "operator", "raft", "verify")
			switch {
			case r.code == 0:
				return nil
			case strings.Contains(r.stderr, "replicas differ"):
				t.Fatalf("%s: %s", what, r)
			}
			last = fmt.Errorf("%s", r)
		}
		return last
	})
}
