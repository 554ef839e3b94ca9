package agent_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/agent"
	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

func gossipKey(t *testing.T) (string, string) {
	t.Helper()
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	key := base64.StdEncoding.EncodeToString(b[:])
	path := filepath.Join(t.TempDir(), "gossip.key")
	if err := os.WriteFile(path, []byte(key+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return key, path
}

func fingerprint(t *testing.T, key string) string {
	t.Helper()
	k, err := cluster.ParseGossipKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return cluster.KeyFingerprint(k)
}

// TestGossipKeyRotation runs an encrypted ring, rotates its key through
// the API (install, use, remove) without losing a member, keeps the new
// keyring across a restart, and refuses a node with the old key.
func TestGossipKeyRotation(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	key1, file1 := gossipKey(t)
	key2, file2 := gossipKey(t)
	fp1, fp2 := fingerprint(t, key1), fingerprint(t, key2)
	c := agenttest.NewExpect(t, 3, func(_ int, cfg *config.Config) { cfg.Cluster.Gossip.EncryptKeyFile = file1 })
	c.WaitLeader(60 * time.Second)
	api := c.Node(1).API

	keyring := func(op clusterv1.KeyringOp, key string) []*clusterv1.NodeKeyring {
		t.Helper()
		resp, err := api.Keyring(ctx, connect.NewRequest(&clusterv1.KeyringRequest{Op: op, Key: key}))
		if err != nil {
			t.Fatalf("keyring %v: %v", op, err)
		}
		return resp.Msg.GetNodes()
	}
	expect := func(step string, nodes []*clusterv1.NodeKeyring, primary string, keys ...string) {
		t.Helper()
		if len(nodes) != 3 {
			t.Fatalf("%s: %d members answered, want 3", step, len(nodes))
		}
		for _, n := range nodes {
			got := slices.Clone(n.GetKeys())
			slices.Sort(got)
			want := slices.Clone(keys)
			slices.Sort(want)
			if n.GetError() != "" || n.GetPrimary() != primary || !slices.Equal(got, want) {
				t.Errorf("%s: %s has primary %s, keys %v, error %q; want %s, %v", step, n.GetNode(), n.GetPrimary(), n.GetKeys(), n.GetError(), primary, keys)
			}
		}
	}
	expect("list", keyring(clusterv1.KeyringOp_KEYRING_OP_LIST, ""), fp1, fp1)
	expect("install", keyring(clusterv1.KeyringOp_KEYRING_OP_INSTALL, key2), fp1, fp1, fp2)
	// use and remove take a key or its fingerprint, as list shows it.
	expect("use", keyring(clusterv1.KeyringOp_KEYRING_OP_USE, fp2), fp2, fp1, fp2)
	expect("remove", keyring(clusterv1.KeyringOp_KEYRING_OP_REMOVE, fp1), fp2, fp2)
	for _, n := range keyring(clusterv1.KeyringOp_KEYRING_OP_USE, fp1) {
		if !strings.Contains(n.GetError(), "no installed gossip key has the fingerprint "+fp1) {
			t.Errorf("%s: use of a removed key's fingerprint: %q", n.GetNode(), n.GetError())
		}
	}
	expect("use by key", keyring(clusterv1.KeyringOp_KEYRING_OP_USE, key2), fp2, fp2)

	// The primary key cannot be removed; a bad key is refused up front.
	for _, n := range keyring(clusterv1.KeyringOp_KEYRING_OP_REMOVE, key2) {
		if n.GetError() == "" {
			t.Errorf("%s removed its primary key", n.GetNode())
		}
	}
	if _, err := api.Keyring(ctx, connect.NewRequest(&clusterv1.KeyringRequest{Op: clusterv1.KeyringOp_KEYRING_OP_INSTALL, Key: "c2hvcnQ="})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("install of a 5-byte key: %v, want InvalidArgument", err)
	}

	// Gossip goes on with the new key: every member stays alive, and a
	// node restarted with the old key file keeps the saved keyring.
	seed := c.Node(0).GossipAddr()
	c.Kill(2)
	n2 := c.Restart(2, false, seed)
	agenttest.Eventually(t, 30*time.Second, "the restarted node is alive to every member", func() error {
		for _, n := range c.Nodes() {
			alive := 0
			for _, m := range n.Gossip().Members() {
				if m.Status == cluster.StatusAlive {
					alive++
				}
			}
			if alive != 3 {
				return fmt.Errorf("%s sees %d alive members", n.Name, alive)
			}
		}
		return nil
	})
	if st, err := n2.Gossip().Keyring(); err != nil || st.Primary != fp2 {
		t.Errorf("restarted node's keyring: %+v, %v; want primary %s", st, err, fp2)
	}

	// A node with the old key cannot join, and the ring's log says why.
	stale := agenttest.Config("stale", filepath.Join(t.TempDir(), "stale"))
	stale.Cluster.Gossip.EncryptKeyFile = file1
	stale.Cluster.Join = []string{seed}
	a, err := agent.New(stale, agenttest.Options(c.Logger("stale")))
	if err != nil {
		t.Fatal(err)
	}
	sctx, scancel := context.WithTimeout(ctx, 20*time.Second)
	err = a.Start(sctx)
	scancel()
	if err == nil {
		a.Shutdown()
		t.Fatal("a node with the old gossip key joined")
	}
	if !strings.Contains(err.Error(), "decrypt") {
		t.Errorf("start with the old key: %v, want an error saying the ring could not decrypt it", err)
	}
	agenttest.Eventually(t, 10*time.Second, "a log line about the undecryptable message", func() error {
		if !c.Logs().Contains("no installed keys could decrypt the message") {
			return fmt.Errorf("not logged yet")
		}
		return nil
	})

	// A node with the new key joins.
	fresh := agenttest.Config("fresh", filepath.Join(t.TempDir(), "fresh"))
	fresh.Cluster.Gossip.EncryptKeyFile = file2
	fresh.Cluster.Join = []string{seed}
	c.Start(3, fresh)
}
