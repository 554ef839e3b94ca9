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

	"pilab.hu/pivirt-agent/cmd/internal/servicedef"
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
	file    string
}

func (a *app) newServiceRegisterCmd() *cobra.Command {
	var o registerOptions
	c := &cobra.Command{
		Use:   "register NAME --address ADDR --port PORT | register --file DEFINITION",
		Short: "Register (or replace) a service instance, from flags or a definition file (YAML or JSON, with its check)",
		Args:  positional("[NAME]"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			if o.file != "" {
				for _, f := range []string{"address", "port", "tag", "meta", "ttl", "id"} {
					if cmd.Flags().Changed(f) {
						return usagef("--%s and --file do not go together: the file defines the instance", f)
					}
				}
				if len(args) > 0 {
					return usagef("NAME and --file do not go together: the file's name field names the service")
				}
				return a.serviceRegisterFile(cmd, &o)
			}
			if len(args) == 0 {
				return usagef("missing argument NAME (or --file)")
			}
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
	f.StringVar(&o.node, "node", "", "node the instance runs on, whose agent runs its check (default: the node asked)")
	f.StringVarP(&o.file, "file", "f", "", "service definition file, YAML or JSON: name, id, address, port, tags, meta, ttl, check {http|tcp|grpc, interval, timeout, ...}, deregister_critical_after")
	return c
}

// serviceRegisterFile registers the instance a definition file defines.
func (a *app) serviceRegisterFile(cmd *cobra.Command, o *registerOptions) error {
	inst, err := servicedef.ReadFile(o.file)
	if err != nil {
		return usagef("%v", err)
	}
	inst.Node = o.node
	req := &clusterv1.RegisterServiceRequest{Instance: inst, Write: a.writeOptions()}
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.RegisterService(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		return a.render(resp.Msg, instancesTable(resp.Msg.GetInstance()))
	})
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
		row(w, "SERVICE", "ID", "ADDRESS", "PORT", "HEALTH", "CHECK", "TAGS", "NODE", "TTL", "INDEX")
		for _, in := range instances {
			if in == nil {
				continue
			}
			row(w, in.GetService(), in.GetInstanceId(), in.GetAddress(), strconv.FormatUint(uint64(in.GetPort()), 10),
				enumName(in.GetHealth()), checkName(in.GetCheck()), strings.Join(in.GetTags(), ","), in.GetNode(),
				formatDuration(in.GetTtl()), formatUint(in.GetModifyIndex()))
		}
	}
}

// checkName is a check in a table cell: its URL, tcp://HOST:PORT or
// grpc://HOST:PORT[/SERVICE] (the output is in -o json).
func checkName(c *clusterv1.HealthCheck) string {
	switch {
	case c == nil:
		return "-"
	case c.GetHttp() != "":
		return c.GetHttp()
	case c.GetTcp() != "":
		return "tcp://" + c.GetTcp()
	case c.GetGrpcService() != "":
		return "grpc://" + c.GetGrpc() + "/" + c.GetGrpcService()
	default:
		return "grpc://" + c.GetGrpc()
	}
}
