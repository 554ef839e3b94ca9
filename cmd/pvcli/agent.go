package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// monitorLevels are the levels pvcli monitor takes.
var monitorLevels = []string{"trace", "debug", "info", "warn", "error"}

// maxDebugDuration is the agent's bound on the CPU profile of a bundle.
const maxDebugDuration = 5 * time.Minute

func (a *app) newMonitorCmd() *cobra.Command {
	var node, level string
	cmd := &cobra.Command{
		Use:   "monitor",
		Short: "Print an agent's log lines as they are written, until interrupted (or --timeout)",
		Long: `monitor streams the log of the agent asked, or with --node of another node (the
agent asked relays it), from now on: every line at --level or above, whatever
level the agent writes its log at (a monitor at debug sees debug lines of an
agent that logs at info). Lines are text (key=value); with -o json each line is
one JSON object. Lines a slow monitor could not take are counted on stderr, the
agent never waits for it. Ctrl-C ends it with exit status 0. Needs the verb
monitor on the resource agent.`,
		Args: positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			if !slices.Contains(monitorLevels, level) {
				return usagef("invalid --level %q: want one of %s", level, strings.Join(monitorLevels, ", "))
			}
			if a.opts.output.value == "yaml" {
				return usagef("monitor prints lines as text or, with -o json, JSON objects: -o yaml does not apply")
			}
			return a.backendCall(cmd, true, func(ctx context.Context, _ *clientConn) error {
				stream, err := a.conn.agent.Monitor(ctx, connect.NewRequest(&clusterv1.MonitorRequest{
					Node: node, Level: level, Json: a.opts.output.value == "json",
				}))
				if err != nil {
					if ctx.Err() != nil {
						return nil
					}
					return err
				}
				defer stream.Close()
				for stream.Receive() {
					m := stream.Msg()
					if n := m.GetDropped(); n > 0 {
						fmt.Fprintf(a.stderr, "# %s: %d lines dropped (this monitor read too slowly)\n", m.GetNode(), n)
					}
					if m.GetLine() == "" {
						if a.opts.verbose {
							fmt.Fprintf(a.stderr, "# monitoring %s at %s\n", m.GetNode(), level)
						}
						continue
					}
					if _, err := fmt.Fprintln(a.stdout, m.GetLine()); err != nil {
						return err
					}
				}
				// Ctrl-C, or the end of --timeout, ends a monitor: not an
				// error.
				return watchErr(ctx, stream.Err())
			})
		}),
	}
	cmd.Flags().StringVar(&node, "node", "", "the node whose log to stream (default: the agent asked)")
	cmd.Flags().StringVar(&level, "level", "info", "the lowest level printed: "+strings.Join(monitorLevels, "|"))
	return cmd
}

func (a *app) newDebugCmd() *cobra.Command {
	var (
		nodes    []string
		duration time.Duration
		output   string
		logLines int32
	)
	cmd := &cobra.Command{
		Use:   "debug",
		Short: "Write a support bundle of every node (profiles, metrics, health, peers, members, configuration, log) to a tar.gz",
		Long: `debug collects, from every member the agent asked knows (or the --node ones), one
node after the other: goroutines.txt (every goroutine's stack), heap.pprof,
cpu.pprof (a CPU profile of --duration), metrics.txt, health.json, ready.json,
members.json, peers.json (the node's own views), config.yaml (the configuration
in force, secrets redacted: the files that hold keys are named, never read) and
log.txt (the last --log-lines lines the node wrote). It writes --output, a
tar.gz with a directory per node and index.json, which lists each node's files
and what failed. Progress goes to stderr. A node that cannot be reached is
recorded with its error and the others are collected. Needs the verb debug on
the resource agent.`,
		Args: positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			if duration < 0 || duration > maxDebugDuration {
				return usagef("invalid --duration %v: want 0 (no CPU profile) to %v", duration, maxDebugDuration)
			}
			if logLines < 0 {
				return usagef("invalid --log-lines %d: want 0 (all the node keeps) or more", logLines)
			}
			if output == "" {
				output = fmt.Sprintf("pivirt-debug-%s.tar.gz", time.Now().UTC().Format("20060102T150405Z"))
			}
			if !a.opts.timeoutSet {
				// Every node's profile, and the rest, one after the other.
				a.opts.timeout = time.Hour
			}
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				if len(nodes) == 0 {
					resp, err := c.api.Members(ctx, connect.NewRequest(&clusterv1.MembersRequest{}))
					if err != nil {
						return err
					}
					for _, m := range resp.Msg.GetMembers() {
						nodes = append(nodes, m.GetName())
					}
					slices.Sort(nodes)
				}
				return a.writeBundle(ctx, output, nodes, &clusterv1.DebugRequest{Duration: durationpb.New(duration), LogLines: logLines})
			})
		}),
	}
	f := cmd.Flags()
	f.StringSliceVar(&nodes, "node", nil, "collect only from these nodes (repeat or separate with commas; default: every member)")
	f.DurationVar(&duration, "duration", 30*time.Second, "how long each node's CPU profile takes (0: none; at most 5m)")
	f.StringVar(&output, "output", "", "the bundle to write (default pivirt-debug-<UTC time>.tar.gz)")
	f.Int32Var(&logLines, "log-lines", 0, "how many of each node's last log lines (0: all it keeps, up to 1000)")
	return cmd
}

