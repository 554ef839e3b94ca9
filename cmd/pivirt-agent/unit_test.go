package main

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"pilab.hu/pivirt-agent/cmd/internal/config"
)

// TestSystemdUnit checks the shipped unit against the agent: Type=notify
// (which the agent speaks), an ExecStart whose flags the agent accepts,
// and a writable default data dir under ProtectSystem=strict.
func TestSystemdUnit(t *testing.T) {
	f, err := os.Open(filepath.Join("..", "..", "packaging", "systemd", "pivirt-agent.service"))
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
	if filepath.Base(exec[0]) != "pivirt-agent" {
		t.Errorf("ExecStart runs %s", exec[0])
	}
	fs := pflag.NewFlagSet("pivirt-agent", pflag.ContinueOnError)
	fl := config.Register(fs)
	if err := fs.Parse(exec[1:]); err != nil || fl.ConfigFile() != "/etc/pivirt-agent/config.yaml" {
		t.Errorf("the agent refuses ExecStart's flags %v: %v", exec[1:], err)
	}
	// Every ReadWritePaths entry exists when the unit starts (systemd
	// refuses the namespace otherwise): made by a *Directory= setting.
	made := map[string]bool{}
	for k, dir := range map[string]string{"RuntimeDirectory": "/run/", "LogsDirectory": "/var/log/", "StateDirectory": "/var/lib/"} {
		for _, v := range keys[k] {
			made[dir+v] = true
		}
	}
	for _, line := range keys["ReadWritePaths"] {
		for _, p := range strings.Fields(line) {
			if !strings.HasPrefix(p, "-") && !made[p] {
				t.Errorf("ReadWritePaths %s: nothing makes it (a missing path stops the unit)", p)
			}
		}
	}
	if got := keys["StateDirectory"]; len(got) != 1 || "/var/lib/"+got[0] != config.DefaultDataDir {
		t.Errorf("StateDirectory=%v does not make the default data dir %s writable", got, config.DefaultDataDir)
	}
}
