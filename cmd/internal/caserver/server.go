// Package caserver is the PiTrust CA server (pitrust serve): the Connect
// API of pivirt.pitrust.v1.CertificateService over TLS, and the OCSP
// responder and the CRL over plain HTTP, on one port. The CA itself (the
// inventory, tokens, signing, OCSP and CRLs) is package identity/castore;
// this package is its network face: listeners, authentication,
// authorization, rate limits and the audit of refusals. See DESIGN.md.
package caserver

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/soheilhy/cmux"

	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/identity/castore"
	"pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1/pitrustv1connect"
)

// Timeouts of the listener and the HTTP servers.
const (
	// sniffTimeout bounds how long a new connection may take to send the
	// bytes that tell TLS from plain HTTP.
	sniffTimeout      = 10 * time.Second
	readHeaderTimeout = 10 * time.Second
	// readTimeout bounds the reading of a whole request, body included.
	readTimeout = 30 * time.Second
	// maxRequestBytes bounds an API request's body.
	maxRequestBytes = 256 << 10
	idleTimeout     = 2 * time.Minute
	// shutdownTimeout is how long Serve waits for requests in flight when
	// its context ends.
	shutdownTimeout = 10 * time.Second
	// watchInterval is how often the server's TLS files are checked for
	// changes.
	watchInterval = 5 * time.Second
)

// Server is a running PiTrust CA server: New opens its listener, CA and
// TLS material, Serve serves until its context ends.
type Server struct {
	cfg    *Config
	logger *slog.Logger
	ln     net.Listener
	ca     *castore.CA
	src    *identity.Source
	extURL string
	svc    *service
	// certFile is the server's own certificate file.
	certFile string
	// renewMu serialises renewOwn; renewPasses counts the passes of
	// renewOwnLoop (a test waits for the first before renewing itself).
	renewMu     sync.Mutex
	renewPasses atomic.Int64
}

// New listens on cfg.Server.Addr, opens the CA and its database, and loads
// (or, when both files are missing, issues) the server's own certificate.
// The caller must call Serve or Close.
func New(cfg *Config, logger *slog.Logger) (*Server, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.Server.Addr)
	if err != nil {
		return nil, fmt.Errorf("server.addr: %w", err)
	}
	s := &Server{cfg: cfg, logger: logger, ln: ln}
	s.extURL = externalURL(cfg, ln.Addr())
	ca, err := castore.Open(castore.Config{
		CertsDir:     cfg.Server.CertsDir,
		DBPath:       cfg.Server.DBPath,
		ExternalURL:  s.extURL,
		DefaultDays:  cfg.Policy.DefaultDays,
		MaxDays:      cfg.Policy.MaxDays,
		CRLValidity:  cfg.Policy.CRLValidity.Std(),
		OCSPValidity: cfg.Policy.OCSPValidity.Std(),
		Logger:       logger,
		Now:          cfg.Now,
	})
	if err != nil {
		ln.Close()
		return nil, err
	}
	s.ca = ca
	certFile, keyFile := cfg.TLSFiles()
	s.certFile = certFile
	if err := s.ensureServerCert(certFile, keyFile); err != nil {
		s.Close()
		return nil, err
	}
	src, err := identity.NewSource(identity.SourceConfig{
		CertFile: certFile, KeyFile: keyFile,
		CAFile: filepath.Join(cfg.Server.CertsDir, identity.ChainFile),
		Logger: logger,
	})
	if err != nil {
		s.Close()
		return nil, err
	}
	s.src = src
	s.svc = newService(ca, cfg, logger)
	return s, nil
}

// externalURL is server.external_url, or the default made from the address
// actually listened on (a port 0 becomes the port chosen).
func externalURL(cfg *Config, addr net.Addr) string {
	if cfg.Server.ExternalURL != "" {
		return strings.TrimSuffix(cfg.Server.ExternalURL, "/")
	}
	c := *cfg
	if host, _, err := net.SplitHostPort(cfg.Server.Addr); err == nil {
		if ta, ok := addr.(*net.TCPAddr); ok {
			c.Server.Addr = net.JoinHostPort(host, strconv.Itoa(ta.Port))
		}
	}
	return c.ExternalURLOrDefault()
}

