package agent_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// registerCheck registers service/id on node (its agent runs the check)
// through n.
func registerCheck(t *testing.T, n *agenttest.Node, node, service string, c *clusterv1.HealthCheck, dca time.Duration) {
	t.Helper()
	in := &clusterv1.ServiceInstance{Service: service, InstanceId: service + "-1", Node: node, Address: "127.0.0.1", Port: 80, Check: c}
	if dca > 0 {
		in.DeregisterCriticalAfter = durationProto(dca)
	}
	if _, err := n.API.RegisterService(ctxT(t), connect.NewRequest(&clusterv1.RegisterServiceRequest{Instance: in})); err != nil {
		t.Fatalf("register %s: %v", service, err)
	}
}

// instanceOf reads service's instance through n (a leader read).
func instanceOf(n *agenttest.Node, service string) (*clusterv1.ServiceInstance, error) {
	resp, err := n.API.GetService(context.Background(), connect.NewRequest(&clusterv1.GetServiceRequest{Service: service}))
	if err != nil {
		return nil, err
	}
	if len(resp.Msg.GetInstances()) != 1 {
		return nil, fmt.Errorf("%d instances of %s", len(resp.Msg.GetInstances()), service)
	}
	return resp.Msg.GetInstances()[0], nil
}

// waitHealth waits until service's instance has health h and an output
// containing output.
func waitHealth(t *testing.T, n *agenttest.Node, service string, h clusterv1.Health, output string) {
	t.Helper()
	agenttest.Eventually(t, waitFor, fmt.Sprintf("%s %s", service, h), func() error {
		inst, err := instanceOf(n, service)
		if err != nil {
			return err
		}
		if inst.GetHealth() != h || !strings.Contains(inst.GetOutput(), output) {
			return fmt.Errorf("health %s, output %q", inst.GetHealth(), inst.GetOutput())
		}
		return nil
	})
}

