// Package etcdtest runs real etcd clusters in the test process (the embedded
// etcd server, go.etcd.io/etcd/server/v3/embed) on 127.0.0.1, with data dirs
// in test temporary directories, for the tests of the etcd-backed mode and
// for the benchmarks that compare with etcd.
package etcdtest

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"

	"pilab.hu/pivirt-agent/internal/freeport"
)

// Cluster is an n-member etcd cluster with etcd's default durability (fsync
// on) and timing (100ms tick, 1s election). Members can be stopped and
// started again on the same ports and data dirs.
type Cluster struct {
	tb      testing.TB
	logFile string
	tls     *TLS

	mu      sync.Mutex
	cfgs    []*embed.Config
	members []*embed.Etcd // nil while stopped
	// Names and Endpoints (client URLs) of the members, by index.
	Names     []string
	Endpoints []string
}

// TLS makes the members serve their clients over HTTPS and require a client
// certificate, as the spec's etcd deployment does (`etcdctl --cacert
// --cert --key`).
type TLS struct {
	// CAFile verifies the clients' certificates; clients trust it for the
	// members' certificate.
	CAFile string
	// CertFile and KeyFile are the members' server certificate, valid for
	// 127.0.0.1.
	CertFile, KeyFile string
	// ClientCertFile and ClientKeyFile are a client certificate: Client's,
	// and the one a member's HTTP gateway presents to the member itself.
	ClientCertFile, ClientKeyFile string
}

// Start starts n members and waits until every member serves. The members
// are closed at cleanup.
func Start(tb testing.TB, n int) *Cluster {
	tb.Helper()
	return start(tb, n, nil)
}

// StartTLS is Start with the client URLs on HTTPS and client certificates
// required.
func StartTLS(tb testing.TB, n int, tlsFiles TLS) *Cluster {
	tb.Helper()
	return start(tb, n, &tlsFiles)
}

func start(tb testing.TB, n int, tlsFiles *TLS) *Cluster {
	tb.Helper()
	dir := tb.TempDir()
	// Errors only, into a file: a member that is closed logs its listeners'
	// "server closed" at error level. The tail is shown if the test fails.
	c := &Cluster{tb: tb, logFile: filepath.Join(dir, "etcd.log"), tls: tlsFiles}
	clientScheme := "http"
	if tlsFiles != nil {
		clientScheme = "https"
	}
	var peers []string
	ports := freePorts(tb, 2*n)
	for i := range n {
		name := fmt.Sprintf("etcd%d", i+1)
		peer := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports[2*i])}
		client := url.URL{Scheme: clientScheme, Host: fmt.Sprintf("127.0.0.1:%d", ports[2*i+1])}
		cfg := embed.NewConfig()
		if tlsFiles != nil {
			cfg.ClientTLSInfo = transport.TLSInfo{
				CertFile: tlsFiles.CertFile, KeyFile: tlsFiles.KeyFile,
				ClientCertFile: tlsFiles.ClientCertFile, ClientKeyFile: tlsFiles.ClientKeyFile,
				TrustedCAFile: tlsFiles.CAFile, ClientCertAuth: true,
			}
		}
		cfg.Name = name
		cfg.Dir = filepath.Join(dir, name)
		cfg.ListenPeerUrls = []url.URL{peer}
		cfg.AdvertisePeerUrls = []url.URL{peer}
		cfg.ListenClientUrls = []url.URL{client}
		cfg.AdvertiseClientUrls = []url.URL{client}
		cfg.ClusterState = embed.ClusterStateFlagNew
		cfg.InitialClusterToken = "pivirt-test"
		cfg.Logger = "zap"
		cfg.LogLevel = "error"
		cfg.LogOutputs = []string{c.logFile}
		c.cfgs = append(c.cfgs, cfg)
		c.Names = append(c.Names, name)
		c.Endpoints = append(c.Endpoints, client.String())
		peers = append(peers, name+"="+peer.String())
	}
	for _, cfg := range c.cfgs {
		cfg.InitialCluster = strings.Join(peers, ",")
	}
	c.members = make([]*embed.Etcd, n)
	tb.Cleanup(c.close)
	// A new member waits for its peers while it starts, so all start at once.
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { errs[i] = c.start(i) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			tb.Fatalf("etcd member %s: %v", c.Names[i], err)
		}
	}
	return c
}

