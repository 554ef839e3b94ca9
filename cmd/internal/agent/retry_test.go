package agent_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// Shape of the retry run.
const (
	retryClients = 6
	retryKeys    = 2 // instances, config keys and schedules each: clients collide
	// retryAttempt bounds one attempt; retryOp bounds one write with its
	// retries, below the agents' 7s hold timeout plus an election.
	retryAttempt = 3 * time.Second
	retryOpTime  = 12 * time.Second
	// retryMinLoad is how long the clients run at least; they go on, up
	// to retryMaxLoad in all, until retryWant writes were answered and
	// repeated (a loaded machine answers fewer per second).
	retryMinLoad = 6 * time.Second
	retryMaxLoad = 60 * time.Second
	retryWant    = 200
	// retryEnough is the least that means anything.
	retryEnough = 60
)

// TestRetriedWritesAnswerTheirOwnOutcome runs concurrent clients that issue
// every write RPC of the cluster and schedule APIs on a few shared objects
// while the leader is killed twice. A write whose attempt fails without an
// answer (the agent asked is down, no leader) is sent again with the same
// identity through another agent, as docs/cluster.md documents and pvcli does.
// Once a write has an answer, another client changes the same object and
// the write is sent once more through another agent: the repeat must give
// exactly the first answer, and every answer must be the write's own
// outcome (its instance, its value, its enabled flag), never the object as
// another writer left it.
func TestRetriedWritesAnswerTheirOwnOutcome(t *testing.T) {
	c := agenttest.NewExpect(t, 3, nil)
	c.WaitLeader(waitFor)
	c.WaitPeers(waitFor, 3, 0)
	run := startRetryClients(t, c)
	for round := 1; round <= 2; round++ {
		linPause(t, 1500*time.Millisecond)
		leader := c.WaitLeader(waitFor)
		i := c.Index(leader)
		run.event(t, "kill leader %s", leader.Name)
		c.Kill(i)
		next := c.WaitLeader(waitFor)
		run.event(t, "new leader %s", next.Name)
		c.Restart(i, false, next.GossipAddr())
		linWaitHealed(t, c)
		run.event(t, "healed (round %d)", round)
	}
	run.finish(t)
}

// TestEtcdRetriedWritesAnswerTheirOwnOutcome is the same in etcd mode,
// while etcd's leader member is stopped and started again and the agent
// holding the schedule leadership is killed.
func TestEtcdRetriedWritesAnswerTheirOwnOutcome(t *testing.T) {
	ec := etcdtest.Start(t, 3)
	c := agenttest.NewEtcd(t, 3, ec.Endpoints, nil)
	c.WaitLeader(waitFor)
	etcdWaitReady(t, c)
	run := startRetryClients(t, c)
	linPause(t, 1500*time.Millisecond)
	name := ec.Leader()
	m := slices.Index(ec.Names, name)
	if m < 0 {
		t.Fatalf("no etcd member leads (%s)", name)
	}
	run.event(t, "stop etcd leader %s", name)
	ec.Stop(m)
	linPause(t, 1500*time.Millisecond)
	ec.Restart(m)
	etcdWaitReady(t, c)
	run.event(t, "etcd healed")
	leader := c.WaitLeader(waitFor)
	i := c.Index(leader)
	run.event(t, "kill agent %s (schedule leader)", leader.Name)
	c.Kill(i)
	next := c.WaitLeader(waitFor)
	c.Restart(i, false, next.GossipAddr())
	etcdWaitReady(t, c)
	run.event(t, "healed")
	run.finish(t)
}

// retryRun is the clients of one test.
type retryRun struct {
	start time.Time
	stop  func()

	mu     sync.Mutex
	counts map[string]int // outcomes by RPC, for the log
	wrong  []string       // answers that were not their write's own outcome
}

