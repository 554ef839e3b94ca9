package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/pmezard/go-difflib/difflib"
	"github.com/spf13/cobra"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

func (a *app) newConfigCmd() *cobra.Command {
	return groupCmd("config", "Read and change the versioned cluster-wide configuration",
		a.newConfigWatchCmd(),
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
		a.newConfigRollbackCmd(),
		&cobra.Command{
			Use:   "status",
			Short: "Show, per node, the cluster settings it applied and any it could not apply",
			Args:  positional(),
			RunE:  a.command(a.configStatus),
		},
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
		file          string
		cas           casFlag
		dryRun, force bool
	)
	c := &cobra.Command{
		Use:   "set KEY [VALUE]",
		Short: "Set a key to VALUE or to the contents of --file (- reads stdin)",
		Long: `Set a cluster setting (` + strings.Join(config.SettingKeys(), ", ") + `)
or a free-form key under kv/.

A setting's value is the YAML (or JSON) of that key as it would appear in the
agent's configuration file; every agent applies it on top of its file within
a second, unless its file pins the key (pinned_settings). A value that does
not validate is refused and nothing is stored. --dry-run shows the change and
the validation result without storing anything.`,
		Args: setArgs,
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
				DryRun:      dryRun,
				Force:       force,
			}
			return a.configSet(cmd, req)
		}),
	}
	c.Flags().StringVarP(&file, "file", "f", "", "read the value from this file (- = stdin)")
	c.Flags().BoolVar(&dryRun, "dry-run", false, "validate and show the change without storing it")
	c.Flags().BoolVar(&force, "force", false, "store an RBAC policy even if it takes away your own right to change it")
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
		var cur *clusterv1.ConfigEntry
		if req.DryRun {
			// The version to compare with, read like any read (from the
			// leader by default): the node asked may not have the latest.
			got, err := api.GetConfig(ctx, connect.NewRequest(&clusterv1.GetConfigRequest{Key: req.Key, Read: a.readOptions()}))
			switch {
			case err == nil:
				cur = got.Msg.GetEntry()
			case connect.CodeOf(err) != connect.CodeNotFound:
				return err
			}
		}
		resp, err := api.SetConfig(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		if resp.Msg.GetDryRun() {
			resp.Msg.Entry = cur
			return a.render(resp.Msg, func(w io.Writer) {
				from := fmt.Sprintf("%s (revision %d)", req.Key, cur.GetRevision())
				if cur == nil {
					from = req.Key + " (not set)"
				}
				fmt.Fprint(w, unifiedDiff(cur.GetValue(), req.Value, from, req.Key+" (new)"))
				fmt.Fprintf(w, "Valid: %s would be set (dry run: nothing stored)\n", req.Key)
			})
		}
		applied := a.waitApplied(ctx, api, req.Key, resp.Msg.GetEntry().GetRevision())
		return a.render(resp.Msg, func(w io.Writer) {
			fmt.Fprintf(w, "Set %s (revision %d)\n", req.Key, resp.Msg.GetEntry().GetRevision())
			fmt.Fprint(w, applied)
		})
	})
}

// applyWait bounds how long a change of a cluster setting waits for the
// nodes to apply it (they do within a second of reaching them).
const applyWait = 5 * time.Second

// waitApplied waits, for a cluster setting changed at revision rev (not a
// kv/ key), until every node the agent asked can reach has applied it or
// failed to (ConfigStatus), at most applyWait: the next command, through
// any node, then finds it in force. It returns the lines that say so ("" for
// a kv/ key).
func (a *app) waitApplied(ctx context.Context, api clusterv1connect.ClusterServiceClient, key string, rev uint64) string {
	if strings.HasPrefix(key, "kv/") || rev == 0 {
		return ""
	}
	ctx, cancel := context.WithTimeout(ctx, applyWait)
	defer cancel()
	var nodes []*clusterv1.NodeConfigStatus
	for {
		resp, err := api.ConfigStatus(ctx, connect.NewRequest(&clusterv1.ConfigStatusRequest{}))
		if err == nil {
			nodes = resp.Msg.GetNodes()
			if !slices.ContainsFunc(nodes, func(n *clusterv1.NodeConfigStatus) bool {
				return n.GetError() == "" && n.GetRevision() < rev && n.GetFailedRevision() < rev
			}) {
				break
			}
		} else if c := connect.CodeOf(err); c != connect.CodeUnavailable && c != connect.CodeDeadlineExceeded {
			break // not allowed to ask (config list), or an agent without it: no wait
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond): // poll, bounded by applyWait
			continue
		}
		break
	}
	if len(nodes) == 0 {
		return "" // not allowed to ask, or an agent without ConfigStatus
	}
	var applied int
	var notes []string
	for _, n := range nodes {
		switch {
		case n.GetError() != "":
			notes = append(notes, fmt.Sprintf("  %s: not asked (%s); it applies the setting when it is back", n.GetNode(), n.GetError()))
		case n.GetRevision() >= rev:
			applied++
		case n.GetFailedRevision() >= rev:
			notes = append(notes, fmt.Sprintf("  %s: not applied: %s", n.GetNode(), n.GetApplyError()))
		default:
			notes = append(notes, fmt.Sprintf("  %s: not yet applied (pvcli config status)", n.GetNode()))
		}
	}
	if applied == len(nodes) {
		return fmt.Sprintf("In force on every node (%d)\n", applied)
	}
	return fmt.Sprintf("In force on %d of %d nodes:\n%s\n", applied, len(nodes), strings.Join(notes, "\n"))
}

