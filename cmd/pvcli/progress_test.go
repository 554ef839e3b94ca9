package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/storage/v1/storagev1connect"
)

// runOnTerminal runs pvcli in process with env, telling it that stderr is
// a terminal when terminal is set (stdout never is).
func runOnTerminal(t testing.TB, terminal bool, env map[string]string, args ...string) cliResult {
	t.Helper()
	var stdout, stderr bytes.Buffer
	a := &app{
		getenv:   func(k string) string { return env[k] },
		stdin:    strings.NewReader(""),
		stdout:   &stdout,
		stderr:   &stderr,
		terminal: func(w io.Writer) bool { return terminal && w == &stderr },
		clientID: newClientID(),
	}
	err := a.run(t.Context(), args)
	return cliResult{stdout: stdout.String(), stderr: stderr.String(), err: err}
}

// progressLine matches the final state of a progress bar: the bytes moved
// and a rate, e.g. "(1.2 MB, 3.4 MB/s)", "(786/786 kB, 40 MB/s)" or
// "(12 kB/1.1 MB, 40 MB/s)".
var progressLine = regexp.MustCompile(`\(([0-9.]+ ?[kMGT]?B?/)?[0-9.]+ ?[kMGT]?B, [0-9.]+ ?[kMGT]?B/s\)`)

// checkProgress fails unless stderr shows the progress of what, with
// bytes and a rate, and ends its line.
func checkProgress(t *testing.T, r cliResult, what string) {
	t.Helper()
	if r.err != nil {
		t.Fatalf("pvcli failed: %v\nstderr:\n%s", r.err, r.stderr)
	}
	if !strings.Contains(r.stderr, what) || !progressLine.MatchString(r.stderr) || !strings.HasSuffix(r.stderr, "\n") {
		t.Errorf("stderr on a terminal = %q, want the progress of %q with bytes and a rate, ending its line", r.stderr, what)
	}
	if strings.Contains(r.stdout, what) {
		t.Errorf("stdout = %q, want no progress there", r.stdout)
	}
}

// TestProgressSnapshot runs snapshot save and restore against a real
// agent: on a terminal stderr shows the bytes moved and the rate; when
// stderr is not a terminal, with --no-progress or with TERM=dumb, nothing
// at all, and stdout is the same either way.
func TestProgressSnapshot(t *testing.T) {
	c := agenttest.NewExpect(t, 1, nil)
	c.WaitLeader(60 * time.Second)
	endpoint := "http://" + c.Node(0).APIAddr()
	dir := t.TempDir()
	file := filepath.Join(dir, "snap.tar.gz")

	saved := runOnTerminal(t, true, nil, "--endpoint", endpoint, "snapshot", "save", file)
	checkProgress(t, saved, "saving snapshot")
	if !strings.HasPrefix(saved.stdout, "Saved snapshot ") {
		t.Errorf("stdout = %q, want the summary alone", saved.stdout)
	}
	restored := runOnTerminal(t, true, nil, "--endpoint", endpoint, "snapshot", "restore", "--dry-run", file)
	checkProgress(t, restored, "uploading snapshot")

	for _, tc := range []struct {
		name     string
		terminal bool
		env      map[string]string
		flags    []string
	}{
		{"not a terminal", false, nil, nil},
		{"--no-progress", true, nil, []string{"--no-progress"}},
		{"TERM=dumb", true, map[string]string{"TERM": "dumb"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, args := range [][]string{
				{"snapshot", "save", filepath.Join(dir, strings.ReplaceAll(tc.name, "/", "")+".tar.gz")},
				{"snapshot", "restore", "--dry-run", file},
			} {
				r := runOnTerminal(t, tc.terminal, tc.env, append(append([]string{"--endpoint", endpoint}, tc.flags...), args...)...)
				if r.err != nil || r.stderr != "" {
					t.Errorf("pvcli %s: %v, stderr %q; want success and nothing on stderr", strings.Join(args, " "), r.err, r.stderr)
				}
			}
		})
	}
}

// fakeStorage is a StorageService whose UploadVolume counts the bytes.
type fakeStorage struct {
	storagev1connect.UnimplementedStorageServiceHandler
}

func (fakeStorage) UploadVolume(_ context.Context, s *connect.ClientStream[storagev1.UploadVolumeRequest]) (*connect.Response[storagev1.UploadVolumeResponse], error) {
	var id string
	var n uint64
	for s.Receive() {
		if s.Msg().GetId() != "" {
			id = s.Msg().GetId()
		}
		n += uint64(len(s.Msg().GetChunk()))
	}
	if err := s.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&storagev1.UploadVolumeResponse{Volume: &storagev1.Volume{Id: id, WrittenBytes: n}}), nil
}

// TestProgressVolumeUpload: volume upload of a file shows its progress on
// a terminal's stderr, and nothing when stderr is not a terminal.
func TestProgressVolumeUpload(t *testing.T) {
	t.Parallel()
	mux := http.NewServeMux()
	mux.Handle(storagev1connect.NewStorageServiceHandler(fakeStorage{}))
	url := serveH2C(t, mux)

	image := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(image, bytes.Repeat([]byte{0xab}, 3*uploadChunk+17), 0o600); err != nil {
		t.Fatal(err)
	}
	r := runOnTerminal(t, true, nil, "--endpoint", url, "volume", "upload", "vol-1", image)
	checkProgress(t, r, "uploading vol-1")
	if !strings.Contains(r.stderr, "100%") {
		t.Errorf("stderr = %q, want the bar at 100%%", r.stderr)
	}
	if r := runOnTerminal(t, false, nil, "--endpoint", url, "volume", "upload", "vol-1", image); r.err != nil || r.stderr != "" {
		t.Errorf("volume upload, stderr not a terminal: %v, stderr %q; want success and nothing on stderr", r.err, r.stderr)
	}
}
