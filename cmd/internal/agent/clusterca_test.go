package agent_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	"pilab.hu/pivirt-agent/gateway"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

// shortLivedPKI is testPKI with leaves valid for validity (0: the
// default of pitrust).
func shortLivedPKI(t *testing.T, nodes int, validity time.Duration) string {
	t.Helper()
	dir := t.TempDir()
	if _, err := identity.InitCA(dir, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	for i := range nodes {
		if _, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: fmt.Sprintf("node%d-server", i+1),
			DNS: []string{"localhost"}, IPs: []net.IP{net.ParseIP("127.0.0.1")}, Validity: validity}); err != nil {
			t.Fatal(err)
		}
		if _, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: fmt.Sprintf("pivirt-agent-node%d", i+1), Cluster: agenttest.ClusterName, Validity: validity}); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// withClusterCA turns on TLS with dir's certificates and the cluster CA,
// installed from caDir's X1 intermediate.
func withClusterCA(dir, caDir string, ttl time.Duration, rate float64, burst int) func(i int, cfg *config.Config) {
	return func(i int, cfg *config.Config) {
		withTLS(dir)(i, cfg)
		cfg.TLS.ClusterCA = config.ClusterCAConfig{
			Enabled:         true,
			CertFile:        filepath.Join(caDir, identity.IntermediateCertFile),
			KeyFile:         filepath.Join(caDir, identity.IntermediateKeyFile),
			LeafTTL:         config.Duration(ttl),
			CSRMaxPerSecond: rate,
			CSRBurst:        burst,
		}
	}
}

// TestClusterCARenewal: with the cluster CA on, three agents whose
// certificates live 30 s (renewed ones 20 s) renew their server and client certificates
// through the leader, twice (the second time a certificate the cluster CA
// issued itself), while writes through a follower (forwarded over mutual
// TLS) and reads on new TLS connections go on without a failure.
func TestClusterCARenewal(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for two certificate lifetimes; skipped with -short")
	}
	dir := shortLivedPKI(t, 3, 30*time.Second)
	chain := filepath.Join(dir, identity.ChainFile)
	// The API port checks client certificates against a CA of its own:
	// renewed server certificates must still be checked against
	// tls.ca_file.
	operatorsDir := testPKI(t, 0)
	operators := filepath.Join(operatorsDir, identity.ChainFile)
	c := agenttest.NewExpect(t, 3, func(i int, cfg *config.Config) {
		withClusterCA(dir, dir, 20*time.Second, 100, 100)(i, cfg)
		cfg.Server.ConnectRPC.TLS.ClientCAFile = operators
	})
	c.WaitLeader(20 * time.Second)
	follower := c.Follower()

	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: mustPool(t, chain), MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{*apiClientCert(t, operatorsDir)}}, ForceAttemptHTTP2: true, DisableKeepAlives: true}
	t.Cleanup(tr.CloseIdleConnections)
	var (
		ok, failed atomic.Int64
		firstErr   atomic.Value
		// noLeader counts reads answered "no cluster leader" (the node
		// asked knew no leader: an election); terms are the Raft terms
		// the answers named, to tell one happened.
		noLeader            atomic.Int64
		termsMu             sync.Mutex
		firstTerm, lastTerm uint64
		stop                = make(chan struct{})
		wg                  sync.WaitGroup
	)
	for _, n := range c.Nodes() {
		api := clusterv1connect.NewClusterServiceClient(&http.Client{Transport: tr}, "https://"+n.APIAddr())
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-time.After(50 * time.Millisecond):
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				var err error
				if n == follower {
					_, err = api.RegisterService(ctx, connect.NewRequest(&clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
						Service: "web", InstanceId: fmt.Sprintf("w-%d", i%50), Address: "10.0.0.1", Port: 80,
					}}))
				} else {
					var resp *connect.Response[clusterv1.LeaderResponse]
					resp, err = api.Leader(ctx, connect.NewRequest(&clusterv1.LeaderRequest{}))
					if err == nil {
						termsMu.Lock()
						if firstTerm == 0 {
							firstTerm = resp.Msg.GetTerm()
						}
						lastTerm = max(lastTerm, resp.Msg.GetTerm())
						termsMu.Unlock()
					}
				}
				cancel()
				if err != nil && connect.CodeOf(err) == connect.CodeUnavailable && strings.Contains(err.Error(), gateway.ErrNoLeader.Error()) {
					noLeader.Add(1)
					continue
				}
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err)
					continue
				}
				ok.Add(1)
			}
		})
	}

	// Every certificate file must hold three serials in turn: the PiTrust
	// one and two renewals.
	files := []string{}
	for i := range 3 {
		files = append(files, filepath.Join(dir, fmt.Sprintf("node%d-server.crt", i+1)), filepath.Join(dir, fmt.Sprintf("pivirt-agent-node%d.crt", i+1)))
	}
	seen := map[string]map[string]bool{}
	for _, f := range files {
		seen[f] = map[string]bool{}
	}
	agenttest.Eventually(t, 90*time.Second, "every certificate renewed twice", func() error {
		var behind []string
		for _, f := range files {
			certs, err := identity.ReadCertificates(f)
			if err != nil {
				return err
			}
			seen[f][certs[0].SerialNumber.String()] = true
			if len(seen[f]) < 3 {
				behind = append(behind, fmt.Sprintf("%s: %d", filepath.Base(f), len(seen[f])-1))
			}
		}
		if len(behind) > 0 {
			return fmt.Errorf("renewals so far: %s", strings.Join(behind, ", "))
		}
		return nil
	})
	close(stop)
	wg.Wait()
	if failed.Load() != 0 || ok.Load() == 0 {
		t.Errorf("%d of %d requests failed while certificates were renewed; first: %v", failed.Load(), ok.Load()+failed.Load()+noLeader.Load(), firstErr.Load())
	}
	// A read that found no leader is the answer of an election, which a
	// loaded machine may hold (a heartbeat late by more than its timeout):
	// accepted when the answers show one term change at most. Renewals
	// that broke Raft's connections would show as elections after each.
	if n := noLeader.Load(); n > 0 {
		termsMu.Lock()
		elections := lastTerm - firstTerm
		termsMu.Unlock()
		t.Logf("%d reads found no leader during %d election(s) (term %d to %d)", n, elections, firstTerm, lastTerm)
		if elections == 0 || elections > 1 {
			t.Errorf("%d reads found no leader, and the answers show %d elections (term %d to %d): want one at most, which explains them", n, elections, firstTerm, lastTerm)
		}
	}
	for _, f := range files {
		certs, err := identity.ReadCertificates(f)
		if err != nil {
			t.Fatal(err)
		}
		if life := certs[0].NotAfter.Sub(certs[0].NotBefore); life > 23*time.Second {
			t.Errorf("%s lives %s, want the cluster CA's leaf_ttl of 20s (plus 2s of backdating)", filepath.Base(f), life)
		}
	}
	// The agents serve the renewed certificates.
	conn, err := tls.Dial("tcp", follower.APIAddr(), &tls.Config{RootCAs: mustPool(t, chain), MinVersion: tls.VersionTLS12})
	if err != nil {
		t.Fatal(err)
	}
	served := conn.ConnectionState().PeerCertificates[0].SerialNumber.String()
	conn.Close()
	// The file may have been renewed once more since the last poll.
	serverFile := follower.Cfg.Server.ConnectRPC.TLS.CertFile
	if certs, err := identity.ReadCertificates(serverFile); err == nil {
		seen[serverFile][certs[0].SerialNumber.String()] = true
	}
	if !seen[serverFile][served] {
		t.Errorf("the follower serves certificate %s, not one of its file's", served)
	}
	t.Logf("%d requests while 6 certificates were renewed twice each, %d failed", ok.Load(), failed.Load())
}

