package identity

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
)

// PiTrust file names in a CA directory (the PiTrust identity model: root,
// X1 intermediate, chain).
const (
	RootCertFile         = "PiRootR1.pem"
	RootKeyFile          = "PiRootR1.key"
	IntermediateCertFile = "PiCA.pem"
	IntermediateKeyFile  = "PiCA.key"
	ChainFile            = "ca-chain.pem"

	// RootCommonName and IntermediateCommonName are the CAs' subjects.
	RootCommonName         = "PiTrust Root CA"
	IntermediateCommonName = "PiTrust X1 Intermediate CA"
	// Organization is the O of every PiTrust certificate.
	Organization = "PiTrust"
)

// Defaults and limits of certificate lifetimes, in days.
const (
	DefaultRootDays         = 3650
	DefaultIntermediateDays = 1825
	DefaultLeafDays         = 365
	MaxDays                 = 36500
)

// Errors of the PKI functions; the wrapping message names the file or the
// field.
var (
	// ErrExists: a file would be overwritten without Force.
	ErrExists = errors.New("already exists (use --force to replace it)")
	// ErrInvalidRequest: a name, SAN or lifetime is not acceptable.
	ErrInvalidRequest = errors.New("invalid certificate request")
	// ErrNoCA: the CA directory holds no usable intermediate CA.
	ErrNoCA = errors.New("no PiTrust CA")
)

// Kind is what a leaf certificate is for.
type Kind string

// Leaf kinds, as the spec's commands name them.
const (
	KindServer Kind = "mtls-server"
	KindClient Kind = "mtls-client"
)

// Usage is an extended key usage a leaf is issued for.
type Usage string

// Leaf usages: TLS server and TLS client authentication.
const (
	UsageServer Usage = "server"
	UsageClient Usage = "client"
)

// usage is a Kind's own usage.
func (k Kind) usage() Usage {
	if k == KindClient {
		return UsageClient
	}
	return UsageServer
}

// PrevSuffix is appended to the names of the files a reissue keeps
// (LeafRequest.KeepPrevious): <name>.crt.prev, <name>.key.prev.
const PrevSuffix = ".prev"

