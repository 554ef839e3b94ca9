package identity_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/identity/revtest"
)

// revPKI is a test CA with its revocation service.
type revPKI struct {
	dir string
	srv *revtest.Server
}

func newRevPKI(t *testing.T) *revPKI {
	t.Helper()
	dir := t.TempDir()
	if _, err := identity.InitCA(dir, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	return &revPKI{dir: dir, srv: revtest.New(t, dir)}
}

func (p *revPKI) leaf(t *testing.T, name string, o revtest.LeafOptions) (identity.LeafFiles, []*x509.Certificate) {
	t.Helper()
	f, leaf := p.srv.Leaf(t, p.dir, name, o)
	return f, []*x509.Certificate{leaf, p.srv.CA}
}

func (p *revPKI) chainFile() string { return filepath.Join(p.dir, identity.ChainFile) }

func checker(t *testing.T, cfg identity.RevocationConfig) *identity.RevocationChecker {
	t.Helper()
	c, err := identity.NewRevocationChecker(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// closedURL is an http:// URL on a closed port of 127.0.0.1.
func closedURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return "http://" + addr + "/crl"
}

func wantRevoked(t *testing.T, err error, leaf *x509.Certificate) {
	t.Helper()
	if !errors.Is(err, identity.ErrRevoked) {
		t.Fatalf("want a revocation error, got %v", err)
	}
	if hex := identity.SerialHex(leaf.SerialNumber); !strings.Contains(err.Error(), hex) || hex != strings.ToUpper(hex) {
		t.Fatalf("the error %q does not name the serial %s", err, hex)
	}
	if !strings.Contains(err.Error(), "keyCompromise") {
		t.Fatalf("the error %q does not name the reason", err)
	}
}

func TestRevocationCRL(t *testing.T) {
	p := newRevPKI(t)
	_, good := p.leaf(t, "good", revtest.LeafOptions{NoOCSP: true})
	_, bad := p.leaf(t, "bad", revtest.LeafOptions{NoOCSP: true})
	_, down := p.leaf(t, "down", revtest.LeafOptions{NoOCSP: true, CRLURL: closedURL(t)})
	_, none := p.leaf(t, "none", revtest.LeafOptions{NoOCSP: true, NoCRL: true})
	p.srv.Revoke(bad[0].SerialNumber)

	results := map[string]int{}
	var mu sync.Mutex
	allow := checker(t, identity.RevocationConfig{Mode: identity.RevocationCRL, OnCheck: func(r string) { mu.Lock(); results[r]++; mu.Unlock() }})
	deny := checker(t, identity.RevocationConfig{Mode: identity.RevocationCRL, OnUnavailable: identity.RevocationDeny})

	if err := allow.Check(good); err != nil {
		t.Fatalf("good certificate: %v", err)
	}
	wantRevoked(t, allow.Check(bad), bad[0])
	wantRevoked(t, deny.Check(bad), bad[0])
	if err := allow.Check(none); err != nil {
		t.Fatalf("a certificate without CDP is not checked: %v", err)
	}
	// The cached CRL answers: no second fetch within Refresh.
	before := p.srv.CRLFetches.Load()
	for range 5 {
		_ = allow.Check(good)
	}
	if n := p.srv.CRLFetches.Load() - before; n != 0 {
		t.Fatalf("%d fetches within Refresh; want the cached CRL", n)
	}

	t.Run("unreachable", func(t *testing.T) {
		if err := allow.Check(down); err != nil {
			t.Fatalf("allow: %v", err)
		}
		err := deny.Check(down)
		if !errors.Is(err, identity.ErrRevocationUnavailable) {
			t.Fatalf("deny: want ErrRevocationUnavailable, got %v", err)
		}
	})
	t.Run("stale", func(t *testing.T) {
		p.srv.StaleCRL.Store(true)
		defer p.srv.StaleCRL.Store(false)
		fresh := func(mode string) *identity.RevocationChecker {
			return checker(t, identity.RevocationConfig{Mode: identity.RevocationCRL, OnUnavailable: mode})
		}
		if err := fresh(identity.RevocationAllow).Check(good); err != nil {
			t.Fatalf("allow: %v", err)
		}
		if err := fresh(identity.RevocationDeny).Check(good); !errors.Is(err, identity.ErrRevocationUnavailable) || !strings.Contains(err.Error(), "stale") {
			t.Fatalf("deny: want a stale CRL refused, got %v", err)
		}
	})
	t.Run("off", func(t *testing.T) {
		if err := checker(t, identity.RevocationConfig{Mode: identity.RevocationOff}).Check(bad); err != nil {
			t.Fatalf("mode off: %v", err)
		}
	})
	mu.Lock()
	defer mu.Unlock()
	if results[identity.RevocationGood] == 0 || results[identity.RevocationRevoked] == 0 || results[identity.RevocationSkipped] == 0 || results[identity.RevocationUnavailable] == 0 {
		t.Fatalf("results counted: %v", results)
	}
}

func TestRevocationCRLFetchedOnce(t *testing.T) {
	p := newRevPKI(t)
	_, good := p.leaf(t, "good", revtest.LeafOptions{NoOCSP: true})
	c := checker(t, identity.RevocationConfig{Mode: identity.RevocationCRL, OnUnavailable: identity.RevocationDeny})
	var wg sync.WaitGroup
	for range 20 {
		wg.Go(func() {
			if err := c.Check(good); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if n := p.srv.CRLFetches.Load(); n != 1 {
		t.Fatalf("%d CRL fetches for 20 concurrent checks; want 1", n)
	}
}

func TestRevocationOCSP(t *testing.T) {
	p := newRevPKI(t)
	_, good := p.leaf(t, "good", revtest.LeafOptions{NoCRL: true})
	_, bad := p.leaf(t, "bad", revtest.LeafOptions{NoCRL: true})
	_, unknown := p.leaf(t, "unknown", revtest.LeafOptions{NoCRL: true})
	p.srv.Revoke(bad[0].SerialNumber)
	p.srv.Unknown(unknown[0].SerialNumber)
	allow := checker(t, identity.RevocationConfig{Mode: identity.RevocationOCSP})
	deny := checker(t, identity.RevocationConfig{Mode: identity.RevocationOCSP, OnUnavailable: identity.RevocationDeny})

	if err := deny.Check(good); err != nil {
		t.Fatalf("good: %v", err)
	}
	wantRevoked(t, allow.Check(bad), bad[0])
	if err := allow.Check(unknown); err != nil {
		t.Fatalf("unknown, allow: %v", err)
	}
	if err := deny.Check(unknown); !errors.Is(err, identity.ErrRevocationUnavailable) || !strings.Contains(err.Error(), "unknown") {
		t.Fatalf("unknown, deny: %v", err)
	}
	// Answers are cached.
	before := p.srv.OCSPRequests.Load()
	_ = deny.Check(good)
	if n := p.srv.OCSPRequests.Load() - before; n != 0 {
		t.Fatalf("%d OCSP requests for a cached answer", n)
	}
	// A staple that does not parse is ignored: the responder answers.
	_, c := p.leaf(t, "other", revtest.LeafOptions{NoCRL: true})
	if err := deny.CheckStapled(c, []byte("not a response")); err != nil {
		t.Fatalf("a bad staple is ignored and the responder asked: %v", err)
	}
}

func TestRevocationBothFallsBackToOCSP(t *testing.T) {
	p := newRevPKI(t)
	_, bad := p.leaf(t, "bad", revtest.LeafOptions{CRLURL: closedURL(t)})
	_, good := p.leaf(t, "good", revtest.LeafOptions{})
	p.srv.Revoke(bad[0].SerialNumber)
	c := checker(t, identity.RevocationConfig{OnUnavailable: identity.RevocationDeny})
	wantRevoked(t, c.Check(bad), bad[0])
	if p.srv.OCSPRequests.Load() != 1 {
		t.Fatalf("OCSP asked %d times; want once", p.srv.OCSPRequests.Load())
	}
	// With a CRL at hand, OCSP is not asked.
	if err := c.Check(good); err != nil {
		t.Fatal(err)
	}
	if p.srv.OCSPRequests.Load() != 1 || p.srv.CRLFetches.Load() != 1 {
		t.Fatalf("OCSP %d, CRL %d requests; want the CRL only", p.srv.OCSPRequests.Load(), p.srv.CRLFetches.Load())
	}
	// The CRL down: OCSP answers.
	p.srv.CRLDown.Store(true)
	c2 := checker(t, identity.RevocationConfig{OnUnavailable: identity.RevocationDeny})
	if err := c2.Check(good); err != nil {
		t.Fatal(err)
	}
	if p.srv.OCSPRequests.Load() != 2 {
		t.Fatalf("OCSP asked %d times; want twice", p.srv.OCSPRequests.Load())
	}
}

func TestRevocationStapled(t *testing.T) {
	p := newRevPKI(t)
	_, leaf := p.leaf(t, "srv", revtest.LeafOptions{Server: true, NoCRL: true})
	c := checker(t, identity.RevocationConfig{Mode: identity.RevocationOCSP})
	// A stapled "revoked" answers, though the responder would say good.
	p.srv.Revoke(leaf[0].SerialNumber)
	staple := p.srv.Response(t, leaf[0].SerialNumber, time.Hour)
	p.srv.OCSPDown.Store(true)
	wantRevoked(t, c.CheckStapled(leaf, staple), leaf[0])
	if p.srv.OCSPRequests.Load() != 0 {
		t.Fatal("the responder was asked despite a valid staple")
	}
}

// TestStaplingHandshake: a server Source staples its certificate's OCSP
// status; a client Source takes it instead of asking the responder.
func TestStaplingHandshake(t *testing.T) {
	p := newRevPKI(t)
	srvFiles, _ := p.leaf(t, "srv", revtest.LeafOptions{Server: true, NoCRL: true})
	cliFiles, _ := p.leaf(t, "cli", revtest.LeafOptions{NoCRL: true, NoOCSP: true})
	rc := checker(t, identity.RevocationConfig{Mode: identity.RevocationOCSP, OnUnavailable: identity.RevocationDeny})
	src, err := identity.NewSource(identity.SourceConfig{CertFile: srvFiles.Cert, KeyFile: srvFiles.Key, CAFile: p.chainFile()})
	if err != nil {
		t.Fatal(err)
	}
	src.SetRevocation(rc)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { src.RunStapling(ctx) })
	deadline := time.Now().Add(5 * time.Second)
	for src.Staple() == nil {
		if time.Now().After(deadline) {
			t.Fatal("no staple fetched")
		}
		time.Sleep(10 * time.Millisecond)
	}
	ln := listen(t, src.TrackConnections(mustListen(t)), src.ServerConfig(tls.RequireAndVerifyClientCert, nil))
	cli, err := identity.NewSource(identity.SourceConfig{CertFile: cliFiles.Cert, KeyFile: cliFiles.Key, CAFile: p.chainFile()})
	if err != nil {
		t.Fatal(err)
	}
	cli.SetRevocation(checker(t, identity.RevocationConfig{Mode: identity.RevocationOCSP, OnUnavailable: identity.RevocationDeny}))
	// The responder down: the staple stands in for it (on_unavailable:
	// deny would refuse the server otherwise).
	p.srv.OCSPDown.Store(true)
	conn, err := tls.Dial("tcp", ln, cli.ClientConfig("127.0.0.1"))
	if err != nil {
		t.Fatalf("with the responder down and a good staple: %v", err)
	}
	defer conn.Close()
	if len(conn.ConnectionState().OCSPResponse) == 0 {
		t.Fatal("no stapled response in the handshake")
	}
}

// TestOldStapleDoesNotHideRevocation: a "good" answer kept from before the
// revocation and stapled by a thief of the key does not pass while the
// CRL or the responder says revoked.
func TestOldStapleDoesNotHideRevocation(t *testing.T) {
	p := newRevPKI(t)
	_, leaf := p.leaf(t, "srv", revtest.LeafOptions{Server: true})
	good := p.srv.Response(t, leaf[0].SerialNumber, time.Hour)
	p.srv.Revoke(leaf[0].SerialNumber)
	for _, mode := range []string{identity.RevocationCRL, identity.RevocationOCSP, identity.RevocationBoth} {
		c := checker(t, identity.RevocationConfig{Mode: mode})
		wantRevoked(t, c.CheckStapled(leaf, good), leaf[0])
	}
}

func mustListen(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln
}

// listen serves TLS on ln: each connection gets "ok\n" after its
// handshake, then is kept open until the client closes it.
func listen(t *testing.T, ln net.Listener, cfg *tls.Config) string {
	t.Helper()
	tl := tls.NewListener(ln, cfg)
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := tl.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				if _, err := io.WriteString(c, "ok\n"); err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, c)
			})
		}
	})
	t.Cleanup(func() {
		tl.Close()
		wg.Wait()
	})
	return ln.Addr().String()
}

