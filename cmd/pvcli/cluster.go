package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

func (a *app) newClusterCmd() *cobra.Command {
	return groupCmd("cluster", "Inspect and change cluster membership and Raft leadership",
		a.newClusterMembersCmd(),
		&cobra.Command{
			Use:   "peers",
			Short: "List the Raft servers with their state and replication progress",
			Args:  positional(),
			RunE:  a.command(a.clusterPeers),
		},
		&cobra.Command{
			Use:   "leader",
			Short: "Show the current Raft leader",
			Args:  positional(),
			RunE:  a.command(a.clusterLeader),
		},
		&cobra.Command{
			Use:   "join ADDR...",
			Short: "Make the node asked join the gossip ring through the given gossip addresses",
			Args:  positional("ADDR..."),
			RunE:  a.command(a.clusterJoin),
		},
		&cobra.Command{
			Use:   "leave",
			Short: "Make the node asked leave the cluster gracefully and shut down",
			Args:  positional(),
			RunE:  a.command(a.clusterLeave),
		},
		&cobra.Command{
			Use:   "remove-peer NODE",
			Short: "Remove a server (by node name or node ID) from the Raft configuration",
			Args:  positional("NODE"),
			RunE:  a.command(a.clusterRemovePeer),
		},
		&cobra.Command{
			Use:   "transfer-leader [NODE]",
			Short: "Hand Raft leadership to the given server (node name or node ID), or to the most up-to-date voter",
			Args:  positional("[NODE]"),
			RunE:  a.command(a.clusterTransferLeader),
		},
		a.newForceLeaveCmd(),
		a.newKeyringCmd(),
		a.newClusterVersionCmd(),
	)
}

func (a *app) newForceLeaveCmd() *cobra.Command {
	var prune bool
	c := &cobra.Command{
		Use:   "force-leave NODE",
		Short: "Mark a failed gossip member as left on every member; the leader then removes its Raft server",
		Long: `force-leave tells every live member that the failed member NODE (its gossip
name, as pvcli cluster members shows it) has left: it is shown as left and
forgotten like a member that left gracefully, and the leader removes its Raft
server at once when the remaining voters keep a quorum. A member that is alive
is refused: run pvcli cluster leave against it instead. Should NODE come back,
it rejoins. Its objects leave the placement catalog: lists stop naming the node,
and a call for one of them is answered NotFound (or reaches the node whose
backend holds it now). With --prune every member forgets NODE at once, instead
of listing it as left until gossip forgets it (72 h); a member that still sees
it alive takes it as left when it fails there, and forgets it at the next
force-leave --prune.`,
		Args: positional("NODE"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error { return a.clusterForceLeave(cmd, args, prune) }),
	}
	c.Flags().BoolVar(&prune, "prune", false, "forget the member at once on every member, instead of listing it as left")
	return c
}

func (a *app) clusterForceLeave(cmd *cobra.Command, args []string, prune bool) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.ForceLeave(ctx, connect.NewRequest(&clusterv1.ForceLeaveRequest{Node: args[0], Prune: prune}))
		if err != nil {
			return err
		}
		failed := 0
		for _, n := range resp.Msg.GetNodes() {
			if n.GetError() != "" {
				failed++
			}
		}
		if err := a.render(resp.Msg, func(w io.Writer) {
			row(w, "NODE", "RESULT")
			for _, n := range resp.Msg.GetNodes() {
				result := args[0] + " marked left"
				if prune {
					result = args[0] + " forgotten"
				}
				if n.GetPending() {
					result = "still sees " + args[0] + " alive: marked left once it fails there"
				}
				row(w, n.GetNode(), orText(n.GetError(), result))
			}
		}); err != nil {
			return err
		}
		if failed > 0 {
			return fmt.Errorf("%d of %d members could not be told (above): run force-leave again once an unreachable one is back", failed, len(resp.Msg.GetNodes()))
		}
		return nil
	})
}

func orText(s, otherwise string) string {
	if s == "" {
		return otherwise
	}
	return s
}

func (a *app) newOperatorCmd() *cobra.Command {
	return groupCmd("operator", "Cluster operator tools",
		a.newUpgradeCmd(),
		a.newRaftCmd(),
		a.newDowngradeCmd(),
		groupCmd("autopilot", "How the leader manages the Raft servers",
			&cobra.Command{
				Use:   "state",
				Short: "Each server's health, voter status and stabilization, and why a non-voter was or was not promoted",
				Args:  positional(),
				RunE:  a.command(a.autopilotState),
			},
		),
	)
}

