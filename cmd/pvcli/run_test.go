package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
	"gopkg.in/yaml.v3"

	"pilab.hu/pivirt-agent/cmd/internal/version"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/schedule/v1/schedulev1connect"
)

var clientIDPattern = regexp.MustCompile(`^[0-9a-f]{32}$`)

func readOpts(c clusterv1.Consistency, maxStale time.Duration) *clusterv1.ReadOptions {
	ro := &clusterv1.ReadOptions{Consistency: c}
	if maxStale > 0 {
		ro.MaxStale = durationpb.New(maxStale)
	}
	return ro
}

var (
	readDefault    = readOpts(clusterv1.Consistency_CONSISTENCY_DEFAULT, 0)
	readConsistent = readOpts(clusterv1.Consistency_CONSISTENCY_CONSISTENT, 0)
	readStale      = readOpts(clusterv1.Consistency_CONSISTENCY_STALE, 0)
)

// takeWriteOptions checks that msg carries WriteOptions of a fresh process
// (random client ID, first sequence number), returns them and clears them in
// msg so the rest can be compared.
func takeWriteOptions(t testing.TB, msg proto.Message) *clusterv1.WriteOptions {
	t.Helper()
	fd := msg.ProtoReflect().Descriptor().Fields().ByName("write")
	if fd == nil {
		t.Fatalf("%T has no write field", msg)
	}
	w, _ := msg.ProtoReflect().Get(fd).Message().Interface().(*clusterv1.WriteOptions)
	if !clientIDPattern.MatchString(w.GetClientId()) {
		t.Errorf("write.client_id = %q, want 32 hex digits", w.GetClientId())
	}
	if w.GetSequence() != 1 {
		t.Errorf("write.sequence = %d, want 1", w.GetSequence())
	}
	msg.ProtoReflect().Clear(fd)
	return w
}

