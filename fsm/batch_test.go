package fsm

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm/fsmtest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// logGen generates a random Raft log of commands of every kind: valid and
// rejected ones (not found, CAS conflicts, stale health, slots not after the
// last, invalid fields), retries and reused identities of client writes,
// envelope errors, non-command entries and checkpoints, and moves of the
// cluster version between 0.0 and the latest (so that every command is
// applied at both, and across the conversions). Entries this release
// cannot apply, which stop the state machine, are TestHalt's. The
// leader clock mostly moves forward, sometimes back (a new leader), and
// sometimes jumps past the dedupe window so that many records expire at
// once.
type logGen struct {
	r      *rand.Rand
	window time.Duration
	jump   int // per mille of entries that jump past the window
	now    time.Time
	log    []*raft.Log

	seq      map[string]uint64
	sent     []*fsmv1.Command // commands sent with a client ID
	lastHB   map[string]*timestamppb.Timestamp
	cfgRev   map[string]uint64
	schedRev map[string]uint64
	cursor   map[string]int64 // per schedule, the last slot claimed (seconds after t0)
	claimed  map[string][]int64
}

func newLogGen(seed uint64, window time.Duration, jump int) *logGen {
	return &logGen{
		r:        rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		window:   window,
		jump:     jump,
		now:      t0,
		seq:      map[string]uint64{},
		lastHB:   map[string]*timestamppb.Timestamp{},
		cfgRev:   map[string]uint64{},
		schedRev: map[string]uint64{},
		cursor:   map[string]int64{},
		claimed:  map[string][]int64{},
	}
}

func (g *logGen) pick(list ...string) string { return list[g.r.IntN(len(list))] }

func (g *logGen) slot(sec int64) *timestamppb.Timestamp {
	return timestamppb.New(t0.Add(time.Duration(sec) * time.Second))
}

// add appends an entry of the given type and data at the next index.
func (g *logGen) add(typ raft.LogType, data []byte) {
	g.log = append(g.log, &raft.Log{Index: uint64(len(g.log) + 1), Term: 1, Type: typ, Data: data})
}

// addCmd stamps cmd with the current time, encodes and appends it.
func (g *logGen) addCmd(cmd *fsmv1.Command) {
	cmd.Time = timestamppb.New(g.now)
	data, err := Encode(cmd)
	if err != nil {
		panic(err)
	}
	g.add(raft.LogCommand, data)
}

func (g *logGen) tick() {
	switch p := g.r.IntN(1000); {
	case p < 30: // a new leader whose clock is behind
		g.now = g.now.Add(-time.Duration(g.r.IntN(20)) * time.Second)
	case p < 30+g.jump: // a jump past the window: everything expires
		g.now = g.now.Add(g.window + time.Duration(g.r.IntN(10))*time.Second)
	default:
		g.now = g.now.Add(time.Duration(g.r.IntN(2000)) * time.Millisecond)
	}
}

func (g *logGen) next() {
	g.tick()
	switch p := g.r.IntN(100); {
	case p < 4:
		g.add([]raft.LogType{raft.LogNoop, raft.LogConfiguration, raft.LogBarrier}[g.r.IntN(3)], []byte("not a command"))
		return
	case p < 6:
		g.addCmd(CheckpointCommand())
		return
	case p < 9:
		// Envelope errors: no time, or a client ID without a sequence.
		cmd := heartbeat("web", "a")
		if g.r.IntN(2) == 0 {
			data, _ := Encode(cmd)
			g.add(raft.LogCommand, data)
			return
		}
		g.addCmd(withClient(cmd, "c1", 0))
		return
	case p < 19 && len(g.sent) > 0:
		// A retry of an earlier write, possibly after its record expired,
		// or (rarely) the same identity reused for another write.
		prev := proto.CloneOf(g.sent[g.r.IntN(len(g.sent))])
		if g.r.IntN(5) == 0 {
			prev.Op = g.op().Op
		}
		g.addCmd(prev)
		return
	}
	cmd := g.op()
	if g.r.IntN(100) < 60 {
		client := g.pick("c1", "c2", "c3")
		g.seq[client]++
		withClient(cmd, client, g.seq[client])
		g.sent = append(g.sent, proto.CloneOf(cmd))
	}
	g.addCmd(cmd)
}

