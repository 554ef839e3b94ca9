package agent_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/identity/revtest"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// TestRevokedCertificates: an operator's client certificate naming a CRL
// is accepted on the API port until its CA revokes it; then, within two
// refreshes, its open connection is closed and new handshakes are
// refused. An agent certificate revoked the same way is refused on the
// internal and Raft ports.
func TestRevokedCertificates(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const refresh = time.Second
	dir := testPKI(t, 2)
	chain := filepath.Join(dir, identity.ChainFile)
	crl := revtest.New(t, dir)
	opFiles, op := crl.Leaf(t, dir, "operator", revtest.LeafOptions{NoOCSP: true})
	agentFiles, agentCert := crl.Leaf(t, dir, "pivirt-agent-node2", revtest.LeafOptions{NoOCSP: true, Cluster: agenttest.ClusterName})
	c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
		withTLS(dir)(i, cfg)
		cfg.TLS.Revocation = config.RevocationConfig{Mode: "crl", OnUnavailable: "allow", Refresh: config.Duration(refresh)}
	})
	n := c.WaitLeader(60 * time.Second)

	// The operator: one connection kept open, a request answered on it.
	opCert, err := tls.LoadX509KeyPair(opFiles.Cert, opFiles.Key)
	if err != nil {
		t.Fatal(err)
	}
	opTLS := &tls.Config{RootCAs: mustPool(t, chain), MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{opCert}, NextProtos: []string{"http/1.1"}}
	conn, err := tls.Dial("tcp", n.APIAddr(), opTLS)
	if err != nil {
		t.Fatalf("the operator's handshake: %v", err)
	}
	defer conn.Close()
	rd := bufio.NewReader(conn)
	get := func() error {
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(conn, "GET /pivirt.cluster.v1.ClusterService/Leader HTTP/1.1\r\nHost: agent\r\n\r\n"); err != nil {
			return err
		}
		resp, err := http.ReadResponse(rd, nil)
		if err != nil {
			return err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.Body.Close()
	}
	if err := get(); err != nil {
		t.Fatalf("a request of the operator: %v", err)
	}
	// The agent identity on the internal port.
	agentSrc, err := identity.NewSource(identity.SourceConfig{CertFile: agentFiles.Cert, KeyFile: agentFiles.Key, CAFile: chain})
	if err != nil {
		t.Fatal(err)
	}
	status := func() error {
		pool := cluster.NewPoolTLS(agentSrc.ClientConfig)
		defer pool.Close()
		sctx, scancel := context.WithTimeout(ctx, 5*time.Second)
		defer scancel()
		_, err := pool.Node(n.InternalAddr()).Status(sctx, connect.NewRequest(&nodev1.StatusRequest{}))
		return err
	}
	if err := status(); err != nil {
		t.Fatalf("the agent certificate on the internal port before its revocation: %v", err)
	}

	crl.Revoke(op.SerialNumber)
	crl.Revoke(agentCert.SerialNumber)
	revoked := time.Now()
	_ = conn.SetReadDeadline(time.Now().Add(2*refresh + 10*time.Second))
	if _, err := rd.ReadByte(); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the operator's connection is still open %v after the revocation (%v)", time.Since(revoked), err)
	}
	if took := time.Since(revoked); took > 2*refresh+2*time.Second {
		t.Errorf("the connection was closed %v after the revocation; want within 2×refresh (%v, plus slack)", took, 2*refresh)
	}
	hexSerial := identity.SerialHex(op.SerialNumber)
	agenttest.Eventually(t, 10*time.Second, "the closing logged", func() error {
		if !c.Logs().Contains("tls: closing a connection of a revoked certificate") || !c.Logs().Contains(hexSerial) {
			return errors.New("no log line about closing the operator's connection")
		}
		return nil
	})

	// New handshakes of both certificates are refused.
	if c2, err := tls.Dial("tcp", n.APIAddr(), opTLS); err == nil {
		rd2 := bufio.NewReader(c2)
		_ = c2.SetDeadline(time.Now().Add(10 * time.Second))
		_, _ = io.WriteString(c2, "GET / HTTP/1.1\r\nHost: agent\r\n\r\n")
		_, err = http.ReadResponse(rd2, nil)
		c2.Close()
		if err == nil {
			t.Error("the revoked operator certificate was answered on the API port")
		}
	}
	if err := status(); err == nil {
		t.Error("the revoked agent certificate was answered on the internal port")
	}
	if n.RaftAddr() != "" {
		rc, err := tls.Dial("tcp", n.RaftAddr(), agentSrc.ClientConfig("127.0.0.1"))
		if err == nil {
			_ = rc.SetDeadline(time.Now().Add(10 * time.Second))
			_, _ = rc.Write([]byte{0})
			_, err = rc.Read(make([]byte, 1))
			rc.Close()
		}
		if err == nil {
			t.Error("the revoked agent certificate was answered on the Raft port")
		}
	}
	agenttest.Eventually(t, 10*time.Second, "the refusal logged", func() error {
		if !c.Logs().Contains("tls: refused revoked certificate") {
			return errors.New(`no log line "tls: refused revoked certificate"`)
		}
		return nil
	})
	// The mode changes live: off, the revoked operator is answered again.
	cfg := *n.Cfg
	cfg.TLS.Revocation.Mode = "off"
	applied, restart, err := n.ReloadConfig(&cfg)
	if err != nil || !slices.Contains(applied, "tls.revocation.mode") || len(restart) > 0 {
		t.Fatalf("reload with tls.revocation.mode off: applied %v, restart %v, %v", applied, restart, err)
	}
	if c3, err := tls.Dial("tcp", n.APIAddr(), opTLS); err != nil {
		t.Errorf("revocation off: the operator's handshake: %v", err)
	} else {
		rd3 := bufio.NewReader(c3)
		_ = c3.SetDeadline(time.Now().Add(10 * time.Second))
		_, _ = io.WriteString(c3, "GET / HTTP/1.1\r\nHost: agent\r\n\r\n")
		if _, err := http.ReadResponse(rd3, nil); err != nil {
			t.Errorf("revocation off: the operator was not answered: %v", err)
		}
		c3.Close()
	}
	body := httpGet(t, "http://"+n.MetricsAddr()+"/metrics")
	for _, want := range []string{`pivirt_tls_revocation_checks_total{result="revoked"}`, `pivirt_tls_crl_fetches_total{result="ok"}`, "pivirt_tls_revoked_connections_closed_total"} {
		line := grepLines(body, want)
		if line == "" || strings.HasSuffix(strings.TrimSpace(line), " 0") {
			t.Errorf("/metrics: %s not counted:\n%s", want, grepLines(body, "pivirt_tls"))
		}
	}
}

