package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// fsmLeader is a one-node "Raft" that applies every command to an FSM at
// the next index: a leader for handler tests without a cluster.
type fsmLeader struct {
	mu  sync.Mutex
	f   *fsm.FSM
	idx uint64
}

func (l *fsmLeader) Apply(_ context.Context, cmd []byte) (any, uint64, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.idx++
	return l.f.Apply(&raft.Log{Index: l.idx, Term: 1, Type: raft.LogCommand, Data: cmd}), l.idx, nil
}
func (l *fsmLeader) Leader() (string, string) { return "self", "self:8300" }
func (l *fsmLeader) ReadIndex(context.Context) (uint64, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.idx, nil
}
func (l *fsmLeader) RaftStatus() RaftStatus {
	return RaftStatus{State: "Leader", LeaderID: "self", LastContact: time.Now()}
}

// unaryProcedures are the ClusterService calls a fuzzed request goes to.
var unaryProcedures = []string{
	clusterv1connect.ClusterServiceRegisterServiceProcedure,
	clusterv1connect.ClusterServiceDeregisterServiceProcedure,
	clusterv1connect.ClusterServiceHeartbeatProcedure,
	clusterv1connect.ClusterServiceListServicesProcedure,
	clusterv1connect.ClusterServiceGetServiceProcedure,
	clusterv1connect.ClusterServiceGetConfigProcedure,
	clusterv1connect.ClusterServiceListConfigProcedure,
	clusterv1connect.ClusterServiceSetConfigProcedure,
	clusterv1connect.ClusterServiceDeleteConfigProcedure,
	clusterv1connect.ClusterServiceConfigHistoryProcedure,
	clusterv1connect.ClusterServiceLeaderProcedure,
	clusterv1connect.ClusterServiceMembersProcedure,
}

// FuzzConnectRequest sends arbitrary request bodies, as protobuf and as
// JSON, to the cluster API's Connect handler (decoding by connect-go,
// then the handler's own checks, on a real FSM): every request gets an
// answer — success or a Connect error naming a client-side code — never a
// panic, a dropped connection or an internal error.
func FuzzConnectRequest(f *testing.F) {
	for i := range unaryProcedures {
		f.Add(uint8(i), true, []byte(`{"instance":{"service":"web","instanceId":"a","address":"10.0.0.1","port":80,"ttl":"30s"}}`))
		f.Add(uint8(i), true, []byte(`{"key":"log_level","value":"debug","casRevision":"0","read":{"consistency":"CONSISTENCY_CONSISTENT","waitIndex":"1","waitTime":"0.2s"}}`))
		f.Add(uint8(i), false, []byte("\x0a\x03web\x12\x01a"))
		f.Add(uint8(i), false, []byte{0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f})
	}
	f.Add(uint8(0), true, []byte(`{"instance":{"service":"web\u0000x","instanceId":"a","meta":{"k":"v"},"tags":["x"]}}`))
	f.Add(uint8(8), true, []byte(`{"key":"","casRevision":"18446744073709551615"}`))

	fs, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		f.Fatal(err)
	}
	leader := &fsmLeader{f: fs}
	cfg := DefaultClusterServiceConfig()
	cfg.NodeID, cfg.NodeName = "self", "self"
	cfg.HoldTimeout = 200 * time.Millisecond
	h, err := NewClusterService(cfg, leader, nil, &followerView{}, &followerView{}, fs)
	if err != nil {
		f.Fatal(err)
	}
	path, handler := clusterv1connect.NewClusterServiceHandler(h, connect.WithReadMaxBytes(1<<20))
	mux := http.NewServeMux()
	mux.Handle(path, handler)
	srv := httptest.NewServer(mux)
	f.Cleanup(srv.Close)
	client := srv.Client()

	f.Fuzz(func(t *testing.T, proc uint8, asJSON bool, body []byte) {
		procedure := unaryProcedures[int(proc)%len(unaryProcedures)]
		ctype := "application/proto"
		if asJSON {
			ctype = "application/json"
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+procedure, bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", ctype)
		req.Header.Set("Connect-Protocol-Version", "1")
		// Bounded: a blocking query answers within its wait time.
		req.Header.Set("Connect-Timeout-Ms", "2000")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("%s: no answer: %v", procedure, err)
		}
		defer resp.Body.Close()
		out, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("%s: answer cut: %v", procedure, err)
		}
		if resp.StatusCode == http.StatusOK {
			return
		}
		var e struct {
			Code    string `json:"code"`
			Message string `json:"message"`
		}
		if err := json.Unmarshal(out, &e); err != nil || e.Code == "" {
			t.Fatalf("%s: status %d with a body that is no Connect error: %q", procedure, resp.StatusCode, out)
		}
		if e.Code == connect.CodeInternal.String() || e.Code == connect.CodeUnknown.String() {
			t.Fatalf("%s: %s error for a client's request: %s (body %q)", procedure, e.Code, e.Message, body)
		}
	})
}