// op returns a random operation; the generator's idea of the state (last
// heartbeats, revisions, slots) is often right and sometimes wrong.
func (g *logGen) op() *fsmv1.Command {
	index := uint64(len(g.log) + 1)
	svc, id := g.pick("web", "api"), g.pick("a", "b", "c")
	key := g.pick("k1", "k2", "k3")
	sid := g.pick("s1", "s2")
	if g.r.IntN(60) == 0 {
		return &fsmv1.Command{Op: &fsmv1.Command_Restored{Restored: &fsmv1.Restored{SnapshotId: "snap", SnapshotIndex: 3}}}
	}
	if g.r.IntN(80) == 0 {
		// The cluster CA: the test CA, or a key that does not match.
		certPEM, keyPEM := fsmtest.CA()
		if g.r.IntN(3) == 0 {
			keyPEM = []byte("-----BEGIN EC PRIVATE KEY-----\nbm90IGEga2V5\n-----END EC PRIVATE KEY-----\n")
		}
		return setClusterCA(certPEM, keyPEM)
	}
	if g.r.IntN(30) == 0 {
		return g.setPlacements()
	}
	if g.r.IntN(50) == 0 {
		// Mostly up (a state spends most of the log at the latest version),
		// sometimes down to 0.0.
		v := Latest
		if g.r.IntN(3) == 0 {
			v = Version0_0
		}
		return SetClusterVersionCommand(v)
	}
	if g.r.IntN(40) == 0 {
		// A refusal (without a client ID or with an unknown code: rejected).
		return &fsmv1.Command{Op: &fsmv1.Command_RefuseWrite{RefuseWrite: &fsmv1.RefuseWrite{
			ErrorCode: g.pick("not_found", "cas_conflict", "bogus"), ErrorMessage: "refused"}}}
	}
	switch g.r.IntN(12) {
	case 0, 1:
		in := instance(svc, id)
		switch g.r.IntN(10) {
		case 0:
			in.Address = ""
		case 1:
			in.Port = MaxPort + 1
		case 2:
			in.Node = ""
		case 3:
			in.Meta = nil
		}
		g.lastHB[svc+"/"+id] = timestamppb.New(g.now)
		return register(in)
	case 2:
		return deregister(svc, id)
	case 3:
		g.lastHB[svc+"/"+id] = timestamppb.New(g.now)
		return heartbeat(svc, id)
	case 4:
		last := g.lastHB[svc+"/"+id]
		if last == nil || g.r.IntN(4) == 0 {
			last = timestamppb.New(g.now.Add(-time.Second))
		}
		h := clusterv1.Health_HEALTH_CRITICAL
		if g.r.IntN(3) == 0 {
			h = clusterv1.Health(g.r.IntN(4))
		}
		return setHealth(svc, id, h, last)
	case 5, 6:
		value := fmt.Sprint("v", index)
		switch g.r.IntN(4) {
		case 0:
			return setConfigCAS(key, value, g.cfgRev[key])
		case 1:
			return setConfigCAS(key, value, uint64(g.r.IntN(int(index))))
		case 2:
			return setConfig("bad key", value)
		}
		g.cfgRev[key] = index
		return setConfig(key, value)
	case 7:
		if g.r.IntN(2) == 0 {
			return deleteConfigCAS(key, g.cfgRev[key])
		}
		return deleteConfig(key)
	case 8:
		s := schedule(sid)
		s.HistoryLimit = uint32(g.r.IntN(5))
		if g.r.IntN(10) == 0 {
			s.Cron = ""
		}
		switch g.r.IntN(3) {
		case 0:
			return putScheduleCAS(s, g.schedRev[sid])
		case 1:
			return putScheduleCAS(s, 0)
		}
		g.schedRev[sid] = index
		return putSchedule(s)
	case 9:
		if g.r.IntN(3) != 0 {
			return putSchedule(schedule(sid))
		}
		return deleteSchedule(sid)
	case 10:
		last := g.cursor[sid]
		slot := last + int64(1+g.r.IntN(4))*100
		if g.r.IntN(8) == 0 {
			slot = last // not after the last slot
		}
		var skipped []*timestamppb.Timestamp
		for s := last + 100; s < slot; s += 100 {
			if g.r.IntN(2) == 0 {
				skipped = append(skipped, g.slot(s))
			}
		}
		if g.r.IntN(10) == 0 {
			skipped = append(skipped, g.slot(last)) // at the last slot: invalid
		}
		if len(skipped) > 1 && g.r.IntN(5) == 0 {
			skipped = append(skipped, skipped[0]) // a repeated skipped slot
		}
		g.cursor[sid] = max(g.cursor[sid], slot)
		g.claimed[sid] = append(g.claimed[sid], slot)
		g.schedRev[sid] = index
		return claim(sid, g.slot(slot), skipped...)
	default:
		slot := int64(g.r.IntN(10)) * 100
		if c := g.claimed[sid]; len(c) > 0 && g.r.IntN(4) != 0 {
			slot = c[g.r.IntN(len(c))]
		}
		return recordRun(&schedulev1.Run{
			ScheduleId: sid, Slot: g.slot(slot),
			Outcome:  schedulev1.RunOutcome(g.r.IntN(5)),
			Attempts: uint32(g.r.IntN(3)), Error: g.pick("", "boom"),
		})
	}
}

