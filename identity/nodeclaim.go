package identity

import (
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
)

// AgentPrefix starts the CN of every agent's client certificate
// (pitrust issue-mtls-client --name pivirt-agent-<node>): the rest of the
// CN is the node name the certificate speaks for.
const AgentPrefix = "pivirt-agent-"

// AgentName returns the node name an agent's client certificate names: its
// CN after AgentPrefix. Any other certificate is refused.
func AgentName(c *x509.Certificate) (string, error) {
	name, ok := strings.CutPrefix(c.Subject.CommonName, AgentPrefix)
	if !ok || name == "" {
		return "", fmt.Errorf("%q is not an agent identity (the CN of an agent's client certificate is %s<node name>)", c.Subject.CommonName, AgentPrefix)
	}
	return name, nil
}

// NodeClaim is what a server claims about itself in gossip: the claim a
// leader checks before it lets the server into the Raft configuration.
type NodeClaim struct {
	Cluster      string
	NodeID       string
	Name         string
	RaftAddr     string
	InternalAddr string
}

// NodeProof shows that the holder of an agent certificate made a claim:
// the certificate chain (DER, leaf first) and the leaf key's signature over
// the claim and the asker's nonce.
type NodeProof struct {
	Chain     [][]byte
	Signature []byte
}

// nodeClaimContext prefixes what a node proof signs, so that the signature
// can never pass for one of another purpose (a renewal proof, a TLS
// handshake).
const nodeClaimContext = "pivirt-node-claim-v1\x00"

// Nonce bounds for a node proof.
const (
	MinNonce = 16
	MaxNonce = 64
)

// ErrNodeProof wraps every refusal of a node proof.
var ErrNodeProof = errors.New("identity not proven")

// message is the signed text: the context, then each field and the nonce
// with its length, so no two claims share a text.
func (c NodeClaim) message(nonce []byte) []byte {
	b := []byte(nodeClaimContext)
	for _, f := range [][]byte{[]byte(c.Cluster), []byte(c.NodeID), []byte(c.Name), []byte(c.RaftAddr), []byte(c.InternalAddr), nonce} {
		b = binary.BigEndian.AppendUint32(b, uint32(len(f)))
		b = append(b, f...)
	}
	return b
}

// ProveNodeClaim signs claim and nonce with cert's key. cert must be the
// agent's client certificate for claim.Name.
func ProveNodeClaim(cert *tls.Certificate, claim NodeClaim, nonce []byte) (NodeProof, error) {
	if len(nonce) < MinNonce || len(nonce) > MaxNonce {
		return NodeProof{}, fmt.Errorf("nonce of %d bytes: want %d to %d", len(nonce), MinNonce, MaxNonce)
	}
	if cert == nil || len(cert.Certificate) == 0 {
		return NodeProof{}, errors.New("no agent certificate loaded")
	}
	key, ok := cert.PrivateKey.(crypto.Signer)
	if !ok {
		return NodeProof{}, fmt.Errorf("the agent key (%T) cannot sign", cert.PrivateKey)
	}
	sig, err := sign(key, claim.message(nonce))
	if err != nil {
		return NodeProof{}, fmt.Errorf("sign node claim: %w", err)
	}
	return NodeProof{Chain: cert.Certificate, Signature: sig}, nil
}

// CheckNodeProof checks that p proves claim for nonce: the chain verifies
// for client authentication with verify (the cluster's CAs), its leaf is
// an agent certificate for claim.Name, and the leaf's key signed the claim
// and the nonce. Refusals wrap ErrNodeProof and say why.
func CheckNodeProof(verify ChainVerifier, claim NodeClaim, nonce []byte, p NodeProof) error {
	refuse := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrNodeProof, fmt.Sprintf(format, args...))
	}
	if len(p.Chain) == 0 {
		return refuse("no certificate in the proof (is TLS off on that node?)")
	}
	if len(p.Chain) > 8 {
		return refuse("a chain of %d certificates", len(p.Chain))
	}
	chain := make([]*x509.Certificate, len(p.Chain))
	for i, der := range p.Chain {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return refuse("certificate %d of the chain: %v", i, err)
		}
		chain[i] = c
	}
	leaf := chain[0]
	if err := verify(chain, x509.ExtKeyUsageClientAuth); err != nil {
		return refuse("%v", err)
	}
	name, err := AgentName(leaf)
	if err != nil {
		return refuse("%v", err)
	}
	if name != claim.Name {
		return refuse("the certificate %q names node %q, the claim is for %q", leaf.Subject.CommonName, name, claim.Name)
	}
	if err := checkSignature(leaf, claim.message(nonce), p.Signature); err != nil {
		return refuse("the claim is %v", err)
	}
	return nil
}
