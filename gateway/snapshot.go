package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	"pilab.hu/pivirt-agent/gateway/authz"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	"pilab.hu/pivirt-agent/store"
)

// ClusterIDKey is the cluster config key holding the cluster's ID. The
// first leader sets it; clients cannot change or delete it.
const ClusterIDKey = "cluster.id"

// DowngradeKey is the cluster config key that holds the cluster version a
// downgrade under way keeps the cluster at ("0.0"): while it is set, the
// leader does not raise the cluster version when every server runs a newer
// release (pvcli operator downgrade). The leader removes it once a server
// runs that version or an older one.
const DowngradeKey = "cluster.downgrade"

// snapshotChunk is the size of the data of one snapshot stream message.
const snapshotChunk = 256 << 10

// Request size limits on the API port, per message, enforced before a
// message is decoded (gateway/access/DESIGN.md, "Before the body").
const (
	// MaxRequestBytes bounds a request of the cluster, snapshot and
	// schedule services over Connect and gRPC-Web: a config value is at
	// most 512 KiB, a snapshot chunk 256 KiB.
	MaxRequestBytes = 1 << 20
	// MaxGRPCRequestBytes bounds a request message over gRPC, where one
	// limit covers the whole server: the proxied backend APIs as well (a
	// volume upload chunk of pvcli is 256 KiB).
	MaxGRPCRequestBytes = 4 << 20
)

// DefaultMaxRestoreSize bounds an uploaded archive unless configured;
// DefaultMaxRestoreState the state it holds (state.bin, uncompressed),
// which a restore or a plan builds in memory: etcd's default quota.
const (
	DefaultMaxRestoreSize  = 8 << 30
	DefaultMaxRestoreState = 2 << 30
)

// Restorer restores Raft snapshots (store.Store).
type Restorer interface {
	Restore(ctx context.Context, index uint64, size int64, r io.Reader) error
}

// SnapshotPeers opens snapshot streams to other agents' internal ports.
type SnapshotPeers interface {
	Snapshots(internalAddr string) clusterv1.SnapshotServiceClient
}

// SnapshotServiceConfig configures a SnapshotService.
type SnapshotServiceConfig struct {
	// Take opens a snapshot of this node's state as an archive's meta and
	// state stream (the agent's, shared with automatic snapshots).
	Take func(ctx context.Context) (archive.Meta, io.ReadCloser, error)
	// TempDir holds uploaded archives while they are verified and
	// restored (the agent uses a directory in its data dir). Empty means
	// the system's.
	TempDir string
	// MaxRestoreSize bounds an uploaded archive, in bytes; 0 means
	// DefaultMaxRestoreSize.
	MaxRestoreSize int64
	// MaxRestoreState bounds the state an archive may hold, in bytes
	// (state.bin uncompressed), checked on the sizes the archive declares
	// before any of it is decoded; 0 means DefaultMaxRestoreState. The
	// archive's own size bounds it too (archive.MaxExpansion).
	MaxRestoreState int64
	// Restoring, when set, is held by the restore or plan running on this
	// node, shared by the node's instances (the API port's and the
	// internal port's), so that one node builds one uploaded state at a
	// time. Nil: the instance's own.
	Restoring *sync.Mutex
	// PauseLeader stops leader-only work (the TTL reaper, ...) before a
	// restore on this leader and returns once it stopped; ResumeLeader
	// starts it again, rebuilt from the (restored) state. Both may be nil.
	PauseLeader, ResumeLeader func()
	// Fork, when set, returns a scratch FSM whose state starts as this
	// node's (fsm.FSM.Fork): a restore is planned in it, and costs memory
	// only for what the archive changes. Nil: an empty FSM.
	Fork func() (*fsm.FSM, error)
	// Authorize, when set, checks that the caller of ctx may do verb on
	// resource (the RBAC policy): a restore needs update on every resource
	// whose records it changes (rbac for the cluster-wide policy). Nil
	// checks nothing (access control off, or the internal port, where the
	// relaying agent checked).
	Authorize func(ctx context.Context, resource, verb string) error
	Logger    *slog.Logger
}

