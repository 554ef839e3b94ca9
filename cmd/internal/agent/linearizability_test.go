package agent_test

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/anishathalye/porcupine"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// Shape of the linearizability run.
const (
	linService = "lin"
	linClients = 6
	linKeys    = 3
	// linMinLoad is how long the clients run at least; they also run until
	// the fault schedule has healed the cluster, plus linTail.
	linMinLoad = 9 * time.Second
	linTail    = time.Second
	// After that the load goes on, up to linMaxLoad in all, until
	// linWantOps writes and reads each have been answered.
	linMaxLoad = 25 * time.Second
	linWantOps = 150
	// linMaxOps caps the operations all clients start together.
	linMaxOps = 6000
	// linOpTimeout bounds one operation, retries included. It is below the
	// agents' 7s hold timeout, so an operation caught in an election may end
	// ambiguous.
	linOpTimeout = 4 * time.Second
	// linCheckTimeout bounds porcupine's search.
	linCheckTimeout = 60 * time.Second
	// linAmbiguous is the return time of an operation whose outcome is not
	// known: it may take effect at any time after its call.
	linAmbiguous = math.MaxInt64
)

type linOpKind int

const (
	linRegister linOpKind = iota
	linDeregister
	linGet
)

// linInput is one operation on one instance ("key") of service linService.
type linInput struct {
	Kind  linOpKind
	Key   string
	Value string // register: the address written
}

type linResult int

const (
	linOK       linResult = iota
	linNotFound           // deregister or get: no such instance
	linUnknown            // write with an ambiguous outcome
)

type linOutput struct {
	Result linResult
	Value  string // get: the address read
}

// linModel is a register per key: the state is the instance's address, ""
// when it is not registered.
var linModel = porcupine.Model{
	Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
		byKey := map[string][]porcupine.Operation{}
		for _, op := range history {
			k := op.Input.(linInput).Key
			byKey[k] = append(byKey[k], op)
		}
		var out [][]porcupine.Operation
		for _, k := range slices.Sorted(maps.Keys(byKey)) {
			out = append(out, byKey[k])
		}
		return out
	},
	PartitionEvent: func(history []porcupine.Event) [][]porcupine.Event {
		byKey := map[string][]porcupine.Event{}
		keyOf := map[int]string{}
		for _, ev := range history {
			if ev.Kind == porcupine.CallEvent {
				keyOf[ev.Id] = ev.Value.(linInput).Key
			}
			k := keyOf[ev.Id]
			byKey[k] = append(byKey[k], ev)
		}
		var out [][]porcupine.Event
		for _, k := range slices.Sorted(maps.Keys(byKey)) {
			out = append(out, byKey[k])
		}
		return out
	},
	Init: func() any { return "" },
	Step: func(state, input, output any) (bool, any) {
		st, in, out := state.(string), input.(linInput), output.(linOutput)
		switch in.Kind {
		case linRegister:
			// Acknowledged or ambiguous: either way the write sets the value
			// if it is linearized; an ambiguous one that never applied is
			// linearized after everything else.
			return out.Result != linNotFound, in.Value
		case linDeregister:
			switch out.Result {
			case linOK:
				return st != "", ""
			case linNotFound:
				return st == "", ""
			default:
				return true, ""
			}
		case linGet:
			switch out.Result {
			case linOK:
				return st == out.Value, st
			case linNotFound:
				return st == "", st
			}
		}
		return false, st
	},
	DescribeOperation: func(input, output any) string {
		in, out := input.(linInput), output.(linOutput)
		var res string
		switch out.Result {
		case linOK:
			res = "ok"
			if in.Kind == linGet {
				res = out.Value
			}
		case linNotFound:
			res = "not_found"
		default:
			res = "unknown"
		}
		switch in.Kind {
		case linRegister:
			return fmt.Sprintf("register(%s, %s) -> %s", in.Key, in.Value, res)
		case linDeregister:
			return fmt.Sprintf("deregister(%s) -> %s", in.Key, res)
		default:
			return fmt.Sprintf("get(%s) -> %s", in.Key, res)
		}
	},
	DescribeState: func(state any) string {
		if state.(string) == "" {
			return "<absent>"
		}
		return state.(string)
	},
}

