package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/kb"
)

// The console's actions (create, power, edit, delete) as TestWebUI's
// subtests run them: each through the browser, its outcome checked with
// pvcli.

// vmState is what the action tests read of a VM through pvcli.
type vmState struct {
	ID         string `json:"id"`
	Name       string `json:"name"`
	PowerState string `json:"powerState"`
	Host       string `json:"host"`
	Vcpus      int    `json:"vcpus"`
	MemoryMiB  string `json:"memoryMib"`
	Metadata   struct {
		Owner string `json:"owner"`
	} `json:"metadata"`
}

// act clicks an action's button on an object's page, confirms it in the
// dialog and waits for its outcome.
func (b *tab) act(label string) {
	b.t.Helper()
	b.run("click "+label, 20*time.Second,
		chromedp.Click(fmt.Sprintf(`//div[@role='group']//button[normalize-space()=%q and not(@disabled)]`, label)),
		chromedp.WaitVisible(`dialog[open]`),
		chromedp.Click(fmt.Sprintf(`//dialog[@open]//button[normalize-space()=%q]`, label)),
	)
	b.waitOutcome(label + " ")
}

// waitOutcome waits until the page's outcome line starts with prefix.
func (b *tab) waitOutcome(prefix string) {
	b.t.Helper()
	q, _ := json.Marshal(prefix)
	b.waitJS("outcome "+prefix, 30*time.Second, fmt.Sprintf(`[...document.querySelectorAll('[data-testid=outcome]')].some((e) => e.textContent.startsWith(%s))`, q))
}