// SnapshotService implements pivirt.cluster.v1.SnapshotService over Connect
// (it is the handler) and gRPC (NewSnapshotGRPC). It uses the
// ClusterService it is built on for leader lookup and forwarding: an
// instance on the internal port is leader-only, as that ClusterService is.
type SnapshotService struct {
	cfg    SnapshotServiceConfig
	cs     *ClusterService
	snap   Restorer
	peers  SnapshotPeers
	logger *slog.Logger

	restoring *sync.Mutex // held by the restore running on this node
}

var _ clusterv1connect.SnapshotServiceHandler = (*SnapshotService)(nil)

// NewSnapshotService returns the handler.
func NewSnapshotService(cfg SnapshotServiceConfig, cs *ClusterService, snap Restorer, peers SnapshotPeers) *SnapshotService {
	if cfg.MaxRestoreSize <= 0 {
		cfg.MaxRestoreSize = DefaultMaxRestoreSize
	}
	if cfg.MaxRestoreState <= 0 {
		cfg.MaxRestoreState = DefaultMaxRestoreState
	}
	if cfg.Restoring == nil {
		cfg.Restoring = new(sync.Mutex)
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &SnapshotService{cfg: cfg, cs: cs, snap: snap, peers: peers, restoring: cfg.Restoring, logger: logger.With("component", "snapshot-api")}
}

// SaveSnapshot implements clusterv1connect.SnapshotServiceHandler.
func (s *SnapshotService) SaveSnapshot(ctx context.Context, req *connect.Request[clusterv1.SaveSnapshotRequest], stream *connect.ServerStream[clusterv1.SaveSnapshotResponse]) error {
	return s.save(ctx, req.Msg.GetStale(), stream.Send)
}

// SetAuthorize sets SnapshotServiceConfig.Authorize; call it before the
// service serves.
func (s *SnapshotService) SetAuthorize(f func(ctx context.Context, resource, verb string) error) {
	s.cfg.Authorize = f
}

// RestoreSnapshot implements clusterv1connect.SnapshotServiceHandler.
func (s *SnapshotService) RestoreSnapshot(ctx context.Context, stream *connect.ClientStream[clusterv1.RestoreSnapshotRequest]) (*connect.Response[clusterv1.RestoreSnapshotResponse], error) {
	resp, err := s.restore(ctx, func() (*clusterv1.RestoreSnapshotRequest, error) {
		if !stream.Receive() {
			if err := stream.Err(); err != nil {
				return nil, err
			}
			return nil, io.EOF
		}
		return stream.Msg(), nil
	}, false)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

// PlanRestore implements clusterv1connect.SnapshotServiceHandler.
func (s *SnapshotService) PlanRestore(ctx context.Context, stream *connect.ClientStream[clusterv1.PlanRestoreRequest]) (*connect.Response[clusterv1.PlanRestoreResponse], error) {
	resp, err := s.restore(ctx, func() (*clusterv1.RestoreSnapshotRequest, error) {
		if !stream.Receive() {
			if err := stream.Err(); err != nil {
				return nil, err
			}
			return nil, io.EOF
		}
		return planRequest(stream.Msg()), nil
	}, true)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(planResponse(resp)), nil
}

// planRequest and planResponse carry PlanRestore's messages through the
// restore path.
func planRequest(m *clusterv1.PlanRestoreRequest) *clusterv1.RestoreSnapshotRequest {
	return &clusterv1.RestoreSnapshotRequest{Data: m.GetData(), Caller: m.GetCaller()}
}

func planResponse(r *clusterv1.RestoreSnapshotResponse) *clusterv1.PlanRestoreResponse {
	return &clusterv1.PlanRestoreResponse{Meta: r.GetMeta(), Plan: r.GetPlan()}
}

// NewSnapshotGRPC serves s over gRPC.
func NewSnapshotGRPC(s *SnapshotService) clusterv1.SnapshotServiceServer { return snapshotGRPC{s} }

type snapshotGRPC struct{ s *SnapshotService }

func (g snapshotGRPC) SaveSnapshot(req *clusterv1.SaveSnapshotRequest, stream grpc.ServerStreamingServer[clusterv1.SaveSnapshotResponse]) error {
	if err := g.s.save(stream.Context(), req.GetStale(), stream.Send); err != nil {
		return grpcError(stream.Context(), err)
	}
	return nil
}

func (g snapshotGRPC) RestoreSnapshot(stream grpc.ClientStreamingServer[clusterv1.RestoreSnapshotRequest, clusterv1.RestoreSnapshotResponse]) error {
	resp, err := g.s.restore(stream.Context(), stream.Recv, false)
	if err != nil {
		return grpcError(stream.Context(), err)
	}
	return stream.SendAndClose(resp)
}

func (g snapshotGRPC) PlanRestore(stream grpc.ClientStreamingServer[clusterv1.PlanRestoreRequest, clusterv1.PlanRestoreResponse]) error {
	resp, err := g.s.restore(stream.Context(), func() (*clusterv1.RestoreSnapshotRequest, error) {
		m, err := stream.Recv()
		if err != nil {
			return nil, err
		}
		return planRequest(m), nil
	}, true)
	if err != nil {
		return grpcError(stream.Context(), err)
	}
	return stream.SendAndClose(planResponse(resp))
}

// --- save ---

// save streams an archive to send: taken here when stale, else on the
// leader (relayed when that is another node). Once a message has gone out
// a failure is final: a retry would send the archive twice.
func (s *SnapshotService) save(ctx context.Context, stale bool, send func(*clusterv1.SaveSnapshotResponse) error) error {
	sent := false
	tracked := func(m *clusterv1.SaveSnapshotResponse) error {
		sent = true
		return send(m)
	}
	final := func(err error) error {
		if err != nil && sent {
			return connect.NewError(connect.CodeAborted, fmt.Errorf("snapshot stream broken off: %w", err))
		}
		return err
	}
	if stale {
		return toConnect(s.saveLocal(ctx, tracked, nil))
	}
	_, err := viaLeader(ctx, s.cs, func(ctx context.Context) (struct{}, error) {
		if !s.cs.leaderReady() {
			return struct{}{}, s.cs.notReady()
		}
		return struct{}{}, final(s.saveLocal(ctx, tracked, s.cs.leaderReady))
	}, func(ctx context.Context, internalAddr string) (struct{}, error) {
		return struct{}{}, final(s.saveRemote(ctx, internalAddr, tracked))
	})
	return err
}

// saveLocal snapshots this node's state and streams it as an archive.
// stillLeader, when set, must hold after the snapshot was taken: a leader
// deposed meanwhile may have missed writes, and nothing was sent yet, so
// the save is retried on the new leader.
func (s *SnapshotService) saveLocal(ctx context.Context, send func(*clusterv1.SaveSnapshotResponse) error, stillLeader func() bool) error {
	meta, rc, err := s.cfg.Take(ctx)
	if err != nil {
		return err
	}
	defer rc.Close()
	if stillLeader != nil && !stillLeader() {
		return ErrLeaderNotReady
	}
	pr, pw := io.Pipe()
	done := make(chan struct{})
	go func() {
		defer close(done)
		pw.CloseWithError(archive.Write(pw, meta, rc))
	}()
	defer func() {
		pr.Close()
		<-done
	}()
	first := true
	for {
		buf := make([]byte, snapshotChunk)
		n, err := io.ReadFull(pr, buf)
		if n > 0 {
			m := &clusterv1.SaveSnapshotResponse{Data: buf[:n]}
			if first {
				m.Meta, first = metaProto(meta), false
			}
			if serr := send(m); serr != nil {
				return serr
			}
		}
		switch {
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			s.logger.InfoContext(ctx, "snapshot saved", "id", meta.ID, "index", meta.Index, "state_bytes", meta.Size)
			return nil
		case err != nil:
			return fmt.Errorf("write snapshot archive: %w", err)
		}
	}
}

// saveRemote relays the leader's archive.
func (s *SnapshotService) saveRemote(ctx context.Context, internalAddr string, send func(*clusterv1.SaveSnapshotResponse) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := s.peers.Snapshots(internalAddr).SaveSnapshot(ctx, &clusterv1.SaveSnapshotRequest{})
	if err != nil {
		return cluster.StreamError(err)
	}
	for {
		m, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return cluster.StreamError(err)
		}
		if err := send(m); err != nil {
			return err
		}
	}
}

// --- restore ---

// restore receives an archive into a temporary file and has the leader
// verify all of it and restore it (relaying the file when the leader is
// another node). Nothing is touched unless the whole archive verified. One
// restore runs at a time on a node.
// restore spools an upload and restores it on the leader; with dryRun it
// only plans the restore (PlanRestore).
func (s *SnapshotService) restore(ctx context.Context, recv func() (*clusterv1.RestoreSnapshotRequest, error), dryRun bool) (*clusterv1.RestoreSnapshotResponse, error) {
	if !s.restoring.TryLock() {
		return nil, toConnect(notApplied(ErrRestoreInProgress))
	}
	defer s.restoring.Unlock()
	f, err := os.CreateTemp(s.cfg.TempDir, RestoreTempPattern)
	if err != nil {
		return nil, toConnect(notApplied(fmt.Errorf("snapshot restore: create temporary file: %w", err)))
	}
	defer func() {
		f.Close()
		os.Remove(f.Name())
	}()
	var (
		size   int64
		caller *clusterv1.RestoreCaller
	)
	for {
		m, err := recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, toConnect(notApplied(err))
		}
		if m.GetCaller() != nil && s.cs.cfg.LeaderOnly {
			caller = m.GetCaller() // from the relaying agent
		}
		size += int64(len(m.GetData()))
		if size > s.cfg.MaxRestoreSize {
			return nil, toConnect(notApplied(invalid("data", "the archive is larger than %d bytes, the most this agent accepts", s.cfg.MaxRestoreSize)))
		}
		if _, err := f.Write(m.GetData()); err != nil {
			return nil, toConnect(notApplied(fmt.Errorf("snapshot restore: spool the upload: %w", err)))
		}
	}
	// The caller needs update on every resource the leader's plan
	// changes. An agent relaying the restore relays its caller's
	// credential, which the internal port authenticated into ctx; the
	// caller the message names (which the relaying agent fills in) counts
	// only without one: from an agent of a release that relays no
	// credential, which the internal port lets through only while the
	// cluster version allows it.
	_, authenticated := authz.PrincipalFrom(ctx)
	check := func(ctx context.Context, plan *clusterv1.RestorePlan) error {
		if s.cfg.Authorize == nil {
			return nil
		}
		if s.cs.cfg.LeaderOnly && !authenticated {
			if caller == nil {
				return connect.NewError(connect.CodeFailedPrecondition, errors.New(
					"the agent that relayed this restore did not pass its caller (an older version?): restore through an upgraded agent or the leader"))
			}
			ctx = authz.WithPrincipal(ctx, authz.Principal{Identity: caller.GetIdentity(), Roles: caller.GetRoles()})
		}
		for _, r := range plan.GetResources() {
			if err := s.cfg.Authorize(ctx, r, "update"); err != nil {
				return err
			}
		}
		return nil
	}
	applied := false
	resp, err := viaLeader(ctx, s.cs, func(ctx context.Context) (*clusterv1.RestoreSnapshotResponse, error) {
		if !s.cs.leaderReady() {
			return nil, s.cs.notReady()
		}
		resp, err := s.restoreLocal(ctx, f, size, &applied, dryRun, check)
		if err != nil && applied {
			// The state was replaced: a retry would restore it again
			// over whatever was written since.
			return nil, connect.NewError(connect.CodeAborted, err)
		}
		return resp, err
	}, func(ctx context.Context, internalAddr string) (*clusterv1.RestoreSnapshotResponse, error) {
		var relayed *clusterv1.RestoreCaller
		if who, ok := authz.PrincipalFrom(ctx); ok && s.cfg.Authorize != nil {
			relayed = &clusterv1.RestoreCaller{Identity: who.Identity, Roles: who.Roles}
		}
		if dryRun {
			return s.planRemote(ctx, internalAddr, f, relayed)
		}
		return s.restoreRemote(ctx, internalAddr, f, relayed)
	})
	if err != nil && !applied && s.cs.cfg.LeaderOnly {
		// This leader-only instance restores nothing but here: whatever
		// failed, nothing was applied, and the relaying node may retry.
		err = notApplied(err)
	}
	return resp, err
}

