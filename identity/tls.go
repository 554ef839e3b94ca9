package identity

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/crypto/ocsp"
)

// ExpiryWarning is how long before expiry a certificate is reported.
const ExpiryWarning = 30 * 24 * time.Hour

// cipherSuites are the TLS 1.2 suites allowed: ECDHE with AEAD ciphers only
// (TLS 1.3 suites are not configurable and all modern).
var cipherSuites = []uint16{
	tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
	tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
	tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
	tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
	tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
	tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
}

// SourceConfig names the files of a Source.
type SourceConfig struct {
	// CertFile and KeyFile are this side's certificate (leaf first, then
	// any intermediates) and key. Both empty: no certificate (a client
	// that only verifies servers).
	CertFile, KeyFile string
	// CAFile holds the CAs trusted for peers (e.g. ca-chain.pem).
	CAFile string
	// PinnedClients lets CAFile also hold self-signed client
	// certificates (not CAs, with the client-auth usage): each is
	// trusted as itself, as an SSH authorized key is (a test client's
	// own certificate, a tool that makes its own). Any other non-CA
	// certificate is still refused.
	PinnedClients bool
	Logger        *slog.Logger
}

// material is one consistent load of a Source's files.
type material struct {
	cert  *tls.Certificate // nil without CertFile
	leaf  *x509.Certificate
	roots *x509.CertPool
	// inter holds the non-self-signed certificates of CAFile, offered as
	// intermediates when verifying peers.
	inter *x509.CertPool
	// pinned names the self-signed client certificates of CAFile
	// trusted as themselves (SourceConfig.PinnedClients).
	pinned []string
	stamps []fileStamp
}

// pinnableClient: a self-signed certificate for client authentication
// only, which may be trusted as itself.
func pinnableClient(c *x509.Certificate) bool {
	return bytes.Equal(c.RawIssuer, c.RawSubject) && c.CheckSignature(c.SignatureAlgorithm, c.RawTBSCertificate, c.Signature) == nil &&
		slices.Contains(c.ExtKeyUsage, x509.ExtKeyUsageClientAuth) &&
		!slices.Contains(c.ExtKeyUsage, x509.ExtKeyUsageServerAuth) && !slices.Contains(c.ExtKeyUsage, x509.ExtKeyUsageAny)
}

// Pinned names the self-signed client certificates the Source trusts as
// themselves (SourceConfig.PinnedClients).
func (s *Source) Pinned() []string { return s.material().pinned }

type fileStamp struct {
	path  string
	size  int64
	mtime time.Time
}

// Source holds TLS material loaded from files and reloads it for new
// handshakes: on Reload (SIGHUP, POST /reload) and, with Watch, when a file
// changes. A reload that fails (a missing or half-written file, a key that
// does not match its certificate) keeps the material in use and reports
// why. Connections already established are not touched.
type Source struct {
	cfg    SourceConfig
	logger *slog.Logger

	mu  sync.RWMutex
	cur *material
	// loaded is closed, and replaced, when a reload installs new
	// material (Loaded).
	loaded chan struct{}
	// reloadMu serialises loads, so that an older load never replaces a
	// newer one.
	reloadMu sync.Mutex

	// rev checks peers for revocation (SetRevocation); nil: not checked.
	rev atomic.Pointer[RevocationChecker]
	// conns are the accepted connections of TrackConnections listeners
	// whose peer passed the handshake (closed when it is revoked).
	connsMu sync.Mutex
	conns   map[*revocableConn]struct{}
	// staple is the OCSP response stapled to the served certificate
	// (RunStapling).
	staple atomic.Pointer[stapled]
	// stapleResp is the parsed response of staple.
	stapleMu   sync.Mutex
	stapleResp *ocsp.Response
}

