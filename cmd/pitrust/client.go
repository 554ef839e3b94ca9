package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cmd/internal/caserver"
	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/identity/castore"
	pitrustv1 "pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1/pitrustv1connect"
)

// Environment variables that give the client flags their defaults.
const (
	envServer = "PITRUST_SERVER"
	envCA     = "PITRUST_CA_FILE"
	envCert   = "PITRUST_CERT_FILE"
	envKey    = "PITRUST_KEY_FILE"
)

// clientFlags reach a running pitrust serve.
type clientFlags struct {
	dir                   *string
	server, ca, cert, key string
}

func (f *clientFlags) add(c *cobra.Command) {
	c.Flags().StringVar(&f.server, "server", "", "URL of a running pitrust serve, e.g. https://pitrust.pivirt.internal:8080 (env "+envServer+")")
	c.Flags().StringVar(&f.ca, "ca", "", "PEM file of the CAs the server's certificate must chain to (env "+envCA+"; default <dir>/ca-chain.pem)")
	c.Flags().StringVar(&f.cert, "cert", "", "client certificate with the pitrust-admin role (env "+envCert+")")
	c.Flags().StringVar(&f.key, "key", "", "key of --cert (env "+envKey+")")
}

// resolve fills the flags not given from the environment.
func (f *clientFlags) resolve() {
	for _, p := range []struct {
		v   *string
		env string
	}{{&f.server, envServer}, {&f.ca, envCA}, {&f.cert, envCert}, {&f.key, envKey}} {
		if *p.v == "" {
			*p.v = os.Getenv(p.env)
		}
	}
}

// client connects to --server, verifying its certificate against --ca and
// presenting --cert when given. requireCA refuses a missing CA file
// instead of defaulting (a first certificate: the server is not trusted
// on first use).
func (f *clientFlags) client(requireCA bool) (pitrustv1connect.CertificateServiceClient, error) {
	if f.server == "" {
		return nil, &usageError{fmt.Errorf("--server is required (or %s): the URL of pitrust serve", envServer)}
	}
	u, err := url.Parse(f.server)
	if err != nil || u.Host == "" {
		return nil, &usageError{fmt.Errorf("--server %q: want https://host:port", f.server)}
	}
	if u.Scheme != "https" {
		return nil, &usageError{fmt.Errorf("--server %q: the API needs TLS: use https://%s", f.server, u.Host)}
	}
	if (f.cert == "") != (f.key == "") {
		return nil, &usageError{errors.New("--cert and --key go together")}
	}
	ca := f.ca
	if ca == "" {
		ca = filepath.Join(*f.dir, identity.ChainFile)
		if _, err := os.Stat(ca); err != nil {
			if requireCA {
				return nil, &usageError{fmt.Errorf("--ca is required: %s does not exist, and pitrust never trusts a server on first use; copy ca-chain.pem from the CA host and pass --ca FILE", ca)}
			}
			return nil, &usageError{fmt.Errorf("--ca: %s: %w (pass the CA chain of the server with --ca FILE)", ca, err)}
		}
	}
	src, err := identity.NewSource(identity.SourceConfig{CertFile: f.cert, KeyFile: f.key, CAFile: ca})
	if err != nil {
		return nil, err
	}
	tr := &http.Transport{
		TLSClientConfig:     src.ClientConfig(u.Hostname()),
		ForceAttemptHTTP2:   true,
		TLSHandshakeTimeout: 10 * time.Second,
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second}).DialContext,
	}
	hc := &http.Client{Transport: tr, Timeout: time.Minute}
	return pitrustv1connect.NewCertificateServiceClient(hc, strings.TrimSuffix(u.String(), "/")), nil
}

// apiError explains an error of the API.
func apiError(server string, err error) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		switch ce.Code() {
		case connect.CodePermissionDenied:
			return fmt.Errorf("%s refused: %s", server, ce.Message())
		case connect.CodeUnauthenticated:
			return fmt.Errorf("%s: not authenticated: %s", server, ce.Message())
		}
		return fmt.Errorf("%s: %s: %s", server, ce.Code(), ce.Message())
	}
	return err
}

