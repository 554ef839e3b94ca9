package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// lowerCamel is the form of every field name of pvcli's JSON.
var lowerCamel = regexp.MustCompile(`^[a-z][a-zA-Z0-9]*$`)

// checkJSONKeys fails unless every object key of the JSON value v is
// lowerCamelCase; path names the value in the messages.
func checkJSONKeys(t *testing.T, path string, v any) {
	t.Helper()
	switch v := v.(type) {
	case map[string]any:
		for k, e := range v {
			if !lowerCamel.MatchString(k) {
				t.Errorf("%s: key %q is not lowerCamelCase", path, k)
			}
			checkJSONKeys(t, path+"."+k, e)
		}
	case []any:
		for _, e := range v {
			checkJSONKeys(t, path+"[]", e)
		}
	}
}

// checkJSONDocument fails unless out is one JSON object, indented by two
// spaces exactly as encoding/json indents it, with lowerCamelCase keys;
// it returns the object.
func checkJSONDocument(t *testing.T, what, out string) map[string]any {
	t.Helper()
	var doc map[string]any
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		t.Fatalf("%s: not a JSON object: %v\n%s", what, err, out)
	}
	var canonical bytes.Buffer
	if err := json.Indent(&canonical, []byte(strings.TrimSpace(out)), "", "  "); err != nil {
		t.Fatal(err)
	}
	if out != canonical.String()+"\n" {
		t.Errorf("%s: the output is not in the stable two-space form:\n%q\nwant\n%q", what, out, canonical.String()+"\n")
	}
	checkJSONKeys(t, what, doc)
	return doc
}

// fakeSnapshots serves SaveSnapshot with a fixed archive.
type fakeSnapshots struct {
	clusterv1connect.UnimplementedSnapshotServiceHandler
	archive []byte
}

