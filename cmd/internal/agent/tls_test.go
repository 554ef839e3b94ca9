package agent_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
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
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/storage/v1/storagev1connect"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/vm/v1/vmv1connect"
)

// testPKI creates a PiTrust CA and, per node, a server certificate for
// 127.0.0.1 and an agent client certificate.
func testPKI(t *testing.T, nodes int) string {
	t.Helper()
	return shortLivedPKI(t, nodes, 0)
}

// withTLS turns on TLS with node i's certificates of dir.
func withTLS(dir string) func(i int, cfg *config.Config) {
	return func(i int, cfg *config.Config) {
		chain := filepath.Join(dir, identity.ChainFile)
		cfg.TLS = config.TLSConfig{
			Enabled: true, VerifyPeer: true, CAFile: chain,
			CertFile: filepath.Join(dir, fmt.Sprintf("pivirt-agent-node%d.crt", i+1)),
			KeyFile:  filepath.Join(dir, fmt.Sprintf("pivirt-agent-node%d.key", i+1)),
		}
		cfg.Server.ConnectRPC.TLS = config.ServerTLSConfig{
			CertFile: filepath.Join(dir, fmt.Sprintf("node%d-server.crt", i+1)),
			KeyFile:  filepath.Join(dir, fmt.Sprintf("node%d-server.key", i+1)),
			CAFile:   chain, ClientCAFile: chain,
		}
	}
}

// apiClientCert issues a client certificate of dir's CA to call the API
// port with (access control needs credentials on a TLS port).
func apiClientCert(t *testing.T, dir string) *tls.Certificate {
	t.Helper()
	f := issueClient(t, dir, "api-client")
	cert, err := tls.LoadX509KeyPair(f[0], f[1])
	if err != nil {
		t.Fatal(err)
	}
	return &cert
}