// NewSource loads the files of cfg.
func NewSource(cfg SourceConfig) (*Source, error) {
	if cfg.CAFile == "" {
		return nil, errors.New("tls: a CA file is required to verify peers")
	}
	if (cfg.CertFile == "") != (cfg.KeyFile == "") {
		return nil, errors.New("tls: cert_file and key_file go together")
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	s := &Source{cfg: cfg, logger: logger.With("component", "tls"), loaded: make(chan struct{})}
	m, err := s.load()
	if err != nil {
		return nil, err
	}
	s.cur = m
	return s, nil
}

// load reads and checks every file.
func (s *Source) load() (*material, error) {
	m := &material{roots: x509.NewCertPool(), inter: x509.NewCertPool()}
	for _, f := range []struct{ what, path string }{{"cert file", s.cfg.CertFile}, {"key file", s.cfg.KeyFile}, {"ca file", s.cfg.CAFile}} {
		p := f.path
		if p == "" {
			continue
		}
		st, err := os.Stat(p)
		if err != nil {
			return nil, fmt.Errorf("tls: %s: %w", f.what, err)
		}
		m.stamps = append(m.stamps, fileStamp{path: p, size: st.Size(), mtime: st.ModTime()})
	}
	cas, err := ReadCertificates(s.cfg.CAFile)
	if err != nil {
		return nil, fmt.Errorf("tls: ca file: %w", err)
	}
	roots := 0
	for _, c := range cas {
		if !c.IsCA && s.cfg.PinnedClients && pinnableClient(c) {
			m.roots.AddCert(c)
			roots++
			m.pinned = append(m.pinned, c.Subject.String())
			continue
		}
		if !c.IsCA {
			hint := ""
			if s.cfg.PinnedClients {
				hint = " (a client certificate trusted as itself must be self-signed and have the client-auth usage)"
			}
			return nil, fmt.Errorf("tls: ca file %s: %q is not a CA certificate%s", s.cfg.CAFile, c.Subject.CommonName, hint)
		}
		if c.CheckSignatureFrom(c) == nil {
			m.roots.AddCert(c)
			roots++
		} else {
			m.inter.AddCert(c)
		}
	}
	if roots == 0 {
		return nil, fmt.Errorf("tls: ca file %s holds no self-signed root CA (use ca-chain.pem, which ends with the root)", s.cfg.CAFile)
	}
	if s.cfg.CertFile == "" {
		return m, nil
	}
	pair, err := tls.LoadX509KeyPair(s.cfg.CertFile, s.cfg.KeyFile)
	if err != nil {
		// A renewal interrupted between its two writes leaves the new
		// key with the old certificate, whose key Replace kept.
		prev, perr := tls.LoadX509KeyPair(s.cfg.CertFile, s.cfg.KeyFile+".prev")
		if perr != nil {
			return nil, fmt.Errorf("tls: %s and %s: %w", s.cfg.CertFile, s.cfg.KeyFile, err)
		}
		s.logger.Warn("tls: the key file does not match the certificate, but the key of an interrupted renewal does; using it",
			"cert", s.cfg.CertFile, "key", s.cfg.KeyFile+".prev")
		pair = prev
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return nil, fmt.Errorf("tls: %s: %w", s.cfg.CertFile, err)
	}
	pair.Leaf = leaf
	m.cert, m.leaf = &pair, leaf
	return m, nil
}

func (s *Source) material() *material {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.cur
}

// Reload reads the files again; new handshakes use what it read. On error
// the material in use stays.
func (s *Source) Reload() error {
	s.reloadMu.Lock()
	defer s.reloadMu.Unlock()
	m, err := s.load()
	if err != nil {
		s.logger.Error("tls reload failed; keeping the certificates in use", "error", err)
		return err
	}
	s.mu.Lock()
	s.cur = m
	close(s.loaded)
	s.loaded = make(chan struct{})
	s.mu.Unlock()
	if m.leaf != nil {
		s.logger.Info("tls certificates loaded", "cert", s.cfg.CertFile, "subject", m.leaf.Subject.String(),
			"not_after", m.leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	return nil
}

// Loaded returns a channel that is closed when a reload installs new
// material (the files changed, or were read again): whoever plans by the
// certificate in use, such as a renewal, looks at it again.
func (s *Source) Loaded() <-chan struct{} {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.loaded
}

// changed reports whether a file differs from the loaded material's.
func (s *Source) changed() bool {
	for _, f := range s.material().stamps {
		st, err := os.Stat(f.path)
		if err != nil || st.Size() != f.size || !st.ModTime().Equal(f.mtime) {
			return true
		}
	}
	return false
}

// Watch reloads when a file changes (checked every interval) until ctx
// ends. A failed reload is retried at the next change.
func (s *Source) Watch(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	var failedAt []fileStamp
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !s.changed() {
			continue
		}
		now := s.stamps()
		if failedAt != nil && sameStamps(now, failedAt) {
			continue // the same broken files: logged already
		}
		if err := s.Reload(); err != nil {
			failedAt = now
			continue
		}
		failedAt = nil
	}
}

// stamps reads the files' current stamps.
func (s *Source) stamps() []fileStamp {
	var out []fileStamp
	for _, f := range s.material().stamps {
		st, err := os.Stat(f.path)
		if err != nil {
			out = append(out, fileStamp{path: f.path})
			continue
		}
		out = append(out, fileStamp{path: f.path, size: st.Size(), mtime: st.ModTime()})
	}
	return out
}

func sameStamps(a, b []fileStamp) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].path != b[i].path || a[i].size != b[i].size || !a[i].mtime.Equal(b[i].mtime) {
			return false
		}
	}
	return true
}

