package agent

import (
	"crypto/x509"
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
		Verify:     a.verifyAgentChain,
		MinBackoff: a.opts.AdmissionBackoff,
		Logger:     a.logger,
	})
}

// verifyAgentChain verifies the chain of a node proof: the CAs, and that
// the agent belongs to this cluster (checkAgentCluster).
func (a *Agent) verifyAgentChain(chain []*x509.Certificate, usage x509.ExtKeyUsage) error {
	if err := a.tls.internal.VerifyChain(chain, usage); err != nil {
		return err
	}
	return a.checkAgentCluster(chain[0])
}

// checkAgentCluster refuses an agent certificate of another cluster, and,
// when this agent's own certificate names its cluster, one that names
// none (identity.CheckAgentCluster).
func (a *Agent) checkAgentCluster(peer *x509.Certificate) error {
	own, _ := identity.AgentCluster(a.tls.client.Leaf())
	return identity.CheckAgentCluster(peer, a.cfg.Cluster.Name, own != "")
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
	if err := identity.CheckAgentCluster(t.client.Leaf(), cfg.Cluster.Name, false); err != nil {
		return fmt.Errorf("tls.cert_file %s: %w: set cluster.name to the certificate's cluster, or issue one with pitrust issue-mtls-client --name %s%s --cluster %s",
			cfg.TLS.CertFile, err, identity.AgentPrefix, cfg.NodeName, cfg.Cluster.Name)
	}
	return nil
}