// TestRevocationClosesOpenConnection: a client certificate revoked while
// its connection is open has the connection closed at the next refresh
// (of the CRL, or of the OCSP answer), and new handshakes refused.
func TestRevocationClosesOpenConnection(t *testing.T) {
	for _, mode := range []string{identity.RevocationCRL, identity.RevocationOCSP} {
		t.Run(mode, func(t *testing.T) { testRevocationClosesOpenConnection(t, mode) })
	}
}

func testRevocationClosesOpenConnection(t *testing.T, mode string) {
	p := newRevPKI(t)
	srvFiles, _ := p.leaf(t, "srv", revtest.LeafOptions{Server: true, NoCRL: true, NoOCSP: true})
	cliFiles, cliChain := p.leaf(t, "operator", revtest.LeafOptions{NoOCSP: mode == identity.RevocationCRL, NoCRL: mode == identity.RevocationOCSP})
	const refresh = 300 * time.Millisecond
	closed := make(chan struct{}, 10)
	rc := checker(t, identity.RevocationConfig{Mode: mode, Refresh: refresh, OnConnectionClosed: func() { closed <- struct{}{} }})
	src, err := identity.NewSource(identity.SourceConfig{CertFile: srvFiles.Cert, KeyFile: srvFiles.Key, CAFile: p.chainFile()})
	if err != nil {
		t.Fatal(err)
	}
	src.SetRevocation(rc)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { rc.Run(ctx) })
	addr := listen(t, src.TrackConnections(mustListen(t)), src.ServerConfig(tls.RequireAndVerifyClientCert, nil))

	cli, err := identity.NewSource(identity.SourceConfig{CertFile: cliFiles.Cert, KeyFile: cliFiles.Key, CAFile: p.chainFile()})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := tls.Dial("tcp", addr, cli.ClientConfig("127.0.0.1"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	buf := make([]byte, 3)
	if _, err := io.ReadFull(conn, buf); err != nil {
		t.Fatalf("the accepted connection: %v", err)
	}

	p.srv.Revoke(cliChain[0].SerialNumber)
	revokedAt := time.Now()
	_ = conn.SetReadDeadline(time.Now().Add(2*refresh + 5*time.Second))
	if _, err := conn.Read(buf); err == nil {
		t.Fatal("the connection of the revoked certificate is still open")
	}
	if took := time.Since(revokedAt); took > 2*refresh+time.Second {
		t.Fatalf("closed %v after the revocation; want within 2×refresh (%v)", took, 2*refresh)
	}
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("OnConnectionClosed not called")
	}
	c2, err := tls.Dial("tcp", addr, cli.ClientConfig("127.0.0.1"))
	if err == nil {
		_ = c2.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = io.ReadFull(c2, buf)
		c2.Close()
	}
	if err == nil {
		t.Fatal("a new handshake of the revoked certificate passed")
	}
	// VerifyChain (node proofs, renewals) refuses it too.
	if err := src.VerifyChain(cliChain, x509.ExtKeyUsageClientAuth); !errors.Is(err, identity.ErrRevoked) {
		t.Fatalf("VerifyChain: %v", err)
	}
}

