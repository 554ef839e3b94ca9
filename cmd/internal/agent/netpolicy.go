package agent

import (
	"crypto/x509"
	"fmt"
	"net"
	"strconv"
	"strings"

	"pilab.hu/pivirt-agent/gateway/netpolicy"
	"pilab.hu/pivirt-agent/gateway/watchfile"
)

// loadNetworkPolicy reads auth.network_policy, when set, and keeps it up
// to date.
func (a *Agent) loadNetworkPolicy() error {
	path := a.cfg.Auth.NetworkPolicy
	if path == "" {
		return nil
	}
	f, err := watchfile.Load("auth.network_policy", path, netpolicy.Parse, a.logger)
	if err != nil {
		return err
	}
	a.netPolicy = f
	a.wg.Go(func() { f.Watch(a.ctx, policyWatchInterval) })
	for name, b := range a.cfg.Backends {
		if !b.TLS.Enabled {
			a.logger.Warn("auth.network_policy does not apply to a plaintext backend: its connections carry no identity", "backend", name, "endpoint", b.Endpoint)
		}
	}
	return nil
}

// checkNetworkPolicy allows a connection from the holder of from to the
// holder of to at addr (its port) when no network policy is configured or
// one allows it; a refusal is logged and names both identities.
func (a *Agent) checkNetworkPolicy(from, to *x509.Certificate, addr, what string) error {
	if a.netPolicy == nil {
		return nil
	}
	port := 0
	if _, p, err := net.SplitHostPort(strings.TrimPrefix(addr, "unix://")); err == nil {
		port, _ = strconv.Atoi(p)
	}
	fromIDs, toIDs := netpolicy.Identities(from), netpolicy.Identities(to)
	if ok, _ := a.netPolicy.Value().Allows(fromIDs, toIDs, port); ok {
		return nil
	}
	err := fmt.Errorf("network policy: no NetworkPolicy allows %s to connect to %s on port %d (%s)", names(fromIDs, from), names(toIDs, to), port, what)
	a.logger.Warn("connection refused by network policy", "from", fromIDs, "from_cn", cn(from), "to", toIDs, "to_cn", cn(to), "port", port, "what", what)
	return err
}

func cn(c *x509.Certificate) string {
	if c == nil {
		return ""
	}
	return c.Subject.CommonName
}

// names describes a certificate's identities for an error.
func names(ids []string, c *x509.Certificate) string {
	if len(ids) > 0 {
		return strings.Join(ids, "|")
	}
	if c != nil {
		return fmt.Sprintf("%q (a certificate without service names)", c.Subject.CommonName)
	}
	return "a peer without a certificate"
}

// peerCheck is the check of agents calling this node's internal or Raft
// port at addr: an agent identity, allowed by the network policy towards
// this node's server certificate.
func (a *Agent) peerCheck(addr string, what string) func(*x509.Certificate) error {
	return func(leaf *x509.Certificate) error {
		if err := agentIdentity(leaf); err != nil {
			return err
		}
		return a.checkNetworkPolicy(leaf, a.tls.internal.Leaf(), addr, what)
	}
}