// bundleIndex is the bundle's index.json.
type bundleIndex struct {
	Created time.Time         `json:"created"`
	Nodes   []bundleNodeIndex `json:"nodes"`
}

type bundleNodeIndex struct {
	Node string `json:"node"`
	// Files collected, and the errors of those that failed.
	Files  []string          `json:"files"`
	Failed map[string]string `json:"failed,omitempty"`
	// Error: the node could not be asked (or its stream broke off).
	Error string `json:"error,omitempty"`
}

// writeBundle collects each node's files into a tar.gz at path: written to
// path.tmp and renamed when complete.
func (a *app) writeBundle(ctx context.Context, path string, nodes []string, req *clusterv1.DebugRequest) (err error) {
	f, err := os.OpenFile(path+".tmp", os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	gz := gzip.NewWriter(f)
	tw := tar.NewWriter(gz)
	root := strings.TrimSuffix(strings.TrimSuffix(filepath.Base(path), ".gz"), ".tar")
	now := time.Now()
	add := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: root + "/" + name, Mode: 0o600, Size: int64(len(data)), ModTime: now, Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	index := bundleIndex{Created: now.UTC()}
	failed := 0
	for _, node := range nodes {
		ni := a.collectNode(ctx, node, req, add)
		if ni.Error != "" || len(ni.Failed) > 0 {
			failed++
		}
		if ni.Error != "" {
			if err := add(node+"/error.txt", []byte(ni.Error+"\n")); err != nil {
				return err
			}
		}
		index.Nodes = append(index.Nodes, ni)
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	b, err := json.MarshalIndent(index, "", "  ")
	if err != nil {
		return err
	}
	if err := add("index.json", append(b, '\n')); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := gz.Close(); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return err
	}
	fmt.Fprintf(a.stderr, "wrote %s: %d nodes, %d with failures\n", path, len(nodes), failed)
	fmt.Fprintln(a.stdout, path)
	return nil
}

// collectNode streams one node's files into the bundle, saying on stderr
// what it collects.
func (a *app) collectNode(ctx context.Context, node string, req *clusterv1.DebugRequest, add func(string, []byte) error) bundleNodeIndex {
	ni := bundleNodeIndex{Node: node}
	fail := func(err error) bundleNodeIndex {
		ni.Error = err.Error()
		fmt.Fprintf(a.stderr, "%s: failed: %v\n", node, err)
		return ni
	}
	r := &clusterv1.DebugRequest{Node: node, Duration: req.GetDuration(), LogLines: req.GetLogLines()}
	stream, err := a.conn.agent.Debug(ctx, connect.NewRequest(r))
	if err != nil {
		return fail(err)
	}
	defer stream.Close()
	var data bytes.Buffer
	for stream.Receive() {
		m := stream.Msg()
		switch {
		case m.GetStarted():
			data.Reset()
			if m.GetFile() == "cpu.pprof" {
				fmt.Fprintf(a.stderr, "%s: %s (%v)...\n", node, m.GetFile(), req.GetDuration().AsDuration())
			}
		case m.GetDone() && m.GetError() != "":
			if ni.Failed == nil {
				ni.Failed = map[string]string{}
			}
			ni.Failed[m.GetFile()] = m.GetError()
			fmt.Fprintf(a.stderr, "%s: %s failed: %s\n", node, m.GetFile(), m.GetError())
		case m.GetDone():
			if err := add(node+"/"+filepath.Base(m.GetFile()), data.Bytes()); err != nil {
				return fail(err)
			}
			ni.Files = append(ni.Files, m.GetFile())
			fmt.Fprintf(a.stderr, "%s: %s done (%s)\n", node, m.GetFile(), byteSize(data.Len()))
		default:
			data.Write(m.GetData())
		}
	}
	if err := stream.Err(); err != nil {
		return fail(err)
	}
	return ni
}

// byteSize is n bytes for people.
func byteSize(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