// linHistory collects the operations of all clients.
type linHistory struct {
	start time.Time

	mu          sync.Mutex
	ops         []porcupine.Operation
	annotations []porcupine.Annotation
	// counts of outcomes, by kind and result or error code, for the log.
	counts map[string]int
}

func newLinHistory() *linHistory {
	return &linHistory{start: time.Now(), counts: map[string]int{}}
}

// now is the history's clock: monotonic nanoseconds since the start.
func (h *linHistory) now() int64 { return int64(time.Since(h.start)) }

func (h *linHistory) add(op porcupine.Operation, outcome string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ops = append(h.ops, op)
	h.counts[outcome]++
}

func (h *linHistory) count(outcome string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.counts[outcome]++
}

// event notes a fault in the log and in the visualization.
func (h *linHistory) event(t *testing.T, format string, args ...any) {
	t.Helper()
	at := h.now()
	msg := fmt.Sprintf(format, args...)
	t.Logf("%6.2fs %s", time.Duration(at).Seconds(), msg)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.annotations = append(h.annotations, porcupine.Annotation{Tag: "faults", Start: at, Description: msg})
}

// answered counts the clients' writes and reads with a definite outcome
// (the final reads left out).
func (h *linHistory) answered() (writes, reads int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, op := range h.ops {
		switch {
		case op.Return == linAmbiguous, op.ClientId == linClients:
		case op.Input.(linInput).Kind == linGet:
			reads++
		default:
			writes++
		}
	}
	return writes, reads
}

func (h *linHistory) snapshot() ([]porcupine.Operation, map[string]int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.ops), maps.Clone(h.counts)
}

// linClient issues random operations through random nodes until stop is
// closed or the shared budget is spent. Its writes carry its own client ID
// and increasing sequence numbers.
type linClient struct {
	id       int
	clientID string
	seq      uint64
	rng      *rand.Rand
	apis     []clusterv1connect.ClusterServiceClient
	hist     *linHistory
}

func (c *linClient) run(ctx context.Context, stop <-chan struct{}, budget *atomic.Int64) {
	for budget.Add(-1) >= 0 {
		select {
		case <-stop:
			return
		default:
		}
		key := fmt.Sprintf("i%d", c.rng.IntN(linKeys))
		switch r := c.rng.IntN(100); {
		case r < 35:
			c.register(ctx, key)
		case r < 55:
			c.deregister(ctx, key)
		default:
			c.get(ctx, key)
		}
	}
}

// call runs f against a random node, and again (same request, so same
// client ID and sequence, against a node picked afresh) while it fails with
// Unavailable (the node asked is down, or there is no leader yet) and the
// operation's deadline allows.
func (c *linClient) call(ctx context.Context, f func(context.Context, clusterv1connect.ClusterServiceClient) error) error {
	ctx, cancel := context.WithTimeout(ctx, linOpTimeout)
	defer cancel()
	for {
		err := f(ctx, c.apis[c.rng.IntN(len(c.apis))])
		if connect.CodeOf(err) != connect.CodeUnavailable {
			return err
		}
		pause := time.NewTimer(time.Duration(20+c.rng.IntN(60)) * time.Millisecond) // pacing between retries
		select {
		case <-ctx.Done():
			pause.Stop()
			return err
		case <-pause.C:
		}
	}
}

func (c *linClient) write() *clusterv1.WriteOptions {
	c.seq++
	return &clusterv1.WriteOptions{ClientId: c.clientID, Sequence: c.seq}
}

