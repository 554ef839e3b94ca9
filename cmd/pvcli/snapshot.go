package main

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/archive"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// snapshotTimeout is the deadline of snapshot save and restore unless
// --timeout is given: a large state takes a while to move.
const snapshotTimeout = time.Hour

// snapshotChunk is the data size of one upload message.
const snapshotChunk = 256 << 10

func (a *app) newSnapshotCmd() *cobra.Command {
	var stale bool
	save := &cobra.Command{
		Use:   "save FILE",
		Short: "Save the whole replicated state into a snapshot archive",
		Long: `save streams a snapshot of the replicated state from the leader (with --stale,
from the agent asked) into FILE: a gzip'd tar of meta.json, state.bin and
SHA256SUMS. It is written to FILE.tmp, verified, then renamed to FILE.`,
		Args: positional("FILE"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			return a.snapshotSave(cmd, args[0], stale)
		}),
	}
	save.Flags().BoolVar(&stale, "stale", false, "take the snapshot on the agent asked, even if it is not the leader (it may lag)")
	var dryRun bool
	restore := &cobra.Command{
		Use:   "restore FILE",
		Short: "Replace the state of the whole cluster with a snapshot archive",
		Long: `restore checks FILE and uploads it through the agent asked to the leader, which
verifies all of it before it restores it. The cluster keeps its current
membership, its cluster CA and its cluster.id, so an archive of another cluster
restores. Every record of the archive must pass the checks its write would (the
RBAC policy must parse, config values 512 KiB at most, ...), and the caller needs
update on every resource the restore changes (rbac for the cluster-wide RBAC
policy). A refused archive leaves the cluster as it was. --dry-run shows what the
restore would change, and changes nothing.`,
		Args: positional("FILE"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error { return a.snapshotRestore(cmd, args, dryRun) }),
	}
	restore.Flags().BoolVar(&dryRun, "dry-run", false, "check the archive and the caller's rights and show what would change, without changing anything")
	var hash bool
	inspect := &cobra.Command{
		Use:   "inspect FILE|DIR",
		Short: "Verify a snapshot archive, or a snapshot directory of a data dir, and show what it holds (offline)",
		Long: `inspect verifies FILE (an archive of pvcli snapshot save) or DIR (a snapshot
directory of a data dir) and shows what it holds, table by table. With --hash it
also hashes each table as pvcli operator raft verify does, so that the state of
an agent that keeps no state hashes (a release before 0.1: take its snapshot with
pvcli --endpoint … snapshot save --stale) can be compared with the others' at
the same index (the cluster CA is never in an archive).`,
		Args: positional("FILE"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error { return a.snapshotInspect(cmd, args, hash) }),
	}
	inspect.Flags().BoolVar(&hash, "hash", false, "hash each table of the state as pvcli operator raft verify does (an archive only)")
	return groupCmd("snapshot", "Save, inspect and restore snapshots of the replicated state",
		save,
		inspect,
		restore,
	)
}

// snapshotContext applies --timeout, or snapshotTimeout when it was not
// given.
func (a *app) snapshotContext(cmd *cobra.Command) (context.Context, context.CancelFunc) {
	timeout := snapshotTimeout
	if a.opts.timeoutSet {
		timeout = a.opts.timeout
	}
	return context.WithTimeout(cmd.Context(), timeout)
}

// savedSnapshot is the output of snapshot save. Its JSON follows the API's
// JSON mapping, like every -o json of pvcli (DESIGN.md "Output"):
// lowerCamelCase names, 64-bit integers as strings, times in UTC RFC 3339.
type savedSnapshot struct {
	File         string    `json:"file"`
	Bytes        int64     `json:"bytes,string"`
	ID           string    `json:"id"`
	Index        uint64    `json:"index,string"`
	Term         uint64    `json:"term,string"`
	ClusterID    string    `json:"clusterId"`
	StateBytes   int64     `json:"stateBytes,string"`
	CreatedAt    time.Time `json:"createdAt"`
	AgentVersion string    `json:"agentVersion"`
}

