package config

import (
	"os"
	"testing"

	"gopkg.in/yaml.v3"
)

// FuzzLoad feeds arbitrary bytes to the parser: it must never panic, and whatever it accepts
// must survive Validate and a marshal/parse round trip unchanged.
func FuzzLoad(f *testing.F) {
	for _, file := range []string{"testdata/spec-agent.yaml", "testdata/spec-mesh.yaml"} {
		data, err := os.ReadFile(file)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Add([]byte(""))
	f.Add([]byte("cluster:\n  raft:\n    voters: 3\n    heartbeat_timeout: 1s\n  join: [\"a:1\"]\n"))
	f.Add([]byte("backends:\n  a: &t {endpoint: x:1}\n  b: *t\nrouting:\n  rules:\n    - match: {prefix: /a}\n"))
	f.Add([]byte("node_name: a\nnode_name: b\n---\nx: 1\n"))
	f.Add([]byte("<<: {a: 1}\ntls: !foo\n"))

	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := Parse(data, "fuzz.yaml")
		if err != nil {
			return
		}
		_ = cfg.Validate() // must not panic; errors are fine
		out, err := yaml.Marshal(cfg)
		if err != nil {
			t.Fatalf("Marshal of a parsed config: %v", err)
		}
		again, err := Parse(out, "marshalled.yaml")
		if err != nil {
			t.Fatalf("Parse(Marshal(cfg)) = %v\ninput:\n%q\nmarshalled:\n%s", err, data, out)
		}
		out2, err := yaml.Marshal(again)
		if err != nil {
			t.Fatalf("Marshal: %v", err)
		}
		if string(out) != string(out2) {
			t.Fatalf("round trip changed the config:\nfirst:\n%s\nsecond:\n%s", out, out2)
		}
	})
}
