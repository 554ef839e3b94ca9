package agent_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// TestServicesDir: the agent registers the definitions of its services
// directory for its node at start, skips a bad file (naming it) without
// losing the good ones, and on a reload registers an added file, follows
// a changed one and deregisters the instance of a removed one.
func TestServicesDir(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("web.yaml", "name: web\naddress: 127.0.0.1\nport: 8080\ntags: [v1]\n")
	write("bad.yaml", "name: broken\naddress: 127.0.0.1\nport: eighty\n")
	c := agenttest.NewExpect(t, 1, func(_ int, cfg *config.Config) { cfg.ServiceDiscovery.ServicesDir = dir })
	n := c.WaitLeader(waitFor)
	list := func() (map[string]*clusterv1.ServiceInstance, error) {
		resp, err := n.API.ListServices(ctxT(t), connect.NewRequest(&clusterv1.ListServicesRequest{}))
		if err != nil {
			return nil, err
		}
		out := map[string]*clusterv1.ServiceInstance{}
		for _, in := range resp.Msg.GetInstances() {
			out[in.GetService()] = in
		}
		return out, nil
	}
	agenttest.Eventually(t, waitFor, "web registered from its file", func() error {
		got, err := list()
		if err != nil {
			return err
		}
		web := got["web"]
		if web == nil || web.GetInstanceId() != "web-"+n.Name || web.GetNode() != n.Name || web.GetMeta()[agent.FileMetaKey] != "web.yaml" {
			return fmt.Errorf("instances %v", got)
		}
		if len(got) != 1 {
			return fmt.Errorf("instances %v, want web alone", got)
		}
		return nil
	})
	if !c.Logs().Contains("bad.yaml") {
		t.Errorf("no log line names bad.yaml")
	}

	write("db.json", `{"name": "db", "address": "127.0.0.1", "port": 5432}`)
	write("web.yaml", "name: web\naddress: 127.0.0.1\nport: 9090\n")
	if _, _, err := n.ReloadConfig(n.Cfg); err != nil {
		t.Fatal(err)
	}
	agenttest.Eventually(t, waitFor, "db added and web changed", func() error {
		got, err := list()
		if err != nil {
			return err
		}
		if got["db"] == nil || got["web"].GetPort() != 9090 {
			return fmt.Errorf("instances %v", got)
		}
		return nil
	})

	if err := os.Remove(filepath.Join(dir, "web.yaml")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := n.ReloadConfig(n.Cfg); err != nil {
		t.Fatal(err)
	}
	agenttest.Eventually(t, waitFor, "web deregistered", func() error {
		got, err := list()
		if err != nil {
			return err
		}
		if got["web"] != nil || got["db"] == nil {
			return errors.New("web still registered, or db gone")
		}
		return nil
	})
}