func TestRequestMapping(t *testing.T) {
	t.Parallel()
	valueFile := writeFile(t, "rules:\n  - prefix: /vm\n")
	tests := []struct {
		name      string
		args      []string
		stdin     string
		procedure string
		want      proto.Message // without WriteOptions
		write     bool
	}{
		{
			name:      "cluster members",
			args:      []string{"cluster", "members"},
			procedure: clusterv1connect.ClusterServiceMembersProcedure,
			want:      &clusterv1.MembersRequest{},
		},
		{
			name:      "cluster peers default consistency",
			args:      []string{"cluster", "peers"},
			procedure: clusterv1connect.ClusterServicePeersProcedure,
			want:      &clusterv1.PeersRequest{Read: readDefault},
		},
		{
			name:      "cluster peers stale with max-stale",
			args:      []string{"--consistency", "stale", "--max-stale", "5s", "cluster", "peers"},
			procedure: clusterv1connect.ClusterServicePeersProcedure,
			want:      &clusterv1.PeersRequest{Read: readOpts(clusterv1.Consistency_CONSISTENCY_STALE, 5*time.Second)},
		},
		{
			name:      "service list blocking query",
			args:      []string{"service", "list", "--wait-index", "42", "--wait", "30s"},
			procedure: clusterv1connect.ClusterServiceListServicesProcedure,
			want: &clusterv1.ListServicesRequest{Read: &clusterv1.ReadOptions{
				Consistency: clusterv1.Consistency_CONSISTENCY_DEFAULT, WaitIndex: 42, WaitTime: durationpb.New(30 * time.Second),
			}},
		},
		{
			name:      "cluster leader consistent, flag after the command",
			args:      []string{"cluster", "leader", "--consistency=consistent"},
			procedure: clusterv1connect.ClusterServiceLeaderProcedure,
			want:      &clusterv1.LeaderRequest{Read: readConsistent},
		},
		{
			name:      "cluster join",
			args:      []string{"cluster", "join", "10.0.0.2:7946", "10.0.0.3"},
			procedure: clusterv1connect.ClusterServiceJoinProcedure,
			want:      &clusterv1.JoinRequest{Addresses: []string{"10.0.0.2:7946", "10.0.0.3"}},
		},
		{
			name:      "cluster leave",
			args:      []string{"cluster", "leave"},
			procedure: clusterv1connect.ClusterServiceLeaveProcedure,
			want:      &clusterv1.LeaveRequest{},
		},
		{
			name:      "cluster remove-peer",
			args:      []string{"cluster", "remove-peer", "node-2"},
			procedure: clusterv1connect.ClusterServiceRemovePeerProcedure,
			want:      &clusterv1.RemovePeerRequest{NodeId: "node-2"},
		},
		{
			name:      "cluster transfer-leader to any",
			args:      []string{"cluster", "transfer-leader"},
			procedure: clusterv1connect.ClusterServiceTransferLeaderProcedure,
			want:      &clusterv1.TransferLeaderRequest{},
		},
		{
			name:      "cluster transfer-leader to a node",
			args:      []string{"cluster", "transfer-leader", "node-3"},
			procedure: clusterv1connect.ClusterServiceTransferLeaderProcedure,
			want:      &clusterv1.TransferLeaderRequest{NodeId: "node-3"},
		},
		{
			name: "service register with every flag",
			args: []string{"service", "register", "web", "--address", "10.0.0.7", "--port", "8080",
				"--tag", "blue", "--tag", "v2", "--meta", "owner=ops", "--meta", "query=a=b", "--meta", "empty=",
				"--ttl", "10s", "--id", "web-1", "--node", "node-1"},
			procedure: clusterv1connect.ClusterServiceRegisterServiceProcedure,
			want: &clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
				Service:    "web",
				InstanceId: "web-1",
				Node:       "node-1",
				Address:    "10.0.0.7",
				Port:       8080,
				Tags:       []string{"blue", "v2"},
				Meta:       map[string]string{"owner": "ops", "query": "a=b", "empty": ""},
				Ttl:        durationpb.New(10 * time.Second),
			}},
			write: true,
		},
		{
			name:      "service deregister",
			args:      []string{"service", "deregister", "web", "web-1"},
			procedure: clusterv1connect.ClusterServiceDeregisterServiceProcedure,
			want:      &clusterv1.DeregisterServiceRequest{Service: "web", InstanceId: "web-1"},
			write:     true,
		},
		{
			name:      "service heartbeat",
			args:      []string{"service", "heartbeat", "web", "web-1"},
			procedure: clusterv1connect.ClusterServiceHeartbeatProcedure,
			want:      &clusterv1.HeartbeatRequest{Service: "web", InstanceId: "web-1"},
			write:     true,
		},
		{
			name:      "service list all",
			args:      []string{"service", "list"},
			procedure: clusterv1connect.ClusterServiceListServicesProcedure,
			want:      &clusterv1.ListServicesRequest{Read: readDefault},
		},
		{
			name:      "service list one, consistent",
			args:      []string{"service", "list", "web", "--consistency", "consistent"},
			procedure: clusterv1connect.ClusterServiceListServicesProcedure,
			want:      &clusterv1.ListServicesRequest{Service: "web", Read: readConsistent},
		},
		{
			name:      "service get all instances",
			args:      []string{"service", "get", "web"},
			procedure: clusterv1connect.ClusterServiceGetServiceProcedure,
			want:      &clusterv1.GetServiceRequest{Service: "web", Read: readDefault},
		},
		{
			name:      "service get one instance, stale",
			args:      []string{"--consistency", "stale", "service", "get", "web", "web-1"},
			procedure: clusterv1connect.ClusterServiceGetServiceProcedure,
			want:      &clusterv1.GetServiceRequest{Service: "web", InstanceId: "web-1", Read: readStale},
		},
		{
			name:      "config get",
			args:      []string{"config", "get", "routing.rules"},
			procedure: clusterv1connect.ClusterServiceGetConfigProcedure,
			want:      &clusterv1.GetConfigRequest{Key: "routing.rules", Read: readDefault},
		},
		{
			name:      "config list",
			args:      []string{"config", "list", "--consistency", "stale"},
			procedure: clusterv1connect.ClusterServiceListConfigProcedure,
			want:      &clusterv1.ListConfigRequest{Read: readStale},
		},
		{
			name:      "config history",
			args:      []string{"config", "history", "log.level"},
			procedure: clusterv1connect.ClusterServiceConfigHistoryProcedure,
			want:      &clusterv1.ConfigHistoryRequest{Key: "log.level", Read: readDefault},
		},
		{
			name:      "config set unconditional has no cas_revision",
			args:      []string{"config", "set", "log.level", "debug"},
			procedure: clusterv1connect.ClusterServiceSetConfigProcedure,
			want:      &clusterv1.SetConfigRequest{Key: "log.level", Value: "debug"},
			write:     true,
		},
		{
			name:      "config set --cas 0 is create-only",
			args:      []string{"config", "set", "log.level", "debug", "--cas", "0"},
			procedure: clusterv1connect.ClusterServiceSetConfigProcedure,
			want:      &clusterv1.SetConfigRequest{Key: "log.level", Value: "debug", CasRevision: proto.Uint64(0)},
			write:     true,
		},
		{
			name:      "config set --cas revision",
			args:      []string{"config", "set", "log.level", "info", "--cas=42"},
			procedure: clusterv1connect.ClusterServiceSetConfigProcedure,
			want:      &clusterv1.SetConfigRequest{Key: "log.level", Value: "info", CasRevision: proto.Uint64(42)},
			write:     true,
		},
		{
			name:      "config set empty value",
			args:      []string{"config", "set", "banner", ""},
			procedure: clusterv1connect.ClusterServiceSetConfigProcedure,
			want:      &clusterv1.SetConfigRequest{Key: "banner"},
			write:     true,
		},
		{
			name:      "config set --file",
			args:      []string{"config", "set", "routing.rules", "--file", valueFile},
			procedure: clusterv1connect.ClusterServiceSetConfigProcedure,
			want:      &clusterv1.SetConfigRequest{Key: "routing.rules", Value: "rules:\n  - prefix: /vm\n"},
			write:     true,
		},
		{
			name:      "config set --file - reads stdin",
			args:      []string{"config", "set", "routing.rules", "-f", "-"},
			stdin:     "from: stdin\n",
			procedure: clusterv1connect.ClusterServiceSetConfigProcedure,
			want:      &clusterv1.SetConfigRequest{Key: "routing.rules", Value: "from: stdin\n"},
			write:     true,
		},
		{
			name:      "config delete unconditional",
			args:      []string{"config", "delete", "log.level"},
			procedure: clusterv1connect.ClusterServiceDeleteConfigProcedure,
			want:      &clusterv1.DeleteConfigRequest{Key: "log.level"},
			write:     true,
		},
		{
			name:      "schedule list without read flags: the schedule API's consistent default",
			args:      []string{"schedule", "list", "--vm", "vm-1"},
			procedure: schedulev1connect.ScheduleServiceListSchedulesProcedure,
			want:      &schedulev1.ListSchedulesRequest{VmId: "vm-1"},
		},
		{
			name:      "schedule list blocking query",
			args:      []string{"schedule", "list", "--wait-index", "42", "--wait", "30s"},
			procedure: schedulev1connect.ScheduleServiceListSchedulesProcedure,
			want: &schedulev1.ListSchedulesRequest{Read: &clusterv1.ReadOptions{
				Consistency: clusterv1.Consistency_CONSISTENCY_DEFAULT, WaitIndex: 42, WaitTime: durationpb.New(30 * time.Second),
			}},
		},
		{
			name:      "schedule next of a schedule",
			args:      []string{"schedule", "next", "s1", "--count", "3"},
			procedure: schedulev1connect.ScheduleServiceNextSlotsProcedure,
			want:      &schedulev1.NextSlotsRequest{Id: "s1", Count: 3},
		},
		{
			name:      "schedule next of an expression, before a create",
			args:      []string{"schedule", "next", "--cron", "0 7 * * 1-5", "--time-zone", "Europe/Budapest"},
			procedure: schedulev1connect.ScheduleServiceNextSlotsProcedure,
			want:      &schedulev1.NextSlotsRequest{Cron: "0 7 * * 1-5", TimeZone: "Europe/Budapest", Count: 5},
		},
		{
			name:      "schedule runs stale blocking query",
			args:      []string{"--consistency", "stale", "--max-stale", "5s", "schedule", "runs", "s1", "--wait-index", "7"},
			procedure: schedulev1connect.ScheduleServiceListRunsProcedure,
			want: &schedulev1.ListRunsRequest{ScheduleId: "s1", Read: &clusterv1.ReadOptions{
				Consistency: clusterv1.Consistency_CONSISTENCY_STALE, MaxStale: durationpb.New(5 * time.Second), WaitIndex: 7,
			}},
		},
		{
			name:      "schedule runs without read flags",
			args:      []string{"schedule", "runs", "s1"},
			procedure: schedulev1connect.ScheduleServiceListRunsProcedure,
			want:      &schedulev1.ListRunsRequest{ScheduleId: "s1"},
		},
		{
			name:      "schedule get consistent",
			args:      []string{"schedule", "get", "s1", "--consistency", "consistent"},
			procedure: schedulev1connect.ScheduleServiceGetScheduleProcedure,
			want:      &schedulev1.GetScheduleRequest{Id: "s1", Read: readConsistent},
		},
		{
			name:      "config delete --cas",
			args:      []string{"config", "delete", "log.level", "--cas", "7"},
			procedure: clusterv1connect.ClusterServiceDeleteConfigProcedure,
			want:      &clusterv1.DeleteConfigRequest{Key: "log.level", CasRevision: proto.Uint64(7)},
			write:     true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			fake := newFakeCluster()
			url := fake.start(t)
			r := cliRun{stdin: tt.stdin}.run(t, append([]string{"--endpoint", url}, tt.args...)...)
			r.mustSucceed(t)

			calls := fake.recorded()
			if len(calls) > 1 && calls[0].procedure == clusterv1connect.ClusterServicePeersProcedure {
				calls = calls[1:] // a node name or ID looked up first
			}
			for len(calls) > 1 && (calls[len(calls)-1].procedure == clusterv1connect.ClusterServiceMembersProcedure ||
				calls[len(calls)-1].procedure == clusterv1connect.ClusterServiceConfigStatusProcedure) {
				calls = calls[:len(calls)-1] // node names for a table, or a setting's state, looked up after
			}
			if len(calls) != 1 {
				t.Fatalf("got %d calls, want 1: %v", len(calls), calls)
			}
			if calls[0].procedure != tt.procedure {
				t.Errorf("procedure = %s, want %s", calls[0].procedure, tt.procedure)
			}
			got := calls[0].msg
			if tt.write {
				takeWriteOptions(t, got)
			}
			if diff := cmp.Diff(tt.want, got, protocmp.Transform()); diff != "" {
				t.Errorf("request mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

func TestServiceRegisterDefaultID(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	url := fake.start(t)
	runCLI(t, url, "service", "register", "web", "--address", "10.0.0.7", "--port", "80").mustSucceed(t)

	calls := fake.recorded()
	if len(calls) != 1 {
		t.Fatalf("got %d calls, want 1", len(calls))
	}
	// Without --id the agent names the instance SERVICE-NODE, so that
	// registering again replaces it.
	if id := calls[0].msg.(*clusterv1.RegisterServiceRequest).GetInstance().GetInstanceId(); id != "" {
		t.Errorf("instance_id = %q, want empty (the agent's default)", id)
	}
}

func TestWriteOptionsPerProcess(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	url := fake.start(t)
	runCLI(t, url, "config", "set", "k", "v1").mustSucceed(t)
	runCLI(t, url, "config", "set", "k", "v2").mustSucceed(t)
	calls := fake.recorded()
	if len(calls) != 2 {
		t.Fatalf("got %d calls, want 2", len(calls))
	}
	w1 := takeWriteOptions(t, calls[0].msg)
	w2 := takeWriteOptions(t, calls[1].msg)
	if w1.GetClientId() == w2.GetClientId() {
		t.Errorf("two processes share client ID %q", w1.GetClientId())
	}

	// Within one process the sequence counts up from 1.
	a := &app{clientID: newClientID()}
	for want := uint64(1); want <= 3; want++ {
		w := a.writeOptions()
		if w.GetSequence() != want || w.GetClientId() != a.clientID {
			t.Errorf("writeOptions() = %v, want client %s sequence %d", w, a.clientID, want)
		}
	}
}

func TestRetryOnUnavailable(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		args      []string
		procedure string
		write     bool
	}{
		{
			name:      "config set",
			args:      []string{"config", "set", "k", "v", "--cas", "3"},
			procedure: clusterv1connect.ClusterServiceSetConfigProcedure,
			write:     true,
		},
		{
			name:      "service register",
			args:      []string{"service", "register", "web", "--address", "a", "--port", "1"},
			procedure: clusterv1connect.ClusterServiceRegisterServiceProcedure,
			write:     true,
		},
		{
			name:      "cluster peers",
			args:      []string{"cluster", "peers", "--consistency", "consistent"},
			procedure: clusterv1connect.ClusterServicePeersProcedure,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			fake := newFakeCluster()
			url := fake.start(t)
			fake.failNext(tt.procedure, errNoLeader, errNoLeader)

			r := runCLI(t, url, append([]string{"--verbose"}, tt.args...)...)
			if r.err != nil {
				t.Fatalf("pvcli failed: %v\nstderr:\n%s", r.err, r.stderr)
			}
			if got := strings.Count(r.stderr, "no cluster leader); retrying in"); got != 2 {
				t.Errorf("stderr reports %d retries, want 2:\n%s", got, r.stderr)
			}

			calls := fake.recorded()
			if len(calls) != 3 {
				t.Fatalf("got %d calls, want 3 (two failures, one success)", len(calls))
			}
			for i, c := range calls[1:] {
				if !proto.Equal(c.msg, calls[0].msg) {
					t.Errorf("retry %d sent %v, want the first request %v unchanged", i+1, c.msg, calls[0].msg)
				}
			}
			if tt.write {
				w := takeWriteOptions(t, calls[0].msg)
				if w.GetClientId() == "" {
					t.Error("write without client ID")
				}
			}
		})
	}
}

func TestRetryGivesUpAtDeadline(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	url := fake.start(t)
	fake.failAlways(clusterv1connect.ClusterServiceSetConfigProcedure, errNoLeader)

	r := runCLI(t, url, "--timeout", "700ms", "config", "set", "k", "v")
	if got, want := exitCode(r.err), 1; got != want {
		t.Errorf("exit code = %d, want %d (err %v)", got, want, r.err)
	}
	if want := "Error: unavailable: no cluster leader\n"; r.stderr != want {
		t.Errorf("stderr = %q, want %q", r.stderr, want)
	}
	calls := fake.recorded()
	if len(calls) < 2 {
		t.Fatalf("got %d calls, want at least 2", len(calls))
	}
	for _, c := range calls[1:] {
		if !proto.Equal(c.msg, calls[0].msg) {
			t.Errorf("retry sent %v, want %v", c.msg, calls[0].msg)
		}
	}
}

func TestConnectErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		err        error
		wantStderr string
	}{
		{
			name:       "failed precondition",
			err:        connect.NewError(connect.CodeFailedPrecondition, errors.New("revision mismatch: current 8, want 7")),
			wantStderr: "Error: failed_precondition: revision mismatch: current 8, want 7\n",
		},
		{
			name:       "not found",
			err:        connect.NewError(connect.CodeNotFound, errors.New(`config key "x" not found`)),
			wantStderr: "Error: not_found: config key \"x\" not found\n",
		},
		{
			name: "permission denied",
			err:  connect.NewError(connect.CodePermissionDenied, errors.New("rbac: config:write denied")),
			wantStderr: "Error: permission_denied: rbac: config:write denied\n" +
				"The agent's RBAC policy does not allow this call for your identity (the message names the resource and verb); ask for a role that does.\n",
		},
		{
			name: "rate limited",
			err: func() error {
				ce := connect.NewError(connect.CodeResourceExhausted, errors.New("rate limit exceeded for alice on *"))
				d, _ := connect.NewErrorDetail(&errdetails.RetryInfo{RetryDelay: durationpb.New(1500 * time.Millisecond)})
				ce.AddDetail(d)
				return ce
			}(),
			wantStderr: "Error: resource_exhausted: rate limit exceeded for alice on *\n" +
				"The agent's rate limit for your identity was reached; retry in 1.5s.\n",
		},
		{
			name: "unauthenticated",
			err:  connect.NewError(connect.CodeUnauthenticated, errors.New("no credentials")),
			wantStderr: "Error: unauthenticated: no credentials\n" +
				"The agent did not accept the credentials: send a bearer token (--token or PVCLI_TOKEN) or a client certificate of the PiTrust chain (--cert-file/--key-file, PVCLI_CERT_FILE/PVCLI_KEY_FILE, or ~/.config/pvcli/client.crt and ~/.config/pvcli/client.key).\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			fake := newFakeCluster()
			url := fake.start(t)
			fake.failAlways(clusterv1connect.ClusterServiceDeleteConfigProcedure, tt.err)

			r := runCLI(t, url, "config", "delete", "x", "--cas", "7")
			if got, want := exitCode(r.err), 1; got != want {
				t.Errorf("exit code = %d, want %d", got, want)
			}
			if r.stderr != tt.wantStderr {
				t.Errorf("stderr = %q, want %q", r.stderr, tt.wantStderr)
			}
			if r.stdout != "" {
				t.Errorf("stdout = %q, want empty", r.stdout)
			}
			if n := len(fake.recorded()); n != 1 {
				t.Errorf("got %d calls, want 1 (no retry)", n)
			}
		})
	}
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	reg := []string{"service", "register", "web", "--address", "10.0.0.1"}
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string // substring of the error message
	}{
		{name: "unknown command", args: []string{"clutser"}, wantErr: `unknown command "clutser" for "pvcli" (did you mean "cluster"?)`},
		{name: "unknown subcommand", args: []string{"cluster", "membrs"}, wantErr: `unknown command "membrs" for "pvcli cluster" (did you mean "members"?)`},
		{name: "unknown flag", args: []string{"cluster", "members", "--bogus"}, wantErr: "unknown flag: --bogus"},
		{name: "unknown output", args: []string{"--output", "xml", "cluster", "members"}, wantErr: `invalid argument "xml" for "-o, --output" flag: must be one of table|json|yaml`},
		{name: "unknown output shorthand", args: []string{"cluster", "peers", "-o", "csv"}, wantErr: "must be one of table|json|yaml"},
		{name: "unknown consistency", args: []string{"--consistency", "strong", "cluster", "peers"}, wantErr: `invalid argument "strong" for "--consistency" flag: must be one of default|consistent|stale`},
		{name: "wait without wait-index", args: []string{"--wait", "5s", "service", "list"}, wantErr: "--wait applies only with --wait-index"},
		{name: "negative wait", args: []string{"--wait-index", "3", "--wait", "-1s", "service", "list"}, wantErr: "invalid --wait -1s"},
		{name: "max-stale without stale", args: []string{"--max-stale", "5s", "cluster", "peers"}, wantErr: "--max-stale applies only to --consistency stale"},
		{name: "negative max-stale", args: []string{"--consistency", "stale", "--max-stale", "-1s", "cluster", "peers"}, wantErr: "invalid --max-stale -1s"},
		{name: "bad max-stale", args: []string{"--max-stale", "soon", "cluster", "peers"}, wantErr: `invalid argument "soon" for "--max-stale" flag`},
		{name: "bad timeout", args: []string{"--timeout", "5", "cluster", "members"}, wantErr: `invalid argument "5" for "--timeout" flag`},
		{name: "zero timeout", args: []string{"--timeout", "0s", "cluster", "members"}, wantErr: "invalid --timeout 0s: must be a positive duration"},
		{name: "bad endpoint scheme", args: []string{"--endpoint", "ftp://h:1", "cluster", "members"}, wantErr: `invalid --endpoint "ftp://h:1": unsupported scheme "ftp"`},
		{name: "endpoint without port", args: []string{"--endpoint", "node1", "cluster", "members"}, wantErr: `invalid --endpoint "node1"`},
		{name: "bad endpoint from env", env: map[string]string{envEndpoint: "http://"}, args: []string{"cluster", "members"}, wantErr: `invalid PVCLI_ENDPOINT "http://": missing host`},
		{name: "members takes no argument", args: []string{"cluster", "members", "x"}, wantErr: `unexpected argument "x" (usage: pvcli cluster members`},
		{name: "join without address", args: []string{"cluster", "join"}, wantErr: "missing argument ADDR"},
		{name: "remove-peer without ID", args: []string{"cluster", "remove-peer"}, wantErr: "missing argument NODE (usage: pvcli cluster remove-peer NODE"},
		{name: "transfer-leader two IDs", args: []string{"cluster", "transfer-leader", "a", "b"}, wantErr: `unexpected argument "b"`},
		{name: "register without name", args: []string{"service", "register", "--address", "a", "--port", "1"}, wantErr: "missing argument NAME"},
		{name: "register without address", args: []string{"service", "register", "web", "--port", "80"}, wantErr: "missing --address"},
		{name: "register without port", args: reg, wantErr: "missing --port"},
		{name: "register port zero", args: append(reg[:5:5], "--port", "0"), wantErr: "invalid --port 0: must be 1-65535"},
		{name: "register port too large", args: append(reg[:5:5], "--port", "65536"), wantErr: "invalid --port 65536: must be 1-65535"},
		{name: "register port not a number", args: append(reg[:5:5], "--port", "http"), wantErr: `invalid argument "http" for "--port" flag`},
		{name: "register meta without =", args: append(reg[:5:5], "--port", "80", "--meta", "owner"), wantErr: `invalid --meta "owner": want KEY=VALUE`},
		{name: "register meta without key", args: append(reg[:5:5], "--port", "80", "--meta", "=x"), wantErr: `invalid --meta "=x": want KEY=VALUE`},
		{name: "register meta twice", args: append(reg[:5:5], "--port", "80", "--meta", "a=1", "--meta", "a=2"), wantErr: `key "a" given twice`},
		{name: "register bad ttl", args: append(reg[:5:5], "--port", "80", "--ttl", "10"), wantErr: `invalid argument "10" for "--ttl" flag`},
		{name: "register negative ttl", args: append(reg[:5:5], "--port", "80", "--ttl", "-5s"), wantErr: "invalid --ttl -5s: must not be negative"},
		{name: "register empty tag", args: append(reg[:5:5], "--port", "80", "--tag", ""), wantErr: "invalid --tag: must not be empty"},
		{name: "deregister without ID", args: []string{"service", "deregister", "web"}, wantErr: "missing argument ID"},
		{name: "heartbeat empty ID", args: []string{"service", "heartbeat", "web", ""}, wantErr: "argument ID must not be empty"},
		{name: "get without name", args: []string{"service", "get"}, wantErr: "missing argument NAME"},
		{name: "list two names", args: []string{"service", "list", "a", "b"}, wantErr: `unexpected argument "b"`},
		{name: "config get without key", args: []string{"config", "get"}, wantErr: "missing argument KEY"},
		{name: "config get empty key", args: []string{"config", "get", " "}, wantErr: "argument KEY must not be empty"},
		{name: "config set without value", args: []string{"config", "set", "k"}, wantErr: "missing argument VALUE (or --file FILE)"},
		{name: "config set value and file", args: []string{"config", "set", "k", "v", "--file", "f"}, wantErr: "give either VALUE or --file, not both"},
		{name: "config set missing file", args: []string{"config", "set", "k", "--file", "/nonexistent/pvcli"}, wantErr: "read --file: open /nonexistent/pvcli"},
		{name: "config set empty file name", args: []string{"config", "set", "k", "--file="}, wantErr: "invalid --file: must name a file"},
		{name: "config set three args", args: []string{"config", "set", "k", "v", "w"}, wantErr: `unexpected argument "w"`},
		{name: "config set negative cas", args: []string{"config", "set", "k", "v", "--cas", "-1"}, wantErr: `invalid argument "-1" for "--cas" flag`},
		{name: "config delete without key", args: []string{"config", "delete"}, wantErr: "missing argument KEY"},
		{name: "config history without key", args: []string{"config", "history"}, wantErr: "missing argument KEY"},
	}
	fake := newFakeCluster()
	url := fake.start(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			args := tt.args
			if tt.env == nil && !slices.Contains(args, "--endpoint") {
				args = append([]string{"--endpoint", url}, args...)
			}
			r := cliRun{env: tt.env}.run(t, args...)
			if r.err == nil {
				t.Fatalf("pvcli %q succeeded, want a usage error containing %q", tt.args, tt.wantErr)
			}
			if !strings.Contains(r.err.Error(), tt.wantErr) {
				t.Errorf("error = %q, want it to contain %q", r.err, tt.wantErr)
			}
			if got, want := exitCode(r.err), 2; got != want {
				t.Errorf("exit code = %d, want %d (usage)", got, want)
			}
			lines := strings.Split(strings.TrimSuffix(r.stderr, "\n"), "\n")
			if len(lines) != 2 || lines[0] != "Error: "+r.err.Error() || !strings.HasSuffix(lines[1], "--help' for usage.") {
				t.Errorf("stderr = %q, want \"Error: <msg>\" and a --help hint", r.stderr)
			}
			if r.stdout != "" {
				t.Errorf("stdout = %q, want empty", r.stdout)
			}
		})
	}
	t.Cleanup(func() {
		if calls := fake.recorded(); len(calls) != 0 {
			t.Errorf("bad input reached the server: %v", calls)
		}
	})
}