func (f *fakeSnapshots) SaveSnapshot(_ context.Context, _ *connect.Request[clusterv1.SaveSnapshotRequest], s *connect.ServerStream[clusterv1.SaveSnapshotResponse]) error {
	for b := f.archive; len(b) > 0; {
		n := min(len(b), 1000)
		if err := s.Send(&clusterv1.SaveSnapshotResponse{Data: b[:n]}); err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// testArchive is a snapshot archive of an empty state.
func testArchive(t *testing.T) []byte {
	t.Helper()
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	var st, out bytes.Buffer
	if err := f.WriteSnapshot(&st); err != nil {
		t.Fatal(err)
	}
	meta := archive.Meta{ID: "2-11-1700000000000", Index: 11, Term: 2, ClusterID: "c-1", AgentVersion: "test", Size: int64(st.Len()),
		CreatedAt: time.Date(2026, 11, 30, 1, 2, 3, 0, time.FixedZone("CET", 3600))}
	if err := archive.Write(&out, meta, &st); err != nil {
		t.Fatal(err)
	}
	return out.Bytes()
}

// TestJSONContract runs the commands of every kind of output with -o json
// against the fake server: the ones that print API messages (protojson),
// the ones that print pvcli's own structs (snapshot save and inspect,
// version, context list) and a stream. Every document is one object in
// the stable two-space form, every key lowerCamelCase, 64-bit integers
// are strings, enums their full names, times RFC 3339 in UTC, durations
// "1.5s"; a stream prints one object per line.
func TestJSONContract(t *testing.T) {
	t.Parallel()
	fake := newFakeCluster()
	fake.header.Set("Pivirt-Served-By", "node-1")
	fake.respond(clusterv1connect.ClusterServiceMembersProcedure, &clusterv1.MembersResponse{Members: []*clusterv1.Member{
		{Name: "node-1", NodeId: "n1", GossipAddr: "10.0.0.1:7946", Status: clusterv1.MemberStatus_MEMBER_STATUS_ALIVE, Version: "1.0.0", Protocol: 1, BootstrapExpect: 3},
	}})
	fake.respond(clusterv1connect.ClusterServicePeersProcedure, &clusterv1.PeersResponse{Meta: meta, Peers: []*clusterv1.Peer{
		{NodeId: "n1", Name: "node-1", State: clusterv1.RaftState_RAFT_STATE_LEADER, Voter: true, CommitIndex: 100, AppliedIndex: 100, Term: 3},
	}})
	fake.respond(clusterv1connect.ClusterServiceListServicesProcedure, &clusterv1.ListServicesResponse{Instances: instances, Meta: meta})
	fake.respond(clusterv1connect.ClusterServiceGetConfigProcedure, &clusterv1.GetConfigResponse{Entry: configEntries[0], Meta: meta})
	snaps := &fakeSnapshots{archive: testArchive(t)}
	mux := http.NewServeMux()
	mux.Handle("/", fake.handler())
	mux.Handle(clusterv1connect.NewSnapshotServiceHandler(snaps))
	srv := serveH2C(t, mux)

	dir := t.TempDir()
	env := map[string]string{"PVCLI_CONFIG": filepath.Join(dir, "config.yaml")}
	if r := (cliRun{env: env}).run(t, "context", "set", "lab", "--endpoint", srv); r.err != nil {
		t.Fatalf("context set: %v\n%s", r.err, r.stderr)
	}
	saved := filepath.Join(dir, "snap.tar.gz")

	docs := map[string]map[string]any{}
	for _, args := range [][]string{
		{"cluster", "members"},
		{"cluster", "peers"},
		{"service", "list"},
		{"config", "get", "log.level"},
		{"version"},
		{"context", "list"},
		{"snapshot", "save", saved},
		{"snapshot", "inspect", saved},
	} {
		name := strings.Join(args[:min(2, len(args))], " ")
		r := (cliRun{env: env}).run(t, append([]string{"-o", "json"}, args...)...).mustSucceed(t)
		docs[name] = checkJSONDocument(t, name, r.stdout)
	}

	// The conventions, on a field of each kind.
	for _, c := range []struct {
		doc, path string
		want      any
	}{
		{"cluster members", "members.0.status", "MEMBER_STATUS_ALIVE"},
		{"cluster peers", "peers.0.commitIndex", "100"},
		{"cluster peers", "meta.lastContact", "0.030s"},
		{"service list", "instances.0.registeredAt", "2026-03-01T12:30:00Z"},
		{"config get", "revision", "12"},
		{"version", "client.program", "pvcli"},
		{"context list", "contexts.0.endpoints.0", srv},
		{"snapshot save", "index", "11"},
		{"snapshot save", "stateBytes", nil}, // a string: checked below
		{"snapshot save", "clusterId", "c-1"},
		{"snapshot save", "createdAt", "2026-11-30T00:02:03Z"},
		{"snapshot inspect", "term", "2"},
		{"snapshot inspect", "formatVersion", float64(1)},
		{"snapshot inspect", "agentVersion", "test"},
		{"snapshot inspect", "tables.0.records", "0"},
		{"snapshot inspect", "verification", "ok"},
	} {
		got := lookup(docs[c.doc], c.path)
		if c.want == nil {
			if _, ok := got.(string); !ok {
				t.Errorf("%s: %s = %#v, want a string", c.doc, c.path, got)
			}
			continue
		}
		if got != c.want {
			t.Errorf("%s: %s = %#v, want %#v", c.doc, c.path, got, c.want)
		}
	}

	// A stream: one object per line.
	r := (cliRun{env: env}).run(t, "-o", "json", "--timeout", "300ms", "service", "watch", "web")
	if r.err != nil {
		t.Fatalf("service watch: %v\n%s", r.err, r.stderr)
	}
	lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
	if len(lines) != 1 {
		t.Fatalf("service watch printed %d lines, want 1 (the list did not change):\n%s", len(lines), r.stdout)
	}
	var ev map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &ev); err != nil {
		t.Fatalf("service watch line %q: %v", lines[0], err)
	}
	var compact bytes.Buffer
	_ = json.Compact(&compact, []byte(lines[0]))
	if lines[0] != compact.String() {
		t.Errorf("service watch line %q, want the compact form %q", lines[0], compact.String())
	}
	checkJSONKeys(t, "service watch", ev)
	if got := lookup(ev, "instances.0.modifyIndex"); got != "9" {
		t.Errorf("service watch: instances.0.modifyIndex = %#v, want \"9\"", got)
	}
}

// lookup returns the value at a dotted path of a decoded JSON value
// (numbers index arrays).
func lookup(v any, path string) any {
	for _, p := range strings.Split(path, ".") {
		switch x := v.(type) {
		case map[string]any:
			v = x[p]
		case []any:
			i := 0
			for _, c := range p {
				i = i*10 + int(c-'0')
			}
			if i >= len(x) {
				return nil
			}
			v = x[i]
		default:
			return nil
		}
	}
	return v
}
