package main

import (
	"crypto/tls"
	"crypto/x509"
	"io"
	"log"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/identity"
)

// TestRefusedClientCertificate: when the agent refuses the TLS handshake,
// pvcli says what it finds wrong with its own certificate.
func TestRefusedClientCertificate(t *testing.T) {
	t.Parallel()
	good, other := t.TempDir(), t.TempDir()
	for _, dir := range []string{good, other} {
		if _, err := identity.InitCA(dir, identity.CAOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	issue := func(dir string, req identity.LeafRequest) identity.LeafFiles {
		t.Helper()
		f, err := identity.Issue(dir, req)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	srvFiles := issue(good, identity.LeafRequest{Kind: identity.KindServer, Name: "agent", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	foreign := issue(other, identity.LeafRequest{Kind: identity.KindClient, Name: "foreign"})
	serverOnly := issue(good, identity.LeafRequest{Kind: identity.KindServer, Name: "server-only", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	expired := issue(good, identity.LeafRequest{Kind: identity.KindClient, Name: "expired", Days: 1,
		Now: func() time.Time { return time.Now().Add(-72 * time.Hour) }})
	ok := issue(good, identity.LeafRequest{Kind: identity.KindClient, Name: "operator"})
	chain := filepath.Join(good, identity.ChainFile)

	pair, err := tls.LoadX509KeyPair(srvFiles.Cert, srvFiles.Key)
	if err != nil {
		t.Fatal(err)
	}
	pem, err := os.ReadFile(chain)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	fake := newFakeCluster()
	srv := httptest.NewUnstartedServer(fake.handler())
	srv.EnableHTTP2 = true
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{pair}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pool, MinVersion: tls.VersionTLS12}
	srv.StartTLS()
	t.Cleanup(srv.Close)

	for _, tt := range []struct {
		name  string
		files *identity.LeafFiles
		want  string
	}{
		{"none", nil, "pvcli sent no client certificate"},
		{"another CA", &foreign, "does not chain to a CA of " + chain},
		{"server only", &serverOnly, "does not include client authentication"},
		{"expired", &expired, "it expired on "},
		{"fine", &ok, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			args := []string{"--endpoint", srv.URL, "--ca-file", chain, "--timeout", "5s"}
			if tt.files != nil {
				args = append(args, "--cert-file", tt.files.Cert, "--key-file", tt.files.Key)
			}
			r := cliRun{}.run(t, append(args, "cluster", "members")...)
			if tt.want == "" {
				r.mustSucceed(t)
				return
			}
			if r.err == nil || !strings.Contains(r.stderr, tt.want) {
				t.Errorf("stderr = %q, want %q", r.stderr, tt.want)
			}
		})
	}
}

// TestUnclearFailureExplained: a call that failed without a TLS alert
// (with TLS 1.3 the agent's refusal of a client certificate can arrive as
// a broken pipe) still says what is wrong with pvcli's certificate, and
// nothing when it is fine.
func TestUnclearFailureExplained(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if _, err := identity.InitCA(dir, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	serverOnly, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: "server-only", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	ok, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: "operator"})
	if err != nil {
		t.Fatal(err)
	}
	chain := filepath.Join(dir, identity.ChainFile)
	var b strings.Builder
	explainUnclearFailure(&b, tlsOptions{certFile: serverOnly.Cert, keyFile: serverOnly.Key, caFile: chain}, time.Now())
	if !strings.Contains(b.String(), "may have refused pvcli's client certificate") || !strings.Contains(b.String(), "does not include client authentication") {
		t.Errorf("a server certificate as the client's: %q", b.String())
	}
	b.Reset()
	explainUnclearFailure(&b, tlsOptions{certFile: ok.Cert, keyFile: ok.Key, caFile: chain}, time.Now())
	if b.String() != "" {
		t.Errorf("a fine client certificate: %q, want nothing", b.String())
	}
}
