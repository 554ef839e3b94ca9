package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// syncBuffer is a bytes.Buffer a running pvcli writes while the test
// reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// readBundle returns the files of a tar.gz by name.
func readBundle(t *testing.T, path string) map[string]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	files := map[string]string{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		files[h.Name] = string(b)
	}
	return files
}

// TestMonitorAndDebugWithRealAgents runs pvcli monitor and pvcli debug
// against three in-process agents that log at info: the monitor of node2
// at debug, asked of node1, prints node2's debug line of a gossip join as
// a JSON object and ends with Ctrl-C without an error; the bundle holds
// every node's files and an index, with the planted secret redacted; with
// node3 down, the bundle has node3's error and the others' files.
func TestMonitorAndDebugWithRealAgents(t *testing.T) {
	const secret = "hunter2-planted"
	c := agenttest.NewExpect(t, 3, func(_ int, cfg *config.Config) {
		cfg.Logging.Level = "info"
		cfg.Tracing.Endpoint = "http://pivirt:" + secret + "@127.0.0.1:4318"
	})
	c.WaitPeers(60*time.Second, 3, 0)
	n1, n2 := c.Node(0), c.Node(1)
	endpoint := "http://" + n1.APIAddr()

	t.Run("monitor", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		var stdout, stderr syncBuffer
		done := make(chan error, 1)
		go func() {
			done <- run(ctx, []string{"--endpoint", endpoint, "monitor", "--node", n2.Name, "--level", "debug", "-o", "json"},
				func(string) string { return "" }, strings.NewReader(""), &stdout, &stderr)
		}()
		const want = "Initiating push/pull sync with"
		agenttest.Eventually(t, 20*time.Second, "node2's debug line of a join in the monitor", func() error {
			jctx, jcancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer jcancel()
			if _, err := n2.API.Join(jctx, connect.NewRequest(&clusterv1.JoinRequest{Addresses: []string{n1.GossipAddr()}})); err != nil {
				return err
			}
			for range 10 {
				if strings.Contains(stdout.String(), want) {
					return nil
				}
				select {
				case err := <-done:
					return fmt.Errorf("pvcli monitor ended: %v; stderr %q", err, stderr.String())
				case <-time.After(100 * time.Millisecond):
				}
			}
			return fmt.Errorf("no %q yet; stdout %q", want, stdout.String())
		})
		cancel() // Ctrl-C
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("pvcli monitor after Ctrl-C: %v, want exit status 0", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("pvcli monitor did not end after Ctrl-C")
		}
		found := false
		for _, line := range strings.Split(strings.TrimSpace(stdout.String()), "\n") {
			var rec map[string]any
			if err := json.Unmarshal([]byte(line), &rec); err != nil {
				t.Errorf("line %q is not a JSON object: %v", line, err)
				continue
			}
			if msg, _ := rec["msg"].(string); strings.Contains(msg, want) {
				found = true
				if rec["level"] != "DEBUG" {
					t.Errorf("line %q, want level DEBUG", line)
				}
			}
		}
		if !found {
			t.Errorf("no JSON line with %q", want)
		}
	})

	t.Run("debug", func(t *testing.T) {
		out := filepath.Join(t.TempDir(), "bundle.tar.gz")
		r := runCLI(t, endpoint, "debug", "--duration", "1s", "--output", out)
		if r.err != nil {
			t.Fatalf("pvcli debug: %v\nstderr:\n%s", r.err, r.stderr)
		}
		for _, want := range []string{"node1: cpu.pprof (1s)...", "node3: config.yaml done", "wrote " + out + ": 3 nodes, 0 with failures"} {
			if !strings.Contains(r.stderr, want) {
				t.Errorf("progress lacks %q:\n%s", want, r.stderr)
			}
		}
		files := readBundle(t, out)
		var index bundleIndex
		if err := json.Unmarshal([]byte(files["bundle/index.json"]), &index); err != nil {
			t.Fatalf("index.json: %v (files %v)", err, slices.Sorted(mapKeys(files)))
		}
		if len(index.Nodes) != 3 {
			t.Fatalf("index: %+v, want 3 nodes", index)
		}
		want := []string{"config.yaml", "cpu.pprof", "goroutines.txt", "health.json", "heap.pprof", "log.txt", "members.json", "metrics.txt", "peers.json", "ready.json"}
		for _, ni := range index.Nodes {
			if ni.Error != "" || len(ni.Failed) > 0 || !slices.Equal(slices.Sorted(slices.Values(ni.Files)), want) {
				t.Errorf("index of %s: %+v, want the files %v", ni.Node, ni, want)
			}
			for _, f := range want {
				if files["bundle/"+ni.Node+"/"+f] == "" {
					t.Errorf("bundle/%s/%s missing or empty", ni.Node, f)
				}
			}
			dir := "bundle/" + ni.Node + "/"
			if !strings.Contains(files[dir+"goroutines.txt"], "github.com/hashicorp/raft.(*Raft).run") {
				t.Errorf("%sgoroutines.txt lacks Raft's run loop", dir)
			}
			if !strings.Contains(files[dir+"metrics.txt"], "pivirt_raft_term") {
				t.Errorf("%smetrics.txt lacks pivirt_raft_term", dir)
			}
			if cfg := files[dir+"config.yaml"]; strings.Contains(cfg, secret) || !strings.Contains(cfg, "pivirt:REDACTED@") || !strings.Contains(cfg, "node_name: "+ni.Node) {
				t.Errorf("%sconfig.yaml, want %s's configuration with the password redacted:\n%s", dir, ni.Node, cfg)
			}
		}
	})

	t.Run("a node down", func(t *testing.T) {
		c.Kill(2)
		out := filepath.Join(t.TempDir(), "partial.tar.gz")
		r := runCLI(t, endpoint, "debug", "--duration", "0", "--output", out)
		if r.err != nil {
			t.Fatalf("pvcli debug: %v\nstderr:\n%s", r.err, r.stderr)
		}
		if !strings.Contains(r.stderr, "node3: failed: ") || !strings.Contains(r.stderr, "1 with failures") {
			t.Errorf("progress, want node3's failure:\n%s", r.stderr)
		}
		files := readBundle(t, out)
		var index bundleIndex
		if err := json.Unmarshal([]byte(files["partial/index.json"]), &index); err != nil {
			t.Fatalf("index.json: %v (files %v)", err, slices.Sorted(mapKeys(files)))
		}
		for _, ni := range index.Nodes {
			switch ni.Node {
			case "node3":
				if ni.Error == "" || files["partial/node3/error.txt"] == "" {
					t.Errorf("node3 down: %+v, want its error (and error.txt)", ni)
				}
			default:
				if ni.Error != "" || files["partial/"+ni.Node+"/metrics.txt"] == "" {
					t.Errorf("%s: %+v, want its files", ni.Node, ni)
				}
				if _, ok := files["partial/"+ni.Node+"/cpu.pprof"]; ok {
					t.Errorf("%s: a CPU profile with --duration 0", ni.Node)
				}
			}
		}
		if len(index.Nodes) != 3 {
			t.Errorf("index: %+v, want 3 nodes", index)
		}
	})
}