// renewalClient returns a pool presenting dir's certificate of an agent
// (to reach the internal port), the request renewing that certificate and
// the certificate itself.
func renewalClient(t *testing.T, dir, agent string) (*cluster.Pool, *nodev1.RenewCertificateRequest, *tls.Certificate) {
	t.Helper()
	src, err := identity.NewSource(identity.SourceConfig{
		CertFile: filepath.Join(dir, agent+".crt"), KeyFile: filepath.Join(dir, agent+".key"), CAFile: filepath.Join(dir, identity.ChainFile),
	})
	if err != nil {
		t.Fatal(err)
	}
	pool := cluster.NewPoolTLS(src.ClientConfig)
	t.Cleanup(pool.Close)
	cert := src.Certificate()
	req, _, err := identity.NewRenewalRequest(cert.Certificate, cert.PrivateKey.(crypto.Signer))
	if err != nil {
		t.Fatal(err)
	}
	return pool, &nodev1.RenewCertificateRequest{Csr: req.CSR, Current: req.Current, Proof: req.Proof}, cert
}

// TestClusterCASigning drives RenewCertificate on a leader's internal port:
// a renewal is signed, a forged proof is refused, the rate limit answers
// ResourceExhausted with a retry hint, and each is counted.
func TestClusterCASigning(t *testing.T) {
	dir := testPKI(t, 1)
	c := agenttest.NewExpect(t, 1, withClusterCA(dir, dir, time.Hour, 0.001, 2))
	n := c.WaitLeader(20 * time.Second)
	agenttest.Eventually(t, 10*time.Second, "the cluster CA installed", func() error {
		if !c.Logs().Contains("cluster CA installed") {
			return errors.New("not yet")
		}
		return nil
	})

	pool, msg, cert := renewalClient(t, dir, "pivirt-agent-node1")
	node := pool.Node(n.InternalAddr())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	resp, err := node.RenewCertificate(ctx, connect.NewRequest(msg))
	if err != nil {
		t.Fatalf("renewal: %v", err)
	}
	issued, err := identity.ParseCertificates(resp.Msg.GetCertPem())
	if err != nil {
		t.Fatal(err)
	}
	if issued[0].Subject.CommonName != "pivirt-agent-node1" || issued[0].NotAfter.Sub(issued[0].NotBefore) > time.Hour+6*time.Minute {
		t.Errorf("issued %s valid %s to %s; want pivirt-agent-node1 for leaf_ttl 1h", issued[0].Subject, issued[0].NotBefore, issued[0].NotAfter)
	}

	// The proof of another key.
	other, _, err := identity.NewRenewalRequest(cert.Certificate, cert.PrivateKey.(crypto.Signer))
	if err != nil {
		t.Fatal(err)
	}
	forged := &nodev1.RenewCertificateRequest{Csr: other.CSR, Current: msg.GetCurrent(), Proof: msg.GetProof()}
	_, err = node.RenewCertificate(ctx, connect.NewRequest(forged))
	if connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "not signed by the current certificate's key") {
		t.Errorf("forged proof: %v, want PermissionDenied naming the proof", err)
	}
	// The burst (2) is spent: the next one waits for the rate.
	_, err = node.RenewCertificate(ctx, connect.NewRequest(msg))
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "retry in") {
		t.Errorf("third renewal: %v, want ResourceExhausted with a retry hint", err)
	}
	// The CA's key is in the replicated state, never in an archive.
	if ca, err := n.FSM().State().ClusterCA(); err != nil || ca == nil {
		t.Fatalf("no cluster CA in the state: %v", err)
	}
	snaps := clusterv1connect.NewSnapshotServiceClient(httpsClient(t, filepath.Join(dir, identity.ChainFile), apiClientCert(t, dir)), "https://"+n.APIAddr())
	_, file, err := saveSnapshotWith(ctx, snaps, false)
	if err != nil {
		t.Fatal(err)
	}
	rd, err := archive.NewReader(bytes.NewReader(file))
	if err != nil {
		t.Fatal(err)
	}
	st, err := rd.State()
	if err != nil {
		t.Fatal(err)
	}
	restored, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := restored.Restore(io.NopCloser(st)); err != nil {
		t.Fatal(err)
	}
	if ca, err := restored.State().ClusterCA(); ca != nil || err != nil {
		t.Errorf("the archive holds the cluster CA (%v)", err)
	}
	if bytes.Contains(file, []byte("PRIVATE KEY")) {
		t.Error("the archive holds a PEM private key")
	}

	metrics := httpGet(t, "http://"+n.MetricsAddr()+"/metrics")
	for _, want := range []string{
		`pivirt_tls_ca_signed_total{result="ok"} 1`,
		`pivirt_tls_ca_signed_total{result="refused"} 1`,
		`pivirt_tls_ca_signed_total{result="rate_limited"} 1`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %s:\n%s", want, grepLines(metrics, "pivirt_tls_ca"))
		}
	}
}