// Addr is the address listened on.
func (s *Server) Addr() net.Addr { return s.ln.Addr() }

// ExternalURL is the URL of the plain-HTTP endpoints put into the
// certificates (<url>/ocsp, <url>/crl).
func (s *Server) ExternalURL() string { return s.extURL }

// Close releases the listener and the CA without serving (Serve closes
// them itself).
func (s *Server) Close() error {
	s.ln.Close()
	if s.ca != nil {
		return s.ca.Close()
	}
	return nil
}

// ensureServerCert issues the server's certificate from the CA when both
// of its files are missing. One present without the other is an error: a
// half-written pair is not silently replaced.
func (s *Server) ensureServerCert(certFile, keyFile string) error {
	_, cerr := os.Stat(certFile)
	_, kerr := os.Stat(keyFile)
	switch {
	case cerr == nil && kerr == nil:
		return nil
	case cerr == nil || kerr == nil:
		return fmt.Errorf("server.tls: only one of %s and %s exists: restore the other, or remove both to have the server issue its certificate again", certFile, keyFile)
	case !errors.Is(cerr, os.ErrNotExist) || !errors.Is(kerr, os.ErrNotExist):
		return fmt.Errorf("server.tls: %w", errors.Join(cerr, kerr))
	}
	u, err := url.Parse(s.extURL)
	if err != nil {
		return fmt.Errorf("server.external_url: %w", err)
	}
	host := u.Hostname()
	g := castore.Grant{Kind: identity.KindServer, Name: host, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}}
	if ip := net.ParseIP(host); ip != nil {
		g.IPs = appendIP(g.IPs, ip)
	} else {
		g.DNS = append(g.DNS, host)
	}
	if host != "localhost" {
		g.DNS = append(g.DNS, "localhost")
	}
	if h, _, err := net.SplitHostPort(s.cfg.Server.Addr); err == nil {
		if ip := net.ParseIP(h); ip != nil && !ip.IsUnspecified() {
			g.IPs = appendIP(g.IPs, ip)
		}
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: host}}, key)
	if err != nil {
		return err
	}
	certPEM, rec, err := s.ca.Issue(csr, g, "pitrust serve (its own certificate)")
	if err != nil {
		return fmt.Errorf("issue the server's certificate: %w", err)
	}
	keyPEM, err := identity.KeyPEM(key)
	if err != nil {
		return err
	}
	for _, f := range []struct {
		path string
		data []byte
		perm os.FileMode
	}{{keyFile, keyPEM, 0o600}, {certFile, certPEM, 0o644}} {
		if err := os.MkdirAll(filepath.Dir(f.path), 0o755); err != nil {
			return err
		}
		if err := identity.WriteFileAtomic(f.path, f.data, f.perm); err != nil {
			return fmt.Errorf("write the server's certificate: %w", err)
		}
	}
	s.logger.Info("issued the server's own certificate", "cert", certFile, "serial", rec.Serial,
		"dns", g.DNS, "ips", fmt.Sprint(g.IPs), "not_after", rec.NotAfter.UTC().Format(time.RFC3339))
	return nil
}

func appendIP(ips []net.IP, ip net.IP) []net.IP {
	for _, have := range ips {
		if have.Equal(ip) {
			return ips
		}
	}
	return append(ips, ip)
}

