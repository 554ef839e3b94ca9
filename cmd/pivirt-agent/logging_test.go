package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/coreos/pkg/capnslog"
	"go.opentelemetry.io/otel"
	"google.golang.org/grpc/grpclog"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/observe"
)

// TestLogDurations: the agent's log and access log write a duration as
// its String ("1.5s") in JSON and in text, at the top level, among a
// logger's attributes and in a group; never as nanoseconds.
func TestLogDurations(t *testing.T) {
	for _, format := range []string{"json", "text"} {
		t.Run(format, func(t *testing.T) {
			cfg := config.Default()
			cfg.Logging.Format = format
			cfg.Logging.AccessLog = config.AccessLogConfig{Enabled: true, Format: format}
			var buf bytes.Buffer
			logger, err := newLogger(cfg, &buf, new(observe.Levels))
			if err != nil {
				t.Fatal(err)
			}
			logger.With("interval", 30*time.Second).WithGroup("g").Info("done", "took", 1500*time.Millisecond)
			newAccessLogger(cfg, &buf).Info("access", "duration", 250*time.Millisecond)

			lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
			if len(lines) != 2 {
				t.Fatalf("%d lines, want 2:\n%s", len(lines), buf.String())
			}
			if format == "text" {
				for _, want := range []string{"interval=30s", "g.took=1.5s"} {
					if !strings.Contains(lines[0], want) {
						t.Errorf("line %q lacks %s", lines[0], want)
					}
				}
				if !strings.Contains(lines[1], "duration=250ms") {
					t.Errorf("access line %q lacks duration=250ms", lines[1])
				}
				return
			}
			var line struct {
				Interval any `json:"interval"`
				G        struct {
					Took any `json:"took"`
				} `json:"g"`
			}
			var access struct {
				Duration any `json:"duration"`
			}
			if err := json.Unmarshal([]byte(lines[0]), &line); err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal([]byte(lines[1]), &access); err != nil {
				t.Fatal(err)
			}
			if line.Interval != "30s" || line.G.Took != "1.5s" || access.Duration != "250ms" {
				t.Errorf("interval %v, took %v, access duration %v; want \"30s\", \"1.5s\", \"250ms\":\n%s", line.Interval, line.G.Took, access.Duration, buf.String())
			}
		})
	}
}

// TestLibraryLogsInTheAgentsFormat: after routeLibraryLogs, what the
// standard log package, capnslog, OpenTelemetry and gRPC print reaches the
// agent's log as JSON lines with their component — no plain-text line (as
// capnslog's takeover of the log package printed an exporter's timeout).
// The globals are set in a child process of this test binary.
func TestLibraryLogsInTheAgentsFormat(t *testing.T) {
	if os.Getenv("PIVIRT_LIBRARY_LOGS_CHILD") == "1" {
		routeLibraryLogs(slog.New(slog.NewJSONHandler(os.Stdout, &slog.HandlerOptions{Level: slog.LevelDebug})))
		log.Print("a line of the log package")
		capnslog.NewPackageLogger("github.com/coreos/etcd", "pkg/fileutil").Warningf("a capnslog line")
		otel.Handle(errors.New("traces export: exporter export timeout"))
		grpclog.Error("a grpc error")
		os.Exit(0)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestLibraryLogsInTheAgentsFormat$")
	cmd.Env = append(os.Environ(), "PIVIRT_LIBRARY_LOGS_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	want := map[string]string{
		"a line of the log package": "stdlog",
		"a capnslog line":           "capnslog",
		"opentelemetry: traces export: exporter export timeout": "otel",
		"a grpc error": "grpc",
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Errorf("not a JSON line: %q", line)
			continue
		}
		msg, _ := rec["msg"].(string)
		if comp, ok := want[msg]; ok && rec["component"] == comp {
			delete(want, msg)
		}
	}
	if len(want) != 0 {
		t.Errorf("not logged with their component: %v\n%s", want, out)
	}
}
