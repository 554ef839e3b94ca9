package config

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

// fileConfig sets every key a flag can override to a value different from both the default
// and the flag defaults, so an unset flag that leaked its default would show.
const fileConfig = `
node_name: from-file
data_dir: /srv/agent
server:
  connectrpc:
    addr: "10.0.0.1:18443"
  grpc_internal:
    addr: "10.0.0.1:19000"
  metrics:
    addr: "10.0.0.1:18444"
logging:
  level: warn
  format: text
cluster:
  advertise_addr: "10.0.0.1"
  gossip:
    bind_addr: "10.0.0.1:17946"
  raft:
    addr: "10.0.0.1:18300"
    voters: 5
    bootstrap: true
  join: ["10.0.0.2:17946"]
  retry_join: ["10.0.0.3:17946"]
  retry_interval: 5s
  retry_max: 4
  leave_on_terminate: true
`

func parseFlags(tb testing.TB, args ...string) *Flags {
	tb.Helper()
	fs := pflag.NewFlagSet("pivirt-agent", pflag.ContinueOnError)
	f := Register(fs)
	if err := fs.Parse(args); err != nil {
		tb.Fatalf("parse %q: %v", args, err)
	}
	return f
}

func TestFlagsApply(t *testing.T) {
	tests := []struct {
		name   string
		args   []string
		change func(want *Config) // what the flags change relative to the file
	}{
		{"no flags keep the file", nil, func(*Config) {}},
		{"--config alone keeps the file", []string{"--config", "/etc/x.yaml"}, func(*Config) {}},
		{"--node-name", []string{"--node-name", "n2"}, func(w *Config) { w.NodeName = "n2" }},
		{"--data-dir", []string{"--data-dir=/d"}, func(w *Config) { w.DataDir = "/d" }},
		{"--gossip-addr", []string{"--gossip-addr", "0.0.0.0:7946"}, func(w *Config) { w.Cluster.Gossip.BindAddr = "0.0.0.0:7946" }},
		{"--advertise-addr", []string{"--advertise-addr", "10.9.9.9"}, func(w *Config) { w.Cluster.AdvertiseAddr = "10.9.9.9" }},
		{"--api-addr", []string{"--api-addr", "0.0.0.0:8443"}, func(w *Config) { w.Server.ConnectRPC.Addr = "0.0.0.0:8443" }},
		{"--internal-addr", []string{"--internal-addr", ":9000"}, func(w *Config) { w.Server.GRPCInternal.Addr = ":9000" }},
		{"--metrics-addr", []string{"--metrics-addr", ":8444"}, func(w *Config) { w.Server.Metrics.Addr = ":8444" }},
		{"--raft-addr", []string{"--raft-addr", "0.0.0.0:8300"}, func(w *Config) { w.Cluster.Raft.Addr = "0.0.0.0:8300" }},
		{"--join repeated replaces the list", []string{"--join", "a:1", "--join", "b:2,c:3"}, func(w *Config) { w.Cluster.Join = []string{"a:1", "b:2", "c:3"} }},
		{"--retry-join", []string{"--retry-join", "d:4"}, func(w *Config) { w.Cluster.RetryJoin = []string{"d:4"} }},
		{"--retry-interval", []string{"--retry-interval", "1m"}, func(w *Config) { w.Cluster.RetryInterval = Duration(time.Minute) }},
		{"--retry-max", []string{"--retry-max", "0"}, func(w *Config) { w.Cluster.RetryMax = 0 }},
		{"--bootstrap-expect", []string{"--bootstrap-expect", "3", "--bootstrap=false"}, func(w *Config) {
			w.Cluster.Raft.BootstrapExpect = 3
			w.Cluster.Raft.Bootstrap = false
		}},
		{"--bootstrap=false overrides the file's true", []string{"--bootstrap=false"}, func(w *Config) { w.Cluster.Raft.Bootstrap = false }},
		{"--voters", []string{"--voters", "3"}, func(w *Config) { w.Cluster.Raft.Voters = 3 }},
		{"--leave-on-terminate=false", []string{"--leave-on-terminate=false"}, func(w *Config) { w.Cluster.LeaveOnTerminate = false }},
		{"--log-level", []string{"--log-level", "debug"}, func(w *Config) { w.Logging.Level = "debug" }},
		{"--log-format", []string{"--log-format", "json"}, func(w *Config) { w.Logging.Format = "json" }},
		{"--dev=false does nothing", []string{"--dev=false"}, func(*Config) {}},
		{"--dev", []string{"--dev"}, func(w *Config) { ApplyDev(w) }},
		{"--dev with explicit flags", []string{"--dev", "--node-name", "n1", "--api-addr", "127.0.0.1:28443", "--data-dir", "/tmp/d", "--log-level", "debug"}, func(w *Config) {
			ApplyDev(w)
			w.NodeName = "n1"
			w.Server.ConnectRPC.Addr = "127.0.0.1:28443"
			w.DataDir = "/tmp/d"
			w.Logging.Level = "debug"
		}},
		{"flags after --dev win regardless of order", []string{"--raft-addr", "127.0.0.1:28300", "--dev"}, func(w *Config) {
			ApplyDev(w)
			w.Cluster.Raft.Addr = "127.0.0.1:28300"
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := parseFlags(t, tt.args...)
			got := mustParse(t, fileConfig)
			if err := f.Apply(got); err != nil {
				t.Fatalf("Apply = %v", err)
			}
			want := mustParse(t, fileConfig)
			tt.change(want)
			if !reflect.DeepEqual(got, want) {
				t.Errorf("after %q:\ngot  %+v\nwant %+v", tt.args, got, want)
			}
		})
	}
}

func TestFlagsApplyErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"bad log level", []string{"--log-level", "verbose"}, `--log-level: invalid value "verbose" (allowed: debug, info, warn, error)`},
		{"bad log format", []string{"--log-format", "yaml"}, `--log-format: invalid value "yaml" (allowed: json, text)`},
		{"negative retry max", []string{"--retry-max", "-1"}, "--retry-max: invalid value -1: must not be negative"},
		{"negative bootstrap expect", []string{"--bootstrap-expect=-2"}, "--bootstrap-expect: invalid value -2: must not be negative"},
		{"zero retry interval", []string{"--retry-interval", "0s"}, "--retry-interval: invalid value 0s: must be positive"},
		{"all reported", []string{"--log-level", "x", "--log-format", "y"}, "--log-level: invalid value \"x\" (allowed: debug, info, warn, error)\n--log-format: invalid value \"y\" (allowed: json, text)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := parseFlags(t, tt.args...).Apply(Default())
			if err == nil || err.Error() != tt.want {
				t.Errorf("Apply = %v, want %q", err, tt.want)
			}
		})
	}
}

func TestFlagsApplyBeforeParse(t *testing.T) {
	f := Register(pflag.NewFlagSet("x", pflag.ContinueOnError))
	if err := f.Apply(Default()); err == nil {
		t.Error("Apply before Parse = nil error, want an error")
	}
}

func TestFlagsDefaultsMatchDefault(t *testing.T) {
	// The help shows the flag defaults; they must be the real defaults.
	fs := pflag.NewFlagSet("pivirt-agent", pflag.ContinueOnError)
	Register(fs)
	d := Default()
	tests := []struct{ flag, want string }{
		{FlagDataDir, d.DataDir},
		{FlagGossipAddr, d.Cluster.Gossip.BindAddr},
		{FlagAPIAddr, d.Server.ConnectRPC.Addr},
		{FlagInternalAddr, d.Server.GRPCInternal.Addr},
		{FlagMetricsAddr, d.Server.Metrics.Addr},
		{FlagRaftAddr, d.Cluster.Raft.Addr},
		{FlagRetryInterval, d.Cluster.RetryInterval.String()},
		{FlagRetryMax, "0"},
		{FlagBootstrapExpect, "0"},
		{FlagVoters, "3"},
		{FlagLogLevel, d.Logging.Level},
		{FlagLogFormat, d.Logging.Format},
	}
	for _, tt := range tests {
		t.Run(tt.flag, func(t *testing.T) {
			fl := fs.Lookup(tt.flag)
			if fl == nil {
				t.Fatalf("flag --%s not registered", tt.flag)
			}
			if fl.DefValue != tt.want {
				t.Errorf("--%s default = %q, want %q", tt.flag, fl.DefValue, tt.want)
			}
		})
	}
}

func TestFlagsResolve(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	if err := os.WriteFile(good, []byte(fileConfig), 0o600); err != nil {
		t.Fatal(err)
	}
	unknown := filepath.Join(dir, "unknown.yaml")
	if err := os.WriteFile(unknown, []byte("clusterr: {}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		args     []string
		wantErr  string
		wantNode string
	}{
		{"no file", nil, "", ""},
		{"file and flag", []string{"--config", good, "--node-name", "n9"}, "", "n9"},
		{"file only", []string{"--config", good}, "", "from-file"},
		{"dev", []string{"--dev"}, "", "dev"},
		{"file with an unknown key", []string{"--config", unknown}, unknown + ": clusterr: unknown key", ""},
		{"missing file", []string{"--config", filepath.Join(dir, "missing.yaml")}, "read config file: ", ""},
		{"flag breaks validation", []string{"--config", good, "--bootstrap-expect", "3"}, "cluster.raft.bootstrap: invalid value: cannot be combined", ""},
		{"flag error", []string{"--log-level", "loud"}, "--log-level: invalid value", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := parseFlags(t, tt.args...).Resolve()
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Resolve = %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("Resolve = %v", err)
			}
			if tt.wantNode != "" && cfg.NodeName != tt.wantNode {
				t.Errorf("node_name = %q, want %q", cfg.NodeName, tt.wantNode)
			}
		})
	}
}