// Leaf is this side's certificate, nil without one.
func (s *Source) Leaf() *x509.Certificate { return s.material().leaf }

// PeerCheck is an extra check of a verified peer's leaf certificate (for
// example: it must hold an agent identity).
type PeerCheck func(leaf *x509.Certificate) error

// ServerConfig returns a server tls.Config that takes the current
// certificate and CAs at every handshake. clientAuth is
// tls.NoClientCert, tls.VerifyClientCertIfGiven or
// tls.RequireAndVerifyClientCert; check, when set, runs on a verified
// client certificate.
func (s *Source) ServerConfig(clientAuth tls.ClientAuthType, check PeerCheck) *tls.Config {
	base := &tls.Config{MinVersion: tls.VersionTLS12, CipherSuites: cipherSuites}
	base.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
		m := s.material()
		if m.cert == nil {
			return nil, errors.New("tls: no server certificate configured")
		}
		cert := *m.cert
		if st := s.staple.Load(); st != nil && bytes.Equal(st.leaf, m.leaf.Raw) {
			cert.OCSPStaple = st.der
		}
		remote := ""
		if hello.Conn != nil {
			remote = hello.Conn.RemoteAddr().String()
		}
		c := &tls.Config{
			MinVersion:   tls.VersionTLS12,
			CipherSuites: cipherSuites,
			Certificates: []tls.Certificate{cert},
			ClientAuth:   clientAuth,
			ClientCAs:    m.roots,
			NextProtos:   []string{"h2", "http/1.1"},
		}
		if clientAuth != tls.NoClientCert {
			// The standard check, with CAFile's intermediates too, and a
			// message that says which certificate was refused and why.
			c.ClientAuth = requestOrRequire(clientAuth)
			// VerifyConnection, not VerifyPeerCertificate: it also runs on
			// resumed sessions, so a session ticket never outlives a CA
			// change or a peer check.
			verify := s.verifyPeer(x509.ExtKeyUsageClientAuth, "", check, clientAuth == tls.RequireAndVerifyClientCert)
			tracked := findRevocable(hello.Conn)
			c.VerifyConnection = func(cs tls.ConnectionState) error {
				chain, err := verify(cs.PeerCertificates, nil, remote)
				if err == nil && tracked != nil && len(chain) > 0 {
					s.trackConn(tracked, chain[0])
				}
				return err
			}
		}
		return c, nil
	}
	return base
}

func requestOrRequire(a tls.ClientAuthType) tls.ClientAuthType {
	if a == tls.RequireAndVerifyClientCert {
		return tls.RequireAnyClientCert
	}
	return tls.RequestClientCert
}

