package identity

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// pki is a CA directory with issued leaves, for handshake tests.
type pki struct {
	t   *testing.T
	dir string
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	dir := t.TempDir()
	if _, err := InitCA(dir, CAOptions{}); err != nil {
		t.Fatal(err)
	}
	return &pki{t: t, dir: dir}
}

func (p *pki) issue(req LeafRequest) LeafFiles {
	p.t.Helper()
	req.Force = true
	f, err := Issue(p.dir, req)
	if err != nil {
		p.t.Fatal(err)
	}
	return f
}

func (p *pki) chain() string { return filepath.Join(p.dir, ChainFile) }

func (p *pki) source(leaf LeafFiles) *Source {
	p.t.Helper()
	s, err := NewSource(SourceConfig{CertFile: leaf.Cert, KeyFile: leaf.Key, CAFile: p.chain()})
	if err != nil {
		p.t.Fatal(err)
	}
	return s
}

// serve accepts TLS connections on 127.0.0.1 and answers each with its
// own certificate's serial; it records handshake errors.
type server struct {
	ln   net.Listener
	errs chan error
	wg   sync.WaitGroup
}

func serve(t *testing.T, cfg *tls.Config) *server {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &server{ln: ln, errs: make(chan error, 1000)}
	s.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.wg.Go(func() {
				defer c.Close()
				tc := tls.Server(c, cfg)
				_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
				if err := tc.Handshake(); err != nil {
					select {
					case s.errs <- err:
					default:
					}
					return
				}
				_, _ = io.WriteString(tc, "ok\n")
			})
		}
	})
	t.Cleanup(func() {
		ln.Close()
		s.wg.Wait()
	})
	return s
}

func (s *server) addr() string { return s.ln.Addr().String() }

// waitErr waits for a handshake error containing want, skipping others
// (those of earlier clients the client side refused).
func (s *server) waitErr(t *testing.T, want string) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	var seen []string
	for {
		select {
		case err := <-s.errs:
			if strings.Contains(err.Error(), want) {
				return
			}
			seen = append(seen, err.Error())
		case <-deadline:
			t.Fatalf("no handshake error saying %q; saw %q", want, seen)
		}
	}
}

// lastErr returns the newest handshake error the server saw.
func (s *server) lastErr(t *testing.T) error {
	t.Helper()
	select {
	case err := <-s.errs:
		return err
	case <-time.After(5 * time.Second):
		t.Fatal("the server saw no handshake error")
		return nil
	}
}

// dial handshakes with cfg and returns the server's leaf.
func dial(addr string, cfg *tls.Config) (*x509.Certificate, error) {
	d := &net.Dialer{Timeout: 5 * time.Second}
	c, err := tls.DialWithDialer(d, "tcp", addr, cfg)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadAll(io.LimitReader(c, 3)); err != nil {
		return nil, err
	}
	return c.ConnectionState().PeerCertificates[0], nil
}