func (a *app) autopilotState(cmd *cobra.Command, _ []string) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.AutopilotState(ctx, connect.NewRequest(&clusterv1.AutopilotStateRequest{}))
		if err != nil {
			return err
		}
		st := resp.Msg
		return a.render(st, func(w io.Writer) {
			fmt.Fprintf(w, "Healthy:\t%t\n", st.GetHealthy())
			fmt.Fprintf(w, "Failure tolerance:\t%d\n", st.GetFailureTolerance())
			fmt.Fprintf(w, "Leader:\t%s\n", st.GetLeader())
			fmt.Fprintf(w, "Voters target:\t%d\n", st.GetVotersTarget())
			fmt.Fprintf(w, "Stabilization:\t%s\n", formatDuration(st.GetStabilization()))
			fmt.Fprintf(w, "Max trailing logs:\t%d\n", st.GetMaxTrailingLogs())
			fmt.Fprintf(w, "Dead server cleanup:\t%s\n\n", formatDuration(st.GetDeadServerCleanup()))
			row(w, "NAME", "ID", "ADDRESS", "VOTER", "GOSSIP", "HEALTHY", "STABLE-SINCE", "TRAILING", "LAST-CONTACT", "STATUS")
			for _, s := range st.GetServers() {
				row(w, s.GetName(), s.GetNodeId(), s.GetAddress(), strconv.FormatBool(s.GetVoter()), enumName(s.GetGossipStatus()),
					strconv.FormatBool(s.GetHealthy()), formatTime(s.GetStableSince()), formatUint(s.GetTrailing()),
					formatDuration(s.GetLastContact()), s.GetStatus())
			}
		})
	})
}

func (a *app) newClusterMembersCmd() *cobra.Command {
	var watch bool
	cmd := &cobra.Command{
		Use:   "members",
		Short: "List the gossip members seen by the node asked",
		Long: `members lists the gossip members the agent asked sees. With --watch it keeps
the list up to date from the agent's status stream (ClusterService.WatchStatus)
and prints it again each time it changes, until interrupted (or --timeout):
Ctrl-C ends it with exit status 0.`,
		Args: positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			if watch {
				return a.watchMembers(cmd)
			}
			return a.clusterMembers(cmd)
		}),
	}
	cmd.Flags().BoolVar(&watch, "watch", false, "print the members again each time they change, until interrupted")
	return cmd
}

func (a *app) clusterMembers(cmd *cobra.Command) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.Members(ctx, connect.NewRequest(&clusterv1.MembersRequest{}))
		if err != nil {
			return err
		}
		return a.renderMembers(resp.Msg)
	})
}

func (a *app) renderMembers(msg *clusterv1.MembersResponse) error {
	return a.render(msg, func(w io.Writer) {
		row(w, "NAME", "NODE-ID", "GOSSIP-ADDR", "STATUS", "ROLE", "RAFT-ADDR", "API-ADDR", "VERSION")
		for _, m := range msg.GetMembers() {
			row(w, m.GetName(), m.GetNodeId(), m.GetGossipAddr(), enumName(m.GetStatus()), m.GetRole(),
				m.GetRaftAddr(), m.GetApiAddr(), m.GetVersion())
		}
	})
}

// watchMembers prints the members of each status snapshot that differ
// from the last printed; tables are separated by a blank line.
func (a *app) watchMembers(cmd *cobra.Command) error {
	return a.backendCall(cmd, true, func(ctx context.Context, c *clientConn) error {
		stream, err := c.api.WatchStatus(ctx, connect.NewRequest(&clusterv1.WatchStatusRequest{}))
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		defer stream.Close()
		var last *clusterv1.MembersResponse
		for stream.Receive() {
			cur := &clusterv1.MembersResponse{Members: stream.Msg().GetMembers()}
			if last != nil && proto.Equal(last, cur) {
				continue
			}
			if last != nil {
				// A blank line between tables, a document marker between
				// YAML documents; JSON objects follow each other (jq reads
				// them as a stream).
				switch a.opts.output.value {
				case "yaml":
					fmt.Fprintln(a.stdout, "---")
				case "json":
				default:
					fmt.Fprintln(a.stdout)
				}
			}
			last = cur
			if err := a.renderMembers(cur); err != nil {
				return err
			}
		}
		// Ctrl-C, or the end of --timeout, ends a watch: not an error.
		return watchErr(ctx, stream.Err())
	})
}

