package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	networkv1 "pilab.hu/pivirt-agent/proto/pivirt/network/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
)

// uploadChunk is the size of the messages of an upload.
const uploadChunk = 256 << 10

// parseSize parses a byte count with an optional binary suffix (KiB, MiB,
// GiB, TiB).
func parseSize(flag, s string) (uint64, error) {
	units := []struct {
		suffix string
		shift  uint
	}{{"TiB", 40}, {"GiB", 30}, {"MiB", 20}, {"KiB", 10}, {"B", 0}}
	num, shift := s, uint(0)
	for _, u := range units {
		if strings.HasSuffix(s, u.suffix) {
			num, shift = strings.TrimSuffix(s, u.suffix), u.shift
			break
		}
	}
	n, err := strconv.ParseUint(strings.TrimSpace(num), 10, 64)
	if err != nil || n == 0 || n > (^uint64(0))>>shift {
		return 0, usagef("invalid %s %q: want a positive byte count, optionally with KiB, MiB, GiB or TiB", flag, s)
	}
	return n << shift, nil
}

func (a *app) newVolumeCmd() *cobra.Command {
	var (
		owner, size, newName string
		host                 string
		labels               []string
		revision             uint64
	)
	create := &cobra.Command{
		Use:   "create NAME --size SIZE",
		Short: "Create a volume",
		Args:  positional("NAME"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("size") {
				return usagef("missing --size: the volume's size (e.g. 20GiB) is required")
			}
			n, err := parseSize("--size", size)
			if err != nil {
				return err
			}
			l, err := parseLabels(labels)
			if err != nil {
				return err
			}
			vol := &storagev1.Volume{Name: args[0], SizeBytes: n, Metadata: &apiv1.ObjectMeta{Owner: owner, Labels: l}}
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				resp, err := c.storage.CreateVolume(ctx, connect.NewRequest(&storagev1.CreateVolumeRequest{Volume: vol, Host: host}))
				if err != nil {
					return err
				}
				return a.render(resp.Msg, volumeTable(resp.Msg.GetVolume()))
			})
		}),
	}
	create.Flags().StringVar(&size, "size", "", "size, e.g. 20GiB (required)")
	create.Flags().StringVar(&owner, "owner", "", "identity the volume belongs to (metadata.owner)")
	create.Flags().StringVar(&host, "host", "", "node to create the volume on (default: the node of --endpoint)")
	create.Flags().StringArrayVar(&labels, "label", nil, "label KEY=VALUE (repeatable)")

	update := &cobra.Command{
		Use:   "update ID [--name N] [--size SIZE] [--label K=V]...",
		Short: "Rename, grow or relabel a volume",
		Args:  positional("ID"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			vol := &storagev1.Volume{Id: args[0], Name: newName}
			if cmd.Flags().Changed("size") {
				n, err := parseSize("--size", size)
				if err != nil {
					return err
				}
				vol.SizeBytes = n
			}
			l, err := parseLabels(labels)
			if err != nil {
				return err
			}
			vol.Metadata = &apiv1.ObjectMeta{Labels: l}
			mask := changedMask(cmd, map[string]string{"name": "name", "size": "size_bytes", "label": "labels"})
			if len(mask.GetPaths()) == 0 {
				return usagef("nothing to update: give at least one of --name, --size, --label")
			}
			req := &storagev1.UpdateVolumeRequest{Volume: vol, UpdateMask: mask}
			if cmd.Flags().Changed("expected-revision") {
				req.ExpectedRevision = &revision
			}
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				resp, err := c.storage.UpdateVolume(ctx, connect.NewRequest(req))
				if err != nil {
					return err
				}
				return a.render(resp.Msg, volumeTable(resp.Msg.GetVolume()))
			})
		}),
	}
	update.Flags().StringVar(&newName, "name", "", "new name")
	update.Flags().StringVar(&size, "size", "", "new size, e.g. 40GiB (volumes only grow)")
	update.Flags().StringArrayVar(&labels, "label", nil, "label KEY=VALUE (repeatable; replaces the labels)")
	update.Flags().Uint64Var(&revision, "expected-revision", 0, "fail unless the volume is at this metadata.revision")

	var listOwner, listHost string
	list := &cobra.Command{
		Use:   "list",
		Short: "List volumes",
		Args:  positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				all, err := allPages(func(token string) ([]*storagev1.Volume, string, error) {
					resp, err := c.storage.ListVolumes(ctx, connect.NewRequest(&storagev1.ListVolumesRequest{Owner: listOwner, Host: listHost, PageToken: token, PageSize: listPageSize}))
					if err != nil {
						return nil, "", err
					}
					a.warnUnavailable(resp.Header())
					return resp.Msg.GetVolumes(), resp.Msg.GetNextPageToken(), nil
				})
				if err != nil {
					return err
				}
				return a.render(&storagev1.ListVolumesResponse{Volumes: all}, volumeTable(all...))
			})
		}),
	}
	list.Flags().StringVar(&listOwner, "owner", "", "only the volumes of this owner")
	list.Flags().StringVar(&listHost, "host", "", "only the volumes of this node")

	var watchOwner, watchHost string
	watch := &cobra.Command{
		Use:   "watch",
		Short: "Print the volumes of every node, then every change, until interrupted (or --timeout)",
		Args:  positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			return a.backendCall(cmd, true, func(ctx context.Context, c *clientConn) error {
				stream, err := c.storage.WatchVolumes(ctx, connect.NewRequest(&storagev1.WatchVolumesRequest{Owner: watchOwner, Host: watchHost}))
				if err != nil {
					return err
				}
				return printWatch(ctx, a, stream, func(w io.Writer, ev *storagev1.WatchVolumesResponse) {
					v := ev.GetVolume()
					row(w, enumName(ev.GetType()), v.GetId(), v.GetName(), formatUint(v.GetSizeBytes()), v.GetHost(), v.GetMetadata().GetOwner())
				})
			})
		}),
	}
	watch.Flags().StringVar(&watchOwner, "owner", "", "only the volumes of this owner")
	watch.Flags().StringVar(&watchHost, "host", "", "only the volumes of this node")

	return groupCmd("volume", "Manage volumes (proxied to the iscsiman backend)",
		list, watch,
		&cobra.Command{
			Use:   "get ID",
			Short: "Show a volume",
			Args:  positional("ID"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
					resp, err := c.storage.GetVolume(ctx, connect.NewRequest(&storagev1.GetVolumeRequest{Id: args[0]}))
					if err != nil {
						return err
					}
					return a.render(resp.Msg, volumeTable(resp.Msg.GetVolume()))
				})
			}),
		},
		create,
		update,
		&cobra.Command{
			Use:   "delete ID",
			Short: "Delete a volume",
			Args:  positional("ID"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
					resp, err := c.storage.DeleteVolume(ctx, connect.NewRequest(&storagev1.DeleteVolumeRequest{Id: args[0]}))
					if err != nil {
						return err
					}
					return a.render(resp.Msg, func(w io.Writer) { fmt.Fprintf(w, "Deleted volume %s\n", args[0]) })
				})
			}),
		},
		&cobra.Command{
			Use:   "upload ID FILE",
			Short: "Write an image file into a volume (streamed; FILE - reads stdin)",
			Args:  positional("ID", "FILE"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				in := a.stdin
				var total int64 = -1 // stdin: not known
				if args[1] != "-" {
					f, err := os.Open(args[1])
					if err != nil {
						return usagef("%v", err)
					}
					defer f.Close()
					in = f
					if st, err := f.Stat(); err == nil && st.Mode().IsRegular() {
						total = st.Size()
					}
				}
				return a.backendCall(cmd, true, func(ctx context.Context, c *clientConn) error {
					stream := c.storage.UploadVolume(ctx)
					prog := a.newProgress(total, "uploading "+args[0])
					defer prog.stop()
					buf := make([]byte, uploadChunk)
					for first := true; ; first = false {
						n, rerr := io.ReadFull(in, buf)
						if n > 0 || first {
							msg := &storagev1.UploadVolumeRequest{Chunk: buf[:n]}
							if first {
								msg.Id = args[0]
							}
							if err := stream.Send(msg); err != nil {
								break // the answer says why
							}
							prog.add(n)
						}
						if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
							break
						}
						if rerr != nil {
							return fmt.Errorf("read %s: %w", args[1], rerr)
						}
					}
					resp, err := stream.CloseAndReceive()
					if err != nil {
						return err
					}
					prog.done()
					return a.render(resp.Msg, volumeTable(resp.Msg.GetVolume()))
				})
			}),
		},
	)
}