func (r *retryRun) event(t *testing.T, format string, args ...any) {
	t.Helper()
	t.Logf("%6.2fs %s", time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
}

func (r *retryRun) count(what string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.counts[what]++
}

func (r *retryRun) fail(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.wrong = append(r.wrong, fmt.Sprintf(format, args...))
}

// finish lets the load run its minimum, stops the clients and fails the
// test for every wrong answer, or when too few writes were checked.
func (r *retryRun) finish(t *testing.T) {
	t.Helper()
	linPause(t, retryMinLoad-time.Since(r.start))
	for time.Since(r.start) < retryMaxLoad && r.checked() < retryWant {
		linPause(t, 100*time.Millisecond) // polling interval
	}
	r.stop()
	checked := r.checked()
	r.mu.Lock()
	defer r.mu.Unlock()
	var lines []string
	for _, k := range slices.Sorted(maps.Keys(r.counts)) {
		lines = append(lines, fmt.Sprintf("  %-45s %d", k, r.counts[k]))
	}
	t.Logf("after %s: %d writes answered and repeated\n%s", time.Since(r.start).Round(time.Millisecond), checked, strings.Join(lines, "\n"))
	if len(r.wrong) > 0 {
		t.Errorf("%d answers were not their write's own outcome:\n  %s", len(r.wrong), strings.Join(r.wrong[:min(20, len(r.wrong))], "\n  "))
	}
	if checked < retryEnough {
		t.Errorf("only %d writes were answered and repeated in %s: too few to mean anything", checked, retryMaxLoad)
	}
}

// checked counts the writes answered and repeated so far.
func (r *retryRun) checked() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for k, v := range r.counts {
		if strings.HasSuffix(k, " checked") {
			n += v
		}
	}
	return n
}

// retryClient sends writes through the agents of a cluster.
type retryClient struct {
	run      *retryRun
	id       string
	seq      uint64
	rng      *rand.Rand
	api      []clusterv1connect.ClusterServiceClient
	sched    []schedulev1.ScheduleServiceClient
	deadline time.Time // of the current write
}

func startRetryClients(t *testing.T, c *agenttest.Cluster) *retryRun {
	t.Helper()
	run := &retryRun{start: time.Now(), counts: map[string]int{}}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	run.stop = sync.OnceFunc(func() {
		cancel()
		wg.Wait()
	})
	t.Cleanup(run.stop)
	seed := rand.Uint64()
	t.Logf("client seed %d", seed)
	for id := range retryClients {
		hc := agenttest.NewHTTPClient()
		cl := &retryClient{run: run, id: fmt.Sprintf("retry-%d-%x", id, seed), rng: rand.New(rand.NewPCG(seed, uint64(id)))}
		for _, n := range c.Nodes() {
			cl.api = append(cl.api, agenttest.NewClient(hc, n.APIAddr()))
			cl.sched = append(cl.sched, schedulev1.NewScheduleServiceClient(dialPlain(t, n.APIAddr())))
		}
		wg.Go(func() {
			defer hc.CloseIdleConnections()
			for ctx.Err() == nil {
				cl.one(ctx)
			}
		})
	}
	return run
}

// answer is the outcome of one call: a response, or an error's code.
type answer struct {
	resp proto.Message
	code string // "" for a response
}

func (a answer) String() string {
	if a.code != "" {
		return a.code
	}
	return fmt.Sprintf("%v", a.resp)
}

// answerOf turns a Connect or gRPC result into an answer; ok is false when
// the call got no answer (the agent is down, no leader, a timeout), so
// that the write must be sent again.
func answerOf(resp proto.Message, err error) (answer, bool) {
	if err == nil {
		return answer{resp: resp}, true
	}
	code := connect.CodeOf(err)
	if st, ok := status.FromError(err); ok && !errors.As(err, new(*connect.Error)) {
		code = connect.Code(st.Code()) // gRPC and Connect share the numbers
	}
	switch code {
	case connect.CodeUnavailable, connect.CodeDeadlineExceeded, connect.CodeCanceled, connect.CodeUnknown:
		return answer{code: code.String()}, false
	}
	return answer{code: code.String()}, true
}

// write is one write RPC: send sends the request (always the same one)
// through agent i; own checks that an answer is this write's own outcome.
type write struct {
	name string
	send func(ctx context.Context, i int) (proto.Message, error)
	own  func(a answer) error
	// spoil is another client's write to the same object, made between
	// the answer and the repeat.
	spoil func(ctx context.Context)
}