// RestoreTempPattern names spooled uploads in TempDir; the agent removes
// leftovers at start.
const RestoreTempPattern = "restore-*.tar.gz"

// ErrRestoreInProgress: another snapshot restore is running on this node.
var ErrRestoreInProgress = errors.New("another snapshot restore is in progress on this agent")

// headerRestore marks an error after which a restore was certainly not
// applied, so that the node relaying it may retry elsewhere.
const (
	headerRestore     = "Pivirt-Restore"
	restoreNotApplied = "not-applied"
)

// notApplied marks err: the restore was not applied.
func notApplied(err error) error {
	ce, ok := toConnect(err).(*connect.Error)
	if !ok {
		return err
	}
	ce.Meta().Set(headerRestore, restoreNotApplied)
	return ce
}

// restoreLocal verifies the archive and restores it on this leader. Leader
// state is paused first (the TTL reaper must not judge the restored
// heartbeats by this term's clock) and rebuilt from the restored state
// after. raft.Restore keeps the current membership and puts the state at an
// index above this cluster's and the archive's; the Restored command that
// follows, applied by every node after the restored state, is the barrier:
// when it returns the restore is committed and every table's index is above
// any index served before. *applied is set once the state was replaced;
// from then on an error does not mean nothing happened.
func (s *SnapshotService) restoreLocal(ctx context.Context, f *os.File, size int64, applied *bool, dryRun bool,
	check func(context.Context, *clusterv1.RestorePlan) error) (*clusterv1.RestoreSnapshotResponse, error) {
	plan, err := s.plan(ctx, f, size)
	if err != nil {
		return nil, err
	}
	defer plan.close()
	if err := check(ctx, plan.plan); err != nil {
		s.logger.WarnContext(ctx, "snapshot restore refused", "error", err, "resources", plan.plan.GetResources())
		return nil, err
	}
	meta := metaProto(plan.meta)
	if dryRun {
		return &clusterv1.RestoreSnapshotResponse{Meta: meta, Plan: plan.plan}, nil
	}

	if s.cfg.PauseLeader != nil {
		s.cfg.PauseLeader()
	}
	// Resumed whatever happens; after a restore, from the restored state.
	defer func() {
		if s.cfg.ResumeLeader != nil {
			s.cfg.ResumeLeader()
		}
	}()
	replaced := s.cs.state.State().AbandonCh()
	rerr := s.snap.Restore(ctx, plan.index, plan.size, plan.state)
	select {
	case <-replaced:
		*applied = true
	default:
	}
	if !*applied {
		if rerr == nil {
			rerr = errors.New("snapshot restore: raft reported success but the state was not replaced")
		}
		return nil, rerr
	}
	if rerr != nil {
		// The no-op raft appends after a restore failed: the followers
		// get the state with the next entry anyway.
		s.logger.WarnContext(ctx, "snapshot restored; raft reported an error after it", "error", rerr)
	}
	// Not the caller's context: a client that gave up must not leave the
	// restore unmarked.
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), restoreMarkTimeout)
	defer cancel()
	index, err := s.markRestored(mctx, &plan.meta, rerr == nil)
	if err != nil {
		return nil, fmt.Errorf("snapshot restored, but committing its marker failed (indexes move on with the next write): %w", err)
	}
	var records []any
	for _, t := range plan.plan.GetTables() {
		records = append(records, slog.Uint64(t.GetTable(), t.GetRecords()))
	}
	s.logger.InfoContext(ctx, "snapshot restored", "id", plan.meta.ID, "archive_index", plan.meta.Index,
		"cluster_id", plan.meta.ClusterID, "index", index, slog.Group("records", records...),
		"config_keys_changed", plan.plan.GetConfigKeys(), "rbac_policy_changed", plan.plan.GetRbacPolicyChanged(),
		"archive_cluster_id", plan.plan.GetArchiveClusterId(), "ca_ignored", plan.plan.GetCaIgnored())
	return &clusterv1.RestoreSnapshotResponse{Meta: meta, Index: index, Plan: plan.plan}, nil
}

