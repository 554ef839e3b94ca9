package operator

import (
	"context"
	"crypto"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pilab.hu/pivirt-agent/cmd/internal/caclient"
	"pilab.hu/pivirt-agent/cmd/internal/operator/certz/v1alpha1"
	"pilab.hu/pivirt-agent/identity"
	pitrustv1 "pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1/pitrustv1connect"
)

// request is one certificate to issue, for pub.
type request struct {
	Name     string
	Kind     identity.Kind
	Usages   []identity.Usage
	DNS      []string
	IPs      []net.IP
	Cluster  string
	Lifetime time.Duration
	Key      crypto.Signer
}

// issued is an issuer's answer.
type issued struct {
	// ChainPEM is the certificate followed by the X1 intermediate: tls.crt.
	ChainPEM []byte
	// CAPEM is the intermediate and the root: ca.crt.
	CAPEM []byte
	Leaf  *x509.Certificate
}

// issuer issues and revokes certificates for one issuerRef.
type issuer interface {
	issue(ctx context.Context, req request) (issued, error)
	// revoke revokes serial (hexadecimal) with an RFC 5280 reason name;
	// errNoRevocation when the issuer cannot.
	revoke(ctx context.Context, serial, reason string) error
	// String names the issuer in conditions and events.
	String() string
}

// errNoRevocation: an offline issuer has no CRL or OCSP to revoke in.
var errNoRevocation = errors.New("an offline issuer (issuerRef.secretName) cannot revoke: there is no CA server to publish the revocation")

// issuerError is a failure with the condition reason it is reported
// under.
type issuerError struct {
	reason string
	err    error
}

func (e *issuerError) Error() string { return e.err.Error() }
func (e *issuerError) Unwrap() error { return e.err }

// Condition reasons of failures.
const (
	ReasonIssuerUnavailable = "IssuerUnavailable"
	ReasonIssuerRefused     = "IssuerRefused"
	ReasonIssuerNotReady    = "IssuerNotReady"
	ReasonSecretInUse       = "SecretInUse"
	ReasonInvalidSpec       = "InvalidSpec"
	ReasonPolicyDenied      = "PolicyDenied"
)

func reasonOf(err error) string {
	var ie *issuerError
	if errors.As(err, &ie) {
		return ie.reason
	}
	return ReasonIssuerUnavailable
}

// caServer issues through a PiTrust CA server's Connect API with the
// operator's own credential.
type caServer struct {
	url    string
	client pitrustv1connect.CertificateServiceClient
}

func (c *caServer) String() string { return "the PiTrust CA server " + c.url }

func (c *caServer) issue(ctx context.Context, req request) (issued, error) {
	csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, req.Key)
	if err != nil {
		return issued{}, fmt.Errorf("make the CSR: %w", err)
	}
	m := &pitrustv1.IssueCertificateRequest{
		Csr: csr, Kind: string(req.Kind), Name: req.Name, DnsNames: req.DNS, Cluster: req.Cluster,
		Lifetime: durationpb.New(req.Lifetime),
		// Days too, for a CA server that predates lifetime: it grants
		// whole days, which the reconciler then refuses to hand out.
		Days: int32(min((req.Lifetime+24*time.Hour-1)/(24*time.Hour), 36500)),
	}
	for _, u := range req.Usages {
		m.Usages = append(m.Usages, string(u))
	}
	for _, ip := range req.IPs {
		m.IpAddresses = append(m.IpAddresses, ip.String())
	}
	resp, err := c.client.IssueCertificate(ctx, connect.NewRequest(m))
	if err != nil {
		return issued{}, c.explain(err)
	}
	chain, err := identity.ParseCertificates(resp.Msg.GetCertPem())
	if err != nil {
		return issued{}, &issuerError{ReasonIssuerRefused, fmt.Errorf("%s answered a certificate that does not parse: %w", c, err)}
	}
	return issued{ChainPEM: resp.Msg.GetCertPem(), CAPEM: resp.Msg.GetCaChainPem(), Leaf: chain[0]}, nil
}

func (c *caServer) revoke(ctx context.Context, serial, reason string) error {
	_, err := c.client.RevokeCertificate(ctx, connect.NewRequest(&pitrustv1.RevokeCertificateRequest{Serial: serial, Reason: reason}))
	if err != nil && connect.CodeOf(err) != connect.CodeNotFound {
		return c.explain(err)
	}
	return nil
}

// explain sorts a CA server error into a condition reason.
func (c *caServer) explain(err error) error {
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable, connect.CodeDeadlineExceeded, connect.CodeResourceExhausted, connect.CodeUnknown, connect.CodeCanceled, connect.CodeAborted, connect.CodeInternal:
		return &issuerError{ReasonIssuerUnavailable, caclient.Explain(c.url, err)}
	}
	return &issuerError{ReasonIssuerRefused, caclient.Explain(c.url, err)}
}

// offline signs with the X1 intermediate held in a Secret: PiCA.pem,
// PiCA.key and ca-chain.pem, as pitrust init writes them.
type offline struct {
	secret types.NamespacedName
	ca     *identity.CertAuthority
	chain  []byte
}

func (o *offline) String() string { return "the X1 intermediate of Secret " + o.secret.String() }

func (o *offline) issue(_ context.Context, req request) (issued, error) {
	der, err := identity.SignLeaf(o.ca.Cert, o.ca.Signer(), req.Key.Public(), identity.LeafRequest{
		Kind: req.Kind, Name: req.Name, Usages: req.Usages, DNS: req.DNS, IPs: req.IPs, Cluster: req.Cluster,
		Validity: req.Lifetime, Days: max(1, int(req.Lifetime/(24*time.Hour))),
	})
	if err != nil {
		return issued{}, &issuerError{ReasonInvalidSpec, err}
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return issued{}, err
	}
	chainPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	chainPEM = append(chainPEM, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: o.ca.Cert.Raw})...)
	return issued{ChainPEM: chainPEM, CAPEM: o.chain, Leaf: leaf}, nil
}

