package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

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
