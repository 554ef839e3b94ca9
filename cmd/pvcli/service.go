package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

func (a *app) newServiceCmd() *cobra.Command {
	return groupCmd("service", "Register, inspect and deregister service instances",
		a.newServiceRegisterCmd(),
		a.newServiceWatchCmd(),
		&cobra.Command{
			Use:   "deregister NAME ID",
			Short: "Remove a service instance",
			Args:  positional("NAME", "ID"),
			RunE:  a.command(a.serviceDeregister),
		},
		&cobra.Command{
			Use:   "list [NAME]",
			Short: "List the instances of all services, or of one",
			Args:  positional("[NAME]"),
			RunE:  a.command(a.serviceList),
		},
		&cobra.Command{
			Use:   "get NAME [ID]",
			Short: "Show the instances of a service, or one instance",
			Args:  positional("NAME", "[ID]"),
			RunE:  a.command(a.serviceGet),
		},
		&cobra.Command{
			Use:   "heartbeat NAME ID",
			Short: "Renew the TTL of a service instance",
			Args:  positional("NAME", "ID"),
			RunE:  a.command(a.serviceHeartbeat),
		},
	)
}

type registerOptions struct {
	address string
	port    int
	portSet bool
	tags    []string
	meta    []string
	ttl     time.Duration
	id      string
	node    string
}

func (a *app) newServiceRegisterCmd() *cobra.Command {
	var o registerOptions
	c := &cobra.Command{
		Use:   "register NAME --address ADDR --port PORT",
		Short: "Register (or replace) a service instance",
		Args:  positional("NAME"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			o.portSet = cmd.Flags().Changed("port")
			return a.serviceRegister(cmd, args[0], &o)
		}),
	}
	f := c.Flags()
	f.StringVar(&o.address, "address", "", "address the instance serves on (required)")
	f.IntVar(&o.port, "port", 0, "port the instance serves on, 1-65535 (required)")
	f.StringArrayVar(&o.tags, "tag", nil, "tag of the instance (repeatable)")
	f.StringArrayVar(&o.meta, "meta", nil, "metadata KEY=VALUE (repeatable)")
	f.DurationVar(&o.ttl, "ttl", 0, "heartbeat interval the instance promises; missed, it turns critical (0 = no TTL)")
	f.StringVar(&o.id, "id", "", "instance ID (default NAME-NODE: registering again without --id replaces the service's instance on that node)")
	f.StringVar(&o.node, "node", "", "node the instance runs on (default: the node asked)")
	return c
}

// instance validates the register flags and builds the instance.
func (o *registerOptions) instance(name string) (*clusterv1.ServiceInstance, error) {
	if strings.TrimSpace(o.address) == "" {
		return nil, usagef("missing --address: the address the instance serves on is required")
	}
	if !o.portSet {
		return nil, usagef("missing --port: the port the instance serves on (1-65535) is required")
	}
	if o.port < 1 || o.port > 65535 {
		return nil, usagef("invalid --port %d: must be 1-65535", o.port)
	}
	if o.ttl < 0 {
		return nil, usagef("invalid --ttl %s: must not be negative (0 = no TTL)", o.ttl)
	}
	for _, t := range o.tags {
		if strings.TrimSpace(t) == "" {
			return nil, usagef("invalid --tag: must not be empty")
		}
	}
	inst := &clusterv1.ServiceInstance{
		Service:    name,
		InstanceId: o.id,
		Node:       o.node,
		Address:    o.address,
		Port:       uint32(o.port),
		Tags:       o.tags,
	}
	if len(o.meta) > 0 {
		inst.Meta = make(map[string]string, len(o.meta))
		for _, kv := range o.meta {
			k, v, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				return nil, usagef("invalid --meta %q: want KEY=VALUE", kv)
			}
			if _, dup := inst.Meta[k]; dup {
				return nil, usagef("invalid --meta %q: key %q given twice", kv, k)
			}
			inst.Meta[k] = v
		}
	}
	if o.ttl > 0 {
		inst.Ttl = durationpb.New(o.ttl)
	}
	return inst, nil
}

func (a *app) serviceRegister(cmd *cobra.Command, name string, o *registerOptions) error {
	inst, err := o.instance(name)
	if err != nil {
		return err
	}
	req := &clusterv1.RegisterServiceRequest{Instance: inst, Write: a.writeOptions()}
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.RegisterService(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, instancesTable(resp.Msg.GetInstance()))
	})
}

func (a *app) serviceDeregister(cmd *cobra.Command, args []string) error {
	req := &clusterv1.DeregisterServiceRequest{Service: args[0], InstanceId: args[1], Write: a.writeOptions()}
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.DeregisterService(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, func(w io.Writer) {
			fmt.Fprintf(w, "Deregistered %s/%s (index %d)\n", req.Service, req.InstanceId, resp.Msg.GetIndex())
		})
	})
}

func (a *app) serviceList(cmd *cobra.Command, args []string) error {
	req := &clusterv1.ListServicesRequest{Read: a.readOptions()}
	if len(args) > 0 {
		req.Service = args[0]
	}
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.ListServices(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, instancesTable(resp.Msg.GetInstances()...))
	})
}

func (a *app) serviceGet(cmd *cobra.Command, args []string) error {
	req := &clusterv1.GetServiceRequest{Service: args[0], Read: a.readOptions()}
	if len(args) > 1 {
		req.InstanceId = args[1]
	}
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.GetService(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, instancesTable(resp.Msg.GetInstances()...))
	})
}

func (a *app) serviceHeartbeat(cmd *cobra.Command, args []string) error {
	req := &clusterv1.HeartbeatRequest{Service: args[0], InstanceId: args[1], Write: a.writeOptions()}
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.Heartbeat(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, instancesTable(resp.Msg.GetInstance()))
	})
}

func instancesTable(instances ...*clusterv1.ServiceInstance) func(io.Writer) {
	return func(w io.Writer) {
		row(w, "SERVICE", "ID", "ADDRESS", "PORT", "HEALTH", "TAGS", "NODE", "TTL", "INDEX")
		for _, in := range instances {
			if in == nil {
				continue
			}
			row(w, in.GetService(), in.GetInstanceId(), in.GetAddress(), strconv.FormatUint(uint64(in.GetPort()), 10),
				enumName(in.GetHealth()), strings.Join(in.GetTags(), ","), in.GetNode(),
				formatDuration(in.GetTtl()), formatUint(in.GetModifyIndex()))
		}
	}
}