// buttons are the enabled and disabled buttons' labels on the page,
// outside dialogs.
func (b *tab) buttons() []string {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	got, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll('main button')].filter((e) => !e.closest('dialog')).map((e) => e.textContent.trim())`))
	if err != nil {
		b.fail("read the buttons", err)
	}
	return got
}

// js runs a JavaScript statement in the page.
func js(expr string) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		_, err := chromedp.Evaluate[bool]("("+expr+", true)")(ctx, t)
		return err
	})
}

// vmByName is the VM of that name as pvcli lists it through n, nil if none.
func (c *cluster) vmByName(t *testing.T, n *node, name string) *vmState {
	t.Helper()
	var list struct {
		VMs []vmState `json:"vms"`
	}
	c.okJSON(t, n, &list, "vm", "list")
	for _, v := range list.VMs {
		if v.Name == name {
			return &v
		}
	}
	return nil
}

// vmActionsAsAdmin creates a VM with the keyboard alone, then runs every
// action on it, each checked through pvcli on another node.
func vmActionsAsAdmin(t *testing.T, admin *tab, c *cluster) {
	n2 := c.nodes[1]
	admin.open("VMs")
	admin.waitText("alice-node1", 20*time.Second)
	// Keyboard only: Enter on the create button opens the form with the
	// focus on its first field; Tab goes through the fields; Enter sends.
	admin.run("open the form", 10*time.Second, chromedp.Focus(`//main//button[normalize-space()='Create a VM']`), chromedp.KeyEvent("\r"))
	admin.waitJS("the name field has the focus", 10*time.Second, `document.activeElement?.name === 'name' && !!document.activeElement.closest('dialog[open]')`)
	// Escape cancels, and the focus is back on the button.
	admin.run("escape", 10*time.Second, chromedp.KeyEvent(kb.Escape))
	admin.waitJS("the form closed", 10*time.Second, `!document.querySelector('dialog[open]') && document.activeElement?.textContent === 'Create a VM'`)
	admin.run("open the form again", 10*time.Second, chromedp.KeyEvent("\r"))
	admin.waitJS("the name field has the focus", 10*time.Second, `document.activeElement?.name === 'name' && !!document.activeElement.closest('dialog[open]')`)
	admin.waitJS("the hosts are offered", 10*time.Second, `!!document.querySelector('dialog[open] select[name=host]')`)
	admin.run("fill the form", 10*time.Second,
		chromedp.KeyEvent("ui-made"), chromedp.KeyEvent("\t"),
		chromedp.KeyEvent(kb.ArrowDown), chromedp.KeyEvent(kb.ArrowDown), chromedp.KeyEvent("\t"), // the second node
		chromedp.KeyEvent("2"), chromedp.KeyEvent("\t"), // Tab selects a field's text
		chromedp.KeyEvent("512"), chromedp.KeyEvent("\t"),
		chromedp.KeyEvent("carol"),
	)
	admin.waitJS("the form's values", 5*time.Second, `(() => { const v = (n) => document.querySelector('dialog[open] [name='+n+']').value; return v('name') === 'ui-made' && v('host') === 'node2' && v('vcpus') === '2' && v('memory') === '512' && v('owner') === 'carol'; })()`)
	admin.shot("vm-create")
	admin.accessible("vm-create")
	admin.run("send", 10*time.Second, chromedp.KeyEvent("\r"))
	admin.waitOutcome("Created VM ui-made")
	admin.waitJS("the dialog closed", 10*time.Second, `!document.querySelector('dialog[open]')`)
	vm := c.vmByName(t, n2, "ui-made")
	if vm == nil || vm.Host != "node2" || vm.Vcpus != 2 || vm.MemoryMiB != "512" || vm.Metadata.Owner != "carol" || vm.PowerState != "POWER_STATE_STOPPED" {
		t.Fatalf("after the create form, pvcli sees %+v, want ui-made on node2, 2 vCPUs, 512 MiB, owner carol, stopped", vm)
	}

	admin.open("ui-made")
	admin.waitJS("the VM's page", 20*time.Second, `(document.querySelector('[data-testid=power]')?.textContent ?? '') === 'stopped'`)
	admin.accessible("vm-actions")
	power := func(action, want string) {
		t.Helper()
		admin.act(action)
		var got struct {
			VM vmState `json:"vm"`
		}
		c.okJSON(t, n2, &got, "vm", "get", vm.ID)
		if got.VM.PowerState != want {
			t.Fatalf("after %s in the UI, pvcli sees %s, want %s", action, got.VM.PowerState, want)
		}
	}
	power("Start", "POWER_STATE_RUNNING")
	power("Reboot", "POWER_STATE_RUNNING")
	power("Stop", "POWER_STATE_STOPPED")
	power("Start", "POWER_STATE_RUNNING")
	power("Power off", "POWER_STATE_STOPPED")

	// Edit: the form starts from the VM's values.
	admin.run("edit", 10*time.Second, chromedp.Click(`//div[@role='group']//button[normalize-space()='Edit']`), chromedp.WaitVisible(`dialog[open] input[name=vcpus]`))
	admin.waitJS("the VM's values", 5*time.Second, `document.querySelector('dialog[open] input[name=vcpus]').value === '2'`)
	admin.run("change vCPUs", 10*time.Second,
		js(`document.querySelector('dialog[open] input[name=vcpus]').select()`),
		chromedp.SendKeys(`dialog[open] input[name=vcpus]`, "3"),
		chromedp.Click(`//dialog[@open]//button[normalize-space()='Save']`),
	)
	admin.waitOutcome("Edit VM ui-made: saved (vcpus)")
	if got := c.vmByName(t, n2, "ui-made"); got == nil || got.Vcpus != 3 {
		t.Fatalf("after Edit in the UI, pvcli sees %+v, want 3 vCPUs", got)
	}

	admin.act("Delete")
	admin.waitText("No VM "+vm.ID, 20*time.Second)
	if r := c.pvcli(t, n2, "vm", "get", vm.ID); r.code == 0 {
		t.Fatalf("after Delete in the UI, pvcli still gets the VM:\n%s", r)
	}
}

