package etcdstore_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"pilab.hu/pivirt-agent/store/etcdstore"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// TestConnsNamesTheCause: with Conns in the client's dial options, requests
// while etcd is down leave the refused dial of the endpoint, named as
// configured (a host name, not the address it resolved to), and the
// connection made once etcd is back clears it.
func TestConnsNamesTheCause(t *testing.T) {
	ec := etcdtest.Start(t, 1)
	_, port, err := net.SplitHostPort(strings.TrimPrefix(ec.Endpoints[0], "http://"))
	if err != nil {
		t.Fatal(err)
	}
	conns := new(etcdstore.Conns)
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{"http://localhost:" + port},
		DialOptions: conns.DialOptions(nil),
		Logger:      zap.NewNop(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	get := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := cli.Get(ctx, "k")
		return err
	}
	if err := get(); err != nil {
		t.Fatalf("get: %v", err)
	}
	if err := conns.Err(); err != nil {
		t.Fatalf("connected, yet: %v", err)
	}

	ec.Stop(0)
	eventually(t, 20*time.Second, "the refused dial is named", func() error {
		if err := get(); err == nil {
			return errors.New("a get succeeded with etcd stopped")
		}
		e := conns.Err()
		if e == nil || !strings.HasPrefix(e.Error(), "localhost:"+port+": dial tcp") || !strings.Contains(e.Error(), "connection refused") {
			return errors.New("conns: " + errString(e))
		}
		return nil
	})

	ec.Restart(0)
	eventually(t, 30*time.Second, "connected again, nothing left", func() error {
		if err := get(); err != nil {
			return err
		}
		if e := conns.Err(); e != nil {
			return e
		}
		return nil
	})
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}
