package identity

import (
	"bytes"
	"context"
	"crypto/x509"
	"net"
	"sync"
	"time"

	"golang.org/x/crypto/ocsp"
)

// SetRevocation makes the Source check every peer (server and client side,
// and VerifyChain) with c, close the connections of TrackConnections
// listeners whose peer a refreshed CRL lists, and lets RunStapling staple
// its certificate's OCSP status. Call it once, before serving.
func (s *Source) SetRevocation(c *RevocationChecker) {
	s.rev.Store(c)
	if c != nil {
		c.OnRevoked(s.closeRevoked)
	}
}

// Revocation is the checker of SetRevocation, nil without one.
func (s *Source) Revocation() *RevocationChecker { return s.rev.Load() }

// TrackConnections wraps ln so that the connections it accepts are
// remembered with their peer's certificate once the handshake (of a
// ServerConfig of this Source) passed, and closed when a refreshed CRL
// lists that certificate. Wrap the listener tls.NewListener (or
// tls.Server) is given; other wrappers may sit in between if their
// connections have a NetConn method returning the wrapped one.
func (s *Source) TrackConnections(ln net.Listener) net.Listener {
	return &revocableListener{Listener: ln, s: s}
}

type revocableListener struct {
	net.Listener
	s *Source
}

func (l *revocableListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &revocableConn{Conn: c, s: l.s}, nil
}

// TrackDialed remembers a connection this side dialled, whose server
// authenticated with leaf, and closes it when a refreshed CRL lists leaf,
// as TrackConnections does for accepted connections. Use the connection it
// returns in c's place: its Close forgets it.
func (s *Source) TrackDialed(c net.Conn, leaf *x509.Certificate) net.Conn {
	if leaf == nil {
		return c
	}
	rc := &revocableConn{Conn: c, s: s}
	s.trackConn(rc, leaf)
	return rc
}

// revocableConn is a connection of a TrackConnections listener, or one
// given to TrackDialed.
type revocableConn struct {
	net.Conn
	s    *Source
	mu   sync.Mutex
	peer *x509.Certificate
	// closed: Close ran; trackConn then leaves it out of the map.
	closed bool
	once   sync.Once
}

// NetConn returns the wrapped connection.
func (c *revocableConn) NetConn() net.Conn { return c.Conn }

func (c *revocableConn) Close() error {
	c.once.Do(func() {
		c.mu.Lock()
		c.closed = true
		c.mu.Unlock()
		c.s.connsMu.Lock()
		delete(c.s.conns, c)
		c.s.connsMu.Unlock()
	})
	return c.Conn.Close()
}

// findRevocable finds the revocableConn under c (through NetConn).
func findRevocable(c net.Conn) *revocableConn {
	for i := 0; c != nil && i < 8; i++ {
		if rc, ok := c.(*revocableConn); ok {
			return rc
		}
		u, ok := c.(interface{ NetConn() net.Conn })
		if !ok {
			return nil
		}
		c = u.NetConn()
	}
	return nil
}

// trackConn remembers c's verified peer.
// A connection closed meanwhile (its handshake raced its Close) is left
// out, so that the map never keeps a closed connection.
func (s *Source) trackConn(c *revocableConn, leaf *x509.Certificate) {
	c.mu.Lock() // before connsMu: closeRevoked never holds both
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	c.peer = leaf
	s.connsMu.Lock()
	defer s.connsMu.Unlock()
	if s.conns == nil {
		s.conns = map[*revocableConn]struct{}{}
	}
	s.conns[c] = struct{}{}
}

