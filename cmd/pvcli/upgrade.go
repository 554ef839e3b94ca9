package main

import (
	"context"
	"fmt"
	"io"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// The commands of upgrades and downgrades: the cluster version, each
// server's release, the comparison of the replicas, and a downgrade.

func (a *app) newClusterVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Show the cluster version (the lowest release of the servers, agreed through Raft) and the features it enables",
		Long: `version asks the leader for the cluster version: the lowest major.minor release of
the servers, agreed through Raft. What a release adds (a command, a table, a
field, a snapshot format, an agent-to-agent call) is used only once the cluster
version allows it, so agents of the previous release keep working beside it
during a rolling upgrade. pvcli operator upgrade status shows each server.`,
		Args: positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
				resp, err := api.ClusterVersion(ctx, connect.NewRequest(&clusterv1.ClusterVersionRequest{}))
				if err != nil {
					return err
				}
				v := resp.Msg
				return a.render(v, func(w io.Writer) {
					fmt.Fprintf(w, "Cluster version:\t%s\n", v.GetClusterVersion())
					if v.GetDowngrade() != "" {
						fmt.Fprintf(w, "Downgrade:\tunder way to %s (pvcli operator downgrade cancel ends it)\n", v.GetDowngrade())
					}
					fmt.Fprintf(w, "Lowest server version:\t%s\n", v.GetLowest())
					fmt.Fprintf(w, "Features:\t%s\n", orText(strings.Join(v.GetFeatures(), ", "), "none (the agents before cluster versions)"))
				})
			})
		}),
	}
}

func (a *app) newUpgradeCmd() *cobra.Command {
	return groupCmd("upgrade", "Rolling upgrades: the cluster version and each server's release",
		&cobra.Command{
			Use:   "status",
			Short: "Each server's release, the features it knows, and whether it is caught up and applying the log",
			Long: `status asks the leader for the cluster version and, for every Raft server
(voters and non-voters), its release, the cluster version that release runs,
the features it knows, its applied index and whether it caught up with the
leader. A server that stopped applying the log (it met an entry of a newer
release) says why. Exit status 1 when a server is not caught up, stopped, or runs
a release older than the cluster version: the upgrade is not done.`,
			Args: positional(),
			RunE: a.command(a.upgradeStatus),
		},
	)
}

func (a *app) upgradeStatus(cmd *cobra.Command, _ []string) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.ClusterVersion(ctx, connect.NewRequest(&clusterv1.ClusterVersionRequest{}))
		if err != nil {
			return err
		}
		v := resp.Msg
		var problems []string
		for _, s := range v.GetServers() {
			switch {
			case s.GetHalted() != "":
				problems = append(problems, s.GetName()+" stopped applying the log")
			case s.GetError() != "":
				problems = append(problems, s.GetName()+": "+s.GetError())
			case versionLess(s.GetVersion(), v.GetClusterVersion()):
				problems = append(problems, s.GetName()+" runs a release older than the cluster version")
			case !s.GetCaughtUp():
				problems = append(problems, s.GetName()+" is not caught up")
			}
		}
		if err := a.render(v, func(w io.Writer) {
			fmt.Fprintf(w, "Cluster version:\t%s\n", v.GetClusterVersion())
			if v.GetDowngrade() != "" {
				fmt.Fprintf(w, "Downgrade:\tunder way to %s\n", v.GetDowngrade())
			}
			fmt.Fprintf(w, "Leader:\t%s (release %s, applied index %d)\n\n", v.GetLeader(), v.GetRelease(), v.GetLeaderAppliedIndex())
			row(w, "NAME", "RELEASE", "VERSION", "VOTER", "GOSSIP", "APPLIED", "CAUGHT-UP", "STATUS")
			for _, s := range v.GetServers() {
				release := s.GetRelease()
				if s.GetProtocol() < 2 && release != "" {
					release += " (before cluster versions)"
				}
				status := "ok"
				switch {
				case s.GetHalted() != "":
					status = "STOPPED: " + s.GetHalted()
				case s.GetError() != "":
					status = s.GetError()
				case versionLess(s.GetVersion(), v.GetClusterVersion()):
					status = "older than the cluster version: cannot apply its log; upgrade it"
				case versionLess(v.GetClusterVersion(), s.GetVersion()):
					status = "ok; the cluster version rises once every server runs " + s.GetVersion()
				}
				row(w, s.GetName(), orText(release, "-"), s.GetVersion(), fmt.Sprint(s.GetVoter()), enumName(s.GetGossipStatus()),
					formatUint(s.GetAppliedIndex()), fmt.Sprint(s.GetCaughtUp()), status)
			}
		}); err != nil {
			return err
		}
		if len(problems) > 0 {
			return fmt.Errorf("the upgrade is not done: %s", strings.Join(problems, "; "))
		}
		return nil
	})
}

// versionLess compares two "major.minor" strings (an unparsable one is
// never less).
func versionLess(a, b string) bool {
	var am, an, bm, bn int
	if _, err := fmt.Sscanf(a, "%d.%d", &am, &an); err != nil {
		return false
	}
	if _, err := fmt.Sscanf(b, "%d.%d", &bm, &bn); err != nil {
		return false
	}
	return am < bm || (am == bm && an < bn)
}

