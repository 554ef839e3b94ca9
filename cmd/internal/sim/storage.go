package sim

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"io"
	"net/netip"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	networkv1 "pilab.hu/pivirt-agent/proto/pivirt/network/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
)

const (
	maxVolumeBytes = 64 << 40 // 64 TiB
	// maxUploadChunk bounds one UploadVolume message.
	maxUploadChunk = 1 << 20
)

// storageService plays iscsiman's volume API. Uploaded data is hashed and
// counted, not kept.
type storageService struct {
	volumes *table[*storagev1.Volume]
	host    string // the node the volumes are on
	watch   *hub[*storagev1.Volume]
}

// WatchVolumes sends every volume (of the owner, when set) as EXISTING,
// then every change, until the client leaves or falls behind.
func (s *storageService) WatchVolumes(r *storagev1.WatchVolumesRequest, stream grpc.ServerStreamingServer[storagev1.WatchVolumesResponse]) error {
	return watch(stream.Context(), s.volumes, s.watch, r.GetOwner(), func(kind int32, v *storagev1.Volume) error {
		return stream.Send(&storagev1.WatchVolumesResponse{Type: storagev1.EventType(kind), Volume: v})
	})
}

func validateVolume(v *storagev1.Volume) error {
	if err := checkName("volume", v.GetName()); err != nil {
		return err
	}
	if v.GetSizeBytes() == 0 || v.GetSizeBytes() > maxVolumeBytes {
		return invalid("volume.size_bytes: %d, want 1 to %d", v.GetSizeBytes(), uint64(maxVolumeBytes))
	}
	return nil
}

func (s *storageService) ListVolumes(_ context.Context, r *storagev1.ListVolumesRequest) (*storagev1.ListVolumesResponse, error) {
	vols, next, err := s.volumes.list(r.GetPageSize(), r.GetPageToken(), r.GetOwner())
	if err != nil {
		return nil, err
	}
	return &storagev1.ListVolumesResponse{Volumes: vols, NextPageToken: next}, nil
}

func (s *storageService) GetVolume(_ context.Context, r *storagev1.GetVolumeRequest) (*storagev1.GetVolumeResponse, error) {
	v, err := s.volumes.get(r.GetId())
	if err != nil {
		return nil, err
	}
	return &storagev1.GetVolumeResponse{Volume: v}, nil
}

func (s *storageService) CreateVolume(ctx context.Context, r *storagev1.CreateVolumeRequest) (*storagev1.CreateVolumeResponse, error) {
	in := proto.Clone(r.GetVolume()).(*storagev1.Volume)
	if in != nil {
		in.WrittenBytes, in.Sha256, in.Iqn, in.Host = 0, "", "", s.host
	}
	v, err := s.volumes.create(ctx, in)
	if err != nil {
		return nil, err
	}
	v, err = s.volumes.update(v.GetId(), nil, func(v *storagev1.Volume) error {
		v.Iqn = "iqn.2026-01.hu.pilab.iscsiman:" + v.GetId()
		return nil
	})
	if err != nil {
		return nil, err
	}
	s.watch.publish(eventCreated, v)
	return &storagev1.CreateVolumeResponse{Volume: v}, nil
}

