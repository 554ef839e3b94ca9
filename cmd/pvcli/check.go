package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// errDenied: a check answered "denied" (exit status 1).
var errDenied = errors.New("denied")

func (a *app) newRBACCmd() *cobra.Command {
	var (
		identity, method, object string
		roles                    []string
	)
	check := &cobra.Command{
		Use:   "check --identity I --roles R --method M [--object JSON]",
		Short: "Say whether the RBAC policy in force lets a principal make a call, and which rules decide",
		Long: `Ask the agent whether the RBAC policy in force on it would let a caller with
--identity and --roles call --method (VMService/DeleteVM, or the full
pivirt.vm.v1.VMService/DeleteVM). For rules with conditions, --object is the
object the call is about, as JSON ('{"metadata": {"owner": "alice"}}').
Nothing is called. The exit status is 0 when allowed, 1 when denied.`,
		Args: positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			if method == "" {
				return usagef("--method is required (VMService/DeleteVM)")
			}
			req := &clusterv1.CheckAccessRequest{Identity: identity, Roles: roles, Method: method, ObjectJson: object}
			return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
				resp, err := api.CheckAccess(ctx, connect.NewRequest(req))
				if err != nil {
					return err
				}
				r := resp.Msg
				if err := a.render(r, func(w io.Writer) {
					verdict := "DENIED"
					if r.GetAllowed() {
						verdict = "ALLOWED"
					}
					by := fmt.Sprintf("the %s's RBAC policy on %s", r.GetSource(), r.GetNode())
					if r.GetSource() == "none" {
						by = "no RBAC policy on " + r.GetNode()
					}
					needs := fmt.Sprintf("%s %s", r.GetVerb(), r.GetResource())
					switch {
					case r.GetDecision() == "open":
						needs = "no credentials needed"
					case r.GetResource() == "":
						needs = "no rule: any authenticated caller"
					}
					fmt.Fprintf(w, "%s: %s (roles %s) %s (%s), %s: %s\n", verdict, identity, orNone(roles), r.GetMethod(), needs, by, r.GetDecision())
					for _, rule := range r.GetRules() {
						fmt.Fprintf(w, "  %s\n", rule)
					}
					if r.GetDetail() != "" {
						fmt.Fprintf(w, "  %s\n", r.GetDetail())
					}
				}); err != nil {
					return err
				}
				if !r.GetAllowed() {
					return errDenied
				}
				return nil
			})
		}),
	}
	check.Flags().StringVar(&identity, "identity", "", "the caller's identity (a token's subject, a certificate's CN)")
	check.Flags().StringSliceVar(&roles, "roles", nil, "the caller's roles, comma-separated")
	check.Flags().StringVar(&method, "method", "", "the method: Service/Method")
	check.Flags().StringVar(&object, "object", "", "the object the call is about, as JSON, for rules with conditions")
	return groupCmd("rbac", "Check the RBAC policy in force", check)
}

func (a *app) newPolicyCmd() *cobra.Command {
	var (
		from, to string
		port     uint32
	)
	check := &cobra.Command{
		Use:   "check --from SERVICE --to SERVICE --port P",
		Short: "Say whether the network policy in force allows a connection, and which policy allows it",
		Long: `Ask the agent whether the network policy in force on it (the cluster's
auth.network_policy, else its file's) allows a peer with the service identity
--from (a DNS or URI name of its certificate) to connect to one with --to on
TCP port --port. The exit status is 0 when allowed, 1 when denied.`,
		Args: positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			if from == "" || to == "" || port == 0 {
				return usagef("--from, --to and --port are required")
			}
			req := &clusterv1.CheckNetworkPolicyRequest{From: from, To: to, Port: port}
			return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
				resp, err := api.CheckNetworkPolicy(ctx, connect.NewRequest(req))
				if err != nil {
					return err
				}
				r := resp.Msg
				if err := a.render(r, func(w io.Writer) {
					switch {
					case r.GetSource() == "none":
						fmt.Fprintf(w, "ALLOWED: %s -> %s:%d (no network policy on %s: every connection is allowed)\n", from, to, port, r.GetNode())
					case r.GetAllowed():
						fmt.Fprintf(w, "ALLOWED: %s -> %s:%d by NetworkPolicy %s (the %s policy on %s)\n", from, to, port, r.GetPolicy(), r.GetSource(), r.GetNode())
					default:
						fmt.Fprintf(w, "DENIED: %s -> %s:%d: no NetworkPolicy allows it (the %s policy on %s)\n", from, to, port, r.GetSource(), r.GetNode())
					}
				}); err != nil {
					return err
				}
				if !r.GetAllowed() {
					return errDenied
				}
				return nil
			})
		}),
	}
	check.Flags().StringVar(&from, "from", "", "the connecting peer's service identity")
	check.Flags().StringVar(&to, "to", "", "the service identity connected to")
	check.Flags().Uint32Var(&port, "port", 0, "the TCP port")
	return groupCmd("policy", "Check the network policy in force", check)
}

func orNone(roles []string) string {
	if len(roles) == 0 {
		return "none"
	}
	return strings.Join(roles, ", ")
}