func (a *app) clusterPeers(cmd *cobra.Command, _ []string) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.Peers(ctx, connect.NewRequest(&clusterv1.PeersRequest{Read: a.readOptions()}))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, func(w io.Writer) {
			row(w, "NODE", "ID", "ADDRESS", "STATE", "VOTER", "COMMIT", "APPLIED", "TRAILING", "LAST-CONTACT")
			for _, p := range resp.Msg.GetPeers() {
				row(w, p.GetName(), p.GetNodeId(), p.GetAddress(), enumName(p.GetState()), strconv.FormatBool(p.GetVoter()),
					formatUint(p.GetCommitIndex()), formatUint(p.GetAppliedIndex()), formatUint(p.GetTrailing()),
					formatDuration(p.GetLastContact()))
			}
		})
	})
}

func (a *app) clusterLeader(cmd *cobra.Command, _ []string) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.Leader(ctx, connect.NewRequest(&clusterv1.LeaderRequest{Read: a.readOptions()}))
		if err != nil {
			return err
		}
		l := resp.Msg
		return a.render(l, func(w io.Writer) {
			row(w, "NAME", "NODE-ID", "RAFT-ADDR", "API-ADDR", "TERM")
			row(w, l.GetName(), l.GetNodeId(), l.GetRaftAddr(), l.GetApiAddr(), formatUint(l.GetTerm()))
		})
	})
}

func (a *app) clusterJoin(cmd *cobra.Command, args []string) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.Join(ctx, connect.NewRequest(&clusterv1.JoinRequest{Addresses: args}))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, func(w io.Writer) {
			fmt.Fprintf(w, "Joined %d node(s)\n", resp.Msg.GetJoined())
		})
	})
}

func (a *app) clusterLeave(cmd *cobra.Command, _ []string) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.Leave(ctx, connect.NewRequest(&clusterv1.LeaveRequest{}))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, func(w io.Writer) {
			fmt.Fprintln(w, "The node is leaving the cluster")
		})
	})
}

func (a *app) clusterRemovePeer(cmd *cobra.Command, args []string) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		id, name, err := resolvePeer(ctx, api, args[0])
		if err != nil {
			return err
		}
		resp, err := api.RemovePeer(ctx, connect.NewRequest(&clusterv1.RemovePeerRequest{NodeId: id}))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, func(w io.Writer) {
			fmt.Fprintf(w, "Removed peer %s (index %d)\n", peerLabel(id, name), resp.Msg.GetIndex())
		})
	})
}

func (a *app) clusterTransferLeader(cmd *cobra.Command, args []string) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		req := &clusterv1.TransferLeaderRequest{}
		if len(args) > 0 {
			id, _, err := resolvePeer(ctx, api, args[0])
			if err != nil {
				return err
			}
			req.NodeId = id
		}
		resp, err := api.TransferLeader(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, func(w io.Writer) {
			id := resp.Msg.GetNodeId()
			if name := memberNames(ctx, api)[id]; name != "" {
				id = name + " (" + id + ")"
			}
			fmt.Fprintf(w, "Leadership transferred to %s\n", id)
		})
	})
}

// resolvePeer turns a node ID or node name into the node ID of a Raft
// peer. An argument that is a peer's ID is taken as is; else a peer whose
// gossip name it is. When the peers cannot be read, the argument goes to
// the agent as an ID, which says whether it is one.
func resolvePeer(ctx context.Context, api clusterv1connect.ClusterServiceClient, arg string) (id, name string, err error) {
	resp, err := api.Peers(ctx, connect.NewRequest(&clusterv1.PeersRequest{}))
	if err != nil || len(resp.Msg.GetPeers()) == 0 {
		return arg, "", nil // the agent reports an unknown ID itself
	}
	var byName []*clusterv1.Peer
	var known []string
	for _, p := range resp.Msg.GetPeers() {
		if p.GetNodeId() == arg {
			return arg, p.GetName(), nil
		}
		if p.GetName() == arg {
			byName = append(byName, p)
		}
		known = append(known, peerLabel(p.GetNodeId(), p.GetName()))
	}
	switch len(byName) {
	case 1:
		return byName[0].GetNodeId(), arg, nil
	case 0:
		return "", "", fmt.Errorf("%q is neither the node ID nor the name of a Raft peer; the peers are: %s", arg, strings.Join(known, ", "))
	default:
		return "", "", fmt.Errorf("%d Raft peers are named %q (a node rebuilt with a new ID?): give the node ID of one: %s", len(byName), arg, strings.Join(known, ", "))
	}
}

func peerLabel(id, name string) string {
	if name == "" {
		return id
	}
	return name + " (" + id + ")"
}