func volumeTable(vols ...*storagev1.Volume) func(io.Writer) {
	return func(w io.Writer) {
		row(w, "ID", "NAME", "SIZE_BYTES", "WRITTEN_BYTES", "IQN", "HOST", "OWNER", "REVISION")
		for _, v := range vols {
			if v == nil {
				continue
			}
			row(w, v.GetId(), v.GetName(), formatUint(v.GetSizeBytes()), formatUint(v.GetWrittenBytes()), v.GetIqn(),
				v.GetHost(), v.GetMetadata().GetOwner(), formatUint(v.GetMetadata().GetRevision()))
		}
	}
}

func (a *app) newNetworkCmd() *cobra.Command {
	var (
		cidr, owner, newName string
		host                 string
		vlan, mtu            uint32
		labels               []string
		revision             uint64
	)
	create := &cobra.Command{
		Use:   "create NAME --cidr PREFIX",
		Short: "Create a network",
		Args:  positional("NAME"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			if cidr == "" {
				return usagef("missing --cidr: the network's prefix (e.g. 10.10.0.0/24) is required")
			}
			l, err := parseLabels(labels)
			if err != nil {
				return err
			}
			n := &networkv1.Network{Name: args[0], Cidr: cidr, Vlan: vlan, Mtu: mtu, Metadata: &apiv1.ObjectMeta{Owner: owner, Labels: l}}
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				resp, err := c.network.CreateNetwork(ctx, connect.NewRequest(&networkv1.CreateNetworkRequest{Network: n, Host: host}))
				if err != nil {
					return err
				}
				return a.render(resp.Msg, networkTable(resp.Msg.GetNetwork()))
			})
		}),
	}
	create.Flags().StringVar(&cidr, "cidr", "", "IP prefix, e.g. 10.10.0.0/24 (required)")
	create.Flags().Uint32Var(&vlan, "vlan", 0, "VLAN 1-4094 (0: untagged)")
	create.Flags().Uint32Var(&mtu, "mtu", 0, "MTU 576-9216 (0: 1500)")
	create.Flags().StringVar(&owner, "owner", "", "identity the network belongs to (metadata.owner)")
	create.Flags().StringVar(&host, "host", "", "node to create the network on (default: the node of --endpoint)")
	create.Flags().StringArrayVar(&labels, "label", nil, "label KEY=VALUE (repeatable)")

	update := &cobra.Command{
		Use:   "update ID [--name N] [--mtu N] [--label K=V]...",
		Short: "Rename a network, change its MTU or labels",
		Args:  positional("ID"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			l, err := parseLabels(labels)
			if err != nil {
				return err
			}
			n := &networkv1.Network{Id: args[0], Name: newName, Mtu: mtu, Metadata: &apiv1.ObjectMeta{Labels: l}}
			mask := changedMask(cmd, map[string]string{"name": "name", "mtu": "mtu", "label": "labels"})
			if len(mask.GetPaths()) == 0 {
				return usagef("nothing to update: give at least one of --name, --mtu, --label")
			}
			req := &networkv1.UpdateNetworkRequest{Network: n, UpdateMask: mask}
			if cmd.Flags().Changed("expected-revision") {
				req.ExpectedRevision = &revision
			}
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				resp, err := c.network.UpdateNetwork(ctx, connect.NewRequest(req))
				if err != nil {
					return err
				}
				return a.render(resp.Msg, networkTable(resp.Msg.GetNetwork()))
			})
		}),
	}
	update.Flags().StringVar(&newName, "name", "", "new name")
	update.Flags().Uint32Var(&mtu, "mtu", 0, "new MTU 576-9216 (0: 1500)")
	update.Flags().StringArrayVar(&labels, "label", nil, "label KEY=VALUE (repeatable; replaces the labels)")
	update.Flags().Uint64Var(&revision, "expected-revision", 0, "fail unless the network is at this metadata.revision")

	var listOwner, listHost string
	list := &cobra.Command{
		Use:   "list",
		Short: "List networks",
		Args:  positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
				all, err := allPages(func(token string) ([]*networkv1.Network, string, error) {
					resp, err := c.network.ListNetworks(ctx, connect.NewRequest(&networkv1.ListNetworksRequest{Owner: listOwner, Host: listHost, PageToken: token, PageSize: listPageSize}))
					if err != nil {
						return nil, "", err
					}
					a.warnUnavailable(resp.Header())
					return resp.Msg.GetNetworks(), resp.Msg.GetNextPageToken(), nil
				})
				if err != nil {
					return err
				}
				return a.render(&networkv1.ListNetworksResponse{Networks: all}, networkTable(all...))
			})
		}),
	}
	list.Flags().StringVar(&listOwner, "owner", "", "only the networks of this owner")
	list.Flags().StringVar(&listHost, "host", "", "only the networks of this node")

	var watchOwner, watchHost string
	watch := &cobra.Command{
		Use:   "watch",
		Short: "Print the networks of every node, then every change, until interrupted (or --timeout)",
		Args:  positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			return a.backendCall(cmd, true, func(ctx context.Context, c *clientConn) error {
				stream, err := c.network.WatchNetworks(ctx, connect.NewRequest(&networkv1.WatchNetworksRequest{Owner: watchOwner, Host: watchHost}))
				if err != nil {
					return err
				}
				return printWatch(ctx, a, stream, func(w io.Writer, ev *networkv1.WatchNetworksResponse) {
					n := ev.GetNetwork()
					row(w, enumName(ev.GetType()), n.GetId(), n.GetName(), n.GetCidr(), n.GetHost(), n.GetMetadata().GetOwner())
				})
			})
		}),
	}
	watch.Flags().StringVar(&watchOwner, "owner", "", "only the networks of this owner")
	watch.Flags().StringVar(&watchHost, "host", "", "only the networks of this node")

	return groupCmd("network", "Manage virtual networks (proxied to the pivirtd backend)",
		list, watch,
		&cobra.Command{
			Use:   "get ID",
			Short: "Show a network",
			Args:  positional("ID"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
					resp, err := c.network.GetNetwork(ctx, connect.NewRequest(&networkv1.GetNetworkRequest{Id: args[0]}))
					if err != nil {
						return err
					}
					return a.render(resp.Msg, networkTable(resp.Msg.GetNetwork()))
				})
			}),
		},
		create,
		update,
		&cobra.Command{
			Use:   "delete ID",
			Short: "Delete a network",
			Args:  positional("ID"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				return a.backendCall(cmd, false, func(ctx context.Context, c *clientConn) error {
					resp, err := c.network.DeleteNetwork(ctx, connect.NewRequest(&networkv1.DeleteNetworkRequest{Id: args[0]}))
					if err != nil {
						return err
					}
					return a.render(resp.Msg, func(w io.Writer) { fmt.Fprintf(w, "Deleted network %s\n", args[0]) })
				})
			}),
		},
	)
}

func networkTable(nets ...*networkv1.Network) func(io.Writer) {
	return func(w io.Writer) {
		row(w, "ID", "NAME", "CIDR", "VLAN", "MTU", "HOST", "OWNER", "REVISION")
		for _, n := range nets {
			if n == nil {
				continue
			}
			row(w, n.GetId(), n.GetName(), n.GetCidr(), strconv.FormatUint(uint64(n.GetVlan()), 10), strconv.FormatUint(uint64(n.GetMtu()), 10),
				n.GetHost(), n.GetMetadata().GetOwner(), formatUint(n.GetMetadata().GetRevision()))
		}
	}
}
