package config

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"
)

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name string
		doc  string
		want string // the whole error message, one line per problem
	}{
		// Unknown keys at several depths.
		{
			name: "unknown top-level key",
			doc:  "nodename: x\n",
			want: "config.yaml: nodename: unknown key (known: node_name, data_dir, server, tls, service_discovery, backends, auth, logging, tracing, routing, load_balancing, circuit_breaking, rate_limiting, cluster, snapshot, pinned_settings)",
		},
		{
			name: "unknown key depth 2",
			doc:  "server:\n  metrcs:\n    addr: x\n",
			want: "config.yaml: server.metrcs: unknown key (known: connectrpc, grpc_internal, metrics, ui)",
		},
		{
			name: "unknown key depth 4",
			doc:  "server:\n  connectrpc:\n    tls:\n      cert_fil: x\n",
			want: "config.yaml: server.connectrpc.tls.cert_fil: unknown key (known: cert_file, key_file, ca_file, client_ca_file)",
		},
		{
			name: "unknown key under a map entry",
			doc:  "backends:\n  pivirtd:\n    retry:\n      max_attempt: 3\n",
			want: "config.yaml: backends.pivirtd.retry.max_attempt: unknown key (known: max_attempts, backoff)",
		},
		{
			name: "unknown key in a list item",
			doc:  "routing:\n  rules:\n    - match: {prefix: /a}\n    - match: {prefx: /b}\n",
			want: "config.yaml: routing.rules[1].match.prefx: unknown key (known: prefix)",
		},
		{
			name: "unknown key in the clustering block",
			doc:  "cluster:\n  raft:\n    voter: 3\n",
			want: "config.yaml: cluster.raft.voter: unknown key (known: addr, advertise_addr, voters, max_non_voters, bootstrap_expect, bootstrap, dead_server_cleanup, heartbeat_timeout, election_timeout, leader_lease_timeout, snapshot_threshold, snapshot_interval, trailing_logs, log_store, wal_segment_size_mb, log_verification, replica_check)",
		},
		{
			name: "dev is not a file key",
			doc:  "dev: true\n",
			want: "config.yaml: dev: unknown key (known: node_name, data_dir, server, tls, service_discovery, backends, auth, logging, tracing, routing, load_balancing, circuit_breaking, rate_limiting, cluster, snapshot, pinned_settings)",
		},
		{
			name: "odd map key is quoted in the path",
			doc:  "backends:\n  \"my.backend\":\n    endpont: x\n",
			want: `config.yaml: backends["my.backend"].endpont: unknown key (known: endpoint, scope, timeout, retry, tls, required)`,
		},

		// Wrong types.
		{
			name: "string for a mapping",
			doc:  "server: x\n",
			want: `config.yaml: server: wrong type: expected a mapping, got string "x"`,
		},
		{
			name: "sequence for a mapping",
			doc:  "backends: [a]\n",
			want: "config.yaml: backends: wrong type: expected a mapping, got a sequence",
		},
		{
			name: "string for a sequence",
			doc:  "cluster:\n  join: 10.0.0.1:7946\n",
			want: `config.yaml: cluster.join: wrong type: expected a sequence, got string "10.0.0.1:7946"`,
		},
		{
			name: "quoted number for an integer",
			doc:  "logging:\n  sampling:\n    initial: \"100\"\n",
			want: `config.yaml: logging.sampling.initial: wrong type: expected an integer, got string "100"`,
		},
		{
			name: "float for an integer",
			doc:  "cluster:\n  raft:\n    voters: 1.5\n",
			want: "config.yaml: cluster.raft.voters: wrong type: expected an integer, got number 1.5",
		},
		{
			name: "negative for an unsigned integer",
			doc:  "cluster:\n  raft:\n    trailing_logs: -1\n",
			want: "config.yaml: cluster.raft.trailing_logs: invalid value: must not be negative, got -1",
		},
		{
			name: "integer out of range",
			doc:  "backends:\n  a:\n    retry:\n      max_attempts: 99999999999999999999999\n",
			want: "config.yaml: backends.a.retry.max_attempts: wrong type: expected an integer, got number 99999999999999999999999",
		},
		{
			name: "yes is not a boolean",
			doc:  "tls:\n  enabled: yes\n",
			want: `config.yaml: tls.enabled: wrong type: expected a boolean (true or false), got string "yes"`,
		},
		{
			name: "quoted boolean",
			doc:  "tls:\n  enabled: \"true\"\n",
			want: `config.yaml: tls.enabled: wrong type: expected a boolean (true or false), got string "true"`,
		},
		{
			name: "quoted float",
			doc:  "tracing:\n  sampling_rate: \"0.1\"\n",
			want: `config.yaml: tracing.sampling_rate: wrong type: expected a number, got string "0.1"`,
		},
		{
			name: "integer for a string",
			doc:  "node_name: 123\n",
			want: "config.yaml: node_name: wrong type: expected a string, got integer 123",
		},
		{
			name: "sequence for a string in a list",
			doc:  "service_discovery:\n  etcd:\n    endpoints: [a:1, [b]]\n",
			want: "config.yaml: service_discovery.etcd.endpoints[1]: wrong type: expected a string, got a sequence",
		},
		{
			name: "root is not a mapping",
			doc:  "- a\n- b\n",
			want: "config.yaml: wrong type: expected a mapping, got a sequence",
		},
		{
			name: "custom tag",
			doc:  "node_name: !secret x\n",
			want: `config.yaml: node_name: wrong type: unsupported tag "!secret"`,
		},

		// Durations.
		{
			name: "bad duration unit",
			doc:  "backends:\n  pivirtd:\n    timeout: \"30x\"\n",
			want: `config.yaml: backends.pivirtd.timeout: invalid duration "30x": time: unknown unit "x" in duration "30x"`,
		},
		{
			name: "duration without unit",
			doc:  "cluster:\n  raft:\n    heartbeat_timeout: 1\n",
			want: `config.yaml: cluster.raft.heartbeat_timeout: invalid duration "1": time: missing unit in duration "1"`,
		},
		{
			name: "duration as a mapping",
			doc:  "cluster:\n  retry_interval: {s: 1}\n",
			want: `config.yaml: cluster.retry_interval: wrong type: expected a duration such as "30s", got a mapping`,
		},
		{
			name: "duration as a boolean",
			doc:  "load_balancing:\n  health_check:\n    interval: true\n",
			want: `config.yaml: load_balancing.health_check.interval: wrong type: expected a duration such as "30s", got boolean true`,
		},

		// Enumerations.
		{
			name: "logging.level",
			doc:  "logging:\n  level: verbose\n",
			want: `config.yaml: logging.level: invalid value "verbose" (allowed: debug, info, warn, error)`,
		},
		{
			name: "logging.format",
			doc:  "logging:\n  format: xml\n",
			want: `config.yaml: logging.format: invalid value "xml" (allowed: json, text)`,
		},
		{
			name: "logging.access_log.format",
			doc:  "logging:\n  access_log:\n    format: combined\n",
			want: `config.yaml: logging.access_log.format: invalid value "combined" (allowed: json, text)`,
		},
		{
			name: "load_balancing.policy",
			doc:  "load_balancing:\n  policy: least_request\n",
			want: `config.yaml: load_balancing.policy: invalid value "least_request" (allowed: round_robin, least_connections, random)`,
		},
		{
			name: "service_discovery.type",
			doc:  "service_discovery:\n  type: consul\n",
			want: `config.yaml: service_discovery.type: invalid value "consul" (allowed: raft, etcd)`,
		},
		{
			name: "tracing.exporter",
			doc:  "tracing:\n  exporter: datadog\n",
			want: `config.yaml: tracing.exporter: invalid value "datadog" (allowed: "", otlp, jaeger, zipkin)`,
		},
		{
			name: "enum values are case-sensitive",
			doc:  "logging:\n  level: INFO\n",
			want: `config.yaml: logging.level: invalid value "INFO" (allowed: debug, info, warn, error)`,
		},

		// Duplicate keys.
		{
			name: "duplicate top-level key",
			doc:  "node_name: a\ndata_dir: /d\nnode_name: b\n",
			want: "config.yaml: node_name: duplicate key (first defined on line 1)",
		},
		{
			name: "duplicate nested key",
			doc:  "cluster:\n  raft:\n    voters: 3\n    voters: 5\n",
			want: "config.yaml: cluster.raft.voters: duplicate key (first defined on line 3)",
		},
		{
			name: "duplicate map key",
			doc:  "backends:\n  a:\n    endpoint: x:1\n  a:\n    endpoint: y:1\n",
			want: "config.yaml: backends.a: duplicate key (first defined on line 2)",
		},
		{
			name: "duplicate key in a list item",
			doc:  "routing:\n  rules:\n    - match: {prefix: /a, prefix: /b}\n",
			want: "config.yaml: routing.rules[0].match.prefix: duplicate key (first defined on line 3)",
		},

		// Documents and syntax.
		{
			name: "two documents",
			doc:  "node_name: a\n---\nnode_name: b\n",
			want: "config.yaml: multiple YAML documents (line 2): only one is allowed",
		},
		{
			name: "merge key",
			doc:  "base: &b {endpoint: x:1}\nbackends:\n  a:\n    <<: *b\n",
			want: "config.yaml: base: unknown key (known: node_name, data_dir, server, tls, service_discovery, backends, auth, logging, tracing, routing, load_balancing, circuit_breaking, rate_limiting, cluster, snapshot, pinned_settings)\n" +
				`config.yaml: backends.a["<<"]: invalid value: merge keys (<<) are not supported`,
		},

		// Every problem is reported.
		{
			name: "several problems at once",
			doc:  "logging:\n  level: loud\n  formatt: json\ncluster:\n  retry_max: many\n",
			want: `config.yaml: logging.level: invalid value "loud" (allowed: debug, info, warn, error)` + "\n" +
				"config.yaml: logging.formatt: unknown key (known: level, components, format, output, sampling, access_log)\n" +
				`config.yaml: cluster.retry_max: wrong type: expected an integer, got string "many"`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte(tt.doc), "config.yaml")
			if err == nil {
				t.Fatalf("Parse(%q) = nil error, want %q", tt.doc, tt.want)
			}
			if c != nil {
				t.Errorf("Parse returned a config with an error")
			}
			if got := err.Error(); got != tt.want {
				t.Errorf("Parse error:\ngot:  %s\nwant: %s", got, tt.want)
			}
		})
	}
}