// ClientConfig returns a client tls.Config that verifies the server against
// the current CAs and serverName — the name or IP the server must hold, as
// a rule the host being dialled — and presents the current certificate when
// the server asks for one. With serverName empty the name the TLS client
// sends (SNI) is used, and a connection without one (an IP address) is
// refused: a server is never accepted without a name check.
func (s *Source) ClientConfig(serverName string) *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS12,
		CipherSuites: cipherSuites,
		ServerName:   serverName,
		// Verification is done below, with the CAs of the moment: the
		// standard check would pin the CAs of the config's creation.
		InsecureSkipVerify: true,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			if m := s.material(); m.cert != nil {
				return m.cert, nil
			}
			return &tls.Certificate{}, nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			name := cs.ServerName
			if serverName != "" {
				name = serverName
			}
			if name == "" {
				return errors.New("tls: no server name or address to verify the server's certificate against")
			}
			_, err := s.verifyPeer(x509.ExtKeyUsageServerAuth, name, nil, true)(cs.PeerCertificates, cs.OCSPResponse, name)
			return err
		},
	}
}

// verifyPeer returns the peer check of a handshake: the peer's chain
// (certs, leaf first) must verify against the current CAs for usage (and
// name), must not be revoked (a valid stapled OCSP response answers for
// it), then check. It returns the verified chain.
func (s *Source) verifyPeer(usage x509.ExtKeyUsage, name string, check PeerCheck, required bool) func(certs []*x509.Certificate, staple []byte, remote string) ([]*x509.Certificate, error) {
	return func(certs []*x509.Certificate, staple []byte, remote string) ([]*x509.Certificate, error) {
		if len(certs) == 0 {
			if required {
				return nil, errors.New("tls: the peer presented no certificate")
			}
			return nil, nil
		}
		role := "server"
		if usage == x509.ExtKeyUsageClientAuth {
			role = "client"
		}
		chain, err := s.verifyChain(certs, usage, name)
		if err != nil {
			err = fmt.Errorf("tls: %s certificate %q refused: %w", role, certs[0].Subject.String(), err)
			s.logger.Warn("tls peer refused", "error", err)
			return nil, err
		}
		if err := s.checkRevocation(chain, staple, remote); err != nil {
			return nil, fmt.Errorf("tls: %s certificate %q refused: %w", role, certs[0].Subject.String(), err)
		}
		if check != nil {
			if err := check(certs[0]); err != nil {
				err = fmt.Errorf("tls: %s certificate %q refused: %w", role, certs[0].Subject.String(), err)
				s.logger.Warn("tls peer refused", "error", err)
				return nil, err
			}
		}
		return chain, nil
	}
}

// checkRevocation runs the revocation checker, if any, on a verified
// chain, logging a refusal.
func (s *Source) checkRevocation(chain []*x509.Certificate, staple []byte, remote string) error {
	rc := s.rev.Load()
	if rc == nil {
		return nil
	}
	err := rc.CheckStapled(chain, staple)
	switch {
	case errors.Is(err, ErrRevoked):
		s.logger.Warn("tls: refused revoked certificate", "serial", SerialHex(chain[0].SerialNumber),
			"subject", chain[0].Subject.String(), "remote", remote, "error", err)
	case err != nil:
		s.logger.Warn("tls: refused a certificate whose revocation status is unavailable (tls.revocation.on_unavailable: deny)",
			"serial", SerialHex(chain[0].SerialNumber), "subject", chain[0].Subject.String(), "remote", remote, "error", err)
	}
	return err
}

// verifyChain verifies chain (leaf first) against the current CAs for
// usage (and name, when not empty), explaining a failure. It returns the
// verified chain (leaf, issuer, …, root).
func (s *Source) verifyChain(chain []*x509.Certificate, usage x509.ExtKeyUsage, name string) ([]*x509.Certificate, error) {
	m := s.material()
	inter := m.inter.Clone()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	now := time.Now()
	chains, err := chain[0].Verify(x509.VerifyOptions{Roots: m.roots, Intermediates: inter, DNSName: name, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{usage}})
	if err != nil {
		return nil, explainVerifyError(chain[0], err, now)
	}
	return chains[0], nil
}

