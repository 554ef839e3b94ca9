package agent_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// plantedSecret is a password in a URL of the configuration: the
// support bundle must not carry it.
const plantedSecret = "hunter2-planted"

// TestAgentMonitorAndDebugThroughAnotherNode: three agents logging at
// info; a monitor at debug of node3, asked of node1, sees the debug line
// of a gossip join made on node3 after the monitor started (a line the
// agents' own log never gets); the support bundle of node3, asked of
// node1, holds every file, the configuration without the planted secret.
func TestAgentMonitorAndDebugThroughAnotherNode(t *testing.T) {
	c := agenttest.NewExpect(t, 3, func(_ int, cfg *config.Config) {
		cfg.Logging.Level = "info"
		cfg.Tracing.Endpoint = "http://pivirt:" + plantedSecret + "@127.0.0.1:4318"
	})
	c.WaitPeers(60*time.Second, 3, 0)
	n1, n3 := c.Node(0), c.Node(2)
	hc := agenttest.NewHTTPClient()
	api := clusterv1connect.NewAgentServiceClient(hc, "http://"+n1.APIAddr())

	t.Run("monitor", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		stream, err := api.Monitor(ctx, connect.NewRequest(&clusterv1.MonitorRequest{Node: n3.Name, Level: "debug"}))
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close()
		if !stream.Receive() {
			t.Fatalf("no first message: %v", stream.Err())
		}
		if m := stream.Msg(); m.GetNode() != n3.Name || m.GetLine() != "" {
			t.Fatalf("first message %v, want node %s and no line", m, n3.Name)
		}
		// A gossip join on node3, after the monitor is in place: memberlist
		// logs the push/pull at debug.
		if _, err := n3.API.Join(ctx, connect.NewRequest(&clusterv1.JoinRequest{Addresses: []string{n1.GossipAddr()}})); err != nil {
			t.Fatal(err)
		}
		const want = "Initiating push/pull sync with"
		for {
			if !stream.Receive() {
				t.Fatalf("the stream ended before a line with %q: %v", want, stream.Err())
			}
			m := stream.Msg()
			if m.GetNode() != n3.Name {
				t.Fatalf("a line of %s, want %s: %v", m.GetNode(), n3.Name, m)
			}
			if strings.Contains(m.GetLine(), want) {
				if !strings.Contains(m.GetLine(), "level=DEBUG") {
					t.Errorf("line %q, want level=DEBUG", m.GetLine())
				}
				break
			}
		}
		// The agents log at info: their own log never had the line.
		if c.Logs().Contains(want) {
			t.Errorf("the agents' log (level info) has %q", want)
		}
	})

	t.Run("monitor json and a bad level", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		stream, err := api.Monitor(ctx, connect.NewRequest(&clusterv1.MonitorRequest{Level: "loud"}))
		if err == nil {
			if stream.Receive() {
				t.Fatalf("a monitor at level loud streams %v", stream.Msg())
			}
			err = stream.Err()
		}
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("level loud: %v, want InvalidArgument", err)
		}
	})

	t.Run("debug", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
		defer cancel()
		stream, err := api.Debug(ctx, connect.NewRequest(&clusterv1.DebugRequest{Node: n3.Name, Duration: durationpb.New(time.Second)}))
		if err != nil {
			t.Fatal(err)
		}
		defer stream.Close()
		files := map[string]string{}
		var cur strings.Builder
		for stream.Receive() {
			m := stream.Msg()
			if m.GetNode() != n3.Name {
				t.Errorf("a message of %s, want %s", m.GetNode(), n3.Name)
			}
			switch {
			case m.GetStarted():
				cur.Reset()
			case m.GetDone() && m.GetError() != "":
				t.Errorf("%s: %s", m.GetFile(), m.GetError())
			case m.GetDone():
				files[m.GetFile()] = cur.String()
			default:
				cur.Write(m.GetData())
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		checkBundleFiles(t, n3.Name, files)
	})
}

// checkBundleFiles checks the files of a node's support bundle.
func checkBundleFiles(t *testing.T, node string, files map[string]string) {
	t.Helper()
	for name, want := range map[string]string{
		"goroutines.txt": "github.com/hashicorp/raft.(*Raft).run",
		"heap.pprof":     "",
		"cpu.pprof":      "",
		"metrics.txt":    "pivirt_raft_term",
		"health.json":    `"node_name":"` + node + `"`,
		"ready.json":     `"checks"`,
		"members.json":   `"name": "` + node + `"`,
		"peers.json":     `"peers"`,
		"config.yaml":    "node_name: " + node,
		"log.txt":        "level=INFO",
	} {
		got, ok := files[name]
		switch {
		case !ok:
			t.Errorf("no %s in the bundle (files: %v)", name, keys(files))
		case got == "":
			t.Errorf("%s is empty", name)
		case !strings.Contains(got, want):
			t.Errorf("%s does not contain %q:\n%.2000s", name, want, got)
		}
	}
	if cfg := files["config.yaml"]; strings.Contains(cfg, plantedSecret) || !strings.Contains(cfg, "http://pivirt:REDACTED@127.0.0.1:4318") {
		t.Errorf("config.yaml, want the tracing endpoint's password redacted:\n%s", cfg)
	}
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestAccessAgentService: monitoring an agent and collecting its support
// bundle need the verbs monitor and debug on the resource agent, which
// the reference policy grants admin only (viewers get and list, they do
// not monitor).
func TestAccessAgentService(t *testing.T) {
	e := newAccessEnv(t, 1, nil)
	agentAPI := clusterv1.NewAgentServiceClient(e.conn)
	call := map[string]func(ctx context.Context) error{
		"monitor": func(ctx context.Context) error {
			s, err := agentAPI.Monitor(ctx, &clusterv1.MonitorRequest{})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		},
		"debug": func(ctx context.Context) error {
			s, err := agentAPI.Debug(ctx, &clusterv1.DebugRequest{})
			if err != nil {
				return err
			}
			_, err = s.Recv()
			return err
		},
	}
	for _, verb := range []string{"monitor", "debug"} {
		for _, role := range []string{"viewer", "operator"} {
			err := call[verb](as(e.ctx(), e.token("alice", role)))
			if status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), "may not "+verb+" agent") {
				t.Errorf("%s as %s: %v, want PermissionDenied naming the verb and resource", verb, role, err)
			}
		}
		if err := call[verb](as(e.ctx(), e.token("root", "admin"))); err != nil {
			t.Errorf("%s as admin: %v", verb, err)
		}
	}
}
