// Package lincheck records histories of register, deregister and
// consistent get operations on a few instances of one service, issued by
// concurrent clients through the cluster API of several agents while tests
// inject faults, and checks them for linearizability with porcupine. The
// in-process leader-kill test (cmd/internal/agent) and the fault tests with
// real processes (cmd/internal/e2e) share it.
package lincheck

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

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

// Shape of the linearizability run.
const (
	Service = "lin"
	Clients = 6
	Keys    = 3
	// OpTimeout bounds one operation, retries included. It is below the
	// agents' 7s hold timeout, so an operation caught in an election may end
	// ambiguous.
	OpTimeout = 4 * time.Second
	// CheckTimeout bounds porcupine's search.
	CheckTimeout = 60 * time.Second
	// Ambiguous is the return time of an operation whose outcome is not
	// known: it may take effect at any time after its call.
	Ambiguous = math.MaxInt64
)

type OpKind int

const (
	Register OpKind = iota
	Deregister
	Get
)

// Input is one operation on one instance ("key") of service Service.
type Input struct {
	Kind  OpKind
	Key   string
	Value string // register: the address written
}

type Result int

const (
	OK       Result = iota
	NotFound        // deregister or get: no such instance
	Unknown         // write with an ambiguous outcome
)

type Output struct {
	Result Result
	Value  string // get: the address read
}

