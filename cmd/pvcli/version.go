package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"pilab.hu/pivirt-agent/cmd/internal/version"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// versionProbeTimeout bounds the agent part of pvcli version when no
// --timeout is given: a stopped agent should not hold the client's own
// answer for 15 s.
const versionProbeTimeout = 3 * time.Second

// versionOutput is pvcli version -o json|yaml.
type versionOutput struct {
	Client version.Info `json:"client"`
	// Agent is the agent that answered, absent with --client.
	Agent *agentVersion `json:"agent,omitempty"`
}

type agentVersion struct {
	Node     string `json:"node"`
	Endpoint string `json:"endpoint"`
	Version  string `json:"version"`
	Protocol int32  `json:"protocol,omitempty"`
	// Mixed lists the other versions among the cluster's members, as
	// "VERSION (protocol N): NODE, NODE" (an upgrade in progress).
	Mixed []string `json:"mixed,omitempty"`
}

func (a *app) newVersionCmd() *cobra.Command {
	var clientOnly bool
	c := &cobra.Command{
		Use:   "version",
		Short: "Print pvcli's version and the version and protocol of the agent it reaches",
		Long: `version prints pvcli's own version, then asks the agent of --endpoint for
its version and protocol (and names members running other versions). With
--client, or when the agent cannot be reached, only pvcli's own version is
certain: an unreachable agent is an error (exit status 1) after the client
line, as kubectl version does.`,
		Args: positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			out := versionOutput{Client: version.Get("pvcli")}
			if clientOnly {
				return a.printVersion(out)
			}
			if !a.opts.timeoutSet {
				a.opts.timeout = versionProbeTimeout
			}
			err := a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
				resp, err := api.Members(ctx, connect.NewRequest(&clusterv1.MembersRequest{}))
				if err != nil {
					return err
				}
				out.Agent = agentVersionOf(resp.Header().Get("Pivirt-Served-By"), resp.Msg.GetMembers())
				out.Agent.Endpoint = a.conn.endpoints.current().String()
				return nil
			})
			if err != nil {
				_ = a.printVersion(out)
				return fmt.Errorf("no agent version: %w", err)
			}
			return a.printVersion(out)
		}),
	}
	c.Flags().BoolVar(&clientOnly, "client", false, "print pvcli's version only, without contacting an agent")
	return c
}

// agentVersionOf picks the answering member (served) out of members.
func agentVersionOf(served string, members []*clusterv1.Member) *agentVersion {
	av := &agentVersion{Node: served}
	others := map[string][]string{}
	var order []string
	for _, m := range members {
		if m.GetName() == served {
			av.Version, av.Protocol = m.GetVersion(), m.GetProtocol()
		}
	}
	for _, m := range members {
		if m.GetStatus() == clusterv1.MemberStatus_MEMBER_STATUS_LEFT {
			continue
		}
		if m.GetVersion() == av.Version && m.GetProtocol() == av.Protocol {
			continue
		}
		key := fmt.Sprintf("%s (protocol %d)", m.GetVersion(), m.GetProtocol())
		if _, ok := others[key]; !ok {
			order = append(order, key)
		}
		others[key] = append(others[key], m.GetName())
	}
	for _, k := range order {
		av.Mixed = append(av.Mixed, fmt.Sprintf("%s: %v", k, others[k]))
	}
	return av
}

func (a *app) printVersion(out versionOutput) error {
	return a.renderValue(out, func(w io.Writer) {
		fmt.Fprintln(w, out.Client.String())
		if av := out.Agent; av != nil {
			fmt.Fprintf(w, "agent pivirt-agent %s (protocol %d) on %s at %s\n", av.Version, av.Protocol, av.Node, av.Endpoint)
			for _, m := range av.Mixed {
				fmt.Fprintf(w, "other members run %s\n", m)
			}
		}
	})
}