// record adds a write: definite outputs with their return time, ambiguous
// ones with an open end.
func (c *linClient) record(in linInput, call int64, out linOutput, err error) {
	op := porcupine.Operation{ClientId: c.id, Input: in, Call: call, Output: out, Return: c.hist.now()}
	kind := [...]string{"register", "deregister", "get"}[in.Kind]
	outcome := kind + " ok"
	switch {
	case out.Result == linNotFound:
		outcome = kind + " not_found"
	case out.Result == linUnknown:
		op.Return = linAmbiguous
		op.Metadata = err.Error()
		outcome = kind + " ambiguous (" + connect.CodeOf(err).String() + ")"
	}
	c.hist.add(op, outcome)
}

func (c *linClient) register(ctx context.Context, key string) {
	in := linInput{Kind: linRegister, Key: key, Value: fmt.Sprintf("c%d-%d", c.id, c.seq+1)}
	req := &clusterv1.RegisterServiceRequest{
		Instance: &clusterv1.ServiceInstance{Service: linService, InstanceId: key, Address: in.Value, Port: 80},
		Write:    c.write(),
	}
	call := c.hist.now()
	err := c.call(ctx, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		_, err := api.RegisterService(ctx, connect.NewRequest(req))
		return err
	})
	out := linOutput{Result: linOK}
	if err != nil {
		// Every failure is ambiguous, NotFound included: a retry that the
		// FSM answers as a duplicate re-reads the instance, which may have
		// been deregistered since.
		out.Result = linUnknown
	}
	c.record(in, call, out, err)
}

func (c *linClient) deregister(ctx context.Context, key string) {
	in := linInput{Kind: linDeregister, Key: key}
	req := &clusterv1.DeregisterServiceRequest{Service: linService, InstanceId: key, Write: c.write()}
	call := c.hist.now()
	err := c.call(ctx, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		_, err := api.DeregisterService(ctx, connect.NewRequest(req))
		return err
	})
	out := linOutput{Result: linOK}
	switch {
	case err == nil:
	case connect.CodeOf(err) == connect.CodeNotFound:
		// The FSM's outcome, also when a retry is answered as a duplicate.
		out.Result = linNotFound
	default:
		out.Result = linUnknown
	}
	c.record(in, call, out, err)
}

func (c *linClient) get(ctx context.Context, key string) {
	in := linInput{Kind: linGet, Key: key}
	req := &clusterv1.GetServiceRequest{
		Service: linService, InstanceId: key,
		Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
	}
	call := c.hist.now()
	var resp *connect.Response[clusterv1.GetServiceResponse]
	err := c.call(ctx, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		var err error
		resp, err = api.GetService(ctx, connect.NewRequest(req))
		return err
	})
	out, ok := linGetOutput(resp, err)
	if !ok {
		// A failed read has no effect: leave it out of the history.
		c.hist.count("get failed (" + connect.CodeOf(err).String() + ")")
		return
	}
	c.record(in, call, out, nil)
}

// linGetOutput turns a GetService answer into an output; ok is false for a
// failed read.
func linGetOutput(resp *connect.Response[clusterv1.GetServiceResponse], err error) (out linOutput, ok bool) {
	switch {
	case connect.CodeOf(err) == connect.CodeNotFound:
		return linOutput{Result: linNotFound}, true
	case err != nil:
		return linOutput{}, false
	}
	insts := resp.Msg.GetInstances()
	if len(insts) != 1 {
		// Not a value the model knows: porcupine will reject it.
		return linOutput{Result: linOK, Value: fmt.Sprintf("<%d instances>", len(insts))}, true
	}
	return linOutput{Result: linOK, Value: insts[0].GetAddress()}, true
}