// volumesAndNetworks creates and deletes a volume and a network.
func volumesAndNetworks(t *testing.T, admin *tab, c *cluster) {
	n1 := c.nodes[0]
	for _, k := range []struct {
		link, button, singular, title, name string
		fields                              map[string]string
		list                                []string
	}{
		{"Volumes", "Create a volume", "volume", "Volume", "ui-disk", map[string]string{"size": "8"}, []string{"volume", "list"}},
		{"Networks", "Create a network", "network", "Network", "ui-net", map[string]string{"cidr": "10.77.0.0/24", "vlan": "77"}, []string{"network", "list"}},
	} {
		admin.open(k.link)
		admin.run("open the form", 10*time.Second, chromedp.Click(fmt.Sprintf(`//main//button[normalize-space()=%q]`, k.button)), chromedp.WaitVisible(`dialog[open] input[name=name]`))
		admin.waitJS("the hosts are offered", 10*time.Second, `!!document.querySelector('dialog[open] select[name=host]')`)
		fill := []chromedp.Action[chromedp.Void]{chromedp.SendKeys(`dialog[open] input[name=name]`, k.name), chromedp.SetValue(`dialog[open] select[name=host]`, "node3")}
		for f, v := range k.fields {
			sel := fmt.Sprintf(`dialog[open] input[name=%s]`, f)
			fill = append(fill, js(fmt.Sprintf(`document.querySelector(%q).select()`, sel)), chromedp.SendKeys(sel, v))
		}
		admin.run("fill the form", 10*time.Second, fill...)
		// SetValue fires no event: tell the form, as a choice would.
		admin.run("choose the host", 5*time.Second, js(`document.querySelector('dialog[open] select[name=host]').dispatchEvent(new Event('change', {bubbles: true}))`))
		admin.accessible(k.singular + "-create")
		admin.run("send", 10*time.Second, chromedp.Click(`//dialog[@open]//button[normalize-space()='Create']`))
		admin.waitOutcome("Created " + k.singular + " " + k.name)
		type obj struct{ ID, Name, Host string }
		var list struct{ Volumes, Networks []obj }
		c.okJSON(t, n1, &list, k.list...)
		var id string
		for _, items := range [][]obj{list.Volumes, list.Networks} {
			for _, o := range items {
				if o.Name == k.name {
					if o.Host != "node3" {
						t.Errorf("%s %s is on %q, want node3", k.singular, k.name, o.Host)
					}
					id = o.ID
				}
			}
		}
		if id == "" {
			t.Fatalf("pvcli %s has no %s after the create form: %+v", strings.Join(k.list, " "), k.name, list)
		}
		admin.open(k.name)
		admin.act("Delete")
		admin.waitText("No "+k.title+" "+id, 20*time.Second)
		list.Volumes, list.Networks = nil, nil
		c.okJSON(t, n1, &list, k.list...)
		for _, items := range [][]obj{list.Volumes, list.Networks} {
			for _, o := range items {
				if o.ID == id {
					t.Fatalf("after Delete in the UI, pvcli still lists %s %s", k.singular, id)
				}
			}
		}
	}
}

