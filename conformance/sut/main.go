// Command sut is the server under test of the ConnectRPC conformance suite
// (connectconformance --mode server): one real pivirt-agent whose routing
// rule sends connectrpc.conformance.v1.ConformanceService to the suite's
// reference server, running as a plain gRPC backend.
//
// It reads a ServerCompatRequest from stdin (size-delimited, as the suite
// writes it), starts the backend and the agent accordingly (TLS from a
// PiTrust PKI made with the real pitrust binary, the suite's client
// certificate trusted beside the PiTrust chain, the receive limit given to
// the backend), answers with a ServerCompatResponse naming the agent's API
// port, and stops both on SIGTERM (the suite's way to end a server). See
// conformance/README.md.
package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
)

// service is the suite's service; the agent routes it to the backend.
const service = "connectrpc.conformance.v1.ConformanceService"

func main() {
	agent := flag.String("agent", "bin/pivirt-agent", "the pivirt-agent binary")
	pitrust := flag.String("pitrust", "bin/pitrust", "the pitrust binary")
	backend := flag.String("backend", "", "the conformance suite's referenceserver binary")
	logDir := flag.String("log-dir", "", "keep each run's agent and backend logs in a directory under this one (default: a temporary directory, removed at the end)")
	agents := flag.Int("agents", 1, "1: the agent routes to the backend; 2: a second agent, which the suite calls, reaches the backend through the replicated services registry, where the first registered it")
	flag.StringVar(&descriptorSet, "descriptor-set", "", "the service's binary FileDescriptorSet, named in the routing rule (route.descriptor_set): the agent then has the service's schema")
	flag.Parse()
	if descriptorSet != "" {
		abs, err := filepath.Abs(descriptorSet)
		if err != nil {
			fatalf("--descriptor-set: %v", err)
		}
		descriptorSet = abs
	}
	if *agents != 1 && *agents != 2 {
		fatalf("--agents: 1 or 2, not %d", *agents)
	}
	if *backend == "" {
		fatalf("--backend: the path of the conformance suite's referenceserver binary is required")
	}
	if err := run(*agent, *pitrust, *backend, *logDir, *agents); err != nil {
		fatalf("%v", err)
	}
}

func fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "sut: "+format+"\n", args...)
	os.Exit(1)
}

// request is the part of connectrpc.conformance.v1.ServerCompatRequest the
// agent acts on.
type request struct {
	protocol, httpVersion int
	useTLS                bool
	clientCert            []byte
	receiveLimit          uint32
}

