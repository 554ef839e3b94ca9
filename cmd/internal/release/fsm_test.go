package release_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cmd/internal/release"
	"pilab.hu/pivirt-agent/cmd/internal/version"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/fsmtest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// applyProgram is built in the previous release's tree: it applies the
// entries read from stdin to that release's state machine, one at a time,
// and writes its snapshot whenever asked. A frame is a type byte, then a
// uvarint length and the entry's data; type 0xfe asks for a snapshot,
// written to stdout with a uvarint length.
const applyProgram = `package main

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"io"
	"os"

	"github.com/hashicorp/raft"

	"pilab.hu/pivirt-agent/fsm"
)

func main() {
	f, err := fsm.New(fsm.DefaultConfig())
	if err != nil {
		panic(err)
	}
	r := bufio.NewReader(os.Stdin)
	w := bufio.NewWriter(os.Stdout)
	defer w.Flush()
	for index := uint64(1); ; {
		typ, err := r.ReadByte()
		if err == io.EOF {
			return
		}
		if err != nil {
			panic(err)
		}
		if typ == 0xfe {
			var b bytes.Buffer
			if err := f.WriteSnapshot(&b); err != nil {
				panic(err)
			}
			w.Write(binary.AppendUvarint(nil, uint64(b.Len())))
			w.Write(b.Bytes())
			continue
		}
		n, err := binary.ReadUvarint(r)
		if err != nil {
			panic(err)
		}
		data := make([]byte, n)
		if _, err := io.ReadFull(r, data); err != nil {
			panic(err)
		}
		f.Apply(&raft.Log{Index: index, Term: 1, Type: raft.LogType(typ), Data: data})
		index++
	}
}
`

// TestStateMachineMatchesPreviousRelease applies random logs to the state
// machine of the previous release (built from the commit CHANGELOG.md
// names) and to this release's at the same cluster version, and expects
// byte-identical snapshots at every point compared: what keeps the
// replicas of a cluster mixing the two identical. The logs hold every
// command the previous release knows (valid and refused, retries of
// client writes, leader clocks going back and jumping past the dedupe
// window) and what this release may propose or receive at that version
// that the previous one does not know (the operations and fields it
// ignores or refuses, checkpoints); this release applies them in batches
// of random sizes, the previous one entry by entry.
func TestStateMachineMatchesPreviousRelease(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the previous release")
	}
	root, err := release.Root()
	if err != nil {
		t.Fatal(err)
	}
	prev, err := release.Previous(filepath.Join(root, "CHANGELOG.md"), version.Version)
	if err != nil {
		t.Fatal(err)
	}
	v, err := fsm.ParseVersion(prev.Version)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()
	bin, err := release.Build(ctx, root, prev.Commit, []string{"./cmd/legacyapply"}, map[string]string{"cmd/legacyapply/main.go": applyProgram})
	if err != nil {
		t.Fatal(err)
	}
	for seed := uint64(1); seed <= 6; seed++ {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			g := newGen(seed)
			log := g.log(700)
			// Snapshots after these many entries.
			marks := map[int]bool{100: true, 350: true, len(log): true}
			var in bytes.Buffer
			for i, l := range log {
				in.WriteByte(byte(l.Type))
				in.Write(binary.AppendUvarint(nil, uint64(len(l.Data))))
				in.Write(l.Data)
				if marks[i+1] {
					in.WriteByte(0xfe)
				}
			}
			cmd := exec.CommandContext(ctx, filepath.Join(bin, "legacyapply"))
			cmd.Stdin = &in
			var out, errOut bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &errOut
			if err := cmd.Run(); err != nil {
				t.Fatalf("the previous release's state machine: %v\n%s", err, errOut.String())
			}
			r := bufio.NewReader(&out)
			want := map[int][]byte{}
			for _, m := range sortedMarks(marks) {
				n, err := binary.ReadUvarint(r)
				if err != nil {
					t.Fatal(err)
				}
				b := make([]byte, n)
				if _, err := io.ReadFull(r, b); err != nil {
					t.Fatal(err)
				}
				want[m] = b
			}

			cfg := fsm.DefaultConfig()
			cfg.InitialVersion = v
			f, err := fsm.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(seed, 7))
			for start := 0; start < len(log); {
				end := min(len(log), start+1+rng.IntN(40))
				for m := range marks {
					if m > start && m < end {
						end = m
					}
				}
				f.ApplyBatch(log[start:end])
				start = end
				if marks[end] {
					var got bytes.Buffer
					if err := f.WriteSnapshot(&got); err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got.Bytes(), want[end]) {
						gh, _ := fsm.HashSnapshot(bytes.NewReader(got.Bytes()))
						wh, _ := fsm.HashSnapshot(bytes.NewReader(want[end]))
						var differ []string
						if gh != nil && wh != nil {
							differ = gh.Differ(wh)
						}
						t.Fatalf("after %d entries the state differs from release %s's (tables %v; %d bytes, want %d)", end, prev.Version, differ, got.Len(), len(want[end]))
					}
				}
			}
			if h := f.Halted(); h != nil {
				t.Fatalf("this release stopped: %v", h)
			}
		})
	}
}

