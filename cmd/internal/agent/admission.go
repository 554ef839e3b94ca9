package agent

import (
	"fmt"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/identity"

	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// newAdmission returns what admits servers into Raft: with TLS on, a
// server must prove the agent identity for the node name it claims in
// gossip (cluster/DESIGN.md, "Admission"); with TLS off there is no
// identity to prove and gossip membership is trusted, which the start-up
// warning about plaintext covers.
func (a *Agent) newAdmission() cluster.Admitter {
	if a.tls == nil {
		return nil
	}
	return cluster.NewAdmission(cluster.AdmissionConfig{
		Ask:        cluster.PoolStatus{Pool: a.pool}.Prove,
		Forget:     a.pool.Forget,
		Verify:     a.tls.internal.VerifyChain,
		MinBackoff: a.opts.AdmissionBackoff,
		Logger:     a.logger,
	})
}

// proveIdentity answers a status query's nonce: this node's gossip claim
// signed with its agent key (tls.key_file).
func (a *Agent) proveIdentity(nonce []byte) (*nodev1.IdentityProof, error) {
	m := a.meta
	p, err := identity.ProveNodeClaim(a.tls.client.Certificate(), identity.NodeClaim{
		Cluster: m.Cluster, NodeID: m.ID, Name: a.cfg.NodeName, RaftAddr: m.RaftAddr, InternalAddr: m.InternalAddr,
	}, nonce)
	if err != nil {
		return nil, err
	}
	return &nodev1.IdentityProof{Chain: p.Chain, Signature: p.Signature}, nil
}

// checkAgentName refuses, in Raft mode, an agent certificate that names
// another node: no leader would admit this server with it.
func checkAgentName(cfg *config.Config, t *agentTLS) error {
	if cfg.ServiceDiscovery.Type == config.DiscoveryEtcd {
		return nil
	}
	name, err := identity.AgentName(t.client.Leaf())
	if err != nil {
		return fmt.Errorf("tls.cert_file %s: %w", cfg.TLS.CertFile, err)
	}
	if name != cfg.NodeName {
		return fmt.Errorf("tls.cert_file %s is the agent identity of node %q, but node_name is %q: servers are admitted into raft only with the agent certificate for their node name; set node_name: %s, or issue one with pitrust issue-mtls-client --name %s%s",
			cfg.TLS.CertFile, name, cfg.NodeName, name, identity.AgentPrefix, cfg.NodeName)
	}
	return nil
}
