package main

import (
	"bytes"
	"context"
	"encoding/pem"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/schedule/v1/schedulev1connect"
)

// fakeCluster is an in-test ClusterService that records every request and
// answers with canned responses or injected errors.
type fakeCluster struct {
	clusterv1connect.UnimplementedClusterServiceHandler

	mu        sync.Mutex
	calls     []recorded
	errs      map[string][]error               // procedure -> errors for the next calls, in order
	errAlways map[string]error                 // procedure -> error for every call
	responses map[string]proto.Message         // procedure -> response (default: empty)
	header    http.Header                      // added to every response
	httpMajor []int                            // HTTP major version of every request
	auth      []string                         // Authorization header of every request
	watch     []*clusterv1.WatchStatusResponse // WatchStatus sends these, then ends
}

var _ clusterv1connect.ClusterServiceHandler = (*fakeCluster)(nil)

type recorded struct {
	procedure string
	msg       proto.Message
}

func newFakeCluster() *fakeCluster {
	return &fakeCluster{
		errs:      map[string][]error{},
		errAlways: map[string]error{},
		responses: map[string]proto.Message{},
		header:    http.Header{},
	}
}

// start serves f over h2c (and HTTP/1.1) on 127.0.0.1 and returns its URL.
func (f *fakeCluster) start(t testing.TB) string {
	t.Helper()
	return serveH2C(t, f.handler())
}

// serveH2C serves h over h2c (and HTTP/1.1) on 127.0.0.1 and returns its
// URL.
func serveH2C(t testing.TB, h http.Handler) string {
	t.Helper()
	srv := httptest.NewUnstartedServer(h)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

// handler serves f's ClusterService, recording each request's protocol
// and Authorization header.
func (f *fakeCluster) handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle(clusterv1connect.NewClusterServiceHandler(f))
	mux.Handle(schedulev1connect.NewScheduleServiceHandler(fakeSchedules{f: f}))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.httpMajor = append(f.httpMajor, r.ProtoMajor)
		f.auth = append(f.auth, r.Header.Get("Authorization"))
		f.mu.Unlock()
		mux.ServeHTTP(w, r)
	})
}

// startTLS serves f over TLS (HTTP/2 through ALPN) on 127.0.0.1 and returns
// its host:port and a file holding the PEM of its certificate, a CA file
// that trusts it.
func (f *fakeCluster) startTLS(t testing.TB) (hostPort, caFile string) {
	t.Helper()
	srv := httptest.NewUnstartedServer(f.handler())
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	caFile = filepath.Join(t.TempDir(), "ca.pem")
	block := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	if err := os.WriteFile(caFile, block, 0o600); err != nil {
		t.Fatal(err)
	}
	return strings.TrimPrefix(srv.URL, "https://"), caFile
}

func (f *fakeCluster) failNext(procedure string, errs ...error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errs[procedure] = append(f.errs[procedure], errs...)
}

func (f *fakeCluster) failAlways(procedure string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errAlways[procedure] = err
}

func (f *fakeCluster) respond(procedure string, msg proto.Message) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.responses[procedure] = msg
}

func (f *fakeCluster) recorded() []recorded {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]recorded(nil), f.calls...)
}

// handle records req and returns the canned response of its procedure.
func handle[Req, Res any](f *fakeCluster, req *connect.Request[Req]) (*connect.Response[Res], error) {
	procedure := req.Spec().Procedure
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, recorded{procedure: procedure, msg: proto.Clone(any(req.Msg).(proto.Message))})
	if errs := f.errs[procedure]; len(errs) > 0 {
		f.errs[procedure] = errs[1:]
		return nil, errs[0]
	}
	if err := f.errAlways[procedure]; err != nil {
		return nil, err
	}
	res := new(Res)
	if canned, ok := f.responses[procedure]; ok {
		res = proto.Clone(canned).(any).(*Res)
	}
	resp := connect.NewResponse(res)
	for k, v := range f.header {
		resp.Header()[k] = v
	}
	return resp, nil
}

func (f *fakeCluster) Members(_ context.Context, r *connect.Request[clusterv1.MembersRequest]) (*connect.Response[clusterv1.MembersResponse], error) {
	return handle[clusterv1.MembersRequest, clusterv1.MembersResponse](f, r)
}

func (f *fakeCluster) Peers(_ context.Context, r *connect.Request[clusterv1.PeersRequest]) (*connect.Response[clusterv1.PeersResponse], error) {
	return handle[clusterv1.PeersRequest, clusterv1.PeersResponse](f, r)
}