func sortedMarks(m map[int]bool) []int {
	var out []int
	for k := range m {
		out = append(out, k)
	}
	for i := range out {
		for j := i + 1; j < len(out); j++ {
			if out[j] < out[i] {
				out[i], out[j] = out[j], out[i]
			}
		}
	}
	return out
}

// gen makes random logs (see TestStateMachineMatchesPreviousRelease).
type gen struct {
	r      *rand.Rand
	now    time.Time
	seq    map[string]uint64
	sent   []*fsmv1.Command
	cursor map[string]int64
	out    []*raft.Log
}

func newGen(seed uint64) *gen {
	return &gen{r: rand.New(rand.NewPCG(seed, seed*31)), now: fsmtest.T0, seq: map[string]uint64{}, cursor: map[string]int64{}}
}

func (g *gen) pick(s ...string) string { return s[g.r.IntN(len(s))] }

func (g *gen) slot(sec int64) *timestamppb.Timestamp {
	return timestamppb.New(fsmtest.T0.Add(time.Duration(sec) * time.Second))
}

func (g *gen) add(typ raft.LogType, data []byte) {
	g.out = append(g.out, &raft.Log{Index: uint64(len(g.out) + 1), Term: 1, Type: typ, Data: data})
}

func (g *gen) addCmd(cmd *fsmv1.Command, stamp bool) {
	if stamp {
		cmd.Time = timestamppb.New(g.now)
	}
	data, err := fsm.Encode(cmd)
	if err != nil {
		panic(err)
	}
	g.add(raft.LogCommand, data)
}

func (g *gen) log(n int) []*raft.Log {
	for len(g.out) < n {
		switch p := g.r.IntN(1000); {
		case p < 20:
			g.now = g.now.Add(-time.Duration(g.r.IntN(20)) * time.Second) // a new leader's clock
		case p < 30:
			g.now = g.now.Add(2*time.Minute + time.Duration(g.r.IntN(30))*time.Second) // past the window
		default:
			g.now = g.now.Add(time.Duration(g.r.IntN(3000)) * time.Millisecond)
		}
		switch p := g.r.IntN(100); {
		case p < 3:
			g.add(raft.LogNoop, nil)
		case p < 5:
			g.addCmd(fsm.CheckpointCommand(), true)
		case p < 6:
			g.addCmd(&fsmv1.Command{Op: &fsmv1.Command_Heartbeat{Heartbeat: &fsmv1.Heartbeat{Service: "web", InstanceId: "a"}}}, false) // no time
		case p < 16 && len(g.sent) > 0:
			prev := g.sent[g.r.IntN(len(g.sent))]
			cp := &fsmv1.Command{ClientId: prev.GetClientId(), Sequence: prev.GetSequence(), Op: prev.GetOp()}
			if g.r.IntN(5) == 0 {
				cp.Op = g.op().GetOp() // the identity reused for another write
			}
			g.addCmd(cp, true)
		default:
			cmd := g.op()
			if g.r.IntN(100) < 60 {
				c := g.pick("c1", "c2", "c3", "c4")
				g.seq[c]++
				cmd.ClientId, cmd.Sequence = c, g.seq[c]
				g.sent = append(g.sent, &fsmv1.Command{ClientId: c, Sequence: g.seq[c], Op: cmd.GetOp()})
			}
			g.addCmd(cmd, true)
		}
	}
	return g.out
}