// Model is a register per key: the state is the instance's address, ""
// when it is not registered.
var Model = porcupine.Model{
	Partition: func(history []porcupine.Operation) [][]porcupine.Operation {
		byKey := map[string][]porcupine.Operation{}
		for _, op := range history {
			k := op.Input.(Input).Key
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
				keyOf[ev.Id] = ev.Value.(Input).Key
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
		st, in, out := state.(string), input.(Input), output.(Output)
		switch in.Kind {
		case Register:
			// Acknowledged or ambiguous: either way the write sets the value
			// if it is linearized; an ambiguous one that never applied is
			// linearized after everything else.
			return out.Result != NotFound, in.Value
		case Deregister:
			switch out.Result {
			case OK:
				return st != "", ""
			case NotFound:
				return st == "", ""
			default:
				return true, ""
			}
		case Get:
			switch out.Result {
			case OK:
				return st == out.Value, st
			case NotFound:
				return st == "", st
			}
		}
		return false, st
	},
	DescribeOperation: func(input, output any) string {
		in, out := input.(Input), output.(Output)
		var res string
		switch out.Result {
		case OK:
			res = "ok"
			if in.Kind == Get {
				res = out.Value
			}
		case NotFound:
			res = "not_found"
		default:
			res = "unknown"
		}
		switch in.Kind {
		case Register:
			return fmt.Sprintf("register(%s, %s) -> %s", in.Key, in.Value, res)
		case Deregister:
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

// History collects the operations of all clients.
type History struct {
	start time.Time

	mu          sync.Mutex
	ops         []porcupine.Operation
	annotations []porcupine.Annotation
	// counts of outcomes, by kind and result or error code, for the log.
	counts map[string]int
	// wrong are the answers that were not their operation's outcome.
	wrong []string
}

func NewHistory() *History {
	return &History{start: time.Now(), counts: map[string]int{}}
}

// now is the history's clock: monotonic nanoseconds since the start.
func (h *History) Now() int64 { return int64(time.Since(h.start)) }

func (h *History) Add(op porcupine.Operation, outcome string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ops = append(h.ops, op)
	h.counts[outcome]++
}

// Wrong records an answer that is not the outcome of its own operation;
// Check fails the test for each.
func (h *History) Wrong(msg string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.wrong = append(h.wrong, msg)
	h.counts["wrong answer"]++
}

func (h *History) Count(outcome string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.counts[outcome]++
}

// event notes a fault in the log and in the visualization.
func (h *History) Event(t testing.TB, format string, args ...any) {
	t.Helper()
	at := h.Now()
	msg := fmt.Sprintf(format, args...)
	t.Logf("%6.2fs %s", time.Duration(at).Seconds(), msg)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.annotations = append(h.annotations, porcupine.Annotation{Tag: "faults", Start: at, Description: msg})
}

// answered counts the clients' writes and reads with a definite outcome
// (the final reads left out).
func (h *History) Answered() (writes, reads int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, op := range h.ops {
		switch {
		case op.Return == Ambiguous, op.ClientId == Clients:
		case op.Input.(Input).Kind == Get:
			reads++
		default:
			writes++
		}
	}
	return writes, reads
}

func (h *History) Snapshot() ([]porcupine.Operation, map[string]int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.ops), maps.Clone(h.counts)
}

// Client issues random operations through random nodes until stop is
// closed or the shared budget is spent. Its writes carry its own client ID
// and increasing sequence numbers.
type Client struct {
	id       int
	clientID string
	seq      uint64
	rng      *rand.Rand
	apis     []clusterv1connect.ClusterServiceClient
	hist     *History
}

func (c *Client) Run(ctx context.Context, stop <-chan struct{}, budget *atomic.Int64) {
	for budget.Add(-1) >= 0 {
		select {
		case <-stop:
			return
		default:
		}
		key := fmt.Sprintf("i%d", c.rng.IntN(Keys))
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
func (c *Client) call(ctx context.Context, f func(context.Context, clusterv1connect.ClusterServiceClient) error) error {
	ctx, cancel := context.WithTimeout(ctx, OpTimeout)
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

func (c *Client) write() *clusterv1.WriteOptions {
	c.seq++
	return &clusterv1.WriteOptions{ClientId: c.clientID, Sequence: c.seq}
}

// record adds a write: definite outputs with their return time, ambiguous
// ones with an open end.
func (c *Client) record(in Input, call int64, out Output, err error) {
	op := porcupine.Operation{ClientId: c.id, Input: in, Call: call, Output: out, Return: c.hist.Now()}
	kind := [...]string{"register", "deregister", "get"}[in.Kind]
	outcome := kind + " ok"
	switch {
	case out.Result == NotFound:
		outcome = kind + " not_found"
	case out.Result == Unknown:
		op.Return = Ambiguous
		op.Metadata = err.Error()
		outcome = kind + " ambiguous (" + connect.CodeOf(err).String() + ")"
	}
	c.hist.Add(op, outcome)
}

func (c *Client) register(ctx context.Context, key string) {
	in := Input{Kind: Register, Key: key, Value: fmt.Sprintf("c%d-%d", c.id, c.seq+1)}
	req := &clusterv1.RegisterServiceRequest{
		Instance: &clusterv1.ServiceInstance{Service: Service, InstanceId: key, Address: in.Value, Port: 80},
		Write:    c.write(),
	}
	call := c.hist.Now()
	var resp *connect.Response[clusterv1.RegisterServiceResponse]
	err := c.call(ctx, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		var err error
		resp, err = api.RegisterService(ctx, connect.NewRequest(req))
		return err
	})
	out := Output{Result: OK}
	switch {
	case err == nil:
		// The answer is the write's own outcome, also for a retry that the
		// FSM answered as a duplicate: this write's instance, at its index.
		if inst := resp.Msg.GetInstance(); inst.GetAddress() != in.Value || inst.GetModifyIndex() != resp.Msg.GetIndex() {
			c.hist.Wrong(fmt.Sprintf("register(%s, %s) answered with %s at index %d (instance modify index %d)",
				key, in.Value, inst.GetAddress(), resp.Msg.GetIndex(), inst.GetModifyIndex()))
		}
	case connect.CodeOf(err) == connect.CodeNotFound:
		// Taken at face value, as a client does: the register failed. The
		// model refuses it, since a register never fails so.
		out.Result = NotFound
	default:
		out.Result = Unknown
	}
	c.record(in, call, out, err)
}

func (c *Client) deregister(ctx context.Context, key string) {
	in := Input{Kind: Deregister, Key: key}
	req := &clusterv1.DeregisterServiceRequest{Service: Service, InstanceId: key, Write: c.write()}
	call := c.hist.Now()
	err := c.call(ctx, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		_, err := api.DeregisterService(ctx, connect.NewRequest(req))
		return err
	})
	out := Output{Result: OK}
	switch {
	case err == nil:
	case connect.CodeOf(err) == connect.CodeNotFound:
		// The FSM's outcome, also when a retry is answered as a duplicate.
		out.Result = NotFound
	default:
		out.Result = Unknown
	}
	c.record(in, call, out, err)
}

func (c *Client) get(ctx context.Context, key string) {
	in := Input{Kind: Get, Key: key}
	req := &clusterv1.GetServiceRequest{
		Service: Service, InstanceId: key,
		Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
	}
	call := c.hist.Now()
	var resp *connect.Response[clusterv1.GetServiceResponse]
	err := c.call(ctx, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		var err error
		resp, err = api.GetService(ctx, connect.NewRequest(req))
		return err
	})
	out, ok := GetOutput(resp, err)
	if !ok {
		// A failed read has no effect: leave it out of the history.
		c.hist.Count("get failed (" + connect.CodeOf(err).String() + ")")
		return
	}
	c.record(in, call, out, nil)
}

// GetOutput turns a GetService answer into an output; ok is false for a
// failed read.
func GetOutput(resp *connect.Response[clusterv1.GetServiceResponse], err error) (out Output, ok bool) {
	switch {
	case connect.CodeOf(err) == connect.CodeNotFound:
		return Output{Result: NotFound}, true
	case err != nil:
		return Output{}, false
	}
	insts := resp.Msg.GetInstances()
	if len(insts) != 1 {
		// Not a value the model knows: porcupine will reject it.
		return Output{Result: OK, Value: fmt.Sprintf("<%d instances>", len(insts))}, true
	}
	return Output{Result: OK, Value: insts[0].GetAddress()}, true
}

// Visualize writes porcupine's HTML visualization where it survives the
// test (t.TempDir is removed) and returns its path.
func Visualize(t testing.TB, info porcupine.LinearizationInfo) string {
	t.Helper()
	f, err := os.CreateTemp("", "pivirt-linearizability-*.html")
	if err != nil {
		t.Logf("create visualization file: %v", err)
		return "(none)"
	}
	defer f.Close()
	if err := porcupine.Visualize(Model, info, f); err != nil {
		t.Logf("write visualization: %v", err)
	}
	return f.Name()
}

// Explain describes, for each key whose history porcupine could not
// linearize, the end of the longest linearization it found and the earliest
// operations it could not place after it.
func Explain(info porcupine.LinearizationInfo, ops []porcupine.Operation) string {
	byKey := map[string][]porcupine.Operation{}
	for _, op := range ops {
		k := op.Input.(Input).Key
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
		key := longest[0].Input.(Input).Key
		if len(longest) == len(byKey[key]) {
			continue
		}
		placed := map[porcupine.Operation]bool{}
		for _, op := range longest {
			placed[op] = true
		}
		fmt.Fprintf(&b, "key %s: the longest linearization places %d of %d operations, ending with:\n", key, len(longest), len(byKey[key]))
		for _, op := range longest[max(0, len(longest)-8):] {
			fmt.Fprintf(&b, "  %s\n", Describe(op))
		}
		b.WriteString("and cannot place next any of (earliest first):\n")
		rest := slices.DeleteFunc(slices.Clone(byKey[key]), func(op porcupine.Operation) bool { return placed[op] })
		slices.SortFunc(rest, func(a, b porcupine.Operation) int { return cmp.Compare(a.Call, b.Call) })
		for _, op := range rest[:min(8, len(rest))] {
			fmt.Fprintf(&b, "  %s\n", Describe(op))
		}
	}
	return b.String()
}

func Describe(op porcupine.Operation) string {
	ret := "open"
	if op.Return != Ambiguous {
		ret = fmt.Sprintf("%.3fs", time.Duration(op.Return).Seconds())
	}
	s := fmt.Sprintf("client %d [%.3fs, %s] %s", op.ClientId, time.Duration(op.Call).Seconds(), ret, Model.DescribeOperation(op.Input, op.Output))
	if op.Metadata != nil {
		s += fmt.Sprintf(" (%v)", op.Metadata)
	}
	return s
}

// NewClient returns client id of a run: its writes carry clientID and
// increasing sequence numbers; it calls random ones of apis.
func NewClient(id int, clientID string, rng *rand.Rand, apis []clusterv1connect.ClusterServiceClient, hist *History) *Client {
	return &Client{id: id, clientID: clientID, rng: rng, apis: apis, hist: hist}
}

// FinalGet reads key through api consistently and adds the read to the
// history (as the extra client Clients): after healing, every acknowledged
// write that was not overwritten must show. It fails when the read does.
func FinalGet(ctx context.Context, hist *History, api clusterv1connect.ClusterServiceClient, key string) error {
	in := Input{Kind: Get, Key: key}
	call := hist.Now()
	resp, err := api.GetService(ctx, connect.NewRequest(&clusterv1.GetServiceRequest{
		Service: Service, InstanceId: key,
		Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
	}))
	out, ok := GetOutput(resp, err)
	if !ok {
		return err
	}
	hist.Add(porcupine.Operation{ClientId: Clients, Input: in, Call: call, Output: out, Return: hist.Now()}, "final get")
	return nil
}

// Check logs the history's outcomes and checks it with porcupine: a
// history that is not linearizable (or undecided) fails t, with a
// visualization written to a file that outlives the test; so does one with
// minOps or fewer acknowledged writes or reads.
func Check(t testing.TB, hist *History, minOps int) {
	t.Helper()
	ops, counts := hist.Snapshot()
	writes, reads := hist.Answered()
	var ambiguous int
	var unusual []string // failures other than the faults' unavailability and timeouts
	var slowest time.Duration
	for _, op := range ops {
		if op.Return == Ambiguous {
			ambiguous++
			if msg, _ := op.Metadata.(string); !strings.HasPrefix(msg, "unavailable") &&
				!strings.HasPrefix(msg, "deadline_exceeded") && !strings.HasPrefix(msg, "canceled") && len(unusual) < 10 {
				unusual = append(unusual, fmt.Sprintf("  client %d %v: %s", op.ClientId, op.Input, msg))
			}
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
	if len(unusual) > 0 {
		t.Logf("ambiguous writes that failed otherwise:\n%s", strings.Join(unusual, "\n"))
	}
	checkStart := time.Now()
	res, info := porcupine.CheckOperationsVerbose(Model, ops, CheckTimeout)
	t.Logf("porcupine: %s in %s", res, time.Since(checkStart).Round(time.Millisecond))
	if res != porcupine.Ok {
		hist.mu.Lock()
		info.AddAnnotations(hist.annotations)
		hist.mu.Unlock()
		path := Visualize(t, info)
		switch res {
		case porcupine.Unknown:
			t.Errorf("porcupine could not decide linearizability within %s (result Unknown); visualization: %s", CheckTimeout, path)
		default:
			t.Errorf("history is not linearizable (%s); visualization: %s\n%s", res, path, Explain(info, ops))
		}
	}
	hist.mu.Lock()
	wrong := slices.Clone(hist.wrong)
	hist.mu.Unlock()
	if len(wrong) > 0 {
		t.Errorf("%d answers were not their own operation's outcome:\n  %s", len(wrong), strings.Join(wrong[:min(len(wrong), 20)], "\n  "))
	}
	if writes <= minOps || reads <= minOps {
		t.Errorf("too few successful operations to mean anything: %d writes and %d reads, want more than %d of each", writes, reads, minOps)
	}
}

// Start is when the history began.
func (h *History) Start() time.Time { return h.start }
