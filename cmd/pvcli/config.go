package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

func (a *app) newConfigCmd() *cobra.Command {
	return groupCmd("config", "Read and change the versioned cluster-wide configuration",
		&cobra.Command{
			Use:   "get KEY",
			Short: "Print the current value of a key (the whole entry with --output json|yaml)",
			Args:  positional("KEY"),
			RunE:  a.command(a.configGet),
		},
		&cobra.Command{
			Use:   "list",
			Short: "List all keys with their current revision",
			Args:  positional(),
			RunE:  a.command(a.configList),
		},
		a.newConfigSetCmd(),
		a.newConfigDeleteCmd(),
		&cobra.Command{
			Use:   "history KEY",
			Short: "List the retained versions of a key, newest first",
			Args:  positional("KEY"),
			RunE:  a.command(a.configHistory),
		},
	)
}

// casFlag is the optional --cas REVISION of a conditional write.
type casFlag struct {
	revision uint64
}

func (c *casFlag) register(cmd *cobra.Command) {
	cmd.Flags().Uint64Var(&c.revision, "cas", 0,
		"write only if the key's current revision is REV (0 = only if the key does not exist)")
}

// get returns the cas_revision field: nil unless --cas was given.
func (c *casFlag) get(cmd *cobra.Command) *uint64 {
	if !cmd.Flags().Changed("cas") {
		return nil
	}
	rev := c.revision
	return &rev
}

func (a *app) newConfigSetCmd() *cobra.Command {
	var (
		file string
		cas  casFlag
	)
	c := &cobra.Command{
		Use:   "set KEY [VALUE]",
		Short: "Set a key to VALUE or to the contents of --file (- reads stdin)",
		Args:  setArgs,
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			value, err := a.configValue(args[1:], file, cmd.Flags().Changed("file"))
			if err != nil {
				return err
			}
			req := &clusterv1.SetConfigRequest{
				Key:         args[0],
				Value:       value,
				CasRevision: cas.get(cmd),
				Write:       a.writeOptions(),
			}
			return a.configSet(cmd, req)
		}),
	}
	c.Flags().StringVarP(&file, "file", "f", "", "read the value from this file (- = stdin)")
	cas.register(c)
	return c
}

// setArgs validates "set KEY [VALUE]": VALUE may be empty, KEY may not.
func setArgs(cmd *cobra.Command, args []string) error {
	if err := positional("KEY", "[VALUE]")(cmd, args[:min(len(args), 1)]); err != nil {
		return err
	}
	if len(args) > 2 {
		return usagef("unexpected argument %q (usage: %s)", args[2], cmd.UseLine())
	}
	return nil
}

// configValue returns the value of "config set" from exactly one of the VALUE
// argument and --file.
func (a *app) configValue(args []string, file string, fileSet bool) (string, error) {
	switch {
	case len(args) > 0 && fileSet:
		return "", usagef("give either VALUE or --file, not both")
	case len(args) > 0:
		return args[0], nil
	case !fileSet:
		return "", usagef("missing argument VALUE (or --file FILE)")
	case file == "":
		return "", usagef("invalid --file: must name a file, or - for stdin")
	}
	var (
		b   []byte
		err error
	)
	if file == "-" {
		b, err = io.ReadAll(a.stdin)
	} else {
		b, err = os.ReadFile(file)
	}
	if err != nil {
		return "", &usageError{err: fmt.Errorf("read --file: %w", err)}
	}
	return string(b), nil
}

func (a *app) configSet(cmd *cobra.Command, req *clusterv1.SetConfigRequest) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.SetConfig(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, func(w io.Writer) {
			fmt.Fprintf(w, "Set %s (revision %d)\n", req.Key, resp.Msg.GetEntry().GetRevision())
		})
	})
}

func (a *app) newConfigDeleteCmd() *cobra.Command {
	var cas casFlag
	c := &cobra.Command{
		Use:   "delete KEY",
		Short: "Delete a key",
		Args:  positional("KEY"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			req := &clusterv1.DeleteConfigRequest{Key: args[0], CasRevision: cas.get(cmd), Write: a.writeOptions()}
			return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
				resp, err := api.DeleteConfig(ctx, connect.NewRequest(req))
				if err != nil {
					return err
				}
				return a.render(resp.Msg, func(w io.Writer) {
					fmt.Fprintf(w, "Deleted %s (index %d)\n", req.Key, resp.Msg.GetIndex())
				})
			})
		}),
	}
	cas.register(c)
	return c
}

func (a *app) configGet(cmd *cobra.Command, args []string) error {
	req := &clusterv1.GetConfigRequest{Key: args[0], Read: a.readOptions()}
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.GetConfig(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		entry := resp.Msg.GetEntry()
		if entry == nil {
			entry = &clusterv1.ConfigEntry{}
		}
		if a.opts.output.value != "table" {
			return a.render(entry, nil)
		}
		// The raw value, so that "pvcli config get KEY > FILE" round-trips
		// through "pvcli config set KEY --file FILE"; a newline is added
		// only where the value lacks one.
		v := entry.GetValue()
		if v != "" && !strings.HasSuffix(v, "\n") {
			v += "\n"
		}
		_, err = io.WriteString(a.stdout, v)
		return err
	})
}

func (a *app) configList(cmd *cobra.Command, _ []string) error {
	req := &clusterv1.ListConfigRequest{Read: a.readOptions()}
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.ListConfig(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, func(w io.Writer) {
			row(w, "KEY", "REVISION", "UPDATED", "VALUE")
			for _, e := range resp.Msg.GetEntries() {
				row(w, e.GetKey(), formatUint(e.GetRevision()), formatTime(e.GetUpdatedAt()), truncate(e.GetValue()))
			}
		})
	})
}

func (a *app) configHistory(cmd *cobra.Command, args []string) error {
	req := &clusterv1.ConfigHistoryRequest{Key: args[0], Read: a.readOptions()}
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.ConfigHistory(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, func(w io.Writer) {
			row(w, "REVISION", "UPDATED", "VALUE")
			for _, e := range resp.Msg.GetEntries() {
				row(w, formatUint(e.GetRevision()), formatTime(e.GetUpdatedAt()), truncate(e.GetValue()))
			}
		})
	})
}