// op is a random operation, its fields often right and sometimes not.
func (g *gen) op() *fsmv1.Command {
	svc, id := g.pick("web", "api"), g.pick("a", "b", "c")
	sid := g.pick("s1", "s2")
	switch g.r.IntN(16) {
	case 0, 1:
		in := &clusterv1.ServiceInstance{Service: svc, InstanceId: id, Node: g.pick("n1", "n2"), Address: "10.0.0.1", Port: 80,
			Meta: map[string]string{"k": "v", "owner": g.pick("a", "b")}}
		switch g.r.IntN(8) {
		case 0:
			in.Address = ""
		case 1:
			in.Ttl = durationpb.New(10 * time.Second)
		case 2:
			// Fields the previous release does not know: kept, unread.
			in.Check = &clusterv1.HealthCheck{Tcp: "127.0.0.1:9", Interval: durationpb.New(10 * time.Second)}
			in.DeregisterCriticalAfter = durationpb.New(time.Minute)
		case 3:
			in.Output, in.HealthSince = "client sent", g.slot(1)
		}
		return &fsmv1.Command{Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{Instance: in}}}
	case 2:
		op := &fsmv1.DeregisterService{Service: svc, InstanceId: id}
		if g.r.IntN(3) == 0 {
			op.CriticalSince = g.slot(int64(g.r.IntN(100)))
		}
		return &fsmv1.Command{Op: &fsmv1.Command_DeregisterService{DeregisterService: op}}
	case 3, 4:
		op := &fsmv1.Heartbeat{Service: svc, InstanceId: id}
		if g.r.IntN(3) == 0 {
			op.Health, op.Output = clusterv1.Health(g.r.IntN(5)), "probe said so"
		}
		return &fsmv1.Command{Op: &fsmv1.Command_Heartbeat{Heartbeat: op}}
	case 5:
		return &fsmv1.Command{Op: &fsmv1.Command_SetServiceHealth{SetServiceHealth: &fsmv1.SetServiceHealth{
			Service: svc, InstanceId: id, Health: clusterv1.Health(g.r.IntN(4)), LastHeartbeat: timestamppb.New(g.now.Add(-time.Duration(g.r.IntN(3)) * time.Second)),
		}}}
	case 6:
		op := &fsmv1.SetConfig{Key: g.pick("k1", "k2", "bad key"), Value: fmt.Sprint("v", len(g.out))}
		if g.r.IntN(3) == 0 {
			rev := uint64(g.r.IntN(len(g.out) + 1))
			op.CasRevision = &rev
		}
		return &fsmv1.Command{Op: &fsmv1.Command_SetConfig{SetConfig: op}}
	case 7:
		return &fsmv1.Command{Op: &fsmv1.Command_DeleteConfig{DeleteConfig: &fsmv1.DeleteConfig{Key: g.pick("k1", "k2", "")}}}
	case 8:
		s := &schedulev1.Schedule{Id: sid, VmId: "vm-" + sid, Action: schedulev1.Action_ACTION_POWER_ON, Cron: g.pick("0 7 * * *", ""),
			TimeZone: "UTC", Enabled: true, HistoryLimit: uint32(g.r.IntN(4))}
		return &fsmv1.Command{Op: &fsmv1.Command_PutSchedule{PutSchedule: &fsmv1.PutSchedule{Schedule: s}}}
	case 9:
		return &fsmv1.Command{Op: &fsmv1.Command_DeleteSchedule{DeleteSchedule: &fsmv1.DeleteSchedule{Id: sid}}}
	case 10, 11:
		last := g.cursor[sid]
		slot := last + int64(1+g.r.IntN(4))*100
		var skipped []*timestamppb.Timestamp
		for s := last + 100; s < slot; s += 100 {
			skipped = append(skipped, g.slot(s))
		}
		g.cursor[sid] = slot
		return &fsmv1.Command{Op: &fsmv1.Command_ClaimSlot{ClaimSlot: &fsmv1.ClaimSlot{
			ScheduleId: sid, Slot: g.slot(slot), Node: "n1", Skipped: skipped, SkipReason: "missed",
		}}}
	case 12:
		return &fsmv1.Command{Op: &fsmv1.Command_RecordRun{RecordRun: &fsmv1.RecordRun{Run: &schedulev1.Run{
			ScheduleId: sid, Slot: g.slot(g.cursor[sid]), Outcome: schedulev1.RunOutcome(1 + g.r.IntN(3)), Attempts: 1,
			FinishedAt: timestamppb.New(g.now), Host: "n2", Error: g.pick("", "boom"),
		}}}}
	case 13:
		if g.r.IntN(4) == 0 {
			cert, key := fsmtest.CA()
			return &fsmv1.Command{Op: &fsmv1.Command_SetClusterCa{SetClusterCa: &fsmv1.SetClusterCA{CertPem: cert, KeyPem: key}}}
		}
		return &fsmv1.Command{Op: &fsmv1.Command_Restored{Restored: &fsmv1.Restored{SnapshotId: "x", SnapshotIndex: 3}}}
	case 14:
		// Operations the previous release does not know.
		return &fsmv1.Command{Op: &fsmv1.Command_RefuseWrite{RefuseWrite: &fsmv1.RefuseWrite{ErrorCode: "not_found", ErrorMessage: "no such schedule"}}}
	default:
		return &fsmv1.Command{Op: &fsmv1.Command_SetPlacements{SetPlacements: &fsmv1.SetPlacements{
			Node: "n1", Upsert: []*fsmv1.Placement{{Kind: "virtualmachines", Id: id}},
		}}}
	}
}
