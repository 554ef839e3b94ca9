package etcdstore

import (
	"testing"

	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/fsm/fsmtest"
)

// notInEtcd are the tables of the state that etcd mode keeps no keys for,
// and why. A table of fsm.Tables() that is neither here nor mapped by the
// layout fails TestLayoutCoversEveryTable.
var notInEtcd = map[string]string{
	fsm.TableIndex: "etcd's revisions are the indexes",
	// Every write of a client would put its one session key, which every
	// agent writing for the client would contend on.
	fsm.TableSessions: "etcd mode keeps a dedupe record per write (under a lease) instead of sessions",
}

// TestLayoutCoversEveryTable: every record of a state with records in every
// table (fsmtest.FullState) has an etcd key, the key is classified back
// under its table, and its value decodes to the record (index fields
// aside, which etcd's revisions replace).
func TestLayoutCoversEveryTable(t *testing.T) {
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	for i, st := range fsmtest.FullState() {
		data, err := fsm.Encode(st.Cmd)
		if err != nil {
			t.Fatal(err)
		}
		res := f.Apply(&raft.Log{Index: uint64(i + 1), Type: raft.LogCommand, Data: data}).(*fsm.Result)
		if fsm.ErrorCode(res.Err) != st.WantErr {
			t.Fatalf("step %d: %v, want %q", i, res.Err, st.WantErr)
		}
	}
	lay := newLayout("/pivirt/services")
	for _, table := range fsm.Tables() {
		if _, ok := notInEtcd[table]; ok {
			continue
		}
		recs, err := f.State().Records(table)
		if err != nil {
			t.Fatal(err)
		}
		if table == fsm.TableDedupe {
			// Raft mode keeps sessions; etcd mode the same outcomes as
			// dedupe records.
			recs = dedupeFromSessions(t, f.State())
		}
		if len(recs) == 0 {
			t.Errorf("fsmtest.FullState leaves %s empty", table)
		}
		for _, rec := range recs {
			key, err := lay.key(table, rec)
			if err != nil {
				t.Errorf("%s: %v: map the table in layout.key (or list it in notInEtcd)", table, err)
				continue
			}
			if got := lay.table(key); got != table {
				t.Errorf("%s: key %s is classified as table %q: map it in layout.table", table, key, got)
			}
			value, err := encode(table, []proto.Message{rec})
			if err != nil {
				t.Errorf("%s: %v", table, err)
				continue
			}
			back, err := decode(table, value, 7)
			if err != nil || len(back) != 1 {
				t.Errorf("%s: decode %s: %v (%d records)", table, value, err, len(back))
				continue
			}
			want, got := proto.Clone(rec), back[0]
			fsm.ClearIndexFields(want)
			fsm.ClearIndexFields(got)
			if !proto.Equal(want, got) {
				t.Errorf("%s: the key's value decodes to\n%v\nwant\n%v", table, got, want)
			}
		}
	}
}

// dedupeFromSessions returns the outcomes the sessions of st keep as the
// dedupe records etcd mode keeps of the same writes.
func dedupeFromSessions(t *testing.T, st *fsm.State) []proto.Message {
	t.Helper()
	sessions, err := st.Records(fsm.TableSessions)
	if err != nil {
		t.Fatal(err)
	}
	var out []proto.Message
	for _, m := range sessions {
		s := m.(*fsmv1.Session)
		for _, o := range s.GetOutcomes() {
			out = append(out, &fsmv1.DedupeRecord{
				ClientId: s.GetClientId(), Sequence: o.GetSequence(), Index: o.GetIndex(), Time: o.GetTime(),
				ErrorCode: o.GetErrorCode(), ErrorMessage: o.GetErrorMessage(),
			})
		}
	}
	return out
}