func run(agentBin, pitrustBin, backendBin, logRoot string, agents int) error {
	raw, err := readDelimited(os.Stdin)
	if err != nil {
		return fmt.Errorf("read the ServerCompatRequest from stdin: %w", err)
	}
	req, err := parseRequest(raw)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp(logRoot, "pivirt-sut-")
	if err != nil {
		return err
	}
	if logRoot == "" {
		defer os.RemoveAll(dir)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	be, backendAddr, err := startBackend(ctx, backendBin, dir, req.receiveLimit)
	if err != nil {
		return err
	}
	children := []*exec.Cmd{be}
	defer func() { terminate(children...) }()

	var certs string
	var caPEM []byte
	if req.useTLS {
		if certs, caPEM, err = makePKI(pitrustBin, dir, req.clientCert, agents); err != nil {
			return err
		}
	}
	ports, err := freePorts(5 * agents)
	if err != nil {
		return err
	}
	addr := func(i, k int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[5*i+k])) }
	exited := make(chan *exitError, agents)
	for i := range agents {
		name := fmt.Sprintf("conformance%d", i+1)
		cfg := agentConfig(req, certs, name)
		switch {
		case agents == 1:
			cfg += routeTo(backendAddr)
		case i == 0:
			// The backend's node: it registers the backend in the
			// replicated services table and routes nothing.
			svcDir := filepath.Join(dir, name+"-services")
			host, port, _ := net.SplitHostPort(backendAddr)
			if err := os.MkdirAll(svcDir, 0o700); err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(svcDir, "conformance.yaml"), fmt.Appendf(nil, "name: conformance\naddress: %s\nport: %s\n", host, port), 0o600); err != nil {
				return err
			}
			cfg += fmt.Sprintf("service_discovery:\n  services_dir: %s\n", svcDir)
		default:
			// The entry agent: the backend's address from the registry.
			cfg += routeTo("registry:///conformance")
		}
		cfgPath := filepath.Join(dir, name+".yaml")
		if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
			return err
		}
		logf, err := os.Create(filepath.Join(dir, name+".log"))
		if err != nil {
			return err
		}
		defer logf.Close()
		args := []string{
			"--config", cfgPath,
			"--node-name", name,
			"--data-dir", filepath.Join(dir, name),
			"--api-addr", addr(i, 0),
			"--internal-addr", addr(i, 1),
			"--metrics-addr", addr(i, 2),
			"--gossip-addr", addr(i, 3),
			"--raft-addr", addr(i, 4),
			"--bootstrap-expect", strconv.Itoa(agents),
			"--retry-interval", "200ms",
		}
		for j := range agents {
			if j != i {
				args = append(args, "--retry-join", addr(j, 3))
			}
		}
		ag := exec.Command(agentBin, args...)
		ag.Stdout, ag.Stderr = logf, logf
		setPdeathsig(ag)
		if err := ag.Start(); err != nil {
			return fmt.Errorf("start %s: %w", agentBin, err)
		}
		children = append(children, ag)
		go func() {
			err := ag.Wait()
			b, _ := os.ReadFile(logf.Name())
			exited <- &exitError{fmt.Sprintf("agent %s exited: %v; its log:\n%s", name, err, tailLines(string(b), 30))}
		}()
	}
	for i := range agents {
		if err := waitReady(ctx, addr(i, 2), exited); err != nil {
			if e := (*exitError)(nil); errors.As(err, &e) {
				return err // with the log of the agent that exited
			}
			b, _ := os.ReadFile(filepath.Join(dir, fmt.Sprintf("conformance%d.log", i+1)))
			return fmt.Errorf("agent conformance%d: %w; its log:\n%s", i+1, err, tailLines(string(b), 30))
		}
	}
	entry := agents - 1
	if err := waitRouted(ctx, addr(entry, 0), certs, req, exited); err != nil {
		return err
	}
	if err := writeDelimited(os.Stdout, response("127.0.0.1", uint32(ports[5*entry]), caPEM)); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
	case err := <-exited:
		return err
	}
	return nil
}

// exitError is an agent's exit before the suite ended, with its log's tail.
type exitError struct{ msg string }

func (e *exitError) Error() string { return e.msg }

// startBackend runs the reference server as a plaintext gRPC (h2c)
// backend on a free port of 127.0.0.1 and returns its address.
func startBackend(ctx context.Context, bin, dir string, limit uint32) (*exec.Cmd, string, error) {
	var in []byte
	in = protowire.AppendTag(in, 1, protowire.VarintType)
	in = protowire.AppendVarint(in, 2) // PROTOCOL_GRPC
	in = protowire.AppendTag(in, 2, protowire.VarintType)
	in = protowire.AppendVarint(in, 2) // HTTP_VERSION_2
	if limit > 0 {
		in = protowire.AppendTag(in, 6, protowire.VarintType)
		in = protowire.AppendVarint(in, uint64(limit))
	}
	cmd := exec.CommandContext(ctx, bin, "-bind", "127.0.0.1", "-port", "0")
	var stdin strings.Builder
	_ = writeDelimited(&stdin, in)
	cmd.Stdin = strings.NewReader(stdin.String())
	logf, err := os.Create(filepath.Join(dir, "backend.log"))
	if err != nil {
		return nil, "", err
	}
	cmd.Stderr = logf
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, "", err
	}
	setPdeathsig(cmd)
	if err := cmd.Start(); err != nil {
		return nil, "", fmt.Errorf("start %s: %w", bin, err)
	}
	raw, err := readDelimited(bufio.NewReader(out))
	if err != nil {
		terminate(cmd)
		return nil, "", fmt.Errorf("the reference server did not answer its ServerCompatRequest: %w (log %s)", err, logf.Name())
	}
	host, port := "", uint64(0)
	if err := walk(raw, func(num protowire.Number, typ protowire.Type, v []byte, n uint64) {
		switch num {
		case 1:
			host = string(v)
		case 2:
			port = n
		}
	}); err != nil || port == 0 {
		terminate(cmd)
		return nil, "", fmt.Errorf("the reference server's ServerCompatResponse has no port (%v)", err)
	}
	if host == "" {
		host = "127.0.0.1"
	}
	go func() { _, _ = io.Copy(io.Discard, out) }()
	return cmd, net.JoinHostPort(host, strconv.FormatUint(port, 10)), nil
}

