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
	flag.Parse()
	if *backend == "" {
		fatalf("--backend: the path of the conformance suite's referenceserver binary is required")
	}
	if err := run(*agent, *pitrust, *backend, *logDir); err != nil {
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

func run(agentBin, pitrustBin, backendBin, logRoot string) error {
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
	defer terminate(be)

	ports, err := freePorts(5)
	if err != nil {
		return err
	}
	api := net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0]))
	cfg, caPEM, err := agentConfig(pitrustBin, dir, req, backendAddr)
	if err != nil {
		return err
	}
	cfgPath := filepath.Join(dir, "agent.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return err
	}
	logf, err := os.Create(filepath.Join(dir, "agent.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	ag := exec.Command(agentBin,
		"--config", cfgPath,
		"--node-name", "conformance1",
		"--data-dir", filepath.Join(dir, "data"),
		"--api-addr", api,
		"--internal-addr", net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[1])),
		"--metrics-addr", net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[2])),
		"--gossip-addr", net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[3])),
		"--raft-addr", net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[4])),
		"--bootstrap-expect", "1")
	ag.Stdout, ag.Stderr = logf, logf
	setPdeathsig(ag)
	if err := ag.Start(); err != nil {
		return fmt.Errorf("start %s: %w", agentBin, err)
	}
	defer terminate(ag)
	exited := make(chan error, 1)
	go func() { exited <- ag.Wait() }()
	if err := waitReady(ctx, net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[2])), exited); err != nil {
		b, _ := os.ReadFile(logf.Name())
		return fmt.Errorf("agent: %w; its log:\n%s", err, tailLines(string(b), 30))
	}

	if err := writeDelimited(os.Stdout, response("127.0.0.1", uint32(ports[0]), caPEM)); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
	case err := <-exited:
		return fmt.Errorf("the agent exited: %v", err)
	}
	return nil
}

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

// agentConfig writes the agent's configuration for req: the routing rule
// for the suite's service, access control off (no OIDC, no policy: the
// development setup), TLS from a fresh PiTrust PKI when the suite asks for
// it. It returns the configuration and, with TLS, the certificate the
// suite's client should trust (the PiTrust root).
func agentConfig(pitrust, dir string, req request, backendAddr string) (string, []byte, error) {
	var b strings.Builder
	b.WriteString("logging:\n  format: text\n  level: warn\n")
	fmt.Fprintf(&b, "backends:\n  conformance:\n    endpoint: %s\n    tls:\n      enabled: false\n", backendAddr)
	fmt.Fprintf(&b, "routing:\n  rules:\n    - match:\n        prefix: /%s\n      route:\n        cluster: conformance\n", service)
	if !req.useTLS {
		b.WriteString("tls:\n  enabled: false\n")
		return b.String(), nil, nil
	}
	certs := filepath.Join(dir, "certs")
	for _, args := range [][]string{
		{"init"},
		{"issue-mtls-server", "--name", "conformance1-server", "--ip", "127.0.0.1", "--dns", "localhost"},
		{"issue-mtls-client", "--name", "pivirt-agent-conformance1"},
	} {
		cmd := exec.Command(pitrust, append(args, "--dir", certs)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", nil, fmt.Errorf("pitrust %s: %w: %s", args[0], err, out)
		}
	}
	chain, err := os.ReadFile(filepath.Join(certs, "ca-chain.pem"))
	if err != nil {
		return "", nil, err
	}
	clientCA := filepath.Join(certs, "client-ca.pem")
	if err := os.WriteFile(clientCA, append(append(chain, '\n'), req.clientCert...), 0o644); err != nil {
		return "", nil, err
	}
	fmt.Fprintf(&b, `tls:
  enabled: true
  ca_file: %[1]s/ca-chain.pem
  cert_file: %[1]s/pivirt-agent-conformance1.crt
  key_file: %[1]s/pivirt-agent-conformance1.key
  require_client_cert: %[3]t
server:
  connectrpc:
    tls:
      cert_file: %[1]s/conformance1-server.crt
      key_file: %[1]s/conformance1-server.key
      ca_file: %[1]s/ca-chain.pem
      client_ca_file: %[2]s
`, certs, clientCA, len(req.clientCert) > 0)
	root, err := os.ReadFile(filepath.Join(certs, "PiRootR1.pem"))
	if err != nil {
		return "", nil, err
	}
	return b.String(), root, nil
}

// waitReady polls the agent's /ready on its metrics port until it answers
// 200, for at most a minute.
func waitReady(ctx context.Context, metricsAddr string, exited <-chan error) error {
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
			return fmt.Errorf("exited during start: %v", err)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return fmt.Errorf("not ready a minute after start: %s", last)
}

// terminate stops a child: SIGTERM, then SIGKILL after 10 s.
func terminate(cmd *exec.Cmd) {
	if cmd.Process == nil || cmd.ProcessState != nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		for range 100 {
			if err := cmd.Process.Signal(syscall.Signal(0)); err != nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		close(done)
	}()
	<-done
	_ = cmd.Process.Kill()
}

// freePorts picks n free TCP ports of 127.0.0.1 (UDP too: the gossip port
// is both), holding each until all are picked.
func freePorts(n int) ([]int, error) {
	var closers []io.Closer
	defer func() {
		for _, c := range closers {
			_ = c.Close()
		}
	}()
	var ports []int
	for attempt := 0; len(ports) < n; attempt++ {
		if attempt > 10*n {
			return nil, fmt.Errorf("found only %d of %d free ports on 127.0.0.1", len(ports), n)
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		closers = append(closers, l)
		port := l.Addr().(*net.TCPAddr).Port
		u, err := net.ListenPacket("udp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		closers = append(closers, u)
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
