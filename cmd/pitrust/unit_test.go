package main

import (
	"bufio"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/cmd/internal/caserver"
)

// TestSystemdUnit checks the shipped unit of pitrust serve: Type=notify
// (which serve speaks), an ExecStart whose flags serve accepts, and the
// default database and certificate directories writable under
// ProtectSystem=strict.
func TestSystemdUnit(t *testing.T) {
	f, err := os.Open(filepath.Join("..", "..", "packaging", "systemd", "pitrust.service"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	keys := map[string][]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") {
			keys[k] = append(keys[k], v)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if got := keys["Type"]; len(got) != 1 || got[0] != "notify" {
		t.Errorf("Type=%v, want notify", got)
	}
	exec := strings.Fields(keys["ExecStart"][0])
	if filepath.Base(exec[0]) != "pitrust" || len(exec) < 2 || exec[1] != "serve" {
		t.Fatalf("ExecStart %v does not run pitrust serve", exec)
	}
	c := serveCmd(io.Discard)
	if err := c.ParseFlags(exec[2:]); err != nil {
		t.Fatalf("serve refuses ExecStart's flags %v: %v", exec[2:], err)
	}
	if got, _ := c.Flags().GetString("config"); got != DefaultConfigFile {
		t.Errorf("ExecStart reads %s, the example config installs as %s", got, DefaultConfigFile)
	}
	def := caserver.Default()
	if got := keys["StateDirectory"]; len(got) != 1 || "/var/lib/"+got[0] != filepath.Dir(def.Server.DBPath) {
		t.Errorf("StateDirectory=%v does not make the default database directory %s writable", got, filepath.Dir(def.Server.DBPath))
	}
	var rw []string
	for _, line := range keys["ReadWritePaths"] {
		rw = append(rw, strings.Fields(line)...)
	}
	if !slices.Contains(rw, def.Server.CertsDir) {
		t.Errorf("ReadWritePaths %v: serve cannot write its certificate to %s", rw, def.Server.CertsDir)
	}
}