func httpsClient(t *testing.T, caFile string, cert *tls.Certificate) *http.Client {
	t.Helper()
	cfg := &tls.Config{RootCAs: mustPool(t, caFile), MinVersion: tls.VersionTLS12}
	if cert != nil {
		cfg.Certificates = []tls.Certificate{*cert}
	}
	tr := &http.Transport{TLSClientConfig: cfg, ForceAttemptHTTP2: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// TestClusterWithMTLS forms a 3-node cluster with TLS on every port: Raft
// and the internal port over mutual TLS with agent identities, the API over
// TLS with optional client certificates. Writes through a follower are
// forwarded over mTLS; plaintext clients, other CAs' certificates and
// non-agent identities are refused.
func TestClusterWithMTLS(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := testPKI(t, 3)
	chain := filepath.Join(dir, identity.ChainFile)
	c := agenttest.NewExpect(t, 3, withTLS(dir))
	c.WaitLeader(60 * time.Second)
	follower := c.Follower()

	anon := clusterv1connect.NewClusterServiceClient(httpsClient(t, chain, nil), "https://"+follower.APIAddr())
	if _, err := anon.Leader(ctx, connect.NewRequest(&clusterv1.LeaderRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("a call without a client certificate: %v, want unauthenticated", err)
	}
	api := clusterv1connect.NewClusterServiceClient(httpsClient(t, chain, apiClientCert(t, dir)), "https://"+follower.APIAddr())
	reg, err := api.RegisterService(ctx, connect.NewRequest(&clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
		Service: "web", InstanceId: "w-1", Address: "10.0.0.1", Port: 80,
	}}))
	if err != nil {
		t.Fatalf("write through a follower over TLS: %v", err)
	}
	got, err := api.GetService(ctx, connect.NewRequest(&clusterv1.GetServiceRequest{
		Service: "web", InstanceId: "w-1", Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
	}))
	if err != nil || len(got.Msg.GetInstances()) != 1 {
		t.Fatalf("consistent read through a follower over TLS: %v, %v", got, err)
	}
	t.Logf("registered at index %d over TLS", reg.Msg.GetIndex())

	// A plaintext client on the TLS API port.
	plain := agenttest.NewClient(agenttest.NewHTTPClient(), follower.APIAddr())
	pctx, pcancel := context.WithTimeout(ctx, 5*time.Second)
	if _, err := plain.Leader(pctx, connect.NewRequest(&clusterv1.LeaderRequest{})); err == nil {
		t.Error("a plaintext client was answered on the TLS API port")
	}
	pcancel()

	// The API port checks client certificates when given: another CA's is
	// refused.
	other := testPKI(t, 1)
	otherCert, err := tls.LoadX509KeyPair(filepath.Join(other, "pivirt-agent-node1.crt"), filepath.Join(other, "pivirt-agent-node1.key"))
	if err != nil {
		t.Fatal(err)
	}
	bad := clusterv1connect.NewClusterServiceClient(httpsClient(t, chain, &otherCert), "https://"+follower.APIAddr())
	if _, err := bad.Leader(ctx, connect.NewRequest(&clusterv1.LeaderRequest{})); err == nil {
		t.Error("a client certificate of another CA was accepted on the API port")
	}

	// The internal port accepts only agents of this CA.
	for name, files := range map[string][2]string{
		"another CA's agent": {filepath.Join(other, "pivirt-agent-node1.crt"), filepath.Join(other, "pivirt-agent-node1.key")},
		"a non-agent client": issueClient(t, dir, "backup-tool"),
		"a server identity":  {filepath.Join(dir, "node1-server.crt"), filepath.Join(dir, "node1-server.key")},
	} {
		src, err := identity.NewSource(identity.SourceConfig{CertFile: files[0], KeyFile: files[1], CAFile: chain})
		if err != nil {
			t.Fatal(err)
		}
		pool := cluster.NewPoolTLS(src.ClientConfig)
		sctx, scancel := context.WithTimeout(ctx, 5*time.Second)
		_, err = pool.Node(follower.InternalAddr()).Status(sctx, connect.NewRequest(&nodev1.StatusRequest{}))
		scancel()
		pool.Close()
		if err == nil {
			t.Errorf("%s was answered on the internal port", name)
		}
	}
	for _, reason := range []string{"not signed by the given CA chain", "is not an agent identity", "not valid for this use"} {
		agenttest.Eventually(t, 10*time.Second, "the refusal logged: "+reason, func() error {
			if !c.Logs().Contains(reason) {
				return fmt.Errorf("no log line says %q", reason)
			}
			return nil
		})
	}
	// ... and answers this CA's agents.
	good, err := identity.NewSource(identity.SourceConfig{CertFile: filepath.Join(dir, "pivirt-agent-node3.crt"), KeyFile: filepath.Join(dir, "pivirt-agent-node3.key"), CAFile: chain})
	if err != nil {
		t.Fatal(err)
	}
	pool := cluster.NewPoolTLS(good.ClientConfig)
	defer pool.Close()
	if _, err := pool.Node(follower.InternalAddr()).Status(ctx, connect.NewRequest(&nodev1.StatusRequest{})); err != nil {
		t.Errorf("an agent of this CA on the internal port: %v", err)
	}
	if !strings.HasPrefix(follower.Cfg.TLS.CertFile, dir) {
		t.Errorf("the follower's client certificate %s is not from the test PKI", follower.Cfg.TLS.CertFile)
	}

	// Operations: the expiry metric, /ready's detail, and POST /reload
	// picking up a reissued server certificate for new handshakes.
	body := httpGet(t, "http://"+follower.MetricsAddr()+"/metrics")
	if !strings.Contains(body, `pivirt_tls_cert_expiry_seconds{cert="api",subject="node`) || !strings.Contains(body, `cert="client",subject="pivirt-agent-node`) {
		t.Errorf("/metrics lacks pivirt_tls_cert_expiry_seconds:\n%s", grepLines(body, "pivirt_tls"))
	}
	if body := httpGet(t, "http://"+follower.MetricsAddr()+"/ready"); !strings.Contains(body, `"tls":"ok"`) {
		t.Errorf("/ready: %s", body)
	}
	serial := func() string {
		conn, err := tls.Dial("tcp", follower.APIAddr(), &tls.Config{RootCAs: mustPool(t, chain), MinVersion: tls.VersionTLS12})
		if err != nil {
			t.Fatalf("handshake with the API port: %v", err)
		}
		defer conn.Close()
		return conn.ConnectionState().PeerCertificates[0].SerialNumber.String()
	}
	before := serial()
	i := c.Index(follower) + 1
	if _, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: fmt.Sprintf("node%d-server", i),
		DNS: []string{"localhost"}, IPs: []net.IP{net.ParseIP("127.0.0.1")}, Force: true}); err != nil {
		t.Fatal(err)
	}
	if code, body := httpPost(t, "http://"+follower.MetricsAddr()+"/reload"); code != http.StatusOK {
		t.Fatalf("POST /reload: %d %s", code, body)
	}
	if after := serial(); after == before {
		t.Error("after POST /reload the API port still presents the old certificate")
	}
	certFile := filepath.Join(dir, fmt.Sprintf("node%d-server.crt", i))
	if err := os.WriteFile(certFile, []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	if code, body := httpPost(t, "http://"+follower.MetricsAddr()+"/reload"); code != http.StatusUnprocessableEntity || !strings.Contains(body, filepath.Base(certFile)) {
		t.Errorf("POST /reload with a broken certificate: %d %s, want 422 naming the file", code, body)
	}
	_ = serial() // the certificate in use still serves
}

func mustPool(t *testing.T, caFile string) *x509.CertPool {
	t.Helper()
	pem, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	p := x509.NewCertPool()
	p.AppendCertsFromPEM(pem)
	return p
}