func TestHandshakes(t *testing.T) {
	p := newPKI(t)
	srvLeaf := p.issue(LeafRequest{Kind: KindServer, Name: "node-01.pivirt.internal", DNS: []string{"node-01.pivirt.internal"}, IPs: []net.IP{net.ParseIP("127.0.0.1")}})
	cliLeaf := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node-02"})
	srv, cli := p.source(srvLeaf), p.source(cliLeaf)

	agentsOnly := func(c *x509.Certificate) error {
		if !strings.HasPrefix(c.Subject.CommonName, "pivirt-agent-") {
			return fmt.Errorf("%q is not an agent identity", c.Subject.CommonName)
		}
		return nil
	}
	mtls := serve(t, srv.ServerConfig(tls.RequireAndVerifyClientCert, agentsOnly))
	if _, err := dial(mtls.addr(), cli.ClientConfig("node-01.pivirt.internal")); err != nil {
		t.Fatalf("mTLS handshake with an agent certificate: %v", err)
	}
	c, err := tls.Dial("tcp", mtls.addr(), cli.ClientConfig("127.0.0.1"))
	if err != nil {
		t.Fatalf("handshake by IP: %v", err)
	}
	if st := c.ConnectionState(); st.Version != tls.VersionTLS13 {
		t.Errorf("negotiated %x, want TLS 1.3", st.Version)
	}
	c.Close()

	// Refusals, each with a message that says why.
	other := newPKI(t)
	otherCli := other.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-evil"})
	expiredCli := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-old", Days: 1, Now: func() time.Time { return time.Now().Add(-72 * time.Hour) }})
	notAgent := p.issue(LeafRequest{Kind: KindClient, Name: "backup-tool"})
	noCert, err := NewSource(SourceConfig{CAFile: p.chain()})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name   string
		client *tls.Config
		want   string // in the server's handshake error
	}{
		{"client of another CA", p.sourceWithCA(otherCli, p.chain()).ClientConfig("node-01.pivirt.internal"), "not signed by the given CA chain"},
		{"expired client", p.source(expiredCli).ClientConfig("node-01.pivirt.internal"), "expired on"},
		{"no client certificate", noCert.ClientConfig("node-01.pivirt.internal"), "didn't provide a certificate"},
		{"server certificate as client", p.source(srvLeaf).ClientConfig("node-01.pivirt.internal"), "not valid for this use"},
		{"not an agent", p.source(notAgent).ClientConfig("node-01.pivirt.internal"), "not an agent identity"},
	} {
		if _, err := dial(mtls.addr(), tt.client); err == nil {
			t.Errorf("%s: handshake succeeded", tt.name)
			continue
		}
		if err := mtls.lastErr(t); !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: server error %q, want it to say %q", tt.name, err, tt.want)
		}
	}

	// The client side refuses a wrong name, another CA and a client
	// certificate offered as a server identity.
	if _, err := dial(mtls.addr(), cli.ClientConfig("node-09.pivirt.internal")); err == nil || !strings.Contains(err.Error(), `not valid for "node-09.pivirt.internal"`) {
		t.Errorf("wrong server name: %v", err)
	}
	if _, err := dial(mtls.addr(), p.sourceWithCA(cliLeaf, filepath.Join(other.dir, ChainFile)).ClientConfig("node-01.pivirt.internal")); err == nil || !strings.Contains(err.Error(), "not signed by the given CA chain") {
		t.Errorf("server of another CA: %v", err)
	}
	clientAsServer := serve(t, p.source(cliLeaf).ServerConfig(tls.NoClientCert, nil))
	if _, err := dial(clientAsServer.addr(), cli.ClientConfig("127.0.0.1")); err == nil || !strings.Contains(err.Error(), `server certificate "CN=pivirt-agent-node-02`) {
		t.Errorf("a client certificate as server identity: %v", err)
	}

	// A server certificate of the CA, but for another host, is refused
	// when dialling by IP; without a name to check, nothing is accepted.
	elsewhere := p.issue(LeafRequest{Kind: KindServer, Name: "evil.example", IPs: []net.IP{net.ParseIP("10.9.9.9")}})
	impostor := serve(t, p.source(elsewhere).ServerConfig(tls.NoClientCert, nil))
	if _, err := dial(impostor.addr(), cli.ClientConfig("127.0.0.1")); err == nil || !strings.Contains(err.Error(), `not valid for "127.0.0.1"`) {
		t.Errorf("a server certificate for another host: %v", err)
	}
	if _, err := dial(mtls.addr(), cli.ClientConfig("")); err == nil || !strings.Contains(err.Error(), "no server name") {
		t.Errorf("dialling an IP without a name to check: %v", err)
	}

	// A plaintext client on the TLS port.
	conn, err := net.Dial("tcp", mtls.addr())
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.WriteString(conn, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	conn.Close()
	mtls.waitErr(t, "does not look like a TLS handshake")

	// TLS 1.1 is refused.
	old := cli.ClientConfig("node-01.pivirt.internal")
	old.MinVersion, old.MaxVersion = tls.VersionTLS10, tls.VersionTLS11
	if _, err := dial(mtls.addr(), old); err == nil {
		t.Error("a TLS 1.1 client was accepted")
	}
}

func (p *pki) sourceWithCA(leaf LeafFiles, ca string) *Source {
	p.t.Helper()
	s, err := NewSource(SourceConfig{CertFile: leaf.Cert, KeyFile: leaf.Key, CAFile: ca})
	if err != nil {
		p.t.Fatal(err)
	}
	return s
}