func tokenCmd(dir *string, stdout io.Writer) *cobra.Command {
	c := &cobra.Command{
		Use:   "token",
		Short: "Bootstrap tokens: one-time secrets that let a new host get one certificate",
		Args:  cobra.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	var (
		cf     = clientFlags{dir: dir}
		req    pitrustv1.CreateBootstrapTokenRequest
		ttl    time.Duration
		days   int
		output string
	)
	create := &cobra.Command{
		Use:   "create --name NAME --server URL",
		Short: "Create a bootstrap token for one certificate of NAME (through pitrust serve, as an operator)",
		Long: `Create a bootstrap token for one certificate of NAME, with the SANs given
(--dns, --ip). The holder gets it with pitrust request --token; the token is
used up then, or when --ttl has passed. The secret is shown once: the server
keeps only its hash. Needs a client certificate with the pitrust-admin role
(--cert, --key).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if req.Name == "" {
				return &usageError{errors.New("--name is required")}
			}
			if err := checkOutput(output); err != nil {
				return err
			}
			if days < 0 {
				return &usageError{fmt.Errorf("--days %d: must be at least 1 (0: the server's default)", days)}
			}
			req.Ttl = durationpb.New(ttl)
			req.Days = int32(days)
			cf.resolve()
			cl, err := cf.client(false)
			if err != nil {
				return err
			}
			resp, err := cl.CreateBootstrapToken(cmd.Context(), connect.NewRequest(&req))
			if err != nil {
				return apiError(cf.server, err)
			}
			m := resp.Msg
			if output == "json" {
				return writeJSON(stdout, map[string]any{"token": m.GetToken(), "id": m.GetId(), "expiresAt": m.GetExpiresAt().AsTime()})
			}
			fmt.Fprintf(stdout, "%s\n", m.GetToken())
			fmt.Fprintf(cmd.ErrOrStderr(), "token %s for %s, usable once until %s\n", m.GetId(), req.Name, m.GetExpiresAt().AsTime().Format(time.RFC3339))
			return nil
		},
	}
	cf.add(create)
	create.Flags().StringVar(&req.Name, "name", "", "the certificate's CN the token grants")
	create.Flags().StringArrayVar(&req.DnsNames, "dns", nil, "DNS name the token grants (repeatable)")
	create.Flags().StringArrayVar(&req.IpAddresses, "ip", nil, "IP address the token grants (repeatable)")
	create.Flags().StringVar(&req.Kind, "kind", "", "mtls-server or mtls-client (default: mtls-server with --dns or --ip, else mtls-client)")
	create.Flags().StringSliceVar(&req.Usages, "usage", nil, "usages the token grants: server, client or both (default: the kind's)")
	create.Flags().DurationVar(&ttl, "ttl", time.Hour, "how long the token can be used (at most 168h)")
	create.Flags().IntVar(&days, "days", 0, "lifetime of the certificate in days (default: the server's policy.default_days)")
	create.Flags().StringVar(&req.Cluster, "cluster", "", "for an agent's certificate (--name pivirt-agent-<node>): the cluster it belongs to (its cluster.name); agents of other clusters on the same CA are then refused")
	create.Flags().StringVarP(&output, "output", "o", "text", "output format: text (the token alone on stdout) or json")
	c.AddCommand(create)
	return c
}

func requestCmd(dir *string, stdout io.Writer) *cobra.Command {
	var (
		cf    = clientFlags{dir: dir}
		req   pitrustv1.IssueCertificateRequest
		days  int
		out   string
		force bool
	)
	c := &cobra.Command{
		Use:   "request --server URL (--token TOKEN | --cert FILE --key FILE) --name NAME",
		Short: "Get a certificate from pitrust serve for a new key made here",
		Long: `Make an ECDSA P-256 key and a CSR here, and have pitrust serve sign it: with a
bootstrap token (--token, from pitrust token create: the names come from the
token, and --name, --dns, --ip may only narrow them) or as an operator
(--cert, --key with the pitrust-admin role). Writes <dir>/<out>.crt (the
certificate and the X1 intermediate, 0644), <out>.key (0600) and, when absent,
<dir>/ca-chain.pem. The key never leaves this host.

The server is verified against --ca (default <dir>/ca-chain.pem): it is
never trusted on first use, so a new host needs the CA chain copied to it.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			token := req.BootstrapToken
			if token == "" {
				token = os.Getenv("PITRUST_TOKEN")
				req.BootstrapToken = token
			}
			cf.resolve()
			if token == "" && req.Name == "" {
				return &usageError{errors.New("--name is required without --token")}
			}
			if token == "" && cf.cert == "" {
				return &usageError{errors.New("give --token (a bootstrap token) or --cert and --key (an operator certificate)")}
			}
			if days < 0 {
				return &usageError{fmt.Errorf("--days %d: must be at least 1 (0: the default)", days)}
			}
			stem := out
			if stem == "" {
				stem = req.Name
			}
			if stem == "" {
				return &usageError{errors.New("--out is required when --name is not given: the file name stem")}
			}
			if stem != filepath.Base(stem) || strings.HasPrefix(stem, ".") {
				return &usageError{fmt.Errorf("--out %q: a file name without directory", stem)}
			}
			certFile, keyFile := filepath.Join(*dir, stem+".crt"), filepath.Join(*dir, stem+".key")
			if !force {
				for _, p := range []string{certFile, keyFile} {
					if _, err := os.Stat(p); err == nil {
						return fmt.Errorf("%s: %w", p, identity.ErrExists)
					}
				}
			}
			cl, err := cf.client(token != "")
			if err != nil {
				return err
			}
			key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			if err != nil {
				return err
			}
			cn := req.Name
			if cn == "" {
				cn = stem
			}
			csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: cn}}, key)
			if err != nil {
				return err
			}
			req.Csr = csr
			req.Days = int32(days)
			resp, err := cl.IssueCertificate(cmd.Context(), connect.NewRequest(&req))
			if err != nil {
				return apiError(cf.server, err)
			}
			certs, err := identity.ParseCertificates(resp.Msg.GetCertPem())
			if err != nil || len(certs) == 0 {
				return fmt.Errorf("%s answered a certificate that does not parse: %v", cf.server, err)
			}
			if !identityKeyMatches(certs[0], key) {
				return fmt.Errorf("%s answered a certificate for another key", cf.server)
			}
			keyPEM, err := identity.KeyPEM(key)
			if err != nil {
				return err
			}
			if err := os.MkdirAll(*dir, 0o755); err != nil {
				return err
			}
			if err := identity.WriteFileAtomic(keyFile, keyPEM, 0o600); err != nil {
				return err
			}
			if err := identity.WriteFileAtomic(certFile, resp.Msg.GetCertPem(), 0o644); err != nil {
				return err
			}
			chain := filepath.Join(*dir, identity.ChainFile)
			wroteChain := false
			if _, err := os.Stat(chain); errors.Is(err, os.ErrNotExist) && len(resp.Msg.GetCaChainPem()) > 0 {
				if err := identity.WriteFileAtomic(chain, resp.Msg.GetCaChainPem(), 0o644); err != nil {
					return err
				}
				wroteChain = true
			}
			info := identity.Describe(certs[0], time.Now())
			fmt.Fprintf(stdout, "Issued %s (serial %s), valid until %s\n  %s\n  %s (key)\n", info.Subject, info.Serial,
				info.NotAfter.Format(time.RFC3339), certFile, keyFile)
			if sans := append(append([]string(nil), info.DNSNames...), info.IPAddresses...); len(sans) > 0 {
				fmt.Fprintf(stdout, "  names: %s\n", strings.Join(sans, ", "))
			}
			if cluster, _ := identity.AgentCluster(certs[0]); cluster != "" {
				fmt.Fprintf(stdout, "  cluster: %s\n", cluster)
			}
			if wroteChain {
				fmt.Fprintf(stdout, "  %s\n", chain)
			}
			return nil
		},
	}
	cf.add(c)
	c.Flags().StringVar(&req.BootstrapToken, "token", "", "bootstrap token (env PITRUST_TOKEN)")
	c.Flags().StringVar(&req.Name, "name", "", "the certificate's CN (with --token: default the token's)")
	c.Flags().StringArrayVar(&req.DnsNames, "dns", nil, "DNS name (repeatable; with --token: default the token's)")
	c.Flags().StringArrayVar(&req.IpAddresses, "ip", nil, "IP address (repeatable; with --token: default the token's)")
	c.Flags().StringVar(&req.Kind, "kind", "", "mtls-server or mtls-client (default: the token's, else mtls-client)")
	c.Flags().StringSliceVar(&req.Usages, "usage", nil, "server, client or both (default: the kind's)")
	c.Flags().IntVar(&days, "days", 0, "lifetime in days (default: the token's or the server's policy)")
	c.Flags().StringVar(&req.Cluster, "cluster", "", "for an agent's certificate: the cluster it belongs to (with --token: the token's)")
	c.Flags().StringVar(&out, "out", "", "file name stem in --dir: <out>.crt and <out>.key (default: --name)")
	c.Flags().BoolVar(&force, "force", false, "replace existing files of that name")
	return c
}

