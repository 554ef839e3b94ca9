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
	"github.com/spf13/pflag"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

func (a *app) newVMCmd() *cobra.Command {
	var owner, listHost string
	list := &cobra.Command{
		Use:   "list",
		Short: "List VMs",
		Args:  positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				all, err := allPages(func(token string) ([]*vmv1.VM, string, error) {
					resp, err := c.vm.ListVMs(ctx, connect.NewRequest(&vmv1.ListVMsRequest{Owner: owner, Host: listHost, PageToken: token, PageSize: listPageSize}))
					if err != nil {
						return nil, "", err
					}
					a.warnUnavailable(resp.Header())
					return resp.Msg.GetVms(), resp.Msg.GetNextPageToken(), nil
				})
				if err != nil {
					return err
				}
				return a.render(&vmv1.ListVMsResponse{Vms: all}, vmTable(all...))
			})
		}),
	}
	list.Flags().StringVar(&owner, "owner", "", "only the VMs of this owner")
	list.Flags().StringVar(&listHost, "host", "", "only the VMs of this node")

	var watchOwner, watchHost string
	watch := &cobra.Command{
		Use:   "watch",
		Short: "Print the VMs of every node, then every change, until interrupted (or --timeout)",
		Args:  positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			return a.backendCall(cmd, true, func(ctx context.Context, c *clientConn) error {
				stream, err := c.vm.WatchVMs(ctx, connect.NewRequest(&vmv1.WatchVMsRequest{Owner: watchOwner, Host: watchHost}))
				if err != nil {
					return err
				}
				return printWatch(ctx, a, stream, func(w io.Writer, ev *vmv1.WatchVMsResponse) {
					vm := ev.GetVm()
					row(w, enumName(ev.GetType()), vm.GetId(), vm.GetName(), enumName(vm.GetPowerState()), vm.GetHost(), vm.GetMetadata().GetOwner())
				})
			})
		}),
	}
	watch.Flags().StringVar(&watchOwner, "owner", "", "only the VMs of this owner")
	watch.Flags().StringVar(&watchHost, "host", "", "only the VMs of this node")

	power := func(use, short string, call func(ctx context.Context, c *clientConn, id string) (*vmv1.VM, error)) *cobra.Command {
		return &cobra.Command{
			Use:   use + " ID",
			Short: short,
			Args:  positional("ID"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
					vm, err := call(ctx, c, args[0])
					if err != nil {
						return err
					}
					return a.render(vm, vmTable(vm))
				})
			}),
		}
	}
	var stopTimeout time.Duration
	stop := power("stop", "Shut a VM down through its guest (ACPI), cutting the power after --shutdown-timeout", func(ctx context.Context, c *clientConn, id string) (*vmv1.VM, error) {
		req := &vmv1.ShutdownDefaultRequest{Id: id}
		if stopTimeout > 0 {
			req.Timeout = durationpb.New(stopTimeout)
		}
		r, err := c.vm.ShutdownDefault(ctx, connect.NewRequest(req))
		if err != nil {
			return nil, err
		}
		return r.Msg.GetVm(), nil
	})
	stop.Flags().DurationVar(&stopTimeout, "shutdown-timeout", 0, "how long the guest gets before the power is cut (default: the backend's, 60s)")

	return groupCmd("vm", "Manage VMs (proxied to the pivirtd backend)",
		list,
		&cobra.Command{
			Use:   "get ID",
			Short: "Show a VM",
			Args:  positional("ID"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
					resp, err := c.vm.GetVM(ctx, connect.NewRequest(&vmv1.GetVMRequest{Id: args[0]}))
					if err != nil {
						return err
					}
					return a.render(resp.Msg, vmTable(resp.Msg.GetVm()))
				})
			}),
		},
		a.newVMCreateCmd(),
		a.newVMUpdateCmd(),
		a.newVMConsoleCmd(),
		&cobra.Command{
			Use:   "delete ID",
			Short: "Delete a stopped VM",
			Args:  positional("ID"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
					resp, err := c.vm.DeleteVM(ctx, connect.NewRequest(&vmv1.DeleteVMRequest{Id: args[0]}))
					if err != nil {
						return err
					}
					return a.render(resp.Msg, func(w io.Writer) { fmt.Fprintf(w, "Deleted VM %s\n", args[0]) })
				})
			}),
		},
		power("start", "Power a VM on", func(ctx context.Context, c *clientConn, id string) (*vmv1.VM, error) {
			r, err := c.vm.PowerOn(ctx, connect.NewRequest(&vmv1.PowerOnRequest{Id: id}))
			if err != nil {
				return nil, err
			}
			return r.Msg.GetVm(), nil
		}),
		stop,
		power("power-off", "Cut a VM's power at once", func(ctx context.Context, c *clientConn, id string) (*vmv1.VM, error) {
			r, err := c.vm.PowerOff(ctx, connect.NewRequest(&vmv1.PowerOffRequest{Id: id}))
			if err != nil {
				return nil, err
			}
			return r.Msg.GetVm(), nil
		}),
		power("reboot", "Reboot a running VM", func(ctx context.Context, c *clientConn, id string) (*vmv1.VM, error) {
			r, err := c.vm.Reboot(ctx, connect.NewRequest(&vmv1.RebootRequest{Id: id}))
			if err != nil {
				return nil, err
			}
			return r.Msg.GetVm(), nil
		}),
		watch,
	)
}