// markRestored commits the Restored command after a restore and returns
// its index. Leadership may move in the moments after a restore (the
// followers install the restored state while the leader waits): the
// command is proposed again whenever this node leads again before ctx
// ends. When another node leads, a restore raft reported committed
// (committed) is in force on a majority, and only the marker is missing:
// the answer is the restore's, at the index this node applied, and the
// tables' indexes move on with the next write.
func (s *SnapshotService) markRestored(ctx context.Context, meta *archive.Meta, committed bool) (uint64, error) {
	cmd := func() *fsmv1.Command {
		return &fsmv1.Command{Op: &fsmv1.Command_Restored{Restored: &fsmv1.Restored{
			SnapshotId: meta.ID, SnapshotIndex: meta.Index,
		}}}
	}
	res, err := s.cs.propose(ctx, nil, cmd())
	for err != nil && leadershipMoved(err) {
		select {
		case <-ctx.Done():
			return 0, err
		case <-time.After(50 * time.Millisecond):
		}
		switch id, _ := s.cs.raft.Leader(); {
		case id == s.cs.cfg.NodeID:
			res, err = s.cs.propose(ctx, nil, cmd())
		case id != "" && committed:
			s.logger.WarnContext(ctx, "snapshot restored; leadership moved before its marker was committed: table indexes move on with the next write",
				"id", meta.ID, "leader_id", id, "error", err)
			return s.cs.state.AppliedIndex(), nil
		}
	}
	if err != nil {
		return 0, err
	}
	return res.Index, nil
}

