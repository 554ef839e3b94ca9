package e2e_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/version"
	"pilab.hu/pivirt-agent/identity"
)

// toolkitExamples runs the operator's conveniences against the real
// cluster: the quick start's exports with several endpoints of which the
// first is down (no scheme: https:// because a CA file is given), a
// context of the configuration file, and pvcli version.
func (c *cluster) toolkitExamples(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := ln.Addr().String()
	ln.Close()
	n1, n2, n3 := c.nodes[0], c.nodes[1], c.nodes[2]

	env := append(c.operatorEnv(), "PVCLI_ENDPOINT="+down+","+n1.api)
	if r := c.pvcliEnv(t, env, "cluster", "members"); r.code != 0 {
		t.Errorf("%s\nwant the members through %s after %s refused", r, n1.api, down)
	}
	r := c.pvcliEnv(t, env, "version")
	if r.code != 0 || !strings.HasPrefix(r.stdout, "pvcli ") || !strings.Contains(r.stdout, "agent pivirt-agent ") ||
		!strings.Contains(r.stdout, fmt.Sprintf("(protocol %d) on ", version.Protocol)+n1.name+" at https://"+n1.api) {
		t.Errorf("%s\nwant the client's and %s's versions", r, n1.name)
	}

	// A context saved once, then used with no flag or variable.
	cfg := []string{"PVCLI_CONFIG=" + filepath.Join(t.TempDir(), "config.yaml")}
	set := c.pvcliEnv(t, cfg, "context", "set", "e2e", "--endpoint", n2.api+","+n3.api,
		"--ca-file", filepath.Join(c.certs, identity.ChainFile),
		"--cert-file", filepath.Join(c.certs, "operator.crt"), "--key-file", filepath.Join(c.certs, "operator.key"))
	if set.code != 0 {
		t.Fatalf("%s", set)
	}
	if r := c.pvcliEnv(t, cfg, "-o", "json", "service", "list", "--consistency", "consistent"); r.code != 0 || !strings.Contains(r.stdout, "instances") {
		t.Errorf("%s\nwant the services through the context's endpoints", r)
	}
	if _, err := os.Stat(strings.TrimPrefix(cfg[0], "PVCLI_CONFIG=")); err != nil {
		t.Error(err)
	}
}

// watchProcess is a pvcli watch running in the background.
type watchProcess struct {
	cmd    *exec.Cmd
	lines  chan string
	stderr *bytes.Buffer
}

// startWatch starts pvcli with args (a watch) against n with the
// operator's credentials; its stdout lines arrive on lines.
func (c *cluster) startWatch(t *testing.T, n *node, args ...string) *watchProcess {
	t.Helper()
	cmd := exec.Command(c.bins.pvcli, append([]string{"--endpoint", "https://" + n.api}, args...)...)
	cmd.Env = append(append(raceEnv(), "PVCLI_CONFIG="+filepath.Join(t.TempDir(), "none.yaml")), c.operatorEnv()...)
	w := &watchProcess{cmd: cmd, lines: make(chan string, 100), stderr: new(bytes.Buffer)}
	cmd.Stderr = w.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	dieWithTest(cmd)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	go func() {
		defer close(w.lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			w.lines <- sc.Text()
		}
	}()
	return w
}

// next is the next line of the watch holding want, failing after timeout.
func (w *watchProcess) next(t *testing.T, want string, timeout time.Duration) string {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case l, ok := <-w.lines:
			if !ok {
				t.Fatalf("the watch ended before a line with %q; stderr: %s", want, w.stderr)
			}
			if strings.Contains(l, want) {
				return l
			}
		case <-deadline:
			t.Fatalf("no line with %q within %s; stderr: %s", want, timeout, w.stderr)
		}
	}
}

// interrupt sends SIGINT (Ctrl-C) and requires exit status 0.
func (w *watchProcess) interrupt(t *testing.T) {
	t.Helper()
	if err := w.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	for range w.lines { // drain until stdout closes
	}
	if err := w.cmd.Wait(); err != nil {
		t.Errorf("the watch after Ctrl-C: %v (want exit status 0); stderr: %s", err, w.stderr)
	}
}

// watchExamples: service watch and config watch print the state, then
// every change, one JSON object per line, and end on Ctrl-C with exit 0.
func (c *cluster) watchExamples(t *testing.T) {
	n1, n2 := c.nodes[0], c.nodes[1]
	sw := c.startWatch(t, n1, "-o", "json", "service", "watch", "watched")
	cw := c.startWatch(t, n2, "-o", "json", "config", "watch", "kv/watched/")
	first := sw.next(t, "{", 30*time.Second)
	if first != "{}" {
		t.Errorf("first answer of service watch = %q, want {} (no instances yet)", first)
	}
	cw.next(t, "{", 30*time.Second)
	c.ok(t, c.nodes[2], "service", "register", "watched", "--address", "10.0.0.9", "--port", "80")
	c.ok(t, c.nodes[2], "config", "set", "kv/watched/a", "1")
	c.ok(t, c.nodes[2], "config", "set", "kv/other", "x")
	c.ok(t, c.nodes[2], "config", "set", "kv/watched/a", "2")
	l := sw.next(t, "watched-"+c.nodes[2].name, 30*time.Second)
	var got struct {
		Instances []struct {
			InstanceID string `json:"instanceId"`
		}
	}
	if err := json.Unmarshal([]byte(l), &got); err != nil || len(got.Instances) != 1 {
		t.Errorf("service watch line %q: %v", l, err)
	}
	cw.next(t, `"value":"1"`, 30*time.Second)
	if l := cw.next(t, `"value":"2"`, 30*time.Second); strings.Contains(l, "kv/other") {
		t.Errorf("config watch kv/watched/ printed another prefix: %s", l)
	}
	sw.interrupt(t)
	cw.interrupt(t)
	// Leave the cluster as the later steps expect it.
	c.ok(t, n1, "service", "deregister", "watched", "watched-"+c.nodes[2].name)
	c.ok(t, n1, "config", "delete", "kv/watched/a")
	c.ok(t, n1, "config", "delete", "kv/other")
}