func mapKeys(m map[string]string) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// TestConfigSetWaitsUntilInForce: pvcli config set of a cluster setting
// answers once every node has applied it, so that the next command through
// any node finds it in force; a kv/ key does not wait; delete waits too.
func TestConfigSetWaitsUntilInForce(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	c.WaitPeers(60*time.Second, 3, 0)
	n1, n3 := c.Node(0), c.Node(2)
	cli := func(endpoint string, args ...string) string {
		t.Helper()
		var stdout, stderr bytes.Buffer
		if err := run(t.Context(), append([]string{"--endpoint", "http://" + endpoint}, args...),
			func(string) string { return "" }, strings.NewReader(""), &stdout, &stderr); err != nil {
			t.Fatalf("pvcli %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
		}
		return stdout.String()
	}
	out := cli(n1.APIAddr(), "config", "set", "logging.level", "debug")
	if !strings.Contains(out, "In force on every node (3)") {
		t.Fatalf("config set printed %q, want it in force on every node", out)
	}
	// At once, through another node: every node reports the revision.
	var status clusterv1.ConfigStatusResponse
	if err := protojson.Unmarshal([]byte(cli(n3.APIAddr(), "-o", "json", "config", "status")), &status); err != nil {
		t.Fatal(err)
	}
	for _, n := range status.GetNodes() {
		if !slices.Contains(n.GetKeys(), "logging.level") {
			t.Errorf("node %s right after config set: settings in force %v, want logging.level", n.GetNode(), n.GetKeys())
		}
	}
	if out := cli(n1.APIAddr(), "config", "set", "kv/x", "1"); strings.Contains(out, "In force") {
		t.Errorf("a kv/ key: %q, want no word of settings in force", out)
	}
	if out := cli(n1.APIAddr(), "config", "delete", "logging.level"); !strings.Contains(out, "In force on every node (3)") {
		t.Errorf("config delete printed %q, want it in force on every node", out)
	}
}