// closeRevoked closes the tracked connections whose peer is revoked.
func (s *Source) closeRevoked(revoked []RevokedCert) {
	type victim struct {
		c    *revocableConn
		peer *x509.Certificate
	}
	s.connsMu.Lock()
	conns := make([]*revocableConn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.connsMu.Unlock()
	var victims []victim
	for _, c := range conns {
		c.mu.Lock()
		peer := c.peer
		c.mu.Unlock()
		for _, r := range revoked {
			if peer != nil && r.Matches(peer) {
				victims = append(victims, victim{c, peer})
				break
			}
		}
	}
	var onClosed func()
	if rc := s.rev.Load(); rc != nil {
		cfg, _, _ := rc.config()
		onClosed = cfg.OnConnectionClosed
	}
	for _, v := range victims {
		s.logger.Warn("tls: closing a connection of a revoked certificate", "serial", SerialHex(v.peer.SerialNumber),
			"subject", v.peer.Subject.String(), "remote", v.c.RemoteAddr().String())
		_ = v.c.Close()
		if onClosed != nil {
			onClosed()
		}
	}
}

// stapled is the OCSP response stapled to a certificate.
type stapled struct {
	leaf []byte // the DER of the certificate it is for
	der  []byte
}

// stapleRetry is how soon a failed staple fetch is tried again, and how
// often RunStapling looks for a changed certificate.
const stapleRetry = 5 * time.Second

// RunStapling keeps an OCSP response for the Source's own certificate
// stapled to the handshakes of its ServerConfig, until ctx ends: when the
// revocation mode is not off and the certificate names an OCSP responder,
// a response is fetched (the issuer is the next certificate of the
// certificate file), verified, and fetched again at half its validity and
// after a reload. A failure is logged; handshakes go on without a staple.
func (s *Source) RunStapling(ctx context.Context) {
	var failedFor []byte
	for {
		wait := stapleRetry
		m := s.material()
		rc := s.rev.Load()
		cur := s.staple.Load()
		switch {
		case m.cert == nil || m.leaf == nil || rc == nil || rc.Mode() == RevocationOff ||
			len(httpURLs(m.leaf.OCSPServer)) == 0 || len(m.cert.Certificate) < 2:
			s.staple.Store(nil)
		case cur != nil && bytes.Equal(cur.leaf, m.leaf.Raw) && !s.stapleDue():
			wait = min(stapleRetry, s.stapleWait())
		default:
			resp, err := s.fetchStaple(rc, m)
			if err != nil {
				if !bytes.Equal(failedFor, m.leaf.Raw) || cur == nil {
					s.logger.Warn("tls: fetching the OCSP staple failed; serving without one", "subject", m.leaf.Subject.String(), "error", err)
				}
				failedFor = m.leaf.Raw
				s.stapleMu.Lock()
				expired := s.stapleResp != nil && !s.stapleResp.NextUpdate.IsZero() && time.Now().After(s.stapleResp.NextUpdate)
				s.stapleMu.Unlock()
				if cur != nil && (expired || !bytes.Equal(cur.leaf, m.leaf.Raw)) {
					s.staple.Store(nil) // never staple a stale answer
				}
				break
			}
			failedFor = nil
			s.staple.Store(&stapled{leaf: m.leaf.Raw, der: resp.Raw})
			s.stapleMu.Lock()
			s.stapleResp = resp
			s.stapleMu.Unlock()
			wait = min(stapleRetry, s.stapleWait())
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-s.Loaded():
		case <-t.C:
		}
		t.Stop()
	}
}

func (s *Source) fetchStaple(rc *RevocationChecker, m *material) (*ocsp.Response, error) {
	issuer, err := x509.ParseCertificate(m.cert.Certificate[1])
	if err != nil {
		return nil, err
	}
	var last error
	for _, u := range httpURLs(m.leaf.OCSPServer) {
		resp, err := rc.FetchOCSP(m.leaf, issuer, u)
		if err == nil {
			return resp, nil
		}
		last = err
	}
	return nil, last
}

// stapleRefreshAt is when the stapled response is fetched again: half way
// through its validity (without NextUpdate: after the checker's Refresh).
func (s *Source) stapleRefreshAt() time.Time {
	s.stapleMu.Lock()
	resp := s.stapleResp
	s.stapleMu.Unlock()
	if resp == nil {
		return time.Time{}
	}
	if resp.NextUpdate.IsZero() {
		refresh := DefaultRevocationRefresh
		if rc := s.rev.Load(); rc != nil {
			cfg, _, _ := rc.config()
			refresh = cfg.Refresh
		}
		return resp.ThisUpdate.Add(refresh)
	}
	return resp.ThisUpdate.Add(resp.NextUpdate.Sub(resp.ThisUpdate) / 2)
}

func (s *Source) stapleDue() bool { return !time.Now().Before(s.stapleRefreshAt()) }

func (s *Source) stapleWait() time.Duration { return max(time.Until(s.stapleRefreshAt()), 0) }

// Staple is the OCSP response stapled to the Source's certificate now,
// nil without one.
func (s *Source) Staple() []byte {
	if st := s.staple.Load(); st != nil {
		return st.der
	}
	return nil
}