// makePKI makes a PiTrust PKI with the real pitrust binary: a server
// certificate for 127.0.0.1 and an agent certificate per agent, and a
// client CA file that trusts the suite's own client certificate as
// itself beside the PiTrust chain. It returns the directory and the
// certificate the suite's client should trust (the PiTrust root).
func makePKI(pitrust, dir string, clientCert []byte, agents int) (string, []byte, error) {
	certs := filepath.Join(dir, "certs")
	steps := [][]string{{"init"}, {"issue-mtls-server", "--name", "agent-server", "--ip", "127.0.0.1", "--dns", "localhost"}}
	for i := range agents {
		steps = append(steps, []string{"issue-mtls-client", "--name", fmt.Sprintf("pivirt-agent-conformance%d", i+1)})
	}
	// The server under test's own readiness calls (waitRouted).
	steps = append(steps, []string{"issue-mtls-client", "--name", "sut-probe"})
	for _, args := range steps {
		cmd := exec.Command(pitrust, append(args, "--dir", certs)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", nil, fmt.Errorf("pitrust %s: %w: %s", args[0], err, out)
		}
	}
	chain, err := os.ReadFile(filepath.Join(certs, "ca-chain.pem"))
	if err != nil {
		return "", nil, err
	}
	if err := os.WriteFile(filepath.Join(certs, "client-ca.pem"), append(append(chain, '\n'), clientCert...), 0o644); err != nil {
		return "", nil, err
	}
	root, err := os.ReadFile(filepath.Join(certs, "PiRootR1.pem"))
	if err != nil {
		return "", nil, err
	}
	// Access control as in production: an RBAC policy that grants the
	// suite's service, by its full name and the verb call, to the role
	// the suite's client certificate (and the probe's) are given.
	policy := fmt.Sprintf(`apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["conformance"]
    resources: ["%s"]
    verbs: ["call"]
`, service)
	if err := os.WriteFile(filepath.Join(certs, "rbac.yaml"), []byte(policy), 0o600); err != nil {
		return "", nil, err
	}
	return certs, root, nil
}

// agentConfig is the configuration of agent name for req: access control
// off in plaintext (the development setup), TLS from certs otherwise.
func agentConfig(req request, certs, name string) string {
	var b strings.Builder
	b.WriteString("logging:\n  format: text\n  level: warn\n")
	if !req.useTLS {
		b.WriteString("tls:\n  enabled: false\n")
		return b.String()
	}
	fmt.Fprintf(&b, `tls:
  enabled: true
  ca_file: %[1]s/ca-chain.pem
  cert_file: %[1]s/pivirt-agent-%[2]s.crt
  key_file: %[1]s/pivirt-agent-%[2]s.key
  require_client_cert: %[3]t
server:
  connectrpc:
    tls:
      cert_file: %[1]s/agent-server.crt
      key_file: %[1]s/agent-server.key
      ca_file: %[1]s/ca-chain.pem
      client_ca_file: %[1]s/client-ca.pem
auth:
  rbac_policy: %[1]s/rbac.yaml
  certificate_roles:
    "Conformance Client": [conformance]
    sut-probe: [conformance]
`, certs, name, len(req.clientCert) > 0)
	return b.String()
}