func (a *app) snapshotSave(cmd *cobra.Command, file string, stale bool) (err error) {
	if err := a.connect(cmd); err != nil {
		return err
	}
	ctx, cancel := a.snapshotContext(cmd)
	defer cancel()

	tmp := file + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("snapshot save: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(tmp)
		}
	}()
	stream, err := a.conn.snap.SaveSnapshot(ctx, connect.NewRequest(&clusterv1.SaveSnapshotRequest{Stale: stale}))
	if err != nil {
		return fmt.Errorf("snapshot save: %w", err)
	}
	defer stream.Close()
	// The archive's length is not known before its end: the progress
	// shows the bytes received and the rate.
	prog := a.newProgress(-1, "saving snapshot")
	defer prog.stop()
	w := bufio.NewWriterSize(f, 1<<20)
	var size int64
	for stream.Receive() {
		n, err := w.Write(stream.Msg().GetData())
		size += int64(n)
		prog.add(n)
		if err != nil {
			return fmt.Errorf("snapshot save: write %s: %w", tmp, err)
		}
	}
	if err := stream.Err(); err != nil {
		return fmt.Errorf("snapshot save: %w", err)
	}
	prog.done()
	if size == 0 {
		return errors.New("snapshot save: the agent sent no data")
	}
	if err := w.Flush(); err != nil {
		return fmt.Errorf("snapshot save: write %s: %w", tmp, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("snapshot save: sync %s: %w", tmp, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("snapshot save: close %s: %w", tmp, err)
	}
	info, err := checkArchiveFile(tmp, check1)
	if err != nil {
		return fmt.Errorf("snapshot save: the archive received does not verify (left nothing at %s): %w", file, err)
	}
	if err := os.Rename(tmp, file); err != nil {
		return fmt.Errorf("snapshot save: %w", err)
	}
	m := info.Meta
	out := savedSnapshot{
		File: file, Bytes: size, ID: m.ID, Index: m.Index, Term: m.Term, ClusterID: m.ClusterID,
		StateBytes: m.Size, CreatedAt: m.CreatedAt.UTC(), AgentVersion: m.AgentVersion,
	}
	return a.renderValue(out, func(w io.Writer) {
		fmt.Fprintf(w, "Saved snapshot %s to %s: index %d, term %d, %d bytes (state %d bytes)\n",
			m.ID, file, m.Index, m.Term, size, m.Size)
	})
}

// checkArchiveFile checks a snapshot archive file with check
// (archive.Verify, or check1 for archive.Check). Only a regular file is
// opened: a FIFO would block the open, a device never end.
func checkArchiveFile(path string, check func(io.ReadSeeker) (*archive.Info, error)) (*archive.Info, error) {
	f, err := archive.OpenRegular(path)
	if err != nil {
		return &archive.Info{}, err
	}
	defer f.Close()
	return check(f)
}

// hashArchive hashes the state of the archive at path, table by table.
func hashArchive(path string) (*fsm.StateHash, error) {
	f, err := archive.OpenRegular(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	rd, err := archive.NewReader(bufio.NewReaderSize(f, 1<<20))
	if err != nil {
		return nil, err
	}
	st, err := rd.State()
	if err != nil {
		return nil, err
	}
	h, err := fsm.HashSnapshot(st)
	if err != nil {
		return nil, err
	}
	return h, rd.Close()
}

// check1 is archive.Check, one buffered pass.
func check1(r io.ReadSeeker) (*archive.Info, error) {
	return archive.Check(bufio.NewReaderSize(r, 1<<20))
}

// inspection is the output of snapshot inspect (its JSON as
// savedSnapshot's).
type inspection struct {
	Path string `json:"path"`
	// Kind is "archive" or "raft snapshot directory".
	Kind               string         `json:"kind"`
	ID                 string         `json:"id"`
	Index              uint64         `json:"index,string"`
	Term               uint64         `json:"term,string"`
	FormatVersion      uint32         `json:"formatVersion,omitempty"`
	StateFormatVersion uint32         `json:"stateFormatVersion,omitempty"`
	ClusterID          string         `json:"clusterId,omitempty"`
	AgentVersion       string         `json:"agentVersion,omitempty"`
	CreatedAt          *time.Time     `json:"createdAt,omitempty"`
	StateBytes         int64          `json:"stateBytes,string"`
	Tables             []tableSummary `json:"tables,omitempty"`
	SHA256             string         `json:"stateSha256,omitempty"`
	// Verification is "ok", or "FAILED: " and the reason.
	Verification string `json:"verification"`
}

type tableSummary struct {
	Name    string `json:"name"`
	Records uint64 `json:"records,string"`
	Bytes   uint64 `json:"bytes,string"`
	// SHA256 is the table's hash (--hash), as pvcli operator raft verify
	// shows it.
	SHA256 string `json:"sha256,omitempty"`
}

func (a *app) snapshotInspect(cmd *cobra.Command, args []string, hash bool) error {
	path := args[0]
	st, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("snapshot inspect: %w", err)
	}
	out := inspection{Path: path, Kind: "archive"}
	var info *archive.Info
	if st.IsDir() {
		out.Kind = "raft snapshot directory"
		info, err = archive.InspectDir(path)
	} else {
		info, err = checkArchiveFile(path, archive.Verify)
	}
	m := info.Meta
	out.ID, out.Index, out.Term, out.StateBytes = m.ID, m.Index, m.Term, m.Size
	out.FormatVersion, out.StateFormatVersion = m.FormatVersion, m.StateFormatVersion
	out.ClusterID, out.AgentVersion = m.ClusterID, m.AgentVersion
	if !m.CreatedAt.IsZero() {
		created := m.CreatedAt.UTC()
		out.CreatedAt = &created
	}
	if info.State != nil {
		for _, t := range info.State.Tables {
			out.Tables = append(out.Tables, tableSummary{Name: t.Name, Records: t.Records, Bytes: t.Bytes})
		}
	}
	out.SHA256 = info.SHA256[archive.StateFile]
	out.Verification = "ok"
	if err != nil {
		out.Verification = "FAILED: " + err.Error()
	}
	if hash && err == nil {
		if st.IsDir() {
			return errors.New("snapshot inspect --hash: hashes an archive; save one (pvcli snapshot save) to hash it")
		}
		sums, herr := hashArchive(path)
		if herr != nil {
			return fmt.Errorf("snapshot inspect: hash %s: %w", path, herr)
		}
		for i := range out.Tables {
			if t, ok := sums.Table(out.Tables[i].Name); ok {
				out.Tables[i].SHA256 = hex.EncodeToString(t.Sum[:])
			}
		}
	}
	if rerr := a.renderValue(out, func(w io.Writer) { inspectTable(w, out) }); rerr != nil {
		return rerr
	}
	if err != nil {
		return fmt.Errorf("snapshot inspect: %s does not verify: %w", path, err)
	}
	return nil
}

func inspectTable(w io.Writer, in inspection) {
	field := func(name, value string) {
		if value != "" {
			fmt.Fprintf(w, "%s\t%s\n", name, value)
		}
	}
	field("Path", in.Path+" ("+in.Kind+")")
	field("ID", in.ID)
	field("Index", formatUint(in.Index))
	field("Term", formatUint(in.Term))
	if in.FormatVersion != 0 {
		field("Format version", fmt.Sprint(in.FormatVersion))
	}
	if in.StateFormatVersion != 0 {
		field("State format version", fmt.Sprint(in.StateFormatVersion))
	}
	field("Cluster ID", in.ClusterID)
	field("Agent version", in.AgentVersion)
	if in.CreatedAt != nil {
		field("Created at", in.CreatedAt.Format(time.RFC3339))
	}
	field("State size", fmt.Sprintf("%d bytes", in.StateBytes))
	field("State SHA-256", in.SHA256)
	field("Verification", in.Verification)
	if len(in.Tables) > 0 {
		fmt.Fprintln(w)
		if len(in.Tables) > 0 && in.Tables[0].SHA256 != "" {
			fmt.Fprintln(w, "TABLE\tRECORDS\tBYTES\tSHA256")
			for _, t := range in.Tables {
				fmt.Fprintf(w, "%s\t%d\t%d\t%s\n", t.Name, t.Records, t.Bytes, t.SHA256)
			}
			return
		}
		fmt.Fprintln(w, "TABLE\tRECORDS\tBYTES")
		for _, t := range in.Tables {
			fmt.Fprintf(w, "%s\t%d\t%d\n", t.Name, t.Records, t.Bytes)
		}
	}
}

func (a *app) snapshotRestore(cmd *cobra.Command, args []string, dryRun bool) error {
	file := args[0]
	// Check here first: a damaged file is refused without an upload. (The
	// leader verifies it completely before restoring.)
	if _, err := checkArchiveFile(file, check1); err != nil {
		return fmt.Errorf("snapshot restore: %s is not a valid snapshot archive: %w", file, err)
	}
	if err := a.connect(cmd); err != nil {
		return err
	}
	ctx, cancel := a.snapshotContext(cmd)
	defer cancel()
	f, err := archive.OpenRegular(file)
	if err != nil {
		return fmt.Errorf("snapshot restore: %w", err)
	}
	defer f.Close()
	var total int64 = -1
	if st, err := f.Stat(); err == nil {
		total = st.Size()
	}
	prog := a.newProgress(total, "uploading snapshot")
	defer prog.stop()
	// A dry run is its own method (PlanRestore), so an agent that does
	// not know it refuses it instead of restoring.
	var (
		send   func(data []byte) error
		finish func() (proto.Message, *clusterv1.SnapshotMeta, *clusterv1.RestorePlan, uint64, error)
	)
	if dryRun {
		planned := a.conn.snap.PlanRestore(ctx)
		send = func(d []byte) error { return planned.Send(&clusterv1.PlanRestoreRequest{Data: d}) }
		finish = func() (proto.Message, *clusterv1.SnapshotMeta, *clusterv1.RestorePlan, uint64, error) {
			r, err := planned.CloseAndReceive()
			if err != nil {
				return nil, nil, nil, 0, err
			}
			return r.Msg, r.Msg.GetMeta(), r.Msg.GetPlan(), 0, nil
		}
	} else {
		restored := a.conn.snap.RestoreSnapshot(ctx)
		send = func(d []byte) error { return restored.Send(&clusterv1.RestoreSnapshotRequest{Data: d}) }
		finish = func() (proto.Message, *clusterv1.SnapshotMeta, *clusterv1.RestorePlan, uint64, error) {
			r, err := restored.CloseAndReceive()
			if err != nil {
				return nil, nil, nil, 0, err
			}
			return r.Msg, r.Msg.GetMeta(), r.Msg.GetPlan(), r.Msg.GetIndex(), nil
		}
	}
	buf := make([]byte, snapshotChunk)
	for {
		n, rerr := io.ReadFull(f, buf)
		if n > 0 {
			if err := send(buf[:n]); err != nil {
				if errors.Is(err, io.EOF) {
					break // the agent ended the call; the answer says why
				}
				return fmt.Errorf("snapshot restore: upload: %w", err)
			}
			prog.add(n)
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			break
		}
		if rerr != nil {
			return fmt.Errorf("snapshot restore: read %s: %w", file, rerr)
		}
	}
	msg, m, plan, index, err := finish()
	if err != nil {
		return fmt.Errorf("snapshot restore: %w", err)
	}
	prog.done()
	return a.render(msg, func(w io.Writer) {
		from := ""
		if m.GetClusterId() != "" {
			from = " of cluster " + m.GetClusterId()
		}
		if dryRun {
			fmt.Fprintf(w, "Dry run: restoring snapshot %s (index %d%s) would change:\n", m.GetId(), m.GetIndex(), from)
		} else {
			fmt.Fprintf(w, "Restored snapshot %s (index %d%s); the cluster holds it from index %d\n",
				m.GetId(), m.GetIndex(), from, index)
		}
		writePlan(w, plan)
	})
}

// writePlan shows what a restore changes.
func writePlan(w io.Writer, p *clusterv1.RestorePlan) {
	if p == nil {
		return
	}
	fmt.Fprintln(w, "TABLE\tADDED\tREMOVED\tCHANGED\tRECORDS")
	for _, t := range p.GetTables() {
		fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d\n", t.GetTable(), t.GetAdded(), t.GetRemoved(), t.GetChanged(), t.GetRecords())
	}
	if keys := p.GetConfigKeys(); len(keys) > 0 {
		fmt.Fprintf(w, "Config keys changed: %s\n", strings.Join(keys, ", "))
	}
	if p.GetRbacPolicyChanged() {
		fmt.Fprintln(w, "The cluster-wide RBAC policy (auth.rbac_policy) changes.")
	}
	if r := p.GetResources(); len(r) > 0 {
		fmt.Fprintf(w, "Rights needed: update on %s\n", strings.Join(r, ", "))
	}
	if id := p.GetArchiveClusterId(); id != "" {
		fmt.Fprintf(w, "The archive is of cluster %s; this cluster keeps its own cluster.id.\n", id)
	}
	if p.GetCaIgnored() {
		fmt.Fprintln(w, "The archive carries a cluster CA; this cluster keeps its own.")
	}
}
