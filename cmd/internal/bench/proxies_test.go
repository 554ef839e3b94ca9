package bench

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"text/template"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/identity"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// benchPKI is one PiTrust CA with a server certificate (localhost,
// 127.0.0.1) that every TLS server of BenchmarkGateway presents — the
// simulator, the agent's API port, the relay, HAProxy and nginx — and a
// client certificate every client presents, the proxies' backend legs
// included.
type benchPKI struct {
	// Exported for the proxies' configuration templates.
	Chain                 string // CA chain (root and X1) in PEM
	ServerCert, ServerKey string
	ClientCert, ClientKey string
	AgentCert, AgentKey   string // the agent's own client identity (tls.cert_file)
	ServerPEM, ClientPEM  string // certificate, chain and key in one file (HAProxy's crt)
	server, client        tls.Certificate
	pool                  *x509.CertPool
}

func newBenchPKI(b *testing.B) *benchPKI {
	b.Helper()
	dir := b.TempDir()
	if _, err := identity.InitCA(dir, identity.CAOptions{}); err != nil {
		b.Fatalf("bench CA: %v", err)
	}
	srv, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: "bench-server",
		DNS: []string{"localhost"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		b.Fatalf("bench server certificate: %v", err)
	}
	cli, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: "bench-client"})
	if err != nil {
		b.Fatalf("bench client certificate: %v", err)
	}
	agent, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-node1"})
	if err != nil {
		b.Fatalf("bench agent certificate: %v", err)
	}
	p := &benchPKI{AgentCert: agent.Cert, AgentKey: agent.Key, Chain: filepath.Join(dir, identity.ChainFile), ServerCert: srv.Cert, ServerKey: srv.Key, ClientCert: cli.Cert, ClientKey: cli.Key}
	p.ServerPEM, p.ClientPEM = filepath.Join(dir, "server.pem"), filepath.Join(dir, "client.pem")
	for _, f := range []struct{ out, cert, key string }{{p.ServerPEM, srv.Cert, srv.Key}, {p.ClientPEM, cli.Cert, cli.Key}} {
		var buf []byte
		for _, in := range []string{f.cert, f.key} {
			c, err := os.ReadFile(in)
			if err != nil {
				b.Fatal(err)
			}
			buf = append(buf, c...)
		}
		if err := os.WriteFile(f.out, buf, 0o600); err != nil {
			b.Fatal(err)
		}
	}
	if p.server, err = tls.LoadX509KeyPair(srv.Cert, srv.Key); err != nil {
		b.Fatal(err)
	}
	if p.client, err = tls.LoadX509KeyPair(cli.Cert, cli.Key); err != nil {
		b.Fatal(err)
	}
	pem, err := os.ReadFile(p.Chain)
	if err != nil {
		b.Fatal(err)
	}
	p.pool = x509.NewCertPool()
	if !p.pool.AppendCertsFromPEM(pem) {
		b.Fatalf("%s: no certificate", p.Chain)
	}
	return p
}

// serverTLS requires and verifies a client certificate of the CA.
func (p *benchPKI) serverTLS() *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{p.server},
		ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: p.pool, NextProtos: []string{"h2"}}
}

// clientCreds presents the client certificate and checks the server's for
// localhost (it names 127.0.0.1 too).
func (p *benchPKI) clientCreds() credentials.TransportCredentials {
	return credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{p.client},
		RootCAs: p.pool, ServerName: "localhost"})
}

// dialVM opens a grpc-go client to addr (host:port or unix:///path), with
// pki's client certificate when pki is not nil.
func dialVM(b *testing.B, addr string, pki *benchPKI) vmv1.VMServiceClient {
	b.Helper()
	creds := insecure.NewCredentials()
	if pki != nil {
		creds = pki.clientCreds()
	}
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cc.Close() })
	return vmv1.NewVMServiceClient(cc)
}

