package authz

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const viewerOnly = `apiVersion: rbac.pivirt.pilab.hu/v1
kind: Policy
rules:
  - roles: ["viewer"]
    resources: ["*"]
    verbs: ["get", "list"]
`

func TestFileReload(t *testing.T) {
	path := filepath.Join(t.TempDir(), "rbac.yaml")
	spec, err := os.ReadFile(filepath.Join("testdata", "spec-rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, spec, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := LoadFile(path, resources, nil)
	if err != nil {
		t.Fatal(err)
	}
	admin := Principal{Identity: "root", Roles: []string{"admin"}}
	allowed := func() bool {
		d, _ := f.Policy().Decide(admin, "virtualmachines", "delete")
		return d.Allowed
	}
	if !allowed() {
		t.Fatal("admin cannot delete under the spec's policy")
	}

	// A broken version is refused; the policy in use stays.
	if err := os.WriteFile(path, []byte(strings.Replace(viewerOnly, `"list"`, `"reboot"`, 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := f.Reload(); err == nil || !strings.Contains(err.Error(), `unknown "reboot"`) || f.Err() == nil {
		t.Errorf("Reload of a broken policy = %v", err)
	}
	if !allowed() {
		t.Error("a broken policy replaced the one in use")
	}

	// Watch picks up a valid change.
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go f.Watch(ctx, 20*time.Millisecond)
	if err := os.WriteFile(path, []byte(viewerOnly+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for allowed() {
		if time.Now().After(deadline) {
			t.Fatal("the watcher did not load the new policy")
		}
		time.Sleep(10 * time.Millisecond) // poll, bounded by the deadline
	}
	if f.Err() != nil {
		t.Errorf("Err after a good reload = %v", f.Err())
	}
	if _, err := LoadFile(filepath.Join(t.TempDir(), "missing.yaml"), resources, nil); err == nil || !strings.Contains(err.Error(), "auth.rbac_policy") {
		t.Errorf("LoadFile of a missing file = %v", err)
	}
}