// setPlacements returns a set_placements of one of two nodes: upserts
// (moves between the nodes included), deletes, full listings, repeats,
// and sometimes an invalid field.
func (g *logGen) setPlacements() *fsmv1.Command {
	kinds := PlacementKinds()
	op := &fsmv1.SetPlacements{Node: g.pick("n1", "n2")}
	used := map[string]bool{}
	entry := func() *fsmv1.Placement {
		e := &fsmv1.Placement{Kind: kinds[g.r.IntN(2)], Id: g.pick("a", "b", "c", "d")}
		if used[e.Kind+"/"+e.Id] {
			return nil
		}
		used[e.Kind+"/"+e.Id] = true
		return e
	}
	for range g.r.IntN(4) {
		if e := entry(); e != nil {
			op.Upsert = append(op.Upsert, e)
		}
	}
	for range g.r.IntN(2) {
		if e := entry(); e != nil {
			op.Delete = append(op.Delete, e)
		}
	}
	if g.r.IntN(3) == 0 {
		op.FullKinds = []string{kinds[g.r.IntN(2)]}
	}
	switch g.r.IntN(12) {
	case 0:
		op.Node = ""
	case 1:
		op.Upsert = append(op.Upsert, &fsmv1.Placement{Kind: "pods", Id: "x"})
	case 2:
		op.FullKinds = []string{"volumes", "volumes"}
	case 3:
		op.Delete = append(op.Delete, &fsmv1.Placement{Kind: "volumes", Id: "bad\x00id"})
	case 4, 5:
		// A repeat in one list (valid), or an entry in both (not).
		if len(op.Upsert) > 0 {
			op.Upsert = append(op.Upsert, op.Upsert[0])
		}
		if len(op.Delete) > 0 {
			op.Delete = append(op.Delete, op.Delete[0])
		}
	case 6:
		if len(op.Upsert) > 0 {
			op.Delete = append(op.Delete, op.Upsert[0])
		}
	}
	return &fsmv1.Command{Op: &fsmv1.Command_SetPlacements{SetPlacements: op}}
}

// TestLogGenCoversEveryCommand: the random logs of TestApplyBatchMatchesApply
// hold every operation of fsmv1.Command (a new command needs a case in
// logGen.op).
func TestLogGenCoversEveryCommand(t *testing.T) {
	seen := map[protoreflect.Name]bool{}
	for _, l := range genLog(1, 3000, 2*time.Minute, 5, 0) {
		cmd, err := Decode(l.Data)
		if l.Type != raft.LogCommand || err != nil {
			continue
		}
		if op := cmd.ProtoReflect().WhichOneof(opOneof); op != nil {
			seen[op.Name()] = true
		}
	}
	fields := opOneof.Fields()
	for i := range fields.Len() {
		if name := fields.Get(i).Name(); !seen[name] {
			t.Errorf("the random log generator never makes %s: add it to logGen.op", name)
		}
	}
}

// genLog generates n entries. jumpAt, when positive, is an entry number at
// which the leader clock jumps past the window.
func genLog(seed uint64, n int, window time.Duration, jump, jumpAt int) []*raft.Log {
	g := newLogGen(seed, window, jump)
	for len(g.log) < n {
		if len(g.log) == jumpAt {
			g.now = g.now.Add(window + time.Second)
		}
		g.next()
	}
	return g.log
}

// diffResult describes how two results differ, or returns "".
func diffResult(got, want *Result) string {
	switch {
	case got == nil || want == nil:
		if got != want {
			return fmt.Sprintf("got %+v, want %+v", got, want)
		}
		return ""
	case got.Index != want.Index || got.Duplicate != want.Duplicate:
		return fmt.Sprintf("got index %d duplicate %v, want %d %v", got.Index, got.Duplicate, want.Index, want.Duplicate)
	case (got.Err == nil) != (want.Err == nil):
		return fmt.Sprintf("got error %v, want %v", got.Err, want.Err)
	case got.Err != nil && (got.Err.Error() != want.Err.Error() || errorCode(got.Err) != errorCode(want.Err)):
		return fmt.Sprintf("got error %q (%s), want %q (%s)", got.Err, errorCode(got.Err), want.Err, errorCode(want.Err))
	case !proto.Equal(got.Value, want.Value):
		return fmt.Sprintf("got value %v, want %v", got.Value, want.Value)
	}
	return ""
}

