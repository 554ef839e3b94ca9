package identity

import (
	"bytes"
	"crypto"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// clusterCA loads the X1 intermediate of p as the cluster CA.
func (p *pki) clusterCA() *CertAuthority {
	p.t.Helper()
	ca, err := ParseCertAuthority(mustRead(p.t, filepath.Join(p.dir, IntermediateCertFile)), mustRead(p.t, filepath.Join(p.dir, IntermediateKeyFile)))
	if err != nil {
		p.t.Fatal(err)
	}
	return ca
}

// renewal makes a renewal request for the files of leaf.
func renewal(t *testing.T, leaf LeafFiles) (RenewalRequest, []byte) {
	t.Helper()
	pair, err := tls.LoadX509KeyPair(leaf.Cert, leaf.Key)
	if err != nil {
		t.Fatal(err)
	}
	req, key, err := NewRenewalRequest(pair.Certificate, pair.PrivateKey.(crypto.Signer))
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := KeyPEM(key)
	if err != nil {
		t.Fatal(err)
	}
	return req, keyPEM
}

func TestParseCertAuthority(t *testing.T) {
	p := newPKI(t)
	ca := p.clusterCA()
	if ca.Cert.Subject.CommonName != IntermediateCommonName {
		t.Errorf("CA %q, want %q", ca.Cert.Subject.CommonName, IntermediateCommonName)
	}
	leaf := p.issue(LeafRequest{Kind: KindServer, Name: "node1", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	for name, tc := range map[string]struct {
		cert, key string
		want      string
	}{
		"a leaf is no CA":  {leaf.Cert, leaf.Key, "is not a CA certificate"},
		"another key":      {filepath.Join(p.dir, IntermediateCertFile), filepath.Join(p.dir, RootKeyFile), "the key does not belong to"},
		"no certificate":   {leaf.Key, leaf.Key, "no PEM certificate"},
		"key is no key":    {filepath.Join(p.dir, IntermediateCertFile), filepath.Join(p.dir, IntermediateCertFile), "not a private key"},
		"empty key file":   {filepath.Join(p.dir, IntermediateCertFile), os.DevNull, "no PEM block"},
		"empty cert file":  {os.DevNull, filepath.Join(p.dir, IntermediateKeyFile), "no PEM certificate"},
		"root as the cert": {filepath.Join(p.dir, RootCertFile), filepath.Join(p.dir, IntermediateKeyFile), "the key does not belong to"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := ParseCertAuthority(mustRead(t, tc.cert), mustRead(t, tc.key))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestRenew(t *testing.T) {
	p := newPKI(t)
	ca := p.clusterCA()
	verifier := p.source(p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-verifier"}))
	now := time.Now()

	for _, leaf := range []LeafFiles{
		p.issue(LeafRequest{Kind: KindServer, Name: "node1.pivirt.internal", DNS: []string{"node1.pivirt.internal", "localhost"},
			IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, Validity: time.Minute}),
		p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node1", Validity: time.Minute}),
	} {
		t.Run(filepath.Base(leaf.Cert), func(t *testing.T) {
			cur := mustLeaf(t, leaf.Cert)
			req, keyPEM := renewal(t, leaf)
			certPEM, issued, err := ca.Renew(req, verifier.VerifyChain, time.Hour, now)
			if err != nil {
				t.Fatal(err)
			}
			pair, err := tls.X509KeyPair(certPEM, keyPEM)
			if err != nil {
				t.Fatalf("the new certificate and the new key do not pair: %v", err)
			}
			if len(pair.Certificate) != 2 || !bytes.Equal(pair.Certificate[1], ca.Cert.Raw) {
				t.Errorf("the new certificate file holds %d certificates, want the leaf and the CA", len(pair.Certificate))
			}
			if issued.Subject.String() != cur.Subject.String() || !slices.Equal(issued.DNSNames, cur.DNSNames) ||
				len(issued.IPAddresses) != len(cur.IPAddresses) || !slices.Equal(issued.ExtKeyUsage, cur.ExtKeyUsage) {
				t.Errorf("issued %s %v %v %v, want the names and usages of %s %v %v %v", issued.Subject, issued.DNSNames,
					issued.IPAddresses, issued.ExtKeyUsage, cur.Subject, cur.DNSNames, cur.IPAddresses, cur.ExtKeyUsage)
			}
			if publicKeysEqual(issued.PublicKey, cur.PublicKey) {
				t.Error("the renewed certificate has the old key")
			}
			if got, want := issued.NotAfter, now.Add(time.Hour).Truncate(time.Second); !got.Equal(want) {
				t.Errorf("NotAfter %s, want %s", got, want)
			}
			if got, want := issued.NotBefore, now.Add(-5*time.Minute).Truncate(time.Second); !got.Equal(want) {
				t.Errorf("NotBefore %s, want %s", got, want)
			}
			if err := verifier.VerifyChain([]*x509.Certificate{issued, ca.Cert}, issued.ExtKeyUsage[0]); err != nil {
				t.Errorf("the renewed certificate does not verify: %v", err)
			}
		})
	}

	t.Run("capped at the CA's expiry", func(t *testing.T) {
		req, _ := renewal(t, p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node2"}))
		_, issued, err := ca.Renew(req, verifier.VerifyChain, 100*365*24*time.Hour, now)
		if err != nil {
			t.Fatal(err)
		}
		if !issued.NotAfter.Equal(ca.Cert.NotAfter) {
			t.Errorf("NotAfter %s, want the CA's %s", issued.NotAfter, ca.Cert.NotAfter)
		}
	})
}

func TestRenewRefuses(t *testing.T) {
	p := newPKI(t)
	ca := p.clusterCA()
	verifier := p.source(p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-verifier"}))
	other := newPKI(t)
	now := time.Now()
	leaf := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node1"})
	good, _ := renewal(t, leaf)
	someoneElse, _ := renewal(t, p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node2"}))

	expired := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-old", Validity: time.Minute,
		Now: func() time.Time { return now.Add(-time.Hour) }})
	expiredReq, _ := renewal(t, expired)
	foreign, _ := renewal(t, other.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node1"}))
	caReq, _ := renewal(t, LeafFiles{Cert: filepath.Join(p.dir, IntermediateCertFile), Key: filepath.Join(p.dir, IntermediateKeyFile)})

	for name, tc := range map[string]struct {
		req  RenewalRequest
		want string
	}{
		"proof by another key": {RenewalRequest{CSR: good.CSR, Current: good.Current, Proof: someoneElse.Proof}, "not signed by the current certificate's key"},
		"another certificate":  {RenewalRequest{CSR: good.CSR, Current: someoneElse.Current, Proof: good.Proof}, "not signed by the current certificate's key"},
		"csr swapped":          {RenewalRequest{CSR: someoneElse.CSR, Current: good.Current, Proof: good.Proof}, "not signed by the current certificate's key"},
		"expired":              {expiredReq, "expired"},
		"another CA":           {foreign, "not signed by the given CA chain"},
		"a CA certificate":     {caReq, "is a CA certificate"},
		"no certificate":       {RenewalRequest{CSR: good.CSR, Proof: good.Proof}, "no current certificate"},
		"garbage certificate":  {RenewalRequest{CSR: good.CSR, Current: [][]byte{[]byte("x")}, Proof: good.Proof}, "current certificate 0"},
		"garbage csr":          {RenewalRequest{CSR: []byte("x"), Current: good.Current, Proof: good.Proof}, "not signed by the current certificate's key"},
	} {
		t.Run(name, func(t *testing.T) {
			_, _, err := ca.Renew(tc.req, verifier.VerifyChain, time.Hour, now)
			if !errors.Is(err, ErrRenewalRefused) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want a refusal containing %q", err, tc.want)
			}
		})
	}
}

// TestRenewRefusesUsageEscalation: a leaf for server and client
// authentication under an intermediate limited to server authentication
// cannot become a client certificate by renewal.
func TestRenewRefusesUsageEscalation(t *testing.T) {
	p := newPKI(t)
	root, rootKey := mustLeaf(t, filepath.Join(p.dir, RootCertFile)), mustKey(t, filepath.Join(p.dir, RootKeyFile))
	now := time.Now()
	limitedKey, _ := newKey()
	limitedDER, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(10), Subject: pkix.Name{CommonName: "servers only"}, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, root, limitedKey.Public(), rootKey)
	if err != nil {
		t.Fatal(err)
	}
	limited, _ := x509.ParseCertificate(limitedDER)
	leafKey, _ := newKey()
	leafDER, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(11), Subject: pkix.Name{CommonName: "pivirt-agent-evil"}, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
	}, limited, leafKey.Public(), limitedKey)
	if err != nil {
		t.Fatal(err)
	}
	req, _, err := NewRenewalRequest([][]byte{leafDER, limitedDER}, leafKey)
	if err != nil {
		t.Fatal(err)
	}
	verifier := p.source(p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-verifier"}))
	_, _, err = p.clusterCA().Renew(req, verifier.VerifyChain, time.Hour, now)
	if !errors.Is(err, ErrRenewalRefused) || !strings.Contains(err.Error(), "not valid for this use") {
		t.Errorf("renewal gaining client authentication: %v, want refused as not valid for client authentication", err)
	}
}

// TestRenewKeyTypesAndCSRChecks: proofs by RSA and Ed25519 keys verify; a
// CSR whose own signature is broken is refused even with a valid proof.
func TestRenewKeyTypesAndCSRChecks(t *testing.T) {
	p := newPKI(t)
	ca := p.clusterCA()
	caKey := mustKey(t, filepath.Join(p.dir, IntermediateKeyFile))
	verifier := p.source(p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-verifier"}))
	now := time.Now()
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	_, edKey, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	for name, key := range map[string]crypto.Signer{"RSA": rsaKey, "Ed25519": edKey} {
		der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
			SerialNumber: big.NewInt(20), Subject: pkix.Name{CommonName: "pivirt-agent-" + name}, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour),
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		}, ca.Cert, key.Public(), caKey)
		if err != nil {
			t.Fatal(err)
		}
		req, _, err := NewRenewalRequest([][]byte{der}, key)
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := ca.Renew(req, verifier.VerifyChain, time.Hour, now); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}

	leaf := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node1"})
	pair, err := tls.LoadX509KeyPair(leaf.Cert, leaf.Key)
	if err != nil {
		t.Fatal(err)
	}
	good, _, err := NewRenewalRequest(pair.Certificate, pair.PrivateKey.(crypto.Signer))
	if err != nil {
		t.Fatal(err)
	}
	broken := bytes.Clone(good.CSR)
	broken[len(broken)-1] ^= 0xff // the CSR's signature, at its end
	proof, err := signProof(pair.PrivateKey.(crypto.Signer), broken)
	if err != nil {
		t.Fatal(err)
	}
	_, _, err = ca.Renew(RenewalRequest{CSR: broken, Current: good.Current, Proof: proof}, verifier.VerifyChain, time.Hour, now)
	if !errors.Is(err, ErrRenewalRefused) || !strings.Contains(err.Error(), "csr") {
		t.Errorf("a CSR with a broken signature: %v, want refused naming the csr", err)
	}
}

func mustKey(t *testing.T, path string) crypto.Signer {
	t.Helper()
	k, err := ReadPrivateKey(path)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestRenewalTime(t *testing.T) {
	c := &x509.Certificate{NotBefore: time.Unix(1000, 0), NotAfter: time.Unix(2000, 0)}
	if got := RenewalTime(c, 0.6); !got.Equal(time.Unix(1600, 0)) {
		t.Errorf("RenewalTime 0.6 = %v", got)
	}
	if got := RenewalTime(c, 0.9); !got.Equal(time.Unix(1900, 0)) {
		t.Errorf("RenewalTime 0.9 = %v", got)
	}
}

func TestSourceReplace(t *testing.T) {
	p := newPKI(t)
	leaf := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node1"})
	s := p.source(leaf)
	cur := s.Leaf()

	// A pair that does not match changes nothing.
	other := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node2"})
	before := mustRead(t, leaf.Cert)
	if err := s.Replace(mustRead(t, leaf.Cert), mustRead(t, other.Key), cur.Raw); err == nil {
		t.Fatal("a certificate with another's key was accepted")
	}
	if !bytes.Equal(mustRead(t, leaf.Cert), before) || s.Leaf().SerialNumber.Cmp(cur.SerialNumber) != 0 {
		t.Fatal("a refused replacement changed the files or the certificate in use")
	}

	req, keyPEM := renewal(t, leaf)
	certPEM, issued, err := p.clusterCA().Renew(req, s.VerifyChain, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	// A renewal of a certificate that is no longer the one in use.
	if err := s.Replace(certPEM, keyPEM, mustLeaf(t, other.Cert).Raw); err == nil || !strings.Contains(err.Error(), "changed since the renewal began") {
		t.Errorf("replacing another certificate: %v", err)
	}
	if err := s.Replace(certPEM, keyPEM, cur.Raw); err != nil {
		t.Fatal(err)
	}
	if s.Leaf().SerialNumber.Cmp(issued.SerialNumber) != 0 {
		t.Error("the new certificate is not in use")
	}
	if !bytes.Equal(mustRead(t, leaf.Cert), certPEM) || !bytes.Equal(mustRead(t, leaf.Key), keyPEM) {
		t.Error("the files do not hold the new certificate and key")
	}
	if m := mode(t, leaf.Key); m != 0o600 {
		t.Errorf("key file mode %v, want 0600", m)
	}
	if _, err := os.Stat(leaf.Key + ".prev"); !os.IsNotExist(err) {
		t.Errorf("the previous key is left behind: %v", err)
	}

	// The files were replaced by hand after the load: a renewal of the
	// loaded certificate must not overwrite them.
	byHand := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node1"})
	req, keyPEM = renewal(t, byHand)
	certPEM, _, err = p.clusterCA().Renew(req, s.VerifyChain, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	handCert := mustRead(t, byHand.Cert)
	if err := s.Replace(certPEM, keyPEM, s.Leaf().Raw); err == nil || !strings.Contains(err.Error(), "holds another certificate") {
		t.Errorf("replacing files changed by hand: %v", err)
	}
	if !bytes.Equal(mustRead(t, byHand.Cert), handCert) {
		t.Error("the files put in place by hand were overwritten")
	}
}

// TestInterruptedRenewalLoads: a crash between the key and the certificate
// writes leaves the new key with the old certificate; the previous key
// kept in <key>.prev still loads with it.
func TestInterruptedRenewalLoads(t *testing.T) {
	p := newPKI(t)
	leaf := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node1"})
	_, keyPEM := renewal(t, leaf)
	oldKey := mustRead(t, leaf.Key)
	if err := WriteFileAtomic(leaf.Key+".prev", oldKey, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := WriteFileAtomic(leaf.Key, keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := NewSource(SourceConfig{CertFile: leaf.Cert, KeyFile: leaf.Key, CAFile: p.chain()})
	if err != nil {
		t.Fatalf("the certificate with the previous key does not load: %v", err)
	}
	if s.Leaf().SerialNumber.Cmp(mustLeaf(t, leaf.Cert).SerialNumber) != 0 {
		t.Error("another certificate was loaded")
	}
	if err := os.Remove(leaf.Key + ".prev"); err != nil {
		t.Fatal(err)
	}
	if _, err := NewSource(SourceConfig{CertFile: leaf.Cert, KeyFile: leaf.Key, CAFile: p.chain()}); err == nil {
		t.Error("a certificate with a key that is not its own loaded")
	}
}
