package caserver

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/config"
)

// AdminRole is the role (auth.certificate_roles) that may issue for any
// name, revoke, list and create bootstrap tokens.
const AdminRole = "pitrust-admin"

// ServerCertStem names the server's own certificate files in certs_dir
// (<stem>.crt, <stem>.key) when server.tls does not name them.
const ServerCertStem = "pitrust-server"

// Config is the configuration file of pitrust serve.
type Config struct {
	Server    ServerConfig    `yaml:"server"`
	Auth      AuthConfig      `yaml:"auth"`
	Policy    PolicyConfig    `yaml:"policy"`
	RateLimit RateLimitConfig `yaml:"rate_limit"`
	// Now is the CA's clock (tests); nil means time.Now. Not in the file.
	Now func() time.Time `yaml:"-"`
}

// ServerConfig is where the server listens and keeps its files.
type ServerConfig struct {
	// Addr is the one listener, shared by the TLS API and the plain-HTTP
	// OCSP responder and CRL.
	Addr string `yaml:"addr"`
	// CertsDir holds the CA (PiCA.pem, PiCA.key, ca-chain.pem), as
	// pitrust init made it.
	CertsDir string `yaml:"certs_dir"`
	// DBPath is the certificate inventory (bbolt).
	DBPath string `yaml:"db_path"`
	// ExternalURL is how clients reach the plain-HTTP endpoints: the
	// certificates issued point their OCSP and CRL at it. Default:
	// http://<host of addr, or this machine's name for a wildcard
	// address>:<port>.
	ExternalURL string    `yaml:"external_url"`
	TLS         TLSConfig `yaml:"tls"`
}

// TLSConfig names the server's own certificate.
type TLSConfig struct {
	// CertFile and KeyFile default to <certs_dir>/pitrust-server.crt and
	// .key; when both are missing the server issues them from its CA.
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
}

// AuthConfig maps client certificates to roles.
type AuthConfig struct {
	// CertificateRoles gives a client certificate roles by its CN: an
	// exact name or a prefix ending in "*".
	CertificateRoles map[string][]string `yaml:"certificate_roles"`
}

// HasAdmin reports whether auth.certificate_roles gives some certificate
// the AdminRole: without it the server issues nothing but renewals.
func (c *Config) HasAdmin() bool {
	for _, roles := range c.Auth.CertificateRoles {
		if slices.Contains(roles, AdminRole) {
			return true
		}
	}
	return false
}

// PolicyConfig is the issuance policy.
type PolicyConfig struct {
	DefaultDays  int             `yaml:"default_days"`
	MaxDays      int             `yaml:"max_days"`
	CRLValidity  config.Duration `yaml:"crl_validity"`
	OCSPValidity config.Duration `yaml:"ocsp_validity"`
}

// RateLimitConfig limits issuance per caller.
type RateLimitConfig struct {
	// IssuePerMinute is the sustained rate of IssueCertificate and
	// RenewCertificate calls per caller; Burst how many may come at once.
	IssuePerMinute int `yaml:"issue_per_minute"`
	Burst          int `yaml:"burst"`
}

// Default is the configuration a file's keys are put on top of.
func Default() *Config {
	return &Config{
		Server: ServerConfig{
			Addr:     "0.0.0.0:8080",
			CertsDir: "/etc/pitrust/certs",
			DBPath:   "/var/lib/pitrust/certs.db",
		},
		Policy: PolicyConfig{
			DefaultDays:  90,
			MaxDays:      365,
			CRLValidity:  config.Duration(24 * time.Hour),
			OCSPValidity: config.Duration(time.Hour),
		},
		RateLimit: RateLimitConfig{IssuePerMinute: 60, Burst: 20},
	}
}

// LoadConfig reads the configuration file at path (strictly: an unknown
// key is an error naming it) and checks it.
func LoadConfig(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config file: %w", err)
	}
	return ParseConfig(data, path)
}

// ParseConfig is LoadConfig for a file already in memory; name is used in
// error messages.
func ParseConfig(data []byte, name string) (*Config, error) {
	cfg := Default()
	if err := config.Decode(data, name, cfg); err != nil {
		return nil, err
	}
	if err := cfg.validate(name); err != nil {
		return nil, err
	}
	return cfg, nil
}