// vmFlags are the fields of a VM that create and update set.
type vmFlags struct {
	name      string
	vcpus     uint32
	memoryMiB uint64
	disks     []string
	networks  []string
	owner     string
	labels    []string
	host      string
}

func (f *vmFlags) register(cmd *cobra.Command, create bool) {
	fs := cmd.Flags()
	if !create {
		fs.StringVar(&f.name, "name", "", "new name")
	}
	fs.Uint32Var(&f.vcpus, "vcpus", 1, "virtual CPUs, 1-256")
	fs.Uint64Var(&f.memoryMiB, "memory-mib", 1024, "memory in MiB, 64 or more")
	fs.StringArrayVar(&f.disks, "disk", nil, "volume ID to attach (repeatable)")
	fs.StringArrayVar(&f.networks, "network", nil, "network ID to attach (repeatable)")
	fs.StringArrayVar(&f.labels, "label", nil, "label KEY=VALUE (repeatable)")
	if create {
		fs.StringVar(&f.owner, "owner", "", "identity the VM belongs to (metadata.owner)")
		fs.StringVar(&f.host, "host", "", "node to create the VM on (default: the node of --endpoint)")
	}
}

func (a *app) newVMCreateCmd() *cobra.Command {
	var f vmFlags
	c := &cobra.Command{
		Use:   "create NAME",
		Short: "Create a VM (stopped)",
		Args:  positional("NAME"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			labels, err := parseLabels(f.labels)
			if err != nil {
				return err
			}
			vm := &vmv1.VM{Name: args[0], Vcpus: f.vcpus, MemoryMib: f.memoryMiB, Disks: f.disks, Networks: f.networks,
				Metadata: &apiv1.ObjectMeta{Owner: f.owner, Labels: labels}}
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				resp, err := c.vm.CreateVM(ctx, connect.NewRequest(&vmv1.CreateVMRequest{Vm: vm, Host: f.host}))
				if err != nil {
					return err
				}
				return a.render(resp.Msg, vmTable(resp.Msg.GetVm()))
			})
		}),
	}
	f.register(c, true)
	return c
}