// identityKeyMatches reports whether cert is for key's public key.
func identityKeyMatches(cert *x509.Certificate, key *ecdsa.PrivateKey) bool {
	pub, ok := cert.PublicKey.(*ecdsa.PublicKey)
	return ok && pub.Equal(&key.PublicKey)
}

// inventoryFlags choose between the database (offline) and a server.
type inventoryFlags struct {
	clientFlags
	db string
}

func (f *inventoryFlags) add(c *cobra.Command) {
	f.clientFlags.add(c)
	c.Flags().StringVar(&f.db, "db", "", "the certificate database of the CA (offline: pitrust serve must not be running on it)")
}

// check says which of --db and --server is used.
func (f *inventoryFlags) check() error {
	f.resolve()
	if (f.db == "") == (f.server == "") {
		return &usageError{errors.New("give exactly one of --db PATH (the database, offline) and --server URL (a running pitrust serve)")}
	}
	return nil
}

func openDB(path string) (*castore.DB, error) {
	db, err := castore.OpenDB(path)
	if errors.Is(err, castore.ErrLocked) {
		return nil, fmt.Errorf("%s is in use by a running pitrust serve: use --server URL instead of --db: %w", path, err)
	}
	return db, err
}

func revokeCmd(dir *string, stdout io.Writer) *cobra.Command {
	var (
		f            = inventoryFlags{clientFlags: clientFlags{dir: dir}}
		name, reason string
		output       string
	)
	c := &cobra.Command{
		Use:   "revoke (SERIAL | --name NAME) (--db PATH | --server URL)",
		Short: "Revoke a certificate by serial, or every valid certificate of a name",
		Long: `Revoke a certificate by its serial (hexadecimal, as openssl prints it; colons
allowed), or every valid certificate whose CN is --name. Offline with --db (the
server rebuilds its CRL from the database when it starts) or through a running
pitrust serve with --server (its CRL is regenerated at once).`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := f.check(); err != nil {
				return err
			}
			if err := checkOutput(output); err != nil {
				return err
			}
			serial := ""
			if len(args) == 1 {
				serial = args[0]
			}
			if (serial == "") == (name == "") {
				return &usageError{errors.New("give a SERIAL or --name NAME, not both")}
			}
			if reason != "" {
				if _, err := castore.ParseRevocationReason(reason); err != nil {
					return &usageError{fmt.Errorf("--reason: %w", err)}
				}
			}
			var certs []*pitrustv1.Certificate
			if f.db != "" {
				db, err := openDB(f.db)
				if err != nil {
					return err
				}
				defer db.Close()
				recs, err := db.Revoke(serial, name, reason, time.Now())
				if err != nil {
					return err
				}
				for _, r := range recs {
					certs = append(certs, caserver.CertificateOf(r))
				}
			} else {
				cl, err := f.client(false)
				if err != nil {
					return err
				}
				resp, err := cl.RevokeCertificate(cmd.Context(), connect.NewRequest(&pitrustv1.RevokeCertificateRequest{Serial: serial, Name: name, Reason: reason}))
				if err != nil {
					return apiError(f.server, err)
				}
				certs = resp.Msg.GetRevoked()
			}
			if output == "json" {
				return writeJSON(stdout, certsJSON(certs))
			}
			if len(certs) == 0 {
				fmt.Fprintln(stdout, "Nothing to revoke: no valid certificate matches.")
				return nil
			}
			for _, c := range certs {
				fmt.Fprintf(stdout, "Revoked %s (%s), reason %s\n", c.GetSerial(), c.GetSubject(), orUnspecified(c.GetRevocationReason()))
			}
			return nil
		},
	}
	f.add(c)
	c.Flags().StringVar(&name, "name", "", "revoke every valid certificate whose CN is NAME")
	c.Flags().StringVar(&reason, "reason", "", "RFC 5280 reason: unspecified, keyCompromise, caCompromise, affiliationChanged, superseded, cessationOfOperation, certificateHold, privilegeWithdrawn")
	c.Flags().StringVarP(&output, "output", "o", "text", "output format: text|json")
	return c
}

