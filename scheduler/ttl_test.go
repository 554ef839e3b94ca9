package scheduler

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/fsm"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// localLog applies commands straight to a real FSM, as a single-node Raft
// log would, so the reaper's proposals go through the real apply path.
type localLog struct {
	mu    sync.Mutex
	fsm   *fsm.FSM
	index uint64
}

func (l *localLog) Apply(_ context.Context, cmd []byte) (any, uint64, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.index++
	return l.fsm.Apply(&raft.Log{Index: l.index, Term: 1, Type: raft.LogCommand, Data: cmd}), l.index, nil
}

func TestTTLReaperRespectsTermStart(t *testing.T) {
	f, err := fsm.New(fsm.LatestConfig())
	if err != nil {
		t.Fatal(err)
	}
	log := &localLog{fsm: f}
	base := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	cmd, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.New(base), Op: &fsmv1.Command_RegisterService{RegisterService: &fsmv1.RegisterService{
		Instance: &clusterv1.ServiceInstance{Service: "web", InstanceId: "w1", Address: "10.0.0.1", Port: 80, Ttl: durationpb.New(10 * time.Second)},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	if res := f.Apply(&raft.Log{Index: 1, Term: 1, Type: raft.LogCommand, Data: cmd}).(*fsm.Result); res.Err != nil {
		t.Fatal(res.Err)
	}
	log.index = 1

	health := func() clusterv1.Health {
		inst, err := f.State().Service("web", "w1")
		if err != nil {
			t.Fatal(err)
		}
		return inst.GetHealth()
	}
	for _, tc := range []struct {
		name      string
		now       time.Time
		termStart time.Time
		want      clusterv1.Health
	}{
		{"within the ttl", base.Add(5 * time.Second), base, clusterv1.Health_HEALTH_PASSING},
		{"expired, but the term is younger than the ttl", base.Add(30 * time.Second), base.Add(25 * time.Second), clusterv1.Health_HEALTH_PASSING},
		{"expired and the term is older than the ttl", base.Add(30 * time.Second), base.Add(15 * time.Second), clusterv1.Health_HEALTH_CRITICAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan struct{})
			go func() {
				defer close(done)
				RunTTLReaper(ctx, TTLReaperConfig{Interval: time.Millisecond, Now: func() time.Time { return tc.now }, TermStart: tc.termStart}, f, log)
			}()
			deadline := time.Now().Add(2 * time.Second)
			for health() != tc.want && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond) // polling
			}
			// Let a few more scans run: the state must stay as wanted.
			for range 20 {
				time.Sleep(2 * time.Millisecond)
			}
			cancel()
			<-done
			if got := health(); got != tc.want {
				t.Fatalf("health = %s, want %s", got, tc.want)
			}
		})
	}
}
