package fsm

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/go-memdb"
	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
)

// TestServiceCountsAndDeadlines: the kept instance counts (ServiceCounts)
// and the deadline indexes (ExpiredTTL, CriticalExpired) answer what a scan
// of every instance answers, after random registrations, heartbeats,
// health changes and deregistrations applied one by one and in batches of
// random sizes (rejected entries among them), and after a restore.
func TestServiceCountsAndDeadlines(t *testing.T) {
	for seed := range uint64(3) {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 11))
			now := t0
			var log []*raft.Log
			for i := range 600 {
				now = now.Add(time.Duration(r.IntN(3000)) * time.Millisecond)
				svc, id := []string{"web", "api", "db"}[r.IntN(3)], fmt.Sprint("i", r.IntN(8))
				var cmd *fsmv1.Command
				switch r.IntN(6) {
				case 0, 1:
					in := instance(svc, id)
					if r.IntN(3) > 0 {
						in.Ttl = durationpb.New(time.Duration(1+r.IntN(20)) * time.Second)
					}
					if r.IntN(2) == 0 {
						in.DeregisterCriticalAfter = durationpb.New(time.Duration(1+r.IntN(60)) * time.Second)
					}
					if r.IntN(10) == 0 {
						in.Port = MaxPort + 1 // rejected
					}
					cmd = register(in)
				case 2:
					cmd = deregister(svc, id)
				case 3:
					cmd = heartbeat(svc, id)
				default:
					cmd = setHealth(svc, id, clusterv1.Health(r.IntN(3)), nil)
				}
				cmd.Time = timestamppb.New(now)
				data, err := Encode(cmd)
				if err != nil {
					t.Fatal(err)
				}
				log = append(log, &raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, Data: data})
			}
			f := newHarness(t).f
			for start := 0; start < len(log); {
				end := min(len(log), start+1+r.IntN(40))
				f.ApplyBatch(log[start:end])
				checkServiceCounts(t, f.State(), now)
				if start < len(log)/2 && end >= len(log)/2 {
					fresh := newHarness(t).f
					if err := fresh.Restore(readCloser(snapshotBytes(t, f))); err != nil {
						t.Fatal(err)
					}
					f = fresh
					checkServiceCounts(t, f.State(), now)
				}
				start = end
			}
		})
	}
}

// checkServiceCounts fails unless st's kept counts and deadline indexes
// match a scan of every instance, at several instants around now.
func checkServiceCounts(t *testing.T, st *State, now time.Time) {
	t.Helper()
	_, insts, err := st.Services("", nil)
	if err != nil {
		t.Fatal(err)
	}
	counts := map[serviceHealth]int{}
	for _, in := range insts {
		counts[serviceHealth{in.GetService(), in.GetHealth()}]++
	}
	var want []ServiceCount
	for k, n := range counts {
		want = append(want, ServiceCount{Service: k.service, Health: k.health, Instances: n})
	}
	slices.SortFunc(want, func(a, b ServiceCount) int {
		return cmp.Or(cmp.Compare(a.Service, b.Service), cmp.Compare(a.Health, b.Health))
	})
	if got := st.ServiceCounts(); !slices.Equal(got, want) {
		t.Fatalf("ServiceCounts() = %v, a scan counts %v", got, want)
	}
	for _, d := range []time.Duration{-time.Minute, -5 * time.Second, 0, 5 * time.Second, time.Minute} {
		at := now.Add(d)
		var ttl, crit []string
		for _, in := range insts {
			if dl, ok := ttlDeadline(in); ok && dl.Before(at) {
				ttl = append(ttl, in.GetService()+"/"+in.GetInstanceId())
			}
			if dl, ok := criticalDeadline(in); ok && dl.Before(at) {
				crit = append(crit, in.GetService()+"/"+in.GetInstanceId())
			}
		}
		if got := instanceKeys(st.ExpiredTTL(at)); !slices.Equal(got, ttl) {
			t.Fatalf("ExpiredTTL(now%+v) = %v, a scan finds %v", d, got, ttl)
		}
		if got := instanceKeys(st.CriticalExpired(at)); !slices.Equal(got, crit) {
			t.Fatalf("CriticalExpired(now%+v) = %v, a scan finds %v", d, got, crit)
		}
	}
}

// TestChecksByNode: the check rows follow registrations, check changes,
// moves to another node and deregistrations; a heartbeat of a checked
// instance and any write of another node's instance leave the node's
// watch alone; a restored state has the same rows.
func TestChecksByNode(t *testing.T) {
	h := newHarness(t)
	withCheck := func(svc, id, node, target string) *fsmv1.Command {
		in := instance(svc, id)
		in.Node = node
		in.Check = &clusterv1.HealthCheck{Tcp: target, Interval: durationpb.New(time.Second)}
		return register(in)
	}
	h.mustApply(withCheck("web", "a", "node-1", "127.0.0.1:1"))
	h.mustApply(withCheck("web", "b", "node-2", "127.0.0.1:2"))
	h.mustApply(register(instance("web", "c"))) // node-1, no check
	keys := func(st *State, node string) []string {
		t.Helper()
		rows, err := st.ChecksByNode(node, nil)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, r := range rows {
			out = append(out, r.Service+"/"+r.Instance+"@"+r.Check.GetTcp())
		}
		return out
	}
	if got := keys(h.f.State(), "node-1"); !slices.Equal(got, []string{"web/a@127.0.0.1:1"}) {
		t.Fatalf("node-1 checks %v", got)
	}
	ws := memdb.NewWatchSet()
	if _, err := h.f.State().ChecksByNode("node-1", ws); err != nil {
		t.Fatal(err)
	}
	h.mustApply(heartbeat("web", "a"))
	if fired(ws) {
		t.Fatal("a heartbeat fired node-1's watch")
	}
	h.mustApply(register(instance("web", "c")))
	if fired(ws) {
		t.Fatal("a write of an instance without a check fired node-1's watch")
	}
	h.mustApply(withCheck("web", "a", "node-1", "127.0.0.1:4")) // check changed
	waitFired(t, ws)
	if got := keys(h.f.State(), "node-1"); !slices.Equal(got, []string{"web/a@127.0.0.1:4"}) {
		t.Fatalf("node-1 checks after the change %v", got)
	}
	h.mustApply(withCheck("web", "b", "node-1", "127.0.0.1:3")) // moved to node-1
	if got := keys(h.f.State(), "node-2"); len(got) != 0 {
		t.Fatalf("node-2 checks after the move %v", got)
	}
	restored := newHarness(t)
	if err := restored.f.Restore(readCloser(h.snapshot())); err != nil {
		t.Fatal(err)
	}
	want := []string{"web/a@127.0.0.1:4", "web/b@127.0.0.1:3"}
	for name, st := range map[string]*State{"applied": h.f.State(), "restored": restored.f.State()} {
		if got := keys(st, "node-1"); !slices.Equal(got, want) {
			t.Fatalf("%s: node-1 checks %v, want %v", name, got, want)
		}
	}
	h.mustApply(deregister("web", "a"))
	if got := keys(h.f.State(), "node-1"); !slices.Equal(got, []string{"web/b@127.0.0.1:3"}) {
		t.Fatalf("node-1 checks after a deregistration %v", got)
	}
}