func httpGet(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func httpPost(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestStartRefusesBadTLS: an agent with TLS on refuses to start on a
// missing file, a client certificate that is not an agent identity or is
// another node's, or verify_peer false, naming what is wrong.
func TestStartRefusesBadTLS(t *testing.T) {
	dir := testPKI(t, 1)
	for _, tt := range []struct {
		name   string
		mutate func(cfg *config.Config)
		want   string
	}{
		{"missing CA", func(cfg *config.Config) { cfg.TLS.CAFile = filepath.Join(dir, "missing.pem") }, "missing.pem"},
		{"not an agent", func(cfg *config.Config) {
			f := issueClient(t, dir, "backup-tool")
			cfg.TLS.CertFile, cfg.TLS.KeyFile = f[0], f[1]
		}, "not an agent identity"},
		{"another node's agent certificate", func(cfg *config.Config) {
			f := issueClient(t, dir, "pivirt-agent-node7")
			cfg.TLS.CertFile, cfg.TLS.KeyFile = f[0], f[1]
		}, `is the agent identity of node "node7", but node_name is "node1"`},
		{"another cluster's agent certificate", func(cfg *config.Config) {
			f, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-node1", File: "node1-other-cluster", Cluster: "other-cluster"})
			if err != nil {
				t.Fatal(err)
			}
			cfg.TLS.CertFile, cfg.TLS.KeyFile = f.Cert, f.Key
		}, `is an agent certificate of cluster "other-cluster", not of this cluster`},
		{"verify_peer false", func(cfg *config.Config) { cfg.TLS.VerifyPeer = false }, "tls.verify_peer"},
		{"key readable by others", func(cfg *config.Config) {
			key := filepath.Join(t.TempDir(), "agent.key")
			b, err := os.ReadFile(cfg.TLS.KeyFile)
			if err == nil {
				err = os.WriteFile(key, b, 0o644)
			}
			if err == nil {
				err = os.Chmod(key, 0o644) // whatever the umask
			}
			if err != nil {
				t.Fatal(err)
			}
			cfg.TLS.KeyFile = key
		}, "is readable by group or others (mode 0644): chmod 600 it"},
		{"key of another certificate", func(cfg *config.Config) {
			cfg.Server.ConnectRPC.TLS.KeyFile = cfg.TLS.KeyFile
		}, "server.connectrpc.tls"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := agenttest.Config("node1", t.TempDir())
			withTLS(dir)(0, cfg)
			cfg.Cluster.Raft.Bootstrap = true
			tt.mutate(cfg)
			// Refused by New (configuration) or by Start (the files).
			a, err := agentNew(cfg)
			if err == nil {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				if err = a.Start(ctx); err == nil {
					a.Shutdown()
					t.Fatal("the agent started")
				}
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("start: %v, want an error naming %q", err, tt.want)
			}
		})
	}
}

// issueClient issues a client certificate named name in dir.
func issueClient(t *testing.T, dir, name string) [2]string {
	t.Helper()
	f, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: name, Force: true})
	if err != nil {
		t.Fatal(err)
	}
	return [2]string{f.Cert, f.Key}
}

func agentNew(cfg *config.Config) (*agent.Agent, error) {
	return agent.New(cfg, agenttest.Options(nil))
}

// TestCertificateRotationUnderLoad replaces the API's server certificate
// five times while clients send requests without pause, each on a new TLS
// connection; reloads (as SIGHUP does) switch new handshakes to the new
// certificate, and no request fails.
func TestCertificateRotationUnderLoad(t *testing.T) {
	dir := testPKI(t, 1)
	chain := filepath.Join(dir, identity.ChainFile)
	c := agenttest.NewExpect(t, 1, withTLS(dir))
	n := c.WaitLeader(60 * time.Second)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: mustPool(t, chain), MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{*apiClientCert(t, dir)}}, ForceAttemptHTTP2: true, DisableKeepAlives: true}
	t.Cleanup(tr.CloseIdleConnections)
	api := clusterv1connect.NewClusterServiceClient(&http.Client{Transport: tr}, "https://"+n.APIAddr())

	var (
		ok, failed atomic.Int64
		firstErr   atomic.Value
		stop       = make(chan struct{})
		wg         sync.WaitGroup
	)
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				_, err := api.Leader(ctx, connect.NewRequest(&clusterv1.LeaderRequest{}))
				cancel()
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err)
					continue
				}
				ok.Add(1)
			}
		})
	}
	served := func() string {
		conn, err := tls.Dial("tcp", n.APIAddr(), &tls.Config{RootCAs: mustPool(t, chain), MinVersion: tls.VersionTLS12})
		if err != nil {
			t.Fatalf("handshake: %v", err)
		}
		defer conn.Close()
		return conn.ConnectionState().PeerCertificates[0].SerialNumber.String()
	}
	for i := range 5 {
		f, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: "node1-server",
			DNS: []string{"localhost"}, IPs: []net.IP{net.ParseIP("127.0.0.1")}, Force: true})
		if err != nil {
			t.Fatal(err)
		}
		want := mustSerial(t, f.Cert)
		if err := n.ReloadTLS(); err != nil {
			t.Fatalf("rotation %d: reload: %v", i, err)
		}
		if got := served(); got != want {
			t.Fatalf("rotation %d: the API serves certificate %s, want the new %s", i, got, want)
		}
		before := ok.Load()
		agenttest.Eventually(t, 10*time.Second, "requests on the new certificate", func() error {
			if ok.Load() < before+10 {
				return fmt.Errorf("%d requests since the rotation", ok.Load()-before)
			}
			return nil
		})
	}
	close(stop)
	wg.Wait()
	if failed.Load() != 0 {
		t.Errorf("%d of %d requests failed during rotation; first: %v", failed.Load(), ok.Load()+failed.Load(), firstErr.Load())
	}
	t.Logf("%d requests on new connections across 5 rotations, %d failed", ok.Load(), failed.Load())
}