// one makes one write: sends it until it is answered, checks the answer,
// has the object changed by another write, sends the write again through
// another agent and checks that it gets the same answer.
func (c *retryClient) one(ctx context.Context) {
	w := c.pick(ctx)
	c.deadline = time.Now().Add(retryOpTime)
	first, via, ok := c.send(ctx, w, -1)
	if !ok {
		if ctx.Err() == nil {
			c.run.count(w.name + " without an answer")
		}
		return
	}
	if err := w.own(first); err != nil {
		c.run.fail("%s %s/%d: first answer %v: %v", w.name, c.id, c.seq, first, err)
		return
	}
	if w.spoil != nil {
		w.spoil(ctx)
	}
	c.deadline = time.Now().Add(retryOpTime)
	again, _, ok := c.send(ctx, w, via)
	if !ok {
		if ctx.Err() == nil {
			c.run.count(w.name + " repeat without an answer")
		}
		return
	}
	switch {
	case again.code != first.code:
		c.run.fail("%s %s/%d: first answer %v, the repeat %v", w.name, c.id, c.seq, first, again)
	case first.code == "" && !proto.Equal(first.resp, again.resp):
		c.run.fail("%s %s/%d: first answer %v, the repeat %v", w.name, c.id, c.seq, first, again)
	default:
		c.run.count(fmt.Sprintf("%s %s checked", w.name, map[bool]string{true: "ok", false: first.code}[first.code == ""]))
	}
}

// send sends w through random agents other than not until it is answered
// or its deadline passed; it returns the answer and the agent that gave it.
func (c *retryClient) send(ctx context.Context, w write, not int) (answer, int, bool) {
	for time.Now().Before(c.deadline) && ctx.Err() == nil {
		i := c.rng.IntN(len(c.api))
		if i == not {
			i = (i + 1) % len(c.api)
		}
		actx, cancel := context.WithTimeout(ctx, retryAttempt)
		resp, err := w.send(actx, i)
		cancel()
		if a, ok := answerOf(resp, err); ok {
			return a, i, true
		}
		pause := time.NewTimer(time.Duration(20+c.rng.IntN(80)) * time.Millisecond) // pacing between retries
		select {
		case <-ctx.Done():
		case <-pause.C:
		}
		pause.Stop()
	}
	return answer{}, -1, false
}

func (c *retryClient) next() *clusterv1.WriteOptions {
	c.seq++
	return &clusterv1.WriteOptions{ClientId: c.id, Sequence: c.seq}
}

// bestEffort makes another client's write (a spoiler), once, ignoring the
// outcome: it only has to change the object most of the time.
func (c *retryClient) bestEffort(ctx context.Context, f func(ctx context.Context, i int) error) {
	actx, cancel := context.WithTimeout(ctx, retryAttempt)
	defer cancel()
	_ = f(actx, c.rng.IntN(len(c.api)))
}