// TestClusterCARefusesForeignCA: an intermediate that does not chain to
// tls.ca_file (certificates it signed would not be trusted) is refused at
// start, as pivirt-agent validate refuses it, and nothing is started; a
// node with the cluster CA on but no intermediate of its own refuses
// renewals with FailedPrecondition while none is installed, and so does a
// node without the cluster CA.
func TestClusterCARefusesForeignCA(t *testing.T) {
	dir := testPKI(t, 2)
	other := testPKI(t, 0)
	cfg := agenttest.Config("node1", t.TempDir())
	withClusterCA(dir, other, time.Hour, 10, 10)(0, cfg)
	a, err := agent.New(cfg, agenttest.Options(nil))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := a.Start(ctx); err == nil || !strings.Contains(err.Error(), "does not chain to tls.ca_file") {
		_ = a.Shutdown()
		t.Fatalf("start with a foreign cluster CA: %v, want the refusal validate gives", err)
	}
	if entries, _ := os.ReadDir(cfg.DataDir); len(entries) != 0 {
		t.Errorf("the refused start wrote into its data dir: %v", entries)
	}

	c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
		withClusterCA(dir, other, time.Hour, 10, 10)(i, cfg)
		cfg.TLS.ClusterCA.CertFile, cfg.TLS.ClusterCA.KeyFile = "", ""
	})
	n := c.WaitLeader(20 * time.Second)
	pool, msg, _ := renewalClient(t, dir, "pivirt-agent-node2")
	_, err = pool.Node(n.InternalAddr()).RenewCertificate(ctx, connect.NewRequest(msg))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "no cluster CA installed") {
		t.Errorf("renewal without an installed CA: %v, want FailedPrecondition", err)
	}

	plain := agenttest.NewExpect(t, 1, withTLS(dir))
	p := plain.WaitLeader(20 * time.Second)
	_, err = pool.Node(p.InternalAddr()).RenewCertificate(ctx, connect.NewRequest(msg))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "tls.cluster_ca.enabled") {
		t.Errorf("renewal on a node without the cluster CA: %v, want FailedPrecondition", err)
	}
}