// Fixtures for the output tests.
var (
	ts        = timestamppb.New(time.Date(2026, 3, 1, 12, 30, 0, 0, time.UTC))
	instances = []*clusterv1.ServiceInstance{
		{
			Service: "web", InstanceId: "web-1", Node: "node-1", Address: "10.0.0.7", Port: 8080,
			Tags: []string{"blue", "v2"}, Meta: map[string]string{"owner": "ops", "version": "1.0"},
			Health: clusterv1.Health_HEALTH_PASSING, Ttl: durationpb.New(10 * time.Second),
			RegisteredAt: ts, LastHeartbeat: ts, CreateIndex: 5, ModifyIndex: 9,
		},
		{
			Service: "web", InstanceId: "web-2", Address: "10.0.0.8", Port: 8081,
			Health: clusterv1.Health_HEALTH_CRITICAL, CreateIndex: 6, ModifyIndex: 6,
			Check: &clusterv1.HealthCheck{Tcp: "10.0.0.8:8081"}, Output: "TCP connect 10.0.0.8:8081: connection refused",
		},
	}
	configEntries = []*clusterv1.ConfigEntry{
		{Key: "log.level", Value: "true", Revision: 12, CreateIndex: 3, UpdatedAt: ts},
		{Key: "routing.rules", Value: "rules:\n  - prefix: /pivirt.vm.v1\n    cluster: pivirtd\n", Revision: 8, CreateIndex: 8, UpdatedAt: ts},
	}
	meta = &clusterv1.QueryMeta{Index: 42, LastContact: durationpb.New(30 * time.Millisecond), KnownLeader: true, ServedBy: "node-2"}
)