// unifiedDiff is the change from a to b as a unified diff ("" when equal).
func unifiedDiff(a, b, fromName, toName string) string {
	if a == b {
		return "(no change)\n"
	}
	lines := func(s string) []string {
		if s == "" {
			return nil
		}
		return difflib.SplitLines(strings.TrimSuffix(s, "\n")) // each line ends in "\n"
	}
	out, err := difflib.GetUnifiedDiffString(difflib.UnifiedDiff{
		A: lines(a), B: lines(b),
		FromFile: fromName, ToFile: toName, Context: 3,
	})
	if err != nil {
		return err.Error() + "\n"
	}
	return out
}

func (a *app) newConfigRollbackCmd() *cobra.Command {
	var (
		to            uint64
		dryRun, force bool
	)
	c := &cobra.Command{
		Use:   "rollback KEY [--to REVISION]",
		Short: "Set a key back to an earlier version from its history (default: the one before the current)",
		Long: `Set KEY back to an earlier value from "pvcli config history KEY": the version
before the current one, or the one written at --to REVISION. The old value is
validated as a new write would be, and written only if the key is still at the
revision read (a concurrent change makes the rollback fail; run it again).`,
		Args: positional("KEY"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			var target, current *clusterv1.ConfigEntry
			err := a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
				resp, err := api.ConfigHistory(ctx, connect.NewRequest(&clusterv1.ConfigHistoryRequest{
					Key: args[0], Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_DEFAULT},
				}))
				if err != nil {
					return err
				}
				hist := resp.Msg.GetEntries() // newest first
				if len(hist) == 0 {
					return fmt.Errorf("%s has no history (not set)", args[0])
				}
				current = hist[0]
				var revs []string
				for _, e := range hist[1:] {
					revs = append(revs, formatUint(e.GetRevision()))
					if (!cmd.Flags().Changed("to") && target == nil) || e.GetRevision() == to {
						target = e
					}
				}
				switch {
				case len(hist) == 1:
					return fmt.Errorf("%s has no earlier version than revision %d (delete it to go back to each node's file)", args[0], current.GetRevision())
				case target == nil && to == current.GetRevision():
					return fmt.Errorf("revision %d is the current version of %s", to, args[0])
				case target == nil:
					return fmt.Errorf("%s has no version at revision %d; earlier versions kept: %s", args[0], to, strings.Join(revs, ", "))
				}
				return nil
			})
			if err != nil {
				return err
			}
			rev := current.GetRevision()
			return a.configSet(cmd, &clusterv1.SetConfigRequest{
				Key: args[0], Value: target.GetValue(), CasRevision: &rev,
				Write: a.writeOptions(), DryRun: dryRun, Force: force,
			})
		}),
	}
	c.Flags().Uint64Var(&to, "to", 0, "the revision to go back to (default: the version before the current)")
	c.Flags().BoolVar(&dryRun, "dry-run", false, "validate and show the change without storing it")
	c.Flags().BoolVar(&force, "force", false, "store an RBAC policy even if it takes away your own right to change it")
	return c
}

func (a *app) newConfigDeleteCmd() *cobra.Command {
	var (
		cas   casFlag
		force bool
	)
	c := &cobra.Command{
		Use:   "delete KEY",
		Short: "Delete a key",
		Args:  positional("KEY"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			req := &clusterv1.DeleteConfigRequest{Key: args[0], CasRevision: cas.get(cmd), Write: a.writeOptions(), Force: force}
			return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
				resp, err := api.DeleteConfig(ctx, connect.NewRequest(req))
				if err != nil {
					return err
				}
				applied := a.waitApplied(ctx, api, req.Key, resp.Msg.GetIndex())
				return a.render(resp.Msg, func(w io.Writer) {
					fmt.Fprintf(w, "Deleted %s (index %d)\n", req.Key, resp.Msg.GetIndex())
					fmt.Fprint(w, applied)
				})
			})
		}),
	}
	cas.register(c)
	c.Flags().BoolVar(&force, "force", false, "delete the cluster RBAC policy even if the policy that then applies takes away your right to set one")
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
		return a.render(resp.Msg, configTable(resp.Msg.GetEntries()))
	})
}

func configTable(entries []*clusterv1.ConfigEntry) func(io.Writer) {
	return func(w io.Writer) {
		row(w, "KEY", "REVISION", "UPDATED", "VALUE")
		for _, e := range entries {
			row(w, e.GetKey(), formatUint(e.GetRevision()), formatTime(e.GetUpdatedAt()), truncate(e.GetValue()))
		}
	}
}

func (a *app) configStatus(cmd *cobra.Command, _ []string) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.ConfigStatus(ctx, connect.NewRequest(&clusterv1.ConfigStatusRequest{}))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, func(w io.Writer) {
			row(w, "NODE", "REVISION", "STATUS", "SETTINGS", "PINNED")
			for _, n := range resp.Msg.GetNodes() {
				st := "ok"
				switch {
				case n.GetError() != "":
					st = "unreachable: " + n.GetError()
				case n.GetApplyError() != "":
					st = fmt.Sprintf("revision %d not applied: %s", n.GetFailedRevision(), n.GetApplyError())
				}
				keys := strings.Join(n.GetKeys(), ",")
				if keys == "" {
					keys = "-"
				}
				pinned := strings.Join(n.GetPinned(), ",")
				if pinned == "" {
					pinned = "-"
				}
				row(w, n.GetNode(), formatUint(n.GetRevision()), st, keys, pinned)
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