// start starts member i and waits until it serves (60s at most).
func (c *Cluster) start(i int) error {
	m, err := embed.StartEtcd(c.cfgs[i])
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.members[i] = m
	c.mu.Unlock()
	timeout := time.NewTimer(60 * time.Second)
	defer timeout.Stop()
	select {
	case <-m.Server.ReadyNotify():
		return nil
	case err := <-m.Err():
		return err
	case <-timeout.C:
		return fmt.Errorf("not ready after 60s")
	}
}

// Stop stops member i (a clean shutdown of the process's member: its
// listeners close at once). Stopping a stopped member does nothing.
func (c *Cluster) Stop(i int) {
	c.mu.Lock()
	m := c.members[i]
	c.members[i] = nil
	c.mu.Unlock()
	if m != nil {
		m.Close()
	}
}

// Restart starts stopped member i again from its data dir on its ports.
// With a quorum of members down, start them together (StartAll): a member
// waits for its peers.
func (c *Cluster) Restart(i int) {
	c.tb.Helper()
	c.cfgs[i].ClusterState = embed.ClusterStateFlagExisting
	if err := c.start(i); err != nil {
		c.tb.Fatalf("restart etcd member %s: %v", c.Names[i], err)
	}
}

// RestartAll starts every stopped member at once.
func (c *Cluster) RestartAll() {
	c.tb.Helper()
	var wg sync.WaitGroup
	errs := make([]error, len(c.cfgs))
	for i := range c.cfgs {
		c.mu.Lock()
		running := c.members[i] != nil
		c.mu.Unlock()
		if running {
			continue
		}
		c.cfgs[i].ClusterState = embed.ClusterStateFlagExisting
		wg.Go(func() { errs[i] = c.start(i) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			c.tb.Fatalf("restart etcd member %s: %v", c.Names[i], err)
		}
	}
}

// Leader returns the name of the member that currently leads, "none" when
// no running member does.
func (c *Cluster) Leader() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, m := range c.members {
		if m != nil && uint64(m.Server.Leader()) == uint64(m.Server.MemberID()) {
			return c.Names[i]
		}
	}
	return "none"
}

func (c *Cluster) close() {
	for i := range c.members {
		c.Stop(i)
	}
	if c.tb.Failed() {
		if b, err := os.ReadFile(c.logFile); err == nil {
			// A member stopping logs its closed listeners as errors.
			var lines []string
			for l := range strings.SplitSeq(string(b), "\n") {
				if l != "" && !strings.Contains(l, "closed") {
					lines = append(lines, l)
				}
			}
			c.tb.Logf("last etcd log lines:\n%s", strings.Join(lines[max(len(lines)-30, 0):], "\n"))
		}
	}
}

// Client returns a clientv3 client over endpoints (all members when none
// are given): one gRPC ClientConn with one HTTP/2 connection per endpoint
// and round-robin picking per RPC. It is closed at cleanup.
func (c *Cluster) Client(tb testing.TB, endpoints ...string) *clientv3.Client {
	tb.Helper()
	if len(endpoints) == 0 {
		endpoints = c.Endpoints
	}
	var tlsCfg *tls.Config
	if c.tls != nil {
		info := transport.TLSInfo{CertFile: c.tls.ClientCertFile, KeyFile: c.tls.ClientKeyFile, TrustedCAFile: c.tls.CAFile}
		var err error
		if tlsCfg, err = info.ClientConfig(); err != nil {
			tb.Fatalf("etcd client TLS: %v", err)
		}
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: 5 * time.Second,
		TLS:         tlsCfg,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		tb.Fatalf("etcd client: %v", err)
	}
	tb.Cleanup(func() { _ = cli.Close() })
	return cli
}

// WaitWritable polls (60s at most) until a put through cli succeeds.
func WaitWritable(tb testing.TB, cli *clientv3.Client) {
	tb.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := cli.Put(ctx, "/etcdtest/ready", "1")
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			tb.Fatalf("etcd does not accept a put after 60s: %v", err)
		}
		time.Sleep(50 * time.Millisecond) // poll interval
	}
}

// freePorts returns n distinct loopback ports that were free when picked,
// outside the range the kernel gives outgoing connections.
func freePorts(tb testing.TB, n int) []int {
	tb.Helper()
	ports, err := freeport.Pick(n)
	if err != nil {
		tb.Fatalf("free ports: %v", err)
	}
	return ports
}
