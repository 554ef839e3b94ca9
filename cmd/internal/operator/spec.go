package operator

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"pilab.hu/pivirt-agent/cmd/internal/operator/certz/v1alpha1"
	"pilab.hu/pivirt-agent/identity"
)

// Defaults of the spec (the CRD's schema applies them too; these cover
// objects written before a default existed).
const (
	defaultDuration    = 8760 * time.Hour
	defaultRenewBefore = 720 * time.Hour
)

// wanted is a resource's spec, defaulted and parsed.
type wanted struct {
	name       string
	kind       identity.Kind
	usages     []identity.Usage
	dns        []string
	ips        []net.IP
	cluster    string
	duration   time.Duration
	renew      time.Duration
	algorithm  string
	size       int
	rotation   string
	revocation string
}

func wantedOf(mc *v1alpha1.ManagedCertificate) (wanted, error) {
	s := mc.Spec
	w := wanted{
		name: s.CommonName, kind: identity.Kind(s.Type), cluster: s.Cluster,
		duration: defaultDuration, renew: defaultRenewBefore,
		algorithm: s.Key().Algorithm, size: s.Key().Size, rotation: s.Key().RotationPolicy,
		revocation: s.RevocationPolicy,
	}
	if w.kind == "" {
		w.kind = identity.KindServer
	}
	if w.kind != identity.KindServer && w.kind != identity.KindClient {
		return w, fmt.Errorf("spec.type %q: want mtls-server or mtls-client", s.Type)
	}
	if s.Duration != nil {
		w.duration = s.Duration.Duration
	}
	if s.RenewBefore != nil {
		w.renew = s.RenewBefore.Duration
	}
	if w.duration < time.Minute {
		return w, fmt.Errorf("spec.duration %s: at least 1m", w.duration)
	}
	if w.algorithm == "" {
		w.algorithm = v1alpha1.AlgorithmECDSA
	}
	if w.size == 0 {
		switch w.algorithm {
		case v1alpha1.AlgorithmECDSA:
			w.size = 256
		case v1alpha1.AlgorithmRSA:
			w.size = 2048
		}
	}
	if w.rotation == "" {
		w.rotation = v1alpha1.RotationAlways
	}
	if w.revocation == "" {
		w.revocation = v1alpha1.RevokeOnDelete
	}
	for _, u := range s.Usages {
		w.usages = append(w.usages, identity.Usage(u))
	}
	if len(w.usages) == 0 {
		w.usages = []identity.Usage{identity.UsageServer}
		if w.kind == identity.KindClient {
			w.usages = []identity.Usage{identity.UsageClient}
		}
	}
	slices.Sort(w.usages)
	w.usages = slices.Compact(w.usages)
	w.dns = slices.Clone(s.DNSNames)
	slices.Sort(w.dns)
	w.dns = slices.Compact(w.dns)
	for _, a := range s.IPAddresses {
		ip := net.ParseIP(a)
		if ip == nil {
			return w, fmt.Errorf("spec.ipAddresses: %q is not an IP address", a)
		}
		if !slices.ContainsFunc(w.ips, ip.Equal) {
			w.ips = append(w.ips, ip)
		}
	}
	slices.SortFunc(w.ips, func(a, b net.IP) int { return bytes.Compare(a.To16(), b.To16()) })
	// A server certificate without names gets its CN as its DNS name, as
	// the CA does.
	if len(w.dns) == 0 && len(w.ips) == 0 && slices.Contains(w.usages, identity.UsageServer) {
		w.dns = []string{w.name}
	}
	return w, nil
}