func (s *storageService) UpdateVolume(_ context.Context, r *storagev1.UpdateVolumeRequest) (*storagev1.UpdateVolumeResponse, error) {
	v, err := s.volumes.update(r.GetVolume().GetId(), r.ExpectedRevision, func(cur *storagev1.Volume) error {
		size := cur.GetSizeBytes()
		if err := s.volumes.patch(cur, r.GetVolume(), r.GetUpdateMask()); err != nil {
			return err
		}
		if cur.GetSizeBytes() < size {
			return invalid("volume.size_bytes: %d is smaller than %d: volumes only grow", cur.GetSizeBytes(), size)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	s.watch.publish(eventUpdated, v)
	return &storagev1.UpdateVolumeResponse{Volume: v}, nil
}

func (s *storageService) DeleteVolume(_ context.Context, r *storagev1.DeleteVolumeRequest) (*storagev1.DeleteVolumeResponse, error) {
	v, err := s.volumes.delete(r.GetId())
	if err != nil {
		return nil, err
	}
	s.watch.publish(eventDeleted, v)
	return &storagev1.DeleteVolumeResponse{}, nil
}

// UploadVolume writes a stream of chunks into a volume: the first message
// names it; the upload may not exceed size_bytes.
func (s *storageService) UploadVolume(stream grpc.ClientStreamingServer[storagev1.UploadVolumeRequest, storagev1.UploadVolumeResponse]) error {
	var (
		id    string
		size  uint64
		total uint64
		h     hash.Hash
	)
	for {
		msg, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		if id == "" {
			v, err := s.volumes.get(msg.GetId())
			if err != nil {
				return err
			}
			id, size, h = v.GetId(), v.GetSizeBytes(), sha256.New()
		} else if msg.GetId() != "" && msg.GetId() != id {
			return invalid("id: %q in a later message of an upload to %q", msg.GetId(), id)
		}
		if n := len(msg.GetChunk()); n > maxUploadChunk {
			return invalid("chunk: %d bytes, at most %d per message", n, maxUploadChunk)
		}
		total += uint64(len(msg.GetChunk()))
		if total > size {
			return status.Errorf(codes.OutOfRange, "upload of %d bytes or more into volume %q of %d bytes", total, id, size)
		}
		h.Write(msg.GetChunk())
	}
	if id == "" {
		return invalid("id: an upload names its volume in the first message")
	}
	v, err := s.volumes.update(id, nil, func(v *storagev1.Volume) error {
		v.WrittenBytes, v.Sha256 = total, hex.EncodeToString(h.Sum(nil))
		return nil
	})
	if err != nil {
		return err
	}
	s.watch.publish(eventUpdated, v)
	return stream.SendAndClose(&storagev1.UploadVolumeResponse{Volume: v})
}

// networkService plays pivirtd's network API.
type networkService struct {
	networks *table[*networkv1.Network]
	host     string // the node the networks are on
	watch    *hub[*networkv1.Network]
}

// WatchNetworks sends every network (of the owner, when set) as EXISTING,
// then every change, until the client leaves or falls behind.
func (s *networkService) WatchNetworks(r *networkv1.WatchNetworksRequest, stream grpc.ServerStreamingServer[networkv1.WatchNetworksResponse]) error {
	return watch(stream.Context(), s.networks, s.watch, r.GetOwner(), func(kind int32, n *networkv1.Network) error {
		return stream.Send(&networkv1.WatchNetworksResponse{Type: networkv1.EventType(kind), Network: n})
	})
}

func validateNetwork(n *networkv1.Network) error {
	if err := checkName("network", n.GetName()); err != nil {
		return err
	}
	p, err := netip.ParsePrefix(n.GetCidr())
	if err != nil {
		return invalid("network.cidr: %q is not an IP prefix such as 10.10.0.0/24", n.GetCidr())
	}
	if p != p.Masked() {
		return invalid("network.cidr: %q has host bits set (%s)", n.GetCidr(), p.Masked())
	}
	if n.GetVlan() > 4094 {
		return invalid("network.vlan: %d, want 1 to 4094 (0: untagged)", n.GetVlan())
	}
	if m := n.GetMtu(); m != 0 && (m < 576 || m > 9216) {
		return invalid("network.mtu: %d, want 576 to 9216 (0: 1500)", m)
	}
	return nil
}

func (s *networkService) ListNetworks(_ context.Context, r *networkv1.ListNetworksRequest) (*networkv1.ListNetworksResponse, error) {
	nets, next, err := s.networks.list(r.GetPageSize(), r.GetPageToken(), r.GetOwner())
	if err != nil {
		return nil, err
	}
	return &networkv1.ListNetworksResponse{Networks: nets, NextPageToken: next}, nil
}

func (s *networkService) GetNetwork(_ context.Context, r *networkv1.GetNetworkRequest) (*networkv1.GetNetworkResponse, error) {
	n, err := s.networks.get(r.GetId())
	if err != nil {
		return nil, err
	}
	return &networkv1.GetNetworkResponse{Network: n}, nil
}

func (s *networkService) CreateNetwork(ctx context.Context, r *networkv1.CreateNetworkRequest) (*networkv1.CreateNetworkResponse, error) {
	in := proto.Clone(r.GetNetwork()).(*networkv1.Network)
	if in != nil {
		in.Host = s.host
	}
	n, err := s.networks.create(ctx, in)
	if err != nil {
		return nil, err
	}
	s.watch.publish(eventCreated, n)
	return &networkv1.CreateNetworkResponse{Network: n}, nil
}

func (s *networkService) UpdateNetwork(_ context.Context, r *networkv1.UpdateNetworkRequest) (*networkv1.UpdateNetworkResponse, error) {
	n, err := s.networks.update(r.GetNetwork().GetId(), r.ExpectedRevision, func(cur *networkv1.Network) error {
		return s.networks.patch(cur, r.GetNetwork(), r.GetUpdateMask())
	})
	if err != nil {
		return nil, err
	}
	s.watch.publish(eventUpdated, n)
	return &networkv1.UpdateNetworkResponse{Network: n}, nil
}

func (s *networkService) DeleteNetwork(_ context.Context, r *networkv1.DeleteNetworkRequest) (*networkv1.DeleteNetworkResponse, error) {
	n, err := s.networks.delete(r.GetId())
	if err != nil {
		return nil, err
	}
	s.watch.publish(eventDeleted, n)
	return &networkv1.DeleteNetworkResponse{}, nil
}
