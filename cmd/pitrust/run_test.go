package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func run(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := Run(context.Background(), args, &out, &errOut)
	return out.String(), err
}

func TestPitrustCommands(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "certs")
	out, err := run(t, "init", "--dir", dir)
	if err != nil || !strings.Contains(out, "PiRootR1.pem") {
		t.Fatalf("init: %q, %v", out, err)
	}
	// The spec's commands, as written there.
	out, err = run(t, "issue-mtls-server", "--dir", dir, "--name", "node-01.pivirt.internal", "--dns", "node-01.pivirt.internal", "--ip", "127.0.0.1", "--days", "365")
	if err != nil || !strings.Contains(out, "node-01.pivirt.internal, 127.0.0.1") {
		t.Fatalf("issue-mtls-server: %q, %v", out, err)
	}
	if _, err := run(t, "issue-mtls-client", "--dir", dir, "--name", "pivirt-agent-node-01", "--days", "365"); err != nil {
		t.Fatalf("issue-mtls-client: %v", err)
	}
	for _, f := range []string{"node-01.pivirt.internal.crt", "node-01.pivirt.internal.key", "pivirt-agent-node-01.crt", "pivirt-agent-node-01.key"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}

	srv := filepath.Join(dir, "node-01.pivirt.internal.crt")
	out, err = run(t, "verify", "--dir", dir, "--name", "127.0.0.1", srv)
	if err != nil || !strings.Contains(out, "OK (trusted by") || !strings.Contains(out, "server authentication") || strings.Count(out, "chain[") != 3 {
		t.Errorf("verify: %q, %v", out, err)
	}
	out, err = run(t, "verify", "--dir", dir, "-o", "json", filepath.Join(dir, "pivirt-agent-node-01.crt"))
	var res struct {
		Usage string `json:"usage"`
		Chain []struct {
			Subject string `json:"subject"`
		} `json:"chain"`
	}
	if err != nil || json.Unmarshal([]byte(out), &res) != nil || res.Usage != "client authentication" || len(res.Chain) != 3 {
		t.Errorf("verify -o json: %q, %v", out, err)
	}
	if _, err := run(t, "verify", "--dir", dir, "--name", "other.example", srv); err == nil || !strings.Contains(err.Error(), "NOT trusted") {
		t.Errorf("verify with a wrong name = %v", err)
	}
	other := filepath.Join(t.TempDir(), "other")
	if _, err := run(t, "init", "--dir", other); err != nil {
		t.Fatal(err)
	}
	if _, err := run(t, "verify", "--ca", filepath.Join(other, "ca-chain.pem"), srv); err == nil || !strings.Contains(err.Error(), "not signed by the given CA chain") {
		t.Errorf("verify against another CA = %v", err)
	}

	out, err = run(t, "inspect", srv)
	if err != nil || !strings.Contains(out, "certificate[1]") || !strings.Contains(out, "PiTrust X1 Intermediate CA") || !strings.Contains(out, "days left") {
		t.Errorf("inspect: %q, %v", out, err)
	}
	out, err = run(t, "inspect", "-o", "json", filepath.Join(dir, "ca-chain.pem"))
	var infos []struct {
		Subject string `json:"subject"`
		IsCA    bool   `json:"is_ca"`
	}
	if err != nil || json.Unmarshal([]byte(out), &infos) != nil || len(infos) != 2 || !infos[0].IsCA {
		t.Errorf("inspect -o json: %q, %v", out, err)
	}
}

func TestPitrustRefuses(t *testing.T) {
	dir := t.TempDir()
	if _, err := run(t, "init", "--dir", dir); err != nil {
		t.Fatal(err)
	}
	key := filepath.Join(dir, "PiCA.key")
	before, _ := os.ReadFile(key)
	var ue *usageError
	for _, tt := range []struct {
		args  []string
		want  string
		usage bool
	}{
		{[]string{"init", "--dir", dir}, "already exists (use --force", false},
		{[]string{"issue-mtls-server", "--dir", dir}, "--name is required", true},
		{[]string{"issue-mtls-server", "--dir", dir, "--name", "a.example", "--ip", "300.1.1.1"}, `--ip "300.1.1.1" is not an IP address`, true},
		{[]string{"issue-mtls-client", "--dir", dir, "--name", "c", "--ip", "10.0.0.1"}, "unknown flag: --ip", true},
		{[]string{"issue-mtls-server", "--dir", dir, "--name", "a.example", "--days", "0"}, "--days 0", true},
		{[]string{"issue-mtls-server", "--dir", dir, "--name", "a.example", "--days", "99999"}, "days 99999", false},
		{[]string{"issue-mtls-server", "--dir", filepath.Join(dir, "nothing"), "--name", "a.example"}, "no PiTrust CA", false},
		{[]string{"verify", "--dir", dir, filepath.Join(dir, "missing.crt")}, "missing.crt", false},
		{[]string{"inspect", "-o", "yaml", key}, "--output", true},
		{[]string{"inspect", key}, "no PEM certificate", false},
		{[]string{"rotate"}, "unknown command", true},
	} {
		_, err := run(t, tt.args...)
		if err == nil || !strings.Contains(err.Error(), tt.want) || errors.As(err, &ue) != tt.usage {
			t.Errorf("pitrust %s = %v (usage error: %v), want an error containing %q (usage error: %v)",
				strings.Join(tt.args, " "), err, errors.As(err, &ue), tt.want, tt.usage)
		}
	}
	if after, _ := os.ReadFile(key); !bytes.Equal(after, before) {
		t.Error("a refused command changed the CA key")
	}
}