func TestOutputFormats(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		args      []string
		procedure string
		response  proto.Message
		printed   proto.Message // what json/yaml print; the response when nil
		table     [][]string    // expected table rows (fields split on runs of spaces)
	}{
		{
			name:      "cluster members",
			args:      []string{"cluster", "members"},
			procedure: clusterv1connect.ClusterServiceMembersProcedure,
			response: &clusterv1.MembersResponse{Members: []*clusterv1.Member{
				{Name: "agent-1", NodeId: "n1", GossipAddr: "10.0.0.1:7946", Status: clusterv1.MemberStatus_MEMBER_STATUS_ALIVE,
					Role: "server", RaftAddr: "10.0.0.1:9000", ApiAddr: "10.0.0.1:8443", Version: "0.1.0", BootstrapExpect: 3},
				{Name: "agent-2", NodeId: "n2", GossipAddr: "10.0.0.2:7946", Status: clusterv1.MemberStatus_MEMBER_STATUS_FAILED},
			}},
			table: [][]string{
				{"NAME", "NODE-ID", "GOSSIP-ADDR", "STATUS", "ROLE", "RAFT-ADDR", "API-ADDR", "VERSION"},
				{"agent-1", "n1", "10.0.0.1:7946", "alive", "server", "10.0.0.1:9000", "10.0.0.1:8443", "0.1.0"},
				{"agent-2", "n2", "10.0.0.2:7946", "failed", "-", "-", "-", "-"},
			},
		},
		{
			name:      "cluster peers",
			args:      []string{"cluster", "peers"},
			procedure: clusterv1connect.ClusterServicePeersProcedure,
			response: &clusterv1.PeersResponse{Meta: meta, Peers: []*clusterv1.Peer{
				{NodeId: "n1", Name: "agent-1", Address: "10.0.0.1:9000", State: clusterv1.RaftState_RAFT_STATE_LEADER, Voter: true,
					CommitIndex: 100, AppliedIndex: 100, LastIndex: 100, Term: 3},
				{NodeId: "n2", Name: "agent-2", Address: "10.0.0.2:9000", State: clusterv1.RaftState_RAFT_STATE_FOLLOWER,
					CommitIndex: 98, AppliedIndex: 97, LastIndex: 98, Trailing: 2, Term: 3, LastContact: durationpb.New(12345 * time.Microsecond)},
			}},
			table: [][]string{
				{"NODE", "ID", "ADDRESS", "STATE", "VOTER", "COMMIT", "APPLIED", "TRAILING", "LAST-CONTACT"},
				{"agent-1", "n1", "10.0.0.1:9000", "leader", "true", "100", "100", "0", "-"},
				{"agent-2", "n2", "10.0.0.2:9000", "follower", "false", "98", "97", "2", "12ms"},
			},
		},
		{
			name:      "cluster leader",
			args:      []string{"cluster", "leader"},
			procedure: clusterv1connect.ClusterServiceLeaderProcedure,
			response:  &clusterv1.LeaderResponse{NodeId: "n1", Name: "agent-1", RaftAddr: "10.0.0.1:9000", ApiAddr: "10.0.0.1:8443", Term: 3, Meta: meta},
			table: [][]string{
				{"NAME", "NODE-ID", "RAFT-ADDR", "API-ADDR", "TERM"},
				{"agent-1", "n1", "10.0.0.1:9000", "10.0.0.1:8443", "3"},
			},
		},
		{
			name:      "service list",
			args:      []string{"service", "list"},
			procedure: clusterv1connect.ClusterServiceListServicesProcedure,
			response:  &clusterv1.ListServicesResponse{Instances: instances, Meta: meta},
			table: [][]string{
				{"SERVICE", "ID", "ADDRESS", "PORT", "HEALTH", "CHECK", "TAGS", "NODE", "TTL", "INDEX"},
				{"web", "web-1", "10.0.0.7", "8080", "passing", "-", "blue,v2", "node-1", "10s", "9"},
				{"web", "web-2", "10.0.0.8", "8081", "critical", "tcp://10.0.0.8:8081", "-", "-", "-", "6"},
			},
		},
		{
			name:      "service register",
			args:      []string{"service", "register", "web", "--address", "10.0.0.7", "--port", "8080"},
			procedure: clusterv1connect.ClusterServiceRegisterServiceProcedure,
			response:  &clusterv1.RegisterServiceResponse{Instance: instances[0], Index: 9},
			table: [][]string{
				{"SERVICE", "ID", "ADDRESS", "PORT", "HEALTH", "CHECK", "TAGS", "NODE", "TTL", "INDEX"},
				{"web", "web-1", "10.0.0.7", "8080", "passing", "-", "blue,v2", "node-1", "10s", "9"},
			},
		},
		{
			name:      "config list",
			args:      []string{"config", "list"},
			procedure: clusterv1connect.ClusterServiceListConfigProcedure,
			response:  &clusterv1.ListConfigResponse{Entries: configEntries, Meta: meta},
			table: [][]string{
				{"KEY", "REVISION", "UPDATED", "VALUE"},
				{"log.level", "12", "2026-03-01T12:30:00Z", "true"},
				{"routing.rules", "8", "2026-03-01T12:30:00Z", "rules:", "-", "prefix:", "/pivirt.vm.v1", "cluste..."},
			},
		},
		{
			name:      "config history",
			args:      []string{"config", "history", "log.level"},
			procedure: clusterv1connect.ClusterServiceConfigHistoryProcedure,
			response:  &clusterv1.ConfigHistoryResponse{Entries: configEntries[:1], Meta: meta},
			table: [][]string{
				{"REVISION", "UPDATED", "VALUE"},
				{"12", "2026-03-01T12:30:00Z", "true"},
			},
		},
		{
			name:      "config get prints the entry",
			args:      []string{"config", "get", "routing.rules"},
			procedure: clusterv1connect.ClusterServiceGetConfigProcedure,
			response:  &clusterv1.GetConfigResponse{Entry: configEntries[1], Meta: meta},
			printed:   configEntries[1],
		},
		{
			name:      "config set",
			args:      []string{"config", "set", "log.level", "true"},
			procedure: clusterv1connect.ClusterServiceSetConfigProcedure,
			response:  &clusterv1.SetConfigResponse{Entry: configEntries[0]},
			table:     [][]string{{"Set", "log.level", "(revision", "12)"}},
		},
		{
			name:      "cluster leave prints an empty response",
			args:      []string{"cluster", "leave"},
			procedure: clusterv1connect.ClusterServiceLeaveProcedure,
			response:  &clusterv1.LeaveResponse{},
			table:     [][]string{{"The", "node", "is", "leaving", "the", "cluster"}},
		},
	}
	for _, tt := range tests {
		for _, format := range outputFormats {
			t.Run(tt.name+"/"+format, func(t *testing.T) {
				t.Parallel()
				fake := newFakeCluster()
				url := fake.start(t)
				fake.respond(tt.procedure, tt.response)
				r := runCLI(t, url, append([]string{"--output", format}, tt.args...)...).mustSucceed(t)

				want := tt.printed
				if want == nil {
					want = tt.response
				}
				switch format {
				case "json":
					got := want.ProtoReflect().New().Interface()
					if err := protojson.Unmarshal([]byte(r.stdout), got); err != nil {
						t.Fatalf("output does not parse as %T JSON: %v\n%s", got, err, r.stdout)
					}
					if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
						t.Errorf("JSON output mismatch (-want +got):\n%s\noutput:\n%s", diff, r.stdout)
					}
				case "yaml":
					got := want.ProtoReflect().New().Interface()
					if err := unmarshalYAML([]byte(r.stdout), got); err != nil {
						t.Fatalf("output does not parse as %T YAML: %v\n%s", got, err, r.stdout)
					}
					if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
						t.Errorf("YAML output mismatch (-want +got):\n%s\noutput:\n%s", diff, r.stdout)
					}
				case "table":
					if tt.table == nil {
						return
					}
					var got [][]string
					for line := range strings.Lines(r.stdout) {
						got = append(got, strings.Fields(line))
					}
					if diff := cmp.Diff(tt.table, got); diff != "" {
						t.Errorf("table mismatch (-want +got):\n%s\noutput:\n%s", diff, r.stdout)
					}
				}
			})
		}
	}
}