// CAOptions configures InitCA.
type CAOptions struct {
	// RootDays and IntermediateDays are the CAs' lifetimes (defaults
	// DefaultRootDays, DefaultIntermediateDays).
	RootDays, IntermediateDays int
	// Force replaces existing CA files.
	Force bool
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// CAFiles are the paths InitCA wrote.
type CAFiles struct {
	RootCert, RootKey, IntermediateCert, IntermediateKey, Chain string
}

// InitCA creates the PiTrust Root CA and the X1 Intermediate CA in dir
// (created 0700 if missing): PiRootR1.pem/.key, PiCA.pem/.key and
// ca-chain.pem (intermediate, then root). Keys are ECDSA P-256, written
// 0600. Without Force nothing is written if any of the files exists.
func InitCA(dir string, opts CAOptions) (CAFiles, error) {
	now := clock(opts.Now)
	rootDays, caDays := orDefault(opts.RootDays, DefaultRootDays), orDefault(opts.IntermediateDays, DefaultIntermediateDays)
	if err := checkDays("root-days", rootDays); err != nil {
		return CAFiles{}, err
	}
	if err := checkDays("ca-days", caDays); err != nil {
		return CAFiles{}, err
	}
	if caDays > rootDays {
		return CAFiles{}, fmt.Errorf("%w: ca-days %d: the intermediate cannot outlive the root (%d days)", ErrInvalidRequest, caDays, rootDays)
	}
	files := CAFiles{
		RootCert: filepath.Join(dir, RootCertFile), RootKey: filepath.Join(dir, RootKeyFile),
		IntermediateCert: filepath.Join(dir, IntermediateCertFile), IntermediateKey: filepath.Join(dir, IntermediateKeyFile),
		Chain: filepath.Join(dir, ChainFile),
	}
	if !opts.Force {
		if err := noneExist(files.RootCert, files.RootKey, files.IntermediateCert, files.IntermediateKey, files.Chain); err != nil {
			return CAFiles{}, err
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return CAFiles{}, err
	}

	rootKey, err := newKey()
	if err != nil {
		return CAFiles{}, err
	}
	rootTmpl, err := caTemplate(RootCommonName, now, rootDays, 1)
	if err != nil {
		return CAFiles{}, err
	}
	rootDER, err := x509.CreateCertificate(rand.Reader, rootTmpl, rootTmpl, rootKey.Public(), rootKey)
	if err != nil {
		return CAFiles{}, fmt.Errorf("create root CA: %w", err)
	}
	root, err := x509.ParseCertificate(rootDER)
	if err != nil {
		return CAFiles{}, err
	}
	caKey, err := newKey()
	if err != nil {
		return CAFiles{}, err
	}
	caTmpl, err := caTemplate(IntermediateCommonName, now, caDays, 0)
	if err != nil {
		return CAFiles{}, err
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, root, caKey.Public(), rootKey)
	if err != nil {
		return CAFiles{}, fmt.Errorf("create intermediate CA: %w", err)
	}
	writes := []struct {
		path string
		data []byte
		mode fs.FileMode
	}{
		{files.RootKey, keyPEM(rootKey), 0o600},
		{files.IntermediateKey, keyPEM(caKey), 0o600},
		{files.RootCert, certPEM(rootDER), 0o644},
		{files.IntermediateCert, certPEM(caDER), 0o644},
		{files.Chain, append(certPEM(caDER), certPEM(rootDER)...), 0o644},
	}
	for _, w := range writes {
		if err := WriteFileAtomic(w.path, w.data, w.mode); err != nil {
			return CAFiles{}, err
		}
	}
	return files, nil
}

// LeafRequest describes a leaf certificate to issue.
type LeafRequest struct {
	Kind Kind
	// Name is the subject CN and, without File, the file name stem:
	// <Name>.crt, <Name>.key.
	Name string
	// File, when set, is the file name stem instead of Name (pitrust
	// --out): <File>.crt, <File>.key.
	File string
	// Usages are the extended key usages (server, client or both); empty
	// means the Kind's own, which must be among them. A certificate with
	// the server usage needs names (DNS or IPs), whatever its Kind.
	Usages []Usage
	// DNS and IPs are the subject alternative names (a server certificate
	// without any gets Name as its DNS name when Name is a host name). A
	// client certificate may carry DNS names: the service identities
	// network policies match (agent.pivirt.internal).
	DNS []string
	IPs []net.IP
	// Cluster, for an agent's client certificate, is the cluster it
	// belongs to (a URI name, ClusterURI).
	Cluster string
	// Days is the lifetime (default DefaultLeafDays).
	Days int
	// Validity, when set, is the lifetime instead of Days (short-lived
	// certificates, e.g. in tests of renewal).
	Validity time.Duration
	// Force replaces existing files, keeping nothing of them.
	Force bool
	// KeepPrevious replaces existing files after copying them to
	// <File>.crt.prev and <File>.key.prev (the key 0600), which replace
	// older copies. Force wins over it.
	KeepPrevious bool
	// OCSPServer and CRLDistributionPoints, when set, are the
	// certificate's OCSP responder URLs (authority information access)
	// and CRL distribution points.
	OCSPServer            []string
	CRLDistributionPoints []string
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// LeafFiles are the paths Issue wrote.
type LeafFiles struct {
	Cert, Key string
	// PrevCert and PrevKey are the copies of the files replaced
	// (KeepPrevious); empty when there was no such file.
	PrevCert, PrevKey string
}

var (
	// leafNamePattern keeps names usable as file names and CNs.
	leafNamePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)
	// dnsLabel is one label of a DNS name (a leading "*." is allowed for
	// the first).
	dnsLabel = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$`)
)

// Issue issues a leaf certificate signed by the X1 intermediate CA in dir,
// and writes <dir>/<file>.crt (the leaf followed by the intermediate, so
// that a peer holding only the root can build the chain) and <file>.key
// (0600), <file> being File or else Name. Existing files are replaced
// with Force, copied to <file>.crt.prev and <file>.key.prev first with
// KeepPrevious; otherwise nothing is written if either file exists.
func Issue(dir string, req LeafRequest) (LeafFiles, error) {
	days := orDefault(req.Days, DefaultLeafDays)
	if err := checkLeaf(&req, days); err != nil {
		return LeafFiles{}, err
	}
	files := LeafFiles{Cert: filepath.Join(dir, req.File+".crt"), Key: filepath.Join(dir, req.File+".key")}
	if !req.Force && !req.KeepPrevious {
		if err := noneExist(files.Cert, files.Key); err != nil {
			return LeafFiles{}, err
		}
	}
	ca, caKey, err := LoadCA(dir)
	if err != nil {
		return LeafFiles{}, err
	}
	key, err := newKey()
	if err != nil {
		return LeafFiles{}, err
	}
	der, err := SignLeaf(ca, caKey, key.Public(), req)
	if err != nil {
		return LeafFiles{}, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return LeafFiles{}, err
	}
	if req.KeepPrevious && !req.Force {
		// The old key first, as Source.Replace does: a reader between the
		// new key and the new certificate finds the old pair's key in
		// <key>.prev.
		if files.PrevCert, err = keepPrevious(files.Cert, 0o644); err != nil {
			return LeafFiles{}, err
		}
		if files.PrevKey, err = keepPrevious(files.Key, 0o600); err != nil {
			return LeafFiles{}, err
		}
	}
	if err := WriteFileAtomic(files.Key, keyPEM(key), 0o600); err != nil {
		return LeafFiles{}, err
	}
	if err := WriteFileAtomic(files.Cert, append(certPEM(der), certPEM(ca.Raw)...), 0o644); err != nil {
		return LeafFiles{}, err
	}
	return files, nil
}

// SignLeaf checks req as Issue does (kind, names, usages, lifetime, not
// outliving ca) and signs a leaf certificate for pub with ca and caKey,
// returning its DER. Only the certificate is made: File, Force and
// KeepPrevious play no part. The subject is CN=<Name>, O=PiTrust,
// OU=<Kind>; NotBefore is backdated to tolerate clock skew;
// OCSPServer and CRLDistributionPoints are copied into the certificate.
func SignLeaf(ca *x509.Certificate, caKey crypto.Signer, pub crypto.PublicKey, req LeafRequest) ([]byte, error) {
	now := clock(req.Now)
	days := orDefault(req.Days, DefaultLeafDays)
	if err := checkLeaf(&req, days); err != nil {
		return nil, err
	}
	lifetime := time.Duration(days) * 24 * time.Hour
	if req.Validity > 0 {
		lifetime = req.Validity
	}
	notAfter := now.Add(lifetime)
	if notAfter.After(ca.NotAfter) {
		return nil, fmt.Errorf("%w: days %d: the certificate would outlive the intermediate CA (valid until %s)",
			ErrInvalidRequest, days, ca.NotAfter.UTC().Format(time.RFC3339))
	}
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: req.Name, Organization: []string{Organization}, OrganizationalUnit: []string{string(req.Kind)}},
		NotBefore:             now.Add(-backdate(lifetime)), // tolerate clock skew between nodes
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		DNSNames:              req.DNS,
		IPAddresses:           req.IPs,
		URIs:                  clusterURIs(req.Cluster),
		OCSPServer:            slices.Clone(req.OCSPServer),
		CRLDistributionPoints: slices.Clone(req.CRLDistributionPoints),
	}
	for _, u := range req.Usages {
		if u == UsageServer {
			tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		} else {
			tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, pub, caKey)
	if err != nil {
		return nil, fmt.Errorf("issue %s: %w", req.Name, err)
	}
	return der, nil
}

// CheckLeafRequest checks req as SignLeaf does, apart from the CA's
// expiry, and returns it completed: File, the usages in order (the
// Kind's own when none were given), a server certificate's DNS name
// taken from Name when it has no names.
func CheckLeafRequest(req LeafRequest) (LeafRequest, error) {
	if err := checkLeaf(&req, orDefault(req.Days, DefaultLeafDays)); err != nil {
		return LeafRequest{}, err
	}
	return req, nil
}

// keepPrevious copies path, if it exists, to path.prev with mode perm
// and returns the copy's path ("" when there was nothing to keep).
func keepPrevious(path string, perm fs.FileMode) (string, error) {
	b, err := os.ReadFile(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return "", nil
	case err != nil:
		return "", fmt.Errorf("keep the previous %s: %w", path, err)
	}
	prev := path + PrevSuffix
	if err := WriteFileAtomic(prev, b, perm); err != nil {
		return "", fmt.Errorf("keep the previous %s: %w", path, err)
	}
	return prev, nil
}

// checkLeaf validates a leaf request, naming the offending flag, and
// fills in the file name stem and the usages.
func checkLeaf(req *LeafRequest, days int) error {
	if req.Kind != KindServer && req.Kind != KindClient {
		return fmt.Errorf("%w: kind %q", ErrInvalidRequest, req.Kind)
	}
	if !leafNamePattern.MatchString(req.Name) {
		return fmt.Errorf("%w: name %q: 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit", ErrInvalidRequest, req.Name)
	}
	if req.File == "" {
		req.File = req.Name
	} else if !leafNamePattern.MatchString(req.File) {
		return fmt.Errorf("%w: out %q: a file name without directory or extension (1-128 letters, digits, '.', '_' or '-', starting with a letter or digit); the files go to the CA directory", ErrInvalidRequest, req.File)
	}
	for _, ca := range []string{strings.TrimSuffix(RootCertFile, ".pem"), strings.TrimSuffix(IntermediateCertFile, ".pem"), strings.TrimSuffix(ChainFile, ".pem")} {
		if strings.EqualFold(req.File, ca) {
			return fmt.Errorf("%w: file name %q is the CA's own file name", ErrInvalidRequest, req.File)
		}
	}
	if err := checkUsages(req); err != nil {
		return err
	}
	server := slices.Contains(req.Usages, UsageServer)
	if err := checkDays("days", days); err != nil {
		return err
	}
	for _, d := range req.DNS {
		if !validDNSName(d) {
			return fmt.Errorf("%w: dns %q is not a DNS name", ErrInvalidRequest, d)
		}
	}
	for _, ip := range req.IPs {
		if ip == nil {
			return fmt.Errorf("%w: ip: empty address", ErrInvalidRequest)
		}
	}
	if req.Cluster != "" {
		if !clusterNamePattern.MatchString(req.Cluster) {
			return fmt.Errorf("%w: cluster %q: 1-63 letters, digits, '-' or '_', starting with a letter or digit (the agents' cluster.name)", ErrInvalidRequest, req.Cluster)
		}
		if !strings.HasPrefix(req.Name, AgentPrefix) || req.Kind != KindClient {
			return fmt.Errorf("%w: --cluster binds an agent's client certificate (%s<node>) to its cluster; %q is not one", ErrInvalidRequest, AgentPrefix, req.Name)
		}
	}
	if !server && len(req.IPs) > 0 {
		return fmt.Errorf("%w: a client certificate names its holder in its CN (and its service in --dns); --ip is for server certificates", ErrInvalidRequest)
	}
	if server && len(req.DNS) == 0 && len(req.IPs) == 0 {
		if !validDNSName(req.Name) {
			return fmt.Errorf("%w: a server certificate needs --dns or --ip (name %q is not a host name)", ErrInvalidRequest, req.Name)
		}
		req.DNS = []string{req.Name}
	}
	return nil
}

// clusterNamePattern is a cluster.name.
var clusterNamePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$`)

// clusterURIs are the URI names of a certificate of cluster ("": none).
func clusterURIs(cluster string) []*url.URL {
	if cluster == "" {
		return nil
	}
	return []*url.URL{ClusterURI(cluster)}
}

// checkUsages checks req.Usages (the Kind's own when empty), sorted and
// without repeats: server, then client.
func checkUsages(req *LeafRequest) error {
	own := req.Kind.usage()
	if len(req.Usages) == 0 {
		req.Usages = []Usage{own}
		return nil
	}
	var server, client bool
	for _, u := range req.Usages {
		switch u {
		case UsageServer:
			server = true
		case UsageClient:
			client = true
		default:
			return fmt.Errorf("%w: usage %q: want server, client or both (server,client)", ErrInvalidRequest, u)
		}
	}
	if !slices.Contains(req.Usages, own) {
		return fmt.Errorf("%w: usage %s: an %s certificate is always for %s authentication (add %s, or issue an %s certificate)",
			ErrInvalidRequest, joinUsages(req.Usages), req.Kind, own, own, otherKind(req.Kind))
	}
	req.Usages = nil
	if server {
		req.Usages = append(req.Usages, UsageServer)
	}
	if client {
		req.Usages = append(req.Usages, UsageClient)
	}
	return nil
}

func joinUsages(us []Usage) string {
	s := make([]string, len(us))
	for i, u := range us {
		s[i] = string(u)
	}
	return strings.Join(s, ",")
}

func otherKind(k Kind) Kind {
	if k == KindServer {
		return KindClient
	}
	return KindServer
}

func validDNSName(s string) bool {
	if len(s) == 0 || len(s) > 253 {
		return false
	}
	labels := strings.Split(strings.TrimSuffix(s, "."), ".")
	for i, l := range labels {
		if i == 0 && l == "*" && len(labels) > 2 {
			continue
		}
		if !dnsLabel.MatchString(l) {
			return false
		}
	}
	return true
}

// LoadCA reads the X1 intermediate CA's certificate and key from dir.
func LoadCA(dir string) (*x509.Certificate, crypto.Signer, error) {
	certPath, keyPath := filepath.Join(dir, IntermediateCertFile), filepath.Join(dir, IntermediateKeyFile)
	certs, err := ReadCertificates(certPath)
	if err != nil {
		return nil, nil, fmt.Errorf("%w in %s (run pitrust init --dir %s first): %w", ErrNoCA, dir, dir, err)
	}
	ca := certs[0]
	if !ca.IsCA {
		return nil, nil, fmt.Errorf("%w: %s is not a CA certificate", ErrNoCA, certPath)
	}
	key, err := ReadPrivateKey(keyPath)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", ErrNoCA, err)
	}
	if !publicKeysEqual(ca.PublicKey, key.Public()) {
		return nil, nil, fmt.Errorf("%w: %s does not belong to %s", ErrNoCA, keyPath, certPath)
	}
	return ca, key, nil
}

// ReadCertificates reads every certificate of a PEM file, in order.
func ReadCertificates(path string) ([]*x509.Certificate, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	out, err := ParseCertificates(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return out, nil
}

// ParseCertificates parses every PEM certificate of b, in order (other
// PEM blocks are skipped); at least one is required, and b may not end in
// a partial block.
func ParseCertificates(b []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for rest := b; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			if len(bytes.TrimSpace(rest)) > 0 {
				return nil, fmt.Errorf("data after certificate %d that is not a complete PEM block (a truncated or half-written file?)", len(out))
			}
			break
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("certificate %d: %w", len(out)+1, err)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("no PEM certificate in it")
	}
	return out, nil
}

// ReadPrivateKey reads a PEM private key (PKCS#8, EC or PKCS#1).
func ReadPrivateKey(path string) (crypto.Signer, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	key, err := parsePrivateKeyPEM(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return key, nil
}

// parsePrivateKeyPEM parses the first PEM block of b as a private key
// (PKCS#8, EC or PKCS#1).
func parsePrivateKeyPEM(b []byte) (crypto.Signer, error) {
	block, _ := pem.Decode(b)
	if block == nil {
		return nil, errors.New("no PEM block in it")
	}
	var (
		key any
		err error
	)
	switch block.Type {
	case "PRIVATE KEY":
		key, err = x509.ParsePKCS8PrivateKey(block.Bytes)
	case "EC PRIVATE KEY":
		key, err = x509.ParseECPrivateKey(block.Bytes)
	case "RSA PRIVATE KEY":
		key, err = x509.ParsePKCS1PrivateKey(block.Bytes)
	default:
		return nil, fmt.Errorf("PEM block %q is not a private key", block.Type)
	}
	if err != nil {
		return nil, err
	}
	signer, ok := key.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("unsupported key type %T", key)
	}
	return signer, nil
}

// CertInfo explains a certificate (pitrust inspect and verify).
type CertInfo struct {
	Subject     string    `json:"subject"`
	Issuer      string    `json:"issuer"`
	Serial      string    `json:"serial"`
	NotBefore   time.Time `json:"notBefore"`
	NotAfter    time.Time `json:"notAfter"`
	IsCA        bool      `json:"isCa"`
	DNSNames    []string  `json:"dnsNames,omitempty"`
	IPAddresses []string  `json:"ipAddresses,omitempty"`
	URIs        []string  `json:"uris,omitempty"`
	KeyUsage    []string  `json:"keyUsage,omitempty"`
	ExtKeyUsage []string  `json:"extKeyUsage,omitempty"`
	PublicKey   string    `json:"publicKey"`
	SHA256      string    `json:"sha256Fingerprint"`
	// ExpiresInDays is the whole days left to NotAfter (32 bits: a JSON
	// number, as the API's JSON mapping writes an int32).
	ExpiresInDays int32 `json:"expiresInDays"`
}

// Describe explains c at now.
func Describe(c *x509.Certificate, now time.Time) CertInfo {
	info := CertInfo{
		Subject: c.Subject.String(), Issuer: c.Issuer.String(), Serial: SerialHex(c.SerialNumber),
		NotBefore: c.NotBefore.UTC(), NotAfter: c.NotAfter.UTC(), IsCA: c.IsCA,
		DNSNames: c.DNSNames, KeyUsage: keyUsages(c.KeyUsage), ExtKeyUsage: extKeyUsages(c.ExtKeyUsage),
		PublicKey:     publicKeyName(c.PublicKey),
		ExpiresInDays: int32(c.NotAfter.Sub(now).Hours() / 24),
	}
	for _, ip := range c.IPAddresses {
		info.IPAddresses = append(info.IPAddresses, ip.String())
	}
	for _, u := range c.URIs {
		info.URIs = append(info.URIs, u.String())
	}
	sum := sha256.Sum256(c.Raw)
	info.SHA256 = hex.EncodeToString(sum[:])
	return info
}

// VerifyResult is what Verify found.
type VerifyResult struct {
	// Chain is the verified chain, leaf first, explained.
	Chain []CertInfo `json:"chain"`
	// Usage names the extended key usages the chain was verified for,
	// each on its own: "server authentication", "client authentication"
	// or "server and client authentication".
	Usage string `json:"usage"`
}

// Verify checks the first certificate of certPath against the roots in
// caPath (e.g. ca-chain.pem; its non-self-signed certificates and the
// certificates after the leaf in certPath serve as intermediates) at now,
// for each of the leaf's own purposes (server and/or client
// authentication), and, when
// dnsName is set, for that name. The error says why a certificate is not
// trusted: expired, signed by another CA, wrong usage or name.
func Verify(certPath, caPath, dnsName string, now time.Time) (*VerifyResult, error) {
	certs, err := ReadCertificates(certPath)
	if err != nil {
		return nil, err
	}
	cas, err := ReadCertificates(caPath)
	if err != nil {
		return nil, err
	}
	roots, inter := x509.NewCertPool(), x509.NewCertPool()
	for _, c := range cas {
		if bytes.Equal(c.RawIssuer, c.RawSubject) && c.CheckSignatureFrom(c) == nil {
			roots.AddCert(c)
		} else {
			inter.AddCert(c)
		}
	}
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	leaf := certs[0]
	// Each of the leaf's usages on its own: a chain check passes when any
	// one of the usages asked for matches.
	var usages []x509.ExtKeyUsage
	var names []string
	if hasExtUsage(leaf, x509.ExtKeyUsageServerAuth) {
		usages, names = append(usages, x509.ExtKeyUsageServerAuth), append(names, "server")
	}
	if hasExtUsage(leaf, x509.ExtKeyUsageClientAuth) {
		usages, names = append(usages, x509.ExtKeyUsageClientAuth), append(names, "client")
	}
	usageName := strings.Join(names, " and ") + " authentication"
	if len(usages) == 0 {
		usages, usageName = []x509.ExtKeyUsage{x509.ExtKeyUsageAny}, "any"
	}
	var chains [][]*x509.Certificate
	for _, usage := range usages {
		chains, err = leaf.Verify(x509.VerifyOptions{
			Roots: roots, Intermediates: inter, CurrentTime: now, DNSName: dnsName,
			KeyUsages: []x509.ExtKeyUsage{usage},
		})
		if err != nil {
			return nil, explainVerifyError(leaf, err, now)
		}
	}
	res := &VerifyResult{Usage: usageName}
	for _, c := range chains[0] {
		res.Chain = append(res.Chain, Describe(c, now))
	}
	return res, nil
}

// explainVerifyError turns x509's error into a sentence an operator acts on.
func explainVerifyError(leaf *x509.Certificate, err error, now time.Time) error {
	var inv x509.CertificateInvalidError
	var unknown x509.UnknownAuthorityError
	var host x509.HostnameError
	switch {
	case errors.As(err, &inv) && inv.Reason == x509.Expired:
		c := inv.Cert
		if now.Before(c.NotBefore) {
			return fmt.Errorf("%s is not valid yet: valid from %s: %w", c.Subject.CommonName, c.NotBefore.UTC().Format(time.RFC3339), err)
		}
		return fmt.Errorf("%s expired on %s: %w", c.Subject.CommonName, c.NotAfter.UTC().Format(time.RFC3339), err)
	case errors.As(err, &inv) && inv.Reason == x509.IncompatibleUsage:
		return fmt.Errorf("%s is not valid for this use (its extended key usages: %s): %w",
			leaf.Subject.CommonName, strings.Join(extKeyUsages(leaf.ExtKeyUsage), ", "), err)
	case errors.As(err, &unknown):
		return fmt.Errorf("%s (issued by %q) is not signed by the given CA chain: %w", leaf.Subject.CommonName, leaf.Issuer.CommonName, err)
	case errors.As(err, &host):
		return fmt.Errorf("%s is not valid for %q (DNS names %v, IPs %v): %w", leaf.Subject.CommonName, host.Host, leaf.DNSNames, leaf.IPAddresses, err)
	}
	return err
}

func hasExtUsage(c *x509.Certificate, u x509.ExtKeyUsage) bool {
	for _, e := range c.ExtKeyUsage {
		if e == u {
			return true
		}
	}
	return false
}

// --- helpers ---

func clock(now func() time.Time) time.Time {
	if now == nil {
		return time.Now()
	}
	return now()
}

func orDefault(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

func checkDays(flag string, days int) error {
	if days < 1 || days > MaxDays {
		return fmt.Errorf("%w: %s %d: must be between 1 and %d", ErrInvalidRequest, flag, days, MaxDays)
	}
	return nil
}

func noneExist(paths ...string) error {
	for _, p := range paths {
		if _, err := os.Lstat(p); err == nil {
			return fmt.Errorf("%s %w", p, ErrExists)
		} else if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}

func newKey() (*ecdsa.PrivateKey, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

func newSerial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
}

func caTemplate(cn string, now time.Time, days, maxPathLen int) (*x509.Certificate, error) {
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	return &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: cn, Organization: []string{Organization}},
		NotBefore:             now.Add(-5 * time.Minute),
		NotAfter:              now.Add(time.Duration(days) * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLen:            maxPathLen,
		MaxPathLenZero:        maxPathLen == 0,
	}, nil
}

func keyPEM(k *ecdsa.PrivateKey) []byte {
	b, err := KeyPEM(k)
	if err != nil {
		panic(err) // an ECDSA P-256 key always marshals
	}
	return b
}

func certPEM(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func publicKeysEqual(a, b crypto.PublicKey) bool {
	type equaler interface{ Equal(crypto.PublicKey) bool }
	e, ok := a.(equaler)
	return ok && e.Equal(b)
}

func publicKeyName(k crypto.PublicKey) string {
	switch k := k.(type) {
	case *ecdsa.PublicKey:
		return "ECDSA " + k.Curve.Params().Name
	default:
		return fmt.Sprintf("%T", k)
	}
}

func keyUsages(u x509.KeyUsage) []string {
	names := []struct {
		u    x509.KeyUsage
		name string
	}{
		{x509.KeyUsageDigitalSignature, "digital signature"},
		{x509.KeyUsageKeyEncipherment, "key encipherment"},
		{x509.KeyUsageCertSign, "certificate sign"},
		{x509.KeyUsageCRLSign, "CRL sign"},
	}
	var out []string
	for _, n := range names {
		if u&n.u != 0 {
			out = append(out, n.name)
		}
	}
	return out
}

func extKeyUsages(us []x509.ExtKeyUsage) []string {
	var out []string
	for _, u := range us {
		switch u {
		case x509.ExtKeyUsageServerAuth:
			out = append(out, "server authentication")
		case x509.ExtKeyUsageClientAuth:
			out = append(out, "client authentication")
		case x509.ExtKeyUsageAny:
			out = append(out, "any")
		default:
			out = append(out, fmt.Sprintf("usage %d", u))
		}
	}
	return out
}

// ParsePrivateKeyPEM parses the first PEM block of b as a private key
// (PKCS#8, EC or PKCS#1).
func ParsePrivateKeyPEM(b []byte) (crypto.Signer, error) { return parsePrivateKeyPEM(b) }
