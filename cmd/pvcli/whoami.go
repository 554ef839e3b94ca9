package main

import (
	"context"
	"fmt"
	"io"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// newWhoAmICmd is pvcli whoami: who the agent takes the caller for, and
// with --access what the RBAC policy in force lets it call.
func (a *app) newWhoAmICmd() *cobra.Command {
	var (
		showAccess bool
		methods    []string
	)
	c := &cobra.Command{
		Use:   "whoami [--access] [--method M]...",
		Short: "Print who the agent takes you for: identity, roles, how you authenticated, and what you may call",
		Long: `Ask the agent who it takes the caller for — the identity and roles of the
token or client certificate pvcli sends, how it authenticated and when the
token expires — and where its RBAC policy in force comes from. With --access,
also what that policy lets the caller call, method by method: allowed (on
every object), conditional (on the objects that meet the conditions of the
rules that allow it), denied, or open. --method (repeatable; VMService/PowerOn
or pivirt.vm.v1.VMService/PowerOn) asks for those methods only and implies
--access. Any authenticated caller may ask: no RBAC rule is needed (rbac
check needs get on rbac).`,
		Args: positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			if len(methods) > 0 {
				showAccess = true
			}
			req := &clusterv1.WhoAmIRequest{Methods: methods}
			return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
				resp, err := api.WhoAmI(ctx, connect.NewRequest(req))
				if err != nil {
					return err
				}
				r := resp.Msg
				if !showAccess {
					r.Access = nil
				}
				return a.render(r, func(w io.Writer) { printWhoAmI(w, r) })
			})
		}),
	}
	c.Flags().BoolVar(&showAccess, "access", false, "also print the decision of the RBAC policy for every method of the API")
	c.Flags().StringSliceVar(&methods, "method", nil, "a method to print the decision for (Service/Method; repeatable, comma-separated); implies --access")
	return c
}

// printWhoAmI is the table form of a WhoAmI answer.
func printWhoAmI(w io.Writer, r *clusterv1.WhoAmIResponse) {
	fmt.Fprintf(w, "IDENTITY:\t%s\n", r.GetIdentity())
	fmt.Fprintf(w, "ROLES:\t%s\n", orNone(r.GetRoles()))
	fmt.Fprintf(w, "AUTHENTICATED BY:\t%s\n", r.GetAuthenticatedBy())
	if r.GetTokenExpiry() != nil {
		fmt.Fprintf(w, "TOKEN EXPIRES:\t%s\n", formatTime(r.GetTokenExpiry()))
	}
	policy := fmt.Sprintf("the %s's RBAC policy on %s", r.GetSource(), r.GetNode())
	if r.GetSource() == "none" {
		policy = "none on " + r.GetNode() + " (every authenticated caller may call every method)"
	}
	fmt.Fprintf(w, "POLICY:\t%s\n", policy)
	if len(r.GetAccess()) == 0 {
		return
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "METHOD\tRESOURCE\tVERB\tDECISION")
	for _, m := range r.GetAccess() {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", m.GetMethod(), orDash(m.GetResource()), orDash(m.GetVerb()), m.GetDecision())
	}
}
