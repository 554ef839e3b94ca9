package servicedef

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	inst, err := Parse([]byte(`
name: web
id: web-1
address: 10.0.0.7
port: 8080
tags: [v1]
meta: {team: edge}
deregister_critical_after: 10m
check:
  http: http://10.0.0.7:8080/health
  interval: 5s
  timeout: 2s
  success_before_passing: 2
  failures_before_critical: 3
`))
	if err != nil {
		t.Fatal(err)
	}
	c := inst.GetCheck()
	if inst.GetService() != "web" || inst.GetInstanceId() != "web-1" || inst.GetPort() != 8080 || inst.GetMeta()["team"] != "edge" ||
		inst.GetDeregisterCriticalAfter().AsDuration() != 10*time.Minute || c.GetHttp() != "http://10.0.0.7:8080/health" ||
		c.GetInterval().AsDuration() != 5*time.Second || c.GetTimeout().AsDuration() != 2*time.Second ||
		c.GetSuccessBeforePassing() != 2 || c.GetFailuresBeforeCritical() != 3 {
		t.Errorf("parsed %v", inst)
	}
	inst, err = Parse([]byte(`{"name": "db", "address": "10.0.0.8", "port": 5432, "check": {"tcp": "10.0.0.8:5432"}}`))
	if err != nil || inst.GetCheck().GetTcp() != "10.0.0.8:5432" {
		t.Errorf("JSON: %v, %v", inst, err)
	}
	for _, tc := range []struct{ in, says string }{
		{"", "empty"},
		{"name: web\nport: 80", "address: required"},
		{"name: web\naddress: a\nport: 70000", "port: 70000"},
		{"name: web\naddress: a\nport: 80\nchek: {}", "field chek not found"},
		{"name: web\naddress: a\nport: 80\ncheck: {interval: soon}", "duration"},
		{"name: web\naddress: a\nport: 80\ncheck: {tcp: a:1, failures_before_critical: 200}", "check.failures_before_critical"},
	} {
		if _, err := Parse([]byte(tc.in)); err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("Parse(%q) = %v, want an error saying %q", tc.in, err, tc.says)
		}
	}
}

// TestReadDir: a bad file is reported by name and the good ones are read
// all the same.
func TestReadDir(t *testing.T) {
	dir := t.TempDir()
	for name, text := range map[string]string{
		"a.yaml":       "name: a\naddress: 127.0.0.1\nport: 1\n",
		"b.json":       `{"name": "b", "address": "127.0.0.1", "port": 2}`,
		"bad.yml":      "name: c\naddress: 127.0.0.1\nport: nope\n",
		"notes.txt":    "not a definition",
		".hidden.yaml": "name: h\n",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	files, errs, err := ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 2 || files[0].Name != "a.yaml" || files[1].Name != "b.json" {
		t.Errorf("files = %v, want a.yaml and b.json", files)
	}
	if len(errs) != 1 || !strings.Contains(errs[0].Error(), "bad.yml") {
		t.Errorf("errs = %v, want one naming bad.yml", errs)
	}
}