// pick builds a random write on one of the shared objects.
func (c *retryClient) pick(ctx context.Context) write {
	key := c.rng.IntN(retryKeys)
	inst, cfgKey, sched := fmt.Sprintf("i%d", key), fmt.Sprintf("kv/retry.k%d", key), fmt.Sprintf("rs%d", key)
	unique := fmt.Sprintf("%s-%d", c.id, c.seq+1)
	reregister := func(ctx context.Context) {
		c.bestEffort(ctx, func(ctx context.Context, i int) error {
			_, err := c.api[i].RegisterService(ctx, connect.NewRequest(&clusterv1.RegisterServiceRequest{
				Instance: &clusterv1.ServiceInstance{Service: "retry", InstanceId: inst, Address: "spoiler-" + unique, Port: 81}}))
			return err
		})
	}
	deregister := func(ctx context.Context) {
		c.bestEffort(ctx, func(ctx context.Context, i int) error {
			_, err := c.api[i].DeregisterService(ctx, connect.NewRequest(&clusterv1.DeregisterServiceRequest{Service: "retry", InstanceId: inst}))
			return err
		})
	}
	setEnabled := func(enabled bool) func(ctx context.Context) {
		return func(ctx context.Context) {
			c.bestEffort(ctx, func(ctx context.Context, i int) error {
				var err error
				if enabled {
					_, err = c.sched[i].ResumeSchedule(ctx, &schedulev1.ResumeScheduleRequest{Id: sched})
				} else {
					_, err = c.sched[i].PauseSchedule(ctx, &schedulev1.PauseScheduleRequest{Id: sched})
				}
				return err
			})
		}
	}
	createSchedule := func(ctx context.Context) {
		c.bestEffort(ctx, func(ctx context.Context, i int) error {
			_, err := c.sched[i].CreateSchedule(ctx, &schedulev1.CreateScheduleRequest{Schedule: retrySchedule(sched, "vm-spoiler")})
			return err
		})
	}
	setConfig := func(ctx context.Context) {
		c.bestEffort(ctx, func(ctx context.Context, i int) error {
			_, err := c.api[i].SetConfig(ctx, connect.NewRequest(&clusterv1.SetConfigRequest{Key: cfgKey, Value: "spoiler-" + unique}))
			return err
		})
	}
	wantCodes := func(a answer, codes ...string) error {
		if a.code != "" && !slices.Contains(codes, a.code) {
			return fmt.Errorf("error %s, want success or one of %v", a.code, codes)
		}
		return nil
	}

	wo := c.next()
	switch c.rng.IntN(11) {
	case 0, 1:
		req := &clusterv1.RegisterServiceRequest{Write: wo,
			Instance: &clusterv1.ServiceInstance{Service: "retry", InstanceId: inst, Address: unique, Port: 80}}
		return write{name: "register", spoil: deregister,
			send: func(ctx context.Context, i int) (proto.Message, error) {
				r, err := c.api[i].RegisterService(ctx, connect.NewRequest(req))
				return msg(r, err)
			},
			own: func(a answer) error {
				if a.code != "" {
					return fmt.Errorf("a register fails only without an answer, got %s", a.code)
				}
				r := a.resp.(*clusterv1.RegisterServiceResponse)
				if in := r.GetInstance(); in.GetAddress() != unique || in.GetInstanceId() != inst || in.GetModifyIndex() != r.GetIndex() {
					return fmt.Errorf("not this write's instance (address %s, want %s; modify index %d, index %d)", in.GetAddress(), unique, in.GetModifyIndex(), r.GetIndex())
				}
				return nil
			}}
	case 2:
		req := &clusterv1.DeregisterServiceRequest{Write: wo, Service: "retry", InstanceId: inst}
		return write{name: "deregister", spoil: reregister,
			send: func(ctx context.Context, i int) (proto.Message, error) {
				r, err := c.api[i].DeregisterService(ctx, connect.NewRequest(req))
				return msg(r, err)
			},
			own: func(a answer) error { return wantCodes(a, "not_found") }}
	case 3:
		req := &clusterv1.HeartbeatRequest{Write: wo, Service: "retry", InstanceId: inst}
		return write{name: "heartbeat", spoil: reregister,
			send: func(ctx context.Context, i int) (proto.Message, error) {
				r, err := c.api[i].Heartbeat(ctx, connect.NewRequest(req))
				return msg(r, err)
			},
			own: func(a answer) error {
				if a.code != "" {
					return wantCodes(a, "not_found")
				}
				r := a.resp.(*clusterv1.HeartbeatResponse)
				if in := r.GetInstance(); in.GetInstanceId() != inst || in.GetModifyIndex() != r.GetIndex() || in.GetHealth() != clusterv1.Health_HEALTH_PASSING {
					return fmt.Errorf("not the instance this heartbeat wrote (modify index %d, index %d, health %s)", in.GetModifyIndex(), r.GetIndex(), in.GetHealth())
				}
				return nil
			}}
	case 4, 5:
		req := &clusterv1.SetConfigRequest{Write: wo, Key: cfgKey, Value: unique}
		if c.rng.IntN(2) == 0 {
			rev := uint64(c.rng.IntN(3)) // 0: must not exist; else most likely a conflict
			req.CasRevision = &rev
		}
		return write{name: map[bool]string{true: "set_config cas", false: "set_config"}[req.CasRevision != nil], spoil: setConfig,
			send: func(ctx context.Context, i int) (proto.Message, error) {
				r, err := c.api[i].SetConfig(ctx, connect.NewRequest(req))
				return msg(r, err)
			},
			own: func(a answer) error {
				if a.code != "" {
					if req.CasRevision == nil {
						return fmt.Errorf("a plain set fails only without an answer, got %s", a.code)
					}
					return wantCodes(a, "aborted")
				}
				if e := a.resp.(*clusterv1.SetConfigResponse).GetEntry(); e.GetKey() != cfgKey || e.GetValue() != unique || e.GetRevision() == 0 {
					return fmt.Errorf("not this write's entry (value %q, want %q; revision %d)", e.GetValue(), unique, e.GetRevision())
				}
				return nil
			}}
	case 6:
		req := &clusterv1.DeleteConfigRequest{Write: wo, Key: cfgKey}
		return write{name: "delete_config", spoil: setConfig,
			send: func(ctx context.Context, i int) (proto.Message, error) {
				r, err := c.api[i].DeleteConfig(ctx, connect.NewRequest(req))
				return msg(r, err)
			},
			own: func(a answer) error { return wantCodes(a, "not_found") }}
	case 7:
		req := &schedulev1.CreateScheduleRequest{Write: wo, Schedule: retrySchedule(sched, "vm-"+unique)}
		return write{name: "create_schedule", spoil: setEnabled(false),
			send: func(ctx context.Context, i int) (proto.Message, error) {
				return msg(c.sched[i].CreateSchedule(ctx, req))
			},
			own: func(a answer) error {
				if a.code != "" {
					return wantCodes(a, "already_exists")
				}
				if s := a.resp.(*schedulev1.CreateScheduleResponse).GetSchedule(); s.GetId() != sched || s.GetVmId() != "vm-"+unique || !s.GetEnabled() {
					return fmt.Errorf("not the schedule this write created (vm %s, enabled %v)", s.GetVmId(), s.GetEnabled())
				}
				return nil
			}}
	case 8:
		req := &schedulev1.UpdateScheduleRequest{Write: wo, Schedule: &schedulev1.Schedule{Id: sched, VmId: "vm-" + unique},
			UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"vm_id"}}}
		return write{name: "update_schedule", spoil: createSchedule,
			send: func(ctx context.Context, i int) (proto.Message, error) {
				return msg(c.sched[i].UpdateSchedule(ctx, req))
			},
			own: func(a answer) error {
				if a.code != "" {
					return wantCodes(a, "not_found")
				}
				if s := a.resp.(*schedulev1.UpdateScheduleResponse).GetSchedule(); s.GetVmId() != "vm-"+unique {
					return fmt.Errorf("not the schedule this update wrote (vm %s)", s.GetVmId())
				}
				return nil
			}}
	case 9:
		enabled := c.rng.IntN(2) == 0
		name := map[bool]string{true: "resume_schedule", false: "pause_schedule"}[enabled]
		return write{name: name, spoil: setEnabled(!enabled),
			send: func(ctx context.Context, i int) (proto.Message, error) {
				if enabled {
					return msg(c.sched[i].ResumeSchedule(ctx, &schedulev1.ResumeScheduleRequest{Write: wo, Id: sched}))
				}
				return msg(c.sched[i].PauseSchedule(ctx, &schedulev1.PauseScheduleRequest{Write: wo, Id: sched}))
			},
			own: func(a answer) error {
				if a.code != "" {
					return wantCodes(a, "not_found")
				}
				var s *schedulev1.Schedule
				switch r := a.resp.(type) {
				case *schedulev1.ResumeScheduleResponse:
					s = r.GetSchedule()
				case *schedulev1.PauseScheduleResponse:
					s = r.GetSchedule()
				}
				if s.GetId() != sched || s.GetEnabled() != enabled {
					return fmt.Errorf("not the schedule this write left (enabled %v, want %v)", s.GetEnabled(), enabled)
				}
				return nil
			}}
	default:
		req := &schedulev1.DeleteScheduleRequest{Write: wo, Id: sched}
		return write{name: "delete_schedule", spoil: createSchedule,
			send: func(ctx context.Context, i int) (proto.Message, error) {
				return msg(c.sched[i].DeleteSchedule(ctx, req))
			},
			own: func(a answer) error { return wantCodes(a, "not_found") }}
	}
}

// retrySchedule is a schedule that never fires during the test.
func retrySchedule(id, vm string) *schedulev1.Schedule {
	return &schedulev1.Schedule{Id: id, VmId: vm, Action: schedulev1.Action_ACTION_REBOOT, Cron: "0 0 1 1 *", Enabled: true}
}

// msg returns a Connect response's message or a gRPC reply as a
// proto.Message (nil on error).
func msg(r any, err error) (proto.Message, error) {
	if err != nil {
		return nil, err
	}
	switch v := r.(type) {
	case interface{ Any() any }: // *connect.Response[T]
		return v.Any().(proto.Message), nil
	case proto.Message:
		return v, nil
	}
	return nil, fmt.Errorf("unexpected reply %T", r)
}