// hash is the digest of what the certificate is made of: a change of it
// (or of the issuer) is a new certificate. renewBefore, the revocation
// and rotation policies and the Secret's template are not.
func (w wanted) hash(issuerRef v1alpha1.IssuerRef) string {
	var b strings.Builder
	fmt.Fprintf(&b, "v1\x00%s\x00%s\x00%v\x00%v\x00", w.name, w.kind, w.usages, w.dns)
	for _, ip := range w.ips {
		b.WriteString(ip.String() + ",")
	}
	fmt.Fprintf(&b, "\x00%s\x00%s\x00%s\x00%d\x00%s\x00%x\x00%s", w.cluster, w.duration, w.algorithm, w.size, issuerRef.URL, sha256.Sum256(issuerRef.CABundle), issuerRef.SecretName)
	sum := sha256.Sum256([]byte(b.String()))
	return hex.EncodeToString(sum[:16])
}

// renewalTime is when a certificate is renewed: renewBefore before its
// expiry, or two thirds into its life when renewBefore is not shorter
// than the duration.
func (w wanted) renewalTime(leaf *x509.Certificate) time.Time {
	before := w.renew
	if before >= w.duration {
		before = w.duration / 3
	}
	// Never in the first third of the life: a renewBefore just under the
	// duration would otherwise renew right after each issuance.
	before = min(before, w.duration*2/3)
	return leaf.NotAfter.Add(-before)
}

// newKey makes a key of the wanted algorithm and size.
func (w wanted) newKey() (crypto.Signer, error) {
	switch w.algorithm {
	case v1alpha1.AlgorithmRSA:
		return rsa.GenerateKey(rand.Reader, w.size)
	case v1alpha1.AlgorithmEd25519:
		_, k, err := ed25519.GenerateKey(rand.Reader)
		return k, err
	default:
		curve := elliptic.P256()
		switch w.size {
		case 384:
			curve = elliptic.P384()
		case 521:
			curve = elliptic.P521()
		}
		return ecdsa.GenerateKey(curve, rand.Reader)
	}
}

// fitsKey reports whether key is of the wanted algorithm and size.
func (w wanted) fitsKey(key crypto.PublicKey) bool {
	switch k := key.(type) {
	case *rsa.PublicKey:
		return w.algorithm == v1alpha1.AlgorithmRSA && k.N.BitLen() == w.size
	case ed25519.PublicKey:
		return w.algorithm == v1alpha1.AlgorithmEd25519
	case *ecdsa.PublicKey:
		return w.algorithm == v1alpha1.AlgorithmECDSA && k.Curve.Params().BitSize == w.size
	}
	return false
}

// current is what a Secret holds, checked.
type current struct {
	leaf   *x509.Certificate
	key    crypto.Signer
	serial string
}