func orUnspecified(s string) string {
	if s == "" {
		return "unspecified"
	}
	return s
}

func listCmd(dir *string, stdout io.Writer) *cobra.Command {
	var (
		f                    = inventoryFlags{clientFlags: clientFlags{dir: dir}}
		status, name, output string
	)
	c := &cobra.Command{
		Use:   "list (--db PATH | --server URL)",
		Short: "List the certificates the CA issued, newest first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := f.check(); err != nil {
				return err
			}
			if err := checkOutput(output); err != nil {
				return err
			}
			switch status {
			case "", "valid", "revoked", "expired":
			default:
				return &usageError{fmt.Errorf("--status %q: want valid, revoked or expired", status)}
			}
			var certs []*pitrustv1.Certificate
			if f.db != "" {
				db, err := openDB(f.db)
				if err != nil {
					return err
				}
				defer db.Close()
				recs, err := db.List(status, name, time.Now())
				if err != nil {
					return err
				}
				for _, r := range recs {
					certs = append(certs, caserver.CertificateOf(r))
				}
			} else {
				cl, err := f.client(false)
				if err != nil {
					return err
				}
				resp, err := cl.ListCertificates(cmd.Context(), connect.NewRequest(&pitrustv1.ListCertificatesRequest{Status: status, Name: name}))
				if err != nil {
					return apiError(f.server, err)
				}
				certs = resp.Msg.GetCertificates()
			}
			if output == "json" {
				return writeJSON(stdout, certsJSON(certs))
			}
			tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "SERIAL\tNAME\tKIND\tSTATUS\tNOT AFTER\tISSUED BY")
			for _, c := range certs {
				st := c.GetStatus()
				if st == "revoked" {
					st += " (" + orUnspecified(c.GetRevocationReason()) + ")"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", c.GetSerial(), c.GetName(), c.GetKind(), st,
					c.GetNotAfter().AsTime().Format(time.RFC3339), c.GetIssuedBy())
			}
			return tw.Flush()
		},
	}
	f.add(c)
	c.Flags().StringVar(&status, "status", "", "only certificates that are valid, revoked or expired")
	c.Flags().StringVar(&name, "name", "", "only certificates whose CN is NAME")
	c.Flags().StringVarP(&output, "output", "o", "text", "output format: text|json")
	return c
}