// leadershipMoved reports whether err is a write refused or cut short
// because this node is not, or no longer, the leader.
func leadershipMoved(err error) bool {
	return errors.Is(err, store.ErrNotLeader) || errors.Is(err, store.ErrLeadershipLost)
}

// plan verifies the spooled archive f and plans its restore against this
// node's state. The archive's framing, versions and checksums are checked
// first, in a pass that decodes nothing (archive.Open); its state is then
// decoded once, by planRestore, which refuses it as archive.Verify would,
// and the checksums are checked again at its end.
func (s *SnapshotService) plan(ctx context.Context, f *os.File, size int64) (*restorePlan, error) {
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	refused := func(err error) error {
		s.logger.WarnContext(ctx, "snapshot restore refused", "error", err, "bytes", size)
		return err
	}
	// The state is refused on its declared size, before it is decoded,
	// when it is more than this node builds or than the archive's size
	// allows.
	rd, _, err := archive.Open(f, s.cfg.MaxRestoreState)
	if err != nil {
		return nil, refused(err)
	}
	state, err := rd.State()
	if err != nil {
		return nil, refused(err)
	}
	p, err := s.planRestore(ctx, state, s.cs.state.State())
	if err != nil {
		return nil, refused(err)
	}
	if err := rd.Close(); err != nil {
		p.close()
		return nil, refused(err)
	}
	p.meta = rd.Meta
	return p, nil
}