// Serve serves until ctx ends, then stops accepting, lets the requests in
// flight finish (for up to 10s) and closes the CA.
func (s *Server) Serve(ctx context.Context) error {
	defer s.ca.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	m := cmux.New(s.ln)
	m.SetReadTimeout(sniffTimeout)
	tlsL := m.Match(cmux.TLS())
	plainL := m.Match(cmux.Any())

	// Requests are a CSR or a few names: a body larger than maxRequestBytes
	// is refused before it is read whole, and any body must arrive within
	// readTimeout (the token and renewal paths need no credentials).
	apiPath, apiHandler := pitrustv1connect.NewCertificateServiceHandler(s.svc, connect.WithReadMaxBytes(maxRequestBytes))
	api := withCaller(apiHandler)
	pki := s.ca.Handler()
	// Routed by hand, not by a ServeMux: it would clean, and redirect, the
	// "//" a base64 OCSP request may hold.
	tlsMux := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch p := r.URL.Path; {
		case strings.HasPrefix(p, apiPath):
			api.ServeHTTP(w, r)
		case p == "/healthz":
			healthz(w, r)
		default:
			pki.ServeHTTP(w, r)
		}
	})
	plainMux := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch p := r.URL.Path; {
		case p == "/healthz":
			healthz(w, r)
		case p == "/crl", p == "/ocsp", strings.HasPrefix(p, "/ocsp/"):
			pki.ServeHTTP(w, r)
		default:
			s.needTLS(w, r)
		}
	})

	errLog := slog.NewLogLogger(s.logger.With("component", "http").Handler(), slog.LevelWarn)
	tlsSrv := &http.Server{
		Handler: tlsMux, TLSConfig: s.src.ServerConfig(tls.VerifyClientCertIfGiven, nil),
		ReadHeaderTimeout: readHeaderTimeout, ReadTimeout: readTimeout, IdleTimeout: idleTimeout, ErrorLog: errLog,
		BaseContext: func(net.Listener) context.Context { return ctx },
	}
	plainSrv := &http.Server{
		Handler: plainMux, ReadHeaderTimeout: readHeaderTimeout, ReadTimeout: readTimeout, IdleTimeout: idleTimeout, ErrorLog: errLog,
		BaseContext: func(net.Listener) context.Context { return ctx },
	}

	var wg sync.WaitGroup
	errc := make(chan error, 3)
	run := func(f func() error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(); err != nil && !errors.Is(err, http.ErrServerClosed) && !errors.Is(err, cmux.ErrListenerClosed) &&
				!errors.Is(err, net.ErrClosed) && !errors.Is(err, cmux.ErrServerClosed) {
				errc <- err
			}
		}()
	}
	run(func() error { return tlsSrv.ServeTLS(tlsL, "", "") })
	run(func() error { return plainSrv.Serve(plainL) })
	run(m.Serve)
	wg.Add(3)
	go func() { defer wg.Done(); s.ca.Run(ctx) }()
	go func() { defer wg.Done(); s.src.Watch(ctx, watchInterval) }()
	go func() { defer wg.Done(); s.renewOwnLoop(ctx) }()

	if !s.cfg.HasAdmin() { // before "pitrust serving": tests wait for that line
		s.logger.Warn("no certificate has the " + AdminRole + " role (auth.certificate_roles): nobody may issue, revoke, list or create bootstrap tokens, " +
			"only renewals are served; give your operator certificate the role, e.g. auth: {certificate_roles: {operator: [" + AdminRole + "]}}")
	}
	s.logger.Info("pitrust serving", "addr", s.ln.Addr().String(), "external_url", s.extURL,
		"api", "https://"+s.ln.Addr().String()+apiPath)
	daemon.SdNotify(false, daemon.SdNotifyReady+"\nSTATUS=serving on "+s.ln.Addr().String())

	var err error
	select {
	case <-ctx.Done():
	case err = <-errc:
		s.logger.Error("pitrust server failed", "error", err)
	}
	daemon.SdNotify(false, daemon.SdNotifyStopping)
	s.logger.Info("pitrust stopping")
	cancel()
	sctx, scancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer scancel()
	m.Close()
	tlsSrv.Shutdown(sctx)
	plainSrv.Shutdown(sctx)
	s.ln.Close()
	wg.Wait()
	return err
}

func healthz(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	io.WriteString(w, "ok\n")
}

// needTLS answers every plain-HTTP request other than OCSP, the CRL and
// /healthz: the API is only served over TLS.
func (s *Server) needTLS(w http.ResponseWriter, r *http.Request) {
	host := r.Host
	if host == "" {
		host = s.ln.Addr().String()
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(http.StatusBadRequest)
	fmt.Fprintf(w, "the API needs TLS: use https://%s%s (plain HTTP serves only /ocsp, /crl and /healthz)\n", host, r.URL.Path)
}