// checkDedupeHead fails if the FSM's session queue, when valid, does not
// hold one entry per committed session, in order, none later than its
// session's last use.
func checkDedupeHead(t testing.TB, f *FSM) {
	t.Helper()
	if hq := f.head; hq.valid {
		it, err := tget(f.State().txn, TableDedupe, indexID)
		if err != nil {
			t.Fatal(err)
		}
		all := collect[*fsmv1.DedupeRecord](it)
		slices.SortFunc(all, compareDedupe)
		if !slices.Equal(all, hq.recs) {
			t.Fatalf("dedupe queue (%d records) does not hold the %d dedupe records in order", len(hq.recs), len(all))
		}
	}
	q := f.sessions
	if !q.valid {
		return
	}
	it, err := tget(f.State().txn, TableSessions, indexID)
	if err != nil {
		t.Fatal(err)
	}
	all := collect[*session](it)
	if len(q.entries) != len(all) || !slices.IsSortedFunc(q.entries, compareUse) {
		t.Fatalf("session queue (%d entries) does not hold the %d sessions in order", len(q.entries), len(all))
	}
	last := make(map[string]int64, len(all))
	for _, s := range all {
		last[s.clientID] = s.lastUsed
	}
	for _, u := range q.entries {
		if lu, ok := last[u.clientID]; !ok || u.time > lu {
			t.Fatalf("session queue entry %+v: session last used %d (found %v)", u, lu, ok)
		}
		delete(last, u.clientID)
	}
}

func snapshotSum(t testing.TB, f *FSM) [32]byte {
	return sha256.Sum256(snapshotBytes(t, f))
}

// TestApplyBatchMatchesApply applies random logs one entry at a time and in
// batches of several sizes, and expects the same Result for every entry and
// byte-identical snapshots after every batch. One run also restores from a
// snapshot half-way.
func TestApplyBatchMatchesApply(t *testing.T) {
	tests := []struct {
		seed   uint64
		n      int
		window time.Duration
		jump   int
		jumpAt int
	}{
		{1, 500, 30 * time.Second, 20, 0},
		{2, 500, 10 * time.Minute, 20, 0},
		{3, 500, 5 * time.Second, 20, 0},
		// More dedupe records than the head holds, all expiring at once.
		{4, 1200, time.Hour, 0, 1100},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint("seed", tt.seed), func(t *testing.T) {
			mod := func(c *Config) {
				c.DedupeWindow = tt.window
				c.ConfigHistoryLimit = 3
				c.MaxRunHistory = 4
			}
			log := genLog(tt.seed, tt.n, tt.window, tt.jump, tt.jumpAt)

			ref := newHarness(t, mod).f
			want := make([]*Result, len(log))
			states := make([]*State, len(log))
			for i, l := range log {
				// Without a dedupe head, every prune scans the time index:
				// the head must not change what is pruned.
				ref.sessions.invalidate()
				want[i] = ref.Apply(l).(*Result)
				states[i] = ref.State()
			}
			sums := make(map[int][32]byte)
			refSum := func(i int) [32]byte {
				if sum, ok := sums[i]; ok {
					return sum
				}
				var buf bytes.Buffer
				if err := writeSnapshot(&buf, states[i].txn, states[i].applied); err != nil {
					t.Fatal(err)
				}
				sums[i] = sha256.Sum256(buf.Bytes())
				return sums[i]
			}
			rejected, maxDedupe := 0, 0
			for i, r := range want {
				if r.Err != nil || r.Duplicate {
					rejected++
				}
				if i%50 == 0 {
					it, _ := tget(states[i].txn, TableSessions, indexID)
					n := 0
					for _, s := range collect[*session](it) {
						n += len(s.outcomes)
					}
					maxDedupe = max(maxDedupe, n)
				}
			}
			t.Logf("%d entries, %d rejected or duplicate, up to %d dedupe records", len(log), rejected, maxDedupe)

			r := rand.New(rand.NewPCG(tt.seed, 7))
			splits := map[string]func() int{
				"1":      func() int { return 1 },
				"2":      func() int { return 2 },
				"7":      func() int { return 7 },
				"64":     func() int { return 64 },
				"all":    func() int { return len(log) },
				"random": func() int { return 1 + r.IntN(100) },
			}
			for name, size := range splits {
				f := newHarness(t, mod).f
				for start, batches := 0, 0; start < len(log); batches++ {
					end := min(len(log), start+size())
					out := f.ApplyBatch(log[start:end])
					if len(out) != end-start {
						t.Fatalf("split %s: ApplyBatch returned %d results for %d entries", name, len(out), end-start)
					}
					for i, o := range out {
						if d := diffResult(o.(*Result), want[start+i]); d != "" {
							t.Fatalf("split %s: entry %d (%s): %s", name, start+i+1, describe(log[start+i]), d)
						}
					}
					// Small batches are compared every few batches only,
					// to keep the test fast under the race detector.
					if (end-start > 2 || batches%16 == 0 || end == len(log)) && snapshotSum(t, f) != refSum(end-1) {
						t.Fatalf("split %s: state after entries %d-%d differs from one-by-one application", name, start+1, end)
					}
					if f.AppliedIndex() != log[end-1].Index {
						t.Fatalf("split %s: AppliedIndex = %d, want %d", name, f.AppliedIndex(), log[end-1].Index)
					}
					checkDedupeHead(t, f)
					if name == "random" && start < len(log)/2 && end >= len(log)/2 {
						fresh := newHarness(t, mod).f
						if err := fresh.Restore(readCloser(snapshotBytes(t, f))); err != nil {
							t.Fatal(err)
						}
						f = fresh
					}
					start = end
				}
			}
		})
	}
}