func (a *app) newRaftCmd() *cobra.Command {
	return groupCmd("raft", "The replicated state",
		&cobra.Command{
			Use:   "verify",
			Short: "Compare every server's replicated state with the leader's at one log index, table by table",
			Long: `verify makes the leader append a checkpoint to the Raft log; every server keeps
the hash of its state as of that entry, table by table, and the leader compares
them with its own (as etcdctl endpoint hashkv compares etcd's members). It
changes no state. A server of a release that keeps no state hashes is named as
not checked (compare its snapshot: pvcli snapshot inspect --hash). Exit status 1
when a server's state differs from the leader's, or a server could not be
checked.`,
			Args: positional(),
			RunE: a.command(a.raftVerify),
		},
	)
}

func (a *app) raftVerify(cmd *cobra.Command, _ []string) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.VerifyReplicas(ctx, connect.NewRequest(&clusterv1.VerifyReplicasRequest{}))
		if err != nil {
			return err
		}
		v := resp.Msg
		var differ, unchecked []string
		for _, n := range v.GetNodes() {
			if len(n.GetDiffer()) > 0 {
				differ = append(differ, n.GetName()+" ("+strings.Join(n.GetDiffer(), ", ")+")")
			}
			if n.GetError() != "" {
				unchecked = append(unchecked, n.GetName())
			}
		}
		if err := a.render(v, func(w io.Writer) {
			fmt.Fprintf(w, "Checkpoint index:\t%d\n", v.GetIndex())
			fmt.Fprintf(w, "Cluster version:\t%s\n\n", v.GetClusterVersion())
			row(w, "NAME", "ROLE", "RESULT")
			for _, n := range v.GetNodes() {
				role := "follower"
				if n.GetLeader() {
					role = "leader"
				}
				result := "agrees on every table"
				switch {
				case n.GetLeader():
					result = "reference"
				case len(n.GetDiffer()) > 0:
					result = "DIFFERS in " + strings.Join(n.GetDiffer(), ", ")
				case n.GetError() != "":
					result = n.GetError()
				}
				row(w, n.GetName(), role, result)
			}
			if ref := leaderTables(v); len(ref) > 0 {
				fmt.Fprintln(w)
				row(w, "TABLE", "RECORDS", "SHA256 (leader)")
				for _, t := range ref {
					row(w, t.GetName(), formatUint(t.GetRecords()), t.GetSum())
				}
			}
		}); err != nil {
			return err
		}
		switch {
		case len(differ) > 0:
			return fmt.Errorf("replicas differ from the leader's state at index %d: %s", v.GetIndex(), strings.Join(differ, "; "))
		case len(unchecked) > 0:
			return fmt.Errorf("not every server was checked: %s", strings.Join(unchecked, ", "))
		}
		return nil
	})
}

func leaderTables(v *clusterv1.VerifyReplicasResponse) []*clusterv1.TableHash {
	for _, n := range v.GetNodes() {
		if n.GetLeader() {
			return n.GetTables()
		}
	}
	return nil
}

func (a *app) newDowngradeCmd() *cobra.Command {
	action := func(act clusterv1.DowngradeAction, needVersion bool) func(*cobra.Command, []string) error {
		return func(cmd *cobra.Command, args []string) error {
			req := &clusterv1.DowngradeRequest{Action: act}
			if needVersion {
				req.Version = args[0]
			}
			return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
				resp, err := api.Downgrade(ctx, connect.NewRequest(req))
				if err != nil {
					return err
				}
				v := resp.Msg
				return a.render(v, func(w io.Writer) {
					fmt.Fprintf(w, "Cluster version:\t%s\n", v.GetClusterVersion())
					if v.GetDowngrade() != "" {
						fmt.Fprintf(w, "Held at:\t%s\n", v.GetDowngrade())
					}
					for _, c := range v.GetChanges() {
						fmt.Fprintf(w, "Changes:\t%s\n", c)
					}
					if v.GetNext() != "" {
						fmt.Fprintf(w, "Next:\t%s\n", v.GetNext())
					}
				})
			})
		}
	}
	return groupCmd("downgrade", "Go back to an older release: validate, enable or cancel a downgrade of the cluster version",
		&cobra.Command{
			Use:   "validate VERSION",
			Short: "Say whether the cluster can go down to VERSION (major.minor) and what changes; nothing is changed",
			Args:  positional("VERSION"),
			RunE:  a.command(action(clusterv1.DowngradeAction_DOWNGRADE_ACTION_VALIDATE, true)),
		},
		&cobra.Command{
			Use:   "enable VERSION",
			Short: "Lower the cluster version to VERSION and hold it there, so that agents of that release can start on the data",
			Long: `enable validates the downgrade, then lowers the cluster version to VERSION at one
log index: every node converts its state there (what the older release cannot
hold is dropped or rewritten, as validate lists), the features of the newer
release stop, and snapshots are written in the older format. The cluster stays
at VERSION until a server runs that release (or pvcli operator downgrade cancel).
Then stop the agents one at a time and start the older release on their data
dirs.`,
			Args: positional("VERSION"),
			RunE: a.command(action(clusterv1.DowngradeAction_DOWNGRADE_ACTION_ENABLE, true)),
		},
		&cobra.Command{
			Use:   "cancel",
			Short: "End the hold of a downgrade: the leader raises the cluster version again once every server runs a newer release",
			Args:  positional(),
			RunE:  a.command(action(clusterv1.DowngradeAction_DOWNGRADE_ACTION_CANCEL, false)),
		},
	)
}
