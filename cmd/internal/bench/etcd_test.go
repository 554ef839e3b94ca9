package bench

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
)

// etcdCluster is an n-member etcd cluster running in this process on
// 127.0.0.1, with etcd's default durability (fsync on) and timing
// (100ms tick, 1s election).
type etcdCluster struct {
	tb        testing.TB
	logFile   string
	members   []*embed.Etcd
	names     []string
	endpoints []string
}

// startEtcd starts n members with data dirs under a test temp dir and waits
// until every member serves. The members are closed at cleanup.
func startEtcd(tb testing.TB, n int) *etcdCluster {
	tb.Helper()
	dir := tb.TempDir()
	// Errors only, into a file: a member that is closed logs its listeners'
	// "server closed" at error level. The tail is shown if the run fails.
	ec := &etcdCluster{tb: tb, logFile: filepath.Join(dir, "etcd.log")}
	var peers []string
	cfgs := make([]*embed.Config, n)
	for i := range n {
		name := fmt.Sprintf("etcd%d", i+1)
		peer := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", agenttest.FreePort(tb))}
		client := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", agenttest.FreePort(tb))}
		cfg := embed.NewConfig()
		cfg.Name = name
		cfg.Dir = filepath.Join(dir, name)
		cfg.ListenPeerUrls = []url.URL{peer}
		cfg.AdvertisePeerUrls = []url.URL{peer}
		cfg.ListenClientUrls = []url.URL{client}
		cfg.AdvertiseClientUrls = []url.URL{client}
		cfg.ClusterState = embed.ClusterStateFlagNew
		cfg.InitialClusterToken = "pivirt-bench"
		cfg.Logger = "zap"
		cfg.LogLevel = "error"
		cfg.LogOutputs = []string{ec.logFile}
		cfgs[i] = cfg
		ec.names = append(ec.names, name)
		ec.endpoints = append(ec.endpoints, client.String())
		peers = append(peers, name+"="+peer.String())
	}
	for _, cfg := range cfgs {
		cfg.InitialCluster = strings.Join(peers, ",")
	}

	// A new member waits for its peers while it starts, so all start at once.
	ec.members = make([]*embed.Etcd, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, cfg := range cfgs {
		wg.Go(func() { ec.members[i], errs[i] = embed.StartEtcd(cfg) })
	}
	wg.Wait()
	tb.Cleanup(ec.close)
	for i, err := range errs {
		if err != nil {
			tb.Fatalf("start etcd member %s: %v", ec.names[i], err)
		}
	}
	timeout := time.NewTimer(60 * time.Second)
	defer timeout.Stop()
	for i, m := range ec.members {
		select {
		case <-m.Server.ReadyNotify():
		case err := <-m.Err():
			tb.Fatalf("etcd member %s: %v", ec.names[i], err)
		case <-timeout.C:
			tb.Fatalf("etcd member %s not ready after 60s", ec.names[i])
		}
	}
	return ec
}

func (ec *etcdCluster) close() {
	for _, m := range ec.members {
		if m != nil {
			m.Close()
		}
	}
	if ec.tb.Failed() {
		if b, err := os.ReadFile(ec.logFile); err == nil {
			lines := strings.Split(string(b), "\n")
			ec.tb.Logf("last etcd log lines:\n%s", strings.Join(lines[max(len(lines)-50, 0):], "\n"))
		}
	}
}

// client returns a clientv3 client over the given endpoints: one gRPC
// ClientConn with one HTTP/2 connection per endpoint and round-robin
// picking per RPC. It is closed at cleanup.
func (ec *etcdCluster) client(tb testing.TB, endpoints []string) *clientv3.Client {
	tb.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		tb.Fatalf("etcd client: %v", err)
	}
	tb.Cleanup(func() { _ = cli.Close() })
	return cli
}

// leader returns the name of the member that currently leads.
func (ec *etcdCluster) leader() string {
	for i, m := range ec.members {
		if uint64(m.Server.Leader()) == uint64(m.Server.MemberID()) {
			return ec.names[i]
		}
	}
	return "none"
}

// waitWritable polls until a put through cli succeeds.
func waitWritable(tb testing.TB, cli *clientv3.Client) {
	tb.Helper()
	agenttest.Eventually(tb, 60*time.Second, "etcd accepts a put", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := cli.Put(ctx, "/pivirt/bench/ready", "1")
		return err
	})
}