// TestLinearizability records concurrent register, deregister and consistent
// get operations on a few instances of one service while the leader is
// killed and restarted twice, and checks with porcupine that the history is
// linearizable. Reads after healing make every acknowledged write that was
// not overwritten visible to the check.
func TestLinearizability(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	c.WaitLeader(waitFor)
	c.WaitPeers(waitFor, 3, 0)
	var addrs []string
	for i := range 3 {
		addrs = append(addrs, c.Node(i).APIAddr())
	}

	hist := newLinHistory()
	stop := make(chan struct{})
	var budget atomic.Int64
	budget.Store(linMaxOps)
	var wg sync.WaitGroup
	stopClients := sync.OnceFunc(func() {
		close(stop)
		wg.Wait()
	})
	defer stopClients() // also when the fault schedule fails the test
	seed := rand.Uint64()
	t.Logf("client seed %d", seed)
	for id := range linClients {
		hc := agenttest.NewHTTPClient()
		cl := &linClient{
			id:       id,
			clientID: fmt.Sprintf("lin-%d-%x", id, seed),
			rng:      rand.New(rand.NewPCG(seed, uint64(id))),
			hist:     hist,
		}
		for _, a := range addrs {
			cl.apis = append(cl.apis, agenttest.NewClient(hc, a))
		}
		wg.Go(func() {
			defer hc.CloseIdleConnections()
			cl.run(t.Context(), stop, &budget)
		})
	}

	// The fault schedule runs here, on the test goroutine, because the
	// cluster kit fails the test from it.
	linPause(t, 2*time.Second)
	for round := 1; round <= 2; round++ {
		leader := c.WaitLeader(waitFor)
		i := c.Index(leader)
		hist.event(t, "kill leader %s", leader.Name)
		c.Kill(i)
		hist.event(t, "%s stopped", leader.Name)
		next := c.WaitLeader(waitFor)
		hist.event(t, "new leader %s", next.Name)
		c.Restart(i, false, next.GossipAddr())
		hist.event(t, "restarted %s", leader.Name)
		linWaitHealed(t, c)
		hist.event(t, "healed (round %d)", round)
	}
	linPause(t, max(linTail, linMinLoad-time.Since(hist.start)))
	for time.Since(hist.start) < linMaxLoad {
		if w, r := hist.answered(); w >= linWantOps && r >= linWantOps {
			break
		}
		linPause(t, 100*time.Millisecond) // polling interval
	}
	stopClients()
	hist.event(t, "clients stopped")

	// Final reads through every node: every acknowledged write that was not
	// overwritten must be visible.
	for _, n := range c.Nodes() {
		for k := range linKeys {
			in := linInput{Kind: linGet, Key: fmt.Sprintf("i%d", k)}
			agenttest.Eventually(t, waitFor, "final read of "+in.Key+" through "+n.Name, func() error {
				call := hist.now()
				resp, err := n.API.GetService(ctxT(t), connect.NewRequest(&clusterv1.GetServiceRequest{
					Service: linService, InstanceId: in.Key,
					Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
				}))
				out, ok := linGetOutput(resp, err)
				if !ok {
					return err
				}
				hist.add(porcupine.Operation{ClientId: linClients, Input: in, Call: call, Output: out, Return: hist.now()}, "final get")
				return nil
			})
		}
	}

	ops, counts := hist.snapshot()
	writes, reads := hist.answered()
	var ambiguous int
	var slowest time.Duration
	for _, op := range ops {
		if op.Return == linAmbiguous {
			ambiguous++
			continue
		}
		slowest = max(slowest, time.Duration(op.Return-op.Call))
	}
	var lines []string
	for _, k := range slices.Sorted(maps.Keys(counts)) {
		lines = append(lines, fmt.Sprintf("  %-40s %d", k, counts[k]))
	}
	t.Logf("history after %s: %d operations, %d acknowledged writes, %d reads, %d ambiguous writes; slowest answered operation %s\n%s",
		time.Since(hist.start).Round(time.Millisecond), len(ops), writes, reads, ambiguous, slowest.Round(time.Millisecond), strings.Join(lines, "\n"))

	checkStart := time.Now()
	res, info := porcupine.CheckOperationsVerbose(linModel, ops, linCheckTimeout)
	t.Logf("porcupine: %s in %s", res, time.Since(checkStart).Round(time.Millisecond))
	if res != porcupine.Ok {
		hist.mu.Lock()
		info.AddAnnotations(hist.annotations)
		hist.mu.Unlock()
		path := linVisualize(t, info)
		switch res {
		case porcupine.Unknown:
			t.Errorf("porcupine could not decide linearizability within %s (result Unknown); visualization: %s", linCheckTimeout, path)
		default:
			t.Errorf("history is not linearizable (%s); visualization: %s\n%s", res, path, linExplain(info, ops))
		}
	}
	if writes <= 100 || reads <= 100 {
		t.Errorf("too few successful operations to mean anything: %d writes and %d reads, want more than 100 of each", writes, reads)
	}
}

