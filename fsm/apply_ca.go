package fsm

import (
	"crypto/x509"
	"encoding/pem"

	"google.golang.org/protobuf/proto"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// clusterCAKey is the primary key of the only record of TableCA.
const clusterCAKey = "cluster"

// MaxClusterCASize bounds the PEM of the cluster CA's certificates and of
// its key.
const MaxClusterCASize = 64 << 10

// applySetClusterCA installs the cluster CA. The leader checks the pair
// before proposing it (the key is the certificate's, the CA chains to the
// trusted root); applying checks what a state machine can check without a
// clock or the node's files: a CA certificate first, a private key.
func (f *FSM) applySetClusterCA(t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetSetClusterCa()
	if n := len(op.GetCertPem()); n == 0 || n > MaxClusterCASize {
		return nil, invalidf("set_cluster_ca.cert_pem: %d bytes, want 1 to %d", n, MaxClusterCASize)
	}
	if n := len(op.GetKeyPem()); n == 0 || n > MaxClusterCASize {
		return nil, invalidf("set_cluster_ca.key_pem: %d bytes, want 1 to %d", n, MaxClusterCASize)
	}
	b, _ := pem.Decode(op.GetCertPem())
	if b == nil || b.Type != "CERTIFICATE" {
		return nil, invalidf("set_cluster_ca.cert_pem: no PEM certificate first")
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		return nil, invalidf("set_cluster_ca.cert_pem: %v", err)
	}
	if !c.IsCA {
		return nil, invalidf("set_cluster_ca.cert_pem: %q is not a CA certificate", c.Subject.CommonName)
	}
	if k, _ := pem.Decode(op.GetKeyPem()); k == nil {
		return nil, invalidf("set_cluster_ca.key_pem: no PEM block")
	}
	rec := &fsmv1.ClusterCA{CertPem: op.GetCertPem(), KeyPem: op.GetKeyPem(), Index: t.index, InstalledAt: cmd.GetTime()}
	if err := t.insert(TableCA, rec); err != nil {
		return nil, err
	}
	return nil, nil
}