// restoreMarkTimeout bounds committing the Restored command.
const restoreMarkTimeout = 30 * time.Second

// restoreRemote uploads the archive to the leader. A failure after the
// whole upload went out that the leader did not mark as "not applied" (a
// connection lost while the leader worked) is ambiguous, and final.
func (s *SnapshotService) restoreRemote(ctx context.Context, internalAddr string, f *os.File, caller *clusterv1.RestoreCaller) (*clusterv1.RestoreSnapshotResponse, error) {
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := s.peers.Snapshots(internalAddr).RestoreSnapshot(ctx)
	if err != nil {
		return nil, cluster.StreamError(err)
	}
	if err := upload(f, func(data []byte, first bool) error {
		m := &clusterv1.RestoreSnapshotRequest{Data: data}
		if first {
			m.Caller = caller
		}
		return stream.Send(m)
	}); err != nil {
		return nil, err
	}
	resp, err := stream.CloseAndRecv()
	if err != nil {
		err = cluster.StreamError(err, stream.Trailer())
		var ce *connect.Error
		if errors.As(err, &ce) && ce.Code() == connect.CodeUnavailable && ce.Meta().Get(headerRestore) != restoreNotApplied {
			return nil, connect.NewError(connect.CodeAborted, fmt.Errorf(
				"the connection to the leader failed after the upload; the restore may have been applied (see the leader's log or pvcli snapshot save): %w", err))
		}
		return nil, err
	}
	return resp, nil
}