// rolesWithoutActions: a viewer is offered no action; an operator may
// create and edit but not start or delete; a create the policy stopped
// allowing after the login is refused in pvcli's words.
func rolesWithoutActions(t *testing.T, e *uiEnv, c *cluster, vmID string) {
	n1, n2 := c.nodes[0], c.nodes[1]
	start := time.Now()
	viewer := e.newTab(t)
	viewer.login(n1, "vera", "viewer")
	t.Logf("a new tab logged in in %s", time.Since(start).Round(100*time.Millisecond))
	viewer.open("VMs")
	viewer.waitText("alice-node1", 20*time.Second)
	if got := viewer.buttons(); len(got) != 0 {
		t.Errorf("a viewer is offered %q on the VMs' list", got)
	}
	viewer.open("alice-node1")
	viewer.waitText("Your roles may not change this VM.", 20*time.Second)
	if got := viewer.buttons(); len(got) != 0 {
		t.Errorf("a viewer is offered %q on a VM's page", got)
	}

	operator := e.newTab(t)
	operator.login(n2, "oscar", "operator")
	operator.waitJS("open the VM by URL", 10*time.Second, fmt.Sprintf(`(history.pushState(null, '', '/ui/vms/%s'), dispatchEvent(new Event('pivirt:navigate')), true)`, vmID))
	operator.waitJS("the VM's page", 20*time.Second, `!!document.querySelector('[data-testid=power]')`)
	if got := strings.Join(operator.buttons(), ","); got != "Edit" {
		t.Errorf("an operator is offered %q on a VM's page, want only Edit", got)
	}
	noConsoleButton(t, operator, "alice-node3")
	operator.open("VMs")
	operator.waitText("Create a VM", 20*time.Second)

	// The policy changes after the login: operators may no longer create
	// VMs. The form is still offered (the console asked at login); the
	// agent refuses, and the console says so as pvcli does.
	policy := filepath.Join(t.TempDir(), "rbac.yaml")
	if err := os.WriteFile(policy, []byte(strings.Replace(referencePolicy(t), `verbs: ["get", "list", "create", "update", "patch"]`, `verbs: ["get", "list", "update", "patch"]`, 1)), 0o600); err != nil {
		t.Fatal(err)
	}
	c.ok(t, n1, "config", "set", "auth.rbac_policy", "-f", policy)
	start = time.Now()
	c.eventually(t, 20*time.Second, "operators may not create VMs on "+n2.name, func() error {
		if r := c.pvcli(t, n2, "rbac", "check", "--identity", "oscar", "--roles", "operator", "--method", "VMService/CreateVM"); r.code != 1 {
			return fmt.Errorf("%s", r)
		}
		return nil
	})
	t.Logf("the changed policy was in force on %s %s after it was set", n2.name, time.Since(start).Round(100*time.Millisecond))
	operator.run("open the form", 10*time.Second, chromedp.Click(`//main//button[normalize-space()='Create a VM']`), chromedp.WaitVisible(`dialog[open] input[name=name]`))
	operator.run("fill and send", 10*time.Second, chromedp.SendKeys(`dialog[open] input[name=name]`, "refused"), chromedp.Click(`//dialog[@open]//button[normalize-space()='Create']`))
	operator.waitText("The agent's RBAC policy does not allow this call for your identity", 20*time.Second)
	operator.shot("vm-create-denied")
	operator.accessible("vm-create-denied")
	if vm := c.vmByName(t, n1, "refused"); vm != nil {
		t.Fatalf("a refused create made %+v", vm)
	}
	// The file's policy again (no later step needs to wait for it).
	c.ok(t, n1, "config", "delete", "auth.rbac_policy")
}