// TestRevocationClosesDialedConnection: a connection this side dialled and
// gave to TrackDialed is closed once the server's certificate is revoked.
func TestRevocationClosesDialedConnection(t *testing.T) {
	p := newRevPKI(t)
	srvFiles, srvChain := p.leaf(t, "srv", revtest.LeafOptions{Server: true, NoOCSP: true})
	cliFiles, _ := p.leaf(t, "operator", revtest.LeafOptions{NoCRL: true, NoOCSP: true})
	const refresh = 300 * time.Millisecond
	rc := checker(t, identity.RevocationConfig{Mode: identity.RevocationCRL, Refresh: refresh})
	srv, err := identity.NewSource(identity.SourceConfig{CertFile: srvFiles.Cert, KeyFile: srvFiles.Key, CAFile: p.chainFile()})
	if err != nil {
		t.Fatal(err)
	}
	addr := listen(t, mustListen(t), srv.ServerConfig(tls.RequireAndVerifyClientCert, nil))
	cli, err := identity.NewSource(identity.SourceConfig{CertFile: cliFiles.Cert, KeyFile: cliFiles.Key, CAFile: p.chainFile()})
	if err != nil {
		t.Fatal(err)
	}
	cli.SetRevocation(rc)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { rc.Run(ctx) })

	raw, err := tls.Dial("tcp", addr, cli.ClientConfig("127.0.0.1"))
	if err != nil {
		t.Fatal(err)
	}
	conn := cli.TrackDialed(raw, raw.ConnectionState().PeerCertificates[0])
	defer conn.Close()
	buf := make([]byte, 3)
	if _, err := io.ReadFull(conn, buf); err != nil {
		t.Fatalf("the dialled connection: %v", err)
	}
	p.srv.Revoke(srvChain[0].SerialNumber)
	revokedAt := time.Now()
	_ = conn.SetReadDeadline(time.Now().Add(2*refresh + 5*time.Second))
	if _, err := conn.Read(buf); err == nil {
		t.Fatal("the connection to the server of the revoked certificate is still open")
	}
	if took := time.Since(revokedAt); took > 2*refresh+time.Second {
		t.Fatalf("closed %v after the revocation; want within 2×refresh (%v)", took, 2*refresh)
	}
	if _, err := tls.Dial("tcp", addr, cli.ClientConfig("127.0.0.1")); err == nil {
		t.Fatal("a new handshake with the revoked server certificate passed")
	}
}

