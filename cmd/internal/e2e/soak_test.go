package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/vm/v1/vmv1connect"
)

// envSoak is the soak's duration (make soak DURATION=10m); unset, TestSoak
// is skipped.
const envSoak = "PIVIRT_SOAK_DURATION"

// TestSoak drives mixed traffic through three real agents for the
// duration in PIVIRT_SOAK_DURATION — service registrations and
// deregistrations, config compare-and-set writes, proxied VM calls and a
// schedule firing every second — while the leader is SIGKILLed and
// restarted every sixth of the run. It reports, per kind of call, the
// calls, errors (expected ones around a kill: Unavailable, deadline) and
// p99 latency, and each agent process's resident memory at the start and
// the end of its life; it fails on an unexpected error code, an
// acknowledged write that is missing at the end, or a schedule slot
// missing or run twice.
func TestSoak(t *testing.T) {
	v := os.Getenv(envSoak)
	if v == "" {
		t.Skip("set " + envSoak + " (make soak DURATION=10m)")
	}
	dur, err := time.ParseDuration(v)
	if err != nil || dur < 20*time.Second || dur > 24*time.Hour {
		t.Fatalf("%s=%q: want a duration from 20s to 24h", envSoak, v)
	}
	bins := buildBinaries(t)
	c := startCluster(t, bins)
	hc := c.httpClient(t)
	api := make([]clusterv1connect.ClusterServiceClient, len(c.nodes))
	vms := make([]vmv1connect.VMServiceClient, len(c.nodes))
	for i, n := range c.nodes {
		api[i] = clusterv1connect.NewClusterServiceClient(hc, "https://"+n.api)
		vms[i] = vmv1connect.NewVMServiceClient(hc, "https://"+n.api)
	}
	// One VM per node's backend (each node has its own pivirtd-sim).
	vmIDs := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		var out struct {
			VM vmOut `json:"vm"`
		}
		c.okJSON(t, n, &out, "vm", "create", fmt.Sprintf("soak-%d", i), "--vcpus", "1", "--memory-mib", "256")
		vmIDs[i] = out.VM.ID
	}
	schedID, created := c.startClockSchedule(t, c.nodes[0])

	st := newSoakStats()
	mem := newMemWatch()
	start := time.Now()
	deadline := start.Add(dur)
	ctx, stop := context.WithDeadline(context.Background(), deadline)
	defer stop()
	var (
		wg  sync.WaitGroup
		reg registry
		cfg casCounter
	)
	for w := range 4 {
		wg.Go(func() { reg.run(ctx, api, w, st) })
	}
	wg.Go(func() { cfg.run(ctx, api, st) })
	for w := range 2 {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				n := (w + i) % len(vms)
				st.do("vm get (proxied)", func(ctx context.Context) error {
					_, err := vms[n].GetVM(ctx, connect.NewRequest(&vmv1.GetVMRequest{Id: vmIDs[n]}))
					return err
				})
				st.do("vm list (proxied)", func(ctx context.Context) error {
					_, err := vms[n].ListVMs(ctx, connect.NewRequest(&vmv1.ListVMsRequest{}))
					return err
				})
			}
		})
	}
	// Every 5 s the agents' memory is sampled; every sixth of the run the
	// leader is killed and comes back 2 s later (this goroutine alone
	// touches the processes).
	kills := 0
	every := dur / 6
	nextKill := start.Add(every)
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	for ctx.Err() == nil {
		select {
		case <-tick.C:
		case <-ctx.Done():
		}
		for _, n := range c.nodes {
			mem.sample(n)
		}
		if ctx.Err() != nil || time.Now().Before(nextKill) || time.Until(deadline) < 10*time.Second {
			continue
		}
		nextKill = time.Now().Add(every)
		l, err := c.agreedLeader(t, c.nodes...)
		if err != nil {
			t.Logf("no agreed leader to kill: %v", err)
			continue
		}
		n := c.byAPI(t, l.APIAddr)
		mem.sample(n)
		c.kill(t, n)
		kills++
		time.Sleep(2 * time.Second) // the time the node stays down
		c.restart(t, n)
		t.Logf("%s: killed the leader %s (SIGKILL) and restarted it", time.Since(start).Round(time.Second), n.name)
	}
	wg.Wait()
	for _, n := range c.nodes {
		mem.sample(n)
	}

	t.Logf("soak of %s: %d leader kills", dur, kills)
	failed := st.report(t)
	reg.verify(t, c, api)
	cfg.verify(t, api)
	c.soakContinuity(t, c.nodes[0], schedID, created)
	c.agreeReplicas(t, "after the soak")
	mem.report(t)
	if failed {
		t.Fatal("unexpected errors (above)")
	}
}