// descriptorSet, when set, is named in the routing rule: the agent has the
// service's schema.
var descriptorSet string

// routeTo is the backend and routing rule of the suite's service.
func routeTo(endpoint string) string {
	s := fmt.Sprintf("backends:\n  conformance:\n    endpoint: %s\n    tls:\n      enabled: false\n", endpoint) +
		fmt.Sprintf("routing:\n  rules:\n    - match:\n        prefix: /%s\n      route:\n        cluster: conformance\n", service)
	if descriptorSet != "" {
		s += fmt.Sprintf("        descriptor_set: %s\n", descriptorSet)
	}
	return s
}

// waitRouted calls the suite's service through the entry agent (Connect,
// an empty Unary request) until the call reaches the backend: through a
// second agent, the backend's registration must reach it first.
func waitRouted(ctx context.Context, api, certs string, req request, exited <-chan *exitError) error {
	client := &http.Client{Timeout: 5 * time.Second}
	scheme := "http"
	if req.useTLS {
		roots := x509.NewCertPool()
		chain, err := os.ReadFile(filepath.Join(certs, "ca-chain.pem"))
		if err != nil {
			return err
		}
		roots.AppendCertsFromPEM(chain)
		probe, err := tls.LoadX509KeyPair(filepath.Join(certs, "sut-probe.crt"), filepath.Join(certs, "sut-probe.key"))
		if err != nil {
			return err
		}
		client.Transport = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{probe}}}
		scheme = "https"
	}
	deadline := time.Now().Add(time.Minute)
	var last string
	for time.Now().Before(deadline) {
		r, _ := http.NewRequestWithContext(ctx, http.MethodPost, scheme+"://"+api+"/"+service+"/Unary", strings.NewReader(""))
		r.Header.Set("Content-Type", "application/proto")
		resp, err := client.Do(r)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = resp.Status + " " + string(b)
		} else {
			last = err.Error()
		}
		select {
		case err := <-exited:
			return err
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("the suite's service is not served through the entry agent a minute after start: %s", last)
}