// VerifyChain is a ChainVerifier: chain (leaf first) must verify against
// the Source's current CAs for usage (x509.ExtKeyUsageAny for a CA), and
// the leaf must not be revoked (SetRevocation).
func (s *Source) VerifyChain(chain []*x509.Certificate, usage x509.ExtKeyUsage) error {
	if len(chain) == 0 {
		return errors.New("no certificate")
	}
	verified, err := s.verifyChain(chain, usage, "")
	if err != nil {
		return err
	}
	return s.checkRevocation(verified, nil, "")
}

// Replace writes a new certificate and key to the Source's files and
// loads them, as Reload does, if the files and the material in use still
// hold the certificate current (DER of the leaf): a renewal never
// overwrites what an operator put in place meanwhile. The old key is kept
// in <key_file>.prev until the new pair is in place, so that a crash
// between the two writes (new key, old certificate) still loads (see
// load). A pair that does not load leaves the files as they were. It
// serialises with Reload.
func (s *Source) Replace(certPEM, keyPEM, current []byte) error {
	if s.cfg.CertFile == "" {
		return errors.New("tls: this source has no certificate files")
	}
	if _, err := tls.X509KeyPair(certPEM, keyPEM); err != nil {
		return fmt.Errorf("tls: new certificate for %s: %w", s.cfg.CertFile, err)
	}
	s.reloadMu.Lock()
	defer s.reloadMu.Unlock()
	if m := s.material(); m.leaf == nil || !bytes.Equal(m.leaf.Raw, current) {
		return fmt.Errorf("tls: %s: the certificate in use changed since the renewal began; not replacing it", s.cfg.CertFile)
	}
	oldCert, errC := os.ReadFile(s.cfg.CertFile)
	oldKey, errK := os.ReadFile(s.cfg.KeyFile)
	if err := errors.Join(errC, errK); err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	onDisk, err := ParseCertificates(oldCert)
	if err != nil || !bytes.Equal(onDisk[0].Raw, current) {
		return fmt.Errorf("tls: %s holds another certificate than the one in use (replaced by hand?); not replacing it", s.cfg.CertFile)
	}
	prev := s.cfg.KeyFile + ".prev"
	restore := func(cause error) error {
		err := errors.Join(WriteFileAtomic(s.cfg.KeyFile, oldKey, 0o600), WriteFileAtomic(s.cfg.CertFile, oldCert, 0o644))
		if err != nil {
			return fmt.Errorf("tls: %w; restoring the previous files failed too: %w", cause, err)
		}
		_ = os.Remove(prev)
		return fmt.Errorf("tls: %w", cause)
	}
	if err := WriteFileAtomic(prev, oldKey, 0o600); err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	if err := WriteFileAtomic(s.cfg.KeyFile, keyPEM, 0o600); err != nil {
		return restore(err)
	}
	if err := WriteFileAtomic(s.cfg.CertFile, certPEM, 0o644); err != nil {
		return restore(err)
	}
	m, err := s.load()
	if err != nil {
		return restore(err)
	}
	_ = os.Remove(prev)
	s.mu.Lock()
	s.cur = m
	s.mu.Unlock()
	s.logger.Info("tls certificate replaced", "cert", s.cfg.CertFile, "subject", m.leaf.Subject.String(),
		"not_after", m.leaf.NotAfter.UTC().Format(time.RFC3339))
	return nil
}

// Certificate is this side's certificate and key, nil without one.
func (s *Source) Certificate() *tls.Certificate { return s.material().cert }

// ExpiringSoon reports whether this side's certificate expires within
// ExpiryWarning of now, and when.
func (s *Source) ExpiringSoon(now time.Time) (time.Time, bool) {
	leaf := s.Leaf()
	if leaf == nil {
		return time.Time{}, false
	}
	return leaf.NotAfter, leaf.NotAfter.Sub(now) < ExpiryWarning
}