// --- statistics ---------------------------------------------------------------

type opStats struct {
	ok       int
	expected map[string]int // error code -> count, codes a kill explains
	other    map[string]int // any other error: a failure
	lat      []time.Duration
	example  string
}

type soakStats struct {
	mu  sync.Mutex
	ops map[string]*opStats
}

func newSoakStats() *soakStats { return &soakStats{ops: map[string]*opStats{}} }

// expectedCodes are what a caller sees while a leader is down or changing.
var expectedCodes = []connect.Code{connect.CodeUnavailable, connect.CodeDeadlineExceeded, connect.CodeCanceled}

// lostConnection reports a call whose connection broke under it (the
// server process died): connect-go reports those as Unknown.
func lostConnection(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.EPIPE) ||
		(err != nil && strings.Contains(err.Error(), "connection reset by peer"))
}

// do runs one call with a 10 s deadline and records its outcome; the
// outcome error (nil on success) is returned.
func (s *soakStats) do(name string, f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	t0 := time.Now()
	err := f(ctx)
	d := time.Since(t0)
	s.mu.Lock()
	defer s.mu.Unlock()
	o := s.ops[name]
	if o == nil {
		o = &opStats{expected: map[string]int{}, other: map[string]int{}}
		s.ops[name] = o
	}
	switch code := connect.CodeOf(err); {
	case err == nil:
		o.ok++
		o.lat = append(o.lat, d)
	case slices.Contains(expectedCodes, code):
		o.expected[code.String()]++
	case lostConnection(err):
		// The agent answering was SIGKILLed mid-call.
		o.expected["connection lost"]++
	default:
		o.other[code.String()]++
		if o.example == "" {
			o.example = err.Error()
		}
	}
	return err
}

func (s *soakStats) report(t *testing.T) (failed bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	names := make([]string, 0, len(s.ops))
	for n := range s.ops {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		o := s.ops[n]
		slices.Sort(o.lat)
		p := func(q float64) time.Duration {
			if len(o.lat) == 0 {
				return 0
			}
			return o.lat[int(q*float64(len(o.lat)-1))]
		}
		t.Logf("%-22s %7d ok  p50 %8s  p99 %8s  max %8s  expected errors %v  other errors %v",
			n, o.ok, p(0.5).Round(10*time.Microsecond), p(0.99).Round(10*time.Microsecond), p(1).Round(time.Millisecond), o.expected, o.other)
		if len(o.other) > 0 {
			t.Errorf("%s: unexpected errors %v, e.g. %s", n, o.other, o.example)
			failed = true
		}
		if o.ok == 0 {
			t.Errorf("%s: no call succeeded", n)
			failed = true
		}
	}
	return failed
}

// --- registrations ------------------------------------------------------------

// registry registers instances and deregisters some, remembering what was
// acknowledged; a call whose answer was lost is "unknown" and not checked.
type registry struct {
	mu      sync.Mutex
	present map[string]bool // service/id -> acknowledged present (true) or absent (false)
	unknown map[string]bool
	seq     atomic.Int64
}

func (r *registry) set(key string, present, known bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.present == nil {
		r.present, r.unknown = map[string]bool{}, map[string]bool{}
	}
	if !known {
		r.unknown[key] = true
		return
	}
	r.present[key] = present
}

