package operator

import (
	"context"
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"pilab.hu/pivirt-agent/cmd/internal/operator/certz/v1alpha1"
	"pilab.hu/pivirt-agent/identity"
)

// testCA is an offline issuer made by pitrust init's code.
func testCA(t *testing.T) *offline {
	t.Helper()
	dir := t.TempDir()
	if _, err := identity.InitCA(dir, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	read := func(f string) []byte {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	ca, err := identity.ParseCertAuthority(read(identity.IntermediateCertFile), read(identity.IntermediateKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	return &offline{ca: ca, chain: read(identity.ChainFile)}
}

func testMC(mutate func(*v1alpha1.ManagedCertificateSpec)) *v1alpha1.ManagedCertificate {
	m := &v1alpha1.ManagedCertificate{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c"}, Spec: v1alpha1.ManagedCertificateSpec{
		CommonName: "svc.pivirt.internal", SecretName: "svc-tls", DNSNames: []string{"svc.pivirt.internal", "localhost"}, IPAddresses: []string{"127.0.0.1"},
		Duration: &metav1.Duration{Duration: 10 * time.Hour}, RenewBefore: &metav1.Duration{Duration: time.Hour},
	}}
	if mutate != nil {
		mutate(&m.Spec)
	}
	return m
}

// issueSecret issues the spec's certificate into a Secret as the
// reconciler does.
func issueSecret(t *testing.T, ca *offline, m *v1alpha1.ManagedCertificate) (*corev1.Secret, wanted) {
	t.Helper()
	w, err := wantedOf(m)
	if err != nil {
		t.Fatal(err)
	}
	key, err := w.newKey()
	if err != nil {
		t.Fatal(err)
	}
	out, err := ca.issue(context.Background(), request{Name: w.name, Kind: w.kind, Usages: w.usages, DNS: w.dns, IPs: w.ips, Cluster: w.cluster, Lifetime: w.duration, Key: key})
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := identity.KeyPEM(key)
	if err != nil {
		t.Fatal(err)
	}
	return &corev1.Secret{
		Type:       corev1.SecretTypeTLS,
		ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{annotationSpecHash: w.hash(m.Spec.Issuer())}},
		Data:       map[string][]byte{corev1.TLSCertKey: out.ChainPEM, corev1.TLSPrivateKeyKey: keyPEM, caKey: out.CAPEM},
	}, w
}

// TestInspect: a Secret holding the spec's certificate passes; each way it
// can be wrong is named.
func TestInspect(t *testing.T) {
	ca := testCA(t)
	now := time.Now()
	m := testMC(nil)
	s, w := issueSecret(t, ca, m)
	hash := w.hash(m.Spec.Issuer())
	if cur, reason, msg := inspect(s, w, hash, now, nil, ""); reason != "" || cur.serial == "" {
		t.Fatalf("fresh certificate: %s %s", reason, msg)
	}
	other, _ := issueSecret(t, ca, testMC(func(s *v1alpha1.ManagedCertificateSpec) { s.CommonName = "other.pivirt.internal" }))
	for _, tc := range []struct {
		name   string
		secret func() *corev1.Secret
		w      wanted
		now    time.Time
		reason string
	}{
		{"missing", func() *corev1.Secret { return nil }, w, now, "DoesNotExist"},
		{"key of another", func() *corev1.Secret {
			c := s.DeepCopy()
			c.Data[corev1.TLSPrivateKeyKey] = other.Data[corev1.TLSPrivateKeyKey]
			return c
		}, w, now, "InvalidKeyPair"},
		{"garbage", func() *corev1.Secret { c := s.DeepCopy(); c.Data[corev1.TLSCertKey] = []byte("x"); return c }, w, now, "InvalidKeyPair"},
		{"opaque", func() *corev1.Secret { c := s.DeepCopy(); c.Type = corev1.SecretTypeOpaque; return c }, w, now, "InvalidSecret"},
		{"foreign CA", func() *corev1.Secret { c := s.DeepCopy(); c.Data[caKey] = testCA(t).chain; return c }, w, now, "InvalidChain"},
		{"spec hash", func() *corev1.Secret { c := s.DeepCopy(); c.Annotations[annotationSpecHash] = "x"; return c }, w, now, "SpecChanged"},
		{"renewal due", func() *corev1.Secret { return s }, w, now.Add(9*time.Hour + time.Minute), "Renewing"},
		{"expired", func() *corev1.Secret { return s }, w, now.Add(11 * time.Hour), "InvalidChain"},
	} {
		_, reason, msg := inspect(tc.secret(), tc.w, hash, tc.now, nil, "")
		if reason != tc.reason {
			t.Errorf("%s: reason %q (%s), want %q", tc.name, reason, msg, tc.reason)
		}
	}
	// The certificate does not match the spec although the hash does (a
	// tampered annotation): named.
	w2, _ := wantedOf(testMC(func(s *v1alpha1.ManagedCertificateSpec) { s.DNSNames = []string{"x.pivirt.internal"} }))
	if _, reason, msg := inspect(s, w2, hash, now, nil, ""); reason != "SpecMismatch" || !strings.Contains(msg, "DNS names") {
		t.Errorf("other names: %s %s", reason, msg)
	}
}

// TestRenewalTime: renewBefore before expiry, or two thirds into the life
// when renewBefore is not shorter than the duration (the default 720h with
// a short duration).
func TestRenewalTime(t *testing.T) {
	leaf := &x509.Certificate{NotBefore: time.Unix(0, 0), NotAfter: time.Unix(0, 0).Add(9000 * time.Hour)}
	for _, tc := range []struct {
		duration, before, want time.Duration
	}{
		{8760 * time.Hour, 720 * time.Hour, 8280 * time.Hour},
		{time.Hour, 720 * time.Hour, 8999*time.Hour + 40*time.Minute},
		{2 * time.Hour, 119 * time.Minute, 8998*time.Hour + 40*time.Minute},
		{3 * time.Hour, 3 * time.Hour, 8999 * time.Hour},
	} {
		w := wanted{duration: tc.duration, renew: tc.before}
		if got := w.renewalTime(leaf).Sub(leaf.NotBefore); got != tc.want {
			t.Errorf("duration %s renewBefore %s: renews at %s, want %s", tc.duration, tc.before, got, tc.want)
		}
	}
}

// TestSpecHash: what makes the certificate changes the hash; renewBefore,
// policies and the Secret's template do not.
func TestSpecHash(t *testing.T) {
	base := testMC(nil)
	wb, _ := wantedOf(base)
	h := wb.hash(base.Spec.Issuer())
	same := []func(*v1alpha1.ManagedCertificateSpec){
		func(s *v1alpha1.ManagedCertificateSpec) { s.RenewBefore = &metav1.Duration{Duration: 2 * time.Hour} },
		func(s *v1alpha1.ManagedCertificateSpec) { s.RevocationPolicy = v1alpha1.RevokeNever },
		func(s *v1alpha1.ManagedCertificateSpec) {
			s.PrivateKey = &v1alpha1.PrivateKey{RotationPolicy: v1alpha1.RotationNever}
		},
		func(s *v1alpha1.ManagedCertificateSpec) {
			s.PrivateKey = &v1alpha1.PrivateKey{Algorithm: "ECDSA", Size: 256}
		},
		func(s *v1alpha1.ManagedCertificateSpec) { s.IPAddresses = []string{"127.0.0.1", "127.0.0.1"} },
		func(s *v1alpha1.ManagedCertificateSpec) {
			s.SecretTemplate = &v1alpha1.SecretTemplate{Labels: map[string]string{"a": "b"}}
		},
		func(s *v1alpha1.ManagedCertificateSpec) { s.DNSNames = []string{"localhost", "svc.pivirt.internal"} },
	}
	changed := []func(*v1alpha1.ManagedCertificateSpec){
		func(s *v1alpha1.ManagedCertificateSpec) { s.CommonName = "x.pivirt.internal" },
		func(s *v1alpha1.ManagedCertificateSpec) { s.DNSNames = append(s.DNSNames, "y") },
		func(s *v1alpha1.ManagedCertificateSpec) { s.IPAddresses = nil },
		func(s *v1alpha1.ManagedCertificateSpec) { s.Duration = &metav1.Duration{Duration: time.Hour} },
		func(s *v1alpha1.ManagedCertificateSpec) { s.Type = v1alpha1.TypeMTLSClient },
		func(s *v1alpha1.ManagedCertificateSpec) { s.Usages = []v1alpha1.Usage{"server", "client"} },
		func(s *v1alpha1.ManagedCertificateSpec) { s.Cluster = "prod" },
		func(s *v1alpha1.ManagedCertificateSpec) {
			s.PrivateKey = &v1alpha1.PrivateKey{Algorithm: v1alpha1.AlgorithmRSA}
		},
		func(s *v1alpha1.ManagedCertificateSpec) { s.IssuerRef = &v1alpha1.IssuerRef{URL: "https://other:8080"} },
		func(s *v1alpha1.ManagedCertificateSpec) { s.IssuerRef = &v1alpha1.IssuerRef{SecretName: "x1"} },
	}
	for i, f := range same {
		m := testMC(f)
		w, _ := wantedOf(m)
		if w.hash(m.Spec.Issuer()) != h {
			t.Errorf("same[%d] changed the hash", i)
		}
	}
	for i, f := range changed {
		m := testMC(f)
		w, _ := wantedOf(m)
		if w.hash(m.Spec.Issuer()) == h {
			t.Errorf("changed[%d] kept the hash", i)
		}
	}
}

// TestInspectTrustAndOwner: a certificate of another CA is refused even
// with its own chain in ca.crt, and a Secret controlled by another
// resource (a deleted one of the same name) is not taken as is.
func TestInspectTrustAndOwner(t *testing.T) {
	ca, other := testCA(t), testCA(t)
	m := testMC(nil)
	s, w := issueSecret(t, other, m)
	hash := w.hash(m.Spec.Issuer())
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.chain)
	if _, reason, msg := inspect(s, w, hash, time.Now(), pool, ""); reason != "InvalidChain" || !strings.Contains(msg, "not a certificate of the issuer") {
		t.Errorf("another CA's certificate: %s %s", reason, msg)
	}
	s, w = issueSecret(t, ca, m)
	ctrl := true
	s.OwnerReferences = []metav1.OwnerReference{{APIVersion: "certz.pilab.hu/v1alpha1", Kind: "ManagedCertificate", Name: "c", UID: "old", Controller: &ctrl}}
	if _, reason, _ := inspect(s, w, hash, time.Now(), pool, "new"); reason != "NotOwned" {
		t.Errorf("another resource's Secret: %s", reason)
	}
	if _, reason, msg := inspect(s, w, hash, time.Now(), pool, "old"); reason != "" {
		t.Errorf("its own Secret: %s %s", reason, msg)
	}
}