// TestParseSyntaxError: a syntax error keeps yaml.v3's message and adds
// the line and column of the mistake itself (yaml.v3 names the line where
// the enclosing mapping began) and quotes it; where goccy's parser places
// it before yaml.v3's line, yaml.v3's error is given alone.
func TestParseSyntaxError(t *testing.T) {
	for _, tt := range []struct {
		doc        string
		line, col  int
		wantQuoted string
	}{
		{"server:\n  addr: [\n", 2, 9, ">  2 |   addr: ["},
		{"node_name: n1\ntls:\n  enabled: true\n - x\n", 4, 2, ">  4 |  - x"},
		{"node_name: n1\ntls:\n\tenabled: true\n", 3, 1, ">  3 | \tenabled: true"},
	} {
		_, err := Parse([]byte(tt.doc), "config.yaml")
		var fe *FieldError
		if !errors.As(err, &fe) {
			t.Fatalf("Parse(%q) = %v, want a *FieldError", tt.doc, err)
		}
		if fe.Line != tt.line || fe.Column != tt.col {
			t.Errorf("Parse(%q): at %d:%d, want %d:%d (%v)", tt.doc, fe.Line, fe.Column, tt.line, tt.col, err)
		}
		if got := err.Error(); !strings.HasPrefix(got, "config.yaml: yaml: line ") || !strings.Contains(got, fmt.Sprintf("\nat [%d:%d]", tt.line, tt.col)) || !strings.Contains(got, tt.wantQuoted) {
			t.Errorf("Parse(%q) error = %q, want yaml.v3's message, the position and the line quoted (%q)", tt.doc, got, tt.wantQuoted)
		}
	}
	// goccy places this one on line 4, yaml.v3 (rightly) on line 5.
	_, err := Parse([]byte("node_name: n1\ntls:\n  enabled: true\n  cert_file: /a.crt\n   key_file: /a.key\n"), "config.yaml")
	var fe *FieldError
	if !errors.As(err, &fe) || fe.Line != 0 || !strings.HasPrefix(err.Error(), "config.yaml: yaml: line 5: ") || strings.Contains(err.Error(), "\nat ") {
		t.Errorf("a position before yaml.v3's line: %v, want yaml.v3's error alone", err)
	}
}

