package identity

import (
	"bytes"
	"crypto/tls"
	"errors"
	"net"
	"strings"
	"testing"
)

func TestNodeProof(t *testing.T) {
	p := newPKI(t)
	other := newPKI(t)
	verifier := p.source(p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-leader"}))
	load := func(f LeafFiles) *tls.Certificate {
		c, err := tls.LoadX509KeyPair(f.Cert, f.Key)
		if err != nil {
			t.Fatal(err)
		}
		return &c
	}
	node1 := load(p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node1"}))
	claim := NodeClaim{Cluster: "pivirt", NodeID: "0b7c5a7e-8d7a-4d0e-9f39-1c2b3d4e5f60", Name: "node1",
		RaftAddr: "127.0.0.1:7000", InternalAddr: "127.0.0.1:9000"}
	nonce := bytes.Repeat([]byte{7}, MinNonce)
	good, err := ProveNodeClaim(node1, claim, nonce)
	if err != nil {
		t.Fatal(err)
	}
	if err := CheckNodeProof(verifier.VerifyChain, claim, nonce, good); err != nil {
		t.Fatalf("a good proof: %v", err)
	}

	prove := func(cert *tls.Certificate, c NodeClaim) NodeProof {
		pr, err := ProveNodeClaim(cert, c, nonce)
		if err != nil {
			t.Fatal(err)
		}
		return pr
	}
	with := func(f func(*NodeClaim)) NodeClaim { c := claim; f(&c); return c }
	node2 := load(p.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node2"}))
	operator := load(p.issue(LeafRequest{Kind: KindClient, Name: "operator"}))
	server := load(p.issue(LeafRequest{Kind: KindServer, Name: "node1", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}}))
	foreign := load(other.issue(LeafRequest{Kind: KindClient, Name: "pivirt-agent-node1"}))
	otherNonce := bytes.Repeat([]byte{8}, MinNonce)

	for name, tt := range map[string]struct {
		claim NodeClaim
		nonce []byte
		proof NodeProof
		want  string
	}{
		"another node's certificate": {claim, nonce, prove(node2, claim), `names node "node2", the claim is for "node1"`},
		"not an agent certificate":   {claim, nonce, prove(operator, claim), "is not an agent identity"},
		"a server certificate":       {claim, nonce, prove(server, claim), "not valid for this use"},
		"another CA":                 {claim, nonce, prove(foreign, claim), "not signed by the given CA chain"},
		"no certificate":             {claim, nonce, NodeProof{Signature: good.Signature}, "no certificate in the proof"},
		"garbage chain":              {claim, nonce, NodeProof{Chain: [][]byte{[]byte("x")}, Signature: good.Signature}, "certificate 0 of the chain"},
		"another nonce (replay)":     {claim, otherNonce, good, "not signed by the certificate's key"},
		"another raft address":       {with(func(c *NodeClaim) { c.RaftAddr = "127.0.0.1:7001" }), nonce, good, "not signed"},
		"another internal address":   {with(func(c *NodeClaim) { c.InternalAddr = "127.0.0.1:9001" }), nonce, good, "not signed"},
		"another node id":            {with(func(c *NodeClaim) { c.NodeID = "x" }), nonce, good, "not signed"},
		"another cluster":            {with(func(c *NodeClaim) { c.Cluster = "other" }), nonce, good, "not signed"},
		"signature of another claim": {claim, nonce, NodeProof{Chain: good.Chain, Signature: prove(node1, with(func(c *NodeClaim) { c.RaftAddr = "10.0.0.9:7000" })).Signature}, "not signed"},
		"fields shifted":             {with(func(c *NodeClaim) { c.NodeID, c.Name = c.NodeID+"n", "ode1" }), nonce, good, "names node"},
	} {
		t.Run(name, func(t *testing.T) {
			err := CheckNodeProof(verifier.VerifyChain, tt.claim, tt.nonce, tt.proof)
			if !errors.Is(err, ErrNodeProof) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("got %v, want ErrNodeProof saying %q", err, tt.want)
			}
		})
	}

	for _, n := range [][]byte{nil, make([]byte, MinNonce-1), make([]byte, MaxNonce+1)} {
		if _, err := ProveNodeClaim(node1, claim, n); err == nil {
			t.Errorf("a nonce of %d bytes was signed", len(n))
		}
	}
}

func TestAgentName(t *testing.T) {
	p := newPKI(t)
	for cn, want := range map[string]string{"pivirt-agent-node-01": "node-01", "pivirt-agent-": "", "operator": "", "xpivirt-agent-a": ""} {
		got, err := AgentName(mustLeaf(t, p.issue(LeafRequest{Kind: KindClient, Name: cn, Force: true}).Cert))
		if got != want || (err == nil) != (want != "") {
			t.Errorf("%q: got %q, %v; want %q", cn, got, err, want)
		}
	}
}