// TestRevocationTimeoutBoundsHandshakes: with the CRL and OCSP servers
// accepting requests but never answering, a check waits at most the
// timeout, and concurrent checks send one request per URL.
func TestRevocationTimeoutBoundsHandshakes(t *testing.T) {
	p := newRevPKI(t)
	var requests atomic.Int64
	stop := make(chan struct{})
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-r.Context().Done():
		case <-stop:
		}
	}))
	defer hang.Close()
	defer close(stop)
	_, leaf := p.leaf(t, "leaf", revtest.LeafOptions{CRLURL: hang.URL + "/crl", OCSPURL: hang.URL + "/ocsp"})
	const timeout = time.Second
	c := checker(t, identity.RevocationConfig{OnUnavailable: identity.RevocationDeny, Timeout: timeout})
	var wg sync.WaitGroup
	start := time.Now()
	for range 10 {
		wg.Go(func() {
			if err := c.Check(leaf); !errors.Is(err, identity.ErrRevocationUnavailable) {
				t.Errorf("want unavailable, got %v", err)
			}
		})
	}
	wg.Wait()
	// Without one deadline per check, CRL then OCSP would take 2×timeout.
	if took := time.Since(start); took > timeout+600*time.Millisecond {
		t.Fatalf("checks took %v with a %v timeout", took, timeout)
	}
	if n := requests.Load(); n > 2 {
		t.Fatalf("%d requests for 10 concurrent checks; want at most one per URL", n)
	}
}