func mustSerial(t *testing.T, certFile string) string {
	t.Helper()
	certs, err := identity.ReadCertificates(certFile)
	if err != nil {
		t.Fatal(err)
	}
	return certs[0].SerialNumber.String()
}

// TestDevModeTLS: --dev runs with TLS on, with a throw-away PKI in its data
// dir that pvcli can use; a client with neither a certificate nor a token
// is refused (the API port takes callers without a certificate, for the
// dev issuer's bearer tokens, but access control stays on).
func TestDevModeTLS(t *testing.T) {
	cfg := config.Default()
	config.ApplyDev(cfg)
	cfg.DataDir = t.TempDir()
	cfg.Server.ConnectRPC.Addr, cfg.Server.GRPCInternal.Addr, cfg.Server.Metrics.Addr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Cluster.Gossip.BindAddr, cfg.Cluster.Raft.Addr = "127.0.0.1:0", "127.0.0.1:0"
	a, err := agentNew(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer a.Shutdown()
	pki := filepath.Join(cfg.DataDir, agent.DevPKIDir)
	op, err := tls.LoadX509KeyPair(filepath.Join(pki, "operator.crt"), filepath.Join(pki, "operator.key"))
	if err != nil {
		t.Fatalf("dev PKI: %v", err)
	}
	chain := filepath.Join(pki, identity.ChainFile)
	api := clusterv1connect.NewClusterServiceClient(httpsClient(t, chain, &op), "https://"+a.APIAddr())
	agenttest.Eventually(t, 20*time.Second, "the dev node answers over TLS", func() error {
		_, err := api.Leader(ctx, connect.NewRequest(&clusterv1.LeaderRequest{}))
		return err
	})
	anon := clusterv1connect.NewClusterServiceClient(httpsClient(t, chain, nil), "https://"+a.APIAddr())
	if _, err := anon.Leader(ctx, connect.NewRequest(&clusterv1.LeaderRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("a client with neither certificate nor token in dev mode: %v, want Unauthenticated", err)
	}
	if cfg.TLS.CertFile != "" {
		t.Errorf("the dev PKI changed the caller's configuration: tls.cert_file = %q", cfg.TLS.CertFile)
	}

	// --dev has a simulated pivirtd and iscsiman behind the VM, network
	// and storage APIs.
	vms := vmv1connect.NewVMServiceClient(httpsClient(t, chain, &op), "https://"+a.APIAddr())
	created, err := vms.CreateVM(ctx, connect.NewRequest(&vmv1.CreateVMRequest{Vm: &vmv1.VM{Name: "dev-vm", Vcpus: 1, MemoryMib: 512}}))
	if err != nil {
		t.Fatalf("create a VM in dev mode: %v", err)
	}
	if _, err := vms.PowerOn(ctx, connect.NewRequest(&vmv1.PowerOnRequest{Id: created.Msg.GetVm().GetId()})); err != nil {
		t.Errorf("power on in dev mode: %v", err)
	}
	vols := storagev1connect.NewStorageServiceClient(httpsClient(t, chain, &op), "https://"+a.APIAddr())
	if _, err := vols.CreateVolume(ctx, connect.NewRequest(&storagev1.CreateVolumeRequest{Volume: &storagev1.Volume{Name: "d", SizeBytes: 1 << 20}})); err != nil {
		t.Errorf("create a volume in dev mode: %v", err)
	}
	if len(cfg.Backends) != 0 {
		t.Errorf("the dev backends changed the caller's configuration: %v", cfg.Backends)
	}
}