// TestRevokedAgentNotAdmitted: a server whose agent certificate is revoked
// joins gossip but is never admitted into Raft: its node proof is refused.
func TestRevokedAgentNotAdmitted(t *testing.T) {
	dir := testPKI(t, 2)
	crl := revtest.New(t, dir)
	_, agentCert := crl.Leaf(t, dir, "pivirt-agent-node2", revtest.LeafOptions{NoOCSP: true, Cluster: agenttest.ClusterName})
	revocation := config.RevocationConfig{Mode: "crl", OnUnavailable: "allow", Refresh: config.Duration(time.Second)}
	c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
		withTLS(dir)(i, cfg)
		cfg.TLS.Revocation = revocation
	})
	leader := c.WaitLeader(60 * time.Second)
	crl.Revoke(agentCert.SerialNumber)

	cfg := agenttest.Config("node2", filepath.Join(t.TempDir(), "node2"))
	withTLS(dir)(1, cfg)
	cfg.TLS.Revocation = revocation
	cfg.Cluster.Join = []string{leader.GossipAddr()}
	c.Start(1, cfg)
	agenttest.Eventually(t, 60*time.Second, "the revoked server's proof refused", func() error {
		for _, l := range strings.Split(c.Logs().Since(0), "\n") {
			if strings.Contains(l, "did not prove the agent identity") && strings.Contains(l, "certificate revoked: serial "+identity.SerialHex(agentCert.SerialNumber)) {
				return nil
			}
		}
		return errors.New("no log line refuses node2's proof for its revoked certificate")
	})
	if servers := serverSet(t, leader); len(servers) != 1 {
		t.Fatalf("the raft configuration holds %d servers; want the leader alone", len(servers))
	}
}