// planRemote has the leader plan the restore of the archive f
// (PlanRestore): nothing is applied, so every failure is final.
func (s *SnapshotService) planRemote(ctx context.Context, internalAddr string, f *os.File, caller *clusterv1.RestoreCaller) (*clusterv1.RestoreSnapshotResponse, error) {
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := s.peers.Snapshots(internalAddr).PlanRestore(ctx)
	if err != nil {
		return nil, cluster.StreamError(err)
	}
	if err := upload(f, func(data []byte, first bool) error {
		m := &clusterv1.PlanRestoreRequest{Data: data}
		if first {
			m.Caller = caller
		}
		return stream.Send(m)
	}); err != nil {
		return nil, err
	}
	resp, err := stream.CloseAndRecv()
	if err != nil {
		return nil, notApplied(cluster.StreamError(err, stream.Trailer()))
	}
	return &clusterv1.RestoreSnapshotResponse{Meta: resp.GetMeta(), Plan: resp.GetPlan()}, nil
}

// upload sends the archive f in snapshotChunk pieces (at least one message,
// which carries what goes first). A send that meets io.EOF means the leader
// ended the call: the caller's CloseAndRecv has its status.
func upload(f *os.File, send func(data []byte, first bool) error) error {
	buf := make([]byte, snapshotChunk)
	for first := true; ; first = false {
		n, rerr := io.ReadFull(f, buf)
		if n > 0 || first {
			// SendMsg may hold on to the message: a new slice each time.
			if err := send(append([]byte(nil), buf[:n]...), first); err != nil {
				if errors.Is(err, io.EOF) {
					return nil
				}
				return cluster.StreamError(err)
			}
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			return nil
		}
		if rerr != nil {
			return rerr
		}
	}
}

func metaProto(m archive.Meta) *clusterv1.SnapshotMeta {
	return &clusterv1.SnapshotMeta{
		Id: m.ID, Index: m.Index, Term: m.Term,
		FormatVersion: m.FormatVersion, StateFormatVersion: m.StateFormatVersion,
		ClusterId: m.ClusterID, AgentVersion: m.AgentVersion, Size: m.Size,
		CreatedAt: timestamppb.New(m.CreatedAt),
	}
}