// TestFirstCRLClosesWhatWasAllowed: a peer let in while no CRL could be
// had (on_unavailable: allow) is handed to the callbacks by the first CRL
// that lists it.
func TestFirstCRLClosesWhatWasAllowed(t *testing.T) {
	p := newRevPKI(t)
	_, leaf := p.leaf(t, "peer", revtest.LeafOptions{NoOCSP: true})
	p.srv.CRLDown.Store(true)
	c := checker(t, identity.RevocationConfig{Mode: identity.RevocationCRL, Refresh: 200 * time.Millisecond})
	got := make(chan []identity.RevokedCert, 10)
	c.OnRevoked(func(r []identity.RevokedCert) { got <- r })
	if err := c.Check(leaf); err != nil {
		t.Fatalf("with the CRL unreachable and on_unavailable allow: %v", err)
	}
	p.srv.Revoke(leaf[0].SerialNumber)
	p.srv.CRLDown.Store(false)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { c.Run(ctx) })
	deadline := time.After(10 * time.Second)
	for {
		select {
		case rs := <-got:
			for _, r := range rs {
				if r.Matches(leaf[0]) {
					return
				}
			}
		case <-deadline:
			t.Fatal("the first CRL listing the peer reached no callback")
		}
	}
}

// TestStaleCRLDoesNotStallHandshakes: once the CA server stops answering
// (it accepts and hangs), a check past refresh uses the CRL it has while
// that is valid, without waiting for the server; Run keeps trying.
func TestStaleCRLDoesNotStallHandshakes(t *testing.T) {
	p := newRevPKI(t)
	var hanging atomic.Bool
	stop := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hanging.Load() {
			select {
			case <-r.Context().Done():
			case <-stop:
			}
			return
		}
		w.Header().Set("Content-Type", "application/pkix-crl")
		_, _ = w.Write(p.srv.CRL(t))
	}))
	defer srv.Close()
	defer close(stop)
	_, leaf := p.leaf(t, "peer", revtest.LeafOptions{CRLURL: srv.URL + "/crl", NoOCSP: true})
	const refresh = 200 * time.Millisecond
	var (
		clockMu sync.Mutex
		now     = time.Now()
	)
	clock := func() time.Time { clockMu.Lock(); defer clockMu.Unlock(); return now }
	c := checker(t, identity.RevocationConfig{Mode: identity.RevocationCRL, OnUnavailable: identity.RevocationDeny, Refresh: refresh,
		Timeout: 3 * time.Second, Now: clock})
	if err := c.Check(leaf); err != nil {
		t.Fatal(err)
	}
	hanging.Store(true)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { c.Run(ctx) })
	for range 5 {
		clockMu.Lock()
		now = now.Add(refresh + 50*time.Millisecond) // the cached CRL is due again
		clockMu.Unlock()
		start := time.Now()
		if err := c.Check(leaf); err != nil {
			t.Fatalf("with a valid cached CRL: %v", err)
		}
		if took := time.Since(start); took > time.Second {
			t.Fatalf("a check waited %s for a CA server that does not answer", took)
		}
	}
}