func (a *app) newVMUpdateCmd() *cobra.Command {
	var (
		f        vmFlags
		revision uint64
	)
	c := &cobra.Command{
		Use:   "update ID [--name N] [--vcpus N] [--memory-mib N] [--disk ID]... [--network ID]... [--label K=V]...",
		Short: "Change the fields given as flags",
		Args:  positional("ID"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			labels, err := parseLabels(f.labels)
			if err != nil {
				return err
			}
			vm := &vmv1.VM{Id: args[0], Name: f.name, Vcpus: f.vcpus, MemoryMib: f.memoryMiB, Disks: f.disks, Networks: f.networks,
				Metadata: &apiv1.ObjectMeta{Labels: labels}}
			mask := changedMask(cmd, map[string]string{"name": "name", "vcpus": "vcpus", "memory-mib": "memory_mib", "disk": "disks", "network": "networks", "label": "labels"})
			if len(mask.GetPaths()) == 0 {
				return usagef("nothing to update: give at least one of --name, --vcpus, --memory-mib, --disk, --network, --label")
			}
			req := &vmv1.UpdateVMRequest{Vm: vm, UpdateMask: mask}
			if cmd.Flags().Changed("expected-revision") {
				req.ExpectedRevision = &revision
			}
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				resp, err := c.vm.UpdateVM(ctx, connect.NewRequest(req))
				if err != nil {
					return err
				}
				return a.render(resp.Msg, vmTable(resp.Msg.GetVm()))
			})
		}),
	}
	f.register(c, false)
	c.Flags().Uint64Var(&revision, "expected-revision", 0, "fail unless the VM is at this metadata.revision")
	return c
}

// listPageSize is the page size of list commands (the backends' maximum).
const listPageSize = 1000

// printWatch prints a watch's events as they come (each rendered by
// line, or as JSON), warning once of the nodes the watch could not reach,
// until the stream ends; the end of --timeout is not an error.
func printWatch[M any, PM interface {
	*M
	proto.Message
}](ctx context.Context, a *app, stream *connect.ServerStreamForClient[M], line func(io.Writer, PM)) error {
	defer stream.Close()
	warned := false
	for stream.Receive() {
		if !warned {
			a.warnUnavailable(stream.ResponseHeader())
			warned = true
		}
		ev := PM(stream.Msg())
		if err := a.renderEvent(ev, func(w io.Writer) { line(w, ev) }); err != nil {
			return err
		}
	}
	// Ctrl-C, or the end of --timeout, ends a watch: not an error.
	return watchErr(ctx, stream.Err())
}

// watchErr is the error a stream (a watch, monitor) ends with: none when
// Ctrl-C or --timeout ended it. The agent ends a stream at the deadline it
// was told, so its answer (deadline_exceeded) may come a moment before
// this process's own clock reaches the deadline.
func watchErr(ctx context.Context, err error) error {
	if err == nil || ctx.Err() != nil {
		return nil
	}
	if d, ok := ctx.Deadline(); ok && connect.CodeOf(err) == connect.CodeDeadlineExceeded && time.Until(d) < time.Second {
		return nil
	}
	return err
}

// allPages collects every page of a list: page returns one page's items
// and the next page's token ("" after the last).
func allPages[T any](page func(token string) ([]T, string, error)) ([]T, error) {
	var all []T
	for token := ""; ; {
		items, next, err := page(token)
		if err != nil {
			return nil, err
		}
		all = append(all, items...)
		if token = next; token == "" {
			return all, nil
		}
	}
}

// changedMask is the field mask of the flags given (flag name → field).
func changedMask(cmd *cobra.Command, fields map[string]string) *fieldmaskpb.FieldMask {
	m := &fieldmaskpb.FieldMask{}
	cmd.Flags().Visit(func(fl *pflag.Flag) {
		if field, ok := fields[fl.Name]; ok {
			m.Paths = append(m.Paths, field)
		}
	})
	return m
}

// parseLabels parses KEY=VALUE labels.
func parseLabels(kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, usagef("invalid --label %q: want KEY=VALUE", kv)
		}
		if _, dup := out[k]; dup {
			return nil, usagef("invalid --label %q: key %q given twice", kv, k)
		}
		out[k] = v
	}
	return out, nil
}

func vmTable(vms ...*vmv1.VM) func(io.Writer) {
	return func(w io.Writer) {
		row(w, "ID", "NAME", "STATE", "VCPUS", "MEMORY_MIB", "HOST", "OWNER", "REVISION")
		for _, vm := range vms {
			if vm == nil {
				continue
			}
			row(w, vm.GetId(), vm.GetName(), enumName(vm.GetPowerState()), strconv.FormatUint(uint64(vm.GetVcpus()), 10),
				formatUint(vm.GetMemoryMib()), vm.GetHost(), vm.GetMetadata().GetOwner(), formatUint(vm.GetMetadata().GetRevision()))
		}
	}
}