// findProxy is the path of a proxy's executable: on PATH, else in the
// sbin directories Debian installs it into (not on a non-root PATH).
func findProxy(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, dir := range []string{"/usr/sbin", "/usr/local/sbin", "/sbin"} {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found on PATH nor in /usr/sbin, /usr/local/sbin, /sbin (install it with scripts/bench-deps.sh, which make bench runs)", name)
}

// proxyConf is what the HAProxy and nginx configurations are made of.
type proxyConf struct {
	Dir     string // the proxy's temp dir: logs, pid file, temp files
	Threads int    // nbthread / worker_processes
	Port    int    // 127.0.0.1 port it listens on
	Backend string // the simulator's unix socket path
	User    string // nginx: the user of its workers when it runs as root
	TLS     *benchPKI
}

var haproxyConf = template.Must(template.New("haproxy").Parse(`global
	nbthread {{.Threads}}
	maxconn 4096
	tune.ssl.default-dh-param 2048

defaults
	mode http
	timeout connect 5s
	timeout client 1h
	timeout server 1h
	timeout http-keep-alive 1h

frontend api
	bind 127.0.0.1:{{.Port}} proto h2{{with .TLS}} ssl crt {{.ServerPEM}} ca-file {{.Chain}} verify required alpn h2{{end}}
	default_backend pivirtd

backend pivirtd
	server sim {{.Backend}} proto h2{{with .TLS}} ssl crt {{.ClientPEM}} ca-file {{.Chain}} verify required verifyhost localhost sni str(localhost) alpn h2{{end}}
`))

var nginxConf = template.Must(template.New("nginx").Parse(`{{with .User}}user {{.}};
{{end}}worker_processes {{.Threads}};
pid {{.Dir}}/nginx.pid;
error_log {{.Dir}}/error.log warn;

events {
	worker_connections 4096;
}

http {
	access_log off;
	client_body_temp_path {{.Dir}}/client_body;
	proxy_temp_path {{.Dir}}/proxy;
	fastcgi_temp_path {{.Dir}}/fastcgi;
	uwsgi_temp_path {{.Dir}}/uwsgi;
	scgi_temp_path {{.Dir}}/scgi;
	keepalive_requests 100000000;
	keepalive_timeout 1h;
	client_body_timeout 1h;
	# A stream's request body is all its messages: the default 1m limit
	# resets a console stream after about 60,000 inputs.
	client_max_body_size 0;
	grpc_read_timeout 1h;
	grpc_send_timeout 1h;

	upstream pivirtd {
		server unix:{{.Backend}};
		keepalive 256;
		keepalive_requests 100000000;
		keepalive_timeout 1h;
	}

	server {
		listen 127.0.0.1:{{.Port}}{{if .TLS}} ssl{{end}} http2;
{{- with .TLS}}
		ssl_certificate {{.ServerCert}};
		ssl_certificate_key {{.ServerKey}};
		ssl_client_certificate {{.Chain}};
		ssl_verify_client on;
		ssl_verify_depth 3;
{{- end}}
		location / {
			grpc_pass {{if .TLS}}grpcs{{else}}grpc{{end}}://pivirtd;
{{- with .TLS}}
			grpc_ssl_certificate {{.ClientCert}};
			grpc_ssl_certificate_key {{.ClientKey}};
			grpc_ssl_trusted_certificate {{.Chain}};
			grpc_ssl_verify on;
			grpc_ssl_verify_depth 3;
			grpc_ssl_name localhost;
			grpc_ssl_server_name on;
			grpc_ssl_session_reuse on;
{{- end}}
		}
	}
}
`))

// proxyProc is a proxy running as a child of the benchmark.
type proxyProc struct {
	name string
	addr string // 127.0.0.1:port
	cmd  *exec.Cmd
	dir  string
}

// cpu is the CPU time the proxy's processes have used: the process itself
// and its direct children (nginx's workers).
func (p *proxyProc) cpu() time.Duration {
	pid := p.cmd.Process.Pid
	total := procCPU(pid)
	for _, c := range childPIDs(pid) {
		total += procCPU(c)
	}
	return total
}

// clockTicks is Linux's USER_HZ, the unit of /proc/<pid>/stat's times.
const clockTicks = 100

// procStat is the fields of /proc/<pid>/stat after the command name.
func procStat(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}

func procCPU(pid int) time.Duration {
	f := procStat(pid)
	if len(f) < 13 {
		return 0
	}
	// Fields 14 and 15 of stat (utime, stime): 12 and 13 after the name.
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+s) * time.Second / clockTicks
}