// certJSON is a certificate in -o json.
type certJSON struct {
	Serial           string     `json:"serial"`
	Subject          string     `json:"subject"`
	Name             string     `json:"name"`
	Kind             string     `json:"kind"`
	Usages           []string   `json:"usages,omitempty"`
	DNSNames         []string   `json:"dnsNames,omitempty"`
	IPAddresses      []string   `json:"ipAddresses,omitempty"`
	NotBefore        time.Time  `json:"notBefore"`
	NotAfter         time.Time  `json:"notAfter"`
	Status           string     `json:"status"`
	RevokedAt        *time.Time `json:"revokedAt,omitempty"`
	RevocationReason string     `json:"revocationReason,omitempty"`
	IssuedBy         string     `json:"issuedBy"`
}

func certsJSON(certs []*pitrustv1.Certificate) []certJSON {
	out := []certJSON{}
	for _, c := range certs {
		j := certJSON{
			Serial: c.GetSerial(), Subject: c.GetSubject(), Name: c.GetName(), Kind: c.GetKind(), Usages: c.GetUsages(),
			DNSNames: c.GetDnsNames(), IPAddresses: c.GetIpAddresses(), NotBefore: c.GetNotBefore().AsTime().UTC(),
			NotAfter: c.GetNotAfter().AsTime().UTC(), Status: c.GetStatus(), RevocationReason: c.GetRevocationReason(), IssuedBy: c.GetIssuedBy(),
		}
		if c.GetRevokedAt() != nil {
			t := c.GetRevokedAt().AsTime().UTC()
			j.RevokedAt = &t
		}
		out = append(out, j)
	}
	return out
}