// unmarshalYAML parses YAML printed by pvcli back into msg through its JSON form.
func unmarshalYAML(b []byte, msg proto.Message) error {
	var v any
	if err := yaml.Unmarshal(b, &v); err != nil {
		return err
	}
	js, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return protojson.Unmarshal(js, msg)
}

func TestYAMLKeepsFieldOrderAndStringTypes(t *testing.T) {
	t.Parallel()
	b, err := marshalYAML(&clusterv1.ConfigEntry{Key: "k", Value: "2026-03-01", Revision: 12, UpdatedAt: ts})
	if err != nil {
		t.Fatal(err)
	}
	want := "key: k\nvalue: \"2026-03-01\"\nrevision: \"12\"\nupdatedAt: \"2026-03-01T12:30:00Z\"\n"
	if string(b) != want {
		t.Errorf("marshalYAML = %q, want %q", b, want)
	}
}

func TestConfigGetTablePrintsRawValue(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		value string
		want  string
	}{
		{name: "multi-line document", value: "a: 1\nb: [x, y]\n", want: "a: 1\nb: [x, y]\n"},
		{name: "newline added", value: "debug", want: "debug\n"},
		{name: "empty", value: "", want: ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			fake := newFakeCluster()
			url := fake.start(t)
			fake.respond(clusterv1connect.ClusterServiceGetConfigProcedure,
				&clusterv1.GetConfigResponse{Entry: &clusterv1.ConfigEntry{Key: "k", Value: tt.value, Revision: 3}})
			r := runCLI(t, url, "config", "get", "k").mustSucceed(t)
			if r.stdout != tt.want {
				t.Errorf("stdout = %q, want %q", r.stdout, tt.want)
			}
		})
	}
}