// inspect checks the Secret against the spec: nil reason means it holds
// a valid certificate of the spec; otherwise reason and message say why
// a new one is needed. cur is filled as far as the Secret allowed.
//
// trust, when known, is what the certificate must chain to (the issuer's),
// besides the Secret's own ca.crt; uid is the resource's, which must
// control the Secret.
func inspect(s *corev1.Secret, w wanted, specHash string, now time.Time, trust *x509.CertPool, uid types.UID) (cur current, reason, message string) {
	if s == nil {
		return cur, "DoesNotExist", "the Secret does not exist"
	}
	certPEM, keyPEM, caPEM := s.Data[corev1.TLSCertKey], s.Data[corev1.TLSPrivateKeyKey], s.Data[caKey]
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return cur, "InvalidKeyPair", fmt.Sprintf("the Secret's tls.crt and tls.key are not a certificate and its key: %v", err)
	}
	cur.leaf = pair.Leaf
	cur.serial = identity.SerialHex(pair.Leaf.SerialNumber)
	if k, ok := pair.PrivateKey.(crypto.Signer); ok {
		cur.key = k
	}
	if s.Type != corev1.SecretTypeTLS {
		return cur, "InvalidSecret", fmt.Sprintf("the Secret is of type %s, not %s", s.Type, corev1.SecretTypeTLS)
	}
	if err := checkChain(certPEM, caPEM, w.usages, now, trust); err != nil {
		return cur, "InvalidChain", err.Error()
	}
	if ref := metav1.GetControllerOf(s); uid != "" && (ref == nil || ref.UID != uid) {
		return cur, "NotOwned", "the Secret is not controlled by this resource (one of the same name, deleted, made it)"
	}
	if s.Annotations[annotationSpecHash] != specHash {
		return cur, "SpecChanged", "the spec changed since the certificate was issued"
	}
	if err := matches(pair.Leaf, w); err != nil {
		return cur, "SpecMismatch", err.Error()
	}
	if !w.fitsKey(pair.Leaf.PublicKey) {
		return cur, "SpecMismatch", "the key is not of the algorithm and size of spec.privateKey"
	}
	if !now.Before(w.renewalTime(pair.Leaf)) {
		return cur, reasonRenewing, fmt.Sprintf("renewal due at %s (expires %s)", w.renewalTime(pair.Leaf).UTC().Format(time.RFC3339), pair.Leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	return cur, "", ""
}

// checkChain verifies tls.crt (the leaf and intermediates) against ca.crt
// for each usage.
func checkChain(certPEM, caPEM []byte, usages []identity.Usage, now time.Time, trust *x509.CertPool) error {
	chain, err := identity.ParseCertificates(certPEM)
	if err != nil {
		return fmt.Errorf("tls.crt: %v", err)
	}
	cas, err := identity.ParseCertificates(caPEM)
	if err != nil {
		return fmt.Errorf("ca.crt: %v", err)
	}
	roots, inter := x509.NewCertPool(), x509.NewCertPool()
	for _, c := range cas {
		if c.IsCA && bytes.Equal(c.RawIssuer, c.RawSubject) {
			roots.AddCert(c)
		} else {
			inter.AddCert(c)
		}
	}
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	for _, u := range usages {
		eku := x509.ExtKeyUsageServerAuth
		if u == identity.UsageClient {
			eku = x509.ExtKeyUsageClientAuth
		}
		if _, err := chain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{eku}}); err != nil {
			return fmt.Errorf("tls.crt does not verify against ca.crt for %s authentication: %v", u, err)
		}
		if trust != nil {
			if _, err := chain[0].Verify(x509.VerifyOptions{Roots: trust, Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{eku}}); err != nil {
				return fmt.Errorf("tls.crt is not a certificate of the issuer: %v", err)
			}
		}
	}
	return nil
}

// matches checks a certificate's subject, names and usages against the
// spec.
func matches(leaf *x509.Certificate, w wanted) error {
	if leaf.Subject.CommonName != w.name {
		return fmt.Errorf("the certificate's CN is %q, the spec's commonName %q", leaf.Subject.CommonName, w.name)
	}
	dns := slices.Clone(leaf.DNSNames)
	slices.Sort(dns)
	if !slices.Equal(dns, w.dns) {
		return fmt.Errorf("the certificate's DNS names are %v, the spec's %v", dns, w.dns)
	}
	if len(leaf.IPAddresses) != len(w.ips) {
		return fmt.Errorf("the certificate's IP addresses are %v, the spec's %v", leaf.IPAddresses, w.ips)
	}
	for _, ip := range w.ips {
		if !slices.ContainsFunc(leaf.IPAddresses, ip.Equal) {
			return fmt.Errorf("the certificate's IP addresses are %v, the spec's %v", leaf.IPAddresses, w.ips)
		}
	}
	var usages []identity.Usage
	for _, u := range leaf.ExtKeyUsage {
		switch u {
		case x509.ExtKeyUsageServerAuth:
			usages = append(usages, identity.UsageServer)
		case x509.ExtKeyUsageClientAuth:
			usages = append(usages, identity.UsageClient)
		}
	}
	slices.Sort(usages)
	if !slices.Equal(usages, w.usages) {
		return fmt.Errorf("the certificate's usages are %v, the spec's %v", usages, w.usages)
	}
	got := ""
	if c, err := identity.AgentCluster(leaf); err == nil {
		got = c
	}
	if got != w.cluster {
		return fmt.Errorf("the certificate's cluster is %q, the spec's %q", got, w.cluster)
	}
	return nil
}