func (o *offline) revoke(context.Context, string, string) error { return errNoRevocation }

// issuers makes the issuer of each resource, keeping one client per CA
// server URL and bundle.
type issuers struct {
	reader        client.Reader
	defaultURL    string
	defaultBundle []byte
	creds         *credentials

	mu      sync.Mutex
	clients map[string]*caServer
}

// trust is the pool a certificate of the issuer must chain to: the CA
// server's bundle (PiTrust's chain, which the server's own certificate
// comes from), or the offline issuer's chain; nil when it cannot be known
// now (the Secret's own ca.crt is then all that is checked).
func (is *issuers) trust(ctx context.Context, namespace string, ref v1alpha1.IssuerRef) *x509.CertPool {
	var pemBytes []byte
	switch {
	case ref.SecretName != "":
		iss, err := is.offline(ctx, types.NamespacedName{Namespace: namespace, Name: ref.SecretName})
		if err != nil {
			return nil
		}
		pemBytes = iss.(*offline).chain
	case len(ref.CABundle) > 0:
		pemBytes = ref.CABundle
	default:
		pemBytes = is.defaultBundle
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemBytes) {
		return nil
	}
	return pool
}

func (is *issuers) forRef(ctx context.Context, namespace string, ref v1alpha1.IssuerRef) (issuer, error) {
	if ref.SecretName != "" {
		return is.offline(ctx, types.NamespacedName{Namespace: namespace, Name: ref.SecretName})
	}
	url, bundle := ref.URL, ref.CABundle
	if url == "" {
		url = is.defaultURL
	}
	if url == "" {
		return nil, &issuerError{ReasonIssuerNotReady, errors.New("no issuer: set spec.issuerRef (url or secretName), or start the operator with --ca-server")}
	}
	if len(bundle) == 0 {
		bundle = is.defaultBundle
	}
	if len(bundle) == 0 {
		return nil, &issuerError{ReasonIssuerNotReady, fmt.Errorf("no CA bundle for %s: set spec.issuerRef.caBundle, or start the operator with --ca-bundle", url)}
	}
	if err := is.creds.ready(); err != nil {
		return nil, &issuerError{ReasonIssuerNotReady, err}
	}
	sum := sha256.Sum256(append([]byte(url+"\x00"), bundle...))
	key := hex.EncodeToString(sum[:])
	is.mu.Lock()
	defer is.mu.Unlock()
	if c, ok := is.clients[key]; ok {
		return c, nil
	}
	host, err := caclient.ServerName(url)
	if err != nil {
		return nil, &issuerError{ReasonInvalidSpec, err}
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(bundle) {
		return nil, &issuerError{ReasonInvalidSpec, fmt.Errorf("the CA bundle for %s holds no PEM certificate", url)}
	}
	tlsConfig := &tls.Config{
		MinVersion: tls.VersionTLS12, ServerName: host, RootCAs: pool,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return is.creds.certificate(), nil },
	}
	tr := &http.Transport{
		TLSClientConfig:     tlsConfig,
		ForceAttemptHTTP2:   true,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		TLSHandshakeTimeout: 5 * time.Second,
		IdleConnTimeout:     90 * time.Second,
	}
	c := &caServer{url: url, client: pitrustv1connect.NewCertificateServiceClient(&http.Client{Transport: tr, Timeout: 30 * time.Second}, strings.TrimSuffix(url, "/"))}
	if is.clients == nil {
		is.clients = map[string]*caServer{}
	}
	is.clients[key] = c
	return c, nil
}

// Keys of an offline issuer's Secret: the files of pitrust init.
const (
	offlineCertKey  = identity.IntermediateCertFile
	offlineKeyKey   = identity.IntermediateKeyFile
	offlineChainKey = identity.ChainFile
)

func (is *issuers) offline(ctx context.Context, name types.NamespacedName) (issuer, error) {
	var s corev1.Secret
	if err := is.reader.Get(ctx, name, &s); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, &issuerError{ReasonIssuerNotReady, fmt.Errorf("issuerRef.secretName: Secret %s does not exist (create it from pitrust init's %s, %s and %s)", name, offlineCertKey, offlineKeyKey, offlineChainKey)}
		}
		return nil, err
	}
	for _, k := range []string{offlineCertKey, offlineKeyKey, offlineChainKey} {
		if len(s.Data[k]) == 0 {
			return nil, &issuerError{ReasonIssuerNotReady, fmt.Errorf("issuerRef.secretName: Secret %s has no %s (it needs %s, %s and %s of pitrust init)", name, k, offlineCertKey, offlineKeyKey, offlineChainKey)}
		}
	}
	ca, err := identity.ParseCertAuthority(s.Data[offlineCertKey], s.Data[offlineKeyKey])
	if err != nil {
		return nil, &issuerError{ReasonIssuerNotReady, fmt.Errorf("issuerRef.secretName: Secret %s: %w", name, err)}
	}
	return &offline{secret: name, ca: ca, chain: s.Data[offlineChainKey]}, nil
}

// readBundle reads a PEM CA bundle file ("" → nil).
func readBundle(path string) ([]byte, error) {
	if path == "" {
		return nil, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--ca-bundle: %w", err)
	}
	if _, err := identity.ParseCertificates(b); err != nil {
		return nil, fmt.Errorf("--ca-bundle %s: %w", path, err)
	}
	return b, nil
}
