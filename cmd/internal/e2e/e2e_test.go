package e2e_test

import (
	"context"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding/gzip"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// TestClusterLifecycle starts three real pivirt-agent processes (built with
// -race) on 127.0.0.1 and drives them with the real pvcli binary through
// formation, replicated writes and reads in every consistency mode, config
// compare-and-set, bad input, a SIGKILLed leader, the restart of that node
// from its data dir, the README's quick start as written and a graceful
// leave.
func TestClusterLifecycle(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three agent processes built with -race; skipped with -short")
	}
	c := startCluster(t, buildBinaries(t))
	n1, n2, n3 := c.nodes[0], c.nodes[1], c.nodes[2]

	// Each step depends on the ones before it: stop at the first failure.
	step := func(name string, f func(t *testing.T)) {
		t.Helper()
		if !t.Run(name, f) {
			t.FailNow()
		}
	}

	web1 := instanceOut{
		Service:    "web",
		InstanceID: "web-1",
		Node:       n2.name, // default: the node asked
		Address:    "10.0.0.5",
		Port:       8080,
		Tags:       []string{"v1"},
		Meta:       map[string]string{"env": "prod"},
		Health:     "HEALTH_PASSING",
	}

	step("formation", func(t *testing.T) {
		c.eventually(t, 30*time.Second, "3 voters and 3 alive members seen by every node", func() error {
			if _, err := c.agreedLeader(t, c.nodes...); err != nil {
				return err
			}
			for _, n := range c.nodes {
				var p peersOut
				if err := c.tryJSON(t, n, &p, "--timeout", "2s", "cluster", "peers"); err != nil {
					return err
				}
				if got, want := sorted(p.voters()), names(c.nodes); !slices.Equal(got, want) {
					return fmt.Errorf("via %s: voters %v, want %v", n.name, got, want)
				}
				var m membersOut
				if err := c.tryJSON(t, n, &m, "--timeout", "2s", "cluster", "members"); err != nil {
					return err
				}
				if got, want := aliveMembers(m), names(c.nodes); !slices.Equal(got, want) {
					return fmt.Errorf("via %s: alive members %v, want %v (all: %+v)", n.name, got, want, m.Members)
				}
			}
			return nil
		})
	})

	step("service register and read back", func(t *testing.T) {
		var reg registerOut
		c.okJSON(t, n2, &reg, "service", "register", "web", "--address", "10.0.0.5", "--port", "8080",
			"--tag", "v1", "--meta", "env=prod", "--id", "web-1")
		if !reflect.DeepEqual(reg.Instance, web1) {
			t.Errorf("register via %s returned %+v, want %+v", n2.name, reg.Instance, web1)
		}
		if reg.Index == 0 {
			t.Errorf("register via %s returned index 0", n2.name)
		}

		// A consistent read after the write returned must see it, on any node.
		var list instancesOut
		c.okJSON(t, n3, &list, "service", "list", "--consistency", "consistent")
		if len(list.Instances) != 1 || !reflect.DeepEqual(list.Instances[0], web1) {
			t.Errorf("consistent list via %s = %+v, want exactly %+v", n3.name, list.Instances, web1)
		}

		// The API port also serves gRPC clients (grpc-go in the agent),
		// compressed requests included.
		cc, err := grpc.NewClient(n1.api, grpc.WithTransportCredentials(credentials.NewTLS(c.clientTLS(t))))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
		defer cancel()
		got, err := clusterv1.NewClusterServiceClient(cc).GetService(ctx, &clusterv1.GetServiceRequest{
			Service: "web", InstanceId: "web-1",
			Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
		}, grpc.UseCompressor(gzip.Name))
		if err != nil || len(got.GetInstances()) != 1 || got.GetInstances()[0].GetAddress() != web1.Address {
			t.Errorf("gzip gRPC get via %s = %v, %v; want web-1", n1.name, got, err)
		}

		// A stale read is served from the node's own state: it gets there.
		c.eventually(t, 10*time.Second, "web-1 in the local state of "+n1.name, func() error {
			var got instancesOut
			if err := c.tryJSON(t, n1, &got, "--timeout", "2s", "service", "get", "web", "web-1",
				"--consistency", "stale"); err != nil {
				return err
			}
			if len(got.Instances) != 1 || !reflect.DeepEqual(got.Instances[0], web1) {
				return fmt.Errorf("stale get via %s = %+v, want exactly %+v", n1.name, got.Instances, web1)
			}
			return nil
		})
	})

	step("curl and openssl as in docs/security.md", func(t *testing.T) { c.docsExamples(t, n1) })
	step("endpoint lists, contexts and version", func(t *testing.T) { c.toolkitExamples(t) })
	step("service watch and config watch", func(t *testing.T) { c.watchExamples(t) })

	step("VM, volume and network APIs through the gateway", func(t *testing.T) { c.gatewayExamples(t, n2) })
	step("every node's objects through every node", func(t *testing.T) { c.placementExamples(t) })
	step("power schedules with pvcli", func(t *testing.T) { c.scheduleExamples(t, n3) })

	step("config compare-and-set and history", func(t *testing.T) {
		var first, second setConfigOut
		c.okJSON(t, n3, &first, "config", "set", "logging.level", "debug")
		if first.Entry.Key != "logging.level" || first.Entry.Value != "debug" || first.Entry.Revision == 0 {
			t.Fatalf("config set logging.level debug returned %+v, want key logging.level, value debug, a revision", first.Entry)
		}
		rev1 := strconv.FormatUint(first.Entry.Revision, 10)

		c.okJSON(t, n3, &second, "config", "set", "logging.level", "info", "--cas", rev1)
		if second.Entry.Value != "info" || second.Entry.Revision <= first.Entry.Revision {
			t.Fatalf("config set logging.level info --cas %s returned %+v, want value info and a revision above %s",
				rev1, second.Entry, rev1)
		}

		r := c.pvcli(t, n3, "config", "set", "logging.level", "warn", "--cas", rev1)
		if r.code == 0 {
			t.Errorf("%s\nwant a non-zero exit status: revision %s is no longer current", r, rev1)
		}
		if !strings.Contains(r.stderr, "aborted") {
			t.Errorf("%s\nwant an aborted error on stderr", r)
		}

		if got := c.ok(t, n3, "config", "get", "logging.level").stdout; got != "info\n" {
			t.Errorf("config get logging.level after the failed compare-and-set = %q, want %q", got, "info\n")
		}

		var h historyOut
		c.okJSON(t, n3, &h, "config", "history", "logging.level")
		want := []configEntryOut{second.Entry, first.Entry}
		if !slices.Equal(h.Entries, want) {
			t.Errorf("config history logging.level = %+v, want newest first %+v", h.Entries, want)
		}
	})

	step("cluster settings: validated, applied on every node, rolled back", func(t *testing.T) {
		for _, bad := range [][]string{
			{"logging.level", "verbose", `logging.level: invalid value "verbose" (allowed: debug, info, warn, error)`},
			{"log_level", "debug", `free-form keys go under "kv/"`},
		} {
			r := c.pvcli(t, n2, "config", "set", bad[0], bad[1])
			if r.code == 0 || !strings.Contains(r.stderr, bad[2]) {
				t.Errorf("%s\nwant a refusal naming %q", r, bad[2])
			}
		}
		if r := c.ok(t, n2, "config", "set", "logging.level", "debug", "--dry-run"); !strings.Contains(r.stdout, "-info") || !strings.Contains(r.stdout, "+debug") || !strings.Contains(r.stdout, "dry run: nothing stored") {
			t.Errorf("%s\nwant the diff info -> debug and nothing stored", r)
		}
		if got := c.ok(t, n1, "config", "get", "logging.level").stdout; got != "info\n" {
			t.Errorf("after the dry run logging.level = %q", got)
		}
		// Rolled back to the version before (debug): debug lines appear on
		// every node (reads are audited at debug level).
		marks := map[*node]int64{}
		for _, n := range c.nodes {
			if fi, err := os.Stat(n.log); err == nil {
				marks[n] = fi.Size()
			}
		}
		c.ok(t, n2, "config", "rollback", "logging.level")
		c.eventually(t, 10*time.Second, "debug lines on every node", func() error {
			for _, n := range c.nodes {
				c.ok(t, n, "service", "list")
				b, err := os.ReadFile(n.log)
				if err != nil {
					return err
				}
				if !strings.Contains(string(b[min(int64(len(b)), marks[n]):]), "level=DEBUG") {
					return fmt.Errorf("%s logs no debug line", n.name)
				}
			}
			return nil
		})
		r := c.ok(t, n3, "config", "status")
		for _, n := range c.nodes {
			if !strings.Contains(r.stdout, n.name) || strings.Contains(r.stdout, "not applied") || !strings.Contains(r.stdout, "logging.level") {
				t.Errorf("%s\nwant %s with logging.level applied", r, n.name)
			}
		}
		c.ok(t, n3, "config", "delete", "logging.level")
	})

	step("bad input is a usage error", func(t *testing.T) {
		r := c.pvcli(t, n1, "service", "register", "web", "--address", "x", "--port", "70000")
		if r.code != 2 {
			t.Errorf("%s\nwant exit status 2", r)
		}
		if !strings.Contains(r.stderr, "--port") {
			t.Errorf("%s\nwant stderr to name --port", r)
		}
	})

	var clockID string
	var clockCreated time.Time
	step("a schedule every second", func(t *testing.T) { clockID, clockCreated = c.startClockSchedule(t, n1) })

	var victim *node
	step("leader killed", func(t *testing.T) {
		var old leaderOut
		c.eventually(t, 10*time.Second, "an agreed leader", func() (err error) {
			old, err = c.agreedLeader(t, c.nodes...)
			return err
		})
		victim = c.byAPI(t, old.APIAddr)
		if victim.name != old.Name {
			t.Errorf("leader %q has the API address of %s", old.Name, victim.name)
		}
		survivors := c.others(victim)
		c.kill(t, victim)
		t.Logf("SIGKILLed the leader %s (term %d)", victim.name, old.Term)

		// pvcli retries Unavailable (no leader yet) within --timeout.
		var reg registerOut
		c.okJSON(t, survivors[0], &reg, "--timeout", "30s", "service", "register", "web",
			"--address", "10.0.0.6", "--port", "8080", "--id", "web-2")
		if reg.Instance.InstanceID != "web-2" || reg.Instance.Address != "10.0.0.6" {
			t.Errorf("register web-2 via %s returned %+v", survivors[0].name, reg.Instance)
		}

		c.eventually(t, 30*time.Second, "a new leader among the survivors", func() error {
			l, err := c.agreedLeader(t, survivors...)
			if err != nil {
				return err
			}
			if l.NodeID == old.NodeID {
				return fmt.Errorf("the survivors still name the killed %s", old.Name)
			}
			if l.Term <= old.Term {
				return fmt.Errorf("new leader %s in term %d, want a term above %d", l.Name, l.Term, old.Term)
			}
			return nil
		})

		var list instancesOut
		c.okJSON(t, survivors[1], &list, "service", "list", "--consistency", "consistent")
		if got, want := sorted(list.ids()), []string{"web/web-1", "web/web-2"}; !slices.Equal(got, want) {
			t.Errorf("consistent list via %s = %v, want %v", survivors[1].name, got, want)
		}
	})

	step("killed node restarts and catches up", func(t *testing.T) {
		c.restart(t, victim)
		c.caughtUp(t, victim, "web/web-1", "web/web-2")
	})

	step("every slot of the schedule recorded once across the SIGKILL", func(t *testing.T) {
		c.scheduleContinuity(t, n1, clockID, clockCreated)
	})

	step("the README's quick start as written", func(t *testing.T) {
		if killed := c.quickStartExamples(t); killed != nil {
			c.restart(t, killed)
			c.caughtUp(t, killed, "web/web-1", "web/web-2")
		}
	})

	step("follower leaves", func(t *testing.T) {
		var l leaderOut
		c.eventually(t, 10*time.Second, "an agreed leader", func() (err error) {
			l, err = c.agreedLeader(t, c.nodes...)
			return err
		})
		leaver := c.others(c.byAPI(t, l.APIAddr))[0]
		rest := c.others(leaver)
		p := leaver.proc

		c.ok(t, leaver, "cluster", "leave")
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			t.Fatalf("%s still running 30s after cluster leave", leaver.name)
		}
		leaver.proc = nil
		if code := p.cmd.ProcessState.ExitCode(); code != 0 {
			t.Errorf("%s after cluster leave: %s, want exit status 0", leaver.name, p.state())
		}

		c.eventually(t, 20*time.Second, "2 voters without "+leaver.name, func() error {
			for _, n := range rest {
				var p peersOut
				if err := c.tryJSON(t, n, &p, "--timeout", "2s", "cluster", "peers"); err != nil {
					return err
				}
				if got, want := sorted(p.voters()), names(rest); !slices.Equal(got, want) {
					return fmt.Errorf("via %s: voters %v, want %v", n.name, got, want)
				}
				var m membersOut
				if err := c.tryJSON(t, n, &m, "--timeout", "2s", "cluster", "members"); err != nil {
					return err
				}
				if got, want := aliveMembers(m), names(rest); !slices.Equal(got, want) {
					return fmt.Errorf("via %s: alive members %v, want %v", n.name, got, want)
				}
			}
			return nil
		})

		// The two remaining voters are a quorum: writes still commit.
		c.ok(t, rest[0], "service", "deregister", "web", "web-1")
		var list instancesOut
		c.okJSON(t, rest[1], &list, "service", "list", "--consistency", "consistent")
		if got, want := list.ids(), []string{"web/web-2"}; !slices.Equal(got, want) {
			t.Errorf("consistent list via %s after deregistering web-1 = %v, want %v", rest[1].name, got, want)
		}
	})

	step("SIGTERM stops the rest cleanly", func(t *testing.T) {
		for _, n := range c.nodes {
			if n.proc != nil {
				c.stop(t, n)
			}
		}
	})
}