func procPPID(pid int) (int, bool) {
	f := procStat(pid)
	if len(f) < 2 {
		return 0, false
	}
	n, err := strconv.Atoi(f[1])
	return n, err == nil
}

// startProxy starts HAProxy ("haproxy") or nginx ("nginx") in the
// foreground with a configuration of its own in a temp dir, in front of the
// simulator's unix socket at backend, and waits until a GetVM of id goes
// through it. The process is killed at the end of the benchmark. An error
// says why the proxy cannot run here (not installed, refused its
// configuration, never answered).
func startProxy(b *testing.B, name string, threads int, backend string, pki *benchPKI, id string) (*proxyProc, error) {
	bin, err := findProxy(name)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "pivirt-bench-"+name+"-")
	if err != nil {
		return nil, err
	}
	b.Cleanup(func() { _ = os.RemoveAll(dir) })
	c := proxyConf{Dir: dir, Threads: threads, Port: agenttest.FreePort(b), Backend: backend, TLS: pki}
	conf := filepath.Join(dir, name+".conf")
	var args []string
	var tmpl *template.Template
	switch name {
	case "haproxy":
		tmpl, args = haproxyConf, []string{"-f", conf, "-db"}
	case "nginx":
		if os.Geteuid() == 0 {
			// As root the workers would run as nobody, who may not open
			// the simulator's socket in the benchmark's temp dir.
			c.User = "root"
		}
		tmpl, args = nginxConf, []string{"-p", dir, "-c", conf, "-e", filepath.Join(dir, "error.log"), "-g", "daemon off;"}
	default:
		return nil, fmt.Errorf("unknown proxy %q", name)
	}
	var buf bytes.Buffer
	if err := tmpl.Execute(&buf, c); err != nil {
		return nil, err
	}
	if err := os.WriteFile(conf, buf.Bytes(), 0o600); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(dir, "output.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = logf, logf
	// A process group of its own: the cleanup ends the proxy and its
	// workers together, and nothing else.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	b.Cleanup(func() {
		pgid := cmd.Process.Pid
		_ = syscall.Kill(-pgid, syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
		}
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
	})
	p := &proxyProc{name: name, addr: fmt.Sprintf("127.0.0.1:%d", c.Port), cmd: cmd, dir: dir}
	logs := func() string {
		out, _ := os.ReadFile(filepath.Join(dir, "output.log"))
		errlog, _ := os.ReadFile(filepath.Join(dir, "error.log"))
		return strings.TrimSpace(string(out) + "\n" + string(errlog))
	}
	api := dialVM(b, p.addr, pki)
	deadline := time.Now().Add(15 * time.Second)
	for i := 0; ; i++ {
		select {
		case <-exited:
			return nil, fmt.Errorf("%s exited at start (configuration %s): %s", name, conf, logs())
		default:
		}
		ctx, cancel := context.WithTimeout(b.Context(), time.Second)
		_, err := api.GetVM(ctx, &vmv1.GetVMRequest{Id: id})
		cancel()
		if err == nil {
			return p, nil
		}
		if time.Now().After(deadline) || i >= 300 {
			return nil, fmt.Errorf("%s on %s: no GetVM answered in 15 s: %v; its log: %s", name, p.addr, err, logs())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// childPIDs are the processes whose parent is pid.
func childPIDs(pid int) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, ok := procPPID(child); ok && ppid == pid {
			out = append(out, child)
		}
	}
	return out
}