func TestVerboseMetadataHeaders(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	url := fake.start(t)
	fake.header.Set("Pivirt-Index", "42")
	fake.header.Set("Pivirt-Known-Leader", "true")
	fake.header.Set("Pivirt-Last-Contact", "30ms")
	fake.header.Set("Pivirt-Served-By", "node-2")
	fake.header.Set("Pivirt-Other", "not printed")

	tests := []struct {
		name       string
		args       []string
		wantStderr string
	}{
		{name: "quiet by default", args: []string{"--consistency", "stale", "cluster", "peers"}},
		{
			name:       "verbose",
			args:       []string{"--verbose", "--consistency", "stale", "cluster", "peers"},
			wantStderr: "Pivirt-Index: 42\nPivirt-Known-Leader: true\nPivirt-Last-Contact: 30ms\nPivirt-Served-By: node-2\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := runCLI(t, url, tt.args...)
			if r.err != nil {
				t.Fatal(r.err)
			}
			if r.stderr != tt.wantStderr {
				t.Errorf("stderr = %q, want %q", r.stderr, tt.wantStderr)
			}
			if !strings.HasPrefix(r.stdout, "NODE ") {
				t.Errorf("stdout = %q, want the peers table", r.stdout)
			}
		})
	}
}

func TestEndpoint(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	url := fake.start(t)
	hostPort := strings.TrimPrefix(url, "http://")

	tests := []struct {
		name string
		env  map[string]string
		args []string
	}{
		{name: "flag with scheme", args: []string{"--endpoint", url}},
		{name: "flag host:port means http", args: []string{"--endpoint", hostPort}},
		{name: "env", env: map[string]string{envEndpoint: url}},
		{name: "env host:port", env: map[string]string{envEndpoint: hostPort}},
		{name: "flag wins over env", env: map[string]string{envEndpoint: "ftp://wrong"}, args: []string{"--endpoint", url}},
		{name: "trailing slash", args: []string{"--endpoint", url + "/"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := cliRun{env: tt.env}.run(t, append(tt.args, "cluster", "members")...)
			r.mustSucceed(t)
		})
	}
	t.Cleanup(func() {
		fake.mu.Lock()
		defer fake.mu.Unlock()
		if len(fake.httpMajor) == 0 {
			t.Error("no request reached the server")
		}
		for _, v := range fake.httpMajor {
			if v != 2 {
				t.Errorf("request over HTTP/%d, want HTTP/2 (h2c)", v)
			}
		}
	})
}

