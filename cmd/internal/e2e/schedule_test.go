package e2e_test

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// scheduleExamples runs the README's pvcli schedule commands through node
// n: a reboot every second is run by the leader and its runs recorded;
// bad input is refused naming the field; next, pause and delete. (Each
// agent here has a pivirtd-sim of its own, and the leader acts through
// its backends: unless n leads, the VM is not found there and the runs
// record that error, which is still a run recorded once.)
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
			} `json:"runs"`
		}
		c.okJSON(t, n, &runs, "schedule", "runs", id)
		if len(runs.Runs) > 0 && (runs.Runs[len(runs.Runs)-1].Outcome == "RUN_OUTCOME_OK" || runs.Runs[len(runs.Runs)-1].Outcome == "RUN_OUTCOME_ERROR") {
			break
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
