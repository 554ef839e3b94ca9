package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// blockingWatch runs a watch as a series of blocking queries: query is
// called with the index of the last answer (0 first) and returns the new
// answer and its index; each answer that differs from the one before is
// printed, the first always. It ends without error when the command's
// context ends (Ctrl-C, or --timeout when given).
func (a *app) blockingWatch(cmd *cobra.Command, query func(ctx context.Context, index uint64) (proto.Message, uint64, error), table func(io.Writer, proto.Message)) error {
	if err := a.connect(cmd); err != nil {
		return err
	}
	if a.opts.waitIndex > 0 || a.opts.wait > 0 {
		return usagef("a watch makes its own blocking queries: --wait-index and --wait do not apply")
	}
	ctx := cmd.Context()
	if a.opts.timeoutSet {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, a.opts.timeout)
		defer cancel()
	}
	var last proto.Message
	var index uint64
	for {
		msg, next, err := query(ctx, index)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		if next < index {
			// The index went back (a restore, or an agent of another
			// cluster): start over rather than wait for a past index.
			next = 0
		}
		index = next
		if last == nil || !proto.Equal(last, msg) {
			if a.opts.output.value == "table" {
				// Each answer is a whole table: say when it came.
				if last != nil {
					fmt.Fprintln(a.stdout)
				}
				fmt.Fprintf(a.stdout, "# %s\n", time.Now().Format(time.TimeOnly))
			}
			if err := a.renderEvent(msg, func(w io.Writer) { table(w, msg) }); err != nil {
				return err
			}
			last = msg
		}
	}
}

// renderEvent writes one event of a stream: with -o json a single line (a
// stream is NDJSON), with -o yaml a document of its own, else the table
// form.
func (a *app) renderEvent(msg proto.Message, table func(w io.Writer)) error {
	switch a.opts.output.value {
	case "json":
		b, err := marshalJSONLine(msg)
		if err != nil {
			return err
		}
		_, err = a.stdout.Write(b)
		return err
	case "yaml":
		if _, err := io.WriteString(a.stdout, "---\n"); err != nil {
			return err
		}
		return a.render(msg, table)
	default:
		return a.render(msg, table)
	}
}

// watchRead is the ReadOptions of a watch's blocking query after index.
func (a *app) watchRead(index uint64) *clusterv1.ReadOptions {
	ro := a.readOptions()
	ro.WaitIndex = index
	return ro
}

func (a *app) newServiceWatchCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "watch NAME",
		Short: "Print the instances of a service, then again at every change, until interrupted (or --timeout)",
		Long: `watch prints the instances of service NAME (none yet is fine), then the whole
list again each time it changes: a registration, a deregistration, a health or
heartbeat change. It is a series of blocking queries, as Consul's watches are;
with -o json each answer is one line (NDJSON). Ctrl-C ends it with exit status 0.`,
		Args: positional("NAME"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			return a.blockingWatch(cmd, func(ctx context.Context, index uint64) (proto.Message, uint64, error) {
				resp, err := a.conn.api.ListServices(ctx, connect.NewRequest(&clusterv1.ListServicesRequest{Service: args[0], Read: a.watchRead(index)}))
				if err != nil {
					return nil, 0, err
				}
				idx := resp.Msg.GetMeta().GetIndex()
				resp.Msg.Meta = nil
				return resp.Msg, idx, nil
			}, func(w io.Writer, m proto.Message) {
				instancesTable(m.(*clusterv1.ListServicesResponse).GetInstances()...)(w)
			})
		}),
	}
}

func (a *app) newConfigWatchCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "watch [PREFIX]",
		Short: "Print the configuration entries (under PREFIX), then again at every change, until interrupted (or --timeout)",
		Long: `watch prints the configuration entries whose keys start with PREFIX (all
without one), then the whole set again each time one of them is set or deleted.
It is a series of blocking queries; with -o json each answer is one line
(NDJSON). Ctrl-C ends it with exit status 0.`,
		Args: positional("[PREFIX]"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			prefix := ""
			if len(args) > 0 {
				prefix = args[0]
			}
			return a.blockingWatch(cmd, func(ctx context.Context, index uint64) (proto.Message, uint64, error) {
				resp, err := a.conn.api.ListConfig(ctx, connect.NewRequest(&clusterv1.ListConfigRequest{Read: a.watchRead(index)}))
				if err != nil {
					return nil, 0, err
				}
				idx := resp.Msg.GetMeta().GetIndex()
				out := &clusterv1.ListConfigResponse{}
				for _, e := range resp.Msg.GetEntries() {
					if strings.HasPrefix(e.GetKey(), prefix) {
						out.Entries = append(out.Entries, e)
					}
				}
				return out, idx, nil
			}, func(w io.Writer, m proto.Message) {
				configTable(m.(*clusterv1.ListConfigResponse).GetEntries())(w)
			})
		}),
	}
}