// Validate checks every value, naming the key of each problem and what to
// do about it.
func (c *Config) Validate() error { return c.validate("") }

// validate is Validate, its errors naming file.
func (c *Config) validate(file string) error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, &config.FieldError{File: file, Path: key, Err: fmt.Errorf("%w: %s", config.ErrInvalid, fmt.Sprintf(format, args...))})
	}
	if _, port, err := net.SplitHostPort(c.Server.Addr); err != nil {
		bad("server.addr", "%q is not host:port (e.g. 0.0.0.0:8080): %v", c.Server.Addr, err)
	} else if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
		bad("server.addr", "port %q is not a number from 0 to 65535", port)
	}
	if c.Server.CertsDir == "" {
		bad("server.certs_dir", "must name the CA directory (pitrust init --dir)")
	}
	if c.Server.DBPath == "" {
		bad("server.db_path", "must name the certificate database file, e.g. /var/lib/pitrust/certs.db")
	}
	if c.Server.ExternalURL != "" {
		u, err := url.Parse(c.Server.ExternalURL)
		if err != nil || u.Scheme != "http" || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
			bad("server.external_url", "%q: want http://host[:port][/path] (OCSP and CRLs are served over plain HTTP)", c.Server.ExternalURL)
		}
	}
	if (c.Server.TLS.CertFile == "") != (c.Server.TLS.KeyFile == "") {
		bad("server.tls", "cert_file and key_file go together: set both or neither")
	}
	for pattern, roles := range c.Auth.CertificateRoles {
		key := "auth.certificate_roles." + pattern
		if pattern == "" || strings.Contains(strings.TrimSuffix(pattern, "*"), "*") {
			bad(key, "a CN, or a CN prefix ending in a single \"*\"")
		}
		if len(roles) == 0 {
			bad(key, "give at least one role (e.g. [%s])", AdminRole)
		}
	}
	if c.Policy.DefaultDays < 1 {
		bad("policy.default_days", "%d: must be at least 1", c.Policy.DefaultDays)
	}
	if c.Policy.MaxDays < 1 {
		bad("policy.max_days", "%d: must be at least 1", c.Policy.MaxDays)
	} else if c.Policy.DefaultDays > c.Policy.MaxDays {
		bad("policy.default_days", "%d is above policy.max_days (%d): lower it or raise max_days", c.Policy.DefaultDays, c.Policy.MaxDays)
	}
	if c.Policy.CRLValidity.Std() < time.Minute {
		bad("policy.crl_validity", "%s: must be at least 1m (e.g. 24h)", c.Policy.CRLValidity)
	}
	if c.Policy.OCSPValidity.Std() < time.Minute {
		bad("policy.ocsp_validity", "%s: must be at least 1m (e.g. 1h)", c.Policy.OCSPValidity)
	}
	if c.RateLimit.IssuePerMinute < 1 {
		bad("rate_limit.issue_per_minute", "%d: must be at least 1", c.RateLimit.IssuePerMinute)
	}
	if c.RateLimit.Burst < 1 {
		bad("rate_limit.burst", "%d: must be at least 1", c.RateLimit.Burst)
	}
	return errors.Join(errs...)
}

// ExternalURLOrDefault is server.external_url, or the default made from
// server.addr.
func (c *Config) ExternalURLOrDefault() string {
	if c.Server.ExternalURL != "" {
		return strings.TrimSuffix(c.Server.ExternalURL, "/")
	}
	host, port, err := net.SplitHostPort(c.Server.Addr)
	if err != nil {
		return ""
	}
	if host == "" || isWildcard(host) {
		if h, err := os.Hostname(); err == nil && h != "" {
			host = h
		} else {
			host = "localhost"
		}
	}
	return "http://" + net.JoinHostPort(host, port)
}

// TLSFiles are the server's certificate and key files.
func (c *Config) TLSFiles() (cert, key string) {
	if c.Server.TLS.CertFile != "" {
		return c.Server.TLS.CertFile, c.Server.TLS.KeyFile
	}
	return filepath.Join(c.Server.CertsDir, ServerCertStem+".crt"), filepath.Join(c.Server.CertsDir, ServerCertStem+".key")
}

func isWildcard(host string) bool {
	ip := net.ParseIP(host)
	return ip != nil && ip.IsUnspecified()
}
