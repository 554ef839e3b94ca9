package agent

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/identity"
)

// AgentIdentityPrefix starts the CN of every agent's client certificate
// (pitrust issue-mtls-client --name pivirt-agent-<node>, as in the spec):
// the internal port and the Raft port accept only such peers.
const AgentIdentityPrefix = identity.AgentPrefix

// tlsWatchInterval is how often certificate files are checked for changes.
const tlsWatchInterval = 5 * time.Second

// agentTLS is the TLS material of an agent with tls.enabled.
type agentTLS struct {
	// api serves 8443: the server certificate, client certificates checked
	// against server.connectrpc.tls.client_ca_file (or the CA files).
	api *identity.Source
	// internal serves 9000 and Raft: the server certificate, agent client
	// certificates checked against tls.ca_file.
	internal *identity.Source
	// client is this agent towards other agents: tls.cert_file and
	// tls.key_file, servers checked against tls.ca_file.
	client *identity.Source

	apiClientAuth tls.ClientAuthType
}

// agentIdentity accepts only agents' client certificates.
func agentIdentity(c *x509.Certificate) error {
	_, err := identity.AgentName(c)
	return err
}

// loadTLS loads the TLS material of cfg: at start, and for
// pivirt-agent validate through Check (logger discarding), so that both
// refuse a file alike.
func loadTLS(cfg *config.Config, logger *slog.Logger) (*agentTLS, error) {
	t, srv := cfg.TLS, cfg.Server.ConnectRPC.TLS
	first := func(v ...string) string {
		for _, s := range v {
			if s != "" {
				return s
			}
		}
		return ""
	}
	// Every problem is reported: the server certificate's and the client
	// certificate's (the internal port's use of the server certificate is
	// checked once the API port's loads).
	var out agentTLS
	var errs []error
	var err error
	if out.api, err = identity.NewSource(identity.SourceConfig{
		CertFile: srv.CertFile, KeyFile: srv.KeyFile, CAFile: first(srv.ClientCAFile, srv.CAFile, t.CAFile), Logger: logger,
		// API callers only: client_ca_file may name a client's own
		// self-signed certificate.
		PinnedClients: srv.ClientCAFile != "",
	}); err != nil {
		errs = append(errs, fmt.Errorf("server.connectrpc.tls: %w", unprefixed{err, "tls: "}))
	} else {
		for _, p := range out.api.Pinned() {
			logger.Warn("server.connectrpc.tls.client_ca_file trusts a self-signed client certificate as itself", "subject", p)
		}
		if out.internal, err = identity.NewSource(identity.SourceConfig{
			CertFile: srv.CertFile, KeyFile: srv.KeyFile, CAFile: t.CAFile, Logger: logger,
		}); err != nil {
			errs = append(errs, fmt.Errorf("server.connectrpc.tls with tls.ca_file: %w", unprefixed{err, "tls: "}))
		}
	}
	if out.client, err = identity.NewSource(identity.SourceConfig{
		CertFile: t.CertFile, KeyFile: t.KeyFile, CAFile: t.CAFile, Logger: logger,
	}); err != nil {
		errs = append(errs, fmt.Errorf("tls: %w", unprefixed{err, "tls: "}))
	} else if err := agentIdentity(out.client.Leaf()); err != nil {
		errs = append(errs, fmt.Errorf("tls.cert_file %s: %w", t.CertFile, err))
	} else if err := checkAgentName(cfg, &out); err != nil {
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	out.apiClientAuth = tls.NoClientCert
	if srv.ClientCAFile != "" {
		out.apiClientAuth = tls.VerifyClientCertIfGiven
	}
	if t.RequireClientCert {
		out.apiClientAuth = tls.RequireAndVerifyClientCert
	}
	return &out, nil
}

// sources lists the TLS sources, for reloads.
func (t *agentTLS) sources() []*identity.Source {
	return []*identity.Source{t.api, t.internal, t.client}
}

// ReloadTLS reads every certificate file again (SIGHUP); new handshakes
// use them. On error the certificates in use stay and the error says why.
func (a *Agent) ReloadTLS() error {
	if a.tls == nil {
		return nil
	}
	var errs []error
	a.backendsMu.RLock()
	sources := append(a.tls.sources(), a.backendSources...)
	a.backendsMu.RUnlock()
	for _, s := range sources {
		if err := s.Reload(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// check describes the certificates for /ready: not ready once one has
// expired; one expiring within identity.ExpiryWarning is named but ready.
func (t *agentTLS) check(now time.Time) (string, bool) {
	var soon []string
	for _, s := range t.sources() {
		leaf := s.Leaf()
		if leaf == nil {
			continue
		}
		if now.After(leaf.NotAfter) {
			return fmt.Sprintf("certificate %s expired on %s", leaf.Subject.CommonName, leaf.NotAfter.UTC().Format(time.RFC3339)), false
		}
		if notAfter, expiring := s.ExpiringSoon(now); expiring {
			soon = append(soon, fmt.Sprintf("%s expires in %d days (%s)", leaf.Subject.CommonName,
				int(notAfter.Sub(now).Hours()/24), notAfter.UTC().Format(time.RFC3339)))
		}
	}
	if len(soon) > 0 {
		return "ok, renew soon: " + strings.Join(soon, "; "), true
	}
	return "ok", true
}

// expiryCollector exports pivirt_tls_cert_expiry_seconds per certificate,
// read at scrape time, so a reloaded certificate shows at once.
type expiryCollector struct {
	t    *agentTLS
	desc *prometheus.Desc
}

func newExpiryCollector(t *agentTLS) *expiryCollector {
	return &expiryCollector{t: t, desc: prometheus.NewDesc("pivirt_tls_cert_expiry_seconds",
		"Seconds until the certificate expires (negative once expired).", []string{"cert", "subject"}, nil)}
}

func (c *expiryCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *expiryCollector) Collect(ch chan<- prometheus.Metric) {
	now := time.Now()
	for name, s := range map[string]*identity.Source{"api": c.t.api, "internal": c.t.internal, "client": c.t.client} {
		if leaf := s.Leaf(); leaf != nil {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, leaf.NotAfter.Sub(now).Seconds(), name, leaf.Subject.CommonName)
		}
	}
}

// watchExpiry logs certificates within identity.ExpiryWarning of expiry
// once a day until ctx ends.
func (a *Agent) watchExpiry(ctx context.Context) {
	t := time.NewTicker(24 * time.Hour)
	defer t.Stop()
	for {
		if detail, _ := a.tls.check(time.Now()); detail != "ok" {
			a.logger.Warn("tls certificates need renewal", "detail", detail)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// DevPKIDir is where --dev makes its throw-away PiTrust PKI, in the data dir.
const DevPKIDir = "dev-pki"

// devCertDays is the lifetime of the dev PKI's certificates: past
// identity.ExpiryWarning, so that a dev node does not warn about the
// certificates it has just made (they are made again at each start).
const devCertDays = 90

// DevCredentials are what pvcli needs to reach a --dev agent through its
// throw-away PKI: the API endpoint and the operator's certificate.
type DevCredentials struct {
	// Endpoint is https://<the API port's address>.
	Endpoint string
	// CAFile, CertFile and KeyFile are the dev PKI's chain and the
	// operator certificate and key, for PVCLI_CA_FILE, PVCLI_CERT_FILE
	// and PVCLI_KEY_FILE.
	CAFile, CertFile, KeyFile string
	// DataDir is the data dir the PKI is in; TempDataDir reports that it
	// is a temporary one, removed on exit.
	DataDir     string
	TempDataDir bool
	// IssuerURL is the development OIDC issuer's URL, and IssuerDir the
	// directory of its key (pitrust dev-token --dir); empty when the
	// --config file names an issuer of its own.
	IssuerURL, IssuerDir string
}

// DevCredentials reports the dev PKI's credentials; false unless the agent
// made one (--dev without certificate files).
func (a *Agent) DevCredentials() (DevCredentials, bool) {
	return a.devCreds, a.devCreds.Endpoint != ""
}

// devPKI makes a throw-away PiTrust PKI for --dev in the data dir (a CA, a
// server certificate for 127.0.0.1 and localhost, this agent's client
// certificate and an operator certificate for pvcli) and points the TLS
// configuration at it, unless certificate files were given.
func (a *Agent) devPKI() error {
	if !a.cfg.Dev || !a.cfg.TLS.Enabled || a.cfg.TLS.CertFile != "" || a.cfg.Server.ConnectRPC.TLS.CertFile != "" {
		return nil
	}
	dir := filepath.Join(a.dataDir, DevPKIDir)
	if _, err := identity.InitCA(dir, identity.CAOptions{RootDays: devCertDays + 2, IntermediateDays: devCertDays + 1, Force: true}); err != nil {
		return fmt.Errorf("dev PKI: %w", err)
	}
	server, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: "dev-server",
		DNS: []string{"localhost"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, Days: devCertDays, Force: true})
	if err != nil {
		return fmt.Errorf("dev PKI: %w", err)
	}
	client, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: AgentIdentityPrefix + a.cfg.NodeName, Cluster: a.cfg.Cluster.Name, Days: devCertDays, Force: true})
	if err != nil {
		return fmt.Errorf("dev PKI: %w", err)
	}
	operator, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: "operator", Days: devCertDays, Force: true})
	if err != nil {
		return fmt.Errorf("dev PKI: %w", err)
	}
	chain := filepath.Join(dir, identity.ChainFile)
	cfg := *a.cfg // the caller's configuration stays as it was given
	cfg.TLS.CAFile, cfg.TLS.CertFile, cfg.TLS.KeyFile = chain, client.Cert, client.Key
	cfg.Server.ConnectRPC.TLS = config.ServerTLSConfig{CertFile: server.Cert, KeyFile: server.Key, CAFile: chain, ClientCAFile: chain}
	a.cfg = &cfg
	a.devCreds = DevCredentials{Endpoint: "https://" + a.lnAPI.Addr().String(), CAFile: chain, CertFile: operator.Cert, KeyFile: operator.Key,
		DataDir: a.dataDir, TempDataDir: a.tempDir}
	// pivirt-agent prints the pvcli settings to stderr (DevCredentials).
	a.logger.Info("dev mode: TLS with a throw-away PKI", "dir", dir, "operator_cert", operator.Cert)
	return nil
}

// checkKeyPermissions refuses key files that others may read or write,
// or group may write (tls.insecure_key_permissions: a warning instead), as
// ssh refuses such private keys: a secret every local account can read is
// none. Group read is allowed when root owns the file (as PostgreSQL
// allows it: root-owned keys readable by the service's group). A file that
// cannot be read is left to the step that reads it.
func checkKeyPermissions(cfg *config.Config, logger *slog.Logger) error {
	var errs []error
	for _, kf := range cfg.KeyFiles() {
		st, err := os.Stat(kf[1])
		if err != nil || !insecureKeyMode(st) {
			continue
		}
		if cfg.TLS.InsecureKeyPermissions {
			logger.Warn("a key file is readable by group or others (tls.insecure_key_permissions is set)", "key", kf[0], "path", kf[1], "mode", fmt.Sprintf("%#o", st.Mode().Perm()))
			continue
		}
		errs = append(errs, fmt.Errorf("%s: %s is readable by group or others (mode %#o): chmod 600 it (or set tls.insecure_key_permissions: true to start anyway)", kf[0], kf[1], st.Mode().Perm()))
	}
	return errors.Join(errs...)
}

// insecureKeyMode reports whether a key file's mode lets others read or
// write it, or its group write it, or its group read it while root does
// not own it.
func insecureKeyMode(st os.FileInfo) bool {
	perm := st.Mode().Perm()
	if perm&0o037 != 0 {
		return true
	}
	if perm&0o040 == 0 {
		return false
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	return !ok || sys.Uid != 0
}