// TestServiceChecks: the agent of the instance's node (a follower, whose
// results go to the leader) runs HTTP, TCP and gRPC checks against real
// servers on 127.0.0.1 that the test turns healthy and unhealthy; the
// instance follows with the check's thresholds; deregister_critical_after
// removes an instance critical for too long.
func TestServiceChecks(t *testing.T) {
	c := agenttest.NewExpect(t, 2, nil)
	leader := c.WaitLeader(waitFor)
	f := c.Follower()
	ms := durationProto

	t.Run("http thresholds", func(t *testing.T) {
		// The server answers a script and notes, as each probe arrives,
		// the health the leader holds: every earlier probe's result has
		// been recorded by then (the runner probes one at a time and
		// waits for its write).
		script := []int{200, 200, 500, 500, 500, 200, 200}
		want := []clusterv1.Health{
			clusterv1.Health_HEALTH_CRITICAL, // not checked yet
			clusterv1.Health_HEALTH_CRITICAL, // 1 pass of 2
			clusterv1.Health_HEALTH_PASSING,
			clusterv1.Health_HEALTH_PASSING, // 1 failure of 3
			clusterv1.Health_HEALTH_PASSING, // 2 failures of 3
			clusterv1.Health_HEALTH_CRITICAL,
			clusterv1.Health_HEALTH_CRITICAL, // 1 pass of 2
			clusterv1.Health_HEALTH_PASSING,
		}
		var (
			mu   sync.Mutex
			seen []clusterv1.Health
		)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			h := clusterv1.Health_HEALTH_UNSPECIFIED
			if inst, err := leader.FSM().State().Service("web", "web-1"); err == nil {
				h = inst.GetHealth()
			}
			mu.Lock()
			n := len(seen)
			seen = append(seen, h)
			mu.Unlock()
			code := 200
			if n < len(script) {
				code = script[n]
			}
			w.WriteHeader(code)
			fmt.Fprintf(w, "probe %d", n+1)
		}))
		defer srv.Close()
		registerCheck(t, f, f.Name, "web", &clusterv1.HealthCheck{
			Http: srv.URL + "/health", Interval: ms(100 * time.Millisecond), Timeout: ms(80 * time.Millisecond),
			SuccessBeforePassing: 2, FailuresBeforeCritical: 3,
		}, 0)
		agenttest.Eventually(t, waitFor, "8 probes", func() error {
			mu.Lock()
			defer mu.Unlock()
			if len(seen) < len(want) {
				return fmt.Errorf("%d probes", len(seen))
			}
			return nil
		})
		mu.Lock()
		got := seen[:len(want)]
		mu.Unlock()
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("health as probes 1-%d arrived = %v, want %v", len(want), got, want)
			}
		}
		waitHealth(t, leader, "web", clusterv1.Health_HEALTH_PASSING, "200 OK")
	})

	t.Run("tcp", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		go acceptAll(ln)
		registerCheck(t, f, f.Name, "db", &clusterv1.HealthCheck{Tcp: addr, Interval: ms(100 * time.Millisecond)}, 0)
		waitHealth(t, leader, "db", clusterv1.Health_HEALTH_PASSING, "Success")
		ln.Close()
		waitHealth(t, leader, "db", clusterv1.Health_HEALTH_CRITICAL, "refused")
		ln, err = net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go acceptAll(ln)
		waitHealth(t, leader, "db", clusterv1.Health_HEALTH_PASSING, "Success")
	})

	t.Run("grpc", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		hs := health.NewServer()
		hs.SetServingStatus("api", healthpb.HealthCheckResponse_SERVING)
		s := grpc.NewServer()
		healthpb.RegisterHealthServer(s, hs)
		go func() { _ = s.Serve(ln) }()
		defer s.Stop()
		registerCheck(t, f, f.Name, "api", &clusterv1.HealthCheck{Grpc: ln.Addr().String(), GrpcService: "api", Interval: ms(100 * time.Millisecond)}, 0)
		waitHealth(t, leader, "api", clusterv1.Health_HEALTH_PASSING, "SERVING")
		hs.SetServingStatus("api", healthpb.HealthCheckResponse_NOT_SERVING)
		waitHealth(t, leader, "api", clusterv1.Health_HEALTH_CRITICAL, "NOT_SERVING")
		hs.SetServingStatus("api", healthpb.HealthCheckResponse_SERVING)
		waitHealth(t, leader, "api", clusterv1.Health_HEALTH_PASSING, "SERVING")
	})

	t.Run("deregister_critical_after", func(t *testing.T) {
		// A closed port on 127.0.0.1: the check fails at once.
		closed := fmt.Sprintf("127.0.0.1:%d", agenttest.FreePort(t))
		registerCheck(t, f, f.Name, "gone", &clusterv1.HealthCheck{Tcp: closed, Interval: ms(100 * time.Millisecond)}, time.Second)
		waitHealth(t, leader, "gone", clusterv1.Health_HEALTH_CRITICAL, "refused")
		agenttest.Eventually(t, waitFor, "the critical instance deregistered", func() error {
			_, err := instanceOf(leader, "gone")
			if err == nil {
				return errors.New("still registered")
			}
			if !strings.Contains(err.Error(), "0 instances") && connect.CodeOf(err) != connect.CodeNotFound {
				return err
			}
			return nil
		})
		// A TTL instance that missed its heartbeat goes the same way.
		if _, err := f.API.RegisterService(ctxT(t), connect.NewRequest(&clusterv1.RegisterServiceRequest{Instance: &clusterv1.ServiceInstance{
			Service: "silent", Address: "127.0.0.1", Port: 1, Ttl: ms(time.Second), DeregisterCriticalAfter: ms(time.Second),
		}})); err != nil {
			t.Fatal(err)
		}
		agenttest.Eventually(t, waitFor, "the silent TTL instance deregistered", func() error {
			_, err := instanceOf(leader, "silent")
			if err == nil {
				return errors.New("still registered")
			}
			return nil
		})
	})
}

// acceptAll accepts and closes connections until ln closes.
func acceptAll(ln net.Listener) {
	for {
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		conn.Close()
	}
}