// caughtUp waits until n, restarted, is a voter again that trails by
// nothing, has the service instances ids ("service/instance") in its own
// state and agrees with the others on the leader.
func (c *cluster) caughtUp(t *testing.T, n *node, ids ...string) {
	t.Helper()
	c.eventually(t, 30*time.Second, n.name+" back as a voter with the replicated state", func() error {
		var p peersOut
		if err := c.tryJSON(t, n, &p, "--timeout", "2s", "cluster", "peers"); err != nil {
			return err
		}
		if got, want := sorted(p.voters()), names(c.nodes); !slices.Equal(got, want) {
			return fmt.Errorf("via %s: voters %v, want %v", n.name, got, want)
		}
		for _, peer := range p.Peers {
			if peer.Name == n.name && peer.Trailing != 0 {
				return fmt.Errorf("via %s: %s trails by %d entries", n.name, n.name, peer.Trailing)
			}
		}
		var list instancesOut
		if err := c.tryJSON(t, n, &list, "--timeout", "2s", "service", "list",
			"--consistency", "stale"); err != nil {
			return err
		}
		if got, want := sorted(list.ids()), sorted(ids); !slices.Equal(got, want) {
			return fmt.Errorf("stale list via %s = %v, want %v", n.name, got, want)
		}
		_, err := c.agreedLeader(t, c.nodes...)
		return err
	})
}

func names(nodes []*node) []string {
	var out []string
	for _, n := range nodes {
		out = append(out, n.name)
	}
	return sorted(out)
}

func aliveMembers(m membersOut) []string {
	var out []string
	for _, mem := range m.Members {
		if mem.Status == "MEMBER_STATUS_ALIVE" {
			out = append(out, mem.Name)
		}
	}
	return sorted(out)
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}