func (f *fakeCluster) Leader(_ context.Context, r *connect.Request[clusterv1.LeaderRequest]) (*connect.Response[clusterv1.LeaderResponse], error) {
	return handle[clusterv1.LeaderRequest, clusterv1.LeaderResponse](f, r)
}

func (f *fakeCluster) Join(_ context.Context, r *connect.Request[clusterv1.JoinRequest]) (*connect.Response[clusterv1.JoinResponse], error) {
	return handle[clusterv1.JoinRequest, clusterv1.JoinResponse](f, r)
}

func (f *fakeCluster) Leave(_ context.Context, r *connect.Request[clusterv1.LeaveRequest]) (*connect.Response[clusterv1.LeaveResponse], error) {
	return handle[clusterv1.LeaveRequest, clusterv1.LeaveResponse](f, r)
}

func (f *fakeCluster) RemovePeer(_ context.Context, r *connect.Request[clusterv1.RemovePeerRequest]) (*connect.Response[clusterv1.RemovePeerResponse], error) {
	return handle[clusterv1.RemovePeerRequest, clusterv1.RemovePeerResponse](f, r)
}

func (f *fakeCluster) TransferLeader(_ context.Context, r *connect.Request[clusterv1.TransferLeaderRequest]) (*connect.Response[clusterv1.TransferLeaderResponse], error) {
	return handle[clusterv1.TransferLeaderRequest, clusterv1.TransferLeaderResponse](f, r)
}

func (f *fakeCluster) RegisterService(_ context.Context, r *connect.Request[clusterv1.RegisterServiceRequest]) (*connect.Response[clusterv1.RegisterServiceResponse], error) {
	return handle[clusterv1.RegisterServiceRequest, clusterv1.RegisterServiceResponse](f, r)
}

func (f *fakeCluster) DeregisterService(_ context.Context, r *connect.Request[clusterv1.DeregisterServiceRequest]) (*connect.Response[clusterv1.DeregisterServiceResponse], error) {
	return handle[clusterv1.DeregisterServiceRequest, clusterv1.DeregisterServiceResponse](f, r)
}

func (f *fakeCluster) Heartbeat(_ context.Context, r *connect.Request[clusterv1.HeartbeatRequest]) (*connect.Response[clusterv1.HeartbeatResponse], error) {
	return handle[clusterv1.HeartbeatRequest, clusterv1.HeartbeatResponse](f, r)
}

func (f *fakeCluster) ListServices(_ context.Context, r *connect.Request[clusterv1.ListServicesRequest]) (*connect.Response[clusterv1.ListServicesResponse], error) {
	return handle[clusterv1.ListServicesRequest, clusterv1.ListServicesResponse](f, r)
}

func (f *fakeCluster) GetService(_ context.Context, r *connect.Request[clusterv1.GetServiceRequest]) (*connect.Response[clusterv1.GetServiceResponse], error) {
	return handle[clusterv1.GetServiceRequest, clusterv1.GetServiceResponse](f, r)
}

func (f *fakeCluster) GetConfig(_ context.Context, r *connect.Request[clusterv1.GetConfigRequest]) (*connect.Response[clusterv1.GetConfigResponse], error) {
	return handle[clusterv1.GetConfigRequest, clusterv1.GetConfigResponse](f, r)
}

func (f *fakeCluster) ListConfig(_ context.Context, r *connect.Request[clusterv1.ListConfigRequest]) (*connect.Response[clusterv1.ListConfigResponse], error) {
	return handle[clusterv1.ListConfigRequest, clusterv1.ListConfigResponse](f, r)
}

func (f *fakeCluster) SetConfig(_ context.Context, r *connect.Request[clusterv1.SetConfigRequest]) (*connect.Response[clusterv1.SetConfigResponse], error) {
	return handle[clusterv1.SetConfigRequest, clusterv1.SetConfigResponse](f, r)
}

func (f *fakeCluster) DeleteConfig(_ context.Context, r *connect.Request[clusterv1.DeleteConfigRequest]) (*connect.Response[clusterv1.DeleteConfigResponse], error) {
	return handle[clusterv1.DeleteConfigRequest, clusterv1.DeleteConfigResponse](f, r)
}

