package fsm

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"testing"
	"time"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// leafPEM is a self-signed certificate that is not a CA.
func leafPEM(t *testing.T) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "leaf"},
		NotBefore: t0, NotAfter: t0.Add(time.Hour), BasicConstraintsValid: true,
	}, &x509.Certificate{Subject: pkix.Name{CommonName: "leaf"}}, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func TestSetClusterCA(t *testing.T) {
	certPEM, keyPEM := testCA(t)
	wantCA := func(want []byte) func(t *testing.T, h *harness, res *Result) {
		return func(t *testing.T, h *harness, res *Result) {
			got, err := h.f.State().ClusterCA()
			if err != nil || got == nil {
				t.Fatalf("ClusterCA() = %v, %v", got, err)
			}
			if !bytes.Equal(got.GetCertPem(), want) || got.GetIndex() != h.index || !got.GetInstalledAt().AsTime().Equal(h.now) {
				t.Errorf("ClusterCA() = index %d at %v, want index %d at %v with the given certificate", got.GetIndex(), got.GetInstalledAt().AsTime(), h.index, h.now)
			}
			if h.f.State().Index(TableCA) != h.index {
				t.Errorf("index of %s = %d, want %d", TableCA, h.f.State().Index(TableCA), h.index)
			}
		}
	}
	other := append(append([]byte{}, certPEM...), certPEM...) // the CA and "the CA above it"
	runApplyCases(t, []applyCase{
		{name: "install", cmd: setClusterCA(certPEM, keyPEM), check: wantCA(certPEM)},
		{name: "replace", setup: []*fsmv1.Command{setClusterCA(certPEM, keyPEM)}, cmd: setClusterCA(other, keyPEM), check: func(t *testing.T, h *harness, res *Result) {
			wantCA(other)(t, h, res)
			if n := len(dumpTables(t, h.f)[TableCA]); n != 1 {
				t.Errorf("%d records in %s, want 1", n, TableCA)
			}
		}},
		{name: "no certificate", cmd: setClusterCA(nil, keyPEM), wantErr: ErrInvalidCommand, check: wantField("set_cluster_ca.cert_pem")},
		{name: "no key", cmd: setClusterCA(certPEM, nil), wantErr: ErrInvalidCommand, check: wantField("set_cluster_ca.key_pem")},
		{name: "not PEM", cmd: setClusterCA([]byte("garbage"), keyPEM), wantErr: ErrInvalidCommand, check: wantField("set_cluster_ca.cert_pem")},
		{name: "key first", cmd: setClusterCA(keyPEM, keyPEM), wantErr: ErrInvalidCommand, check: wantField("set_cluster_ca.cert_pem")},
		{name: "not a CA", cmd: setClusterCA(leafPEM(t), keyPEM), wantErr: ErrInvalidCommand, check: wantField("set_cluster_ca.cert_pem")},
		{name: "key not PEM", cmd: setClusterCA(certPEM, []byte("garbage")), wantErr: ErrInvalidCommand, check: wantField("set_cluster_ca.key_pem")},
		{name: "too large", cmd: setClusterCA(bytes.Repeat([]byte("x"), MaxClusterCASize+1), keyPEM), wantErr: ErrInvalidCommand, check: wantField("set_cluster_ca.cert_pem")},
		{name: "a failed replace keeps the CA", setup: []*fsmv1.Command{setClusterCA(certPEM, keyPEM)}, cmd: setClusterCA(leafPEM(t), keyPEM), wantErr: ErrInvalidCommand, check: func(t *testing.T, h *harness, res *Result) {
			if got, _ := h.f.State().ClusterCA(); !bytes.Equal(got.GetCertPem(), certPEM) {
				t.Error("the installed CA changed")
			}
		}},
	})
	h := newHarness(t)
	if got, err := h.f.State().ClusterCA(); got != nil || err != nil {
		t.Errorf("ClusterCA() of an empty state = %v, %v; want nil, nil", got, err)
	}
}