func (r *registry) run(ctx context.Context, api []clusterv1connect.ClusterServiceClient, w int, st *soakStats) {
	svc := fmt.Sprintf("soak-%d", w)
	var mine []string
	for ctx.Err() == nil {
		n := rand.IntN(len(api))
		id := "i-" + strconv.FormatInt(r.seq.Add(1), 10)
		err := st.do("service register", func(ctx context.Context) error {
			_, err := api[n].RegisterService(ctx, connect.NewRequest(&clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
				Service: svc, InstanceId: id, Address: "10.9.0.1", Port: 9000, Meta: map[string]string{"worker": strconv.Itoa(w)},
			}}))
			return err
		})
		r.set(svc+"/"+id, true, err == nil)
		if err == nil {
			mine = append(mine, id)
		}
		if len(mine) > 20 && rand.IntN(3) == 0 {
			victim := mine[0]
			mine = mine[1:]
			err := st.do("service deregister", func(ctx context.Context) error {
				_, err := api[rand.IntN(len(api))].DeregisterService(ctx, connect.NewRequest(&clusterv1.DeregisterServiceRequest{Service: svc, InstanceId: victim}))
				return err
			})
			r.set(svc+"/"+victim, false, err == nil)
		}
	}
}

// verify lists every soak service through every node (consistently) and
// checks each acknowledged registration and deregistration.
func (r *registry) verify(t *testing.T, c *cluster, api []clusterv1connect.ClusterServiceClient) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, a := range api {
		var found map[string]bool
		c.eventually(t, 60*time.Second, "a consistent list through "+c.nodes[i].name, func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			resp, err := a.ListServices(ctx, connect.NewRequest(&clusterv1.ListServicesRequest{Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT}}))
			if err != nil {
				return err
			}
			found = map[string]bool{}
			for _, inst := range resp.Msg.GetInstances() {
				if strings.HasPrefix(inst.GetService(), "soak-") {
					found[inst.GetService()+"/"+inst.GetInstanceId()] = true
				}
			}
			return nil
		})
		acked, lost, resurrected := 0, 0, 0
		for key, present := range r.present {
			if r.unknown[key] {
				continue
			}
			acked++
			switch {
			case present && !found[key]:
				lost++
				t.Errorf("via %s: %s was acknowledged registered and is missing", c.nodes[i].name, key)
			case !present && found[key]:
				resurrected++
				t.Errorf("via %s: %s was acknowledged deregistered and is present", c.nodes[i].name, key)
			}
		}
		t.Logf("via %s: %d acknowledged registrations and deregistrations checked (%d of unknown outcome skipped): %d missing, %d back", c.nodes[i].name, acked, len(r.unknown), lost, resurrected)
	}
}

// --- config compare-and-set ---------------------------------------------------

// casCounter increments a config value with compare-and-set writes.
type casCounter struct {
	acked atomic.Int64 // the highest value acknowledged written
}

const soakKey = "kv/soak.counter"

func (cc *casCounter) run(ctx context.Context, api []clusterv1connect.ClusterServiceClient, st *soakStats) {
	for ctx.Err() == nil {
		a := api[rand.IntN(len(api))]
		var cur int64
		var rev uint64
		err := st.do("config get (consistent)", func(ctx context.Context) error {
			resp, err := a.GetConfig(ctx, connect.NewRequest(&clusterv1.GetConfigRequest{Key: soakKey, Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT}}))
			if connect.CodeOf(err) == connect.CodeNotFound {
				return nil
			}
			if err != nil {
				return err
			}
			rev = resp.Msg.GetEntry().GetRevision()
			cur, err = strconv.ParseInt(resp.Msg.GetEntry().GetValue(), 10, 64)
			return err
		})
		if err != nil {
			continue
		}
		next := cur + 1
		err = st.do("config set (cas)", func(ctx context.Context) error {
			_, err := a.SetConfig(ctx, connect.NewRequest(&clusterv1.SetConfigRequest{Key: soakKey, Value: strconv.FormatInt(next, 10), CasRevision: &rev}))
			if connect.CodeOf(err) == connect.CodeAborted {
				return nil // lost the race to another write: an outcome, not an error
			}
			return err
		})
		if err == nil {
			for {
				old := cc.acked.Load()
				if next <= old || cc.acked.CompareAndSwap(old, next) {
					break
				}
			}
		}
	}
}