// TestReloadUnderLoad replaces the server's certificate files again and
// again while clients handshake without pause: no handshake fails, new
// handshakes see the new certificate without a restart, and a broken file
// keeps the certificate in use.
func TestReloadUnderLoad(t *testing.T) {
	p := newPKI(t)
	leaf := p.issue(LeafRequest{Kind: KindServer, Name: "node-01.pivirt.internal", IPs: []net.IP{net.ParseIP("127.0.0.1")}})
	cliLeaf := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node-02"})
	srv, cli := p.source(leaf), p.source(cliLeaf)
	s := serve(t, srv.ServerConfig(tls.RequireAndVerifyClientCert, nil))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go srv.Watch(ctx, 10*time.Millisecond)

	var (
		ok, failed atomic.Int64
		firstErr   atomic.Value
		serials    sync.Map
		stop       = make(chan struct{})
		wg         sync.WaitGroup
	)
	for range 4 {
		wg.Go(func() {
			cfg := cli.ClientConfig("127.0.0.1")
			for {
				select {
				case <-stop:
					return
				default:
				}
				c, err := dial(s.addr(), cfg)
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
					continue
				}
				ok.Add(1)
				serials.Store(c.SerialNumber.String(), true)
			}
		})
	}
	const rotations = 10
	for i := range rotations {
		// Write the new pair beside, then rename into place: what an
		// operator's tooling (or pitrust --force, which renames) does.
		staged := filepath.Join(p.dir, "staged")
		if err := os.MkdirAll(staged, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := copyCA(staged, p.dir); err != nil {
			t.Fatal(err)
		}
		n, err := Issue(staged, LeafRequest{Kind: KindServer, Name: "node-01.pivirt.internal", IPs: []net.IP{net.ParseIP("127.0.0.1")}, Force: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(n.Key, leaf.Key); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(n.Cert, leaf.Cert); err != nil {
			t.Fatal(err)
		}
		want := mustLeaf(t, leaf.Cert).SerialNumber.String()
		deadline := time.Now().Add(10 * time.Second)
		for {
			if _, seen := serials.Load(want); seen {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("rotation %d: certificate %s not served within 10s", i, want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}

	// A broken certificate file: the one in use stays.
	inUse := srv.Leaf().SerialNumber
	if err := os.WriteFile(leaf.Cert, []byte("not a certificate"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := srv.Reload(); err == nil {
		t.Error("Reload of a broken certificate succeeded")
	}
	if got := srv.Leaf().SerialNumber; got.Cmp(inUse) != 0 {
		t.Error("a failed reload replaced the certificate in use")
	}
	before := ok.Load()
	deadline := time.Now().Add(10 * time.Second)
	for ok.Load() < before+20 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	if failed.Load() != 0 {
		t.Errorf("%d of %d handshakes failed during rotation; first: %v", failed.Load(), failed.Load()+ok.Load(), firstErr.Load())
	}
	if ok.Load() < before+20 {
		t.Errorf("handshakes stopped after the broken file: %d more", ok.Load()-before)
	}
	t.Logf("%d handshakes, %d rotations, 0 failures", ok.Load(), rotations)
}

// copyCA copies the intermediate CA of src into dir, to stage leaves
// signed by the same CA.
func copyCA(dir, src string) error {
	for _, f := range []string{IntermediateCertFile, IntermediateKeyFile} {
		b, err := os.ReadFile(filepath.Join(src, f))
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o600); err != nil {
			return err
		}
	}
	return nil
}

func mustLeaf(t *testing.T, path string) *x509.Certificate {
	t.Helper()
	certs, err := ReadCertificates(path)
	if err != nil {
		t.Fatal(err)
	}
	return certs[0]
}

// TestResumedSessionIsVerifiedAgain: a client resuming a TLS session after
// the server stopped trusting its CA is refused, as a full handshake is.
func TestResumedSessionIsVerifiedAgain(t *testing.T) {
	p := newPKI(t)
	other := newPKI(t)
	srvLeaf := p.issue(LeafRequest{Kind: KindServer, Name: "node-01.pivirt.internal", IPs: []net.IP{net.ParseIP("127.0.0.1")}})
	cliLeaf := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node-02"})

	// The server's CA file is a copy that the test replaces later.
	caFile := filepath.Join(t.TempDir(), "ca.pem")
	chain, err := os.ReadFile(p.chain())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(caFile, chain, 0o644); err != nil {
		t.Fatal(err)
	}
	srv, err := NewSource(SourceConfig{CertFile: srvLeaf.Cert, KeyFile: srvLeaf.Key, CAFile: caFile})
	if err != nil {
		t.Fatal(err)
	}
	s := serve(t, srv.ServerConfig(tls.RequireAndVerifyClientCert, nil))
	cfg := p.source(cliLeaf).ClientConfig("127.0.0.1")
	cfg.ClientSessionCache = tls.NewLRUClientSessionCache(4)
	if _, err := dial(s.addr(), cfg); err != nil {
		t.Fatal(err)
	}
	c, err := tls.Dial("tcp", s.addr(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	resumed := c.ConnectionState().DidResume
	c.Close()
	if !resumed {
		t.Fatal("the second connection did not resume the session: the test proves nothing")
	}

	otherChain, err := os.ReadFile(filepath.Join(other.dir, ChainFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(caFile, otherChain, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := srv.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := dial(s.addr(), cfg); err == nil {
		t.Fatal("a resumed session was accepted after the server stopped trusting the client's CA")
	}
	s.waitErr(t, "not signed by the given CA chain")
}

// TestSourceRefusesBadCAFiles: a CA file without a root, or with a
// truncated certificate, is refused at load instead of making every peer
// "not signed by the chain".
func TestSourceRefusesBadCAFiles(t *testing.T) {
	p := newPKI(t)
	chain, err := os.ReadFile(p.chain())
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for name, tt := range map[string]struct {
		data []byte
		want string
	}{
		"intermediate only": {mustRead(t, filepath.Join(p.dir, IntermediateCertFile)), "no self-signed root"},
		"half-written":      {chain[:len(chain)-40], "not a complete PEM block"},
	} {
		path := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".pem")
		if err := os.WriteFile(path, tt.data, 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := NewSource(SourceConfig{CAFile: path}); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: NewSource = %v, want an error saying %q", name, err, tt.want)
		}
	}
	for _, name := range []string{"PiCA", "pirootr1", "ca-chain"} {
		if _, err := Issue(p.dir, LeafRequest{Kind: KindClient, Name: name, Force: true}); err == nil || !strings.Contains(err.Error(), "CA's own file name") {
			t.Errorf("Issue(%s) = %v, want a refusal", name, err)
		}
	}
	if _, _, err := LoadCA(p.dir); err != nil {
		t.Errorf("the CA is damaged: %v", err)
	}
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// selfSigned makes a self-signed certificate (RSA, as the ConnectRPC
// conformance suite's client certificate) with the given usages and CA
// bit, and returns its PEM and the key pair.
func selfSigned(t *testing.T, cn string, isCA bool, usages ...x509.ExtKeyUsage) ([]byte, tls.Certificate) {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: usages, BasicConstraintsValid: true, IsCA: isCA,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	pair, err := tls.X509KeyPair(pemBytes, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}))
	if err != nil {
		t.Fatal(err)
	}
	return pemBytes, pair
}

// TestPinnedClientCertificates: with PinnedClients, a CA file may also
// hold a client's own self-signed certificate, trusted as itself in a
// real handshake beside the PiTrust chain; other non-CA certificates are
// still refused, and without PinnedClients every non-CA certificate is.
func TestPinnedClientCertificates(t *testing.T) {
	p := newPKI(t)
	server := p.issue(LeafRequest{Kind: KindServer, Name: "api", IPs: []net.IP{net.ParseIP("127.0.0.1")}})
	client := p.issue(LeafRequest{Kind: KindClient, Name: "operator"})
	pinnedPEM, pinned := selfSigned(t, "Conformance Client", false, x509.ExtKeyUsageClientAuth)
	_, other := selfSigned(t, "Not Pinned", false, x509.ExtKeyUsageClientAuth)
	serverPEM, _ := selfSigned(t, "A Server", false, x509.ExtKeyUsageServerAuth)
	dir := t.TempDir()
	write := func(name string, parts ...[]byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, bytes.Join(parts, []byte("\n")), 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	chain := mustRead(t, p.chain())
	withPinned := write("client-ca.pem", chain, pinnedPEM)

	if _, err := NewSource(SourceConfig{CertFile: server.Cert, KeyFile: server.Key, CAFile: withPinned}); err == nil || !strings.Contains(err.Error(), "is not a CA certificate") {
		t.Fatalf("without PinnedClients: %v, want a refusal", err)
	}
	if _, err := NewSource(SourceConfig{CAFile: write("server.pem", chain, serverPEM), PinnedClients: true}); err == nil || !strings.Contains(err.Error(), "client-auth usage") {
		t.Fatalf("a self-signed server certificate: %v, want a refusal naming what may be pinned", err)
	}
	src, err := NewSource(SourceConfig{CertFile: server.Cert, KeyFile: server.Key, CAFile: withPinned, PinnedClients: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := src.Pinned(); len(got) != 1 || !strings.Contains(got[0], "Conformance Client") {
		t.Errorf("Pinned() = %q", got)
	}
	srv := serve(t, src.ServerConfig(tls.RequireAndVerifyClientCert, nil))
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(chain)
	clientTLS := func(cert tls.Certificate) *tls.Config {
		return &tls.Config{RootCAs: roots, ServerName: "127.0.0.1", Certificates: []tls.Certificate{cert}}
	}
	if _, err := dial(srv.addr(), clientTLS(pinned)); err != nil {
		t.Errorf("the pinned certificate: %v", err)
	}
	ours, err := tls.LoadX509KeyPair(client.Cert, client.Key)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dial(srv.addr(), clientTLS(ours)); err != nil {
		t.Errorf("a certificate of the PiTrust chain beside it: %v", err)
	}
	if _, err := dial(srv.addr(), clientTLS(other)); err == nil {
		t.Error("a self-signed certificate not in the file was accepted")
	}
	srv.waitErr(t, "certificate")
}