// describe names a log entry for failure messages.
func describe(l *raft.Log) string {
	if l.Type != raft.LogCommand {
		return l.Type.String()
	}
	cmd, err := Decode(l.Data)
	if err != nil {
		return fmt.Sprintf("undecodable %x", l.Data)
	}
	return cmd.String()
}

func TestApplyBatchEntries(t *testing.T) {
	h := newHarness(t)
	cmd := func(c *fsmv1.Command, sec int) []byte {
		c.Time = at(sec)
		b, err := Encode(c)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	logs := []*raft.Log{
		{Index: 5, Type: raft.LogConfiguration, Data: []byte("config")},
		{Index: 6, Type: raft.LogCommand, Data: cmd(withClient(register(instance("web", "a")), "c", 1), 1)},
		{Index: 7, Type: raft.LogCommand, Data: cmd(withClient(register(instance("web", "a")), "c", 1), 2)},
		{Index: 8, Type: raft.LogCommand, Data: func() []byte { b, _ := Encode(heartbeat("web", "a")); return b }()}, // no time
		{Index: 9, Type: raft.LogCommand, Data: cmd(setConfig("k", "v"), 3)},
		{Index: 10, Type: raft.LogNoop},
	}
	ws := h.f.State()
	watch := make(map[string]<-chan struct{})
	for _, table := range Tables() {
		ch, _, err := ws.txn.FirstWatch(TableIndex, indexID, table)
		if err != nil {
			t.Fatal(err)
		}
		watch[table] = ch
	}
	out := h.f.ApplyBatch(logs)
	want := []*Result{
		{Index: 5},
		{Index: 6},
		{Index: 6, Duplicate: true},
		{Index: 8, Err: ErrInvalidCommand},
		{Index: 9},
		{Index: 10},
	}
	for i, o := range out {
		got := o.(*Result)
		if got.Index != want[i].Index || got.Duplicate != want[i].Duplicate || !errors.Is(got.Err, want[i].Err) {
			t.Errorf("result %d = %+v, want %+v", i, got, want[i])
		}
	}
	if got := h.f.AppliedIndex(); got != 10 {
		t.Errorf("AppliedIndex = %d, want 10", got)
	}
	st := h.f.State()
	for table, want := range map[string]uint64{TableServices: 6, TableSessions: 6, TableConfig: 9, TableConfigHistory: 9, TableSchedules: 0} {
		if got := st.Index(table); got != want {
			t.Errorf("index of %s = %d, want %d", table, got, want)
		}
	}
	for _, table := range []string{TableServices, TableConfig} {
		select {
		case <-watch[table]:
		default:
			t.Errorf("the watch of %s did not fire", table)
		}
	}
	if got := h.f.ApplyBatch(nil); len(got) != 0 {
		t.Errorf("ApplyBatch(nil) = %v, want no results", got)
	}
}

// writeThenFailApplier writes an instance, then fails: the atomicity bug
// that the batch path must catch and roll back.
func writeThenFailApplier(f *FSM, t *writeTxn, cmd *fsmv1.Command) (proto.Message, error) {
	op := cmd.GetDeregisterService()
	if err := t.insert(TableServices, instance(op.GetService(), op.GetInstanceId())); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("%w: failed after writing", ErrNotFound)
}

// TestWriteThenFailRollsBack swaps in an apply function that fails after
// writing: the hook must see it, and the batch must fall back to one
// transaction per entry, where the failed entry leaves only its dedupe
// record.
func TestWriteThenFailRollsBack(t *testing.T) {
	var caught []uint64
	saved, savedHook := appliers["deregister_service"], writeThenFail
	appliers["deregister_service"] = writeThenFailApplier
	writeThenFail = func(index uint64, err error) { caught = append(caught, index) }
	t.Cleanup(func() { appliers["deregister_service"], writeThenFail = saved, savedHook })

	var logs []*raft.Log
	for i, c := range []*fsmv1.Command{
		withClient(register(instance("web", "a")), "c", 1),
		withClient(deregister("web", "ghost"), "c", 2),
		setConfig("k", "v"),
		deregister("web", "ghost2"),
	} {
		c.Time = at(i)
		data, err := Encode(c)
		if err != nil {
			t.Fatal(err)
		}
		logs = append(logs, &raft.Log{Index: uint64(i + 1), Type: raft.LogCommand, Data: data})
	}

	one := newHarness(t).f
	var want []*Result
	for _, l := range logs {
		want = append(want, one.Apply(l).(*Result))
	}
	if !slices.Equal(caught, []uint64{2, 4}) {
		t.Fatalf("hook saw entries %v, want [2 4]", caught)
	}
	caught = nil
	batch := newHarness(t).f
	out := batch.ApplyBatch(logs)
	// The batch attempt and the isolated retry both report entry 2.
	if !slices.Equal(caught, []uint64{2, 2, 4}) {
		t.Errorf("hook saw entries %v, want [2 2 4]", caught)
	}
	for i, o := range out {
		if d := diffResult(o.(*Result), want[i]); d != "" {
			t.Errorf("entry %d: %s", i+1, d)
		}
	}
	if !bytes.Equal(snapshotBytes(t, batch), snapshotBytes(t, one)) {
		t.Errorf("batch and one-by-one states differ")
	}
	checkDedupeHead(t, batch)
	st := batch.State()
	if _, err := st.Service("web", "ghost"); !errors.Is(err, ErrNotFound) {
		t.Errorf("the failed entry's write survived: %v", err)
	}
	if !errors.Is(want[1].Err, ErrNotFound) {
		t.Errorf("failed entry result = %v, want its error", want[1].Err)
	}
	if res, _ := st.WriteOutcome("c", 2); res == nil || !errors.Is(res.Err, ErrNotFound) {
		t.Errorf("outcome of the failed entry = %v, want not_found", res)
	}
	if got := st.Index(TableServices); got != 1 {
		t.Errorf("services index = %d, want 1", got)
	}
}

// TestOpDigestMatchesCopy checks the digest taken from the log bytes
// against its definition: the digest of the deterministic encoding of a
// copy without the envelope and without a registration's instance.node.
func TestOpDigestMatchesCopy(t *testing.T) {
	g := newLogGen(9, time.Minute, 0)
	for range 300 {
		cmd := g.op()
		cmd.ClientId, cmd.Sequence, cmd.Time = "client", 42, at(3)
		before := proto.CloneOf(cmd)

		cp := &fsmv1.Command{}
		proto.Merge(cp, cmd)
		cp.ClientId, cp.Sequence, cp.Time = "", 0, nil
		if in := cp.GetRegisterService().GetInstance(); in != nil {
			in.Node = ""
		}
		b, err := proto.MarshalOptions{Deterministic: true}.Marshal(cp)
		if err != nil {
			t.Fatal(err)
		}
		want := sha256.Sum256(b)

		data, err := Encode(cmd)
		if err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(cmd, before) {
			t.Fatalf("encoding changed the command: %v, was %v", cmd, before)
		}
		if got := opDigest(data); !bytes.Equal(got, want[:]) {
			t.Fatalf("opDigest(%v) = %x, want %x", cmd, got, want)
		}
		// The same operation with another identity and time has the
		// same digest.
		cmd.ClientId, cmd.Sequence, cmd.Time = "other", 7, at(9)
		data2, err := Encode(cmd)
		if err != nil {
			t.Fatal(err)
		}
		if got := opDigest(data2); !bytes.Equal(got, want[:]) {
			t.Fatalf("digest depends on the envelope: %x, want %x", got, want)
		}
	}
}

// TestOpDigestLeavesOutTheNode: registrations that differ in
// instance.node alone, unknown fields inside the instance included, have
// one digest; the digest of one without a node or without an instance is
// that of its bytes as they are; another address is another digest.
func TestOpDigestLeavesOutTheNode(t *testing.T) {
	shared := newDigester()
	digest := func(in *clusterv1.ServiceInstance) []byte {
		t.Helper()
		// As a leader of 0.0 encodes it: with what it does not know.
		data, err := marshalOpts.MarshalAppend([]byte{CommandVersion}, register(in))
		if err != nil {
			t.Fatal(err)
		}
		d := opDigest(data)
		// The FSM's reused digester, twice: the same first 8 bytes.
		for range 2 {
			if got := shared.digest64(data); got != binary.BigEndian.Uint64(d) {
				t.Fatalf("digest64 = %x, want the first 8 bytes of %x", got, d)
			}
		}
		return d
	}
	a := &clusterv1.ServiceInstance{Service: "web", InstanceId: "a", Node: "node1", Address: "10.0.0.1", Port: 80}
	b := proto.CloneOf(a)
	b.Node = "node2"
	none := proto.CloneOf(a)
	none.Node = ""
	if !bytes.Equal(digest(a), digest(b)) || !bytes.Equal(digest(a), digest(none)) {
		t.Fatal("registrations differing in the node alone have different digests")
	}
	raw := func(data []byte) []byte { s := sha256.Sum256(data[1:]); return s[:] }
	for _, cmd := range []*fsmv1.Command{register(none), register(nil)} {
		data, err := Encode(cmd)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(opDigest(data), raw(data)) {
			t.Fatalf("digest of %v is not that of its bytes", cmd)
		}
	}
	// An unknown field inside the instance (a newer agent's) stays in.
	withUnknown := func(in *clusterv1.ServiceInstance) *clusterv1.ServiceInstance {
		c := proto.CloneOf(in)
		c.ProtoReflect().SetUnknown(protowire.AppendString(protowire.AppendTag(nil, 999, protowire.BytesType), "x"))
		return c
	}
	if !bytes.Equal(digest(withUnknown(a)), digest(withUnknown(b))) || bytes.Equal(digest(withUnknown(a)), digest(a)) {
		t.Fatal("an unknown field inside the instance: the node must be left out and the field kept")
	}
	other := proto.CloneOf(a)
	other.Address = "10.0.0.2"
	if bytes.Equal(digest(a), digest(other)) {
		t.Fatal("another address has the same digest")
	}
}

func TestTableNum(t *testing.T) {
	for i, td := range tableDefs {
		if got := tableNum(td.name); got != i {
			t.Errorf("tableNum(%q) = %d, want %d", td.name, got, i)
		}
	}
	if got := tableNum("nope"); got != -1 {
		t.Errorf("tableNum(unknown) = %d, want -1", got)
	}
}

// TestIndexKeys pins the key encoding of every index: it decides the order
// of lists and of snapshot records.
func TestIndexKeys(t *testing.T) {
	ts := &timestamppb.Timestamp{Seconds: 1_700_000_000, Nanos: 5}
	tkey := []byte{0x80, 0, 0, 0, 0x65, 0x53, 0xf1, 0x00, 0, 0, 0, 5}
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	u64 := func(v uint64) []byte {
		return []byte{byte(v >> 56), byte(v >> 48), byte(v >> 40), byte(v >> 32), byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}
	}
	inst := &clusterv1.ServiceInstance{Service: "web", InstanceId: "a", Node: "n1"}
	entry := &clusterv1.ConfigEntry{Key: "k", Revision: 7}
	sched := &schedulev1.Schedule{Id: "s", VmId: "vm"}
	run := &schedulev1.Run{ScheduleId: "s", Slot: ts}
	rec := &fsmv1.DedupeRecord{ClientId: "c", Sequence: 9, Time: ts}
	pl := &fsmv1.Placement{Kind: "volumes", Id: "v", Node: "n1"}
	tests := []struct {
		table, index string
		obj          any
		want         []byte
	}{
		{TableServices, indexID, inst, []byte("web\x00a\x00")},
		{TableConfig, indexID, entry, []byte("k\x00")},
		{TableConfigHistory, indexID, entry, cat([]byte("k\x00"), u64(7))},
		{TableSchedules, indexID, sched, []byte("s\x00")},
		{TableSchedules, indexVM, sched, []byte("vm\x00")},
		{TableScheduleRuns, indexID, run, cat([]byte("s\x00"), tkey)},
		{TablePlacements, indexID, pl, []byte("volumes\x00v\x00")},
		{TablePlacements, indexNode, pl, []byte("n1\x00")},
		{TableDedupe, indexID, rec, cat([]byte("c\x00"), u64(9))},
		{TableIndex, indexID, &indexEntry{Table: "services"}, []byte("services\x00")},
	}
	for _, tt := range tests {
		td, _ := tableDefByName(tt.table)
		ix := td.indexes[tt.index].Indexer
		ok, got, err := ix.(primaryIndexer).FromObject(tt.obj)
		if err != nil || !ok || !bytes.Equal(got, tt.want) {
			t.Errorf("%s.%s FromObject = %v %x %v, want %x", tt.table, tt.index, ok, got, err, tt.want)
		}
	}
	args, err := runID.FromArgs("s", ts.AsTime())
	if err != nil || !bytes.Equal(args, cat([]byte("s\x00"), tkey)) {
		t.Errorf("run key from a time.Time = %x %v", args, err)
	}
	if ok, _, _ := serviceID.FromObject(&clusterv1.ServiceInstance{Service: "web"}); ok {
		t.Errorf("a key with a missing field was indexed")
	}
	if _, err := serviceID.FromArgs("web"); err == nil {
		t.Errorf("FromArgs with a missing argument succeeded")
	}
	if _, err := dedupeID.FromArgs("c", 9); err == nil {
		t.Errorf("FromArgs with an int for a uint64 field succeeded")
	}
	for _, tc := range []struct {
		got  func() ([]byte, error)
		want []byte
	}{
		{func() ([]byte, error) { return serviceID.PrefixFromArgs("web") }, []byte("web\x00")},
		{func() ([]byte, error) { return serviceID.PrefixFromArgs("web", "a") }, []byte("web\x00a\x00")},
		{func() ([]byte, error) { return configHistoryID.PrefixFromArgs("k") }, []byte("k\x00")},
		{func() ([]byte, error) { return runID.PrefixFromArgs("s") }, []byte("s\x00")},
		{func() ([]byte, error) { return placementID.PrefixFromArgs("volumes") }, []byte("volumes\x00")},
		{func() ([]byte, error) { return serviceID.PrefixFromArgs() }, []byte{}},
	} {
		if got, err := tc.got(); err != nil || !bytes.Equal(got, tc.want) {
			t.Errorf("PrefixFromArgs = %q %v, want %q", got, err, tc.want)
		}
	}
	if _, err := serviceID.PrefixFromArgs("web", "a", "extra"); err == nil {
		t.Errorf("PrefixFromArgs with too many arguments succeeded")
	}
}

// TestRejectedCommandsWriteNothing applies every kind of rejected command in
// the middle of a batch and checks that each changed nothing but its dedupe
// record.
func TestRejectedCommandsWriteNothing(t *testing.T) {
	log := genLog(11, 400, time.Hour, 0, 0)
	ref := newHarness(t).f
	for _, l := range log {
		before := dumpTables(t, ref)
		res := ref.Apply(l).(*Result)
		if res.Err == nil && !res.Duplicate {
			continue
		}
		after := dumpTables(t, ref)
		delete(before, TableSessions)
		delete(after, TableSessions)
		delete(before, TableIndex)
		delete(after, TableIndex)
		if !reflect.DeepEqual(before, after) {
			t.Fatalf("rejected entry %d (%s, %v) changed the state", l.Index, describe(l), res.Err)
		}
	}
}

// TestSessionQueueExpiredSession retries a write of a client whose
// session expired but is not pruned yet (more than
// maxSessionPrunePerApply sessions expired at once), in batches split
// everywhere around it.
func TestSessionQueueExpiredSession(t *testing.T) {
	var log []*raft.Log
	add := func(cmd *fsmv1.Command, ts time.Time) {
		cmd.Time = timestamppb.New(ts)
		data, err := Encode(cmd)
		if err != nil {
			t.Fatal(err)
		}
		log = append(log, &raft.Log{Index: uint64(len(log) + 1), Type: raft.LogCommand, Data: data})
	}
	const n = 3*maxSessionPrunePerApply + 50
	for i := range n {
		add(withClient(setConfig("k", "v"), fmt.Sprintf("c%04d", i), 1), t0.Add(time.Duration(i)*time.Millisecond))
	}
	later := t0.Add(time.Hour)
	add(setConfig("k", "v"), later)
	add(setConfig("k", "v"), later)
	last := fmt.Sprintf("c%04d", n-10)
	add(withClient(setConfig("k", "v"), last, 1), later) // its session is still stored, expired
	add(withClient(setConfig("k", "v"), last, 1), later) // a duplicate now
	add(setConfig("k", "v"), later)

	one := newHarness(t).f
	var want []*Result
	for _, l := range log {
		want = append(want, one.Apply(l).(*Result))
		checkDedupeHead(t, one)
	}
	if !want[len(want)-2].Duplicate || want[len(want)-3].Duplicate {
		t.Fatalf("results %+v %+v, want a fresh write then its duplicate", want[len(want)-3], want[len(want)-2])
	}
	for _, size := range []int{n + 1, n + 3, len(log)} {
		f := newHarness(t).f
		got := f.ApplyBatch(log[:size])
		got = append(got, f.ApplyBatch(log[size:])...)
		for i, o := range got {
			if d := diffResult(o.(*Result), want[i]); d != "" {
				t.Fatalf("split at %d: entry %d: %s", size, i+1, d)
			}
		}
		checkDedupeHead(t, f)
		if !bytes.Equal(snapshotBytes(t, f), snapshotBytes(t, one)) {
			t.Errorf("split at %d: state differs from one-by-one application", size)
		}
	}
}

// TestSessionPruneAfterRestore prunes far more idle sessions than one
// entry may, starting from a state restored from a snapshot (so the queue
// is loaded from the table): every entry prunes maxSessionPrunePerApply
// sessions until none is idle.
func TestSessionPruneAfterRestore(t *testing.T) {
	src := newHarness(t)
	const n = 7 * maxSessionPrunePerApply / 2
	for i := range n {
		src.now = t0.Add(time.Duration(i) * time.Millisecond)
		src.mustApply(withClient(setConfig("k", "v"), fmt.Sprintf("c%04d", i), 1))
	}
	h := newHarness(t)
	if err := h.f.Restore(readCloser(src.snapshot())); err != nil {
		t.Fatal(err)
	}
	h.index, h.now = src.index, t0.Add(time.Hour)
	for left := n; left > 0; {
		h.mustApply(setConfig("k", "v"))
		left = max(0, left-maxSessionPrunePerApply)
		if got := sessionCount(t, h); got != left {
			t.Fatalf("sessions = %d, want %d", got, left)
		}
		checkDedupeHead(t, h.f)
	}
}