// verify checks that the counter holds at least the last value a write
// was acknowledged for.
func (cc *casCounter) verify(t *testing.T, api []clusterv1connect.ClusterServiceClient) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := api[0].GetConfig(ctx, connect.NewRequest(&clusterv1.GetConfigRequest{Key: soakKey, Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT}}))
	if err != nil {
		t.Errorf("read the counter: %v", err)
		return
	}
	got, _ := strconv.ParseInt(resp.Msg.GetEntry().GetValue(), 10, 64)
	if got < cc.acked.Load() {
		t.Errorf("config %s = %d, below the %d acknowledged", soakKey, got, cc.acked.Load())
	}
	t.Logf("config %s: %d (highest acknowledged %d)", soakKey, got, cc.acked.Load())
}

// --- schedule -----------------------------------------------------------------

// soakContinuity checks the clock schedule's runs: consecutive seconds,
// each recorded once, from its creation when the history still holds it.
func (c *cluster) soakContinuity(t *testing.T, n *node, id string, created time.Time) {
	c.ok(t, n, "--timeout", "30s", "schedule", "pause", id)
	var runs runsOut
	c.eventually(t, 30*time.Second, "no run of "+id+" in flight", func() error {
		if err := c.tryJSON(t, n, &runs, "--timeout", "20s", "schedule", "runs", id); err != nil {
			return err
		}
		for _, r := range runs.Runs {
			if r.Outcome == "RUN_OUTCOME_STARTED" {
				return fmt.Errorf("slot %s still started", r.Slot)
			}
		}
		return nil
	})
	if len(runs.Runs) == 0 {
		t.Errorf("schedule %s: no run", id)
		return
	}
	outcomes := map[string]int{}
	// Newest first.
	for i := len(runs.Runs) - 1; i >= 0; i-- {
		outcomes[runs.Runs[i].Outcome]++
		if i < len(runs.Runs)-1 {
			if prev := runs.Runs[i+1].Slot; !runs.Runs[i].Slot.Equal(prev.Add(time.Second)) {
				t.Errorf("schedule %s: slot %s follows %s: a slot is missing or doubled", id, runs.Runs[i].Slot, prev)
			}
		}
	}
	if first := runs.Runs[len(runs.Runs)-1].Slot; len(runs.Runs) < 1000 && !first.Equal(created.Truncate(time.Second).Add(time.Second)) {
		t.Errorf("schedule %s: first slot %s, want the second after its creation %s", id, first, created)
	}
	t.Logf("schedule %s: %d consecutive slots, each recorded once: %v", id, len(runs.Runs), outcomes)
}

// --- memory -------------------------------------------------------------------

// memWatch keeps, per agent process (pid), its first resident memory
// sample once warm (memWarmUp after its start) and its last.
type memWatch struct {
	mu      sync.Mutex
	procs   map[int]*memLife
	started map[int]time.Time // first seen
}

const memWarmUp = 15 * time.Second

type memLife struct {
	node        string
	first, last int64 // kB
	from, to    time.Time
}

func newMemWatch() *memWatch {
	return &memWatch{procs: map[int]*memLife{}, started: map[int]time.Time{}}
}

func (m *memWatch) sample(n *node) {
	p := n.proc
	if p == nil || p.exited() {
		return
	}
	pid := p.cmd.Process.Pid
	kb, err := rssKB(pid)
	if err != nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.started[pid]; !ok {
		m.started[pid] = time.Now()
	}
	if time.Since(m.started[pid]) < memWarmUp {
		return
	}
	l := m.procs[pid]
	if l == nil {
		l = &memLife{node: n.name, first: kb, from: time.Now()}
		m.procs[pid] = l
	}
	l.last, l.to = kb, time.Now()
}

func rssKB(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			return strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	return 0, errors.New("no VmRSS")
}

func (m *memWatch) report(t *testing.T) {
	m.mu.Lock()
	defer m.mu.Unlock()
	pids := make([]int, 0, len(m.procs))
	for pid := range m.procs {
		pids = append(pids, pid)
	}
	slices.Sort(pids)
	for _, pid := range pids {
		l := m.procs[pid]
		t.Logf("memory %s (pid %d, race-enabled build): RSS %d MiB -> %d MiB (%+d MiB) over %s",
			l.node, pid, l.first>>10, l.last>>10, (l.last-l.first)>>10, l.to.Sub(l.from).Round(time.Second))
	}
}