// plainAgent starts one agent with its pivirtd-sim, TLS off and no auth
// configured (access control off), and answers its API address.
func plainAgent(t *testing.T, bins binaries) (*cluster, *node) {
	dir := t.TempDir()
	c := &cluster{bins: bins, dir: dir, certs: dir}
	t.Cleanup(c.stopAll)
	ports, err := freePorts(5)
	if err != nil {
		t.Fatal(err)
	}
	addr := func(i int) string { return fmt.Sprintf("127.0.0.1:%d", ports[i]) }
	n := &node{name: "plain1", dataDir: filepath.Join(dir, "data"), config: filepath.Join(dir, "agent.yaml"), log: filepath.Join(dir, "agent.log"),
		api: addr(0), intern: addr(1), metrics: addr(2), gossip: addr(3), raft: addr(4),
		simAddr: filepath.Join(dir, "sim.sock"), simLog: filepath.Join(dir, "sim.log")}
	cfg := fmt.Sprintf("tls:\n  enabled: false\nlogging:\n  format: text\nbackends:\n  pivirtd:\n    endpoint: unix://%[1]s\n  iscsiman:\n    endpoint: unix://%[1]s\n", n.simAddr)
	if err := os.WriteFile(n.config, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := c.startSim(n, dir); err != nil {
		t.Fatal(err)
	}
	p, err := c.spawn(n.log, bins.agent, []string{"--config", n.config, "--node-name", n.name, "--data-dir", n.dataDir,
		"--api-addr", n.api, "--internal-addr", n.intern, "--metrics-addr", n.metrics, "--gossip-addr", n.gossip, "--raft-addr", n.raft,
		"--bootstrap-expect", "1"})
	if err != nil {
		t.Fatal(err)
	}
	n.proc = p
	c.nodes = []*node{n}
	c.eventually(t, 30*time.Second, "the plain agent answers", func() error {
		if r := c.plainCLI(t, n, "vm", "list"); r.code != 0 {
			return fmt.Errorf("%s\n%s", r, tail(n.log, 10))
		}
		return nil
	})
	return c, n
}

// plainCLI runs pvcli against a plain agent, without credentials.
func (c *cluster) plainCLI(t *testing.T, n *node, args ...string) result {
	t.Helper()
	return c.pvcliEnv(t, nil, append([]string{"--endpoint", "http://" + n.api}, args...)...)
}

// plainConsole: the console of an agent without access control opens
// without a login, says that access control is off, and acts.
func plainConsole(t *testing.T, e *uiEnv) {
	c, n := plainAgent(t, e.c.bins)
	b := e.newTab(t)
	b.run("open the UI", 30*time.Second, chromedp.Navigate("http://"+n.api+"/"))
	b.waitText("Access control is off: anyone who reaches this port may act", 20*time.Second)
	if page := b.text(); strings.Contains(page, "Log in") || strings.Contains(page, "no authenticated caller") || strings.Contains(page, ".p12") {
		t.Errorf("the console of an agent without access control asks for a login:\n%s", page)
	}
	b.open("VMs")
	b.run("open the form", 10*time.Second, chromedp.Click(`//main//button[normalize-space()='Create a VM']`), chromedp.WaitVisible(`dialog[open] input[name=name]`))
	b.run("fill and send", 10*time.Second, chromedp.SendKeys(`dialog[open] input[name=name]`, "open-vm"), chromedp.Click(`//dialog[@open]//button[normalize-space()='Create']`))
	b.waitOutcome("Created VM open-vm")
	b.waitText("open-vm", 20*time.Second)
	b.shot("access-off")
	b.accessible("access-off")
	var list struct {
		VMs []vmState `json:"vms"`
	}
	r := c.plainCLI(t, n, "vm", "list", "-o", "json")
	if err := json.Unmarshal([]byte(r.stdout), &list); err != nil || len(list.VMs) != 1 || list.VMs[0].Name != "open-vm" {
		t.Fatalf("after the create in the console, %s", r)
	}
}

// scheduleOut is what the action tests read of a schedule through pvcli.
type scheduleOut struct {
	ID       string `json:"id"`
	VMID     string `json:"vmId"`
	Action   string `json:"action"`
	Cron     string `json:"cron"`
	TimeZone string `json:"timeZone"`
	Enabled  bool   `json:"enabled"`
}

// scheduleByID is the schedule as pvcli lists it through n, nil if none.
func (c *cluster) scheduleByID(t *testing.T, n *node, id string) *scheduleOut {
	t.Helper()
	var list struct {
		Schedules []scheduleOut `json:"schedules"`
	}
	c.okJSON(t, n, &list, "schedule", "list")
	for _, s := range list.Schedules {
		if s.ID == id {
			return &s
		}
	}
	return nil
}

// scheduleActions creates a schedule with the preview of its next runs,
// pauses, resumes, edits and deletes it, each checked through pvcli.
func scheduleActions(t *testing.T, admin *tab, c *cluster, vmID string) {
	n3 := c.nodes[2]
	admin.open("Schedules")
	admin.run("open the form", 10*time.Second, chromedp.Click(`//main//button[normalize-space()='Create a schedule']`), chromedp.WaitVisible(`dialog[open] input[name=vm]`))
	admin.run("fill the form", 10*time.Second,
		chromedp.SendKeys(`dialog[open] input[name=vm]`, vmID),
		chromedp.SendKeys(`dialog[open] input[name=id]`, "ui-sched"),
		chromedp.SendKeys(`dialog[open] input[name=cron]`, "0 7 * * 1-5"),
		chromedp.SendKeys(`dialog[open] input[name=zone]`, "Europe/Budapest"),
	)
	admin.waitJS("the preview of the next runs", 10*time.Second, `document.querySelectorAll('dialog[open] [data-testid=preview] li').length === 5 && [...document.querySelectorAll('dialog[open] [data-testid=preview] li')].every((li) => /7:00/.test(li.textContent))`)
	admin.shot("schedule-create")
	admin.accessible("schedule-create")
	admin.run("send", 10*time.Second, chromedp.Click(`//dialog[@open]//button[normalize-space()='Create']`))
	admin.waitOutcome("Created schedule ui-sched.")
	if s := c.scheduleByID(t, n3, "ui-sched"); s == nil || s.VMID != vmID || s.Cron != "0 7 * * 1-5" || s.TimeZone != "Europe/Budapest" || !s.Enabled || s.Action != "ACTION_POWER_ON" {
		t.Fatalf("after the create form, pvcli sees %+v", s)
	}

	admin.open("ui-sched")
	admin.waitText("Next slots", 20*time.Second)
	for _, step := range []struct {
		action  string
		enabled bool
	}{{"Pause", false}, {"Resume", true}} {
		admin.run(step.action, 10*time.Second, chromedp.Click(fmt.Sprintf(`//div[@role='group']//button[normalize-space()=%q]`, step.action)))
		admin.waitOutcome(step.action + " schedule ui-sched: done.")
		if s := c.scheduleByID(t, n3, "ui-sched"); s == nil || s.Enabled != step.enabled {
			t.Fatalf("after %s in the UI, pvcli sees %+v", step.action, s)
		}
	}
	admin.run("edit", 10*time.Second, chromedp.Click(`//div[@role='group']//button[normalize-space()='Edit']`), chromedp.WaitVisible(`dialog[open] input[name=cron]`))
	admin.run("change the expression", 10*time.Second,
		js(`document.querySelector('dialog[open] input[name=cron]').select()`),
		chromedp.SendKeys(`dialog[open] input[name=cron]`, "@daily"),
	)
	admin.waitJS("the preview follows", 10*time.Second, `[...document.querySelectorAll('dialog[open] [data-testid=preview] li')].every((li) => /12:00|0:00/.test(li.textContent))`)
	admin.run("save", 10*time.Second, chromedp.Click(`//dialog[@open]//button[normalize-space()='Save']`))
	admin.waitOutcome("Edit schedule ui-sched: saved (cron)")
	if s := c.scheduleByID(t, n3, "ui-sched"); s == nil || s.Cron != "@daily" {
		t.Fatalf("after Edit in the UI, pvcli sees %+v", s)
	}
	admin.act("Delete")
	if s := c.scheduleByID(t, n3, "ui-sched"); s != nil {
		t.Fatalf("after Delete in the UI, pvcli still lists %+v", s)
	}
}

// deregisterService deregisters the only instance of service web from its
// page, checked through pvcli.
func deregisterService(t *testing.T, admin *tab, c *cluster) {
	n1 := c.nodes[0]
	admin.open("Services")
	admin.open("web")
	admin.waitText("10.0.0.5:8080", 20*time.Second)
	admin.accessible("service")
	admin.act("Deregister")
	var list struct {
		Instances []struct {
			Service string `json:"service"`
		} `json:"instances"`
	}
	c.okJSON(t, n1, &list, "service", "list", "web")
	if len(list.Instances) != 0 {
		t.Fatalf("after Deregister in the UI, pvcli lists %+v", list.Instances)
	}
}

// settingValue is the value of a cluster setting as pvcli reads it.
func (c *cluster) settingValue(t *testing.T, n *node, key string) string {
	t.Helper()
	return strings.TrimSpace(c.ok(t, n, "config", "get", key).stdout)
}

// settingActions rolls logging.level back to its previous revision, then
// sets it again through the dry run's diff, each checked through pvcli.
func settingActions(t *testing.T, admin *tab, c *cluster) {
	n2 := c.nodes[1]
	admin.open("Settings")
	admin.open("logging.level")
	admin.waitText("Diff", 20*time.Second)
	if got := c.settingValue(t, n2, "logging.level"); got != "info" {
		t.Fatalf("logging.level is %q before the rollback, want info", got)
	}
	admin.run("roll back", 10*time.Second,
		chromedp.Click(`//div[@role='group']//button[starts-with(normalize-space(), 'Roll back to revision')]`),
		chromedp.WaitVisible(`dialog[open] pre.diff`),
	)
	admin.waitJS("the rollback's diff", 5*time.Second, `document.querySelector('dialog[open] pre.diff').textContent.includes('- info') && document.querySelector('dialog[open] pre.diff').textContent.includes('+ debug')`)
	admin.accessible("setting-rollback")
	admin.run("confirm", 10*time.Second, chromedp.Click(`//dialog[@open]//button[starts-with(normalize-space(), 'Roll back to revision')]`))
	admin.waitOutcome("Roll back to revision")
	if got := c.settingValue(t, n2, "logging.level"); got != "debug" {
		t.Fatalf("after the rollback in the UI, pvcli reads logging.level %q, want debug", got)
	}

	admin.run("set", 10*time.Second, chromedp.Click(`//div[@role='group']//button[normalize-space()='Set a new value']`), chromedp.WaitVisible(`dialog[open] textarea[name=value]`))
	admin.waitJS("the form has the value", 5*time.Second, `document.querySelector('dialog[open] textarea[name=value]').value.trim() === 'debug'`)
	admin.run("type and check", 10*time.Second,
		js(`document.querySelector('dialog[open] textarea[name=value]').select()`),
		chromedp.SendKeys(`dialog[open] textarea[name=value]`, "info"),
		chromedp.Click(`//dialog[@open]//button[normalize-space()='Check']`),
	)
	admin.waitJS("the dry run's diff", 20*time.Second, `(document.querySelector('dialog[open] [data-testid=dry-run]')?.textContent ?? '').includes('+ info')`)
	admin.shot("setting-set")
	admin.accessible("setting-set")
	if got := c.settingValue(t, n2, "logging.level"); got != "debug" {
		t.Fatalf("after the dry run, pvcli reads logging.level %q, want debug still", got)
	}
	admin.run("set", 10*time.Second, chromedp.Click(`//dialog[@open]//button[normalize-space()='Set']`))
	admin.waitOutcome("Set logging.level: revision")
	if got := c.settingValue(t, n2, "logging.level"); got != "info" {
		t.Fatalf("after Set in the UI, pvcli reads logging.level %q, want info", got)
	}
}

// saveAndRestore takes a snapshot to a download, then restores the archive
// whose plan is on the page (saved before kv/ui-after-save was set),
// checked through pvcli.
func saveAndRestore(t *testing.T, admin *tab, c *cluster) {
	n2 := c.nodes[1]
	admin.run("take a snapshot", 10*time.Second, chromedp.Click(`//button[normalize-space()='Take a snapshot']`))
	admin.waitJS("the download link", 30*time.Second, `(document.querySelector('a[download]')?.href ?? '').startsWith('blob:') && document.querySelector('a[download]').download.endsWith('.snap')`)
	admin.run("restore", 10*time.Second,
		chromedp.Click(`//button[normalize-space()='Restore this archive']`),
		chromedp.WaitVisible(`dialog[open]`),
		chromedp.Click(`//dialog[@open]//button[normalize-space()='Restore']`),
	)
	admin.waitText("Restored backup.tar.gz", 60*time.Second)
	c.eventually(t, 20*time.Second, "the restore takes back kv/ui-after-save", func() error {
		if r := c.pvcli(t, n2, "config", "get", "kv/ui-after-save"); r.code == 0 && strings.TrimSpace(r.stdout) != "" {
			return fmt.Errorf("pvcli still reads %q", strings.TrimSpace(r.stdout))
		}
		return nil
	})
}