func TestParseEndpoint(t *testing.T) {
	t.Parallel()
	tests := []struct {
		in, want string // want "" = error
	}{
		{in: "http://127.0.0.1:8443", want: "http://127.0.0.1:8443"},
		{in: "https://agent-1.pilab.hu:8443/", want: "https://agent-1.pilab.hu:8443"},
		{in: "https://agent-1.pilab.hu", want: "https://agent-1.pilab.hu"},
		{in: "10.0.0.1:8443", want: "http://10.0.0.1:8443"},
		{in: "[::1]:8443", want: "http://[::1]:8443"},
		{in: "http://[::1]:8443/prefix", want: "http://[::1]:8443/prefix"},
		{in: "node1"},
		{in: ":8443"},
		{in: "node1:"},
		{in: "grpc://node1:8443"},
		{in: "http://"},
		{in: "http://user:pw@node1:8443"},
		{in: "http://node1:8443?x=1"},
		{in: "http://node1:port"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			t.Parallel()
			u, err := parseEndpoint(tt.in, "http")
			switch {
			case tt.want == "" && err == nil:
				t.Errorf("parseEndpoint(%q) = %s, want an error", tt.in, u)
			case tt.want != "" && err != nil:
				t.Errorf("parseEndpoint(%q) error: %v", tt.in, err)
			case tt.want != "" && u.String() != tt.want:
				t.Errorf("parseEndpoint(%q) = %s, want %s", tt.in, u, tt.want)
			}
		})
	}
}

func TestHelp(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		args []string
		want []string
	}{
		{name: "root --help", args: []string{"--help"}, want: []string{"cluster", "service", "config", "--endpoint", "--consistency"}},
		{name: "no arguments", args: nil, want: []string{"cluster", "service", "config"}},
		{name: "group without subcommand", args: []string{"cluster"}, want: []string{"members", "peers", "leader", "join", "leave", "remove-peer", "transfer-leader"}},
		{name: "service help", args: []string{"help", "service"}, want: []string{"register", "deregister", "list", "get", "heartbeat"}},
		{name: "config help", args: []string{"config", "--help"}, want: []string{"get", "list", "set", "delete", "history"}},
		{name: "register help", args: []string{"service", "register", "-h"}, want: []string{"--address", "--port", "--tag", "--meta", "--ttl", "--id", "--node"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var stdout, stderr bytes.Buffer
			if err := Run(t.Context(), tt.args, &stdout, &stderr); err != nil {
				t.Fatalf("Run(%q) = %v, want nil", tt.args, err)
			}
			for _, w := range tt.want {
				if !strings.Contains(stdout.String(), w) {
					t.Errorf("help does not mention %q:\n%s", w, stdout.String())
				}
			}
			if stderr.Len() != 0 {
				t.Errorf("stderr = %q, want empty", stderr.String())
			}
		})
	}
}

func TestExitCode(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		err  error
		want int
	}{
		{name: "success", err: nil, want: 0},
		{name: "usage", err: usagef("missing --port"), want: 2},
		{name: "wrapped usage", err: fmt.Errorf("cmd: %w", usagef("x")), want: 2},
		{name: "rpc", err: connect.NewError(connect.CodeUnavailable, errors.New("no leader")), want: 1},
		{name: "other", err: errors.New("boom"), want: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if got := exitCode(tt.err); got != tt.want {
				t.Errorf("exitCode(%v) = %d, want %d", tt.err, got, tt.want)
			}
		})
	}
}

func TestTLSFailureIsNotRetried(t *testing.T) {
	t.Parallel()
	tlsSrv := httptest.NewUnstartedServer(http.NotFoundHandler())
	tlsSrv.EnableHTTP2 = true
	tlsSrv.Config.ErrorLog = log.New(io.Discard, "", 0)
	tlsSrv.StartTLS()
	t.Cleanup(tlsSrv.Close)
	plain := newFakeCluster().start(t)

	tests := []struct {
		name     string
		endpoint string
		want     string
	}{
		{
			// The test server's certificate is not in the system roots.
			name:     "untrusted certificate",
			endpoint: tlsSrv.URL,
			want:     "certificate",
		},
		{
			name:     "TLS to a plain-text port",
			endpoint: strings.Replace(plain, "http://", "https://", 1),
			want:     "server gave HTTP response to HTTPS client",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := runCLI(t, tt.endpoint, "--verbose", "cluster", "members")
			if got, want := exitCode(r.err), 1; got != want {
				t.Errorf("exit code = %d, want %d (err %v)", got, want, r.err)
			}
			if !strings.HasPrefix(r.stderr, "Error: unavailable: ") || !strings.Contains(r.stderr, tt.want) {
				t.Errorf("stderr = %q, want an unavailable error containing %q", r.stderr, tt.want)
			}
			if strings.Contains(r.stderr, "retrying") {
				t.Errorf("a TLS failure was retried:\n%s", r.stderr)
			}
		})
	}
}

func TestPermanentTransportError(t *testing.T) {
	for _, tt := range []struct {
		err  error
		want bool
	}{
		{connect.NewError(connect.CodeUnavailable, errors.New("remote error: tls: certificate required")), true},
		{connect.NewError(connect.CodeUnavailable, errors.New("remote error: tls: bad certificate")), true},
		{connect.NewError(connect.CodeUnavailable, errors.New("http: server gave HTTP response to HTTPS client")), true},
		{connect.NewError(connect.CodeUnavailable, errors.New("dial tcp 127.0.0.1:8443: connect: connection refused")), false},
		{connect.NewError(connect.CodeUnavailable, errors.New("no cluster leader")), false},
	} {
		if got := permanentTransportError(tt.err); got != tt.want {
			t.Errorf("permanentTransportError(%v) = %v, want %v", tt.err, got, tt.want)
		}
	}
}

// TestSnapshotFilesMustBeRegular: snapshot inspect and restore refuse a
// FIFO (whose open would block) and a link to a device (which never ends)
// at once, naming the file.
func TestSnapshotFilesMustBeRegular(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo.tar.gz")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	zero := filepath.Join(dir, "zero.tar.gz")
	if err := os.Symlink("/dev/zero", zero); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"snapshot", "inspect", fifo}, {"snapshot", "inspect", zero},
		{"snapshot", "restore", fifo}, {"snapshot", "restore", zero},
	} {
		done := make(chan cliResult, 1)
		go func() { done <- cliRun{}.run(t, append([]string{"--endpoint", "http://127.0.0.1:1"}, args...)...) }()
		select {
		case r := <-done:
			if r.err == nil || !strings.Contains(r.err.Error()+r.stdout, "not a regular file") {
				t.Errorf("pvcli %s: %v %q, want an error saying it is not a regular file", strings.Join(args, " "), r.err, r.stdout)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("pvcli %s did not return", strings.Join(args, " "))
		}
	}
}