// waitReady polls the agent's /ready on its metrics port until it answers
// 200, for at most a minute.
func waitReady(ctx context.Context, metricsAddr string, exited <-chan *exitError) error {
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	deadline := time.Now().Add(time.Minute)
	var last string
	for time.Now().Before(deadline) {
		for _, scheme := range []string{"http", "https"} {
			resp, err := client.Get(scheme + "://" + metricsAddr + "/ready")
			if err != nil {
				last = err.Error()
				continue
			}
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = resp.Status
		}
		select {
		case err := <-exited:
			return err
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("not ready a minute after start: %s", last)
}

// terminate stops children: SIGTERM, then SIGKILL for those still
// running after 3 s (the suite kills the server under test 5 s after its
// own SIGTERM: the temporary directory is removed within that).
func terminate(cmds ...*exec.Cmd) {
	var running []*exec.Cmd
	for _, c := range cmds {
		if c.Process != nil && c.Process.Signal(syscall.SIGTERM) == nil {
			running = append(running, c)
		}
	}
	deadline := time.Now().Add(3 * time.Second)
	for _, c := range running {
		for time.Now().Before(deadline) && c.Process.Signal(syscall.Signal(0)) == nil {
			time.Sleep(50 * time.Millisecond)
		}
		_ = c.Process.Kill()
	}
}

// freePorts picks n ports of 127.0.0.1 free for TCP and UDP (the gossip
// port is both), each held until all are picked, below the kernel's
// ephemeral range: a port from that range may be taken by any outgoing
// connection before the agent binds it. (The main module's
// internal/freeport does the same; this module does not depend on it, so
// that the suite's pinned dependencies stay its own.)
func freePorts(n int) ([]int, error) {
	lo := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil {
				lo = v
			}
		}
	}
	first, span := max(lo/2, 10000), lo-max(lo/2, 10000)
	var closers []io.Closer
	defer func() {
		for _, c := range closers {
			_ = c.Close()
		}
	}()
	var ports []int
	for attempt := 0; len(ports) < n; attempt++ {
		if attempt > 50*n+100 {
			return nil, fmt.Errorf("found only %d of %d free ports on 127.0.0.1", len(ports), n)
		}
		port := 0 // the kernel's choice when no range is left below its own
		if span >= 1000 {
			port = first + rand.IntN(span)
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		closers = append(closers, l)
		port = l.Addr().(*net.TCPAddr).Port
		u, err := net.ListenPacket("udp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		closers = append(closers, u)
		if !reserve(port) {
			continue // another process picked it and may not have bound it yet
		}
		ports = append(ports, port)
	}
	return ports, nil
}

// parseRequest decodes the fields of a ServerCompatRequest the agent acts
// on (connectrpc/conformance/v1/server_compat.proto).
func parseRequest(raw []byte) (request, error) {
	var r request
	err := walk(raw, func(num protowire.Number, _ protowire.Type, v []byte, n uint64) {
		switch num {
		case 1:
			r.protocol = int(n)
		case 2:
			r.httpVersion = int(n)
		case 4:
			r.useTLS = n != 0
		case 5:
			r.clientCert = append([]byte(nil), v...)
		case 6:
			r.receiveLimit = uint32(n)
		}
	})
	if err != nil {
		return r, fmt.Errorf("ServerCompatRequest: %w", err)
	}
	if r.httpVersion == 3 {
		return r, errors.New("ServerCompatRequest: HTTP/3 is not served by pivirt-agent (declare HTTP_VERSION_1 and HTTP_VERSION_2 only)")
	}
	if len(r.clientCert) > 0 {
		if _, err := x509.ParseCertificate(pemBlock(r.clientCert)); err != nil {
			return r, fmt.Errorf("ServerCompatRequest: client_tls_cert: %w", err)
		}
	}
	return r, nil
}

// response encodes a ServerCompatResponse.
func response(host string, port uint32, pemCert []byte) []byte {
	var b []byte
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendString(b, host)
	b = protowire.AppendTag(b, 2, protowire.VarintType)
	b = protowire.AppendVarint(b, uint64(port))
	if len(pemCert) > 0 {
		b = protowire.AppendTag(b, 3, protowire.BytesType)
		b = protowire.AppendBytes(b, pemCert)
	}
	return b
}

// walk calls f for every top-level field of a message: v for length-
// delimited fields, n for varints.
func walk(b []byte, f func(num protowire.Number, typ protowire.Type, v []byte, n uint64)) error {
	for len(b) > 0 {
		num, typ, l := protowire.ConsumeTag(b)
		if l < 0 {
			return protowire.ParseError(l)
		}
		b = b[l:]
		switch typ {
		case protowire.VarintType:
			n, l := protowire.ConsumeVarint(b)
			if l < 0 {
				return protowire.ParseError(l)
			}
			f(num, typ, nil, n)
			b = b[l:]
		case protowire.BytesType:
			v, l := protowire.ConsumeBytes(b)
			if l < 0 {
				return protowire.ParseError(l)
			}
			f(num, typ, v, 0)
			b = b[l:]
		default:
			l := protowire.ConsumeFieldValue(num, typ, b)
			if l < 0 {
				return protowire.ParseError(l)
			}
			b = b[l:]
		}
	}
	return nil
}

// readDelimited reads one message preceded by its length (4 bytes, big
// endian), as the suite frames them.
func readDelimited(r io.Reader) ([]byte, error) {
	var n [4]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return nil, err
	}
	size := binary.BigEndian.Uint32(n[:])
	if size > 16<<20 {
		return nil, fmt.Errorf("a message of %d bytes: more than 16 MiB", size)
	}
	b := make([]byte, size)
	_, err := io.ReadFull(r, b)
	return b, err
}

func writeDelimited(w io.Writer, b []byte) error {
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(len(b)))
	if _, err := w.Write(n[:]); err != nil {
		return err
	}
	_, err := w.Write(b)
	return err
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
