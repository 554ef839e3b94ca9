package identity

import (
	"bytes"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"errors"
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
	oldSerial := s.Leaf().SerialNumber

	// A pair that does not match changes nothing.
	other := p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node2"})
	before := mustRead(t, leaf.Cert)
	if err := s.Replace(mustRead(t, leaf.Cert), mustRead(t, other.Key)); err == nil {
		t.Fatal("a certificate with another's key was accepted")
	}
	if !bytes.Equal(mustRead(t, leaf.Cert), before) || s.Leaf().SerialNumber.Cmp(oldSerial) != 0 {
		t.Fatal("a refused replacement changed the files or the certificate in use")
	}

	req, keyPEM := renewal(t, leaf)
	certPEM, issued, err := p.clusterCA().Renew(req, s.VerifyChain, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Replace(certPEM, keyPEM); err != nil {
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
}