func (f *fakeCluster) ConfigHistory(_ context.Context, r *connect.Request[clusterv1.ConfigHistoryRequest]) (*connect.Response[clusterv1.ConfigHistoryResponse], error) {
	return handle[clusterv1.ConfigHistoryRequest, clusterv1.ConfigHistoryResponse](f, r)
}

func (f *fakeCluster) WhoAmI(_ context.Context, r *connect.Request[clusterv1.WhoAmIRequest]) (*connect.Response[clusterv1.WhoAmIResponse], error) {
	return handle[clusterv1.WhoAmIRequest, clusterv1.WhoAmIResponse](f, r)
}

// cliResult is the outcome of one in-process pvcli run.
type cliResult struct {
	stdout, stderr string
	err            error
}

// cliRun runs pvcli in process with the given environment and stdin.
type cliRun struct {
	env   map[string]string
	stdin string
}

func (c cliRun) run(t testing.TB, args ...string) cliResult {
	t.Helper()
	var stdout, stderr bytes.Buffer
	getenv := func(k string) string { return c.env[k] }
	err := run(t.Context(), args, getenv, strings.NewReader(c.stdin), &stdout, &stderr)
	return cliResult{stdout: stdout.String(), stderr: stderr.String(), err: err}
}

// runCLI runs pvcli in process against endpoint with an empty environment.
func runCLI(t testing.TB, endpoint string, args ...string) cliResult {
	t.Helper()
	return cliRun{}.run(t, append([]string{"--endpoint", endpoint}, args...)...)
}

// mustSucceed fails the test when r is an error.
func (r cliResult) mustSucceed(t testing.TB) cliResult {
	t.Helper()
	if r.err != nil {
		t.Fatalf("pvcli failed: %v\nstderr:\n%s", r.err, r.stderr)
	}
	if r.stderr != "" {
		t.Errorf("stderr = %q, want empty", r.stderr)
	}
	return r
}

func writeFile(t testing.TB, content string) string {
	t.Helper()
	name := t.TempDir() + "/value"
	if err := os.WriteFile(name, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return name
}

var errNoLeader = connect.NewError(connect.CodeUnavailable, errors.New("no cluster leader"))

// fakeSchedules is f's ScheduleService: its reads are recorded and
// answered as f's are; the rest answers Unimplemented.
type fakeSchedules struct {
	schedulev1connect.UnimplementedScheduleServiceHandler
	f *fakeCluster
}

func (s fakeSchedules) GetSchedule(_ context.Context, r *connect.Request[schedulev1.GetScheduleRequest]) (*connect.Response[schedulev1.GetScheduleResponse], error) {
	return handle[schedulev1.GetScheduleRequest, schedulev1.GetScheduleResponse](s.f, r)
}

func (s fakeSchedules) NextSlots(_ context.Context, r *connect.Request[schedulev1.NextSlotsRequest]) (*connect.Response[schedulev1.NextSlotsResponse], error) {
	return handle[schedulev1.NextSlotsRequest, schedulev1.NextSlotsResponse](s.f, r)
}

func (s fakeSchedules) ListSchedules(_ context.Context, r *connect.Request[schedulev1.ListSchedulesRequest]) (*connect.Response[schedulev1.ListSchedulesResponse], error) {
	return handle[schedulev1.ListSchedulesRequest, schedulev1.ListSchedulesResponse](s.f, r)
}

func (s fakeSchedules) DeleteSchedule(_ context.Context, r *connect.Request[schedulev1.DeleteScheduleRequest]) (*connect.Response[schedulev1.DeleteScheduleResponse], error) {
	return handle[schedulev1.DeleteScheduleRequest, schedulev1.DeleteScheduleResponse](s.f, r)
}

func (s fakeSchedules) ListRuns(_ context.Context, r *connect.Request[schedulev1.ListRunsRequest]) (*connect.Response[schedulev1.ListRunsResponse], error) {
	return handle[schedulev1.ListRunsRequest, schedulev1.ListRunsResponse](s.f, r)
}

// WatchStatus sends the snapshots of f.watch, then ends the stream.
func (f *fakeCluster) WatchStatus(_ context.Context, r *connect.Request[clusterv1.WatchStatusRequest], stream *connect.ServerStream[clusterv1.WatchStatusResponse]) error {
	f.mu.Lock()
	f.calls = append(f.calls, recorded{procedure: r.Spec().Procedure, msg: proto.Clone(r.Msg)})
	snaps := f.watch
	f.mu.Unlock()
	for _, m := range snaps {
		if err := stream.Send(m); err != nil {
			return err
		}
	}
	return nil
}
