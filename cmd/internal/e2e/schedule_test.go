package e2e_test

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// scheduleExamples runs docs/schedules.md's pvcli schedule commands through node
// n: a reboot every second is run by the leader on the VM's node (each
// agent here has a pivirtd-sim of its own) and its runs recorded, ok, with
// that node; bad input is refused naming the field; next, pause and
// delete.
func (c *cluster) scheduleExamples(t *testing.T, n *node) {
	var created struct {
		VM vmOut `json:"vm"`
	}
	c.okJSON(t, n, &created, "vm", "create", "scheduled-1", "--vcpus", "1", "--memory-mib", "512")
	c.ok(t, n, "vm", "start", created.VM.ID)
	if r := c.pvcli(t, n, "schedule", "create", "--vm", created.VM.ID, "--action", "reboot", "--cron", "61 * * * *"); r.code != 1 || !strings.Contains(r.stderr, "schedule.cron") {
		t.Errorf("schedule create with a bad cron: %s", r)
	}
	if r := c.pvcli(t, n, "schedule", "create", "--vm", created.VM.ID, "--action", "hibernate", "--cron", "@daily"); r.code != 2 {
		t.Errorf("schedule create with a bad action: %s", r)
	}
	var sched struct {
		Schedule struct {
			ID string `json:"id"`
		} `json:"schedule"`
	}
	c.okJSON(t, n, &sched, "schedule", "create", "--vm", created.VM.ID, "--action", "reboot", "--cron", "@every 1s", "--time-zone", "Europe/Budapest")
	id := sched.Schedule.ID
	deadline := time.Now().Add(30 * time.Second)
	for {
		var runs struct {
			Runs []struct {
				Outcome string `json:"outcome"`
				Node    string `json:"node"`
				Host    string `json:"host"`
				Error   string `json:"error"`
			} `json:"runs"`
		}
		c.okJSON(t, n, &runs, "schedule", "runs", id)
		if len(runs.Runs) > 0 {
			last := runs.Runs[len(runs.Runs)-1]
			if last.Outcome == "RUN_OUTCOME_ERROR" {
				t.Fatalf("a run of %s failed: %s", id, last.Error)
			}
			if last.Outcome == "RUN_OUTCOME_OK" {
				if last.Host != n.name {
					t.Errorf("run of %s recorded host %q, want %s (the VM's node)", id, last.Host, n.name)
				}
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no run of %s within 30 s: %+v", id, runs.Runs)
		}
		time.Sleep(200 * time.Millisecond) // poll, bounded by the deadline
	}
	next := c.ok(t, n, "schedule", "next", id, "--count", "3")
	if lines := strings.Split(strings.TrimSpace(next.stdout), "\n"); len(lines) != 4 || !strings.Contains(next.stdout, "CE") {
		t.Errorf("schedule next printed %q, want a header and 3 slots in Budapest time", next.stdout)
	}
	c.ok(t, n, "schedule", "pause", id)
	list := c.ok(t, n, "schedule", "list", "--vm", created.VM.ID)
	if !strings.Contains(list.stdout, id) || !strings.Contains(list.stdout, "false") {
		t.Errorf("schedule list after pause: %q", list.stdout)
	}
	c.ok(t, n, "schedule", "delete", id)
	if r := c.pvcli(t, n, "schedule", "get", id); r.code != 1 || !strings.Contains(r.stderr, fmt.Sprintf("schedule %q", id)) {
		t.Errorf("schedule get after delete: %s", r)
	}
}

// runsOut is pvcli schedule runs -o json.
type runsOut struct {
	Runs []struct {
		Slot    time.Time `json:"slot"`
		Outcome string    `json:"outcome"`
		Error   string    `json:"error"`
	} `json:"runs"`
}

// startClockSchedule creates a schedule every second (catch-up all)
// through n, whose runs scheduleContinuity checks later.
func (c *cluster) startClockSchedule(t *testing.T, n *node) (id string, created time.Time) {
	var vm struct {
		VM vmOut `json:"vm"`
	}
	c.okJSON(t, n, &vm, "vm", "create", "clock-1", "--vcpus", "1", "--memory-mib", "256")
	var s struct {
		Schedule struct {
			ID        string    `json:"id"`
			UpdatedAt time.Time `json:"updatedAt"`
		} `json:"schedule"`
	}
	c.okJSON(t, n, &s, "schedule", "create", "--vm", vm.VM.ID, "--action", "power-on", "--cron", "@every 1s",
		"--catch-up", "all", "--history-limit", "1000")
	return s.Schedule.ID, s.Schedule.UpdatedAt
}

// scheduleContinuity pauses the schedule and checks its runs: every
// second from its creation to its last slot recorded exactly once (run or
// skipped), none left started.
func (c *cluster) scheduleContinuity(t *testing.T, n *node, id string, created time.Time) {
	var runs runsOut
	c.eventually(t, 30*time.Second, "runs of "+id+" after the restart", func() error {
		if err := c.tryJSON(t, n, &runs, "schedule", "runs", id); err != nil {
			return err
		}
		if len(runs.Runs) < 8 {
			return fmt.Errorf("%d runs", len(runs.Runs))
		}
		return nil
	})
	c.ok(t, n, "--timeout", "30s", "schedule", "pause", id)
	c.eventually(t, 30*time.Second, "no run of "+id+" in flight", func() error {
		if err := c.tryJSON(t, n, &runs, "schedule", "runs", id); err != nil {
			return err
		}
		for _, r := range runs.Runs {
			if r.Outcome == "RUN_OUTCOME_STARTED" {
				return fmt.Errorf("slot %s still started", r.Slot)
			}
		}
		return nil
	})
	// Newest first.
	want := created.Truncate(time.Second).Add(time.Second)
	outcomes := map[string]int{}
	for i := len(runs.Runs) - 1; i >= 0; i-- {
		r := runs.Runs[i]
		if !r.Slot.Equal(want) {
			t.Fatalf("slot %s where %s was due: a slot is missing or doubled", r.Slot, want)
		}
		outcomes[r.Outcome]++
		want = want.Add(time.Second)
	}
	t.Logf("schedule %s: %d consecutive slots recorded once each across the SIGKILL: %v", id, len(runs.Runs), outcomes)
	c.ok(t, n, "schedule", "delete", id)
}