func TestParseErrorDetails(t *testing.T) {
	tests := []struct {
		name     string
		doc      string
		sentinel error
		path     string
		line     int
	}{
		{"unknown key", "tls:\n  enable: true\n", ErrUnknownKey, "tls.enable", 2},
		{"duplicate key", "tls:\n  enabled: true\n  enabled: false\n", ErrDuplicateKey, "tls.enabled", 3},
		{"wrong type", "server:\n  metrics:\n    path: [a]\n", ErrType, "server.metrics.path", 3},
		{"bad enum", "logging:\n  format: yaml\n", ErrInvalid, "logging.format", 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.doc), "c.yaml")
			if !errors.Is(err, tt.sentinel) {
				t.Errorf("errors.Is(%v, %v) = false, want true", err, tt.sentinel)
			}
			var fe *FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("error %v is not a *FieldError", err)
			}
			if fe.File != "c.yaml" || fe.Path != tt.path || fe.Line != tt.line {
				t.Errorf("FieldError{File: %q, Path: %q, Line: %d}, want {%q, %q, %d}",
					fe.File, fe.Path, fe.Line, "c.yaml", tt.path, tt.line)
			}
		})
	}
}

func TestParseValues(t *testing.T) {
	tests := []struct {
		name  string
		doc   string
		check func(c *Config) (got, want any)
	}{
		{"empty file gives defaults", "",
			func(c *Config) (any, any) { return c, Default() }},
		{"comments only gives defaults", "# nothing here\n\n# at all\n",
			func(c *Config) (any, any) { return c, Default() }},
		{"explicit empty document gives defaults", "---\n",
			func(c *Config) (any, any) { return c, Default() }},
		{"null section keeps defaults", "server:\n  # connectrpc:\n  #   addr: x\n",
			func(c *Config) (any, any) { return c.Server, Default().Server }},
		{"null scalar keeps default", "server:\n  metrics:\n    path:\n",
			func(c *Config) (any, any) { return c.Server.Metrics.Path, "/metrics" }},
		{"empty string clears default", "tls:\n  ca_file: \"\"\n",
			func(c *Config) (any, any) { return c.TLS.CAFile, "" }},
		{"partial section keeps sibling defaults", "server:\n  metrics:\n    path: /m\n",
			func(c *Config) (any, any) {
				return c.Server.Metrics, MetricsConfig{Addr: "0.0.0.0:8444", Path: "/m", ManagementAllowFrom: DefaultManagementAllowFrom}
			}},
		{"null list is empty", "cluster:\n  join:\n",
			func(c *Config) (any, any) { return len(c.Cluster.Join), 0 }},
		{"list", "cluster:\n  retry_join: [\"a:1\", b:2]\n",
			func(c *Config) (any, any) { return c.Cluster.RetryJoin, []string{"a:1", "b:2"} }},
		{"map entry without the optional keys", "backends:\n  iscsiman:\n    endpoint: unix:///run/i.sock\n",
			func(c *Config) (any, any) {
				return c.Backends, map[string]BackendConfig{"iscsiman": {Endpoint: "unix:///run/i.sock"}}
			}},
		{"alias", "backends:\n  a: &tmpl\n    endpoint: x:1\n    timeout: 5s\n  b: *tmpl\n",
			func(c *Config) (any, any) { return c.Backends["b"], c.Backends["a"] }},
		{"hex integer", "cluster:\n  raft:\n    snapshot_threshold: 0x2000\n",
			func(c *Config) (any, any) { return c.Cluster.Raft.SnapshotThreshold, uint64(8192) }},
		{"integer for a float", "tracing:\n  sampling_rate: 1\n",
			func(c *Config) (any, any) { return c.Tracing.SamplingRate, 1.0 }},
		{"bare zero duration", "cluster:\n  raft:\n    dead_server_cleanup: 0\n",
			func(c *Config) (any, any) { return c.Cluster.Raft.DeadServerCleanup, Duration(0) }},
		{"compound duration", "cluster:\n  retry_interval: 1m30s\n",
			func(c *Config) (any, any) { return c.Cluster.RetryInterval.Std(), 90 * time.Second }},
		{"explicit string tag", "node_name: !!str 123\n",
			func(c *Config) (any, any) { return c.NodeName, "123" }},
		{"empty exporter allowed", "tracing:\n  exporter: \"\"\n",
			func(c *Config) (any, any) { return c.Tracing.Exporter, "" }},
		{"clustering block", `
node_name: node-01
data_dir: /var/lib/pivirt-agent
cluster:
  advertise_addr: "10.0.0.1"
  gossip:
    bind_addr: "0.0.0.0:7946"
    advertise_addr: "10.0.0.1:7946"
    encrypt_key_file: ""
  raft:
    addr: "0.0.0.0:8300"
    advertise_addr: "10.0.0.1:8300"
    voters: 5
    bootstrap_expect: 3
    bootstrap: false
    dead_server_cleanup: "1m"
    heartbeat_timeout: "1s"
    election_timeout: "1s"
    leader_lease_timeout: "500ms"
    snapshot_threshold: 8192
    snapshot_interval: "2m"
    trailing_logs: 10240
  join: ["10.0.0.2:7946"]
  retry_join: ["10.0.0.3:7946"]
  retry_interval: "30s"
  retry_max: 0
  leave_on_terminate: true
  forward_hold_timeout: "7s"
`, func(c *Config) (any, any) {
			want := Default().Cluster
			want.AdvertiseAddr = "10.0.0.1"
			want.Gossip.AdvertiseAddr = "10.0.0.1:7946"
			want.Raft.AdvertiseAddr = "10.0.0.1:8300"
			want.Raft.Voters = 5
			want.Raft.BootstrapExpect = 3
			want.Join = []string{"10.0.0.2:7946"}
			want.RetryJoin = []string{"10.0.0.3:7946"}
			want.LeaveOnTerminate = true
			return c.Cluster, want
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, want := tt.check(mustParse(t, tt.doc))
			if !reflect.DeepEqual(got, want) {
				t.Errorf("got %#v\nwant %#v", got, want)
			}
		})
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(path, []byte("node_name: n7\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(path)
	if err != nil {
		t.Fatalf("Load = %v", err)
	}
	if c.NodeName != "n7" {
		t.Errorf("node_name = %q, want %q", c.NodeName, "n7")
	}

	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("node_nam: n7\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(bad); err == nil || !strings.HasPrefix(err.Error(), bad+": node_nam: unknown key") {
		t.Errorf("Load(bad) = %v, want an error starting with %q", err, bad+": node_nam: unknown key")
	}

	if _, err := Load(filepath.Join(dir, "missing.yaml")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Load(missing) = %v, want os.ErrNotExist", err)
	}
}

// TestLimits checks that a hostile file stays cheap: errors are capped and alias expansion
// is bounded by a node budget.
func TestLimits(t *testing.T) {
	var many strings.Builder
	for i := range 200 {
		many.WriteString("k" + strconv.Itoa(i) + ": 1\n")
	}
	// An anchored mapping of 3000 unknown keys used 3000 times: 9M key visits without limits.
	var bomb strings.Builder
	bomb.WriteString("routing:\n  rules:\n    - &r {")
	for i := range 3000 {
		if i > 0 {
			bomb.WriteString(", ")
		}
		bomb.WriteString("k" + strconv.Itoa(i) + ": 1")
	}
	bomb.WriteString("}\n")
	for range 3000 {
		bomb.WriteString("    - *r\n")
	}

	tests := []struct {
		name      string
		doc       string
		wantLines int
		wantLast  string
	}{
		{"errors are capped", many.String(), maxErrors + 1, "too many errors, giving up"},
		{"aliased unknown keys stop at the error cap", bomb.String(), maxErrors + 1, "too many errors, giving up"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.doc), "c.yaml")
			if err == nil {
				t.Fatal("Parse = nil error")
			}
			lines := strings.Split(err.Error(), "\n")
			if len(lines) != tt.wantLines {
				t.Errorf("got %d error lines, want %d", len(lines), tt.wantLines)
			}
			if last := lines[len(lines)-1]; !strings.HasSuffix(last, tt.wantLast) {
				t.Errorf("last error line = %q, want suffix %q", last, tt.wantLast)
			}
		})
	}
}

func TestNodeBudget(t *testing.T) {
	// Valid content only, so the error cap does not stop the walk first: a list of many
	// aliases to a rule, with the budget lowered for the test.
	var doc strings.Builder
	doc.WriteString("routing:\n  rules:\n    - &r {match: {prefix: /p}, route: {cluster: c}}\n")
	for range 100 {
		doc.WriteString("    - *r\n")
	}
	var c Config
	w := &walker{file: "c.yaml", budget: 50}
	var root yaml.Node
	if err := yaml.Unmarshal([]byte(doc.String()), &root); err != nil {
		t.Fatal(err)
	}
	w.value(root.Content[0], reflect.ValueOf(&c).Elem(), "")
	err := errors.Join(w.errs...)
	if err == nil || !strings.Contains(err.Error(), "too many alias expansions") {
		t.Errorf("walk with a small budget = %v, want a budget error", err)
	}
}