// linPause waits d as part of the fault schedule (load runs meanwhile).
func linPause(t *testing.T, d time.Duration) {
	t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
	case <-t.Context().Done():
	}
}

// linWaitHealed waits until every node follows one leader and has applied
// what that leader had committed when the wait began.
func linWaitHealed(t *testing.T, c *agenttest.Cluster) {
	t.Helper()
	leader := c.WaitLeader(waitFor)
	want := leader.Store().Status().CommitIndex
	agenttest.Eventually(t, waitFor, "every node catches up", func() error {
		for _, n := range c.Nodes() {
			if got := n.Store().Status().AppliedIndex; got < want {
				return fmt.Errorf("%s applied %d, leader had committed %d", n.Name, got, want)
			}
		}
		return nil
	})
}

// linVisualize writes porcupine's HTML visualization where it survives the
// test (t.TempDir is removed) and returns its path.
func linVisualize(t *testing.T, info porcupine.LinearizationInfo) string {
	t.Helper()
	f, err := os.CreateTemp("", "pivirt-linearizability-*.html")
	if err != nil {
		t.Logf("create visualization file: %v", err)
		return "(none)"
	}
	defer f.Close()
	if err := porcupine.Visualize(linModel, info, f); err != nil {
		t.Logf("write visualization: %v", err)
	}
	return f.Name()
}

// linExplain describes, for each key whose history porcupine could not
// linearize, the end of the longest linearization it found and the earliest
// operations it could not place after it.
func linExplain(info porcupine.LinearizationInfo, ops []porcupine.Operation) string {
	byKey := map[string][]porcupine.Operation{}
	for _, op := range ops {
		k := op.Input.(linInput).Key
		byKey[k] = append(byKey[k], op)
	}
	var b strings.Builder
	for _, sets := range info.PartialLinearizationsOperations() {
		var longest []porcupine.Operation
		for _, s := range sets {
			if len(s) > len(longest) {
				longest = s
			}
		}
		if len(longest) == 0 {
			continue
		}
		key := longest[0].Input.(linInput).Key
		if len(longest) == len(byKey[key]) {
			continue
		}
		placed := map[porcupine.Operation]bool{}
		for _, op := range longest {
			placed[op] = true
		}
		fmt.Fprintf(&b, "key %s: the longest linearization places %d of %d operations, ending with:\n", key, len(longest), len(byKey[key]))
		for _, op := range longest[max(0, len(longest)-8):] {
			fmt.Fprintf(&b, "  %s\n", linDescribe(op))
		}
		b.WriteString("and cannot place next any of (earliest first):\n")
		rest := slices.DeleteFunc(slices.Clone(byKey[key]), func(op porcupine.Operation) bool { return placed[op] })
		slices.SortFunc(rest, func(a, b porcupine.Operation) int { return cmp.Compare(a.Call, b.Call) })
		for _, op := range rest[:min(8, len(rest))] {
			fmt.Fprintf(&b, "  %s\n", linDescribe(op))
		}
	}
	return b.String()
}

func linDescribe(op porcupine.Operation) string {
	ret := "open"
	if op.Return != linAmbiguous {
		ret = fmt.Sprintf("%.3fs", time.Duration(op.Return).Seconds())
	}
	s := fmt.Sprintf("client %d [%.3fs, %s] %s", op.ClientId, time.Duration(op.Call).Seconds(), ret, linModel.DescribeOperation(op.Input, op.Output))
	if op.Metadata != nil {
		s += fmt.Sprintf(" (%v)", op.Metadata)
	}
	return s
}
