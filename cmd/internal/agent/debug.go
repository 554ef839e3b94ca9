package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"runtime/pprof"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"gopkg.in/yaml.v3"

	"pilab.hu/pivirt-agent/gateway"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// redacted replaces a secret in the bundle's configuration.
const redacted = "REDACTED"

// debugFiles are the files of this node's support bundle (pvcli debug),
// in the order they are collected: the quick ones first, the CPU profile
// (the request's duration) before the log lines, so that those show what
// the profile saw.
func (a *Agent) debugFiles(req *clusterv1.DebugRequest) []gateway.DebugFile {
	files := []gateway.DebugFile{
		{Name: "goroutines.txt", Collect: func(context.Context) ([]byte, error) { return profile("goroutine", 2) }},
		{Name: "heap.pprof", Collect: func(context.Context) ([]byte, error) { return profile("heap", 0) }},
		{Name: "metrics.txt", Collect: a.debugGet(a.cfg.Server.Metrics.Path)},
		{Name: "health.json", Collect: a.debugGet("/health")},
		{Name: "ready.json", Collect: a.debugGet("/ready")},
		{Name: "members.json", Collect: func(ctx context.Context) ([]byte, error) {
			resp, err := a.api.Members(ctx, connect.NewRequest(&clusterv1.MembersRequest{}))
			if err != nil {
				return nil, err
			}
			return debugJSON(resp.Msg)
		}},
		{Name: "peers.json", Collect: func(ctx context.Context) ([]byte, error) {
			// This node's own view: a stale read is never forwarded.
			resp, err := a.api.Peers(ctx, connect.NewRequest(&clusterv1.PeersRequest{
				Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_STALE},
			}))
			if err != nil {
				return nil, err
			}
			return debugJSON(resp.Msg)
		}},
		{Name: "config.yaml", Collect: func(context.Context) ([]byte, error) { return redactedConfig(a.current.Load()) }},
	}
	if d := req.GetDuration().AsDuration(); d > 0 {
		files = append(files, gateway.DebugFile{Name: "cpu.pprof", Collect: func(ctx context.Context) ([]byte, error) {
			return cpuProfile(ctx, d)
		}})
	}
	return append(files, gateway.DebugFile{Name: "log.txt", Collect: func(context.Context) ([]byte, error) {
		var b bytes.Buffer
		for _, e := range a.tee.Recent(int(req.GetLogLines())) {
			b.WriteString(e.Text())
			b.WriteByte('\n')
		}
		return b.Bytes(), nil
	}})
}

// profile writes a runtime profile (debug 2: goroutine stacks as text).
func profile(name string, debug int) ([]byte, error) {
	p := pprof.Lookup(name)
	if p == nil {
		return nil, fmt.Errorf("no %s profile", name)
	}
	var b bytes.Buffer
	if err := p.WriteTo(&b, debug); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// cpuProfile profiles the process for d (shorter when ctx ends first).
func cpuProfile(ctx context.Context, d time.Duration) ([]byte, error) {
	var b bytes.Buffer
	if err := pprof.StartCPUProfile(&b); err != nil {
		// One CPU profile at a time per process: pprof's own error says
		// it is in use.
		return nil, fmt.Errorf("CPU profile: %w", err)
	}
	t := time.NewTimer(d)
	select {
	case <-t.C:
	case <-ctx.Done():
		t.Stop()
	}
	pprof.StopCPUProfile()
	return b.Bytes(), nil
}

// debugGet is the metrics port's answer to GET path, as it would serve it.
func (a *Agent) debugGet(path string) func(context.Context) ([]byte, error) {
	return func(ctx context.Context) ([]byte, error) {
		req := httptest.NewRequestWithContext(ctx, http.MethodGet, path, nil)
		rec := httptest.NewRecorder()
		a.metricsMux().ServeHTTP(rec, req)
		return rec.Body.Bytes(), nil
	}
}

// debugJSON is m as indented JSON, always the same bytes for the same
// message (protojson varies its whitespace on purpose; json.Indent does
// not).
func debugJSON(m proto.Message) ([]byte, error) {
	b, err := protojson.Marshal(m)
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	if err := json.Indent(&out, b, "", "  "); err != nil {
		return nil, err
	}
	out.WriteByte('\n')
	return out.Bytes(), nil
}

// secretKey matches the names of settings whose values are secrets.
var secretKey = regexp.MustCompile(`(?i)(secret|password|passwd|token|credential)`)

// redactedConfig is cfg as YAML with its secrets replaced by REDACTED:
// the values of keys that name a secret, and the password of every URL
// (user:password@host). The files that hold keys are named, never read.
func redactedConfig(cfg any) ([]byte, error) {
	if cfg == nil {
		return nil, errors.New("no configuration")
	}
	var n yaml.Node
	if err := n.Encode(cfg); err != nil {
		return nil, err
	}
	redactNode(&n)
	var b bytes.Buffer
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(&n); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

func redactNode(n *yaml.Node) {
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			if v.Kind == yaml.ScalarNode && v.Value != "" && secretKey.MatchString(k.Value) && !strings.HasSuffix(k.Value, "_file") {
				v.Value, v.Tag, v.Style = redacted, "!!str", 0
				continue
			}
			redactNode(v)
		}
	case yaml.SequenceNode, yaml.DocumentNode:
		for _, c := range n.Content {
			redactNode(c)
		}
	case yaml.ScalarNode:
		if strings.Contains(n.Value, "://") && strings.Contains(n.Value, "@") {
			if u, err := url.Parse(n.Value); err == nil && u.User != nil {
				if _, ok := u.User.Password(); ok {
					u.User = url.UserPassword(u.User.Username(), redacted)
					n.Value = u.String()
				}
			}
		}
	}
}
