package agent

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"pilab.hu/pivirt-agent/gateway/netpolicy"
	"pilab.hu/pivirt-agent/gateway/watchfile"
)

// NetworkPolicyKey is the cluster setting holding the cluster-wide network
// policies (the text of NetworkPolicy documents): when set, every agent
// enforces it in place of its auth.network_policy file.
const NetworkPolicyKey = "auth.network_policy"

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
			a.logger.Warn("auth.network_policy does not apply to a backend without a tls block (plaintext, or https:// verified by the system's trust store): its connections carry no identity", "backend", name, "endpoint", b.Endpoint)
		}
	}
	return nil
}

// networkPolicy is the network policy in force: the cluster's
// (auth.network_policy as a cluster setting), else the file's, else none.
func (a *Agent) networkPolicy() (*netpolicy.Set, string) {
	if p := a.clusterNetPolicy.Load(); p != nil {
		return p, "cluster"
	}
	if a.netPolicy != nil {
		return a.netPolicy.Value(), "file"
	}
	return nil, ""
}

// checkNetworkPolicy allows a connection from the holder of from to the
// holder of to at addr (its port) when no network policy is configured or
// one allows it; a refusal is logged and names both identities.
func (a *Agent) checkNetworkPolicy(from, to *x509.Certificate, addr, what string) error {
	ok, port, fromIDs, toIDs := a.networkAllows(from, to, addr)
	if ok {
		return nil
	}
	err := fmt.Errorf("network policy: no NetworkPolicy allows %s to connect to %s on port %d (%s)", names(fromIDs, from), names(toIDs, to), port, what)
	a.logger.Warn("connection refused by network policy", "from", fromIDs, "from_cn", cn(from), "to", toIDs, "to_cn", cn(to), "port", port, "what", what)
	return err
}

// networkAllows evaluates the policy in force for a connection.
func (a *Agent) networkAllows(from, to *x509.Certificate, addr string) (ok bool, port int, fromIDs, toIDs []string) {
	if _, p, err := net.SplitHostPort(strings.TrimPrefix(addr, "unix://")); err == nil {
		port, _ = strconv.Atoi(p)
	}
	fromIDs, toIDs = netpolicy.Identities(from), netpolicy.Identities(to)
	pol, _ := a.networkPolicy()
	if pol == nil {
		return true, port, fromIDs, toIDs
	}
	ok, _ = pol.Allows(fromIDs, toIDs, port)
	return ok, port, fromIDs, toIDs
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
		if err := a.checkAgentCluster(leaf); err != nil {
			return err
		}
		return a.checkNetworkPolicy(leaf, a.tls.internal.Leaf(), addr, what)
	}
}

// The connections of agents to this node's internal and Raft ports are
// tracked with their peer's certificate, so that a network policy that no
// longer allows one closes it instead of leaving it open until either side
// restarts (the policy is checked only in a handshake).

// connTracker holds the open connections of the tracked listeners.
type connTracker struct {
	mu    sync.Mutex
	conns map[*trackedConn]struct{}
}

// trackedConn is an accepted connection; peer is set once its handshake
// passed.
type trackedConn struct {
	net.Conn
	t    *connTracker
	addr string // the listener's address (its port is the policy's)
	what string
	peer atomic.Pointer[x509.Certificate]
	once sync.Once
}

// NetConn returns the wrapped connection (identity.Source finds its own
// tracking under this one).
func (c *trackedConn) NetConn() net.Conn { return c.Conn }

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.t.mu.Lock()
		delete(c.t.conns, c)
		c.t.mu.Unlock()
	})
	return c.Conn.Close()
}

type trackingListener struct {
	net.Listener
	t    *connTracker
	what string
}

func (l trackingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, t: l.t, addr: l.Addr().String(), what: l.what}
	l.t.mu.Lock()
	if l.t.conns == nil {
		l.t.conns = map[*trackedConn]struct{}{}
	}
	l.t.conns[tc] = struct{}{}
	l.t.mu.Unlock()
	return tc, nil
}

// track makes ln's connections tracked (what names the port in logs).
func (a *Agent) track(ln net.Listener, what string) net.Listener {
	return trackingListener{Listener: ln, t: &a.peerConns, what: what}
}

// recordPeer wraps a server tls.Config of a tracked listener: a connection
// whose handshake passed records its peer's certificate.
func recordPeer(base *tls.Config) *tls.Config {
	inner := base.GetConfigForClient
	base.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
		c, err := inner(hello)
		if err != nil || c == nil || c.VerifyConnection == nil {
			return c, err
		}
		verify := c.VerifyConnection
		c.VerifyConnection = func(cs tls.ConnectionState) error {
			// Recorded before the check: a policy that changes meanwhile
			// either is the one the check reads, or finds the peer
			// recorded when it goes over the open connections.
			if tc, ok := hello.Conn.(*trackedConn); ok && len(cs.PeerCertificates) > 0 {
				tc.peer.Store(cs.PeerCertificates[0])
			}
			return verify(cs)
		}
		return c, nil
	}
	return base
}

// enforceOnOpenConnections checks every tracked connection against the
// network policy in force and closes those it no longer allows, logging
// both identities. It returns how many it closed.
func (a *Agent) enforceOnOpenConnections() int {
	a.peerConns.mu.Lock()
	conns := make([]*trackedConn, 0, len(a.peerConns.conns))
	for c := range a.peerConns.conns {
		conns = append(conns, c)
	}
	a.peerConns.mu.Unlock()
	closed := 0
	for _, c := range conns {
		peer := c.peer.Load()
		if peer == nil {
			continue // the handshake is still running: it checks the policy of the moment
		}
		if ok, port, fromIDs, toIDs := a.networkAllows(peer, a.tls.internal.Leaf(), c.addr); !ok {
			a.logger.Warn("closing a connection the network policy no longer allows",
				"from", fromIDs, "from_cn", cn(peer), "to", toIDs, "to_cn", cn(a.tls.internal.Leaf()), "port", port, "what", c.what, "remote", c.RemoteAddr().String())
			_ = c.Close()
			closed++
		}
	}
	return closed
}

// watchNetworkPolicy enforces a changed network policy (the file's, read
// again every policyWatchInterval, or the cluster's) on the connections
// already open.
func (a *Agent) watchNetworkPolicy() {
	var last *netpolicy.Set
	t := time.NewTicker(policyWatchInterval)
	defer t.Stop()
	for {
		select {
		case <-a.ctx.Done():
			return
		case <-t.C:
		case <-a.netPolicyChanged:
		}
		if p, _ := a.networkPolicy(); p != last {
			last = p
			a.enforceOnOpenConnections()
			a.reconnectTLSBackends()
		}
	}
}

// reconnectTLSBackends replaces the backend clusters that speak TLS by new
// ones, whose handshakes check the policy in force; the old ones finish
// their calls in flight (as a reload does). Without TLS backends it does
// nothing.
func (a *Agent) reconnectTLSBackends() {
	a.reloadMu.Lock()
	defer a.reloadMu.Unlock()
	cur := a.current.Load()
	tlsBackends := false
	for _, b := range cur.Backends {
		tlsBackends = tlsBackends || b.TLS.Enabled
	}
	if !tlsBackends || a.cfg.Dev {
		return
	}
	backends, routes, err := a.buildBackends(cur)
	if err != nil {
		a.logger.Error("reconnecting the TLS backends after a network policy change failed; their open connections stay", "error", err)
		return
	}
	a.replaceBackends(backends, routes)
	a.logger.Info("TLS backends reconnected under the network policy in force")
}