func TestVersion(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	fake.header.Set("Pivirt-Served-By", "node2")
	fake.respond(clusterv1connect.ClusterServiceMembersProcedure, &clusterv1.MembersResponse{Members: []*clusterv1.Member{
		{Name: "node1", Version: "0.9.0", Protocol: 1, Status: clusterv1.MemberStatus_MEMBER_STATUS_ALIVE},
		{Name: "node2", Version: "1.0.0", Protocol: 1, Status: clusterv1.MemberStatus_MEMBER_STATUS_ALIVE},
		{Name: "node3", Version: "1.0.0", Protocol: 1, Status: clusterv1.MemberStatus_MEMBER_STATUS_ALIVE},
	}})
	url := fake.start(t)

	r := runCLI(t, url, "version").mustSucceed(t)
	for _, want := range []string{"pvcli " + version.Version + " (", "agent pivirt-agent 1.0.0 (protocol 1) on node2 at " + url, "other members run 0.9.0 (protocol 1): [node1]"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("version output lacks %q:\n%s", want, r.stdout)
		}
	}
	var out struct {
		Client struct{ Program, Version string }
		Agent  struct {
			Node, Version string
			Protocol      int
		}
	}
	if err := json.Unmarshal([]byte(runCLI(t, url, "version", "-o", "json").mustSucceed(t).stdout), &out); err != nil {
		t.Fatal(err)
	}
	if out.Client.Program != "pvcli" || out.Agent.Node != "node2" || out.Agent.Version != "1.0.0" || out.Agent.Protocol != 1 {
		t.Errorf("version -o json = %+v", out)
	}

	// --version and --client need no agent; an agent that cannot be
	// reached is an error after the client's own line.
	closed := "http://127.0.0.1:" + strconv.Itoa(closedPort(t))
	if r := runCLI(t, closed, "--version").mustSucceed(t); !strings.HasPrefix(r.stdout, "pvcli "+version.Version+" (") {
		t.Errorf("--version = %q", r.stdout)
	}
	if r := runCLI(t, closed, "version", "--client").mustSucceed(t); strings.Contains(r.stdout, "agent") {
		t.Errorf("version --client = %q, want the client only", r.stdout)
	}
	r = runCLI(t, closed, "version")
	if r.err == nil || !strings.HasPrefix(r.stdout, "pvcli ") || !strings.Contains(r.stderr, "no agent version") {
		t.Errorf("version against a closed port: err %v, stdout %q, stderr %q", r.err, r.stdout, r.stderr)
	}
}

// closedPort is a port on 127.0.0.1 that nothing listens on.
func closedPort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return port
}

// TestPeerByName: remove-peer and transfer-leader take a node's name as
// well as its ID; an unknown one names the peers.
func TestPeerByName(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	fake.respond(clusterv1connect.ClusterServicePeersProcedure, &clusterv1.PeersResponse{Peers: []*clusterv1.Peer{
		{NodeId: "id-1", Name: "node1"}, {NodeId: "id-2", Name: "node2"},
	}})
	url := fake.start(t)
	runCLI(t, url, "cluster", "remove-peer", "node2").mustSucceed(t)
	runCLI(t, url, "cluster", "transfer-leader", "id-1").mustSucceed(t)
	var got []string
	for _, c := range fake.recorded() {
		switch m := c.msg.(type) {
		case *clusterv1.RemovePeerRequest:
			got = append(got, "remove "+m.GetNodeId())
		case *clusterv1.TransferLeaderRequest:
			got = append(got, "transfer "+m.GetNodeId())
		}
	}
	if strings.Join(got, ",") != "remove id-2,transfer id-1" {
		t.Errorf("requests %v, want remove id-2 and transfer id-1", got)
	}
	r := runCLI(t, url, "cluster", "remove-peer", "node9")
	if r.err == nil || !strings.Contains(r.stderr, `"node9" is neither the node ID nor the name of a Raft peer; the peers are: node1 (id-1), node2 (id-2)`) {
		t.Errorf("unknown peer: %v, %q", r.err, r.stderr)
	}
}

// TestServiceRegisterFile: --file reads a YAML or JSON definition, check
// included, into the request; a bad file is refused naming it and the
// field, and flags that the file decides do not go with it.
func TestServiceRegisterFile(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	url := fake.start(t)
	dir := t.TempDir()
	web := filepath.Join(dir, "web.yaml")
	if err := os.WriteFile(web, []byte(`name: web
address: 10.0.0.7
port: 8080
tags: [v2]
deregister_critical_after: 10m
check:
  http: http://10.0.0.7:8080/health
  interval: 5s
  failures_before_critical: 3
`), 0o600); err != nil {
		t.Fatal(err)
	}
	runCLI(t, url, "service", "register", "--file", web, "--node", "node-2").mustSucceed(t)
	calls := fake.recorded()
	if len(calls) != 1 {
		t.Fatalf("got %d calls, want 1", len(calls))
	}
	got := calls[0].msg.(*clusterv1.RegisterServiceRequest).GetInstance()
	want := &clusterv1.ServiceInstance{
		Service: "web", Node: "node-2", Address: "10.0.0.7", Port: 8080, Tags: []string{"v2"},
		DeregisterCriticalAfter: durationpb.New(10 * time.Minute),
		Check:                   &clusterv1.HealthCheck{Http: "http://10.0.0.7:8080/health", Interval: durationpb.New(5 * time.Second), FailuresBeforeCritical: 3},
	}
	if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
		t.Errorf("instance (-want +got):\n%s", diff)
	}

	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte(`{"name": "db", "address": "10.0.0.8", "port": 5432, "check": {"tcp": "10.0.0.8:5432", "interval": "often"}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args    []string
		wantErr string
	}{
		{[]string{"service", "register", "--file", bad}, "bad.json"},
		{[]string{"service", "register", "--file", bad}, "duration"},
		{[]string{"service", "register", "--file", web, "--port", "80"}, "--port and --file do not go together"},
		{[]string{"service", "register", "web", "--file", web}, "NAME and --file do not go together"},
		{[]string{"service", "register", "--file", filepath.Join(dir, "none.yaml")}, "none.yaml"},
	} {
		r := runCLI(t, url, tc.args...)
		if r.err == nil || !strings.Contains(r.stderr+r.err.Error(), tc.wantErr) {
			t.Errorf("%v: err %v, stderr %q; want an error saying %q", tc.args, r.err, r.stderr, tc.wantErr)
		}
	}
	if n := len(fake.recorded()); n != 1 {
		t.Errorf("%d calls after the refused ones, want 1", n)
	}
}

// TestScheduleRunsAndDelete: schedule runs names the leader that ran each
// slot by its node name (the node ID when the members cannot be read);
// schedule delete says what it deleted.
func TestScheduleRunsAndDelete(t *testing.T) {
	fake := newFakeCluster()
	url := fake.start(t)
	fake.respond(schedulev1connect.ScheduleServiceListRunsProcedure, &schedulev1.ListRunsResponse{Runs: []*schedulev1.Run{
		{ScheduleId: "s1", Outcome: schedulev1.RunOutcome_RUN_OUTCOME_OK, Node: "0b5c6a1e-uuid", Host: "node-2", Attempts: 1},
	}})
	fake.respond(clusterv1connect.ClusterServiceMembersProcedure, &clusterv1.MembersResponse{Members: []*clusterv1.Member{{Name: "node-1", NodeId: "0b5c6a1e-uuid"}}})
	r := cliRun{}.run(t, "--endpoint", url, "schedule", "runs", "s1")
	r.mustSucceed(t)
	if !strings.Contains(r.stdout, "node-1") || strings.Contains(r.stdout, "0b5c6a1e-uuid") {
		t.Errorf("schedule runs:\n%s\nwant the leader named node-1, not its ID", r.stdout)
	}
	fake.failAlways(clusterv1connect.ClusterServiceMembersProcedure, connect.NewError(connect.CodePermissionDenied, errors.New("no")))
	r = cliRun{}.run(t, "--endpoint", url, "schedule", "runs", "s1")
	r.mustSucceed(t)
	if !strings.Contains(r.stdout, "0b5c6a1e-uuid") {
		t.Errorf("schedule runs without the members:\n%s\nwant the leader's node ID", r.stdout)
	}
	r = cliRun{}.run(t, "--endpoint", url, "schedule", "delete", "s1")
	r.mustSucceed(t)
	if r.stdout != "Deleted schedule s1 and its runs\n" {
		t.Errorf("schedule delete printed %q", r.stdout)
	}
}
